"""Helpers shared by the tests."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Optional

import numpy as np
from mpi4py import MPI

DTYPES = [np.float16, np.float32, np.float64, np.int32, np.int64]
FLOATS = [np.float16, np.float32, np.float64]
HERE = Path(__file__).resolve().parent         # tests/
ROOT = HERE.parent                               # the checkout
PROGRAMS = HERE / "programs"                     # MPI programs the tests launch


def module_path(name: str) -> Path:
    """The test module `name` (tests/ mirrors the source in folders)."""
    found = sorted(HERE.rglob(name))
    assert len(found) == 1, (name, found)
    return found[0]


def small_ints(n: int, rank: int, dtype) -> np.ndarray:
    """Values whose sums over up to 4 ranks are exact in every dtype,
    float16 included, so results can be compared bit for bit."""
    return ((np.arange(n, dtype=np.int64) * 7 + 3 * rank) % 23 + rank).astype(dtype)


def mpi_sum(comm: MPI.Comm, x: np.ndarray) -> np.ndarray:
    """The reference: MPI_Allreduce through mpi4py (float16 through float64)."""
    if x.dtype == np.float16:
        wide = np.empty(x.shape, np.float64)
        comm.Allreduce(x.astype(np.float64), wide)
        return wide.astype(np.float16)
    out = np.empty_like(x)
    comm.Allreduce(x, out)
    return out


def same_everywhere(comm: MPI.Comm, value) -> bool:
    values = comm.allgather(value)
    return all(v == values[0] for v in values)


def _outcome(fn, exc_type) -> tuple:
    """("raised", message), ("wrong", type and message) or ("returned", ...)."""
    try:
        fn()
    except exc_type as exc:
        return "raised", str(exc)
    except Exception as exc:  # wrong type: report which
        return "wrong", f"{type(exc).__name__}: {exc}"
    return "returned", "no exception"


def all_ranks_raise(comm: MPI.Comm, fn, exc_type) -> str:
    """Run fn(); assert it raised exc_type on *every* rank; return the message."""
    outcomes = comm.allgather(_outcome(fn, exc_type))
    bad = [(r, m) for r, (o, m) in enumerate(outcomes) if o != "raised"]
    assert not bad, f"expected {exc_type.__name__} on every rank, got: {bad}"
    return outcomes[comm.rank][1]


def all_ranks_raise_by_next_call(comm: MPI.Comm, fn, then, exc_type,
                                 deadline: float = None) -> str:
    """The rule of a call with a deadline: fn() raises exc_type on every
    rank, or, where some rank had already returned from it when the failure
    was found (its deadline ended first, say because the culprit entered the
    call later than that on a loaded machine), the next call, then(), raises
    exc_type on every rank, naming the first.  A rank may have returned only
    by waiting out its `deadline` (seconds): one that returned sooner did
    not learn what it should have.  Returns fn's message.
    `then` None (a call without deadline): fn() must raise on every rank."""
    if then is None:
        return all_ranks_raise(comm, fn, exc_type)
    assert deadline is not None, "a call with a deadline: say which"
    began = time.monotonic()
    outcome = _outcome(fn, exc_type)
    first = comm.allgather((*outcome, time.monotonic() - began))
    wrong = [(r, m) for r, (o, m, _) in enumerate(first) if o == "wrong"]
    assert not wrong, f"expected {exc_type.__name__} on every rank, got: {wrong}"
    raised = [m for o, m, _ in first if o == "raised"]
    assert raised, f"expected {exc_type.__name__}: no rank raised"
    if len(raised) == len(first):
        return first[comm.rank][1]
    early = [(r, took) for r, (o, _, took) in enumerate(first)
             if o == "returned" and took < 0.9 * deadline]
    assert not early, f"ranks returned before their {deadline} s deadline ended: {early}"
    second = comm.allgather(_outcome(then, exc_type))
    bad = [(r, first[r], m) for r, (o, m) in enumerate(second)
           if o != "raised" or (first[r][0] == "returned" and "failed after rank" not in m)]
    assert not bad, f"some ranks returned from the failed call, and the next did not " \
        f"fail on every rank naming it: {bad}"
    return raised[0]


# The learned deadline's rule as docs/deadlines.md states it (not read from
# the code, so that a changed factor fails the tests that use it).
DOCUMENTED_FACTOR = 4.0


def learned_as_documented(lc, stats) -> tuple:
    """(the learned deadline a call used, what the documented rule gives
    from what the ranks agreed in this run: FACTOR * scale * the agreed
    95th percentile of the call's kind, within [floor, cap])."""
    from mpilossy.call.stats import ALGORITHM_NAMES, COLLECTIVE_NAMES
    from mpilossy.control.deadline import size_bucket
    auto = lc._state.auto
    code = {name: c for c, name in COLLECTIVE_NAMES.items()}[stats.collective]
    algo = {name: a for a, name in ALGORITHM_NAMES.items()}[stats.algorithm]
    kind = (code, algo, size_bucket(stats.nbytes))
    rule = min(max(DOCUMENTED_FACTOR * auto.scale * auto.agreed[kind], auto.floor), auto.cap)
    return stats.timeout, rule, auto.agreed[kind]


def failures_in_turn(comm: MPI.Comm, lc, rounds: int, took: Optional[list] = None) -> list:
    """Each rank in turn (round r: rank r % size) fails three calls in a
    row (a read-only output), then one good call follows; nothing
    synchronises the ranks.  Returns this rank's outcome of every call:
    "BufferError", "exact", "partial" (returned, not the exact sum), or
    the type and message of any other exception; appends each call's
    seconds to `took`, if given."""
    x = small_ints(1001, comm.rank, np.int64)
    want = mpi_sum(comm, x)
    seen = []
    for r in range(rounds):
        for call in range(4):
            out = np.full_like(x, -1)
            recv = out
            if comm.rank == r % comm.size and call < 3:
                recv = out.copy()
                recv.flags.writeable = False
            began = time.perf_counter()
            try:
                lc.allreduce(x, recv)
                seen.append("exact" if np.array_equal(out, want) else "partial")
            except BufferError:
                seen.append("BufferError")
            except Exception as exc:     # noqa: BLE001 (reported by the caller)
                seen.append(f"{type(exc).__name__}: {exc}")
            if took is not None:
                took.append(time.perf_counter() - began)
    return seen


def clean_subprocess_env(**extra: str) -> dict:
    """Environment for a child `mpiexec`: no PMI/hydra variables inherited from
    the mpiexec that runs the test suite."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("PMI_", "PMIX_", "HYDRA_", "MPIR_CVAR_", "OMPI_", "UCX_"))}
    env.update(extra)
    return env


def run_bounded(cmd: list, timeout: float, env: dict = None, **kwargs) -> subprocess.CompletedProcess:
    """subprocess.run, but on timeout the whole process group dies: an mpiexec
    killed alone leaves its ranks waiting forever in MPI calls."""
    proc = subprocess.Popen([str(c) for c in cmd], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True, **kwargs)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        raise AssertionError(f"timed out after {timeout} s: {' '.join(map(str, cmd))}\n"
                             f"{out[-2000:]}{err[-2000:]}") from None
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


def mpiexec() -> str:
    path = Path(sys.executable).parent / "mpiexec"
    return str(path) if path.exists() else "mpiexec"


def json_reports(stdout: str, opening: str = '{"rank"') -> list:
    """The JSON objects that ranks printed, each starting with `opening`
    (Hydra may forward two ranks' lines as one)."""
    decoder, out, at = json.JSONDecoder(), [], stdout.find(opening)
    while at >= 0:
        obj, end = decoder.raw_decode(stdout, at)
        out.append(obj)
        at = stdout.find(opening, end)
    return out


def elastic_run(program: str, ranks: int, *args: str, timeout: float = 90,
                **env: str) -> tuple:
    """A program of tests/programs under its own ``mpiexec
    -disable-auto-cleanup`` (ranks exit mid-run): (reports, output)."""
    cmd = [mpiexec(), "-disable-auto-cleanup", "-n", str(ranks), sys.executable,
           str(PROGRAMS / program), *args]
    # (a crash prints its Python stack: PYTHONFAULTHANDLER)
    proc = run_bounded(cmd, timeout, clean_subprocess_env(PYTHONFAULTHANDLER="1", **env))
    return json_reports(proc.stdout), proc.stdout + proc.stderr


def run_mpi_script(script: str, nprocs: int, *args: str, timeout: float = 120,
                   prefix: tuple = (), options: tuple = (), **env: str):
    """Run tests/programs/<script> under its own mpiexec (after `prefix`, e.g.
    `ip netns exec NAME`; with mpiexec `options`), bounded; return
    CompletedProcess."""
    cmd = [*prefix, mpiexec(), *options, "-n", str(nprocs), sys.executable,
           str(PROGRAMS / script), *args]
    return run_bounded(cmd, timeout, clean_subprocess_env(**env))


def join_after_loss(job: list, env: dict, port: Path, **kwargs) -> list:
    """Run tests/programs/join_by_port.py: `job` (its launcher command for
    the "job" role) in the background, then the newcomer as a singleton
    outside it, both bounded; assert the newcomer succeeded; return every
    JSON line both printed (check_joined checks them)."""
    proc = subprocess.Popen([str(c) for c in job], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True, **kwargs)
    try:
        new = run_bounded([sys.executable, str(PROGRAMS / "join_by_port.py"), "new", str(port)],
                          60, clean_subprocess_env())
        out, _ = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:         # (a launcher killed alone leaves its ranks)
            os.killpg(proc.pid, signal.SIGKILL)
    assert new.returncode == 0, new.stdout + new.stderr[-2000:]
    return json_reports(out + new.stdout)


def check_joined(lines: list, survivors: int) -> None:
    """tests/programs/join_by_port.py's lines: every survivor and the
    newcomer report one merged communicator of survivors + 1 ranks, the
    newcomer last, and the sum over it."""
    size = survivors + 1
    assert sorted(r["rank"] for r in lines) == list(range(size)), lines
    for r in lines:
        assert r["size"] == size and r["sum"] == size * (size + 1) // 2, r
        assert (r["role"] == "new") == (r["rank"] == size - 1), r


def last_report(stdout: str, stderr: str = "") -> dict:
    """The last JSON object a program printed on a line of its own (a
    library may print warnings on stdout too: UCX at MPI_Finalize)."""
    lines = [line for line in stdout.splitlines() if line.startswith("{")]
    assert lines, stdout[-2000:] + stderr[-3000:]
    return json.loads(lines[-1])


def program_report(script: str, nprocs: int, *args: str, timeout: float = 150,
                   **env: str) -> dict:
    """Run tests/programs/<script> (run_mpi_script), which prints one JSON
    line from rank 0 with a "failures" list; assert it ran and nothing
    failed; return that line."""
    proc = run_mpi_script(script, nprocs, *args, timeout=timeout, **env)
    result = last_report(proc.stdout, proc.stderr)
    assert proc.returncode == 0 and not result["failures"], result
    return result


def unavailable(reason: str) -> None:
    """What a test needs of the machine is missing.  On a developer's
    machine that is a skip; in CI (CI=true), where scripts/setup.sh and
    scripts/system-packages.sh install all of it (root, ip, tc, nft, the
    single-node Slurm), a failure: a broken set-up must not pass as skips."""
    import pytest
    if os.environ.get("CI", "").lower() in ("1", "true", "yes"):
        pytest.fail(f"CI=true: {reason} (the project's set-up provides it)")
    pytest.skip(reason)


def cpu_wait() -> float:
    """Seconds the calling thread has spent runnable but waiting for a CPU
    (the kernel's schedstat run_delay).  A deadline test subtracts what a
    call's thread waited from its elapsed time: on two cores shared by four
    ranks and a build, the scheduler's delays are measured, not guessed.
    0.0 where the kernel does not report it: then nothing is excused."""
    try:
        with open("/proc/thread-self/schedstat") as f:
            return int(f.read().split()[1]) * 1e-9
    except (OSError, IndexError, ValueError):
        return 0.0


def is_singleton() -> bool:
    return MPI.COMM_WORLD.size == 1


def build_package(tmp_path: Path, *meson_options: str, timeout: float = 300) -> Path:
    """Build the checkout with meson `meson_options` into tmp_path and lay out
    an importable copy of the package; returns the folder for PYTHONPATH."""
    import shutil
    root = HERE.parent
    bindir = os.path.dirname(sys.executable)
    build = tmp_path / "build"
    for cmd in ([os.path.join(bindir, "meson"), "setup", str(build), str(root), *meson_options],
                [os.path.join(bindir, "ninja"), "-C", str(build)]):
        proc = run_bounded(cmd, timeout, clean_subprocess_env())
        assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    pkg = tmp_path / "pkg"
    shutil.copytree(root / "mpilossy", pkg / "mpilossy")
    for so in build.glob("*.so"):     # _core and _testing
        shutil.copy(so, pkg / "mpilossy")
    return pkg


def importing_from(pkg: Path, *more_paths: Path, **extra: str) -> dict:
    """Environment for a child Python that must import mpilossy from `pkg`
    (a build_package copy) rather than the installed one.  PYTHONPATH is not
    enough under an editable install: meson-python's import hook comes before
    it, so the child is told to skip the hook's build (MESONPY_EDITABLE_SKIP,
    the switch the hook itself uses while it rebuilds), and conftest.py checks
    that mpilossy really came from `pkg` (MPILOSSY_TEST_PACKAGE)."""
    hooks = [f._build_path for f in sys.meta_path if hasattr(f, "_build_path")]
    skip = os.pathsep.join([os.environ.get("MESONPY_EDITABLE_SKIP", ""), *hooks])
    return clean_subprocess_env(PYTHONPATH=os.pathsep.join(map(str, (pkg, *more_paths))),
                                MESONPY_EDITABLE_SKIP=skip, MPILOSSY_TEST_PACKAGE=str(pkg),
                                **extra)


def imported_from(pkg: Path) -> bool:
    """Is the imported mpilossy (package and compiled core) the copy in `pkg`?"""
    import mpilossy
    import mpilossy._core
    return all(Path(m.__file__).resolve().is_relative_to(Path(pkg).resolve())
               for m in (mpilossy, mpilossy._core))


def check_weighted_signatures(out: np.ndarray, contributors, weights: np.ndarray,
                              rtol: float) -> int:
    """Rank r sent 2**r with weight weights[r]: every block of `out` must be
    sum(w_r 2**r) / sum(w_r) over exactly the ranks its bitmap names.
    Returns how many blocks missed some rank."""
    partial = 0
    firsts, lengths = contributors.blocks()
    for first, length, who in zip(firsts, lengths, contributors.members()):
        if length == 0:
            continue
        ranks = np.flatnonzero(who)
        assert ranks.size >= 1
        expected = float(np.sum(weights[ranks] * 2.0 ** ranks) / weights[ranks].sum())
        np.testing.assert_allclose(out[first:first + length], expected, rtol=rtol)
        partial += ranks.size < contributors.size
    return partial
