"""Tiny models, data and reliable references for the mpilossy.torch tests.
Every value is computed from a seed, the rank and the step, so a test runs
at any number of ranks."""

from __future__ import annotations

import numpy as np
import torch
from mpi4py import MPI

IN, HIDDEN, OUT = 16, 48, 4          # 816 + 2,352 + 196 = 3,364 parameters


def make_model(seed: int = 0, dtype=torch.float32) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(
        torch.nn.Linear(IN, HIDDEN), torch.nn.Tanh(),
        torch.nn.Linear(HIDDEN, HIDDEN), torch.nn.Tanh(),
        torch.nn.Linear(HIDDEN, OUT)).to(dtype)


_TEACHER = torch.randn(IN, OUT, generator=torch.Generator().manual_seed(1234),
                       dtype=torch.float64) / 4


def batch(rank: int, step: int, n: int = 16, dtype=torch.float32):
    """Rank `rank`'s batch at `step`: inputs and the outputs of a fixed
    random teacher (so that the loss really goes down)."""
    g = torch.Generator().manual_seed(1000 * step + rank)
    x = torch.randn(n, IN, generator=g, dtype=torch.float64)
    return x.to(dtype), torch.sin(x @ _TEACHER).to(dtype)


def loss_of(model: torch.nn.Module, rank: int, step: int) -> torch.Tensor:
    dtype = next(model.parameters()).dtype
    x, y = batch(rank, step, dtype=dtype)
    return torch.nn.functional.mse_loss(model(x), y)


def backward(model: torch.nn.Module, rank: int, step: int) -> float:
    loss = loss_of(model, rank, step)
    loss.backward()
    return loss.item()


def reliable_average(comm: MPI.Comm, params) -> None:
    """The reference: every gradient averaged with MPI_Allreduce (float64)."""
    for p in params:
        g = p.grad.detach().to(torch.float64).numpy().copy()
        total = np.empty_like(g)
        comm.Allreduce(g, total)
        with torch.no_grad():
            p.grad.copy_(torch.from_numpy(total / comm.size))


def train_reference(comm: MPI.Comm, model: torch.nn.Module, optimizer, steps: int,
                    first_step: int = 0) -> None:
    for step in range(first_step, first_step + steps):
        optimizer.zero_grad()
        backward(model, comm.rank, step)
        reliable_average(comm, model.parameters())
        optimizer.step()


def flat(model_or_params) -> np.ndarray:
    params = (model_or_params.parameters() if isinstance(model_or_params, torch.nn.Module)
              else model_or_params)
    return np.concatenate([p.detach().to(torch.float64).reshape(-1).numpy() for p in params])


def gather_check(comm: MPI.Comm, ok: bool, detail: object = "") -> None:
    """Assert `ok` on every rank, after one collective (no rank left waiting)."""
    outcomes = comm.allgather((bool(ok), detail))
    bad = [(r, d) for r, (o, d) in enumerate(outcomes) if not o]
    assert not bad, f"failed on ranks: {bad}"


def same_on_every_rank(comm: MPI.Comm, values: np.ndarray) -> bool:
    return all(np.array_equal(v, values) for v in comm.allgather(values))


def assert_matches_reference(comm: MPI.Comm, model, ref) -> None:
    """Every rank's parameters equal the reference's and each other's
    (the collectives run before any assertion: no rank is left waiting)."""
    got, want = flat(model), flat(ref)
    identical = same_on_every_rank(comm, got)
    gather_check(comm, np.allclose(got, want, rtol=1e-5, atol=1e-6),
                 f"largest difference {np.abs(got - want).max():.3g}")
    assert identical, "ranks ended with different parameters without loss"
