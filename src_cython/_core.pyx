# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True
# cython: initializedcheck=False, embedsignature=True
"""mpilossy's compiled core: kernels, channels, ring, tree and direct.

One module, one concern per included file (the layout of mpi4py's MPI.pyx),
in folders by what they are:
  prelude.pxi, native.pxd, mpilossy_native.h
                 what every compiled module shares: cimports, atomics,
                 hashing, float16, the window layout
  codecs/        what turns blocks into bytes and back
    kernels.pxi    accumulate and unbiased scaling, per dtype, outside the GIL
    exposed.pxi    the kernels and codes as Python functions (bench, tests)
    coding.pxi     redundancy: parity records of groups of blocks, rebuilding
    payload.pxi    how a contribution travels on direct: plain, quantised, weighted
    mpilossy_quant.h, mpilossy_fec.h, mpilossy_simd.h, mpilossy_bf16.h
                   low-bit payloads, erasure codes, vector kernels, bfloat16 (C)
  engine/        one call from begin to end, whatever the channel and algorithm
    channel.pxi    the interface between algorithms and channels; the call record
    outcome.pxi    one outcome per call on every rank (failures told over MPI)
    lossmodel.pxi  injected loss, decided from counters
    core.pxi       per-communicator state and the entry points
  channels/      how records move
    rma_window.pxi the one-sided channel: this rank's window and what it publishes
    rma.pxi        the one-sided channel: reading peers (loads, MPI_Rget)
    dgram_wire.pxi the datagram channel's wire format and packet checks
    dgram_endpoint.pxi  its endpoint: transport, buffers, sending, reaping
    dgram_recovery.pxi  without deadline: what a reader asks for again (NACK)
    dgram.pxi      its protocol (HELLO, DATA, END, ERROR, NACK)
    mpilossy_transport.h, _fabric.h, _sockets.h, _pace.h, _mac.h
                   the datagram transports (libfabric, native UDP), pacing, MACs (C)
  algorithms/    what to read from whom and what to do with it
    schedule.pxi   streams, deadlines, the polling loop every algorithm runs on
    ring.pxi, tree.pxi, direct.pxi, gather.pxi
  testing/_testing.pyx  the test suite's scaffolding, a module of its own
"""

include "prelude.pxi"

cdef extern from *:
    const char* MPILOSSY_VERSION      # -D by meson.build, from the file VERSION

include "codecs/kernels.pxi"
include "engine/channel.pxi"
include "engine/outcome.pxi"
include "channels/rma_window.pxi"
include "channels/rma.pxi"
include "channels/dgram_wire.pxi"
include "channels/dgram_endpoint.pxi"
include "channels/dgram_recovery.pxi"
include "channels/dgram.pxi"
include "algorithms/schedule.pxi"
include "codecs/coding.pxi"
include "algorithms/ring.pxi"
include "algorithms/tree.pxi"
include "codecs/payload.pxi"
include "algorithms/weights.pxi"
include "algorithms/direct.pxi"
include "algorithms/gather.pxi"
include "engine/lossmodel.pxi"
include "engine/core.pxi"
include "codecs/exposed.pxi"

DTYPE_F16 = DT_F16
DTYPE_F32 = DT_F32
DTYPE_F64 = DT_F64
DTYPE_I32 = DT_I32
DTYPE_I64 = DT_I64
DTYPE_BF16 = DT_BF16
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
# Share of a call's deadline spent waiting for peers not yet in it (channel.pxi)
PATIENCE = 1.0 - BUDGET


def datagram_providers() -> list:
    """The libfabric datagram providers/domains on this host ("prov/domain")."""
    cdef char out[4096]
    cdef char err[256]
    if mpl_fab_list(out, 4096, err, 256):
        raise MPILossyChannelError(err.decode(errors="replace"))
    return out.decode().split()
