"""A process started after a loss joins the survivors through MPI's
ports (MPI_Open_port, MPI_Comm_accept, MPI_Comm_connect), the port name
published in a file: the building block docs/elastic.md ("Growing back")
weighs against hot spares and MPI_Comm_spawn.  MPI only, no mpilossy.

  job FILE             under mpiexec/srun (3 or more ranks): the last rank
                       exits at once; the others build their communicator
                       (MPI_Comm_create_group, as an exclusion does), the
                       lowest opens a port and writes its name to FILE,
                       all accept one newcomer, merge, and sum rank + 1
  new FILE [SECONDS]   a singleton (or a job step of its own): waits for
                       FILE, connects, merges, sums

Every process prints one JSON line {"rank", "role", "size", "sum", "seconds"}
(seconds: from its start to the merged communicator).  SECONDS bounds the
newcomer's wait for FILE (default 30)."""

import json
import os
import sys
import time

from mpi4py import MPI

role, path = sys.argv[1], sys.argv[2]
bound = float(sys.argv[3]) if len(sys.argv) > 3 else 30.0
began = time.monotonic()
world = MPI.COMM_WORLD
if role == "job":
    if world.rank == world.size - 1:
        os._exit(3)                                   # the rank lost
    group = world.Get_group()
    kept = group.Incl(list(range(world.size - 1)))
    survivors = world.Create_group(kept, tag=7)
    kept.Free()
    group.Free()
    port = MPI.Open_port() if survivors.rank == 0 else ""
    if survivors.rank == 0:
        with open(path + ".tmp", "w") as f:
            f.write(port)
        os.rename(path + ".tmp", path)                 # (whole, or not there)
    inter = survivors.Accept(port, root=0)
    merged = inter.Merge(high=False)
else:
    while not os.path.exists(path):
        if time.monotonic() - began > bound:
            sys.exit(f"no port name in {path} after {bound} s")
        time.sleep(0.01)
    with open(path) as f:
        port = f.read()
    inter = world.Connect(port, root=0)
    merged = inter.Merge(high=True)
joined = time.monotonic() - began
total = merged.allreduce(merged.rank + 1)
print(json.dumps({"rank": merged.rank, "role": role, "size": merged.size, "sum": total,
                  "seconds": round(joined, 3)}), flush=True)
merged.Free()
inter.Disconnect()
if role == "job":
    if survivors.rank == 0:
        MPI.Close_port(port)
    os._exit(0)         # (MPI_Finalize waits for the lost rank: docs/elastic.md)
