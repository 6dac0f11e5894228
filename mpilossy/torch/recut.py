"""The sharded optimizer's chunks cut again for the survivors of an elastic
exclusion (sharded.py's rebalance): every old chunk of the parameters and
of the optimizer's elementwise state (momenta) reaches every survivor from
its owner if it is still in, else from the lowest survivor (its last
values there; zeros for state), by reliable broadcasts; every other state
entry (a step counter) takes the largest value over the survivors.

The broadcasts are made again from the start over the survivors if a rank
is lost during them: a chunk whose broadcast completed is then the same on
every survivor, so whoever sends it again sends that.  The optimizer's
state is taken out of it once, before (take_state)."""

from __future__ import annotations

from typing import Any, Callable, Dict, List, Tuple

import torch

from .. import Communicator
from ..call.buffers import chunk_bounds
from ..errors import MembershipChanged
from ..reliable import again
from .tensors import as_bytes

__all__ = ["take_state", "share"]

Elementwise = Dict[Tuple[torch.dtype, str], torch.Tensor]     # (dtype, key): whole buffer
Taken = Tuple[Elementwise, Dict[str, Tuple[float, Any]]]
Counters = Dict[str, Callable[[], Any]]                        # key: maker of a fresh copy


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
          old: List[int]) -> Tuple[Elementwise, Counters]:
    """Collective over the survivors (`comm`: the wrapper's reliable
    communicator): the old chunks of the `host` buffers and of the state
    `taken`, filled in place; returns the whole elementwise state and the
    counters.  `old`: the ranks that owned the chunks, in chunk order."""
    return again(lambda: _share(comm, list(lc.members), host, taken, old), MembershipChanged)


def _share(comm: Any, members: List[int], host: Dict[torch.dtype, torch.Tensor], taken: Taken,
           old: List[int]) -> Tuple[Elementwise, Counters]:
    for buf in host.values():
        _from_old_owners(comm, buf, old, members)
    mine, largest = taken
    elementwise = dict(mine)        # (the same buffers: filled in place)
    # (the same keys on every survivor, in the same order, before the broadcasts;
    # each counter with its kind: a rank called in holds none yet)
    every = comm.allgather(([(d, k, t.dtype) for (d, k), t in elementwise.items()],
                            {k: (v[0], _kind(v[1])) for k, v in largest.items()}))
    for entries, _ in every:
        for dtype, key, value_dtype in entries:
            if (dtype, key) not in elementwise:
                elementwise[(dtype, key)] = torch.zeros_like(host[dtype], dtype=value_dtype)
    for (dtype, key) in sorted(elementwise, key=lambda dk: (str(dk[0]), dk[1])):
        _from_old_owners(comm, elementwise[(dtype, key)], old, members)
    counters: Counters = {}
    for key in sorted({k for _, numbers in every for k in numbers}):
        held = [numbers[key] for _, numbers in every if key in numbers]
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


def _from_old_owners(comm: Any, buf: torch.Tensor, old: List[int], members: List[int]) -> None:
    """Each old chunk of `buf` from its owner if it is still in, else from
    the lowest survivor."""
    for old_rank, who in enumerate(old):
        lo, hi = chunk_bounds(buf.numel(), len(old), old_rank)
        if hi > lo:
            comm.Bcast(as_bytes(buf[lo:hi]), root=members.index(who) if who in members else 0)
