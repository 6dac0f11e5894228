"""``mpiexec -n 4 python -m mpilossy.bench COMMAND [options]``: the benchmarks,
each a command with its own options (``python -m mpilossy.bench COMMAND -h``).

Without a command, the options are those of allreduce:
``python -m mpilossy.bench --sizes 1M`` is ``python -m mpilossy.bench allreduce --sizes 1M``."""

from __future__ import annotations

import argparse
import importlib
import sys
from typing import Dict, List, Optional, Sequence

PROG = "python -m mpilossy.bench"
DEFAULT = "allreduce"

# command: what it measures (the module mpilossy.bench.<command>, '-' as '_', does it)
COMMANDS: Dict[str, str] = {
    "allreduce": "lossy all-reduce against MPI_Allreduce, nccl-tests style (the default)",
    "crossover": "where the tree stops beating the ring, lossless (algorithm='auto')",
    "deadline": "how far past its timeout a call returns when a peer is late",
    "kernels": "the reduction kernels against a copy, and datagram authentication (--mac)",
    "delivery": "the contributions each algorithm keeps under loss, at several rank counts",
    "torch": "training under loss: drift (optimizer wrappers), overlap (DDP hook)",
    "device": "GPU buffers: staged mpilossy against mpi4py with host staging and Gloo",
    "device-node": "a node's stages on device memory (CUDA IPC) against host staging",
    "group": "group averaging (GroupAverager, Moshpit) against a full lossy all-reduce",
    "node": "the hierarchy's stages within a node against MPI's reduce-scatter + allgather",
    "elastic": "what elastic=True's heartbeat costs: elastic against plain calls, and MPI",
    "dtypes": "one element count in several dtypes (bfloat16 against float32), interleaved",
    "backend": "torch.distributed all_reduce: the 'mpilossy' backend against Gloo, interleaved",
}


def build_parser(command: Optional[str] = None) -> argparse.ArgumentParser:
    """Every command is listed; only `command`'s module is imported and its
    options added (the torch command imports torch, for one, and the others
    must run without it)."""
    parser = argparse.ArgumentParser(prog=PROG, description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name, summary in COMMANDS.items():
        if name != command:
            sub.add_parser(name, help=summary)
            continue
        module = importlib.import_module(f"mpilossy.bench.{name.replace('-', '_')}")
        p = sub.add_parser(name, help=summary, description=module.__doc__,
                           formatter_class=argparse.RawDescriptionHelpFormatter)
        module.add_arguments(p)
        p.set_defaults(run=module.run)
    return parser


def main(argv: Optional[Sequence[str]] = None) -> int:
    args: List[str] = list(sys.argv[1:] if argv is None else argv)
    if not args or (args[0].startswith("-") and args[0] not in ("-h", "--help")):
        args.insert(0, DEFAULT)             # the spelling from before the commands
    ns = build_parser(args[0]).parse_args(args)
    code: int = ns.run(ns)
    return code


if __name__ == "__main__":
    sys.exit(main())
