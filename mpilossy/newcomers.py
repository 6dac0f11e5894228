"""The newcomer's side of an elastic Communicator's growth (growth.py is
the side of the ranks in): a spare set aside at construction that stands
by until the survivors call it in (SpareSeat, control/spares.py), and a
process started after a loss that knocks at the rendezvous and is
accepted (arrive, control/rendezvous.py).  Either ends with the state
built on the grown communicator, warmed with what the ranks in learned,
and its own Elastic membership."""

from __future__ import annotations

import dataclasses
from typing import List, Optional, Tuple

from mpi4py import MPI

from .call import environment
from .call.config import Config
from .call.environment import Settings
from .control.elastic import check_elastic
from .control.rendezvous import Rendezvous
from .control.spares import Spares
from .growth import opened
from .state import State
from .survivors import Callback, Elastic

__all__ = ["SpareSeat", "arrive"]


class SpareSeat:
    """spares=k, on one rank: set aside at construction (the last k ranks of
    the communicator are spares), then on a spare the wait to be called in
    (control/spares.py's Spares), with the callbacks registered meanwhile."""

    def __init__(self, comm: MPI.Intracomm, config: Config) -> None:
        """Collective over `comm`; `workers` is the working ranks'
        communicator (COMM_NULL on a spare), for the caller to free."""
        size = comm.Get_size()
        if not config.elastic or check_elastic(config.timeout) is not None:
            raise ValueError("spares= needs elastic=True and a deadline: spares replace ranks "
                             "that an elastic communicator excluded")
        if config.spares >= size:
            raise ValueError(f"spares={config.spares} leaves no working rank of {size}")
        self.config = config        # (a spare's, until stand_by() opens its state)
        self.spares = Spares(comm.Dup(), config.spares)
        self.standing = comm.Get_rank() >= size - config.spares   # not called in yet
        self.newcomer = False                                       # called in
        self.arrivals = 0                                           # times called in
        # (on_exclusion's and on_growth's callbacks, until it is called in)
        self.early: Tuple[List[Callback], List[Callback]] = ([], [])
        self.workers = comm.Split(MPI.UNDEFINED if self.standing else 0, comm.Get_rank())

    def stand_by(self, serial: int, timeout: Optional[float]) -> Optional[Tuple[State, Elastic]]:
        """Wait until the survivors call this spare in (Communicator.stand_by):
        its state on the grown communicator, warmed with what the survivors
        learned, and its membership; None if it was not needed."""
        message = self.spares.stand_by(timeout)
        self.standing = False
        if message is None:
            return None
        grown = message["comm"]
        try:
            learned = grown.bcast(None, root=0)     # (the survivors' learned deadline, ...)
        except BaseException:
            grown.Free()
            raise
        state, offers = opened(grown, self.config, serial, learned, offers=True)
        elastic = Elastic(state, self.spares, joining=message, offers=offers)
        elastic.callbacks, elastic.growth_callbacks = self.early
        self.early = ([], [])
        self.newcomer = True
        self.arrivals += 1
        return state, elastic

    def come_back(self, members: List[int]) -> None:
        """On a rank the others excluded (it hung) that woke: stand by as
        a spare again, offered to `members`, the ranks (of the parent) in
        with it when it was excluded."""
        me = self.spares.parent.Get_rank()
        self.spares.offer([m for m in members if m != me])
        self.standing, self.newcomer = True, False


def arrive(own: Config, env: Settings, comm: MPI.Intracomm, bound: float, serial: int
           ) -> Optional[Tuple[State, Elastic]]:
    """Communicator.join on a newcomer's processes (collective over
    `comm`): knock at the rendezvous of `own` (this process's settings,
    built and checked before it knocks: once it is taken in, the ranks in
    wait for it), and once the ranks in accepted it, its state on the
    merged communicator with their settings, warmed with what they
    learned, and its membership; None if the job ended or nobody took it
    in within `bound` seconds."""
    assert own.rendezvous is not None
    rendezvous = Rendezvous(own.rendezvous)
    admitted = rendezvous.knock_and_connect(comm, bound)
    if admitted is None:
        return None
    grown, info = admitted
    try:
        config = dataclasses.replace(own, **info["settings"])
        environment.configure_logging(env, grown.Get_rank())
    except BaseException:
        grown.Free()
        raise
    state, offers = opened(grown, config, serial, info["learned"], offers=True)
    return state, Elastic(state, None, joining=info, offers=offers, rendezvous=rendezvous)
