# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True
# cython: initializedcheck=False, embedsignature=True
"""mpilossy's compiled core: kernels, channels, ring, tree and direct.

One module, one concern per included file (the layout of mpi4py's MPI.pyx):
  prelude.pxi    the cimports every compiled module shares
  kernels.pxi    accumulate and unbiased scaling, per dtype, outside the GIL
  channel.pxi    the interface between algorithms and channels
  rma_window.pxi the one-sided channel: this rank's window and what it publishes
  rma.pxi        the one-sided channel: reading peers (loads, MPI_Rget)
  dgram_wire.pxi the datagram channel's wire format and packet checks
  dgram_endpoint.pxi  its endpoint: transport, buffers, sending, reaping
  dgram.pxi      its protocol (HELLO, DATA, END, ERROR, NACK)
  schedule.pxi   the engine: streams, deadlines, the polling loop
  coding.pxi     redundancy: parity records of groups of blocks, rebuilding
  ring.pxi       ring all-reduce and reduce-scatter
  tree.pxi       k-nomial tree all-reduce
  direct.pxi     direct (one-hop) all-reduce and reduce-scatter
  gather.pxi     direct all-gather
  lossmodel.pxi  injected loss, decided from counters
  core.pxi       per-communicator state and the entry points
"""

include "prelude.pxi"

cdef extern from *:
    const char* MPILOSSY_VERSION      # -D by meson.build, from the file VERSION

include "kernels.pxi"
include "channel.pxi"
include "outcome.pxi"
include "rma_window.pxi"
include "rma.pxi"
include "dgram_wire.pxi"
include "dgram_endpoint.pxi"
include "dgram.pxi"
include "schedule.pxi"
include "coding.pxi"
include "ring.pxi"
include "tree.pxi"
include "direct.pxi"
include "gather.pxi"
include "lossmodel.pxi"
include "core.pxi"

DTYPE_F16 = DT_F16
DTYPE_F32 = DT_F32
DTYPE_F64 = DT_F64
DTYPE_I32 = DT_I32
DTYPE_I64 = DT_I64
SUM = OP_SUM
AVG = OP_AVG
RING = ALGO_RING
TREE = ALGO_TREE
DIRECT = ALGO_DIRECT
ALLREDUCE = COLL_ALLREDUCE
REDUCE_SCATTER = COLL_REDUCE_SCATTER
ALLGATHER = COLL_ALLGATHER
MAX_TREE_RADIX = RADIX_MAX
PKT_DATA = MPL_PKT_DATA
PKT_HELLO = MPL_PKT_HELLO
PKT_ERROR = MPL_PKT_ERROR
PKT_NACK = MPL_PKT_NACK
PKT_END = MPL_PKT_END
ERRORS = {
    "type": ERR_TYPE, "value": ERR_VALUE, "buffer": ERR_BUFFER,
    "mismatch": ERR_MISMATCH, "protocol": ERR_PROTOCOL, "mpi": ERR_MPI,
    "interrupted": ERR_INTERRUPTED,
}
VERSION = MPILOSSY_VERSION.decode()
HAVE_LIBFABRIC = bool(MPL_HAVE_LIBFABRIC)
HAVE_DATAGRAM_AUTH = bool(MPL_HAVE_MAC)    # OpenSSL: channel="ud" needs it too
HAVE_ISAL = bool(MPL_HAVE_ISAL)            # erasure codes with m >= 2
MAC_KEY_BYTES = MPL_MAC_KEY_BYTES


def datagram_providers() -> list:
    """The libfabric datagram providers/domains on this host ("prov/domain")."""
    cdef char out[4096]
    cdef char err[256]
    if mpl_fab_list(out, 4096, err, 256):
        raise MPILossyChannelError(err.decode(errors="replace"))
    return out.decode().split()
