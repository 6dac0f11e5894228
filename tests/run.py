"""Run the test suite at 1, 2, 3 and 4 ranks and add up the results.

    python tests/run.py                 # sizes 1,2,3,4
    python tests/run.py --sizes 2,4 -k ring

Size 1 runs every test (including those that start their own mpiexec);
larger sizes run the MPI tests (marked mpi) only.  Each size is bounded by --timeout
seconds (and every single test by pytest-timeout), so a deadlock fails fast.
"""

from __future__ import annotations

import argparse
import os
import shutil
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


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="1,2,3,4")
    parser.add_argument("--timeout", type=float, default=900, help="seconds per size")
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
        cmd = [sys.executable, "-m", "pytest", "--with-mpi", "-q", "-p", "no:cacheprovider",
               f"--timeout={args.per_test}", "--timeout-method=thread",
               f"--junitxml={out}/rank-{{rank}}.xml", str(HERE)]
        if size > 1:
            # MPI tests only: the others ran at size 1 (deselected, not skipped)
            cmd[5:5] = ["-m", "mpi"]
            cmd = [mpiexec, "-n", str(size), "-outfile-pattern", str(out / "out.%r"),
                   "-errfile-pattern", str(out / "out.%r")] + cmd
        cmd += pytest_args
        print(f"== {size} rank(s): {' '.join(cmd)}", flush=True)
        began = time.monotonic()
        try:
            # In a folder of its own: the JUnit files and whatever tests leave.
            proc = subprocess.run(cmd, timeout=args.timeout, cwd=out,
                                  stdout=None if size == 1 else subprocess.DEVNULL)
            code = proc.returncode
        except subprocess.TimeoutExpired:
            code = "timeout"
        took = time.monotonic() - began
        xml = out / "rank-0.xml"
        if xml.exists():
            c = count(xml)
            total["passed"] += c["passed"]
            total["failed"] += c["failures"] + c["errors"]
            total["skipped"] += c["skipped"]
            line = (f"{c['passed']} passed, {c['failures'] + c['errors']} failed, "
                    f"{c['skipped']} skipped")
        else:
            line = "no results"
        print(f"== {size} rank(s): {line} in {took:.0f} s (exit {code})", flush=True)
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
