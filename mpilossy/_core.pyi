# Type stubs for the compiled core (src_cython/_core.pyx).  The Python layer
# (mpilossy.communicator) validates every argument before it gets here.
from typing import Any, Dict, List, NamedTuple, Optional, Tuple

from mpi4py import MPI

VERSION: str
HAVE_LIBFABRIC: bool
HAVE_DATAGRAM_AUTH: bool
HAVE_ISAL: bool
MAC_KEY_BYTES: int
MAX_TREE_RADIX: int
PATIENCE: float

DTYPE_F16: int
DTYPE_F32: int
DTYPE_F64: int
DTYPE_I32: int
DTYPE_I64: int
DTYPE_BF16: int
SUM: int
AVG: int
RING: int
TREE: int
DIRECT: int
ALLREDUCE: int
REDUCE_SCATTER: int
ALLGATHER: int
PART_WHOLE: int
PART_SEGMENT: int
PART_LAST: int
PKT_DATA: int
PKT_HELLO: int
PKT_ERROR: int
PKT_NACK: int
PKT_END: int
ERRORS: Dict[str, int]

class CallResult(NamedTuple):
    """What one call returns to the Python layer."""
    err_kind: int
    err_rank: int
    err_msg: str
    delivered: float
    elapsed: float
    deadline_hit: bool
    fallback: float
    min_contributors: int
    seq: int
    lost_blocks: Tuple[int, int, int, int]
    timing: Tuple[float, float, float, float]   # start, anchor, end, seen
    agreed: float
    contributors: Optional[Tuple[bytes, int, int, int, int]]
    rebuilt: int
    read_blocks: int = 0
    weight_sum: float = -1.0

def library_version() -> str: ...
def datagram_providers() -> List[str]: ...
def kernel(name: str, dst: Any, a: Any, b: Any = ..., scale: float = ...) -> None: ...
def quant_kernel(name: str, dst: Any, src: Any, bits: int, group: int, seed: int = ...,
                 scale: float = ...) -> None: ...
def quant_bytes(n: int, group: int, bits: int) -> int: ...
def fec_check(k: int, m: int) -> Optional[str]: ...
def fec_kernel(name: str, blocks: Any, k: int, m: int, present: Any = ..., filled: int = ...) -> int: ...
def buffer_address(obj: Any) -> int: ...
def mac_seconds(payload: int, count: int) -> float: ...

class CallSpec:
    """One call, resolved (mpilossy/call/spec.py builds it)."""
    collective: int
    algorithm: int
    dtype: int
    op: int
    timeout: float
    budget: float
    weight: float
    qbits: int
    qgroup: int
    residual: Optional[Any]
    nbytes: int
    elements: int
    kind: Tuple[int, int, int]
    fec_k: int
    fec_m: int
    part: int
    tag: int
    def __init__(self, *, collective: int, algorithm: int, dtype: int, op: int, timeout: float,
                 budget: float, weight: float, qbits: int, qgroup: int, residual: Optional[Any],
                 nbytes: int, elements: int, kind: Tuple[int, int, int], fec_k: int = ...,
                 fec_m: int = ..., part: int = ..., tag: int = ...) -> None: ...
    @property
    def redundancy(self) -> Optional[Tuple[int, int]]: ...

class Core:
    def __init__(self, comm: MPI.Comm, config: Any, channel: str) -> None: ...
    @property
    def seq(self) -> int: ...
    @property
    def capacity(self) -> int: ...
    @property
    def shared_peers(self) -> int: ...
    @property
    def max_block(self) -> int: ...
    def channel_info(self) -> Dict[str, Any]: ...
    def datagram_key(self) -> bytes: ...
    def set_send_rate(self, rate: float, burst: float, local: Optional[bytes] = None) -> None: ...
    def set_offload(self, on: bool) -> bool: ...
    def configure_loss(self, spec: Dict[str, Any]) -> None: ...
    def close(self) -> None: ...
    def collective(self, sendbuf: Any, recvbuf: Any, spec: CallSpec) -> CallResult: ...
    def fail(self, kind: int, message: str, timeout: float) -> CallResult: ...
