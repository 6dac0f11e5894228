"""The per-rank half of tests/cluster/test_multinode.py: one MPI job across the nodes
of mpilossy.cluster's emulated cluster runs every check, and rank 0 prints
one JSON line of what was measured; the test asserts on it.

    python multinode.py --phases topology,lossless,unbiased,drops,sigstop

Phases (each for channel="rma" and channel="ud" with the native transport):
- topology: host names, ranks per node (MPI's shared-memory split),
  shared-memory peers of the one-sided channel, the datagram channel's
  interface and address;
- lossless: no deadline, no loss: direct, ring and tree against
  MPI_Allreduce (exact small integers), reduce_scatter and allgather;
- unbiased: injected Bernoulli loss, fixed and different data per rank:
  per element, the rank-averaged result over many calls against the exact
  average (a t statistic); the calls' durations show early close;
- drops: the switch drops a share of the TCP/UDP packets (asked of the
  cluster through $CLUSTER_CONTROL); calls with a deadline and no injected
  loss, their durations and what was delivered, the switch's counters;
- sigstop: the last rank asks the cluster to SIGSTOP it for a while in the
  middle of a run of calls; how long the other ranks' calls took meanwhile.
"""

import argparse
import json
import os
import socket
import sys
import time
from pathlib import Path

import numpy as np
from mpi4py import MPI

import mpilossy
from mpilossy.cluster import request    # the emulated cluster's control folder

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))   # tests/: helpers
from helpers import cpu_wait  # noqa: E402

ap = argparse.ArgumentParser()
ap.add_argument("--phases", default="topology,lossless,unbiased,drops,sigstop")
ap.add_argument("--channels", default="rma,ud")
ap.add_argument("--algorithms", default="direct,ring,tree,hierarchical")
ap.add_argument("--calls", type=int, default=150, help="unbiased: calls per channel and algorithm")
ap.add_argument("--loss", type=float, default=0.1, help="unbiased: injected Bernoulli loss")
ap.add_argument("--timeout", type=float, default=0.2, help="unbiased: deadline per call")
ap.add_argument("--drop", type=float, default=0.05, help="drops: share dropped on the switch")
ap.add_argument("--drop-calls", type=int, default=20)
ap.add_argument("--drop-timeout", type=float, default=0.1)
ap.add_argument("--stop-seconds", type=float, default=0.8)
ap.add_argument("--stop-calls", type=int, default=16)
ap.add_argument("--stop-timeout", type=float, default=0.1)
args = ap.parse_args()

comm = MPI.COMM_WORLD
rank, size = comm.rank, comm.size
channels = args.channels.split(",")
algorithms = args.algorithms.split(",")
phases = args.phases.split(",")
report = {}


def small_ints(n, r):
    """Values whose sums are exact in float64 whatever the order."""
    return ((np.arange(n) * 7 + 3 * r) % 23 + r).astype(np.float64)


def communicator(channel, **kw):
    return mpilossy.Communicator(comm, channel=channel, **kw)


# -- topology ----------------------------------------------------------------
def topology():
    node = comm.Split_type(MPI.COMM_TYPE_SHARED)
    # Each node has a /dev/shm of its own: rank 0's file is seen on its node only.
    probe = Path("/dev/shm") / f"multinode-probe-{comm.bcast(os.getpid())}"
    if rank == 0:
        probe.touch()
    comm.Barrier()
    out = {"hosts": comm.gather(socket.gethostname(), root=0),
           "node_sizes": comm.gather(node.size, root=0),
           "sees_rank0_shm": comm.gather(probe.exists(), root=0)}
    comm.Barrier()
    if rank == 0:
        probe.unlink()
    node.Free()
    for ch in channels:
        with communicator(ch, timeout=None, loss=None) as lc:
            info = lc.channel_info()
            mine = {"shared_memory_peers": lc.shared_memory_peers if ch == "rma" else None,
                    "domain": info.get("domain"), "address": info.get("address")}
            out[ch] = comm.gather(mine, root=0)
    return out


# -- lossless ------------------------------------------------------------------
def lossless():
    out = {}
    for ch in channels:
        wrong = {}
        with communicator(ch, timeout=None, loss=None, block_bytes=16384) as lc:
            for algo in algorithms:
                for n in (1, 1000, 70_003):
                    x = small_ints(n, rank)
                    ref = np.empty_like(x)
                    comm.Allreduce(x, ref)
                    got = np.full_like(x, np.nan)
                    stats = lc.allreduce(x, got, op="sum", algorithm=algo)
                    wrong[f"{algo} {n}"] = int(np.sum(got != ref)) + (stats.delivered != 1.0)
            n = 50_001
            x = small_ints(n, rank)
            ref = np.empty_like(x)
            comm.Allreduce(x, ref)
            lo, hi = lc.chunk_bounds(n)
            part = np.full(hi - lo, np.nan)
            lc.reduce_scatter(x, part, algorithm="direct")
            wrong["reduce_scatter"] = int(np.sum(part != ref[lo:hi]))
            full = np.full(n, np.nan)
            lc.allgather(part, full)
            wrong["allgather"] = int(np.sum(full != ref))
        everyone = comm.gather(wrong, root=0)
        if rank == 0:
            out[ch] = {k: sum(w[k] for w in everyone) for k in everyone[0]}
    return out


# -- unbiased, early close -------------------------------------------------------
ELEMENTS, BLOCK = 64, 64        # 8 doubles per block: several blocks per chunk


def fixed_data(r):
    """Rank r's vector: around r, different per element (test_unbiased.py's)."""
    e = np.arange(ELEMENTS)
    return r + 0.5 * np.sin(1.3 * e + r)


def unbiased():
    out = {}
    exact = np.mean([fixed_data(r) for r in range(size)], axis=0)
    for ch in channels:
        loss = mpilossy.loss.Bernoulli(args.loss, seed=11)
        with communicator(ch, timeout=args.timeout, loss=loss, block_bytes=BLOCK) as lc:
            for algo in algorithms:
                results = np.empty((args.calls, ELEMENTS))
                elapsed, delivered, lossy = [], [], []
                lost = np.zeros(4, np.int64)
                for call in range(args.calls):
                    t = time.monotonic()
                    stats = lc.allreduce(fixed_data(rank), results[call], op="avg",
                                         algorithm=algo)
                    elapsed.append(time.monotonic() - t)
                    delivered.append(stats.delivered)
                    lossy.append(stats.lost_blocks[0] > 0)
                    lost += stats.lost_blocks
                gathered = comm.gather(results, root=0)
                times = comm.gather((elapsed, lossy), root=0)
                losts = comm.gather(lost.tolist(), root=0)
                delivered = comm.gather(float(np.mean(delivered)), root=0)
                if rank == 0:
                    z = np.mean(gathered, axis=0)              # per call, averaged over ranks
                    se = z.std(axis=0, ddof=1) / np.sqrt(len(z))
                    t = np.abs(z.mean(axis=0) - exact) / np.where(se > 0, se, np.inf)
                    el = np.concatenate([e for e, _ in times])
                    lo = np.concatenate([l for _, l in times])
                    out[f"{ch} {algo}"] = {
                        "max_t": float(t.max()), "over_4": float(np.mean(t > 4)),
                        "delivered": float(np.mean(delivered)),
                        "lost_blocks": np.sum(losts, axis=0).tolist(),
                        "elapsed_p50": float(np.median(el)),
                        "lossy_elapsed_p50": float(np.median(el[lo])) if lo.any() else None,
                        "elapsed_max": float(el.max()), "timeout": args.timeout}
    return out


# -- drops on the switch -----------------------------------------------------------
def drops():
    out = {}
    x = small_ints(8192, rank)              # 64 KiB: dozens of packets per rank
    for ch in channels:
        with communicator(ch, timeout=args.drop_timeout, loss=None) as lc:
            lc.allreduce(x, algorithm="direct")         # connections up before the drops
            comm.Barrier()
            before = request(counters=True) if rank == 0 else None
            if rank == 0:
                request(drop=args.drop)
            comm.Barrier()
            elapsed, net, delivered = [], [], []
            for _ in range(args.drop_calls):
                t, queued = time.monotonic(), cpu_wait()
                stats = lc.allreduce(x, algorithm="direct")
                elapsed.append(time.monotonic() - t)
                net.append(elapsed[-1] - (cpu_wait() - queued))
                delivered.append(stats.delivered)
            comm.Barrier()
            if rank == 0:
                after = request(counters=True)
                request(clear=True)
            comm.Barrier()
        el = comm.gather(elapsed, root=0)
        nt = comm.gather(net, root=0)
        dl = comm.gather(delivered, root=0)
        if rank == 0:
            out[ch] = {"elapsed_max": float(np.max(el)), "elapsed_p50": float(np.median(el)),
                       "elapsed_net_max": float(np.max(nt)),
                       "delivered_min": float(np.min(dl)), "delivered_mean": float(np.mean(dl)),
                       "switch_drops": after["switch_drops"]["dropped"]
                       - before["switch_drops"]["dropped"],
                       "tcp_retransmits": after["kernel"].get("Tcp.RetransSegs", 0)
                       - before["kernel"].get("Tcp.RetransSegs", 0),
                       "timeout": args.drop_timeout}
    return out


# -- a stopped rank ------------------------------------------------------------------
def sigstop():
    out = {}
    victim = size - 1
    x = small_ints(1024, rank)
    for ch in channels:
        with communicator(ch, timeout=args.stop_timeout, loss=None) as lc:
            lc.allreduce(x, algorithm="direct")
            comm.Barrier()
            calls = []
            began = time.monotonic()
            for call in range(args.stop_calls):
                if rank == victim and call == 3:
                    # Stopped by the cluster while it waits for the answer.
                    request(stop=os.getpid(), seconds=args.stop_seconds)
                t = time.monotonic()
                stats = lc.allreduce(x, algorithm="direct")
                calls.append((t - began, time.monotonic() - t, stats.delivered,
                              stats.contributed(victim) if rank != victim else 1.0))
            comm.Barrier()
        everyone = comm.gather(calls, root=0)
        if rank == 0:
            others = [c for r, cs in enumerate(everyone) if r != victim for c in cs]
            out[ch] = {"others_elapsed_max": max(c[1] for c in others),
                       "others_missing_victim": sum(c[3] < 1.0 for c in others),
                       "others_calls": len(others),
                       "others_span": max(c[0] + c[1] for c in others),
                       "victim_span": max(c[0] + c[1] for c in everyone[victim]),
                       "timeout": args.stop_timeout, "stop_seconds": args.stop_seconds}
    return out


PHASES = {"topology": topology, "lossless": lossless, "unbiased": unbiased, "drops": drops,
          "sigstop": sigstop}
for phase in phases:
    t0 = time.monotonic()
    report[phase] = PHASES[phase]()
    report.setdefault("seconds", {})[phase] = round(time.monotonic() - t0, 2)
if rank == 0:
    print("MULTINODE " + json.dumps(report), flush=True)
