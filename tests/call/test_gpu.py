"""GPU buffers on a real GPU: CuPy arrays and CUDA tensors through the
staged path (docs/gpu.md), against MPI_Allreduce on host copies.  Every
test here carries the `gpu` marker and skips, saying why, where CuPy finds
no device (CI has none); scripts/gpu_check.sh runs them on a GPU machine,
at 1 to 4 ranks sharing its GPU.  tests/call/test_device.py covers the same
paths everywhere with fake device arrays."""

import numpy as np
import pytest

import mpilossy
from helpers import all_ranks_raise, mpi_sum, small_ints

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def cupy():
    cupy = pytest.importorskip("cupy", reason="CuPy is not installed (no GPU tests)")
    try:
        count = cupy.cuda.runtime.getDeviceCount()
    except Exception as exc:            # CuPy without a driver or device
        pytest.skip(f"no CUDA device: {exc}")
    if count < 1:
        pytest.skip("no CUDA device")
    from mpi4py import MPI
    local = MPI.COMM_WORLD.Split_type(MPI.COMM_TYPE_SHARED)
    cupy.cuda.Device(local.rank % count).use()      # (one GPU: all ranks share it)
    local.Free()
    return cupy


@pytest.mark.mpi
@pytest.mark.parametrize("dtype", [np.float16, np.float32, np.float64, np.int32])
def test_gpu_allreduce_equals_the_host_result(comm, lc, cupy, dtype):
    x = small_ints((1 << 20) + 5, comm.rank, dtype)      # (not a multiple of the blocks)
    out = cupy.full(x.size, -1, dtype=dtype)
    send = cupy.asarray(x)
    lc.allreduce(send, out, op="sum")
    np.testing.assert_array_equal(cupy.asnumpy(out), mpi_sum(comm, x))
    np.testing.assert_array_equal(cupy.asnumpy(send), x)        # sendbuf untouched


@pytest.mark.mpi
@pytest.mark.parametrize("algorithm", ["direct", "ring", "tree"])
def test_gpu_allreduce_in_place_every_algorithm(comm, lc, cupy, algorithm):
    x = small_ints(300_001, comm.rank, np.float32)
    buf = cupy.asarray(x)
    stats = lc.allreduce(buf, algorithm=algorithm)
    np.testing.assert_array_equal(cupy.asnumpy(buf), mpi_sum(comm, x))
    assert stats.delivered == 1.0


@pytest.mark.mpi
def test_gpu_staging_is_allocated_once_and_reused(comm, lc, cupy):
    x = cupy.asarray(small_ints(1 << 16, comm.rank, np.float32))
    lc.allreduce(x.copy())
    staged = lc._state.buffers.staging.nbytes
    for _ in range(5):
        lc.allreduce(x.copy())
    assert staged > 0 and lc._state.buffers.staging.nbytes == staged


@pytest.mark.mpi
def test_gpu_reduce_scatter_and_allgather(comm, lc, cupy):
    x = small_ints(100_003, comm.rank, np.float64)
    lo, hi = lc.chunk_bounds(x.size)
    chunk = cupy.zeros(hi - lo)
    lc.reduce_scatter(cupy.asarray(x), chunk)
    want = mpi_sum(comm, x)
    np.testing.assert_array_equal(cupy.asnumpy(chunk), want[lo:hi])
    full = cupy.zeros(x.size)
    lc.allgather(chunk, full)
    np.testing.assert_array_equal(cupy.asnumpy(full), want)


@pytest.mark.mpi
def test_gpu_work_queued_on_a_side_stream_is_seen(comm, lc, cupy):
    """The data is produced by a kernel on a non-blocking stream and the
    call is made at once, without a synchronisation: the staging copies
    are ordered on that stream (CuPy's current stream)."""
    n = 1 << 22
    stream = cupy.cuda.Stream(non_blocking=True)
    with stream:
        buf = cupy.arange(n, dtype=cupy.float32) % 23 + comm.rank
        buf *= 1.0                      # more queued work before the call
        lc.allreduce(buf)
        got = cupy.asnumpy(buf)
    host = ((np.arange(n) % 23) + comm.rank).astype(np.float32)
    np.testing.assert_array_equal(got, mpi_sum(comm, host))


@pytest.mark.mpi
def test_gpu_torch_cuda_tensor_and_dlpack_exporter(comm, lc, cupy):
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("torch has no CUDA here")
    x = small_ints(70_001, comm.rank, np.float32)
    want = mpi_sum(comm, x)
    tensor = torch.from_numpy(x).cuda()             # __cuda_array_interface__
    lc.allreduce(tensor)
    np.testing.assert_array_equal(tensor.cpu().numpy(), want)

    class DLPackOnly:                               # no CUDA array interface
        def __init__(self, t):
            self.t = t

        def __dlpack__(self, stream=None):
            return self.t.__dlpack__(stream=stream) if stream is not None else self.t.__dlpack__()

        def __dlpack_device__(self):
            return self.t.__dlpack_device__()

    other = torch.from_numpy(x).cuda()
    lc.allreduce(DLPackOnly(other))
    np.testing.assert_array_equal(other.cpu().numpy(), want)


@pytest.mark.mpi
@pytest.mark.parametrize("algorithm", ["direct", "ring", "tree"])
@pytest.mark.parametrize("op", ["sum", "avg"])
def test_gpu_bfloat16_cuda_tensor_equals_the_host_result(comm, lc, cupy, algorithm, op):
    """CUDA bfloat16 tensors (no __cuda_array_interface__ for that dtype):
    staged as bfloat16, summed in float32 and rounded once, as on the host
    (tests/core/test_bfloat16.py).  Small integers: their sums are exact."""
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("torch has no CUDA here")
    import ml_dtypes
    bf16 = np.dtype(ml_dtypes.bfloat16)
    x = small_ints(100_003, comm.rank, np.float32)
    total = mpi_sum(comm, x)
    want = (total * np.float32(1.0 / comm.size) if op == "avg" else total).astype(bf16)
    send = torch.from_numpy(x).to(device="cuda", dtype=torch.bfloat16)
    recv = torch.full_like(send, -1.0)
    stats = lc.allreduce(send, recv, op=op, algorithm=algorithm)
    got = recv.float().cpu().numpy().astype(bf16)
    np.testing.assert_array_equal(got.view(np.uint16), want.view(np.uint16))
    np.testing.assert_array_equal(send.float().cpu().numpy(), x)      # sendbuf untouched
    assert stats.delivered == 1.0
    inplace = torch.from_numpy(x).to(device="cuda", dtype=torch.bfloat16)
    lc.allreduce(inplace, op=op, algorithm=algorithm)
    assert torch.equal(inplace, recv)


BAD = {
    "strided": (lambda cp, x: cp.asarray(np.repeat(x, 2))[::2], BufferError, "contiguous"),
    "dtype": (lambda cp, x: cp.asarray(x.astype(np.uint8)), TypeError, "dtype"),
    "size": (lambda cp, x: cp.asarray(x[:16]), ValueError, "elements"),
    "host-and-device": (lambda cp, x: x.copy(), BufferError, "same side"),
}


@pytest.mark.mpi
@pytest.mark.parametrize("case", sorted(BAD))
def test_gpu_bad_buffer_on_one_rank_raises_everywhere(comm, lc, cupy, case):
    make, exc, words = BAD[case]
    x = np.ones(64, np.float32)
    send = cupy.asarray(x)
    recv = make(cupy, x) if comm.rank == 0 else cupy.ones(64, dtype=cupy.float32)
    msg = all_ranks_raise(comm, lambda: lc.allreduce(send, recv), exc)
    if comm.rank == 0:
        assert words in msg
    np.testing.assert_array_equal(cupy.asnumpy(send), x)        # untouched


@pytest.mark.mpi(min_size=2)
def test_gpu_allreduce_under_loss_is_unbiased(comm, cupy):
    """Averaged over ranks (each rank's own result leans to its own data,
    which is always in it: tests/core/test_unbiased.py)."""
    x = np.full(1 << 14, float(comm.rank + 1))
    exact = (comm.size + 1) / 2
    total = np.zeros_like(x)
    with mpilossy.Communicator(comm, timeout=0.05, block_bytes=1024,
                               loss=mpilossy.loss.Bernoulli(0.2, seed=3)) as lossy:
        delivered = []
        for _ in range(200):
            buf = cupy.asarray(x)
            delivered.append(lossy.allreduce(buf, op="avg").delivered)
            total += cupy.asnumpy(buf)
    assert min(delivered) < 1.0                     # the loss really happened
    mean = comm.allreduce(total.mean() / 200) / comm.size
    assert abs(mean - exact) < 0.02 * exact, mean


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("inplace", [False, True])
def test_gpu_pipelined_allreduce_equals_the_host_result(comm, cupy, inplace):
    """Segments of 1 MiB (mpilossy/call/pipeline.py), data made on a
    non-blocking stream and passed without a synchronisation."""
    x = small_ints((9 << 18) + 7, comm.rank, np.float32)      # 9 MiB and a bit: 10 segments
    want = mpi_sum(comm, x)
    with mpilossy.Communicator(comm, timeout=None, loss=None, pipeline_bytes=1 << 20) as piped:
        before = piped.allreduce(np.ones(4)).seq
        stream = cupy.cuda.Stream(non_blocking=True)
        with stream:
            send = cupy.asarray(x) * 1                          # (a kernel on that stream)
            recv = send if inplace else cupy.full(x.size, -1, dtype=cupy.float32)
            stats = piped.allreduce(send, None if inplace else recv)
        np.testing.assert_array_equal(cupy.asnumpy(recv), want)
    assert stats.seq - before == 10


@pytest.mark.mpi
def test_gpu_ddp_hook_on_cuda_equals_ddp_default(comm, lc, cupy):
    """The DDP hook (no compression) takes CUDA buckets as they are: eight
    steps of a model on the GPU train as DDP's own all-reduce (Gloo on
    CUDA tensors) trains it."""
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("torch has no CUDA here")
    import mpilossy.torch as mt
    from torch.nn.parallel import DistributedDataParallel as DDP
    from torch_helpers import batch, make_model
    import torch.distributed as dist
    torch.cuda.set_device(cupy.cuda.Device().id)
    created = not dist.is_initialized()
    mt.init_process_group()
    try:
        ref = DDP(make_model().cuda(), bucket_cap_mb=0.004)
        model = DDP(make_model().cuda(), bucket_cap_mb=0.004)
        state = mt.AllreduceHookState(lc, model=model.module)
        model.register_comm_hook(state, mt.allreduce_hook)
        opts = [torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9) for m in (ref, model)]
        for step in range(8):
            x, y = batch(comm.rank, step)
            for m, opt in zip((ref, model), opts):
                opt.zero_grad()
                torch.nn.functional.mse_loss(m(x.cuda()), y.cuda()).backward()
                opt.step()
        assert len(state.bucket_stats) >= 2 and state.stats.delivered == 1.0
        for a, b in zip(ref.parameters(), model.parameters()):
            torch.testing.assert_close(b.detach().cpu(), a.detach().cpu(), rtol=1e-5, atol=1e-6)
    finally:
        if created:
            mt.destroy_process_group()


# -- the node's stages on device memory (mpilossy/hierarchy/device_node.py) -----
CAPACITY = 16 << 20


@pytest.fixture
def node_stages(comm, cupy):
    from mpi4py import MPI
    from mpilossy.hierarchy.device_node import DeviceNodeStages
    node = comm.Split_type(MPI.COMM_TYPE_SHARED, key=comm.rank)
    stages = DeviceNodeStages(node, CAPACITY)
    yield node, stages
    stages.close()
    node.Free()


@pytest.mark.mpi
@pytest.mark.parametrize("count", [0, 3, 1_000_003])     # fewer elements than ranks, uneven
@pytest.mark.parametrize("dtype", [np.float32, np.float64, np.int32])
def test_gpu_node_stages_through_ipc_equal_mpi(node_stages, cupy, count, dtype):
    node, stages = node_stages
    for call in range(3):                       # the buffers are reused call after call
        x = small_ints(count, node.rank + call, dtype)
        out = cupy.full(count, -1, dtype=dtype)
        send = cupy.asarray(x)
        stages.allreduce(send, out)
        np.testing.assert_array_equal(cupy.asnumpy(out), mpi_sum(node, x))
        np.testing.assert_array_equal(cupy.asnumpy(send), x)        # untouched
    inplace = cupy.asarray(x)
    stages.allreduce(inplace, inplace)
    np.testing.assert_array_equal(cupy.asnumpy(inplace), mpi_sum(node, x))


@pytest.mark.mpi
def test_gpu_node_stages_refuse_what_does_not_fit(node_stages, cupy):
    node, stages = node_stages
    with pytest.raises(ValueError, match="do not fit"):
        stages.reduce_scatter(cupy.zeros(CAPACITY // 4 + 1, dtype=cupy.float32))
    with pytest.raises(TypeError, match="CuPy arrays"):
        stages.reduce_scatter(np.zeros(4, np.float32))
    with pytest.raises(BufferError, match="contiguous"):
        stages.reduce_scatter(cupy.zeros(8, dtype=cupy.float32)[::2])
    x = small_ints(1000, node.rank, np.float32)                 # still works after
    out = cupy.empty(1000, dtype=cupy.float32)
    stages.allreduce(cupy.asarray(x), out)
    np.testing.assert_array_equal(cupy.asnumpy(out), mpi_sum(node, x))
