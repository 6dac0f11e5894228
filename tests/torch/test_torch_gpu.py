"""mpilossy.torch on CUDA tensors (docs/gpu.md): the parts that copy
tensors into host buffers of their own (DistributedOptimizer, the
broadcasts, drift control, average_parameters, ShardedOptimizer, compression,
the hook with compression, the compute deadline) against the same on CPU
copies.  Marked `gpu`; they skip, saying why, where torch sees no GPU (CI
has none); scripts/gpu_check.sh runs them on a GPU machine, every rank
sharing its GPU."""

import numpy as np
import pytest
import torch

import mpilossy.torch as mt
from helpers import all_ranks_raise
from torch_helpers import batch, gather_check, make_model

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def cuda():
    if not torch.cuda.is_available():
        pytest.skip("torch sees no CUDA device")
    return torch.device("cuda")


def host_values(model) -> np.ndarray:
    return np.concatenate([p.detach().double().cpu().reshape(-1).numpy()
                           for p in model.parameters()])


def train(model, opt, rank, steps, device):
    for step in range(steps):
        opt.zero_grad()
        x, y = batch(rank, step)
        torch.nn.functional.mse_loss(model(x.to(device)), y.to(device)).backward()
        opt.step()


@pytest.mark.mpi
def test_distributed_optimizer_on_cuda_equals_on_cpu(comm, lc, cuda):
    """Lossless: four steps of a model on the GPU end where the same steps
    of a CPU copy end, on every rank; Adam's state is broadcast from the
    GPU at wrap time."""
    on_gpu, on_cpu = make_model(3).to(cuda), make_model(3)
    runs = []
    for model, device in ((on_gpu, cuda), (on_cpu, torch.device("cpu"))):
        opt = mt.DistributedOptimizer(torch.optim.Adam(model.parameters(), lr=0.01),
                                      model.named_parameters(), lc)
        train(model, opt, comm.rank, 4, device)
        runs.append(host_values(model))
    assert all(p.grad.is_cuda for p in on_gpu.parameters())
    gather_check(comm, np.allclose(runs[0], runs[1], rtol=1e-4, atol=1e-5),
                 f"largest difference {np.abs(runs[0] - runs[1]).max():.3g}")
    every = comm.allgather(runs[0])
    gather_check(comm, all(np.allclose(v, every[0], rtol=1e-6, atol=1e-7) for v in every))


@pytest.mark.mpi
def test_broadcasts_and_drift_control_on_cuda(comm, lc, cuda):
    model = make_model(10 + comm.rank).to(cuda)            # different on every rank
    mt.broadcast_parameters(model, root_rank=0, comm=lc)
    every = comm.allgather(host_values(model))
    gather_check(comm, all(np.array_equal(v, every[0]) for v in every))
    gather_check(comm, np.allclose(every[0], host_values(make_model(10))))
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.01 * comm.rank)                        # drift apart
    control = mt.DriftController(model, comm=lc, broadcast_every=1, measure_every=1)
    report = control.step()
    assert report is not None and report.broadcast
    every = comm.allgather(host_values(model))
    gather_check(comm, all(np.array_equal(v, every[0]) for v in every))
    mt.average_parameters(model, comm=lc)
    assert next(model.parameters()).is_cuda


@pytest.mark.mpi
@pytest.mark.parametrize("missed", ["keep", "extrapolate"])
def test_sharded_optimizer_on_cuda_equals_on_cpu(comm, lc, cuda, missed):
    """Lossless, with a re-synchronisation on the way: the parameters stay
    on the GPU (views of its flat buffers), the optimizer updates its chunk
    there, and the run ends where the same run on a CPU copy ends."""
    on_gpu, on_cpu = make_model(5 + comm.rank).to(cuda), make_model(5 + comm.rank)
    runs, opts = [], []
    for model, device in ((on_gpu, cuda), (on_cpu, torch.device("cpu"))):
        opt = mt.ShardedOptimizer(torch.optim.Adam(model.parameters(), lr=0.01),
                                  model.named_parameters(), lc, missed=missed,
                                  resync_every=3, measure_every=3)
        train(model, opt, comm.rank, 6, device)
        runs.append(host_values(model))
        opts.append(opt)
    assert all(p.is_cuda for p in on_gpu.parameters())
    assert opts[0]._mpilossy.mirrored and not opts[1]._mpilossy.mirrored
    state = [t for s in opts[0].state.values() for t in s.values()
             if isinstance(t, torch.Tensor) and t.dim() > 0]
    assert state and all(t.is_cuda for t in state)
    assert opts[0].stats.delivered == 1.0
    gather_check(comm, np.allclose(runs[0], runs[1], rtol=1e-4, atol=1e-5),
                 f"largest difference {np.abs(runs[0] - runs[1]).max():.3g}")
    every = comm.allgather(runs[0])
    gather_check(comm, all(np.array_equal(v, every[0]) for v in every))


@pytest.mark.mpi
@pytest.mark.parametrize("wrapper", ["sharded", "replicated"])
def test_compression_on_cuda_equals_on_cpu(comm, cuda, wrapper):
    """TopK keeping every block (compression's whole path, nothing left
    out) on CUDA parameters against the same on CPU ones; int8 keeps every
    rank's model the same."""
    import mpilossy
    runs = []
    for compression, device in ((mt.TopK(1.0), cuda), (mt.TopK(1.0), torch.device("cpu")),
                                (mt.LowBit("int8"), cuda)):
        model = make_model(7).to(device)
        lc = mpilossy.Communicator(comm, timeout=None, rotate=False)
        wrap = mt.ShardedOptimizer if wrapper == "sharded" else mt.DistributedOptimizer
        opt = wrap(torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9),
                   model.named_parameters(), lc, compression=compression)
        train(model, opt, comm.rank, 4, device)
        assert opt.stats.delivered == 1.0
        runs.append(host_values(model))
        lc.free()
    gather_check(comm, np.allclose(runs[0], runs[1], rtol=1e-4, atol=1e-5),
                 f"largest difference {np.abs(runs[0] - runs[1]).max():.3g}")
    every = comm.allgather(runs[2])
    gather_check(comm, all(np.array_equal(v, every[0]) for v in every))
    gather_check(comm, not np.array_equal(runs[2], host_values(make_model(7))))


@pytest.mark.mpi
def test_ddp_hook_with_compression_on_cuda(comm, lc, cuda):
    """The hook copies each CUDA bucket into a pinned host buffer of its own
    for the compressor: TopK(1.0) trains as DDP's own all-reduce (Gloo on
    CUDA tensors) does, TopK(0.25) keeps every rank's model the same."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP
    created = not dist.is_initialized()
    mt.init_process_group()
    try:
        ref = DDP(make_model().to(cuda), bucket_cap_mb=0.004)
        exact = DDP(make_model().to(cuda), bucket_cap_mb=0.004)
        sparse = DDP(make_model().to(cuda), bucket_cap_mb=0.004)
        states = []
        for m, compression in ((exact, mt.TopK(1.0)), (sparse, mt.TopK(0.25))):
            state = mt.AllreduceHookState(lc, model=m.module, compression=compression)
            m.register_comm_hook(state, mt.allreduce_hook)
            states.append(state)
        models = (ref, exact, sparse)
        opts = [torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9) for m in models]
        for step in range(6):
            x, y = batch(comm.rank, step)
            for m, opt in zip(models, opts):
                opt.zero_grad()
                torch.nn.functional.mse_loss(m(x.to(cuda)), y.to(cuda)).backward()
                opt.step()
        assert len(states[0].bucket_stats) >= 2 and states[0].stats.delivered == 1.0
        assert states[0]._host and all(h.is_pinned() for h in states[0]._host.values())
        want, got = host_values(ref.module), host_values(exact.module)
        gather_check(comm, np.allclose(got, want, rtol=1e-4, atol=1e-5),
                     f"largest difference {np.abs(got - want).max():.3g}")
        every = comm.allgather(host_values(sparse.module))
        gather_check(comm, all(np.array_equal(v, every[0]) for v in every))
    finally:
        if created:
            mt.destroy_process_group()


@pytest.mark.mpi
def test_compute_deadline_times_the_gpu_work(comm, lc, cuda):
    """Rank 0's micro-batches queue about 50 ms of GPU work each, in well
    under a millisecond: timed after torch.cuda.synchronize, its 40 ms
    budget cuts every step to one micro-batch (timed at queueing, all four
    would run).  The wrapper filled in the device from the parameters."""
    model = make_model(2).to(cuda)
    deadline = mt.ComputeDeadline(0.04, max_micro_batches=4)
    opt = mt.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05),
                                  model.named_parameters(), lc, compute_deadline=deadline)
    assert deadline.device is not None and deadline.device.type == "cuda"
    heavy = torch.randn(8192, 8192, device=cuda) if comm.rank == 0 else None
    # (on the GPU beforehand: a copy from pageable memory would wait for the queue)
    batches = [[t.to(cuda) for t in batch(comm.rank, step)] for step in range(3)]
    torch.cuda.synchronize()
    counts = []
    for x, y in batches:
        opt.zero_grad()
        for _ in deadline:
            if heavy is not None:
                for _ in range(3):
                    heavy = torch.tanh(heavy @ heavy * 1e-4)
            torch.nn.functional.mse_loss(model(x), y).backward()
        counts.append(deadline.micro_batches)
        opt.step()
    if comm.rank == 0:
        assert counts == [1, 1, 1] and deadline.cut_steps == 3, counts
    assert opt.stats.delivered == 1.0 and next(model.parameters()).is_cuda
