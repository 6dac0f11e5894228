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
import xml.etree.ElementTree as ET
from pathlib import Path

HERE = Path(__file__).resolve().parent


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


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="1,2,3,4")
    parser.add_argument("--timeout", type=float, default=1800,
                        help="seconds per size: a deadlock guard (every test has its own bound)")
    parser.add_argument("--per-test", type=float, default=180, help="seconds per test")
    args, pytest_args = parser.parse_known_args()
    mpiexec = shutil.which("mpiexec", path=os.path.dirname(sys.executable)) or "mpiexec"
    # Import once before any mpiexec: an editable install rebuilds on import,
    # and ranks starting together would all run ninja in the same build.
    subprocess.run([sys.executable, "-c", "import mpilossy._core, mpilossy._testing"], check=True)
    total = {"passed": 0, "failed": 0, "skipped": 0}
    failed_sizes = []
    for size in [int(s) for s in args.sizes.split(",")]:
        out = Path(tempfile.mkdtemp(prefix=f"mpilossy-tests-{size}-"))

        def pytest(tag: str, marks: str) -> list:
            return [sys.executable, "-m", "pytest", "--with-mpi", "-q", "-p", "no:cacheprovider",
                    "-m", marks, f"--timeout={args.per_test}", "--timeout-method=thread",
                    f"--junitxml={out}/{tag}-{{rank}}.xml", str(HERE), *pytest_args]

        # (tag, command, where its output goes); each in the folder `out`,
        # which also takes whatever the tests leave behind.
        if size == 1:
            runs = [("rank", pytest("rank", "not builds"), None),
                    ("builds", pytest("builds", "builds"), out / "builds.log")]
        else:
            # MPI tests only: the others ran at size 1 (deselected, not skipped)
            runs = [("rank", [mpiexec, "-n", str(size), "-outfile-pattern", str(out / "out.%r"),
                              "-errfile-pattern", str(out / "out.%r"), *pytest("rank", "mpi")],
                     subprocess.DEVNULL)]
        for tag, cmd, _ in runs:
            print(f"== {size} rank(s): {shlex.join(map(str, cmd))}", flush=True)
        began = time.monotonic()
        procs = []
        for tag, cmd, log in runs:
            if isinstance(log, Path):       # stdout and stderr to the file
                with open(log, "w") as sink:
                    # the builds: CPU left over by the timing-sensitive tests only
                    procs.append(subprocess.Popen(cmd, cwd=out, stdout=sink,
                                                  stderr=subprocess.STDOUT,
                                                  preexec_fn=lambda: os.nice(19)))
            else:
                procs.append(subprocess.Popen(cmd, cwd=out, stdout=log))
        codes = [finish(proc, began + args.timeout) for proc in procs]
        took = time.monotonic() - began
        # pytest's 5 is "no tests selected": fine for the builds run under -k.
        codes[1:] = [0 if c == 5 else c for c in codes[1:]]
        code = next((c for c in codes if c != 0), 0)
        if (out / "builds.log").exists():
            print("== 1 rank(s), the tests marked `builds` (run beside the others):")
            print((out / "builds.log").read_text(errors="replace"), end="", flush=True)
        counts = [count(xml) for xml in (out / f"{tag}-0.xml" for tag, _, _ in runs)
                  if xml.exists()]
        if len(counts) == len(runs):
            c = {key: sum(one[key] for one in counts) for key in counts[0]}
            total["passed"] += c["passed"]
            total["failed"] += c["failures"] + c["errors"]
            total["skipped"] += c["skipped"]
            line = (f"{c['passed']} passed, {c['failures'] + c['errors']} failed, "
                    f"{c['skipped']} skipped")
        else:
            line = "no results"
        print(f"== {size} rank(s): {line} in {took:.0f} s (exit {code})", flush=True)
        for xml in (out / f"{tag}-0.xml" for tag, _, _ in runs):
            if xml.exists():
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
