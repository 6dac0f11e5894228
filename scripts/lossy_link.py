"""One job's ranks on a real lossy link: MPI_Allreduce over TCP against
mpilossy's datagram channel, under packet drops made by the kernel.

    sudo .venv/bin/python scripts/lossy_link.py bench            # per-call p50/p99/max
    sudo .venv/bin/python scripts/lossy_link.py train            # the language model, both ways
    sudo .venv/bin/python scripts/lossy_link.py bench --drops 0,0.01 --sizes 1M:0.05 --iters 20

The link is a network namespace of its own (mpilossy-link-PID).  Its
loopback gets an Ethernet MTU (1500) and its segmentation offloads turned
off (ethtool), so that TCP and UDP (also UDP sent with segmentation
offload) reach the device as wire-sized packets, as they would leave a NIC;
an nftables chain on the loopback's ingress then drops a share of the TCP
and UDP packets at random (`numgen random`), each packet once, whichever way
it goes.  `--bursts` adds microbursts: a drop-everything rule switched on for
--burst-ms every --burst-every-ms on average (through one `nft -i` fed by a
pipe).  Only addresses inside the namespace exist, and the namespace (with
its rules) is deleted on every way out (normal end, exception, SIGINT,
SIGTERM).

Both ways run in one job, on the same ranks and buffers: MPICH over TCP
(`MPIR_CVAR_NOLOCAL=1`: no shared memory; `MPIR_CVAR_CH4_NETMOD=ofi
FI_PROVIDER=tcp,udp`: libfabric's tcp provider; UCX refuses TCP over
loopback) and mpilossy
with channel="ud" (--provider: libfabric's udp provider, or mpilossy's own
sockets).  Needs root, `ip`, `nft` and `ethtool` (Debian: iproute2,
nftables, ethtool); without them it says why
and exits with status 3.  Results: a table on stdout and, with --json, every
number (the rows of `python -m mpilossy.bench allreduce --scenario link` and
of the training runs).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Dict, Iterator, List, Optional, Sequence, Tuple

UNAVAILABLE = 3          # exit status: no root, ip or nft (the test skips on it)
TABLE = "mpilossy_link"
PACKETS = "meta protocol ip ip protocol { tcp, udp }"      # what the rules drop


def unavailable() -> Optional[str]:
    """Why a lossy link cannot be made here, or None."""
    if os.geteuid() != 0:
        return "needs root (network namespaces and nftables)"
    for tool, package in (("ip", "iproute2"), ("nft", "nftables"), ("ethtool", "ethtool")):
        if shutil.which(tool) is None:
            return f"needs `{tool}` (Debian: {package})"
    return None


def run(cmd: Sequence[str], **kwargs: Any) -> subprocess.CompletedProcess:
    return subprocess.run(list(cmd), check=True, capture_output=True, text=True, **kwargs)


class LossyLink:
    """A namespace whose loopback drops `drop` of the TCP/UDP packets, and
    optionally everything during bursts.  A context manager: the namespace
    goes away on exit."""

    def __init__(self, mtu: int = 1500) -> None:
        self.name = f"mpilossy-link-{os.getpid()}"
        self.mtu = mtu
        self._bursts: Optional[threading.Thread] = None
        self._stop = threading.Event()

    def __enter__(self) -> "LossyLink":
        run(["ip", "netns", "add", self.name])
        try:
            self.ns("ip", "link", "set", "lo", "mtu", str(self.mtu))
            self.ns("ip", "link", "set", "lo", "up")
            self.ns("ethtool", "-K", "lo", "tso", "off", "gso", "off", "tx-udp-segmentation", "off",
                    "gro", "off")
            hook = 'type filter hook ingress device "lo"'
            self.nft(f"add table netdev {TABLE}\n"
                     f"add chain netdev {TABLE} drops {{ {hook} priority 0 ; }}\n"
                     f"add chain netdev {TABLE} bursts {{ {hook} priority 1 ; }}\n")
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self.stop_bursts()
        subprocess.run(["ip", "netns", "del", self.name], capture_output=True)

    def ns(self, *cmd: str, **kwargs: Any) -> subprocess.CompletedProcess:
        return run(["ip", "netns", "exec", self.name, *cmd], **kwargs)

    def nft(self, script: str) -> None:
        self.ns("nft", "-f", "-", input=script)

    def set_drop(self, share: float) -> None:
        """Drop `share` (0..1) of the TCP and UDP packets, at random."""
        if not 0 <= share < 1:
            raise ValueError(f"drop share {share}: 0 <= share < 1")
        rule = (f"add rule netdev {TABLE} drops {PACKETS} "
                f"numgen random mod 100000 < {round(share * 100000)} drop\n" if share else "")
        self.nft(f"flush chain netdev {TABLE} drops\n" + rule)

    def start_bursts(self, every: float, length: float) -> None:
        """Drop every TCP/UDP packet for `length` seconds, every `every`
        seconds (the phase drawn at random each time), until stop_bursts."""
        shell = subprocess.Popen(["ip", "netns", "exec", self.name, "nft", "-i"],
                                 stdin=subprocess.PIPE, stdout=subprocess.DEVNULL,
                                 stderr=subprocess.DEVNULL, text=True)
        on = f"add rule netdev {TABLE} bursts {PACKETS} drop\n"
        off = f"flush chain netdev {TABLE} bursts\n"

        def toggle() -> None:
            import random
            rng = random.Random(1)
            assert shell.stdin is not None
            try:
                while not self._stop.wait(rng.uniform(0.5, 1.5) * every):
                    shell.stdin.write(on)
                    shell.stdin.flush()
                    time.sleep(length)
                    shell.stdin.write(off)
                    shell.stdin.flush()
            finally:
                shell.stdin.write(off)
                shell.stdin.close()
                shell.wait(timeout=10)

        self._stop.clear()
        self._bursts = threading.Thread(target=toggle, daemon=True)
        self._bursts.start()

    def stop_bursts(self) -> None:
        if self._bursts is not None:
            self._stop.set()
            self._bursts.join(timeout=10)
            self._bursts = None

    def kernel_counters(self) -> Dict[str, int]:
        """The namespace's UDP datagrams and TCP segments sent and TCP
        segments retransmitted so far (/proc/net/snmp)."""
        out = self.ns("cat", "/proc/net/snmp").stdout.splitlines()
        stats: Dict[str, int] = {}
        for head, values in zip(out[::2], out[1::2]):
            proto, names = head.split(":", 1)
            for name, value in zip(names.split(), values.split(":", 1)[1].split()):
                if (proto, name) in (("Udp", "OutDatagrams"), ("Tcp", "RetransSegs"),
                                     ("Tcp", "OutSegs")):
                    stats[f"{proto}.{name}"] = int(value)
        return stats


def job_environment(provider: str) -> Dict[str, str]:
    """MPICH over TCP for MPI; the datagram `provider` for mpilossy."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("PMI_", "HYDRA_", "MPIR_CVAR_", "UCX_", "FI_", "MPILOSSY_"))}
    # MPICH's libfabric netmod with the tcp provider (UCX refuses TCP over
    # loopback); "udp" stays allowed for mpilossy, whose provider is named
    # apart (MPICH needs reliable endpoints and never picks it).
    env.update(MPIR_CVAR_NOLOCAL="1", MPIR_CVAR_CH4_NETMOD="ofi", FI_PROVIDER="tcp,udp",
               MPILOSSY_UD_PROVIDER=provider, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    return env


def mpiexec(np_: int) -> List[str]:
    here = Path(sys.executable).parent
    return [str(here / "mpiexec") if (here / "mpiexec").exists() else "mpiexec", "-n", str(np_)]


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


def in_link(link: LossyLink, share: float, bursts: bool, args: argparse.Namespace,
            cmd: List[str], timeout: float) -> subprocess.CompletedProcess:
    """Run `cmd` in the namespace under the given drops."""
    link.set_drop(share)
    if bursts:
        link.start_bursts(args.burst_every_ms / 1e3, args.burst_ms / 1e3)
    # A session of its own: on any way out the whole job (mpiexec and its
    # ranks) is killed, not mpiexec alone, and what a killed job left in
    # /dev/shm (the bench's meeting folders) is removed.
    shm = Path("/dev/shm")
    before = set(shm.glob("mpilossy-bench-*"))
    job = subprocess.Popen(["ip", "netns", "exec", link.name, *cmd],
                           env=job_environment(args.provider),
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                           start_new_session=True)
    try:
        out, err = job.communicate(timeout=timeout)
        return subprocess.CompletedProcess(cmd, job.returncode, out, err)
    finally:
        if job.poll() is None:
            os.killpg(job.pid, signal.SIGKILL)
            job.communicate()
            for left in set(shm.glob("mpilossy-bench-*")) - before:
                shutil.rmtree(left, ignore_errors=True)
        link.stop_bursts()
        link.set_drop(0)


def bench(link: LossyLink, args: argparse.Namespace) -> List[Dict[str, Any]]:
    rows: List[Dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as tmp:
        for name, share, bursts in conditions(args):
            for size, deadline in parse_sizes(args.sizes):
                out = Path(tmp) / "bench.json"
                cmd = mpiexec(args.np) + [
                    sys.executable, "-m", "mpilossy.bench", "allreduce", "--scenario", "link",
                    "-c", "ud", "-a", args.algorithm, "-o", "avg", "--sizes", size,
                    "-t", str(deadline), "-n", str(args.iters), "-w", "3", "--json", str(out)]
                before = link.kernel_counters()
                proc = in_link(link, share, bursts, args, cmd, args.limit)
                if proc.returncode != 0:
                    raise SystemExit(f"{name} {size}: exit {proc.returncode}\n"
                                     f"{proc.stdout[-3000:]}{proc.stderr[-3000:]}")
                after = link.kernel_counters()
                for row in json.loads(out.read_text())["tail"]:
                    row.update(condition=name, drop=share, bursts=bursts,
                               kernel={k: after[k] - before.get(k, 0) for k in after})
                    row.pop("times_us", None)
                    row.pop("mpi_times_us", None)
                    rows.append(row)
                    print(bench_line(row), flush=True)
    return rows


BENCH_HEAD = (f"{'condition':<22} {'bytes':>9} {'deadline':>8}  {'mpi-p50':>8} {'mpi-p99':>8} "
              f"{'mpi-max':>8}  {'ud-p50':>8} {'ud-p99':>8} {'ud-max':>8}  {'p99 ratio':>9} "
              f"{'delivered':>9} {'tcp-retrans':>11}")


def ms(us: float) -> str:
    return f"{us / 1e3:8.2f}"


def bench_line(r: Dict[str, Any]) -> str:
    return (f"{r['condition']:<22} {r['size']:>9} {r['timeout'] or 0:8.3f}  {ms(r['mpi_p50_us'])} "
            f"{ms(r['mpi_p99_us'])} {ms(r['mpi_max_us'])}  {ms(r['p50_us'])} {ms(r['p99_us'])} "
            f"{ms(r['max_us'])}  {r['p99_ratio']:9.2f} {r['delivered']:9.3f} "
            f"{r['kernel'].get('Tcp.RetransSegs', 0):11d}")


def train(link: LossyLink, args: argparse.Namespace) -> List[Dict[str, Any]]:
    rows: List[Dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as tmp:
        for name, share, bursts in conditions(args):
            for seed in (int(s) for s in args.seeds.split(",")):
                for reduce in ("mpi", "mpilossy"):
                    out = Path(tmp) / "train.json"
                    cmd = mpiexec(args.np) + [
                        sys.executable, "-m", "mpilossy.examples.lm", "--reduce", reduce,
                        "--channel", "ud", "--algorithm", args.algorithm,
                        "--timeout", str(args.train_timeout), "--steps", str(args.steps),
                        "--seed", str(seed), "--no-progress", "--json", str(out),
                        *args.example_args.split()]
                    proc = in_link(link, share, bursts, args, cmd, args.limit)
                    if proc.returncode != 0:
                        raise SystemExit(f"{name} {reduce}: exit {proc.returncode}\n"
                                         f"{proc.stdout[-3000:]}{proc.stderr[-3000:]}")
                    res = json.loads(out.read_text())
                    row = {"condition": name, "drop": share, "bursts": bursts, "seed": seed,
                           "reduce": reduce, **{k: res[k] for k in (
                               "val_perplexity", "delivered", "train_seconds", "comm_seconds",
                               "wall_seconds")}}
                    rows.append(row)
                    print(f"{name:<22} seed {seed} {reduce:<9} train {row['train_seconds']:7.1f} s"
                          f"  comm {row['comm_seconds']:6.1f} s  perplexity "
                          f"{row['val_perplexity']:6.3f}  delivered {row['delivered']:.3f}",
                          flush=True)
    return rows


def interrupted(signum: int, frame: object) -> None:
    """SIGTERM unwinds like Ctrl-C, so the namespace is deleted either way."""
    raise KeyboardInterrupt


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog=__doc__.split("\n", 2)[2])
    ap.add_argument("what", choices=("bench", "train"))
    ap.add_argument("--np", type=int, default=4, help="ranks")
    ap.add_argument("--drops", default="0,0.001,0.01,0.05",
                    help="shares of TCP/UDP packets dropped, one run each")
    ap.add_argument("--bursts", action="store_true", help="also a run with microbursts")
    ap.add_argument("--burst-ms", type=float, default=5.0, help="length of a burst")
    ap.add_argument("--burst-every-ms", type=float, default=50.0, help="mean gap between bursts")
    ap.add_argument("--algorithm", default="direct", help="of mpilossy's all-reduce")
    ap.add_argument("--provider", default="native",
                    help="mpilossy's datagram transport: native (its own UDP sockets) or a "
                         "libfabric provider (udp)")
    ap.add_argument("--sizes", default="1M:0.1,16M:2",
                    help="bench: SIZE:DEADLINE pairs (mpilossy's deadline in seconds)")
    ap.add_argument("--iters", type=int, default=50, help="bench: calls per size and way")
    ap.add_argument("--steps", type=int, default=300, help="train: steps")
    ap.add_argument("--seeds", default="0", help="train: comma-separated seeds")
    ap.add_argument("--train-timeout", type=float, default=0.05,
                    help="train: mpilossy's deadline per call (s)")
    ap.add_argument("--example-args", default="",
                    help="train: more arguments of the example, e.g. '--no-align'")
    ap.add_argument("--limit", type=float, default=1200, help="seconds per job before it is killed")
    ap.add_argument("--json", help="write every row here")
    return ap


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = parser().parse_args(argv)
    why = unavailable()
    if why:
        print(f"lossy_link: {why}", file=sys.stderr)
        return UNAVAILABLE
    signal.signal(signal.SIGTERM, interrupted)
    with LossyLink() as link:
        if args.what == "bench":
            print(BENCH_HEAD, flush=True)
        rows = bench(link, args) if args.what == "bench" else train(link, args)
    if args.json:
        Path(args.json).write_text(json.dumps({"what": args.what, "np": args.np,
                                               "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
