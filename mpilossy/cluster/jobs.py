"""The jobs on a cluster: the launcher wrapper that enters a node, the job's
environment, the mpiexec command line (hydra started on node 1, reaching
the other nodes through the wrapper: `-launcher ssh -launcher-exec
WRAPPER`), starting and killing jobs, and stopping a process on a node for
a while (SIGSTOP, then SIGCONT).

Every process tree started on a node gets fresh UTS, IPC and mount
namespaces: the node's host name, its own /dev/shm (a tmpfs that vanishes
with the processes) and an /etc/hosts naming every node.  Ranks of one node
share memory (MPICH groups them by host name); ranks of different nodes
talk over TCP (MPIR_CVAR_CH4_NETMOD=ofi FI_PROVIDER=tcp FI_TCP_IFACE=eth0)."""

from __future__ import annotations

import os
import shlex
import shutil
import signal
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence

from .host import _kill_in
from .network import Network

WRAPPER = r"""#!/bin/sh
# Written by mpilossy.cluster for {cid}: start a command on a node.
#   WRAPPER [options] NODE COMMAND...      (hydra's ssh launcher: -x NODE "proxy" args...)
# Enters the node's network namespace, then fresh UTS, IPC and mount
# namespaces: the node's host name, its own /dev/shm (a tmpfs that vanishes
# with the processes) and /etc/hosts naming every node.
while [ $# -gt 0 ]; do
    case "$1" in
        -*) shift ;;
        *) break ;;
    esac
done
node=$1
shift
case "$node" in
{cases}
    *) echo "cluster: no node named '$node' in {cid}" >&2; exit 255 ;;
esac
# shellcheck disable=SC2016  # $0, $1, $2 are the inner shell's
exec ip netns exec "$ns" unshare --uts --ipc --mount --propagation private /bin/sh -c \
    'hostname "$0" && mount -t tmpfs -o mode=1777,size={shm_size} shm /dev/shm \
     && mount --bind "$1" /etc/hosts && exec /bin/sh -c "$2"' "$name" "{hosts}" "$*"
"""


class Jobs(Network):
    """The jobs of a cluster (a part of Cluster): started in sessions of
    their own, killed with everything on the nodes when asked or when the
    cluster closes."""

    def __init__(self) -> None:
        self._jobs: List[subprocess.Popen] = []
        self._stopped: Dict[int, threading.Timer] = {}

    def _write_launcher(self) -> None:
        """The nodes' /etc/hosts and the launcher wrapper, in the state folder."""
        hosts = "127.0.0.1 localhost\n" + "".join(
            f"{a} {n}\n" for a, n in zip(self.addresses, self.names))
        self.state.joinpath("hosts").write_text(hosts)
        cases = "\n".join(f"    {n}|{a}) ns={ns}; name={n} ;;"
                          for n, a, ns in zip(self.names, self.addresses, self.node_ns))
        self.wrapper.write_text(WRAPPER.format(cid=self.cid, cases=cases, shm_size="50%",
                                               hosts=self.state / "hosts"))
        self.wrapper.chmod(0o755)

    # -- running -------------------------------------------------------------------
    def job_environment(self, extra: Optional[Dict[str, str]] = None,
                        provider: str = "native") -> Dict[str, str]:
        """MPICH over TCP between nodes (libfabric's tcp provider on eth0),
        shared memory within a node (none in loopback mode); the datagram
        `provider` for mpilossy's channel='ud'; the control folder."""
        env = {k: v for k, v in os.environ.items()
               if not k.startswith(("PMI_", "PMIX_", "HYDRA_", "MPIR_CVAR_", "UCX_", "FI_",
                                    "OMPI_", "MPILOSSY_"))}
        env.update(MPIR_CVAR_CH4_NETMOD="ofi", FI_PROVIDER="tcp,udp",
                   FI_TCP_IFACE="lo" if self.loopback else "eth0",
                   MPILOSSY_UD_PROVIDER=provider, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1",
                   CLUSTER_CONTROL=str(self.control),
                   # the bench lines its ranks up through files, off the network
                   MPILOSSY_BENCH_MEET=str(self.meet))
        if self.loopback:
            env["MPIR_CVAR_NOLOCAL"] = "1"
        env.update(extra or {})
        return env

    def mpiexec_command(self, cmd: Sequence[str], ppn: int = 1, nodes: Optional[int] = None,
                        np: Optional[int] = None) -> List[str]:
        """The command line that runs `cmd` as one MPI job on the first
        `nodes` nodes (default all), `ppn` ranks on each (np: fewer in all),
        hydra started on node 1."""
        nodes = self.nodes if nodes is None else nodes
        if not 1 <= nodes <= self.nodes:
            raise ValueError(f"nodes={nodes}: this cluster has {self.nodes}")
        np = nodes * ppn if np is None else np
        here = Path(sys.executable).parent
        mpiexec = str(here / "mpiexec") if (here / "mpiexec").exists() else \
            (shutil.which("mpiexec") or "mpiexec")
        job = [mpiexec, "-launcher", "ssh", "-launcher-exec", str(self.wrapper),
               "-hosts", ",".join(self.names[:nodes]), "-ppn", str(ppn), "-n", str(np), *cmd]
        return self.on_node(1, job)

    def on_node(self, node: int, cmd: Sequence[str]) -> List[str]:
        """`cmd` run on node `node` (1-based), as the launcher starts it."""
        lead = ["setpriv", "--pdeathsig", "KILL"] if shutil.which("setpriv") else []
        return [*lead, str(self.wrapper), self.names[node - 1], shlex.join(map(str, cmd))]

    def popen(self, cmd: Sequence[str], env: Optional[Dict[str, str]] = None,
              **kwargs: Any) -> subprocess.Popen:
        """Start a command line (mpiexec_command, on_node) in a session of
        its own; close() kills whatever is left of it."""
        proc = subprocess.Popen(list(cmd), env=env if env is not None else self.job_environment(),
                                start_new_session=True, **kwargs)
        self._jobs.append(proc)
        return proc

    def run(self, cmd: Sequence[str], ppn: int = 1, nodes: Optional[int] = None,
            np: Optional[int] = None, env: Optional[Dict[str, str]] = None,
            timeout: float = 600, capture: bool = True, serve: bool = True,
            provider: str = "native") -> subprocess.CompletedProcess:
        """Run `cmd` as an MPI job (mpiexec_command) and wait, at most
        `timeout` seconds: then the job is killed (every process on the
        nodes) and subprocess.TimeoutExpired raised.  `env`: added to the
        job's environment; `serve`: answer the job's requests meanwhile."""
        line = self.mpiexec_command(cmd, ppn, nodes, np)
        pipe = subprocess.PIPE if capture else None
        job = self.popen(line, env=self.job_environment(env, provider), stdout=pipe,
                         stderr=pipe, text=True)
        if serve:
            self.serve()
        try:
            out, err = job.communicate(timeout=timeout)
        except BaseException:
            self.kill_jobs()
            job.communicate()
            raise
        finally:
            self.clear_requests()
        return subprocess.CompletedProcess(line, job.returncode, out, err)

    # the job's requests: answered by control.Requests, the part that overrides these
    def serve(self) -> None:
        """Answer the job's requests (control.Requests)."""

    def clear_requests(self) -> None:
        """Forget the requests of a job that ended (control.Requests)."""

    def kill_jobs(self) -> None:
        """SIGKILL every job started here and every process on the nodes."""
        self._kill_sessions()
        _kill_in(self.node_ns)
        for pid in list(self._stopped):
            self._resume(pid)

    def _kill_sessions(self) -> None:
        """SIGKILL the session of every job started here that still runs."""
        for job in self._jobs:
            if job.poll() is None:
                try:
                    os.killpg(job.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass

    def _reap(self) -> None:
        """Wait for the jobs started here, killed by now (10 s at most each)."""
        for job in self._jobs:
            try:
                job.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass

    # -- stopping a process for a while ----------------------------------------------
    def stop_process(self, pid: int, seconds: float) -> None:
        """SIGSTOP a process that runs on one of the nodes, SIGCONT it
        `seconds` later (or when the cluster closes)."""
        if not self._on_a_node(pid):
            raise ValueError(f"process {pid} is not on a node of this cluster")
        os.kill(pid, signal.SIGSTOP)
        timer = threading.Timer(seconds, self._resume, (pid,))
        timer.daemon = True
        self._stopped[pid] = timer
        timer.start()

    def _resume(self, pid: int) -> None:
        self._stopped.pop(pid, None)
        try:
            os.kill(pid, signal.SIGCONT)
        except ProcessLookupError:
            pass

    def _on_a_node(self, pid: int) -> bool:
        try:
            mine = os.stat(f"/proc/{pid}/ns/net").st_ino
        except OSError:
            return False
        return any(os.stat(f"/run/netns/{ns}").st_ino == mine for ns in self.node_ns)

    def _cancel_resumes(self) -> None:
        """Cancel the pending SIGCONTs (close(): the processes are killed)."""
        for timer in list(self._stopped.values()):
            timer.cancel()
