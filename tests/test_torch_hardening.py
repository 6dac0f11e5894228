"""Hardening of mpilossy.torch (issue 27, items 6, 8 and 10): optimizer
state that is not contiguous, a compute deadline that fails on one rank,
checkpoints of the sharded mode, group averaging of float64 parameters,
and the DDP hook's error-feedback residuals across DDP's bucket rebuild.
Every test is bounded and runs at any number of ranks."""

import pytest

torch = pytest.importorskip("torch", reason="PyTorch is not installed (pip install torch)")

import numpy as np  # noqa: E402

import mpilossy  # noqa: E402
import mpilossy.torch as mt  # noqa: E402
from helpers import all_ranks_raise  # noqa: E402
from torch_helpers import same_on_every_rank  # noqa: E402


# -- item 8: a compute deadline that fails on one rank fails on every rank ------------

def micro_gradient(rank, step, i, n):
    g = torch.Generator().manual_seed(1000 * rank + 10 * step + i)
    return torch.randn(n, generator=g, dtype=torch.float64)


@pytest.mark.mpi
@pytest.mark.parametrize("wrapper", ["distributed", "sharded"])
@pytest.mark.parametrize("timeout", [None, 2.0], ids=["no-deadline", "deadline"])
def test_a_rank_without_micro_batches_fails_the_step_everywhere(comm, wrapper, timeout):
    """The last rank's loader runs dry: no micro-batch, no weight.  The step
    raises the same ValueError on every rank (not on that rank alone, with
    its peers waiting for it or going on a call ahead), nothing is applied,
    and the next step runs normally on every rank."""
    n = 600
    p = torch.nn.Parameter(torch.zeros(n, dtype=torch.float64))
    deadline = mt.ComputeDeadline(1e9, max_micro_batches=2)
    dry = comm.size - 1
    with mpilossy.Communicator(comm, timeout=timeout) as lc:
        wrap = mt.DistributedOptimizer if wrapper == "distributed" else mt.ShardedOptimizer
        opt = wrap(torch.optim.SGD([p], lr=1.0), [("p", p)], lc, compute_deadline=deadline)

        def step(number, loader):
            opt.zero_grad()
            for i, _ in zip(deadline, loader):
                (p * micro_gradient(comm.rank, number, i, n)).sum().backward()
            opt.step()

        message = all_ranks_raise(comm, lambda: step(0, [] if comm.rank == dry else [0, 1]),
                                  ValueError)
        messages = comm.allgather(message)
        assert all(m == messages[0] for m in messages), messages
        assert f"rank {dry}" in message and "micro-batch" in message, message
        assert torch.count_nonzero(p.detach()) == 0         # nothing applied
        step(1, [0, 1])
        grads = [micro_gradient(r, 1, i, n) for r in range(comm.size) for i in range(2)]
        torch.testing.assert_close(p.detach(), -torch.stack(grads).mean(dim=0),
                                   rtol=1e-10, atol=1e-10)
        assert opt.stats.delivered == 1.0
        assert same_on_every_rank(comm, p.detach().numpy())
