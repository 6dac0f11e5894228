"""Run the test suite at 1, 2, 3 and 4 ranks and add up the results.

    python tests/run.py                 # sizes 1,2,3,4
    python tests/run.py --sizes 2,4 -k ring

Size 1 runs every test (including those that start their own mpiexec);
larger sizes run the MPI tests (marked mpi) only.  At size 1 the tests
marked `builds` (they build their own copies and environments: mostly one
compiler or pip on one core) run in a second pytest beside the others, at
the lowest CPU priority (nice 19), so that the timing-sensitive tests keep
the cores whenever they need them.
Each size is bounded by --timeout seconds (and every single test by
pytest-timeout), so a deadlock fails fast; a size past its bound is
interrupted first, so that pytest still reports what failed.

A test past its own bound ends its whole session (pytest-timeout's thread
method exits the process; a crash does too), which would lose every result
after it.  So each session keeps a ledger (tests/run_plugin.py, --ledger):
when one ends without its JUnit file, the tests that finished are counted
from the ledger, and a new session starts after them.  The test that was
running gets one more try, said in the report; if it ends a session again,
it counts as failed.

A test that fails (an assertion, not a second end of its session) is run
once more, alone, after every session of its size has ended (so no build
runs beside it): one rerun per test, and only where at most RERUNS tests of
the size failed (more is a regression, not noise).  A test that passes on
its rerun counts as passed and is named in the report ("passed on its
rerun"); one that fails again counts as failed.  docs/testing.md lists the
tests seen to need it, and why.
"""

from __future__ import annotations

import argparse
import os
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import threading
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Callable, List, Optional, Tuple

HERE = Path(__file__).resolve().parent
RERUNS = 5      # the most failed tests of one size that are run once more


def count(xml_file: Path) -> dict:
    root = ET.parse(xml_file).getroot()
    suites = [root] if root.tag == "testsuite" else list(root.iter("testsuite"))
    totals = {"tests": 0, "failures": 0, "errors": 0, "skipped": 0}
    for suite in suites:
        for key in totals:
            totals[key] += int(suite.get(key, 0))
    totals["passed"] = totals["tests"] - totals["failures"] - totals["errors"] - totals["skipped"]
    return totals


def skip_reasons(xml_file: Path) -> dict:
    """Why the tests of a JUnit file skipped: reason -> how many."""
    reasons: dict = {}
    for case in ET.parse(xml_file).getroot().iter("testcase"):
        for skipped in case.iter("skipped"):
            why = (skipped.get("message") or "").strip()[:100]
            reasons[why] = reasons.get(why, 0) + 1
    return reasons


def finish(proc: subprocess.Popen, deadline: float) -> object:
    """Wait for `proc` until `deadline`; past it, interrupt it (pytest then
    tears down, prints its failures and writes its JUnit file) and kill it if
    that takes more than a minute.  Returns the exit status or "timeout"."""
    try:
        return proc.wait(timeout=max(0.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        return "timeout"


def ledger_outcomes(path: Path) -> Tuple[dict, Optional[str]]:
    """({test id: passed/failed/skipped} of the tests that finished, the test
    that was running when the session ended, or None)."""
    phases: dict = {}
    finished, running = [], None
    lines = path.read_text(errors="replace").splitlines() if path.exists() else []
    for line in lines:
        fields = line.split("\t")
        if fields[0] == "start" and len(fields) == 2:
            running = fields[1]
        elif fields[0] == "end" and len(fields) == 2:
            finished.append(fields[1])
            running = None
        elif len(fields) == 3:
            phases.setdefault(fields[2], []).append(fields[1])
    outcomes = {}
    for test in finished:
        seen = phases.get(test, [])
        outcomes[test] = ("failed" if "failed" in seen else
                          "skipped" if "skipped" in seen else "passed")
    return outcomes, running


def ledger_rootdir(path: Path) -> Optional[Path]:
    """The rootdir the ledger's test ids are relative to (run_plugin.py)."""
    lines = path.read_text(errors="replace").splitlines() if path.exists() else []
    for line in lines:
        fields = line.split("\t")
        if fields[0] == "rootdir" and len(fields) == 2:
            return Path(fields[1])
    return None


class Session:
    """One pytest session of a size (`command(junit, ledger, done)` makes
    its command line), resumed after it ends without a JUnit file."""

    ATTEMPTS = 4

    def __init__(self, tag: str, command: Callable[[str, Path, Path], List[str]], out: Path,
                 log: object, nice: bool) -> None:
        self.tag, self.command, self.out, self.log, self.nice = tag, command, out, log, nice
        self.counts: Optional[dict] = None
        self.code: object = None
        self.notes: List[str] = []
        self.junit: List[Path] = []
        self.ledgers: List[Path] = []
        self.twice: set = set()       # tests that ended their session twice

    def first_command(self) -> List[str]:
        return self.command(str(self.out / f"{self.tag}-1-{{rank}}.xml"),
                            self.out / f"{self.tag}-ledger-1.tsv", self.out / f"{self.tag}-done.txt")

    def run(self, deadline: float) -> None:
        done = self.out / f"{self.tag}-done.txt"
        done.write_text("")
        carried = {"passed": 0, "failed": 0, "skipped": 0}
        retried: set = set()
        for attempt in range(1, self.ATTEMPTS + 1):
            junit = self.out / f"{self.tag}-{attempt}-0.xml"
            ledger = self.out / f"{self.tag}-ledger-{attempt}.tsv"
            self.ledgers.append(ledger)
            cmd = self.command(str(self.out / f"{self.tag}-{attempt}-{{rank}}.xml"), ledger, done)
            self.code = self.start(cmd, deadline)
            if junit.exists():
                self.junit.append(junit)
                c = count(junit)
                self.counts = {"passed": carried["passed"] + c["passed"],
                               "failed": carried["failed"] + c["failures"] + c["errors"],
                               "skipped": carried["skipped"] + c["skipped"]}
                return
            outcomes, running = ledger_outcomes(ledger)
            for outcome in outcomes.values():
                carried[outcome] += 1
            finished = list(outcomes)
            if running is None or self.code == "timeout" or time.monotonic() >= deadline:
                self.notes.append(f"session {attempt} ended (exit {self.code}) with no test "
                                  "running, or past the size's bound: not resumed")
                self.counts = None
                return
            if running in retried:
                carried["failed"] += 1
                self.twice.add(running)
                finished.append(running)
                self.notes.append(f"{running} ended its session again (exit {self.code}): "
                                  "counted as failed")
            else:
                retried.add(running)
                self.notes.append(f"{running} ended session {attempt} (exit {self.code}: past "
                                  "its per-test bound, or a crash); resumed there, that test "
                                  "tried once more")
            with open(done, "a") as fh:
                fh.writelines(test + "\n" for test in finished)
        self.notes.append(f"{self.ATTEMPTS} sessions ended early: not resumed again")

    def outcomes(self) -> dict:
        """{test id: outcome} over every attempt's ledger (rank 0's)."""
        seen: dict = {}
        for ledger in self.ledgers:
            seen.update(ledger_outcomes(ledger)[0])
        return seen

    def failed_tests(self) -> List[str]:
        """The tests that failed (not those that ended their session twice:
        they had their second try), as paths pytest can be given."""
        root = next((r for r in map(ledger_rootdir, self.ledgers) if r is not None), None)
        failed = [t for t, outcome in self.outcomes().items()
                  if outcome == "failed" and t not in self.twice]
        return [str(root / t) if root is not None else t for t in failed]

    def start(self, cmd: List[str], deadline: float) -> object:
        if isinstance(self.log, Path):      # stdout and stderr to the file
            with open(self.log, "a") as sink:
                # the builds: CPU left over by the timing-sensitive tests only
                proc = subprocess.Popen(cmd, cwd=self.out, stdout=sink, stderr=subprocess.STDOUT,
                                        preexec_fn=(lambda: os.nice(19)) if self.nice else None)
                return finish(proc, deadline)
        return finish(subprocess.Popen(cmd, cwd=self.out, stdout=self.log), deadline)


def rerun_report(size: int, reruns: List[Tuple[Session, List[str]]]) -> List[str]:
    """Print which failed tests passed on their rerun; return those that did not."""
    again = []
    for session, (test,) in reruns:
        outcomes = session.outcomes()
        ok = session.counts is not None and session.counts["passed"] == 1 and all(
            o == "passed" for o in outcomes.values()) and len(outcomes) == 1
        if not ok:
            again.append(test)
        verdict = "passed on its rerun" if ok else f"failed again on its rerun ({outcomes})"
        print(f"== {size} rank(s): failed, run once more: {test}: {verdict}", flush=True)
    return again


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="1,2,3,4")
    parser.add_argument("--timeout", type=float, default=2400,
                        help="seconds per size: a deadlock guard (every test has its own bound)")
    parser.add_argument("--per-test", type=float, default=180, help="seconds per test")
    parser.add_argument("--path", default=str(HERE), help="the tests to run (default: all)")
    args, pytest_args = parser.parse_known_args()
    mpiexec = shutil.which("mpiexec", path=os.path.dirname(sys.executable)) or "mpiexec"
    # Import once before any mpiexec: an editable install rebuilds on import,
    # and ranks starting together would all run ninja in the same build.
    subprocess.run([sys.executable, "-c", "import mpilossy._core, mpilossy._testing"], check=True)
    total = {"passed": 0, "failed": 0, "skipped": 0}
    failed_sizes = []
    for size in [int(s) for s in args.sizes.split(",")]:
        out = Path(tempfile.mkdtemp(prefix=f"mpilossy-tests-{size}-"))

        def pytest(marks: str, launcher: Tuple[str, ...] = (),
                   paths: Optional[List[str]] = None) -> Callable:
            def command(junit: str, ledger: Path, done: Path) -> List[str]:
                return [*launcher, sys.executable, "-m", "pytest", "--with-mpi", "-q",
                        "-p", "no:cacheprovider", "-m", marks, f"--timeout={args.per_test}",
                        "--timeout-method=thread", f"--junitxml={junit}", "--ledger", str(ledger),
                        "--ledger-done", str(done), *(paths or [args.path]), *pytest_args]
            return command

        # Each session runs in the folder `out`, which also takes whatever
        # the tests leave behind.
        if size == 1:
            marks, launcher, log = ["not builds", "builds"], (), None
            sessions = [Session("rank", pytest(marks[0]), out, log, False),
                        Session("builds", pytest(marks[1]), out, out / "builds.log", True)]
        else:
            # MPI tests only: the others ran at size 1 (deselected, not skipped)
            marks, log = ["mpi"], subprocess.DEVNULL
            launcher = (mpiexec, "-n", str(size), "-outfile-pattern", str(out / "out.%r"),
                        "-errfile-pattern", str(out / "out.%r"))
            sessions = [Session("rank", pytest(marks[0], launcher), out, log, False)]
        for session in sessions:
            print(f"== {size} rank(s): {shlex.join(map(str, session.first_command()))}", flush=True)
        began = time.monotonic()
        threads = [threading.Thread(target=session.run, args=(began + args.timeout,))
                   for session in sessions]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        # each failed test once more, alone, once no build runs beside
        failed_first = [(m, s.failed_tests()) for m, s in zip(marks, sessions)]
        reruns: List[Tuple[Session, List[str]]] = []
        if 0 < sum(len(tests) for _, tests in failed_first) <= RERUNS:
            for m, tests in failed_first:
                for n, test in enumerate(tests):
                    rerun = Session(f"rerun-{m.replace(' ', '-')}-{n}",
                                    pytest(m, launcher, [test]), out, log, False)
                    rerun.run(began + args.timeout + 600)
                    reruns.append((rerun, [test]))
        took = time.monotonic() - began
        # pytest's 5 is "no tests selected": fine for the builds run under -k.
        codes = [sessions[0].code] + [0 if s.code == 5 else s.code for s in sessions[1:]]
        code = next((c for c in codes if c != 0), 0)
        if (out / "builds.log").exists():
            print("== 1 rank(s), the tests marked `builds` (run beside the others):")
            print((out / "builds.log").read_text(errors="replace"), end="", flush=True)
        for session in sessions:
            for note in session.notes:
                print(f"== {size} rank(s), {session.tag}: {note}", flush=True)
        counts = [s.counts for s in sessions if s.counts is not None]
        if len(counts) == len(sessions):
            c = {key: sum(one[key] for one in counts) for key in counts[0]}
            again = rerun_report(size, reruns)
            if reruns and not again and c["failed"] == len(reruns) and all(
                    s.code in (0, 1, 5) for s in sessions):
                code = 0        # (every failure passed on its rerun, said above)
            c["passed"] += len(reruns) - len(again)
            c["failed"] -= len(reruns) - len(again)
            for key in total:
                total[key] += c[key]
            line = f"{c['passed']} passed, {c['failed']} failed, {c['skipped']} skipped"
            if c["failed"] and code == 0:
                code = 1            # (a test counted failed from a ledger)
        else:
            line = "no results"
        print(f"== {size} rank(s): {line} in {took:.0f} s (exit {code})", flush=True)
        for xml in (junit for s in sessions for junit in s.junit):
            for why, n in sorted(skip_reasons(xml).items(), key=lambda kv: -kv[1]):
                print(f"   skipped {n:4d}: {why}", flush=True)
        if code != 0:
            failed_sizes.append(size)
            if size > 1:
                for rank_out in sorted(out.glob("out.*")):
                    print(f"---- {rank_out.name} (last lines) ----")
                    print("\n".join(rank_out.read_text(errors="replace").splitlines()[-60:]))
    if failed_sizes:
        total["failed"] = max(total["failed"], 1)
    print(f"{total['passed']} passed, {total['failed']} failed, {total['skipped']} skipped")
    return 1 if failed_sizes else 0


if __name__ == "__main__":
    sys.exit(main())
