"""Planted faults (tests/core/test_planted.py, the mutation check): with
PLANTED_FAULT=NAME in the environment and this folder on PYTHONPATH,
every Python process of a test run (pytest's ranks and the programs the
tests launch) patches one defect into mpilossy as soon as it is imported.
The tests that guard the invariant the defect breaks must then fail.

Each fault reproduces a defect's effect at the boundary where the library
hands it on (the compiled core's result, a control loop's answer), so the
production code carries no hook for it.
"""

import importlib.abc
import importlib.util
import os
import sys

FAULT = os.environ.get("PLANTED_FAULT", "")
VICTIM = 1              # the rank (of COMM_WORLD) whose data a fault loses or hides


def _world_rank() -> int:
    from mpi4py import MPI
    return MPI.COMM_WORLD.Get_rank()


class _ZeroingCore:
    """A core whose rank sends zeros: its data never reaches the others,
    while every record says it did."""

    def __init__(self, core):
        self._core = core

    def __getattr__(self, name):
        return getattr(self._core, name)

    def collective(self, send, recv, spec):
        import numpy as np
        from mpilossy._core import ALLGATHER
        if spec.collective != ALLGATHER:
            zeros = np.zeros_like(send)
            if recv is send or np.shares_memory(send, recv):
                recv[...] = 0
                send = recv
            else:
                send = zeros
        return self._core.collective(send, recv, spec)


class _HidingCore(_ZeroingCore):
    """A core whose records leave VICTIM out while its data is in."""

    def collective(self, send, recv, spec):
        import numpy as np
        result = self._core.collective(send, recv, spec)
        if result.contributors is not None and not result.err_kind:
            bits, entries, nblocks, block_elems, words = result.contributors
            table = np.frombuffer(bytearray(bits), np.uint64).reshape(-1, words).copy()
            table[:, VICTIM // 64] &= ~np.uint64(1 << (VICTIM % 64))
            result = result._replace(contributors=(table.tobytes(), entries, nblocks,
                                                   block_elems, words))
        return result


def _wrap_cores(wrapper, on_rank):
    from mpilossy import state
    opened = state.State.__init__

    def __init__(self, *args, **kwargs):
        opened(self, *args, **kwargs)
        if on_rank(_world_rank()):
            self.core = wrapper(self.core)

    state.State.__init__ = __init__


def _longer_deadlines():
    from mpilossy._core import CallSpec
    from mpilossy.call import spec as spec_module
    resolve = spec_module.CallResolver.resolve

    def resolved(self, *args, **kwargs):
        s = resolve(self, *args, **kwargs)
        if s.timeout <= 0:
            return s
        return CallSpec(collective=s.collective, algorithm=s.algorithm, dtype=s.dtype, op=s.op,
                        timeout=10 * s.timeout, budget=10 * s.budget, weight=s.weight,
                        qbits=s.qbits, qgroup=s.qgroup, residual=s.residual, nbytes=s.nbytes,
                        elements=s.elements, kind=s.kind, fec_k=s.fec_k, fec_m=s.fec_m,
                        part=s.part, tag=s.tag)

    spec_module.CallResolver.resolve = resolved


def _learned_at_the_cap():
    from mpilossy.control import deadline
    deadline.AutoDeadline.timeout = lambda self, key: self.cap


def _factor_doubled():
    from mpilossy.control import deadline
    deadline.FACTOR *= 2


def _silent_errors():
    """A rank whose input is refused raises alone: its peers are not told."""
    from mpilossy import state

    def refuse(core, collective, exc, rank, timeout):
        return exc if isinstance(exc, Exception) else None

    state.refuse = refuse


def _late_agreements():
    from mpilossy.control import deadline
    from mpilossy.control.agreement import Agreement
    start = deadline.AutoDeadline._start

    def started(self):
        start(self)
        if _world_rank() == VICTIM:
            last = self.pending.pop()
            self.pending.append(Agreement(last.request, last.send, last.recv, last.due + 3))

    deadline.AutoDeadline._start = started


def _nodes_as_whole():
    """The hierarchy's stage 2 weighs each node by its number of ranks,
    whoever of them reached its stage 1 (as before the fix)."""
    from mpilossy.hierarchy import allreduce, scatter

    def weighs(h, request, send):
        return send.dtype.kind == "f" and (request.weight is not None or not h.layout.uniform)

    allreduce.weighs_nodes = weighs
    scatter.weighs_nodes = weighs


def _survivor_lost():
    from mpilossy import survivors
    switch = survivors.Elastic._switch

    def switched(self, state, out):
        fresh = switch(self, state, out)
        if _world_rank() == 0:
            fresh.core = _ZeroingCore(fresh.core)
        return fresh

    survivors.Elastic._switch = switched


PLANTS = {
    "dropped-but-recorded": lambda: _wrap_cores(_ZeroingCore, lambda r: r == VICTIM),
    "recorded-lost-but-added": lambda: _wrap_cores(_HidingCore, lambda r: r != VICTIM),
    "deadline-ten-times": _longer_deadlines,
    "learned-at-the-cap": _learned_at_the_cap,
    "learned-factor-doubled": _factor_doubled,
    "error-not-told": _silent_errors,
    "agreements-late": _late_agreements,
    "nodes-counted-whole": _nodes_as_whole,
    "survivor-data-lost": _survivor_lost,
}


class _AfterImport(importlib.abc.MetaPathFinder):
    """Plants the fault once the package `mpilossy` has been imported."""

    def find_spec(self, name, path, target=None):
        if name != "mpilossy":
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        if spec is None or spec.loader is None:
            return spec
        load = spec.loader.exec_module

        def exec_module(module):
            load(module)
            PLANTS[FAULT]()

        spec.loader.exec_module = exec_module
        return spec


if FAULT:
    if FAULT not in PLANTS:
        raise SystemExit(f"PLANTED_FAULT={FAULT!r}: not one of {sorted(PLANTS)}")
    sys.meta_path.insert(0, _AfterImport())
