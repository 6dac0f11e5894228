"""The typed API (py.typed, the stubs of the compiled core, annotations):
a user script that uses the public API passes `mypy --strict`, one with a
type error does not, and the package itself type-checks.  mypy reads the
sources of this checkout (the repository root on its search path), so the
test checks what is being changed, not an older installed copy."""

import importlib.util
import sys
import textwrap
from pathlib import Path

import pytest

from helpers import ROOT, is_singleton, run_bounded

pytestmark = [
    pytest.mark.skipif(not is_singleton(), reason="starts its own mypy: runs at size 1"),
    pytest.mark.skipif(importlib.util.find_spec("mypy") is None,
                       reason="mypy is not installed (pip install mypy)"),
    pytest.mark.builds,     # not a build, but as long and as independent of the others
]

HAVE_TORCH = importlib.util.find_spec("torch") is not None
TIMEOUT = 170       # (pytest-timeout: 180 s a test); a cold cache with torch: about a minute

USER_SCRIPT = '''
from typing import List, Optional, Tuple

import numpy as np
import numpy.typing as npt
from mpi4py import MPI

import mpilossy
import mpilossy.loss
from mpilossy import CollectiveStats, Communicator, Contributors


def models() -> List[mpilossy.loss.LossModel]:
    bursts = mpilossy.loss.GilbertElliott(0.01, 0.5, seed=2)
    mean: float = bursts.mean_loss
    assert 0.0 <= mean <= 1.0
    return [mpilossy.loss.Bernoulli(0.1, seed=1), bursts,
            mpilossy.loss.Straggler(rank=0, delay=0.001, prob=0.5)]


def summary(stats: CollectiveStats) -> Tuple[float, float, bool, int, str, int]:
    delivered: float = stats.delivered
    elapsed: float = stats.elapsed
    hit: bool = stats.deadline_hit
    fewest: int = stats.min_contributors
    algorithm: str = stats.algorithm
    lost: int = sum(stats.lost_blocks)
    timeout: Optional[float] = stats.timeout
    assert timeout is None or timeout > 0
    assert 0.0 <= stats.fallback <= 1.0 and 0.0 <= stats.agreed <= 1.0
    return delivered, elapsed, hit, fewest, algorithm, lost + stats.seq + stats.nbytes


def main() -> None:
    comm: MPI.Intracomm = MPI.COMM_WORLD
    with Communicator(comm, timeout=0.05, loss=models(), scaling="zero-fill") as lc:
        x: npt.NDArray[np.float32] = np.ones(1000, np.float32)
        out = np.empty_like(x)
        print(summary(lc.allreduce(x, out, op="avg")))
        print(summary(lc.allreduce(x, op="sum", algorithm="direct", timeout=0.1)))
        lo, hi = lc.chunk_bounds(x.size)
        part = np.empty(hi - lo, np.float32)
        print(summary(lc.reduce_scatter(x, part, op="avg")))
        stats = lc.allgather(part, x)
        who: Optional[Contributors] = stats.contributors
        if who is not None:
            got: np.ndarray = who.received()
            print(got.mean(), who.fraction(), stats.contributed())
        print(lc.rank, lc.size, lc.calls, summary(stats))
    parsed: List[mpilossy.loss.LossModel] = mpilossy.loss.parse("bernoulli:0.1+ge:0.01,0.5")
    print(parsed, mpilossy.__version__)


main()
'''

TORCH_SCRIPT = '''
from typing import Optional

import torch
from mpi4py import MPI

import mpilossy
import mpilossy.torch as mt


def train(lc: mpilossy.Communicator) -> None:
    model = torch.nn.Linear(8, 2)
    mt.broadcast_parameters(model, comm=MPI.COMM_WORLD)
    opt = mt.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                  model.named_parameters(), lc, measure_every=10,
                                  tolerance=mt.PhaseAwareTolerance(critical_steps=10))
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    opt.synchronize()
    opt.step()
    opt.zero_grad()
    stats: Optional[mt.StepStats] = opt.stats
    if stats is not None:
        delivered: float = stats.delivered
        drift: Optional[float] = stats.drift
        print(delivered, drift, stats.comm_seconds)
    control: Optional[mt.DriftController] = opt.drift_control
    if control is not None:
        print(control.measure(), control.history)
    assert opt.communicator is lc and opt.error_feedback is None

    sharded = mt.ShardedOptimizer(torch.optim.Adam(model.parameters()), communicator=lc,
                                  resync_every=50, missed="extrapolate")
    sharded.step()
    sharded.resynchronize()
    wrapped: mt.WrappedOptimizer = sharded
    plain: torch.optim.Optimizer = sharded      # still an optimizer (LR schedulers)
    print(wrapped.stats, plain.param_groups, mt.measure_drift(model))


def hook(lc: mpilossy.Communicator) -> None:
    mt.init_process_group()
    ddp = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(8, 2))
    state = mt.AllreduceHookState(lc, op="avg", background=True)
    ddp.register_comm_hook(state, mt.allreduce_hook)
    print(state.stats, state.steps, state.bucket_stats)
    state.close()
    mt.destroy_process_group()
'''

BROKEN_SCRIPT = '''
import numpy as np

import mpilossy

x = np.ones(10, np.float32)
stats = mpilossy.allreduce(x)
print(stats.delivered + "x")
'''


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    """One mypy cache for the module: torch's stubs are analysed once."""
    return tmp_path_factory.mktemp("mypy-cache")


def mypy(args: list, cwd: Path, cache: Path) -> tuple:
    """Run mypy; returns (exit status, output)."""
    out = run_bounded([sys.executable, "-m", "mypy", "--cache-dir", str(cache), *args],
                      TIMEOUT, cwd=cwd)
    return out.returncode, out.stdout + out.stderr


def strict(tmp_path: Path, cache: Path, name: str, code: str) -> tuple:
    """mypy --strict on a script in tmp_path, with mpilossy from this
    checkout; the library's own modules are checked by test_package, not
    under --strict here."""
    config = tmp_path / "mypy.ini"
    config.write_text(f"[mypy]\nmypy_path = {ROOT}\n\n[mypy-mpilossy.*]\nignore_errors = True\n")
    script = tmp_path / name
    script.write_text(textwrap.dedent(code))
    return mypy(["--strict", "--config-file", str(config), str(script)], tmp_path, cache)


def test_user_script_passes_strict(tmp_path, cache):
    rc, output = strict(tmp_path, cache, "user.py", USER_SCRIPT)
    assert rc == 0, output


@pytest.mark.skipif(not HAVE_TORCH, reason="PyTorch is not installed (pip install torch)")
def test_torch_user_script_passes_strict(tmp_path, cache):
    rc, output = strict(tmp_path, cache, "user_torch.py", TORCH_SCRIPT)
    assert rc == 0, output


def test_type_error_is_caught(tmp_path, cache):
    rc, output = strict(tmp_path, cache, "broken.py", BROKEN_SCRIPT)
    assert rc == 1, output
    assert 'broken.py:8: error: Unsupported operand types for + ("float" and "str")' in output, \
        output


def test_package(cache):
    rc, output = mypy(["-p", "mpilossy", "--ignore-missing-imports"], ROOT, cache)
    assert rc == 0, output
    assert "Success: no issues found" in output, output
