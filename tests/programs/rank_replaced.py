"""What MPI offers for a rank to come back after another exited (the
foundation of a rejoin, docs/elastic.md "Growing back"), bare, without the
Communicator.  Launch with ``mpiexec -disable-auto-cleanup``.

    mpiexec -disable-auto-cleanup -n N python rank_replaced.py spare VICTIM [silent]
    mpiexec -disable-auto-cleanup -n N python rank_replaced.py spawn VICTIM [silent]

spare: the last rank is a hot spare, launched with the job and outside the
working communicator (the others); VICTIM (a worker) exits; the
survivors see it (MPIX_Comm_get_failed), rank 0 calls the spare in with a
message on COMM_WORLD, and survivors and spare build their communicator
(MPI_Comm_create_group, collective over them only).  spawn: VICTIM exits;
the survivors start a replacement with MPI_Comm_spawn and merge with it.
Every rank of the grown communicator prints one JSON line: its world rank
(the replacement: -1), its rank and size there, an exact all-reduce of
(rank + 1) there, and the seconds from seeing the loss to the grown
communicator.  `silent`: the launcher reports no exit (srun's PMI2), so
the survivors take VICTIM as gone 0.5 s after it left, as the elastic
heartbeat would find a silent rank.  Everyone ends with os._exit: MPI_Finalize hangs after a
death."""

import json
import os
import sys
import time

from mpi4py import MPI

from mpilossy.control.failures import failed_ranks, survivors

CALL_IN = 9         # the tag of the spare's call-in


def report(grown: MPI.Intracomm, world_rank: int, since: float) -> None:
    total = grown.allreduce(grown.rank + 1)
    print(json.dumps({"world": world_rank, "rank": grown.rank, "size": grown.size,
                      "result": total, "seconds": round(time.monotonic() - since, 3)}),
          flush=True)
    os._exit(0)


def wait_for_failure(comm: MPI.Intracomm, bound: float = 20.0) -> frozenset:
    if len(sys.argv) > 3 and sys.argv[3] == "silent":
        time.sleep(0.5)
        return frozenset([victim])
    began = time.monotonic()
    while time.monotonic() - began < bound:
        gone = failed_ranks(comm)
        if gone:
            return gone
        time.sleep(0.01)
    print(json.dumps({"world": comm.rank, "error": "no failure reported"}), flush=True)
    os._exit(1)


if sys.argv[1] == "child":                  # the replacement MPI_Comm_spawn started
    parent = MPI.Comm.Get_parent()
    report(parent.Merge(high=True), -1, time.monotonic())

world = MPI.COMM_WORLD
how, victim = sys.argv[1], int(sys.argv[2])
spare = world.size - 1 if how == "spare" else None
workers = survivors(world, [spare]) if spare is not None and world.rank != spare else world
if world.rank == victim:
    os._exit(0)
if world.rank == spare:
    members = world.recv(source=MPI.ANY_SOURCE, tag=CALL_IN)
    since = time.monotonic()
else:
    gone = wait_for_failure(world)
    since = time.monotonic()
    members = [r for r in range(world.size) if r not in gone]
    if how == "spare" and world.rank == min(members):
        world.send(members, dest=spare, tag=CALL_IN)
if how == "spare":
    report(world.Create_group(world.Get_group().Incl(members), tag=CALL_IN), world.rank, since)
rest = survivors(world, sorted(set(range(world.size)) - set(members)))
inter = rest.Spawn(sys.executable, args=[__file__, "child"], maxprocs=1, root=0)
report(inter.Merge(high=False), world.rank, since)
