"""ComputeDeadline (DropCompute): how many micro-batches a step runs under a
budget (on a fake clock), the auto budget agreed across ranks, and the
optimizer wrappers' weighted average: the reduced gradient is the mean over
every micro-batch of every rank, whatever each rank managed."""

import pytest

torch = pytest.importorskip("torch", reason="PyTorch is not installed (pip install torch)")

import numpy as np  # noqa: E402

import mpilossy  # noqa: E402
import mpilossy.torch as mt  # noqa: E402
from mpilossy.torch import compute  # noqa: E402
from helpers import all_ranks_raise  # noqa: E402


class Clock:
    """A perf_counter that moves only when a micro-batch 'computes'."""

    def __init__(self):
        self.now = 100.0

    def __call__(self):
        return self.now


@pytest.fixture
def clock(monkeypatch):
    c = Clock()
    monkeypatch.setattr(compute.time, "perf_counter", c)
    return c


def run_step(deadline, clock, seconds_each):
    """Iterate one step; micro-batch i takes seconds_each[i] (the last value
    repeats).  Returns how many ran."""
    n = 0
    for i in deadline:
        assert i == n
        clock.now += seconds_each[min(i, len(seconds_each) - 1)]
        n += 1
    assert deadline.micro_batches == n and deadline.weight == float(n)
    return n


def test_fixed_budget_stops_before_overrunning(clock):
    d = mt.ComputeDeadline(0.08, max_micro_batches=8)
    assert run_step(d, clock, [1 / 32]) == 2        # a third would end at 0.094 > 0.08
    assert run_step(d, clock, [1 / 64]) == 5        # a sixth would end at 0.094
    assert run_step(d, clock, [0.001]) == 8         # never more than the maximum
    assert run_step(d, clock, [1.0]) == 1           # at least one, however slow
    assert d.steps == 4 and d.cut_steps == 3          # all but the one that did 8


def test_prediction_uses_this_steps_mean(clock):
    d = mt.ComputeDeadline(0.1, max_micro_batches=10)
    # 0.05 then 0.01: mean 0.03, elapsed 0.06, the third predicted to end at
    # 0.09: it runs (0.04); then mean 0.033, elapsed 0.1: a fourth would overrun
    assert run_step(d, clock, [0.05, 0.01, 0.04]) == 3


def test_on_a_gpu_micro_batches_are_timed_when_their_work_is_done(clock, monkeypatch):
    """Kernels are queued at once and run later: on a CUDA device the time
    is read after torch.cuda.synchronize, which is where it passes."""
    synced = []

    def synchronize(device=None):
        synced.append(device)
        clock.now += 1 / 32                 # the queued work of one micro-batch
    monkeypatch.setattr(compute.torch.cuda, "synchronize", synchronize)
    on_gpu = mt.ComputeDeadline(0.08, max_micro_batches=8, device="cuda:0")
    assert run_step(on_gpu, clock, [0.0]) == 2      # as test_fixed_budget_stops_before...
    assert synced == [torch.device("cuda:0")] * 2
    on_cpu = mt.ComputeDeadline(0.08, max_micro_batches=8, device="cpu")
    assert run_step(on_cpu, clock, [0.0]) == 8 and len(synced) == 2


def test_weight_before_any_micro_batch():
    with pytest.raises(RuntimeError, match="iterate"):
        mt.ComputeDeadline(1.0, max_micro_batches=2).weight


@pytest.mark.parametrize("kwargs", [
    {"budget": 0}, {"budget": -1.0}, {"budget": float("nan")}, {"budget": "fast"},
    {"budget": True}, {"max_micro_batches": 0}, {"max_micro_batches": 2.0},
    {"slack": -0.1}, {"agree_every": 0}, {"history": 0}, {"device": "warp-drive"}])
def test_bad_arguments(kwargs):
    args = {"budget": 1.0, "max_micro_batches": 4, **kwargs}
    with pytest.raises(ValueError):
        mt.ComputeDeadline(args.pop("budget"), **args)


def test_auto_needs_a_communicator(clock):
    d = mt.ComputeDeadline("auto", max_micro_batches=2, agree_every=1)
    run_step(d, clock, [0.01])
    with pytest.raises(RuntimeError, match="communicator"):
        run_step(d, clock, [0.01])


@pytest.mark.mpi
def test_auto_budget_is_agreed(comm, clock):
    """Each rank computes at its own speed; after `agree_every` steps every
    rank holds the same budget: the median over ranks of their median time
    per micro-batch, times the maximum count, times 1 + slack."""
    speed = 0.01 * (1 + comm.rank)
    d = mt.ComputeDeadline("auto", max_micro_batches=4, comm=comm, slack=0.25, agree_every=3)
    for _ in range(3):
        assert run_step(d, clock, [speed]) == 4       # nothing is cut before agreeing
    run_step(d, clock, [speed])
    medians = sorted(0.01 * (1 + r) for r in range(comm.size))
    expected = float(np.median(medians)) * 4 * 1.25
    assert d.budget == pytest.approx(expected)
    assert comm.allgather(d.budget) == [d.budget] * comm.size
    if comm.size >= 3:
        assert d.micro_batches < 4 if comm.rank == comm.size - 1 else d.micro_batches == 4


# -- the optimizer wrappers: a weighted average over micro-batches -------------
def micro_gradient(rank, step, i, n):
    """The gradient of micro-batch i of `rank` at `step` (a linear loss)."""
    g = torch.Generator().manual_seed(1000 * rank + 10 * step + i)
    return torch.randn(n, generator=g, dtype=torch.float64)


@pytest.mark.mpi
@pytest.mark.parametrize("wrapper", ["distributed", "sharded"])
def test_reduced_gradient_is_the_mean_over_micro_batches(comm, wrapper):
    """Rank r runs r + 1 micro-batches: with SGD(lr=1) a step moves the
    parameters by minus the mean of all micro-batch gradients of all ranks
    (not the mean of the ranks' means)."""
    n, steps = 1000, 3
    p = torch.nn.Parameter(torch.zeros(n, dtype=torch.float64))
    inner = torch.optim.SGD([p], lr=1.0)
    deadline = mt.ComputeDeadline(1e9, max_micro_batches=comm.rank + 1)
    with mpilossy.Communicator(comm, timeout=5.0) as lc:
        if wrapper == "distributed":
            opt = mt.DistributedOptimizer(inner, [("p", p)], lc, compute_deadline=deadline)
        else:
            opt = mt.ShardedOptimizer(inner, [("p", p)], lc, compute_deadline=deadline)
        assert deadline.comm is not None
        expected = torch.zeros(n, dtype=torch.float64)
        for step in range(steps):
            opt.zero_grad()
            for i in deadline:
                (p * micro_gradient(comm.rank, step, i, n)).sum().backward()
            opt.step()
            grads = [micro_gradient(r, step, i, n) for r in range(comm.size) for i in range(r + 1)]
            expected -= torch.stack(grads).mean(dim=0)
            assert opt.stats.delivered == 1.0
        torch.testing.assert_close(p.detach(), expected, rtol=1e-10, atol=1e-10)


@pytest.mark.mpi
@pytest.mark.parametrize("case", ["error-feedback", "sum", "not-a-deadline"])
def test_wrappers_refuse_what_cannot_be_weighted(comm, case):
    p = torch.nn.Parameter(torch.zeros(10))
    deadline = mt.ComputeDeadline(1.0, max_micro_batches=2)
    scaling = "zero-fill" if case == "error-feedback" else "unbiased"
    with mpilossy.Communicator(comm, timeout=1.0, scaling=scaling) as lc:
        kwargs = {"compute_deadline": "1s" if case == "not-a-deadline" else deadline}
        if case == "error-feedback":
            kwargs["error_feedback"] = True
        if case == "sum":
            kwargs["op"] = "sum"
        exc = TypeError if case == "not-a-deadline" else ValueError
        for wrap in (mt.DistributedOptimizer, mt.ShardedOptimizer):
            all_ranks_raise(comm, lambda: wrap(torch.optim.SGD([p], lr=0.1), [("p", p)], lc,
                                               **kwargs), exc)
