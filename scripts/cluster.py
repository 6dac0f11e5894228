"""An emulated cluster on one machine: nodes, a switch, one MPI job across them.

    python scripts/cluster.py run --nodes 2 --ppn 2 --rate 1gbit -- \\
        python -m mpilossy.bench allreduce -c rma,ud -t 0.1
    python scripts/cluster.py run --nodes 3 --ppn 1 --drop 0.01 --queue 64kb -- python job.py
    python scripts/cluster.py bench --nodes 4 --ppn 1        # MPI over TCP against ud, under drops
    python scripts/cluster.py train --nodes 4 --ppn 1        # the language model, both ways
    python scripts/cluster.py bench --loopback --np 4        # the former lossy_link.py: one node,
                                                             # every rank through its loopback
    python scripts/cluster.py clean                          # what killed runs left behind

Every node is a network namespace with its own host name (a UTS namespace),
its own /dev/shm and System V IPC (a mount and an IPC namespace made fresh
for every process tree launched on it: they vanish with the processes), and
one interface, eth0, at 10.77.0.N.  The nodes' veths meet on a Linux bridge
(the switch), which lives in a namespace of its own: nothing is created in
the root namespace, and packets travel only between namespaces made here.

Each switch port has an egress rate and a queue bounded in bytes (tbf:
--rate, --queue), so that incast overflows it and drops packets as a
shallow-buffered switch does; each node's eth0 has a rate too (--node-rate,
--node-queue: the NIC).  Offloads (--offloads): `nic` (default) segments
before the wire (TSO off, GSO on: the stack cuts super-packets into MTU
frames after the qdisc, as a NIC's TSO does) and merges on receipt (GRO
on); `off` turns GSO and GRO off as well; `on` leaves veth's defaults
(64 KB super-packets cross the switch: one drop takes dozens of packets).
Extra drops on the switch (nftables, bridge family, forward hook, TCP and
UDP over IPv4): --drop (random), --bursts MS/EVERY_MS (microbursts: all
dropped for MS, every EVERY_MS on average), --gilbert GOOD_MS:BAD_MS:LOSS_BAD
(a two-state channel in time: exponential sojourns, LOSS_BAD dropped in the
bad state).  netem is not in every kernel: there is no delay emulation.

The job: MPICH's hydra launcher started on node 1, reaching the other
nodes through a launcher wrapper (`-launcher ssh -launcher-exec WRAPPER`)
that enters the node's namespaces; ranks of one node share memory (MPICH
groups them by host name), ranks of different nodes talk over TCP
(MPIR_CVAR_CH4_NETMOD=ofi FI_PROVIDER=tcp FI_TCP_IFACE=eth0).

Everything it makes is removed on every way out: normal end, exception,
SIGINT, SIGTERM, SIGHUP (also one that arrives while it removes), a job
past --limit (its processes are found by namespace and killed).  A run
killed with SIGKILL leaves its namespaces; the next start (or `clean`)
removes those whose owner is gone (_owner_alive says how it knows).  Needs
root, `ip`, `tc` (iproute2), `nft` (nftables), `ethtool`, `unshare` and
`mount` (util-linux), and a kernel with veth, bridge and tbf: without them
it says why and exits with status 3.

Also a Python module (tests/cluster/test_multinode.py uses it):

    with Cluster(nodes=2, rate="1gbit") as c:
        proc = c.run(["python", "job.py"], ppn=2, timeout=120)
        c.set_drop(0.01); print(c.counters())

While one is open in a program that has no SIGTERM (SIGHUP) handler of its
own, such a signal removes the clusters first, then kills the program as
before (_take_signals).

A job can ask the cluster to change its conditions while it runs (drops,
bursts, SIGSTOP of a process on a node, counters): `request(...)` below,
through files in the folder named by $CLUSTER_CONTROL.
"""

from __future__ import annotations

import argparse
import atexit
import json
import os
import random
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Tuple

UNAVAILABLE = 3          # exit status: no root, a tool or a kernel feature missing (tests skip)
PREFIX = "mpilossy-cluster-"        # of every namespace and state folder made here
STATE_ROOT = Path("/run")
TABLE = "mpilossy_cluster"
PACKETS = "meta protocol ip ip protocol { tcp, udp }"      # what drop rules drop
SUBNET = "10.77.0"
TOOLS = (("ip", "iproute2"), ("tc", "iproute2"), ("nft", "nftables"), ("ethtool", "ethtool"),
         ("unshare", "util-linux"), ("mount", "util-linux"))
GRACE = 10.0            # seconds: how young a cluster without owner record may be (_owner_alive)
SIGNALS = {signal.SIGINT, signal.SIGTERM, signal.SIGHUP}        # blocked while close() works
_serial = 0
_open: List["Cluster"] = []         # the clusters of this process that close() has not removed
_dying = False


class ClusterUnavailable(RuntimeError):
    """This machine cannot host the emulated cluster (not root, a tool or a
    kernel feature missing)."""


def unavailable() -> Optional[str]:
    """Why a cluster cannot be made here, or None."""
    if sys.platform != "linux":
        return "needs Linux (network namespaces)"
    if os.geteuid() != 0:
        return "needs root (network namespaces, tc and nftables)"
    for tool, package in TOOLS:
        if shutil.which(tool) is None:
            return f"needs `{tool}` (Debian: {package})"
    return None


def sh(cmd: Sequence[str], **kwargs: Any) -> subprocess.CompletedProcess:
    """Run a set-up command; its stderr goes into the exception."""
    proc = subprocess.run(list(cmd), capture_output=True, text=True, **kwargs)
    if proc.returncode != 0:
        raise subprocess.CalledProcessError(proc.returncode, list(cmd), proc.stdout, proc.stderr)
    return proc


# -- ownership and leftovers -----------------------------------------------------
def _start_time(pid: int) -> Optional[str]:
    """The start time of process `pid` (field 22 of /proc/PID/stat), or None
    when there is no such process: with the pid it names a process for good."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat.rsplit(")", 1)[1].split()[19]


def _owner_alive(state: Path, pid: int) -> bool:
    """Whether the cluster of state folder `state`, named for `pid`, may still
    be in use.  open() writes the owner record (pid and start time) atomically
    into the state folder before it makes any namespace, and close() removes
    the folder after the namespaces.  So: with a record, the owner lives iff a
    process with that pid and start time runs.  Without one the pid proves
    nothing (it may belong to another process by now): the cluster is stale,
    unless its folder changed in the last GRACE seconds (a cluster being made
    or removed right now); a namespace without a folder is stale.  Our own
    pid: only the clusters open in this process are alive."""
    if pid == os.getpid():
        return any(c.state == state for c in _open)
    try:
        owner = state.joinpath("owner").read_text().split()
    except OSError:
        try:
            return time.time() - state.stat().st_mtime < GRACE
        except OSError:
            return False
    return owner == [str(pid), str(_start_time(pid))]


def _netns_names() -> List[str]:
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    return [line.split()[0] for line in out.splitlines() if line.strip()]


def _netns_pids(name: str) -> List[int]:
    out = subprocess.run(["ip", "netns", "pids", name], capture_output=True, text=True).stdout
    return [int(p) for p in out.split() if p.isdigit() and int(p) != os.getpid()]


def _kill_in(names: Sequence[str], timeout: float = 10.0) -> None:
    """SIGKILL every process inside the namespaces `names` and wait until
    they are gone (a namespace keeps its interfaces while a process holds it)."""
    deadline = time.monotonic() + timeout
    while True:
        pids = [p for name in names for p in _netns_pids(name)]
        if not pids or time.monotonic() > deadline:
            return
        for pid in pids:
            try:
                os.kill(pid, signal.SIGCONT)
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        time.sleep(0.05)


def clean_leftovers(verbose: bool = False) -> List[str]:
    """Remove the namespaces and state folders of clusters whose owner process
    is gone (a run killed with SIGKILL).  Returns what it removed."""
    removed: List[str] = []
    owners: Dict[str, Tuple[Path, int]] = {}
    for state in STATE_ROOT.glob(PREFIX + "*"):
        m = re.fullmatch(re.escape(PREFIX) + r"(\d+)-\d+", state.name)
        if m:
            owners[state.name] = (state, int(m.group(1)))
    stale_ns: Dict[str, List[str]] = {}
    for name in _netns_names():
        m = re.match(re.escape(PREFIX) + r"(\d+)-(\d+)-", name)
        if not m:
            continue
        cid = f"{PREFIX}{m.group(1)}-{m.group(2)}"
        if not _owner_alive(STATE_ROOT / cid, int(m.group(1))):
            stale_ns.setdefault(cid, []).append(name)
    for cid, names in stale_ns.items():
        _kill_in(names)
        for name in names:
            subprocess.run(["ip", "netns", "del", name], capture_output=True)
            removed.append(name)
    for cid, (state, pid) in owners.items():
        if not _owner_alive(state, pid):
            shutil.rmtree(state, ignore_errors=True)
            removed.append(str(state))
    if verbose:
        for what in removed:
            print(f"cluster: removed {what}", file=sys.stderr)
    return removed


# -- signals while a cluster is open --------------------------------------------------
def _take_signals() -> None:
    """While a cluster is open, a SIGTERM or SIGHUP that would kill the
    process outright (default disposition: a program that uses Cluster as a
    library) first removes the clusters (_die_clean).  A handler of the
    program's own is left alone: main()'s unwinds like Ctrl-C, through
    close().  signal.signal works in the main thread only: a cluster opened
    in another thread relies on its program's handlers and atexit."""
    if threading.current_thread() is not threading.main_thread():
        return
    for signum in (signal.SIGTERM, signal.SIGHUP):
        if signal.getsignal(signum) == signal.SIG_DFL:
            signal.signal(signum, _die_clean)


def _give_back_signals() -> None:
    """The default disposition again, once no cluster is open (from the main
    thread; elsewhere _die_clean stays, and with nothing open it acts as the
    default would)."""
    if _open or threading.current_thread() is not threading.main_thread():
        return
    for signum in (signal.SIGTERM, signal.SIGHUP):
        if signal.getsignal(signum) is _die_clean:
            signal.signal(signum, signal.SIG_DFL)


def _die_clean(signum: int, frame: object) -> None:
    """SIGTERM or SIGHUP where the default disposition was to die: close
    this process's clusters (not a forked parent's), then die of the signal
    as the default would have.  A second signal meanwhile changes nothing."""
    global _dying
    if _dying:
        return
    _dying = True
    for cluster in [c for c in _open if c.owner == os.getpid()]:
        try:
            cluster.close()
        except BaseException as exc:        # the others still go
            print(f"cluster: while removing {cluster.cid}: {exc!r}", file=sys.stderr)
    signal.signal(signum, signal.SIG_DFL)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signum})
    signal.raise_signal(signum)


# -- the launcher wrapper ----------------------------------------------------------
WRAPPER = r"""#!/bin/sh
# Written by scripts/cluster.py for {cid}: start a command on a node.
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


# -- loss processes on the switch --------------------------------------------------
class Flapper:
    """A two-state drop process in time, driven through one `nft -i` shell:
    `good()` and `bad()` draw how long each state lasts; entering the bad
    state installs `bad_rule` in the chain, the good state empties it."""

    def __init__(self, cluster: "Cluster", good: Callable[[], float], bad: Callable[[], float],
                 bad_rule: str) -> None:
        self.cluster, self.good, self.bad, self.bad_rule = cluster, good, bad, bad_rule
        self.stop_event = threading.Event()
        self.bad_periods = 0
        self.shell = subprocess.Popen(cluster.in_filter_ns(["nft", "-i"]), stdin=subprocess.PIPE,
                                      stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                      text=True)
        self.thread = threading.Thread(target=self._loop, daemon=True)
        self.thread.start()

    def _say(self, line: str) -> None:
        assert self.shell.stdin is not None
        self.shell.stdin.write(line + "\n")
        self.shell.stdin.flush()

    def _loop(self) -> None:
        chain = self.cluster.chain("bursts")
        try:
            while not self.stop_event.wait(self.good()):
                self._say(f"add rule {chain} {self.bad_rule}")
                self.bad_periods += 1
                self.stop_event.wait(self.bad())
                self._say(f"flush chain {chain}")
        except (BrokenPipeError, ValueError):
            pass

    def stop(self) -> None:
        self.stop_event.set()
        self.thread.join(timeout=10)
        try:
            self._say(f"flush chain {self.cluster.chain('bursts')}")
            assert self.shell.stdin is not None
            self.shell.stdin.close()
        except (BrokenPipeError, ValueError, OSError):
            pass
        try:
            self.shell.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.shell.kill()
            self.shell.wait()


def _drop_rule(share: float) -> str:
    """The nftables rule that drops `share` of PACKETS, counted in the named
    counter "dropped" (which outlives the rule)."""
    if not 0 <= share <= 1:
        raise ValueError(f"drop share {share}: 0 <= share <= 1")
    if share >= 1:
        return f'{PACKETS} counter name "dropped" drop'
    return (f"{PACKETS} numgen random mod 100000 < {round(share * 100000)} "
            f'counter name "dropped" drop')


# -- the cluster -----------------------------------------------------------------
class Cluster:
    """`nodes` network namespaces on a bridge in a switch namespace (see the
    module's text).  A context manager: everything goes away on exit.

    rate, queue: each switch port's egress (toward its node): tbf rate (tc
    syntax, '1gbit'; None: uncapped) and queue bytes ('128kb').  node_rate,
    node_queue: each node's eth0 egress (default: rate, and 1 MB).  burst:
    the token bucket (default: 4 frames, at least 16 KB).  mtu: 1500 or
    9000.  offloads: 'nic', 'off' or 'on'.  loopback: one node whose ranks
    reach each other through its loopback (MPIR_CVAR_NOLOCAL=1), drops and
    rate on the loopback: the former scripts/lossy_link.py."""

    def __init__(self, nodes: int = 2, rate: Optional[str] = "1gbit", queue: str = "128kb",
                 node_rate: Optional[str] = "", node_queue: str = "1mb", burst: str = "",
                 mtu: int = 1500, offloads: str = "nic", loopback: bool = False) -> None:
        global _serial
        if nodes < 1 or nodes > 200:
            raise ValueError(f"nodes={nodes}: 1 to 200")
        if offloads not in ("nic", "off", "on"):
            raise ValueError(f"offloads={offloads!r}: 'nic', 'off' or 'on'")
        if loopback and nodes != 1:
            raise ValueError("loopback: one node")
        if not 576 <= mtu <= 65535:
            raise ValueError(f"mtu={mtu}: 576 to 65535")
        _serial += 1
        self.cid = f"{PREFIX}{os.getpid()}-{_serial}"
        self.nodes = nodes
        self.rate = rate or None
        self.queue = queue
        self.node_rate = self.rate if node_rate == "" else (node_rate or None)
        self.node_queue = node_queue
        self.burst = burst or f"{max(4 * (mtu + 14), 16384)}b"
        self.mtu = mtu
        self.offloads = offloads
        self.loopback = loopback
        self.state = STATE_ROOT / self.cid
        self.control = self.state / "control"
        self.meet = self.state / "meet"         # where bench ranks line up (MPILOSSY_BENCH_MEET)
        self.switch_ns = f"{self.cid}-sw"
        self.node_ns = [f"{self.cid}-n{i + 1}" for i in range(nodes)]
        self.names = [f"node{i + 1}" for i in range(nodes)]
        self.addresses = [f"{SUBNET}.{i + 1}" for i in range(nodes)]
        self.wrapper = self.state / "launch"
        self._flapper: Optional[Flapper] = None
        self._jobs: List[subprocess.Popen] = []
        self._stopped: Dict[int, threading.Timer] = {}
        self._server: Optional[threading.Thread] = None
        self._serving = threading.Event()
        self._made = False          # True from open() until close() has removed everything
        self._lock = threading.RLock()      # reentrant: _die_clean may run inside close()
        self.owner = os.getpid()

    # -- life --------------------------------------------------------------
    def __enter__(self) -> "Cluster":
        if not self._made:
            self.open()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def open(self) -> "Cluster":
        why = unavailable()
        if why:
            raise ClusterUnavailable(why)
        clean_leftovers()
        with self._lock:
            if self._made:
                raise RuntimeError(f"{self.cid} is open already")
            # Made before anything exists, so that a close() from here on (a
            # signal's, atexit's) removes whatever there is by then.
            self.owner = os.getpid()
            _open.append(self)
            self._made = True
            atexit.register(self.close)
        _take_signals()
        try:
            self.state.mkdir(mode=0o755)
            tmp = self.state / "owner.tmp"          # complete or absent, never torn
            tmp.write_text(f"{self.owner} {_start_time(self.owner)}\n")
            tmp.rename(self.state / "owner")
            self._build()
        except subprocess.CalledProcessError as exc:
            self.close()
            detail = (exc.stderr or "").strip()
            raise ClusterUnavailable(f"`{' '.join(exc.cmd)}` failed: {detail}") from None
        except BaseException:
            self.close()
            raise
        return self

    def close(self) -> None:
        """Stop the loss processes and every process on the nodes, delete
        the namespaces and the state folder.  Idempotent, and whole: the
        cluster counts as made until everything is removed, so a close()
        cut short (an error) is finished by the next one (atexit's at the
        latest).  Ctrl-C, SIGTERM and SIGHUP are blocked in the calling
        thread meanwhile; one that reaches another thread still runs its
        Python handler in the main thread, and if that handler raises here,
        the removal starts over and the exception follows once it is done.
        Any thread may call it (pthread_sigmask works in every thread)."""
        cut: Optional[BaseException] = None
        blocked = signal.pthread_sigmask(signal.SIG_BLOCK, SIGNALS)
        try:
            with self._lock:
                if not self._made:
                    return
                while True:
                    try:
                        self._close()           # every step may run again
                        break
                    except (KeyboardInterrupt, SystemExit) as exc:
                        cut = cut or exc
                self._made = False
                _open.remove(self)
                atexit.unregister(self.close)
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, blocked)
        _give_back_signals()
        if cut is not None:
            raise cut

    def _close(self) -> None:
        self._serving.set()
        if self._flapper is not None:
            self._flapper.stop()
            self._flapper = None
        for timer in list(self._stopped.values()):
            timer.cancel()
        for job in self._jobs:
            if job.poll() is None:
                try:
                    os.killpg(job.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        names = [n for n in self.node_ns + [self.switch_ns] if n in set(_netns_names())]
        _kill_in(names)
        for job in self._jobs:
            try:
                job.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass
        for name in names:
            subprocess.run(["ip", "netns", "del", name], capture_output=True)
        shutil.rmtree(self.state, ignore_errors=True)

    # -- building ------------------------------------------------------------
    def _build(self) -> None:
        sw = self.switch_ns
        for name in [sw] + self.node_ns:
            sh(["ip", "netns", "add", name])
        for name in [sw] + self.node_ns:
            # No IPv6 (router solicitations and the like on the wire), no
            # bridged traffic through iptables (br_netfilter) in the switch.
            self._sysctl(name, {"net/ipv6/conf/all/disable_ipv6": "1",
                                "net/ipv6/conf/default/disable_ipv6": "1",
                                "net/bridge/bridge-nf-call-iptables": "0",
                                "net/bridge/bridge-nf-call-ip6tables": "0"})
            sh(["ip", "-n", name, "link", "set", "lo", "up"])
        sh(["ip", "-n", sw, "link", "add", "br0", "mtu", str(self.mtu), "type", "bridge",
            "stp_state", "0", "forward_delay", "0", "mcast_snooping", "0"])
        sh(["ip", "-n", sw, "link", "set", "br0", "up"])
        for i, ns in enumerate(self.node_ns):
            port = f"p{i + 1}"
            sh(["ip", "-n", sw, "link", "add", port, "mtu", str(self.mtu), "type", "veth",
                "peer", "name", "eth0", "mtu", str(self.mtu), "netns", ns])
            sh(["ip", "-n", sw, "link", "set", port, "master", "br0", "up"])
            sh(["ip", "-n", ns, "addr", "add", f"{self.addresses[i]}/24", "dev", "eth0"])
            sh(["ip", "-n", ns, "link", "set", "eth0", "up"])
            self._offloads(ns, "eth0", node=True)
            self._offloads(sw, port, node=False)
            if self.rate:
                self._tbf(sw, port, self.rate, self.queue)
            if self.node_rate:
                self._tbf(ns, "eth0", self.node_rate, self.node_queue)
        if self.loopback:
            ns = self.node_ns[0]
            sh(["ip", "-n", ns, "link", "set", "lo", "mtu", str(self.mtu)])
            sh(["ip", "netns", "exec", ns, "ethtool", "-K", "lo", "tso", "off", "gso", "off",
                "tx-udp-segmentation", "off", "gro", "off"])
            if self.rate:
                self._tbf(ns, "lo", self.rate, self.queue)
        family, hook = self._hook()
        sh(self.in_filter_ns(["nft", "-f", "-"]), input=(
            f"add table {family} {TABLE}\n"
            f"add counter {family} {TABLE} seen\n"
            f"add counter {family} {TABLE} dropped\n"
            f"add chain {family} {TABLE} count {{ {hook} priority -1 ; policy accept ; }}\n"
            f"add chain {family} {TABLE} drops {{ {hook} priority 0 ; policy accept ; }}\n"
            f"add chain {family} {TABLE} bursts {{ {hook} priority 1 ; policy accept ; }}\n"
            f'add rule {family} {TABLE} count {PACKETS} counter name "seen"\n'))
        hosts = "127.0.0.1 localhost\n" + "".join(
            f"{a} {n}\n" for a, n in zip(self.addresses, self.names))
        self.state.joinpath("hosts").write_text(hosts)
        cases = "\n".join(f"    {n}|{a}) ns={ns}; name={n} ;;"
                          for n, a, ns in zip(self.names, self.addresses, self.node_ns))
        self.wrapper.write_text(WRAPPER.format(cid=self.cid, cases=cases, shm_size="50%",
                                               hosts=self.state / "hosts"))
        self.wrapper.chmod(0o755)
        self.control.mkdir()
        self.meet.mkdir()

    def _sysctl(self, ns: str, values: Dict[str, str]) -> None:
        script = "".join(f"[ -e /proc/sys/{k} ] && echo {v} > /proc/sys/{k}\n"
                         for k, v in values.items())
        subprocess.run(["ip", "netns", "exec", ns, "sh", "-c", script + "true"],
                       capture_output=True)

    def _offloads(self, ns: str, dev: str, node: bool) -> None:
        if self.offloads == "on":
            return
        if self.offloads == "off" or not node:
            # switch ports: never merge frames back into super-packets
            opts = ["tso", "off", "gso", "off", "tx-udp-segmentation", "off", "gro", "off"]
        else:
            # a NIC: the stack segments after the qdisc (GSO), GRO merges on receipt
            opts = ["tso", "off", "tx-udp-segmentation", "off", "gso", "on", "gro", "on"]
        sh(["ip", "netns", "exec", ns, "ethtool", "-K", dev, *opts])

    def _tbf(self, ns: str, dev: str, rate: str, limit: str) -> None:
        sh(["tc", "-n", ns, "qdisc", "replace", "dev", dev, "root", "tbf", "rate", rate,
            "burst", self.burst, "limit", limit])

    def _hook(self) -> Tuple[str, str]:
        if self.loopback:
            return "netdev", 'type filter hook ingress device "lo"'
        return "bridge", "type filter hook forward"

    def chain(self, name: str) -> str:
        return f"{self._hook()[0]} {TABLE} {name}"

    def in_filter_ns(self, cmd: Sequence[str]) -> List[str]:
        """`cmd` in the namespace whose nftables drop: the switch (node 1 in
        loopback mode)."""
        ns = self.node_ns[0] if self.loopback else self.switch_ns
        return ["ip", "netns", "exec", ns, *cmd]

    # -- conditions ------------------------------------------------------------
    def set_drop(self, share: float) -> None:
        """Drop `share` (0..1) of the IPv4 TCP and UDP packets crossing the
        switch, at random."""
        chain = self.chain("drops")
        rule = f"add rule {chain} {_drop_rule(share)}\n" if share else ""
        sh(self.in_filter_ns(["nft", "-f", "-"]), input=f"flush chain {chain}\n" + rule)

    def start_bursts(self, length: float, every: float, seed: int = 1) -> None:
        """Microbursts: every TCP/UDP packet dropped for `length` seconds,
        every `every` seconds on average (gaps uniform in 0.5-1.5 times)."""
        rng = random.Random(seed)
        self._start_flapper(Flapper(self, lambda: rng.uniform(0.5, 1.5) * every,
                                    lambda: length, _drop_rule(1.0)))

    def start_gilbert(self, good: float, bad: float, loss_bad: float, seed: int = 1) -> None:
        """Gilbert-Elliott in time: good and bad states of exponential
        length (means `good`, `bad` seconds); `loss_bad` dropped in bad."""
        rng = random.Random(seed)
        self._start_flapper(Flapper(self, lambda: rng.expovariate(1 / good),
                                    lambda: rng.expovariate(1 / bad), _drop_rule(loss_bad)))

    def _start_flapper(self, flapper: Flapper) -> None:
        self.stop_bursts()
        self._flapper = flapper

    def stop_bursts(self) -> None:
        if self._flapper is not None:
            self._flapper.stop()
            self._flapper = None

    def clear(self) -> None:
        """No extra drops."""
        self.stop_bursts()
        self.set_drop(0)

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

    # -- counters ----------------------------------------------------------------
    def counters(self) -> Dict[str, Any]:
        """What the wire saw: per switch port and per node NIC the tbf's
        packets, bytes, drops, overlimits; the nftables drops; per node the
        kernel's TCP and UDP counters (/proc/net/snmp)."""
        out: Dict[str, Any] = {"ports": {}, "nics": {}, "nodes": {}}
        for i, ns in enumerate(self.node_ns):
            port = f"p{i + 1}"
            out["ports"][port] = self._qdisc(self.switch_ns, port)
            out["nics"][self.names[i]] = self._qdisc(ns, "lo" if self.loopback else "eth0")
            out["nodes"][self.names[i]] = self._snmp(ns)
        out["switch_drops"] = self._nft_drops()
        total: Dict[str, int] = {}
        for node in out["nodes"].values():
            for k, v in node.items():
                total[k] = total.get(k, 0) + v
        out["kernel"] = total
        out["port_drops"] = sum(p.get("drops", 0) for p in out["ports"].values())
        return out

    def _qdisc(self, ns: str, dev: str) -> Dict[str, int]:
        proc = subprocess.run(["tc", "-n", ns, "-s", "-j", "qdisc", "show", "dev", dev],
                              capture_output=True, text=True)
        try:
            rows = json.loads(proc.stdout or "[]")
        except ValueError:
            return {}
        for row in rows:
            if row.get("kind") == "tbf":
                return {k: int(row.get(k, 0)) for k in ("packets", "bytes", "drops",
                                                        "overlimits", "backlog")}
        return {}

    def _snmp(self, ns: str) -> Dict[str, int]:
        proc = subprocess.run(["ip", "netns", "exec", ns, "cat", "/proc/net/snmp"],
                              capture_output=True, text=True)
        lines = proc.stdout.splitlines()
        stats: Dict[str, int] = {}
        wanted = {("Udp", "OutDatagrams"), ("Udp", "InDatagrams"), ("Udp", "RcvbufErrors"),
                  ("Tcp", "RetransSegs"), ("Tcp", "OutSegs")}
        for head, values in zip(lines[::2], lines[1::2]):
            proto, names = head.split(":", 1)
            for name, value in zip(names.split(), values.split(":", 1)[1].split()):
                if (proto, name) in wanted:
                    stats[f"{proto}.{name}"] = int(value)
        return stats

    def _nft_drops(self) -> Dict[str, int]:
        family = self._hook()[0]
        proc = subprocess.run(self.in_filter_ns(["nft", "-j", "list", "table", family, TABLE]),
                              capture_output=True, text=True)
        counts = {"seen": 0, "dropped": 0}
        try:
            items = json.loads(proc.stdout or "{}").get("nftables", [])
        except ValueError:
            items = []
        for item in items:
            counter = item.get("counter")
            if counter and counter.get("name") in counts:
                counts[counter["name"]] = int(counter.get("packets", 0))
        return counts

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

    def kill_jobs(self) -> None:
        """SIGKILL every job started here and every process on the nodes."""
        for job in self._jobs:
            if job.poll() is None:
                try:
                    os.killpg(job.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        _kill_in(self.node_ns)
        for pid in list(self._stopped):
            self._resume(pid)

    # -- requests from a running job ------------------------------------------------
    def serve(self) -> None:
        """Answer requests from the job (request()) in a thread, until close()."""
        if self._server is None:
            self._server = threading.Thread(target=self._serve, daemon=True)
            self._server.start()

    def clear_requests(self) -> None:
        for f in self.control.glob("*"):
            f.unlink(missing_ok=True)

    def _serve(self) -> None:
        while not self._serving.wait(0.005):
            for req in sorted(self.control.glob("req-*.json")):
                try:
                    what = json.loads(req.read_text())
                except (OSError, ValueError):
                    continue            # still being written
                try:
                    answer: Any = {"ok": True, "result": self.answer(what)}
                except Exception as exc:            # the job gets the error, not us
                    answer = {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
                ack = self.control / ("ack-" + req.name[4:])
                tmp = ack.with_suffix(".tmp")
                tmp.write_text(json.dumps(answer))
                tmp.rename(ack)
                req.unlink(missing_ok=True)

    def answer(self, what: Dict[str, Any]) -> Any:
        """Carry out one request: {"drop": p}, {"bursts": [ms, every_ms]},
        {"gilbert": [good_ms, bad_ms, loss_bad]}, {"clear": true},
        {"stop": pid, "seconds": s}, {"counters": true}."""
        if "drop" in what:
            self.set_drop(float(what["drop"]))
        elif "bursts" in what:
            ms, every = what["bursts"]
            self.start_bursts(ms / 1e3, every / 1e3)
        elif "gilbert" in what:
            good, bad, loss = what["gilbert"]
            self.start_gilbert(good / 1e3, bad / 1e3, loss)
        elif "clear" in what:
            self.clear()
        elif "stop" in what:
            self.stop_process(int(what["stop"]), float(what["seconds"]))
        elif "counters" in what:
            return self.counters()
        else:
            raise ValueError(f"unknown request {what}")
        return None


def request(timeout: float = 30, **what: Any) -> Any:
    """From inside a job: ask the cluster that runs it for something (see
    Cluster.answer) and wait for the answer (request(drop=0.05),
    request(stop=os.getpid(), seconds=1), request(counters=True))."""
    folder = Path(os.environ["CLUSTER_CONTROL"])
    name = f"{os.getpid()}-{time.monotonic_ns()}.json"
    tmp = folder / f"tmp-{name}"
    tmp.write_text(json.dumps(what))
    tmp.rename(folder / f"req-{name}")
    ack = folder / f"ack-{name}"
    deadline = time.monotonic() + timeout
    while not ack.exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"the cluster did not answer {what} in {timeout} s")
        time.sleep(0.002)
    answer = json.loads(ack.read_text())
    ack.unlink(missing_ok=True)
    if not answer["ok"]:
        raise RuntimeError(answer["error"])
    return answer["result"]


# -- bench and train: MPI over TCP against mpilossy's datagrams -------------------
def parse_sizes(text: str) -> List[Tuple[str, float]]:
    """'1M:0.05,16M:0.5' -> [(size, deadline), ...]."""
    out = []
    for item in filter(None, text.split(",")):
        size, _, deadline = item.partition(":")
        out.append((size.strip(), float(deadline or 0.05)))
    return out


def conditions(args: argparse.Namespace) -> Iterator[Tuple[str, float, bool]]:
    for share in (float(x) for x in args.drops.split(",")):
        yield (f"drop {share:g}", share, False)
    if args.bursts:
        yield (f"bursts {args.burst_ms:g}ms/{args.burst_every_ms:g}ms", 0.0, True)


def under(cluster: Cluster, share: float, bursts: bool, args: argparse.Namespace,
          cmd: List[str]) -> subprocess.CompletedProcess:
    """Run `cmd` as the job under the given drops, then clear them."""
    cluster.set_drop(share)
    if bursts:
        cluster.start_bursts(args.burst_ms / 1e3, args.burst_every_ms / 1e3)
    try:
        pace = args.rate if args.pace == "port" else args.pace
        return cluster.run(cmd, ppn=args.ppn, timeout=args.limit, provider=args.provider,
                           env={"MPILOSSY_UD_RATE": pace})
    finally:
        cluster.clear()


def delta(after: Dict[str, int], before: Dict[str, int]) -> Dict[str, int]:
    return {k: after[k] - before.get(k, 0) for k in after}


def bench(cluster: Cluster, args: argparse.Namespace) -> List[Dict[str, Any]]:
    rows: List[Dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as tmp:
        for name, share, bursts in conditions(args):
            for size, deadline in parse_sizes(args.sizes):
                out = Path(tmp) / "bench.json"
                cmd = [sys.executable, "-m", "mpilossy.bench", "allreduce", "--scenario", "link",
                       "-c", "ud", "-a", args.algorithm, "-o", "avg", "--sizes", size,
                       "-t", str(deadline), "-n", str(args.iters), "-w", "3", "--json", str(out)]
                before = cluster.counters()
                proc = under(cluster, share, bursts, args, cmd)
                if proc.returncode != 0:
                    raise SystemExit(f"{name} {size}: exit {proc.returncode}\n"
                                     f"{proc.stdout[-3000:]}{proc.stderr[-3000:]}")
                after = cluster.counters()
                for row in json.loads(out.read_text())["tail"]:
                    row.update(condition=name, drop=share, bursts=bursts, pace=args.pace,
                               kernel=delta(after["kernel"], before["kernel"]),
                               switch_drops=after["switch_drops"]["dropped"]
                               - before["switch_drops"]["dropped"],
                               port_drops=after["port_drops"] - before["port_drops"])
                    row.pop("times_us", None)
                    row.pop("mpi_times_us", None)
                    rows.append(row)
                    print(bench_line(row), flush=True)
    return rows


BENCH_HEAD = (f"{'condition':<22} {'bytes':>9} {'deadline':>8}  {'mpi-p50':>8} {'mpi-p99':>8} "
              f"{'mpi-max':>8}  {'ud-p50':>8} {'ud-p99':>8} {'ud-max':>8}  {'p99 ratio':>9} "
              f"{'delivered':>9} {'tcp-retrans':>11} {'nft-drops':>9} {'port-drops':>10}")


def ms(us: float) -> str:
    return f"{us / 1e3:8.2f}"


def bench_line(r: Dict[str, Any]) -> str:
    return (f"{r['condition']:<22} {r['size']:>9} {r['timeout'] or 0:8.3f}  {ms(r['mpi_p50_us'])} "
            f"{ms(r['mpi_p99_us'])} {ms(r['mpi_max_us'])}  {ms(r['p50_us'])} {ms(r['p99_us'])} "
            f"{ms(r['max_us'])}  {r['p99_ratio']:9.2f} {r['delivered']:9.3f} "
            f"{r['kernel'].get('Tcp.RetransSegs', 0):11d} {r['switch_drops']:9d} "
            f"{r['port_drops']:10d}")


def train(cluster: Cluster, args: argparse.Namespace) -> List[Dict[str, Any]]:
    rows: List[Dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as tmp:
        for name, share, bursts in conditions(args):
            for seed in (int(s) for s in args.seeds.split(",")):
                for reduce in ("mpi", "mpilossy"):
                    out = Path(tmp) / "train.json"
                    cmd = [sys.executable, "-m", "mpilossy.examples.lm", "--reduce", reduce,
                           "--channel", "ud", "--algorithm", args.algorithm,
                           "--timeout", str(args.train_timeout), "--steps", str(args.steps),
                           "--seed", str(seed), "--no-progress", "--json", str(out),
                           *args.example_args.split()]
                    proc = under(cluster, share, bursts, args, cmd)
                    if proc.returncode != 0:
                        raise SystemExit(f"{name} {reduce}: exit {proc.returncode}\n"
                                         f"{proc.stdout[-3000:]}{proc.stderr[-3000:]}")
                    res = json.loads(out.read_text())
                    row = {"condition": name, "drop": share, "bursts": bursts, "seed": seed,
                           "pace": args.pace,
                           "reduce": reduce, **{k: res[k] for k in (
                               "val_perplexity", "delivered", "train_seconds", "comm_seconds",
                               "wall_seconds")}}
                    rows.append(row)
                    print(f"{name:<22} seed {seed} {reduce:<9} train {row['train_seconds']:7.1f} s"
                          f"  comm {row['comm_seconds']:6.1f} s  perplexity "
                          f"{row['val_perplexity']:6.3f}  delivered {row['delivered']:.3f}",
                          flush=True)
    return rows


# -- command line ----------------------------------------------------------------
def interrupted(signum: int, frame: object) -> None:
    """SIGTERM and SIGHUP unwind like Ctrl-C, so that everything is removed."""
    raise KeyboardInterrupt


def add_topology(ap: argparse.ArgumentParser, nodes: int, ppn: int, rate: str) -> None:
    g = ap.add_argument_group("the cluster")
    g.add_argument("--nodes", type=int, default=None, help=f"nodes (default {nodes})")
    g.add_argument("--ppn", type=int, default=ppn, help="ranks per node")
    g.add_argument("--np", type=int, help="ranks in all (default nodes x ppn; with --nodes "
                   "unset: nodes = np / ppn)")
    g.add_argument("--rate", default=rate, help="switch port egress rate, tc syntax; 'none': "
                   "uncapped")
    g.add_argument("--queue", default="128kb", help="switch port queue, bytes (tc syntax)")
    g.add_argument("--node-rate", default="", help="node NIC egress rate (default: --rate)")
    g.add_argument("--node-queue", default="1mb", help="node NIC queue, bytes")
    g.add_argument("--burst", default="", help="token bucket of each tbf (default: 4 frames, "
                   ">= 16 KB)")
    g.add_argument("--mtu", type=int, default=1500, help="1500 or 9000")
    g.add_argument("--offloads", choices=("nic", "off", "on"), default="nic")
    g.add_argument("--loopback", action="store_true",
                   help="one node whose ranks reach each other through its loopback "
                        "(MPIR_CVAR_NOLOCAL=1; drops on the loopback): the former lossy_link.py")
    g.add_argument("--provider", default="native",
                   help="mpilossy's datagram transport: native (its own UDP sockets) or a "
                        "libfabric provider (udp)")
    g.add_argument("--default-nodes", type=int, default=nodes, help=argparse.SUPPRESS)


def add_loss(ap: argparse.ArgumentParser, run: bool) -> None:
    g = ap.add_argument_group("extra drops on the switch")
    if run:
        g.add_argument("--drop", type=float, default=0.0, help="share of TCP/UDP packets dropped")
        g.add_argument("--bursts", metavar="MS/EVERY_MS",
                       help="microbursts: all dropped for MS every EVERY_MS on average")
        g.add_argument("--gilbert", metavar="GOOD_MS:BAD_MS:LOSS_BAD",
                       help="Gilbert-Elliott in time: mean state lengths, loss when bad")
    else:
        g.add_argument("--drops", default="0,0.001,0.01,0.05",
                       help="shares of TCP/UDP packets dropped, one run each")
        g.add_argument("--bursts", action="store_true", help="also a run with microbursts")
        g.add_argument("--burst-ms", type=float, default=5.0, help="length of a burst")
        g.add_argument("--burst-every-ms", type=float, default=50.0,
                       help="mean gap between bursts")


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog=__doc__.split("\n", 2)[2])
    sub = ap.add_subparsers(dest="what", required=True)
    run = sub.add_parser("run", help="one MPI job across the nodes",
                         formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    add_topology(run, 2, 2, "1gbit")
    add_loss(run, True)
    run.add_argument("--env", action="append", default=[], metavar="NAME=VALUE",
                     help="set in the job's environment (repeatable)")
    run.add_argument("--limit", type=float, default=3600, help="seconds before the job is killed")
    run.add_argument("--counters", metavar="FILE", help="write the wire's counters here (JSON)")
    run.add_argument("command", nargs=argparse.REMAINDER, help="-- COMMAND ...")
    for what, doc in (("bench", "per-call p50/p99/max: MPI_Allreduce over TCP against ud"),
                      ("train", "the language model, MPI against mpilossy")):
        p = sub.add_parser(what, help=doc, formatter_class=argparse.ArgumentDefaultsHelpFormatter)
        add_topology(p, 4, 1, "none")
        add_loss(p, False)
        p.add_argument("--algorithm", default="direct", help="of mpilossy's all-reduce")
        p.add_argument("--limit", type=float, default=1200,
                       help="seconds per job before it is killed")
        p.add_argument("--json", help="write every row here")
        p.add_argument("--pace", default="none", metavar="RATE",
                       help="MPILOSSY_UD_RATE of the job: pace mpilossy's datagrams to a node "
                            "port of this rate (docs/ud.md); 'port': the port rate (--rate)")
        if what == "bench":
            p.add_argument("--sizes", default="1M:0.1,16M:2",
                           help="SIZE:DEADLINE pairs (mpilossy's deadline in seconds)")
            p.add_argument("--iters", type=int, default=50, help="calls per size and way")
        else:
            p.add_argument("--steps", type=int, default=300)
            p.add_argument("--seeds", default="0", help="comma-separated seeds")
            p.add_argument("--train-timeout", type=float, default=0.05,
                           help="mpilossy's deadline per call (s)")
            p.add_argument("--example-args", default="",
                           help="more arguments of the example, e.g. '--no-align'")
    sub.add_parser("clean", help="remove what runs killed with SIGKILL left behind")
    return ap


def make_cluster(args: argparse.Namespace) -> Cluster:
    if args.loopback:
        nodes = 1
        args.ppn = args.np or (args.nodes or args.default_nodes) * args.ppn
    elif args.nodes is not None:
        nodes = args.nodes
    elif args.np:
        nodes = max(1, args.np // args.ppn)
    else:
        nodes = args.default_nodes
    if args.np and args.np != nodes * args.ppn:
        raise SystemExit(f"--np {args.np} is not --nodes {nodes} x --ppn {args.ppn}")
    rate = None if str(args.rate).lower() in ("none", "0", "") else args.rate
    node_rate = "" if args.node_rate == "" else (
        None if args.node_rate.lower() in ("none", "0") else args.node_rate)
    return Cluster(nodes=nodes, rate=rate, queue=args.queue, node_rate=node_rate,
                   node_queue=args.node_queue, burst=args.burst, mtu=args.mtu,
                   offloads=args.offloads, loopback=args.loopback)


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = parser().parse_args(argv)
    why = unavailable()
    if why:
        print(f"cluster: {why}", file=sys.stderr)
        return UNAVAILABLE
    if args.what == "clean":
        clean_leftovers(verbose=True)
        return 0
    signal.signal(signal.SIGTERM, interrupted)
    signal.signal(signal.SIGHUP, interrupted)
    cluster = make_cluster(args)
    try:
        cluster.open()
    except ClusterUnavailable as exc:
        print(f"cluster: {exc}", file=sys.stderr)
        return UNAVAILABLE
    try:
        with cluster:
            if args.what == "run":
                return run_command(cluster, args)
            if args.what == "bench":
                print(BENCH_HEAD, flush=True)
            rows = bench(cluster, args) if args.what == "bench" else train(cluster, args)
    except KeyboardInterrupt:
        print("cluster: interrupted; the job was killed and the cluster removed",
              file=sys.stderr)
        return 130
    if args.json:
        Path(args.json).write_text(json.dumps({"what": args.what, "nodes": cluster.nodes,
                                               "ppn": args.ppn, "np": cluster.nodes * args.ppn,
                                               "loopback": args.loopback, "rows": rows},
                                              indent=1))
    return 0


def run_command(cluster: Cluster, args: argparse.Namespace) -> int:
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        raise SystemExit("run: no command (cluster.py run [options] -- COMMAND ...)")
    env = dict(item.split("=", 1) for item in args.env)
    if args.drop:
        cluster.set_drop(args.drop)
    if args.bursts:
        length, every = (float(x) for x in args.bursts.split("/"))
        cluster.start_bursts(length / 1e3, every / 1e3)
    if args.gilbert:
        good, bad, loss = (float(x) for x in args.gilbert.split(":"))
        cluster.start_gilbert(good / 1e3, bad / 1e3, loss)
    began = time.monotonic()
    try:
        proc = cluster.run(command, ppn=args.ppn, np=args.np, env=env, timeout=args.limit,
                           capture=False, provider=args.provider)
    except subprocess.TimeoutExpired:
        print(f"cluster: the job ran past --limit {args.limit:g} s and was killed",
              file=sys.stderr)
        return 124
    took = time.monotonic() - began
    counts = cluster.counters()
    print(f"cluster: exit {proc.returncode} after {took:.1f} s on {cluster.nodes} node(s) x "
          f"{args.ppn}; switch: {counts['port_drops']} packets dropped at full port queues, "
          f"{counts['switch_drops']['dropped']} by drop rules, TCP retransmits "
          f"{counts['kernel'].get('Tcp.RetransSegs', 0)}", file=sys.stderr)
    if args.counters:
        Path(args.counters).write_text(json.dumps(counts, indent=1))
    return proc.returncode


if __name__ == "__main__":
    sys.exit(main())
