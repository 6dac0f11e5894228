"""An emulated cluster on one machine: nodes, a switch, one MPI job across them.

    python -m mpilossy.cluster run --nodes 2 --ppn 2 --rate 1gbit -- \\
        python -m mpilossy.bench allreduce -c rma,ud -t 0.1
    python -m mpilossy.cluster run --nodes 3 --ppn 1 --drop 0.01 --queue 64kb -- python job.py
    python -m mpilossy.cluster bench --nodes 4 --ppn 1      # MPI over TCP against ud, under drops
    python -m mpilossy.cluster bench --drops 0 --background 200/300:2   # ... beside other traffic
    python -m mpilossy.cluster train --nodes 4 --ppn 1      # the language model, both ways
    python -m mpilossy.cluster bench --loopback --np 4      # the former lossy_link.py: one node,
                                                            # every rank through its loopback
    python -m mpilossy.cluster clean                        # what killed runs left behind

(`python scripts/cluster.py ...` is the same command line.)

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
Other traffic: --background ON_MS/OFF_MS[:FLOWS] (every node sends to the
next of a ring over FLOWS TCP connections, on and off for these mean times:
another job sharing the ports, as on a shared cluster).

The job: MPICH's hydra launcher started on node 1, reaching the other
nodes through a launcher wrapper (`-launcher ssh -launcher-exec WRAPPER`)
that enters the node's namespaces; ranks of one node share memory (MPICH
groups them by host name), ranks of different nodes talk over TCP
(MPIR_CVAR_CH4_NETMOD=ofi FI_PROVIDER=tcp FI_TCP_IFACE=eth0).

Everything it makes is removed on every way out: normal end, exception,
SIGINT, SIGTERM, SIGHUP (also one that arrives while it removes), a job
past --limit (its processes are found by namespace and killed).  A run
killed with SIGKILL leaves its namespaces; the next start (or `clean`)
removes those whose owner is gone (leftovers.py says how it knows).  Needs
root, `ip`, `tc` (iproute2), `nft` (nftables), `ethtool`, `unshare` and
`mount` (util-linux), and a kernel with veth, bridge and tbf: without them
it says why and exits with status 3.

From Python (tests/cluster/test_multinode.py):

    from mpilossy.cluster import Cluster
    with Cluster(nodes=2, rate="1gbit") as c:
        proc = c.run(["python", "job.py"], ppn=2, timeout=120)
        c.set_drop(0.01); print(c.counters())

While one is open in a program that has no SIGTERM (SIGHUP) handler of its
own, such a signal removes the clusters first, then kills the program as
before.

A job can ask the cluster to change its conditions while it runs (drops,
bursts, SIGSTOP of a process on a node, counters): mpilossy.cluster.request(...),
through files in the folder named by $CLUSTER_CONTROL.

The modules: lifetime (Cluster: its parts, open and close), network
(namespaces, switch, ports, counters), conditions (drops and loss
processes), background (other traffic; its processes: flows), jobs
(launching on the nodes, stopping processes), control (a job's requests),
leftovers (owners, leftovers of killed runs, signals), host (what the
machine must offer), commands (the command line).
"""

from .background import parse_background
from .commands import interrupted, main
from .control import request
from .host import (UNAVAILABLE, ClusterUnavailable, _kill_in, _netns_names, _netns_pids, sh,
                   unavailable)
from .leftovers import PREFIX, STATE_ROOT, clean_leftovers
from .lifetime import Cluster

__all__ = [
    "Cluster",
    "ClusterUnavailable",
    "PREFIX",
    "STATE_ROOT",
    "UNAVAILABLE",
    "clean_leftovers",
    "interrupted",
    "main",
    "parse_background",
    "request",
    "sh",
    "unavailable",
]
