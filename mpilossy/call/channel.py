"""The compiled core of a communicator, opened on its channel: "auto"
resolved, the channel built, and any rank's failure agreed by every rank."""

from __future__ import annotations

from typing import Optional, Tuple

from mpi4py import MPI

from .._core import HAVE_DATAGRAM_AUTH, HAVE_LIBFABRIC, Core, datagram_providers
from ..errors import MPILossyError
from ..loss import to_spec as loss_spec
from .config import Config

__all__ = ["open_core", "HARDWARE_DATAGRAMS", "PACE_SHARE", "PACE_BURST"]

# Datagram providers that mean real datagram hardware (where "auto" picks ud).
HARDWARE_DATAGRAMS = ("verbs", "efa")
# Pacing (MPILOSSY_UD_RATE, docs/ud.md): the ranks of a node send at this
# share of their port's rate together (room for MPI's own traffic and the
# headers the port counts and the pacer cannot see), each in bursts of at
# most PACE_BURST bytes: a few frames, so that the bursts of every sender of
# an all-to-all fit a shallow switch queue together.
PACE_SHARE = 0.95
PACE_BURST = 16384
# Datagrams to a rank on the same node never cross the port: pacing charges
# them nothing.  (The pacer's own tests, on one machine, turn it off.)
PACE_LOCAL_FREE = True


def open_core(comm: MPI.Intracomm, config: Config) -> Tuple[Core, str]:
    """Collective: the core on `comm` and the channel it runs ("rma" or
    "ud").  Raises on every rank if any rank failed: its own error there,
    an MPILossyError naming the ranks and reasons elsewhere."""
    channel = config.channel
    if channel == "auto":
        channel = auto_channel(comm, config.ud_provider)
    core: Optional[Core] = None
    error: Optional[BaseException] = None
    try:
        core = Core(comm, config, channel)
        core.configure_loss(loss_spec(config.loss))
        if channel == "ud" and not config.ud_offload:
            core.set_offload(False)
    except BaseException as exc:
        error = exc
    if channel == "ud":                  # (every rank: the node split is collective)
        pace(comm, core, config.ud_rate)
    # The channels agree on their own failures; this catches the rest, so
    # that no rank returns a communicator whose peers raised.
    outcomes = comm.allgather(None if error is None else f"{type(error).__name__}: {error}")
    broken = [(r, why) for r, why in enumerate(outcomes) if why is not None]
    if broken:
        if core is not None:
            core.close()
        if error is not None:
            raise error
        raise MPILossyError("Communicator construction failed on " + "; ".join(
            f"rank {r}: {why}" for r, why in broken))
    assert core is not None
    return core, channel


def pace(comm: MPI.Intracomm, core: Optional[Core], node_rate: float,
         senders: Optional[int] = None) -> None:
    """Collective: pace every rank's datagrams at its share of its node's
    port rate (`node_rate`, bits per second): shared by `senders` ranks of
    the node (default: the ranks of `comm` on it).  Datagrams to the ranks
    of `comm` on the same node never cross the port and cost nothing."""
    node = comm.Split_type(MPI.COMM_TYPE_SHARED, key=comm.Get_rank())
    groups = (node.Get_group(), comm.Get_group())
    try:
        mine = groups[0].Translate_ranks(list(range(node.Get_size())), groups[1])
    finally:
        for group in groups:
            group.Free()
        node.Free()
    if senders is None:
        senders = len(mine)
    if core is not None and node_rate > 0:
        local = bytearray(comm.Get_size())
        for r in mine if PACE_LOCAL_FREE else ():
            local[r] = 1
        core.set_send_rate(PACE_SHARE * node_rate / 8 / senders, PACE_BURST, bytes(local))


def auto_channel(comm: MPI.Intracomm, provider: str) -> str:
    """ud where the fabric does datagrams in hardware, or where a datagram
    provider is asked for (MPILOSSY_UD_PROVIDER, FI_PROVIDER); rma
    otherwise.  Agreed by every rank."""
    choice = "rma"
    if HAVE_DATAGRAM_AUTH and provider == "native":
        choice = "ud"
    elif HAVE_LIBFABRIC:
        try:
            providers = datagram_providers()
        except MPILossyError:
            providers = []
        names = {p.split("/")[0] for p in providers}
        if (provider and provider in names) or names & set(HARDWARE_DATAGRAMS):
            choice = "ud"
    return "ud" if all(c == "ud" for c in comm.allgather(choice)) else "rma"
