"""The sharded optimizer's chunks cut again for the survivors of an elastic
exclusion (sharded.py's rebalance): every old chunk of the parameters and
of the optimizer's elementwise state (momenta) reaches every survivor from
its owner if it is still in, else from the lowest survivor (its last
values there; for state, the copy the next rank in the chunk order kept of
it (Copy: ShardedOptimizer's copy_state_every) if that rank is in and the
copy is of these chunks, else zeros), by reliable broadcasts; every other
state entry (a step counter) takes the largest value over the survivors.

The broadcasts are made again from the start over the survivors if a rank
is lost during them: a chunk whose broadcast completed is then the same on
every survivor, so whoever sends it again sends that.  The optimizer's
state is taken out of it once, before (take_state)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch

from .. import Communicator
from ..call.buffers import chunk_bounds
from ..errors import MembershipChanged
from ..reliable import again
from .tensors import as_bytes

__all__ = ["Copy", "chunk_state", "take_state", "share"]

Elementwise = Dict[Tuple[torch.dtype, str], torch.Tensor]     # (dtype, key): whole buffer
Taken = Tuple[Elementwise, Dict[str, Tuple[float, Any]]]
Counters = Dict[str, Callable[[], Any]]                        # key: maker of a fresh copy


@dataclass
class Copy:
    """Another rank's chunk of the optimizer's elementwise state, kept by
    the next rank in the chunk order: whose chunk (`owner`, a member),
    for which cut of the chunks (`cut`: their owners, in chunk order), and
    the state: (dtype of the parameters, key): the chunk's tensor, on the host."""
    owner: int
    cut: Tuple[int, ...]
    state: Elementwise


def chunk_state(optimizer: torch.optim.Optimizer,
                bounds: Dict[torch.dtype, Tuple[int, int]]) -> Elementwise:
    """A host copy of the optimizer's elementwise state of this rank's chunk
    (`bounds`: the chunk of each dtype's flat buffer), one tensor per
    (dtype, key), as long as the chunk."""
    chunks: Elementwise = {}
    for group in optimizer.param_groups:
        for view in group["params"]:
            lo, hi = bounds[view.dtype]
            for key, value in optimizer.state.get(view, {}).items():
                if isinstance(value, torch.Tensor) and value.shape == view.shape:
                    chunk = chunks.get((view.dtype, key))
                    if chunk is None:
                        chunk = chunks[(view.dtype, key)] = torch.zeros(hi - lo, dtype=value.dtype)
                    at = view.storage_offset() - lo
                    chunk[at:at + view.numel()].copy_(value.reshape(-1))
    return chunks


def take_state(optimizer: torch.optim.Optimizer, host: Dict[torch.dtype, torch.Tensor]
               ) -> Taken:
    """The optimizer's state of this rank's old chunk, taken out of it:
    elementwise tensors (as long as their view) in whole buffers shaped as
    `host`'s (one per dtype and key, zeros outside the chunk), every other
    entry (a step counter) as (its value as a float, the value)."""
    elementwise: Elementwise = {}
    largest: Dict[str, Tuple[float, Any]] = {}
    for group in optimizer.param_groups:
        for view in group["params"]:
            for key, value in optimizer.state.pop(view, {}).items():
                if isinstance(value, torch.Tensor) and value.shape == view.shape:
                    full = elementwise.get((view.dtype, key))
                    if full is None:
                        full = elementwise[(view.dtype, key)] = torch.zeros_like(
                            host[view.dtype], dtype=value.dtype)
                    lo = view.storage_offset()
                    full[lo:lo + view.numel()].copy_(value)
                else:
                    number = float(value)
                    if key not in largest or number > largest[key][0]:
                        largest[key] = (number, value)
    return elementwise, largest


def share(comm: Any, lc: Communicator, host: Dict[torch.dtype, torch.Tensor], taken: Taken,
          old: List[int], copy: Optional[Copy] = None) -> Tuple[Elementwise, Counters]:
    """Collective over the survivors (`comm`: the wrapper's reliable
    communicator): the old chunks of the `host` buffers and of the state
    `taken`, filled in place; returns the whole elementwise state and the
    counters.  `old`: the ranks that owned the chunks, in chunk order;
    `copy`: the copy this rank kept of another's chunk, if any."""
    return again(lambda: _share(comm, list(lc.members), host, taken, old, copy),
                 MembershipChanged)


def _share(comm: Any, members: List[int], host: Dict[torch.dtype, torch.Tensor], taken: Taken,
           old: List[int], copy: Optional[Copy]) -> Tuple[Elementwise, Counters]:
    for buf in host.values():
        _from_old_owners(comm, buf, old, members, {})
    mine, largest = taken
    elementwise = dict(mine)        # (the same buffers: filled in place)
    restores = None     # (the gone owner whose chunk of the state this rank sends)
    if copy is not None and copy.cut == tuple(old) and copy.owner not in members:
        restores = copy.owner
        for (dtype, key), chunk in copy.state.items():
            full = elementwise.get((dtype, key))
            if full is None:
                full = elementwise[(dtype, key)] = torch.zeros_like(host[dtype],
                                                                    dtype=chunk.dtype)
            lo, hi = chunk_bounds(full.numel(), len(old), old.index(copy.owner))
            full[lo:hi].copy_(chunk)
    # (the same keys on every survivor, in the same order, before the broadcasts;
    # each counter with its kind: a rank called in holds none yet)
    every = comm.allgather(([(d, k, t.dtype) for (d, k), t in elementwise.items()],
                            {k: (v[0], _kind(v[1])) for k, v in largest.items()}, restores))
    holders = {gone: i for i, (_, _, gone) in enumerate(every) if gone is not None}
    for entries, _, _ in every:
        for dtype, key, value_dtype in entries:
            if (dtype, key) not in elementwise:
                elementwise[(dtype, key)] = torch.zeros_like(host[dtype], dtype=value_dtype)
    for (dtype, key) in sorted(elementwise, key=lambda dk: (str(dk[0]), dk[1])):
        _from_old_owners(comm, elementwise[(dtype, key)], old, members, holders)
    counters: Counters = {}
    for key in sorted({k for _, numbers, _ in every for k in numbers}):
        held = [numbers[key] for _, numbers, _ in every if key in numbers]
        top, kind = max(number for number, _ in held), held[0][1]
        like = largest[key][1] if key in largest else None

        def make(top: float = top, kind: Any = kind, like: Any = like) -> Any:
            if isinstance(kind, torch.dtype):       # (a singleton tensor: Adam's step)
                device = like.device if isinstance(like, torch.Tensor) else "cpu"
                return torch.tensor(top, dtype=kind, device=device)
            return kind(top)

        counters[key] = make
    return elementwise, counters


def _kind(value: Any) -> Any:
    """What a counter is made as: its dtype if a tensor, else its type."""
    return value.dtype if isinstance(value, torch.Tensor) else type(value)


def _from_old_owners(comm: Any, buf: torch.Tensor, old: List[int], members: List[int],
                     holders: Dict[int, int]) -> None:
    """Each old chunk of `buf` from its owner if it is still in, else from
    the survivor that holds a copy of it (`holders`: gone owner: the
    holder's rank among the survivors), else from the lowest survivor."""
    for old_rank, who in enumerate(old):
        lo, hi = chunk_bounds(buf.numel(), len(old), old_rank)
        if hi > lo:
            root = members.index(who) if who in members else holders.get(who, 0)
            comm.Bcast(as_bytes(buf[lo:hi]), root=root)
