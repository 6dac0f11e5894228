"""A throw-away single-node Slurm for the tests of jobs/.

Everything lives in one temporary folder: munge's key and socket, slurm.conf,
state, spool and logs.  The daemons (munged, slurmctld, slurmd) run in the
foreground as children of the test, listen on 127.0.0.1 only, and are stopped
by `SingleNodeSlurm.stop()`, which also ends any process that still carries
this cluster's SLURM_CONF in its environment (job steps left by a failed test).
"""

from __future__ import annotations

import os
import pwd
import random
import re
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Optional

from helpers import unavailable, clean_subprocess_env

JOBS = Path(__file__).resolve().parent.parent / "jobs"
# One node, 4 tasks of 1 CPU, 3 minutes: command-line options override the
# templates' #SBATCH lines, as a user would do for a quick try.
SMALL = ("--nodes=1", "--ntasks-per-node=4", "--cpus-per-task=1", "--time=3")
DAEMONS = ("munged", "slurmctld", "slurmd")
CLIENTS = ("sbatch", "srun", "scontrol", "sinfo", "scancel")
PACKAGES = ("slurm-wlm", "munge")


def _missing() -> list:
    return [p for p in DAEMONS + CLIENTS if not shutil.which(p, path=_sbin_path())]


def _sbin_path() -> str:
    return os.environ.get("PATH", "") + ":/usr/sbin:/sbin"


def ensure_slurm(install_timeout: float = 120) -> Optional[str]:
    """Install Debian's slurm-wlm and munge if they are missing.  Returns None
    when Slurm is there, else why not (for pytest.skip)."""
    if not _missing():
        return None
    if os.geteuid() != 0:
        return f"Slurm is not installed ({', '.join(_missing())} missing) and installing needs root"
    if not shutil.which("apt-get"):
        return f"Slurm is not installed ({', '.join(_missing())} missing) and there is no apt-get"
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    install = ["apt-get", "install", "-y", "-q", "--no-install-recommends", *PACKAGES]
    log = []
    began = time.monotonic()
    # Install first; only if that fails refresh the package lists and retry.
    for cmd in (install, ["apt-get", "update", "-q"], install):
        left = install_timeout - (time.monotonic() - began)
        if left <= 0:
            break
        try:
            proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=left)
        except subprocess.TimeoutExpired:
            log.append(f"{' '.join(cmd)}: timed out")
            break
        log.append(f"{' '.join(cmd)}: exit {proc.returncode}: {proc.stderr.strip()[-300:]}")
        if cmd is install and proc.returncode == 0 and not _missing():
            return None
    return (f"could not install {' '.join(PACKAGES)} with apt-get "
            f"({', '.join(_missing())} missing): " + " | ".join(log))


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class SlurmError(RuntimeError):
    pass


class SingleNodeSlurm:
    """slurmctld + slurmd on 127.0.0.1 with `cpus` CPUs, configured in `root`."""

    def __init__(self, cpus: int = 4):
        # Its own folder, not pytest's (mode 0700): munged runs as the munge
        # user and must reach its socket and key through every parent.
        self.root = Path(tempfile.mkdtemp(prefix="mpilossy-slurm-"))
        os.chmod(self.root, 0o755)
        blocked = [str(p) for p in self.root.parents if not os.stat(p).st_mode & 0o001]
        if blocked:
            shutil.rmtree(self.root, ignore_errors=True)
            raise SlurmError(f"the munge user cannot reach {self.root} (no search permission "
                             f"on {', '.join(blocked)}): set TMPDIR to a folder it can reach")
        self.cpus = cpus
        self.node = socket.gethostname().split(".")[0]
        self.conf = self.root / "slurm.conf"
        self.munge_dir = self.root / "munge"
        self.munge_socket = self.munge_dir / "munge.socket"
        self.procs: dict = {}

    # -- environment -----------------------------------------------------------
    def env(self, **extra: str) -> dict:
        """Environment for Slurm clients: this cluster, nothing inherited from
        an allocation or an mpiexec around the test run."""
        env = {k: v for k, v in clean_subprocess_env().items()
               if not k.startswith(("SLURM_", "SBATCH_", "SALLOC_", "SRUN_"))}
        env["SLURM_CONF"] = str(self.conf)
        env["PATH"] = _sbin_path()
        env.update(extra)
        return env

    # -- start -----------------------------------------------------------------
    def start(self, timeout: float = 60) -> None:
        for sub in ("state", "spool", "log"):
            (self.root / sub).mkdir(exist_ok=True)
        self._start_munge(timeout)
        self._write_conf()
        deadline = time.monotonic() + timeout
        self._spawn("slurmctld", ["slurmctld", "-D", "-f", str(self.conf)])
        self._wait(lambda: "UP" in self._ctl(["scontrol", "ping"]).stdout, deadline,
                   "slurmctld answers")
        self._spawn("slurmd", ["slurmd", "-D", "-f", str(self.conf), "-N", self.node])
        self._wait(lambda: self.node_state() in ("idle", "mixed", "allocated"), deadline,
                   "the node is idle")

    def _start_munge(self, timeout: float) -> None:
        munge = pwd.getpwnam("munge")
        self.munge_dir.mkdir(mode=0o755, exist_ok=True)
        os.chown(self.munge_dir, munge.pw_uid, munge.pw_gid)
        key = self.munge_dir / "munge.key"
        key.write_bytes(os.urandom(1024))
        os.chown(key, munge.pw_uid, munge.pw_gid)
        os.chmod(key, 0o400)
        # munged refuses to run as root; it runs as the munge user.
        self._spawn("munged", [
            "munged", "--foreground", "--force", f"--socket={self.munge_socket}",
            f"--key-file={key}", f"--pid-file={self.munge_dir / 'munged.pid'}",
            f"--log-file={self.munge_dir / 'munged.log'}",
            f"--seed-file={self.munge_dir / 'munged.seed'}"],
            user=munge.pw_uid, group=munge.pw_gid)
        self._wait(self.munge_socket.exists, time.monotonic() + timeout, "munged's socket")

    def _write_conf(self) -> None:
        r = self.root
        self.ctl_port, self.d_port = free_port(), free_port()
        self.conf.write_text(f"""\
# Written by tests/cluster_helpers.py: one node, loopback only, no accounting.
ClusterName=mpilossytest
SlurmctldHost={self.node}(127.0.0.1)
SlurmctldPort={self.ctl_port}
SlurmdPort={self.d_port}
SlurmUser=root
AuthType=auth/munge
AuthInfo=socket={self.munge_socket}
CredType=cred/munge
StateSaveLocation={r}/state
SlurmdSpoolDir={r}/spool
SlurmctldPidFile={r}/slurmctld.pid
SlurmdPidFile={r}/slurmd.pid
SlurmctldDebug=info
SlurmdDebug=info
# Job ids from a random start: MPICH names a job's shared-memory segments
# after its PMI job, and a segment that a killed earlier run left in
# /dev/shm must not be joined by a new job of the same id (every test
# cluster would otherwise count from 1; seen: MPI_Init hanging or failing
# with "Message truncated" after a run was killed).
FirstJobId={random.randint(1000, 999_999)}
# no cgroups in a container: track processes by parentage, no binding plugin
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
SchedulerType=sched/builtin
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
# PMI-2 by default: with `none` every rank of the mpich wheel is a singleton
MpiDefault=pmi2
# CPUs as configured below, not as detected (the machine may have fewer)
SlurmdParameters=config_overrides
ReturnToService=2
# sbatch --wait polls every 2 s while MinJobAge is under 4 s, else up to every 10 s
MinJobAge=3
KillWait=5
InactiveLimit=0
NodeName={self.node} NodeAddr=127.0.0.1 CPUs={self.cpus} RealMemory=1024 State=UNKNOWN
PartitionName=test Nodes={self.node} Default=YES MaxTime=30 State=UP OverSubscribe=YES
""")

    def _spawn(self, name: str, cmd: list, **kw) -> None:
        log = open(self.root / "log" / f"{name}.out", "ab")
        self.procs[name] = subprocess.Popen(
            cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            env=self.env(), cwd=self.root, start_new_session=True, **kw)
        log.close()

    def _ctl(self, cmd: list, timeout: float = 20) -> subprocess.CompletedProcess:
        return subprocess.run(cmd, env=self.env(), capture_output=True, text=True, timeout=timeout)

    def _wait(self, ready, deadline: float, what: str) -> None:
        while time.monotonic() < deadline:
            for name, proc in self.procs.items():
                if proc.poll() is not None:
                    raise SlurmError(f"{name} exited with {proc.returncode} while waiting for "
                                     f"{what}:\n{self.logs()}")
            try:
                if ready():
                    return
            except subprocess.TimeoutExpired:
                pass
            time.sleep(0.2)
        raise SlurmError(f"timed out waiting for {what}:\n{self.logs()}")

    def node_state(self) -> str:
        proc = self._ctl(["sinfo", "-h", "-N", "-o", "%t"])
        return proc.stdout.strip().rstrip("*~#!%$@^-")

    def logs(self, lines: int = 15) -> str:
        out = []
        for path in sorted((self.root / "log").glob("*")) + [self.munge_dir / "munged.log"]:
            if path.exists():
                text = path.read_text(errors="replace").splitlines()[-lines:]
                out.append(f"--- {path.name}\n" + "\n".join(text))
        return "\n".join(out)

    # -- jobs --------------------------------------------------------------------
    def sbatch(self, script: Path, *options: str, cwd: Path, timeout: float = 120,
               **env: str) -> tuple:
        """`sbatch --parsable --wait [options] script` in cwd; returns
        (job id, CompletedProcess).  --wait makes sbatch exit with the job's
        exit code."""
        cmd = ["sbatch", "--parsable", "--wait", *options, str(script)]
        try:
            proc = subprocess.run(cmd, env=self.env(**env), cwd=cwd, capture_output=True,
                                  text=True, timeout=timeout)
        except subprocess.TimeoutExpired as exc:
            self._ctl(["scancel", "--full", "--user=root"])
            raise SlurmError(f"{' '.join(cmd)} did not end in {timeout} s:\n"
                             f"{exc.stdout!r}\n{self.logs()}") from None
        match = re.match(r"\s*(\d+)", proc.stdout)
        return (match.group(1) if match else None), proc

    def run_template(self, template: str, cwd: Path, **env: str) -> tuple:
        """sbatch --wait jobs/<template> on SMALL sizes from cwd; returns (job
        id, exit code, text of its .out file, text of its .err file)."""
        job, proc = self.sbatch(JOBS / template, *SMALL, cwd=cwd, **env)
        assert job, f"sbatch gave no job id: {proc.stdout}\n{proc.stderr}\n{self.logs()}"
        name = template.replace(".sbatch", "")
        out, err = cwd / f"mpilossy-{name}-{job}.out", cwd / f"mpilossy-{name}-{job}.err"
        assert out.exists() and err.exists(), (
            f"no {out.name}/{err.name} in {sorted(p.name for p in cwd.iterdir())}\n"
            f"sbatch: {proc.stderr}\n{self.logs()}")
        return job, proc.returncode, out.read_text(), err.read_text()

    # -- stop --------------------------------------------------------------------
    def stop(self) -> None:
        """Cancel jobs, stop the daemons, end whatever this cluster started."""
        if "slurmctld" in self.procs and self.procs["slurmctld"].poll() is None:
            try:
                self._ctl(["scancel", "--full", "--user=root"], timeout=10)
            except (subprocess.TimeoutExpired, OSError):
                pass
        for name in reversed(DAEMONS):
            proc = self.procs.get(name)
            if proc is None or proc.poll() is not None:
                continue
            proc.terminate()
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=10)
        for pid in self.leftover_pids():
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass

    def remove(self) -> None:
        shutil.rmtree(self.root, ignore_errors=True)

    def leftover_pids(self) -> list:
        """Processes (job steps, ranks) that run with this cluster's SLURM_CONF."""
        marker = f"SLURM_CONF={self.conf}".encode() + b"\0"
        pids = []
        for entry in os.listdir("/proc"):
            if not entry.isdigit() or int(entry) == os.getpid():
                continue
            try:
                with open(f"/proc/{entry}/environ", "rb") as f:
                    if marker in f.read() + b"\0":
                        pids.append(int(entry))
            except OSError:
                continue
        return pids


def cluster_fixture():
    """Body of a module fixture: yields a started SingleNodeSlurm (or skips
    with the reason why there is none), and stops it whatever happened."""
    cluster = _start_or_skip()
    try:
        yield cluster
    finally:
        cluster.stop()
        left = cluster.leftover_pids()
        cluster.remove()
        assert not left, f"processes left running after the daemons stopped: {left}"


def _start_or_skip():

    reason = ensure_slurm()
    if reason:
        unavailable(reason)
    try:
        cluster = SingleNodeSlurm()
    except SlurmError as exc:
        unavailable(str(exc))
    try:
        cluster.start()
    except (SlurmError, OSError, subprocess.SubprocessError) as exc:
        cluster.stop()
        cluster.remove()
        unavailable(f"a single-node Slurm could not be started here: {exc}")
    return cluster
