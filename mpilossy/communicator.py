"""The lossy communicator: validation, lifetime, defaults and statistics
around the compiled core."""

from __future__ import annotations

import atexit
import itertools
import math
import numbers
import os
import weakref
from typing import Any, NamedTuple, Optional, Type, Union

import numpy as np
from mpi4py import MPI

from . import _buffers, _core, device as _device, loss as _loss, settings as _settings
from .contributors import Contributors
from .deadline import AutoDeadline, size_bucket
from .errors import LaggingError, MismatchError, MPILossyError

__all__ = ["Communicator", "CollectiveStats", "AllreduceStats", "allreduce",
           "reduce_scatter", "allgather", "default_communicator"]

OPS = {"sum": _core.SUM, "avg": _core.AVG}
ALGORITHMS = {"ring": _core.RING, "tree": _core.TREE, "direct": _core.DIRECT}
ALGORITHM_NAMES = {_core.RING: "ring", _core.TREE: "tree", _core.DIRECT: "direct"}
COLLECTIVE_NAMES = {_core.ALLREDUCE: "allreduce", _core.REDUCE_SCATTER: "reduce_scatter",
                    _core.ALLGATHER: "allgather"}
CHANNELS = ("rma", "ud", "auto")
# Datagram providers that mean real datagram hardware (where "auto" picks ud).
HARDWARE_DATAGRAMS = ("verbs", "efa")
SCALINGS = ("unbiased", "zero-fill")
COMPRESSIONS = {"int8": 8, "int4": 4}      # bits per value on the wire

DEFAULT_CAPACITY = 4 * 1024 * 1024
# Largest message for which algorithm="auto" picks the tree, by rank count,
# measured with `mpiexec -n N python -m mpilossy.bench crossover` on the
# development machine (docs/performance.md).  Larger jobs could not be
# measured there: they use TREE_MAX_BYTES_LARGE until calibrated
# (MPILOSSY_TREE_MAX_BYTES overrides the table).
TREE_MAX_BYTES = {1: 0, 2: 1024, 3: 2 * 1024, 4: 16 * 1024}
TREE_MAX_BYTES_LARGE = 32 * 1024
# algorithm="auto" above the tree's sizes, for calls without a deadline: the
# ring (True) or direct (False), whichever was faster without loss
# (docs/performance.md).  Calls with a deadline take direct.
RING_WITHOUT_DEADLINE = True

_EXCEPTIONS = {
    _core.ERRORS["type"]: TypeError,
    _core.ERRORS["value"]: ValueError,
    _core.ERRORS["buffer"]: BufferError,
    _core.ERRORS["mismatch"]: MismatchError,
    _core.ERRORS["protocol"]: MPILossyError,
    _core.ERRORS["mpi"]: MPILossyError,
}
_KINDS = {TypeError: "type", ValueError: "value", BufferError: "buffer"}
_serials = itertools.count()


class CollectiveStats(NamedTuple):
    """What one call delivered, as this rank saw it.  (A named tuple: one is
    built per call, and a frozen dataclass costs microseconds to build.)"""

    delivered: float
    """Fraction of all contributions (ranks x elements) in this rank's result, 0..1."""
    elapsed: float
    """Seconds spent in the call on this rank."""
    deadline_hit: bool
    """True if this rank gave up waiting for something."""
    fallback: float
    """Fraction of elements for which the reduced value did not arrive and this
    rank used its own partial sum instead (its deviation from the other ranks)."""
    min_contributors: int
    """Fewest contributions in any block of this rank's result."""
    algorithm: str
    nbytes: int
    seq: int
    """Call number on this communicator (1 for the first call)."""
    lost_blocks: tuple = (0, 0, 0, 0)
    """Blocks this rank did not receive, by cause: (injected, late, gone,
    torn).  'late' missed its deadline; 'gone': its producer had finished
    sending (moved past the call, or marked the stream complete: early
    close) and it never came; 'torn' changed while being read."""
    collective: str = "allreduce"
    timeout: Optional[float] = None
    """The deadline this call had (with timeout="auto": the learned one)."""
    agreed: float = 1.0
    """Fraction of all contributions in the blocks whose reduced value
    arrived (fallbacks left out): what the reduction itself kept."""
    contributors: Optional[Contributors] = None
    """algorithm="direct" and the all-gather: which ranks' data is in each
    block of the result (all-gather: the owner's for a block that arrived,
    none for one that kept its previous contents)."""

    def contributed(self, rank: Optional[int] = None) -> float:
        """Fraction of this rank's result that holds `rank`'s data (default:
        this rank's own).  Only algorithm="direct" and the all-gather record
        who contributed."""
        if self.contributors is None:
            raise ValueError(f"the {self.algorithm} {self.collective} does not record who "
                             f"contributed; use algorithm='direct'")
        return self.contributors.fraction(rank)


AllreduceStats = CollectiveStats

class _Unset:
    def __repr__(self) -> str:
        return "<from environment>"


_UNSET: Any = _Unset()


AUTO = -2.0     # _check_timeout's answer for timeout="auto"


def _check_compression(compression: Any) -> None:
    if compression is not None and compression not in COMPRESSIONS:
        raise ValueError(f"compression must be None, 'int8' or 'int4', got {compression!r}")


def _check_residual(residual: Any, send: np.ndarray, recv: np.ndarray) -> Optional[np.ndarray]:
    """The error-feedback buffer of a call, validated (None: none)."""
    if residual is None:
        return None
    if not isinstance(residual, np.ndarray):
        raise TypeError(f"residual must be a NumPy array, got {type(residual).__name__}")
    if residual.dtype != np.float32 or send.dtype != np.float32:
        raise TypeError(f"residual needs float32 data and a float32 residual, got "
                        f"{send.dtype} and {residual.dtype}")
    if residual.size != send.size:
        raise ValueError(f"residual has {residual.size} elements, sendbuf {send.size}")
    if not residual.flags.c_contiguous or not residual.flags.writeable:
        raise ValueError("residual must be C-contiguous and writable")
    if np.may_share_memory(residual, send) or np.may_share_memory(residual, recv):
        raise ValueError("residual overlaps sendbuf or recvbuf")
    return residual.reshape(-1)

def _check_timeout(timeout: Any) -> float:
    """The core's timeout: seconds, -1 for none, AUTO for "auto".  Raises for
    bad values."""
    if timeout is None:
        return -1.0
    if isinstance(timeout, str) and timeout == "auto":
        return AUTO
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)):
        raise TypeError(f"timeout must be a number of seconds, 'auto' or None, not {timeout!r}")
    if math.isinf(timeout) and timeout > 0:
        return -1.0
    if not math.isfinite(timeout) or timeout <= 0:
        raise ValueError(f"timeout must be a positive number of seconds or None, got {timeout!r}")
    return float(timeout)


def _models(loss: Any) -> list:
    if loss is None:
        return []
    if isinstance(loss, str):
        return _loss.parse(loss)
    if isinstance(loss, (list, tuple)):
        return list(loss)
    return [loss]


class Communicator:
    """Lossy collectives over a private duplicate of `comm`.

    Parameters
    ----------
    comm:
        The MPI communicator whose ranks take part (default COMM_WORLD).  It is
        duplicated: mpilossy's traffic never mixes with the caller's.
    channel:
        "rma" (MPI one-sided windows), "ud" (unreliable datagrams through
        libfabric: verbs UD on InfiniBand/RoCE, efa, udp elsewhere; honours
        FI_PROVIDER, MPILOSSY_UD_DOMAIN, MPILOSSY_UD_MTU) or "auto" (ud where
        libfabric offers datagram hardware or FI_PROVIDER names a provider,
        rma otherwise).
    timeout:
        Deadline of every call in seconds; "auto" for a deadline learned from
        earlier calls and agreed by all ranks (mpilossy/deadline.py:
        4x the recent 95th percentile of complete calls, between
        MPILOSSY_AUTO_FLOOR=1 ms and MPILOSSY_AUTO_CAP=1 s); or None to wait
        for everything (the result is then exact).  Default: $MPILOSSY_TIMEOUT,
        else None.
    loss:
        Injected loss: a model of mpilossy.loss, a list of them, or a string
        in MPILOSSY_LOSS syntax.  Default: $MPILOSSY_LOSS, else none.
    algorithm:
        Default algorithm of allreduce: "ring", "tree", "direct" or "auto"
        (the tree for small messages, direct above: docs/performance.md).
    block_bytes:
        Pipelining and loss unit (default 256 KiB, $MPILOSSY_BLOCK_BYTES).
    capacity:
        Bytes of records per call to allocate now (default 4 MiB: a ring of
        up to about 4 MiB, a tree of up to 2 MiB).  Larger calls grow the
        windows, and that first larger call waits for every rank: growing is
        collective, so it is the one point not bound by the deadline.
    tree_radix:
        Fan-out of the k-nomial tree, 2..64 (2 = binomial; default 4).
    scaling, rotate:
        scaling="zero-fill" counts missing contributions as zeros instead of
        dividing by what arrived (sum / size): the plain average that error
        feedback needs (mpilossy.torch; the lost part is re-sent, not
        rescaled).  rotate=False keeps every chain start, tree root and
        direct reducer in place; the sharded training mode uses it so that
        each shard's owner is its reducer (one hop).  Each biases a single
        call over arbitrary inputs (docs/unbiasedness.md, docs/training.md).
    compression, compression_group:
        None, "int8" or "int4": float32 reductions on the direct algorithm
        travel quantised, `compression_group` values (default 64, even) per
        float32 scale, rounded stochastically (unbiased); reducers sum in
        float32 and quantise the reduced values once more for the gather.
        A per-call ``compression=`` overrides it (None: off for that call).

    Construction and free() are collective over `comm`.
    """

    def __init__(self, comm: Optional[MPI.Comm] = None, *, channel: str = "rma",
                 timeout: Union[float, str, None] = _UNSET, loss: Any = _UNSET,
                 algorithm: str = "auto", block_bytes: Optional[int] = None,
                 capacity: int = DEFAULT_CAPACITY, tree_radix: Optional[int] = None,
                 scaling: str = "unbiased", rotate: bool = True,
                 compression: Optional[str] = None, compression_group: int = 64) -> None:
        if comm is None:
            comm = MPI.COMM_WORLD
        if not isinstance(comm, MPI.Intracomm) or comm == MPI.COMM_NULL:
            raise TypeError("comm must be an mpi4py intracommunicator")
        self._core: Optional[_core.Core] = None
        self._serial = next(_serials)
        self._comm = comm.Dup()
        error: Optional[BaseException] = None
        settings: tuple = ()
        env: Optional[_settings.Settings] = None
        try:
            env = _settings.from_environment()
            self._timeout = _check_timeout(env.timeout if timeout is _UNSET else timeout)
            self._loss_models = _models(env.loss if loss is _UNSET else loss)
            loss_spec = _loss.to_spec(self._loss_models)
            if channel not in CHANNELS:
                raise ValueError(f"channel must be one of {CHANNELS}, got {channel!r}")
            self._algorithm = self._check_algorithm(algorithm)
            block = env.block_bytes if block_bytes is None else block_bytes
            radix = env.tree_radix if tree_radix is None else tree_radix
            if isinstance(block, bool) or not isinstance(block, int) or block < 64:
                raise ValueError(f"block_bytes must be an int >= 64, got {block!r}")
            if (isinstance(radix, bool) or not isinstance(radix, int)
                    or not 2 <= radix <= _core.MAX_TREE_RADIX):
                raise ValueError(f"tree_radix must be an int in 2..{_core.MAX_TREE_RADIX}, "
                                 f"got {radix!r}")
            if isinstance(capacity, bool) or not isinstance(capacity, int) or capacity < 0:
                raise ValueError(f"capacity must be an int >= 0, got {capacity!r}")
            if scaling not in SCALINGS:
                raise ValueError(f"scaling must be one of {SCALINGS}, got {scaling!r}")
            if not isinstance(rotate, bool):
                raise TypeError(f"rotate must be a bool, not {type(rotate).__name__}")
            _check_compression(compression)
            if (isinstance(compression_group, bool) or not isinstance(compression_group, int)
                    or not 2 <= compression_group <= 65536 or compression_group % 2):
                raise ValueError(f"compression_group must be an even int in 2..65536, "
                                 f"got {compression_group!r}")
            use_shared = env.rma_shm
            # (FI_PROVIDER: libfabric's own variable)
            provider = env.ud_provider or os.environ.get("FI_PROVIDER", "")
            # What every rank must share, agreed before any channel work (a
            # rank on another channel or window size would wait forever in a
            # collective the others never enter).  Per-node settings (the
            # datagram domain, buffer counts) may differ.
            settings = (("channel", channel), ("block_bytes", block), ("tree_radix", radix),
                        ("capacity", capacity), ("scaling", scaling), ("rotate", rotate),
                        ("compression", compression), ("compression_group", compression_group),
                        ("MPILOSSY_RMA_SHM", use_shared),
                        ("datagram provider", provider), ("MPILOSSY_UD_MTU", env.ud_mtu))
        except (TypeError, ValueError) as exc:
            error = exc
        # Construction is collective: every rank learns of any rank's bad
        # argument, or of any difference between ranks, from one allgather.
        configs = self._comm.allgather((error is not None, settings))
        failed = [r for r, (bad, _) in enumerate(configs) if bad]
        if not failed:
            differ = [k for k in range(len(settings))
                      if len({c[k][1] for _, c in configs}) > 1]
            if differ:
                error = MismatchError("ranks disagree on " + "; ".join(
                    f"{settings[k][0]} (" + ", ".join(
                        f"rank {r}: {c[k][1]!r}" for r, (_, c) in enumerate(configs)) + ")"
                    for k in differ))
                failed = [-1]
        if failed:
            self._comm.Free()
            if error is not None:
                raise error
            raise ValueError(f"Communicator arguments rejected on rank(s) {failed}")
        assert env is not None
        _settings.configure_logging(env, self._comm.Get_rank())
        _settings.warn_from_environment(
            env, MPI.COMM_WORLD.Get_rank(),
            tuple(name for name, given in (("loss", loss), ("timeout", timeout)) if given is _UNSET))
        if channel == "auto":
            channel = self._auto_channel(provider)
        try:
            self._core = _core.Core(
                self._comm, capacity, block, radix, use_shared, scaling == "zero-fill", rotate,
                channel=channel, provider=provider, domain=env.ud_domain,
                datagram_bytes=env.ud_mtu, recv_buffers=env.ud_recv_buffers,
                socket_bytes=env.ud_socket_bytes, spin=env.spin, early_close=env.early_close)
            self._core.configure_loss(loss_spec)
        except BaseException as exc:
            error = exc
        # The channels agree on their own failures; this catches the rest, so
        # that no rank returns a communicator whose peers raised.
        outcomes = self._comm.allgather(None if error is None else f"{type(error).__name__}: {error}")
        broken = [(r, why) for r, why in enumerate(outcomes) if why is not None]
        if broken:
            if self._core is not None:
                self._core.close()
                self._core = None
            self._comm.Free()
            if error is not None:
                raise error
            raise MPILossyError("Communicator construction failed on " + "; ".join(
                f"rank {r}: {why}" for r, why in broken))
        _live.add(self)
        self._block_bytes = block
        self._radix = radix
        self._scaling = scaling
        self._rotate = rotate
        self._compression = compression
        self._compression_group = compression_group
        self._size = self._comm.Get_size()
        self._staging = _device.Staging()       # pinned host copies of GPU buffers
        self._copy_back: Optional[tuple] = None
        self._channel = channel
        self._settings = env
        self._trace = self._open_trace(env.trace)
        # Calls in a row in which every peer had already moved on (see _watch_lag).
        self._behind = 0
        self._max_behind: int = env.max_behind
        self._auto = AutoDeadline(self._comm.Dup(), floor=env.auto_floor, cap=env.auto_cap)
        self._tree_max_bytes: int = env.tree_max_bytes if env.tree_max_bytes is not None \
            else TREE_MAX_BYTES.get(self.size, TREE_MAX_BYTES_LARGE)
        _settings.log.info("communicator of %d ranks: channel=%s timeout=%s loss=%s "
                           "block_bytes=%d", self._size, channel, self.timeout,
                           self._loss_models or None, block)

    def _auto_channel(self, provider: str) -> str:
        """ud where the fabric does datagrams in hardware, or where a datagram
        provider is asked for (MPILOSSY_UD_PROVIDER, FI_PROVIDER); rma
        otherwise.  Agreed by every rank."""
        choice = "rma"
        if _core.HAVE_DATAGRAM_AUTH and provider == "native":
            choice = "ud"
        elif _core.HAVE_LIBFABRIC:
            try:
                providers = _core.datagram_providers()
            except MPILossyError:
                providers = []
            names = {p.split("/")[0] for p in providers}
            if (provider and provider in names) or names & set(HARDWARE_DATAGRAMS):
                choice = "ud"
        return "ud" if all(c == "ud" for c in self._comm.allgather(choice)) else "rma"

    # -- properties ----------------------------------------------------------
    @property
    def comm(self) -> MPI.Comm:
        """The private duplicate that carries mpilossy's traffic."""
        self._alive()
        return self._comm

    @property
    def rank(self) -> int:
        return self._comm.Get_rank()

    @property
    def size(self) -> int:
        return self._comm.Get_size()

    @property
    def channel(self) -> str:
        return self._channel

    @property
    def timeout(self) -> Any:
        """Seconds, "auto", or None."""
        if self._timeout == AUTO:
            return "auto"
        return None if self._timeout < 0 else self._timeout

    @property
    def auto_timeouts(self) -> dict:
        """timeout="auto": the deadline in force per kind of call
        (collective, algorithm, bit length of the byte count)."""
        return {(COLLECTIVE_NAMES[c], ALGORITHM_NAMES[a], b): t
                for (c, a, b), t in self._auto.snapshot().items()}

    @property
    def scaling(self) -> str:
        """"unbiased" (sum / contributions) or "zero-fill" (sum / size)."""
        return self._scaling

    @property
    def rotate(self) -> bool:
        return self._rotate

    @property
    def loss(self) -> list:
        return list(self._loss_models)

    @property
    def calls(self) -> int:
        """Calls made so far (the sequence number of the last one)."""
        return self._alive().seq

    def channel_info(self) -> dict:
        """The channel and, for "ud", its provider, domain, datagram size and
        counters of datagrams dropped by cause (foreign, truncated, malformed,
        forged, stale, future, unexpected, duplicate, mismatch; docs/ud.md)."""
        return self._alive().channel_info()

    @property
    def shared_memory_peers(self) -> int:
        """Peers read through shared memory; the others through MPI_Rget."""
        return self._alive().shared_peers

    # -- lifetime ------------------------------------------------------------
    def free(self) -> None:
        """Release windows and the duplicate communicator (collective)."""
        if self._core is None:
            return
        if getattr(self, "_trace", None) is not None:
            self._trace.close()
            self._trace = None
        core, self._core = self._core, None
        core.close()
        self._auto.close()
        self._auto.comm.Free()
        self._comm.Free()

    def __enter__(self) -> "Communicator":
        self._alive()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.free()

    def __repr__(self) -> str:
        state = "freed" if self._core is None else f"size={self.size}"
        return (f"<mpilossy.Communicator {state} channel={self._channel!r} "
                f"timeout={self.timeout!r} loss={self._loss_models!r}>")

    def _alive(self) -> _core.Core:
        """The compiled core; raises once the communicator was freed."""
        if self._core is None:
            raise MPILossyError("this mpilossy.Communicator was freed")
        return self._core

    # -- collectives -----------------------------------------------------------
    def allreduce(self, sendbuf: Any, recvbuf: Any = None, *, op: str = "sum",
                  algorithm: Optional[str] = None, timeout: Any = _UNSET,
                  weight: Optional[float] = None,
                  compression: Optional[str] = _UNSET,
                  residual: Optional[np.ndarray] = None) -> CollectiveStats:
        """Lossy all-reduce of `sendbuf` into `recvbuf` (in place without recvbuf).

        With op="avg" the result is sum / count; with op="sum" it is
        sum * size / count, where count is the number of ranks whose data
        reached each block in time.  Returns this rank's statistics.

        weight: this rank's weight w > 0 in a weighted average (op="avg",
        the direct algorithm, scaling="unbiased"): each block of the result
        is sum(w_i x_i) / sum(w_i) over the ranks whose data reached it.
        Every rank passes a weight, or none does.

        compression: None, "int8" or "int4" for this call (default: the
        communicator's); float32 on the direct algorithm only.

        residual: a float32 NumPy array as long as `sendbuf`, for error
        feedback: receives what quantisation took from this rank's
        contribution (sendbuf minus what travelled), zeros where nothing
        was quantised (this rank's own chunk, an uncompressed call).
        """
        def prepare(deadline: bool):
            send, recv = self._buffers(sendbuf, recvbuf, recv_required=False, same_ok=True)
            if recv.size != send.size:
                raise ValueError(f"recvbuf has {recv.size} elements, sendbuf {send.size}")
            chosen = self._algorithm if algorithm is None else self._check_algorithm(algorithm)
            opcode = self._op(op, send)
            w = self._check_weight(weight, op, chosen)
            bits = self._quantise(compression, send, chosen)
            err = _check_residual(residual, send, recv)
            algo = _core.DIRECT if w or bits else self._resolve_algorithm(chosen, send.nbytes,
                                                                          deadline)
            return send, recv, opcode, algo, w, bits, err
        return self._run(_core.ALLREDUCE, prepare, timeout)

    def reduce_scatter(self, sendbuf: Any, recvbuf: Any, *, op: str = "sum",
                       algorithm: str = "auto", timeout: Any = _UNSET,
                       weight: Optional[float] = None,
                       compression: Optional[str] = _UNSET,
                       residual: Optional[np.ndarray] = None) -> CollectiveStats:
        """Lossy reduce-scatter: `recvbuf` receives this rank's chunk
        (chunk_bounds) of the reduction of every rank's `sendbuf`, scaled as
        in allreduce.  algorithm: "ring", "direct" or "auto" (as allreduce
        chooses above the tree's sizes); unbiased like allreduce.  weight,
        compression, residual: as in allreduce."""
        def prepare(deadline: bool):
            send, recv = self._buffers(sendbuf, recvbuf, recv_required=True, same_ok=False)
            lo, hi = self.chunk_bounds(send.size)
            if recv.size != hi - lo:
                raise ValueError(f"recvbuf has {recv.size} elements; this rank's chunk of "
                                 f"{send.size} has {hi - lo} (Communicator.chunk_bounds)")
            if algorithm not in ("ring", "direct", "auto"):
                raise ValueError(f"reduce_scatter's algorithm must be 'ring', 'direct' or "
                                 f"'auto', got {algorithm!r}")
            opcode = self._op(op, send)
            w = self._check_weight(weight, op, algorithm)
            bits = self._quantise(compression, send, algorithm)
            err = _check_residual(residual, send, recv)
            algo = _core.DIRECT if w or bits else self._resolve_algorithm(
                algorithm, send.nbytes, deadline, tree_ok=False)
            return send, recv, opcode, algo, w, bits, err
        return self._run(_core.REDUCE_SCATTER, prepare, timeout)

    def allgather(self, sendbuf: Any, recvbuf: Any, *, timeout: Any = _UNSET) -> CollectiveStats:
        """Lossy all-gather: chunk r (chunk_bounds) of `recvbuf` receives rank
        r's `sendbuf`.  A chunk (block) that does not arrive in time keeps
        the previous contents of `recvbuf`.  `sendbuf` may be this rank's
        own chunk of `recvbuf` (in place)."""
        def prepare():
            # (sendbuf may be this rank's chunk of recvbuf: checked below)
            send, recv = self._buffers(sendbuf, recvbuf, recv_required=True, same_ok=True,
                                       overlap_ok=True)
            lo, hi = self.chunk_bounds(recv.size)
            if send.size != hi - lo:
                raise ValueError(f"sendbuf has {send.size} elements; this rank's chunk of "
                                 f"{recv.size} has {hi - lo} (Communicator.chunk_bounds)")
            if (_buffers.address(send) != _buffers.address(recv) + lo * recv.itemsize
                    and np.may_share_memory(send, recv)):
                raise ValueError("sendbuf overlaps recvbuf without being this rank's chunk of it")
            return send, recv, _core.SUM, _core.DIRECT, 0.0, 0, None
        return self._run(_core.ALLGATHER, lambda deadline: prepare(), timeout)

    def chunk_bounds(self, count: int, rank: Optional[int] = None) -> tuple:
        """(first, end) of `rank`'s chunk (default: this rank's) of a vector of
        `count` elements, as reduce_scatter and allgather cut it: the first
        count % size ranks get one element more."""
        size = self.size
        rank = self.rank if rank is None else rank
        base, extra = divmod(count, size)
        first = rank * base + min(rank, extra)
        return first, first + base + (1 if rank < extra else 0)

    def _run(self, coll: int, prepare, timeout: Any) -> CollectiveStats:
        """Validate (every failure goes to every rank), run, report.  Every
        rank counts every call, whatever fails, so that the call numbers (and
        the auto deadline's schedule) stay the same on every rank."""
        core = self._alive()
        self._copy_back = None
        spent = 0.0
        try:
            spent = self._auto.tick(self._timeout == AUTO if timeout is _UNSET
                                    else isinstance(timeout, str) and timeout == "auto")
            tmo = self._timeout if timeout is _UNSET else _check_timeout(timeout)
            send, recv, opcode, algo, weight, qbits, residual = prepare(tmo != -1.0)
        except BaseException as exc:
            # Validation errors become the same exception on every rank;
            # anything else (a device error, Ctrl-C) is raised here as it
            # is, and the peers learn that this rank dropped out of the call.
            kind = next((k for cls, k in _KINDS.items() if isinstance(exc, cls)), None)
            validation = kind is not None
            message = str(exc) if validation else (
                f"rank {self.rank} could not take part: {type(exc).__name__}: {exc}")
            result = core.fail(_core.ERRORS[kind or "protocol"], message, self._fail_timeout())
            if isinstance(exc, Exception) and validation:
                raise self._error(coll, result, type(exc)) from None
            raise
        dtype = _buffers.DTYPE_CODES[send.dtype]
        key = (coll, algo, size_bucket(send.nbytes))
        budget = tmo
        if tmo == AUTO:
            tmo = budget = self._auto.timeout(key)
            if spent:       # the agreement's wait is part of this call's deadline
                budget = max(tmo - spent, 0.25 * tmo)
        copy_back, self._copy_back = self._copy_back, None
        if residual is not None:
            residual[...] = 0       # (the core writes the blocks it quantised)
        result = core.collective(send, recv, coll, dtype, opcode, algo, budget, weight,
                                 qbits, self._compression_group, residual)
        if copy_back is not None and not result.err_kind:
            self._copy_out(*copy_back)
        start, anchor, end = result.timing
        if anchor >= 0 and not result.err_kind and self._size > 1:
            self._auto.record(key, end - anchor, result.delivered >= 1.0 and not result.deadline_hit)
        if self._trace is not None:
            self._write_trace(result, coll, algo, send.nbytes, tmo)
        if result.err_kind:
            raise self._error(coll, result)
        self._watch_lag(result)
        contributors = None
        if algo == _core.DIRECT:
            contributors = Contributors(
                result.contributors, size=self._size, rank=self._comm.Get_rank(),
                count=recv.size if coll == _core.ALLGATHER else send.size,
                chunks=(self._comm.Get_rank(),) if coll == _core.REDUCE_SCATTER
                else tuple(range(self._size)))
        return CollectiveStats(result.delivered, result.elapsed, result.deadline_hit,
                               result.fallback, result.min_contributors,
                               ALGORITHM_NAMES[algo], send.nbytes, result.seq, result.lost_blocks,
                               COLLECTIVE_NAMES[coll], None if tmo < 0 else tmo, result.agreed,
                               contributors)

    def _watch_lag(self, result: _core.CallResult) -> None:
        """A rank that finds every peer already past its call (only its own
        data in the result, blocks `gone`, none late) catches up by itself:
        such calls return at once while the peers wait for it.  One that
        stays behind for `MPILOSSY_MAX_BEHIND` calls in a row has dropped
        out of the others' calls: say so instead of staying silent."""
        delivered, lost = result.delivered, result.lost_blocks
        behind = (self._size > 1 and lost[2] > 0 and lost[1] == 0
                  and delivered <= 1.0 / self._size + 1e-9)
        self._behind = self._behind + 1 if behind else 0
        if self._behind >= self._max_behind:
            calls, self._behind = self._behind, 0
            raise LaggingError(
                f"rank {self.rank}: every peer had already finished this rank's call on "
                f"{calls} calls in a row (call {result.seq}): this rank no longer takes part in "
                f"the others' calls. Do all ranks make the same calls? (MPILOSSY_MAX_BEHIND="
                f"{self._max_behind} sets how many calls in a row are tolerated)")

    def _fail_timeout(self) -> float:
        """How long a failing call may take to tell its peers: the
        communicator's deadline, or the auto cap, never unbounded."""
        if self._timeout > 0:
            return min(self._timeout, self._auto.cap)
        return self._auto.cap

    def _buffers(self, sendbuf: Any, recvbuf: Any, recv_required: bool, same_ok: bool,
                 overlap_ok: bool = False) -> tuple:
        if _device.is_device(sendbuf) or (recvbuf is not None and _device.is_device(recvbuf)):
            return self._device_buffers(sendbuf, recvbuf, recv_required, same_ok, overlap_ok)
        send = _buffers.as_array(sendbuf, "sendbuf")
        _buffers.dtype_code(send, "sendbuf")
        _buffers.check_contiguous(send, "sendbuf")
        if recvbuf is None:
            if recv_required:
                raise TypeError("recvbuf is required")
            _buffers.check_writable(send, "sendbuf (in place, no recvbuf)")
            return send, send
        recv = _buffers.as_array(recvbuf, "recvbuf")
        if recv.dtype != send.dtype:
            raise TypeError(f"recvbuf has dtype {recv.dtype}, sendbuf {send.dtype}")
        _buffers.check_contiguous(recv, "recvbuf")
        _buffers.check_writable(recv, "recvbuf")
        same = _buffers.address(recv) == _buffers.address(send) and recv.size == send.size
        if same and not same_ok:
            raise ValueError("sendbuf and recvbuf must be different buffers")
        if not same and not overlap_ok and np.may_share_memory(send, recv):
            raise ValueError("sendbuf and recvbuf overlap without being the same buffer")
        return send, recv

    def _device_buffers(self, sendbuf: Any, recvbuf: Any, recv_required: bool, same_ok: bool,
                        overlap_ok: bool) -> tuple:
        """GPU buffers: validate, stage into pinned host memory (copies on
        the arrays' streams, synchronised), and note the copy back."""
        if recvbuf is None and recv_required:
            raise TypeError("recvbuf is required")
        staging = self._staging
        back = staging.backend                          # raises without CuPy
        for obj, name in ((sendbuf, "sendbuf"), (recvbuf, "recvbuf")):
            if obj is not None and not _device.is_device(obj):
                raise BufferError(f"{name} is in host memory and the other buffer on a GPU; "
                                  f"pass both on the same side")
        send = _device.describe(sendbuf, "sendbuf")
        recv = send if recvbuf is None else _device.describe(recvbuf, "recvbuf")
        for buf, name in ((send, "sendbuf"), (recv, "recvbuf")):
            if buf.dtype not in _buffers.DTYPE_CODES:
                raise TypeError(f"{name} has dtype {buf.dtype}; supported: {_buffers.SUPPORTED}")
            if not buf.contiguous:
                raise BufferError(f"{name} is not C-contiguous; pass a contiguous copy")
        if recv.readonly:
            raise BufferError("recvbuf is read-only; the result is written into it"
                              if recvbuf is not None else
                              "sendbuf (in place, no recvbuf) is read-only")
        if recv.dtype != send.dtype:
            raise TypeError(f"recvbuf has dtype {recv.dtype}, sendbuf {send.dtype}")
        in_stream, out_stream = back.stream_of(send), back.stream_of(recv)
        same = send.ptr == recv.ptr and send.nbytes == recv.nbytes
        s_lo, s_hi, r_lo, r_hi = send.ptr, send.ptr + send.nbytes, recv.ptr, recv.ptr + recv.nbytes
        if same:
            if recvbuf is not None and not same_ok:
                raise ValueError("sendbuf and recvbuf must be different buffers")
            host_send = host_recv = staging.host(1, recv)
            back.to_host(host_recv, recv, out_stream)
        elif s_lo < r_hi and r_lo < s_hi:
            offset = s_lo - r_lo
            if not (overlap_ok and offset >= 0 and s_hi <= r_hi
                    and offset % recv.dtype.itemsize == 0):
                raise ValueError("sendbuf and recvbuf overlap without being the same buffer")
            host_recv = staging.host(1, recv)
            back.to_host(host_recv, recv, out_stream)
            first = offset // recv.dtype.itemsize
            host_send = host_recv.reshape(-1)[first:first + send.size]     # a chunk of recv
        elif same_ok and not overlap_ok:
            # allreduce out of place: reduce the staged send data in place,
            # then copy it to recvbuf (recvbuf's old contents are not needed).
            if recv.nbytes != send.nbytes:
                raise ValueError(f"recvbuf has {recv.size} elements, sendbuf {send.size}")
            host_send = host_recv = staging.host(1, send)
            back.to_host(host_send, send, in_stream)
        else:
            # reduce_scatter, allgather: recvbuf's old contents stay where
            # nothing arrives (allgather keeps a missing chunk's previous values)
            host_recv = staging.host(1, recv)
            back.to_host(host_recv, recv, out_stream)
            host_send = staging.host(0, send)
            back.to_host(host_send, send, in_stream)
        back.synchronize(in_stream)
        if out_stream != in_stream:
            back.synchronize(out_stream)
        self._copy_back = (recv, host_recv, out_stream)
        return host_send.reshape(-1), host_recv.reshape(-1)

    def _copy_out(self, recv: Any, host: np.ndarray, stream: int) -> None:
        back = self._staging.backend
        back.to_device(recv, host, stream)
        back.synchronize(stream)

    @staticmethod
    def _op(op: Any, send: np.ndarray) -> int:
        opcode = OPS.get(op) if isinstance(op, str) else None
        if opcode is None:
            raise ValueError(f"op must be one of {sorted(OPS)}, got {op!r}")
        if opcode == _core.AVG and send.dtype.kind != "f":
            raise TypeError(f"op='avg' needs a floating-point dtype, got {send.dtype}")
        return opcode

    def _quantise(self, compression: Any, send: np.ndarray, algorithm: str) -> int:
        """Bits per value of this call's payloads (0: not quantised)."""
        compression = self._compression if compression is _UNSET else compression
        _check_compression(compression)
        if compression is None:
            return 0
        if send.dtype != np.float32:
            raise TypeError(f"compression={compression!r} needs float32 data, got {send.dtype}")
        if algorithm not in ("direct", "auto"):
            raise ValueError(f"compression needs algorithm='direct' (or 'auto', which then "
                             f"picks it), got {algorithm!r}")
        return COMPRESSIONS[compression]

    def _check_weight(self, weight: Any, op: str, algorithm: str) -> float:
        """The weight to pass to the core: 0.0 for none."""
        if weight is None:
            return 0.0
        if isinstance(weight, bool) or not isinstance(weight, numbers.Real):
            raise TypeError(f"weight must be a real number or None, got {type(weight).__name__}")
        w = float(weight)
        if not (math.isfinite(w) and w > 0):
            raise ValueError(f"weight must be finite and > 0, got {weight!r}")
        if op != "avg":
            raise ValueError(f"weight needs op='avg' (a weighted average), got op={op!r}")
        if algorithm not in ("direct", "auto"):
            raise ValueError(f"weight needs algorithm='direct' (or 'auto', which then picks "
                             f"it), got {algorithm!r}")
        if self._scaling != "unbiased":
            raise ValueError("weight needs scaling='unbiased' (a weighted average divides by "
                             "the weights that arrived)")
        return w

    @staticmethod
    def _check_algorithm(algorithm: Any) -> str:
        if algorithm not in ("ring", "tree", "direct", "auto"):
            raise ValueError(f"algorithm must be 'ring', 'tree', 'direct' or 'auto', "
                             f"got {algorithm!r}")
        return algorithm

    def _resolve_algorithm(self, algorithm: str, nbytes: int, deadline: bool,
                           tree_ok: bool = True) -> int:
        """algorithm="auto" (docs/performance.md): the tree up to its measured
        crossover; above it, direct whenever the call has a deadline (the
        ring loses whole partial sums: at 3 ranks and more it keeps fewer
        contributions than direct), else the faster of ring and direct
        without loss (RING_WITHOUT_DEADLINE)."""
        if algorithm != "auto":
            return ALGORITHMS[algorithm]
        if tree_ok and nbytes <= self._tree_max_bytes:
            return _core.TREE
        if deadline or not RING_WITHOUT_DEADLINE:
            return _core.DIRECT
        return _core.RING

    def _open_trace(self, directory: Optional[str]):
        """MPILOSSY_TRACE=DIR: one line per call and rank, for tuning deadlines."""
        if not directory:
            return None
        os.makedirs(directory, exist_ok=True)
        path = os.path.join(directory, f"trace-{self._serial}-rank{self.rank}.tsv")
        trace = open(path, "w", buffering=1)
        trace.write("seq\talgorithm\tbytes\ttimeout\tstart\tanchor_ms\telapsed_ms"
                    "\tdelivered\tlost_injected\tlost_late\tlost_gone\tlost_torn\terror\n")
        return trace

    def _write_trace(self, result: _core.CallResult, coll: int, algo: int, nbytes: int,
                     timeout: float) -> None:
        start, anchor, _end = result.timing
        self._trace.write("\t".join(map(str, (
            result.seq, f"{COLLECTIVE_NAMES[coll]}/{ALGORITHM_NAMES[algo]}", nbytes, timeout,
            f"{start:.6f}",
            f"{(anchor - start) * 1e3:.3f}" if anchor >= 0 else "-", f"{result.elapsed * 1e3:.3f}",
            f"{result.delivered:.4f}", *result.lost_blocks, result.err_kind))) + "\n")

    def _error(self, coll: int, result: _core.CallResult,
               local: Optional[Type[Exception]] = None) -> Exception:
        kind, rank, message, seq = result.err_kind, result.err_rank, result.err_msg, result.seq
        cls = _EXCEPTIONS.get(kind, MPILossyError)
        if local is not None and kind != _core.ERRORS["mismatch"]:
            cls = local
        return cls(f"{COLLECTIVE_NAMES[coll]} call {seq}: rank {rank}: {message}")


# -- module level -----------------------------------------------------------
_default: Optional[Communicator] = None
_live: "weakref.WeakSet[Communicator]" = weakref.WeakSet()


@atexit.register
def _free_at_exit() -> None:
    """Free what the program left open before mpi4py finalizes MPI (every
    rank built the same communicators, so this is collective as it must be)."""
    for lc in sorted(_live, key=lambda c: -c._serial):
        lc.free()


def default_communicator() -> Communicator:
    """The communicator behind mpilossy.allreduce(): COMM_WORLD, settings
    from the environment (MPILOSSY_TIMEOUT, MPILOSSY_LOSS, ...).  Created on
    first use, which is collective."""
    global _default
    if _default is None or _default._core is None:
        _default = Communicator(MPI.COMM_WORLD)
    return _default


def allreduce(sendbuf: Any, recvbuf: Any = None, *, op: str = "sum",
              algorithm: Optional[str] = None, timeout: Any = _UNSET,
              weight: Optional[float] = None,
              compression: Optional[str] = _UNSET) -> CollectiveStats:
    """mpilossy.Communicator.allreduce on default_communicator()."""
    return default_communicator().allreduce(sendbuf, recvbuf, op=op, algorithm=algorithm,
                                            timeout=timeout, weight=weight,
                                            compression=compression)


def reduce_scatter(sendbuf: Any, recvbuf: Any, *, op: str = "sum",
                   timeout: Any = _UNSET, weight: Optional[float] = None) -> CollectiveStats:
    """mpilossy.Communicator.reduce_scatter on default_communicator()."""
    return default_communicator().reduce_scatter(sendbuf, recvbuf, op=op, timeout=timeout,
                                                 weight=weight)


def allgather(sendbuf: Any, recvbuf: Any, *, timeout: Any = _UNSET) -> CollectiveStats:
    """mpilossy.Communicator.allgather on default_communicator()."""
    return default_communicator().allgather(sendbuf, recvbuf, timeout=timeout)
