"""The command line: `run` (one job across the nodes, then the counters),
`bench` and `train` (MPI over TCP against mpilossy's datagrams, under each
of several drop conditions), `clean` (what runs killed with SIGKILL left).

    python -m mpilossy.cluster COMMAND [options]      (or python scripts/cluster.py ...)"""

from __future__ import annotations

import argparse
import json
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Dict, Iterator, List, NamedTuple, Optional, Sequence, Tuple, Union

from ..call.environment import to_timeout
from . import __doc__ as _overview
from . import training
from .background import parse_background
from .host import UNAVAILABLE, ClusterUnavailable, unavailable
from .leftovers import clean_leftovers
from .lifetime import Cluster


# -- bench and train: MPI over TCP against mpilossy's datagrams -------------------
def parse_sizes(text: str) -> List[Tuple[str, Union[float, str, None]]]:
    """'1M:0.05,16M:auto' -> [(size, deadline), ...] (seconds or "auto")."""
    out = []
    for item in filter(None, text.split(",")):
        size, _, deadline = item.partition(":")
        out.append((size.strip(), to_timeout(deadline or "0.05")))
    return out


class Condition(NamedTuple):
    """One condition of bench and train: extra drops, microbursts, or
    background traffic (ON s, OFF s, flows)."""
    name: str
    drop: float
    bursts: bool
    background: Optional[Tuple[float, float, int]]


def conditions(args: argparse.Namespace) -> Iterator[Condition]:
    for share in (float(x) for x in args.drops.split(",") if x.strip()):
        yield Condition(f"drop {share:g}", share, False, None)
    if args.bursts:
        yield Condition(f"bursts {args.burst_ms:g}ms/{args.burst_every_ms:g}ms", 0.0, True, None)
    if args.background:
        yield Condition(f"background {args.background}", 0.0, False,
                        parse_background(args.background))


def under(cluster: Cluster, condition: Condition, args: argparse.Namespace,
          cmd: List[str]) -> subprocess.CompletedProcess:
    """Run `cmd` as the job under the given condition, then clear it."""
    try:
        cluster.set_drop(condition.drop)
        if condition.bursts:
            cluster.start_bursts(args.burst_ms / 1e3, args.burst_every_ms / 1e3)
        if condition.background:
            on, off, flows = condition.background
            cluster.start_background(on, off, flows, seconds=args.limit + 60)
        pace = args.rate if args.pace == "port" else args.pace
        return cluster.run(cmd, ppn=args.ppn, timeout=args.limit, provider=args.provider,
                           env={"MPILOSSY_UD_RATE": pace})
    finally:
        cluster.stop_background()
        cluster.clear()


def delta(after: Dict[str, int], before: Dict[str, int]) -> Dict[str, int]:
    return {k: after[k] - before.get(k, 0) for k in after}


def bench(cluster: Cluster, args: argparse.Namespace) -> List[Dict[str, Any]]:
    rows: List[Dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as tmp:
        for cond in conditions(args):
            for size, deadline in parse_sizes(args.sizes):
                out = Path(tmp) / "bench.json"
                cmd = [sys.executable, "-m", "mpilossy.bench", "allreduce", "--scenario", "link",
                       "-c", "ud", "-a", args.algorithm, "-o", "avg", "--sizes", size,
                       "-t", str(deadline).lower(), "-n", str(args.iters), "-w", "3",
                       "--json", str(out)]
                if args.redundancy:
                    cmd += ["--redundancy", args.redundancy]
                before = cluster.counters()
                proc = under(cluster, cond, args, cmd)
                if proc.returncode != 0:
                    raise SystemExit(f"{cond.name} {size}: exit {proc.returncode}\n"
                                     f"{proc.stdout[-3000:]}{proc.stderr[-3000:]}")
                after = cluster.counters()
                for row in json.loads(out.read_text())["tail"]:
                    row.update(condition=cond.name, drop=cond.drop, bursts=cond.bursts,
                               redundancy=args.redundancy or None,
                               background=args.background if cond.background else None,
                               pace=args.pace,
                               kernel=delta(after["kernel"], before["kernel"]),
                               switch_drops=after["switch_drops"]["dropped"]
                               - before["switch_drops"]["dropped"],
                               port_drops=after["port_drops"] - before["port_drops"])
                    deadline = row.get("timeout") or (row.get("lossy_timeouts") or [None])[-1]
                    row["late_30ms"] = None if deadline is None else sum(
                        1 for t in row.get("times_us", []) if t > 1e6 * deadline + 30e3)
                    rows.append(row)
                    print(bench_line(row), flush=True)
    return rows


BENCH_HEAD = (f"{'condition':<22} {'bytes':>9} {'deadline':>8}  {'mpi-p50':>8} {'mpi-p99':>8} "
              f"{'mpi-max':>8}  {'ud-p50':>8} {'ud-p99':>8} {'ud-max':>8}  {'p99 ratio':>9} "
              f"{'delivered':>9} {'tcp-retrans':>11} {'nft-drops':>9} {'port-drops':>10}")


def ms(us: float) -> str:
    return f"{us / 1e3:8.2f}"


def bench_line(r: Dict[str, Any]) -> str:
    # timeout="auto": the deadline learned by the last call, marked with "~"
    learned = r.get("lossy_timeouts") or [0.0]
    deadline = f"{r['timeout']:8.3f}" if r["timeout"] else f"~{learned[-1]:7.3f}"
    return (f"{r['condition']:<22} {r['size']:>9} {deadline}  {ms(r['mpi_p50_us'])} "
            f"{ms(r['mpi_p99_us'])} {ms(r['mpi_max_us'])}  {ms(r['p50_us'])} {ms(r['p99_us'])} "
            f"{ms(r['max_us'])}  {r['p99_ratio']:9.2f} {r['delivered']:9.3f} "
            f"{r['kernel'].get('Tcp.RetransSegs', 0):11d} {r['switch_drops']:9d} "
            f"{r['port_drops']:10d}")


def train(cluster: Cluster, args: argparse.Namespace) -> List[Dict[str, Any]]:
    return training.train(lambda cond, cmd: under(cluster, cond, args, cmd),
                          list(conditions(args)), args)


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
    g = ap.add_argument_group("extra drops on the switch, and other traffic")
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
    g.add_argument("--background", default="", metavar="ON_MS/OFF_MS[:FLOWS]",
                   help="background TCP traffic: every node sends to the next over FLOWS "
                        "connections, on and off for these mean times (mpilossy/cluster/"
                        "background.py)" + ("" if run else "; one more condition"))


def parser(prog: Optional[str] = None) -> argparse.ArgumentParser:
    """The commands and their options; the package's text is the help."""
    doc = _overview or ""
    ap = argparse.ArgumentParser(prog=prog, description=doc.splitlines()[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog=doc.split("\n", 2)[2])
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
                           help="SIZE:DEADLINE pairs (mpilossy's deadline: seconds or auto)")
            p.add_argument("--iters", type=int, default=50, help="calls per size and way")
            p.add_argument("--redundancy", default="", metavar="K,M",
                           help="mpilossy's calls with m parity blocks per k (docs/redundancy.md)")
        else:
            p.add_argument("--steps", type=int, default=300)
            p.add_argument("--seeds", default="0", help="comma-separated seeds")
            p.add_argument("--train-timeout", type=to_timeout, default="auto",
                           help="mpilossy's deadline per call: seconds, auto (learned and "
                                "agreed, the default) or none")
            p.add_argument("--arms", type=training.parse_arms, default=",".join(training.ARMS),
                           help="the two runs of each seed, back to back: mpi,mpilossy (the "
                                "default), or an A/A pair (mpilossy,mpilossy; mpi,mpi)")
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


def main(argv: Optional[Sequence[str]] = None, prog: Optional[str] = None) -> int:
    """The command line (`prog`: its name in the help; default: the script's)."""
    args = parser(prog).parse_args(argv)
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
        if parse_background(args.background) and cluster.nodes < 2:
            raise ValueError("--background needs two nodes or more")
    except ValueError as exc:
        print(f"cluster: {exc}", file=sys.stderr)
        return 2
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
    background = parse_background(args.background)
    if background:
        on, off, flows = background
        cluster.start_background(on, off, flows, seconds=args.limit + 60)
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
