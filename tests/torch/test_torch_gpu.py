"""mpilossy.torch on CUDA tensors (docs/gpu.md): the parts that copy
tensors into host buffers of their own (DistributedOptimizer, the
broadcasts, drift control, average_parameters) against the same on CPU
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
def test_sharded_optimizer_refuses_cuda_on_every_rank(comm, lc, cuda):
    model = make_model(0).to(cuda)
    msg = all_ranks_raise(comm, lambda: mt.ShardedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.1), model.named_parameters(), lc), BufferError)
    assert "CPU tensors only" in msg and "DistributedOptimizer" in msg
