"""The complete scripts of docs/training.md run as printed, on 1 rank and
for 20 steps instead of 200 (to save time: the other tests cover several
ranks)."""

import re
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch", reason="PyTorch is not installed (pip install torch)")

from helpers import HERE, clean_subprocess_env, is_singleton  # noqa: E402

pytestmark = pytest.mark.skipif(not is_singleton(), reason="starts its own mpiexec: runs at size 1")

DOC = HERE.parent / "docs" / "training.md"
SCRIPTS = re.findall(r"```python\n(# mpiexec -n 4 python (\w+)\.py.*?)```",
                     DOC.read_text(), re.S)


def test_the_page_has_three_scripts():
    assert [name for _, name in SCRIPTS] == ["train_ddp", "train_mpi", "train_sharded"]


@pytest.mark.parametrize("code,name", SCRIPTS, ids=[name for _, name in SCRIPTS])
def test_script_runs(tmp_path, code, name):
    script = tmp_path / f"{name}.py"
    assert code.count("range(200)") == 1
    script.write_text(code.replace("range(200)", "range(20)"))
    mpiexec = Path(sys.executable).parent / "mpiexec"
    out = subprocess.run([str(mpiexec), "-n", "1", sys.executable, str(script)],
                         capture_output=True, text=True, timeout=150, cwd=tmp_path,
                         env=clean_subprocess_env())
    assert out.returncode == 0, out.stderr[-3000:]
    last = out.stdout.strip().splitlines()[-1]
    assert last.startswith("step 20: loss") and "delivered" in last, out.stdout[-2000:]
