"""What a ShardedOptimizer step costs besides its communication, for the
example's 25M-parameter model on CPU tensors: with and without the host
mirror that parameters on a GPU go through (forced here), keeping or
extrapolating missed blocks (docs/gpu.md).

    mpiexec -n 2 python tests/programs/sharded_step_cost.py [LOSS]
"""
import sys
import time

import torch
from mpi4py import MPI

import mpilossy
import mpilossy.torch as mt
from mpilossy.examples.lm.model import TinyGPT
from mpilossy.torch import sharded

STEPS = 8


def main() -> None:
    comm = MPI.COMM_WORLD
    loss = float(sys.argv[1]) if len(sys.argv) > 1 else 0.0
    torch.set_num_threads(1)            # (as the example)
    for mirror in (False, True):
        for missed in ("keep", "extrapolate"):
            sharded.needs_mirror = (lambda d: True) if mirror else (lambda d: d.type != "cpu")
            model = TinyGPT(256, 64, 512, 8, 8)
            lc = mpilossy.Communicator(comm, timeout="auto", loss=mpilossy.loss.Bernoulli(
                loss, seed=1) if loss else None)
            opt = mt.ShardedOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-3),
                                      model.named_parameters(), lc, missed=missed)
            for p in model.parameters():
                p.grad = torch.randn_like(p) * 1e-3
            total = in_comm = 0.0
            for _ in range(STEPS):
                comm.Barrier()
                began = time.perf_counter()
                opt.step()
                total += time.perf_counter() - began
                in_comm += opt.stats.comm_seconds
            if comm.rank == 0:
                print(f"mirror={mirror} missed={missed}: step {1e3 * total / STEPS:.0f} ms, "
                      f"communication {1e3 * in_comm / STEPS:.0f} ms, "
                      f"the rest {1e3 * (total - in_comm) / STEPS:.0f} ms", flush=True)
            lc.free()


if __name__ == "__main__":
    main()
