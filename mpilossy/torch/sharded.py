"""Bounded-drift parameter exchange (the sharded mode).

The parameters live in one flat buffer per dtype, and the model's parameter
tensors become views of it.  Each rank owns one chunk of every buffer
(Communicator.chunk_bounds).  A step is:

1. lossy reduce-scatter of the flat gradient: each rank receives the
   (unbiased) average gradient of its own chunk;
2. the wrapped optimizer updates that chunk only (its param_groups hold
   views of the chunk, so its state covers this rank's chunk only);
3. lossy all-gather of the flat parameters, in place: every rank receives
   every owner's updated chunk.  A segment that does not arrive in time
   keeps its previous values on that rank.

The owner of a chunk is the only rank that updates it, and it sends the
whole chunk every step: a rank that missed a segment is one step behind on
it, and catches up as soon as a later all-gather gets through.  The drift
therefore stays bounded without broadcasts.
"""

from __future__ import annotations

import hashlib
import weakref
from typing import Any, Callable, Dict, List, Mapping, Optional, Tuple

import torch
from mpi4py import MPI

from .. import Communicator
from ..errors import MembershipChanged
from ..reliable import BoundedComm, again
from . import recut
from .broadcast import bcast_tensors
from .checks import check_everywhere, check_tensors
from .communicators import lossy_communicator, reliable_comm
from .compression import Compression, compression_problem
from .compute import ComputeDeadline, deadline_problem, fill_in, weigh
from .drift import DriftController, every_problem
from .feedback import ErrorFeedback, feedback_problem
from .optimizer import (Engine, WrappedOptimizer, already_wrapped, check_settings,
                        follow_exclusions, params_changed, welcomed, wrap)
from .tensors import Flat, REDUCIBLE, as_bytes, as_numpy, optimizer_parameters
from .trend import Trend

__all__ = ["ShardedOptimizer"]

MISSED = ("keep", "extrapolate")
SHARD_KEY = "mpilossy_shard"     # a sharded state_dict's record of its rank and chunk
DEFAULT_COPY_EVERY = 10         # steps between copies of the state (elastic communicators)


class _ShardedExchange(Engine):
    """The engine behind ShardedOptimizer."""

    def __init__(self, lc: Communicator, params: List[torch.Tensor],
                 groups: List[int], n_groups: int, op: str, root_rank: int,
                 error_feedback: bool, missed: str,
                 compute_deadline: Optional[ComputeDeadline] = None,
                 compression: Optional[Compression] = None, joining: bool = False,
                 copy_every: int = 0) -> None:
        super().__init__(lc, params, op, None)
        self.compute_deadline = compute_deadline
        self.compression = compression
        device = params[0].device if params else torch.device("cpu")
        self.flat = Flat(params, device=device)     # the parameters themselves, from now on
        self.flat.pack(params)
        if not joining:     # (a spare called in: share() brings every chunk from its owner)
            bcast_tensors(self.reliable, list(self.flat.buffers.values()), root_rank)
        with torch.no_grad():
            for i, p in enumerate(params):
                p.data = self.flat.view(i, p)
        # What the collectives move: the parameters themselves on the host,
        # else a pinned host mirror of them, copied around each exchange.
        self.mirrored = needs_mirror(device)
        self.host = Flat(params) if self.mirrored else self.flat
        self.grads = Flat(params)           # gradients, packed for the reduce-scatter
        self.device = device
        self.groups, self.n_groups = groups, n_groups
        self._cut()
        # elastic communicators: the members the chunks were cut for, and
        # whether an exclusion calls for cutting them again
        self.members = lc.members
        self.rebalance_due = False
        # the copy of the previous rank's chunk of the optimizer's state, kept
        # against its loss (copy_state_every); the steps since this rank's was
        # sent, and the cut it was sent for
        self.copy_every = copy_every
        self.copy: Optional[recut.Copy] = None
        self.since_copy = 0
        self.copied_for: Optional[Tuple[int, ...]] = None
        self.optimizer: Optional[Callable[[], Optional[torch.optim.Optimizer]]] = None
        if error_feedback:
            self.feedback = ErrorFeedback(lc, self.grads)
        self._download()
        # (on the parameters' device: on a GPU its passes cost next to nothing)
        self.trends = ({d: Trend(b) for d, b in self.flat.buffers.items() if d in REDUCIBLE}
                       if missed == "extrapolate" else None)

    def _cut(self) -> None:
        """This rank's chunk of every buffer (for the communicator's size),
        its gradient buffers, and each param group's views of it."""
        lc = self.lc
        self.bounds = {d: lc.chunk_bounds(b.numel()) for d, b in self.flat.buffers.items()}
        pinned = self.mirrored and self.device.type == "cuda"
        self.shard_grads = {d: torch.zeros(hi - lo, dtype=d, pin_memory=pinned)
                            for d, (lo, hi) in self.bounds.items()}
        # the chunk's gradients where the optimizer reads them
        self.device_grads = ({d: torch.zeros_like(g, device=self.device)
                              for d, g in self.shard_grads.items()}
                             if self.mirrored else self.shard_grads)
        self.shards = self._shards(self.groups, self.n_groups)

    def rebind(self, resync: bool = True) -> None:
        """After an elastic exclusion: the chunks are cut again for the
        survivors at the end of this step (rebalance), and until then the
        step's remaining lossy calls are skipped, but for those the
        communicator answers alone (Communicator.behind: calls the other
        survivors made before the exclusion, on the old chunks).  After
        growth, share() cuts them again at once."""
        super().rebind(resync)
        self.rebalance_due = True

    def share(self, optimizer: torch.optim.Optimizer) -> None:
        """Collective over the ranks in and the spares just called in (the
        end of Engine.grow, and a newcomer's construction): rank 0's step
        counts and the owners the chunks were cut for, then the chunks cut
        again over everyone (rebalance: each old chunk of the parameters
        and of the optimizer's state from its owner).  A rank lost during
        it: made again from the start over the survivors."""
        def once() -> None:
            self.share_counts()
            self.members = tuple(self.reliable.bcast(list(self.members), root=0))
            self.rebalance()
        again(once, MembershipChanged)

    def rebalance(self) -> None:
        """Cut the chunks for the ranks in (after an exclusion or growth):
        the old chunks and the optimizer's state reach every rank
        (recut.py: a chunk from its owner if it is in, exact, a gone rank's
        from the lowest survivor's copy, and its state from the copy the
        next rank kept (copy_state), else zeros); then the
        optimizer holds views of the new chunk."""
        optimizer = self.optimizer() if self.optimizer is not None else None
        assert optimizer is not None        # (set by ShardedOptimizer; it is alive: stepping)
        self._download()
        taken = recut.take_state(optimizer, self.host.buffers)
        elementwise, counters = recut.share(self.reliable, self.lc, self.host.buffers, taken,
                                            list(self.members), self.copy)
        self._upload()
        self._cut()
        for group, views in zip(optimizer.param_groups, self.shards):
            group["params"] = [view for view, _ in views]
            for view, _ in views:
                lo, n = view.storage_offset(), view.numel()
                state = {key: full[lo:lo + n].to(self.device, copy=True)
                         for (dtype, key), full in elementwise.items() if dtype == view.dtype}
                state.update({key: make() for key, make in counters.items()})
                if state:
                    optimizer.state[view] = state
        self.ids = [id(p) for g in optimizer.param_groups for p in g["params"]]
        if self.trends is not None:
            for dtype, trend in self.trends.items():
                trend.exact(self.flat.buffers[dtype])
        self.members = tuple(self.lc.members)
        self.rebalance_due = False

    def copy_state(self) -> None:
        """Elastic, every copy_every steps and at the first step after the
        chunks were cut again: this rank's chunk of the optimizer's
        elementwise state to the next rank in the chunk order, which keeps
        it until the next one (recut.Copy), so that a lost owner's state
        is restored from it (rebalance) instead of restarting from zeros.
        Reliable and bounded; a rank lost during it: not made again (the
        chunks are cut again at the end of this step, from the copies kept
        before)."""
        if not self.copy_every:
            return
        self.since_copy += 1
        cut = tuple(self.members)
        if self.since_copy < self.copy_every and self.copied_for == cut:
            return
        optimizer = self.optimizer() if self.optimizer is not None else None
        assert optimizer is not None
        mine = recut.Copy(cut[self.lc.rank], cut, recut.chunk_state(optimizer, self.bounds))
        reliable = self.reliable
        assert isinstance(reliable, BoundedComm)        # (elastic: copy_problem)
        try:
            self.copy = reliable.shift(mine)
        except MembershipChanged:
            return
        self.since_copy, self.copied_for = 0, cut

    def _download(self, chunk_only: bool = False) -> None:
        """The parameters (this rank's chunk only) into the host mirror."""
        if self.mirrored:
            with torch.no_grad():
                for dtype, buf in self.flat.buffers.items():
                    lo, hi = self.bounds[dtype] if chunk_only else (0, buf.numel())
                    self.host.buffers[dtype][lo:hi].copy_(buf[lo:hi])

    def _upload(self) -> None:
        """The host mirror into the parameters.  Blocking: the mirror may be
        written again as soon as this returns."""
        if self.mirrored:
            with torch.no_grad():
                for dtype, buf in self.flat.buffers.items():
                    buf.copy_(self.host.buffers[dtype])

    def _shards(self, groups: List[int],
                n_groups: int) -> List[List[Tuple[torch.Tensor, torch.Tensor]]]:
        """Per param group: (view of this rank's chunk, its gradient view) for
        every dtype in which the group's parameters meet this rank's chunk.
        Parameters are laid out by dtype, then in group order, so a group's
        parameters of one dtype are one contiguous range."""
        ranges: Dict[Tuple[int, torch.dtype], List[int]] = {}
        for (dtype, offset, n), group in zip(self.flat.slots, groups):
            r = ranges.setdefault((group, dtype), [offset, offset])
            r[1] = offset + n
        shards: List[List[Tuple[torch.Tensor, torch.Tensor]]] = [[] for _ in range(n_groups)]
        for (group, dtype), (first, end) in ranges.items():
            lo, hi = self.bounds[dtype]
            a, b = max(first, lo), min(end, hi)
            if a < b:
                shards[group].append((self.flat.buffers[dtype][a:b],
                                      self.device_grads[dtype][a - lo:b - lo]))
        return shards

    def reduce_scatter(self) -> None:
        grads = [p.grad for p in self.params]
        if any(g is not None and g.layout != torch.strided for g in grads):
            raise TypeError("sparse gradients are not supported")
        self.grads.pack(grads)
        feedback = self.feedback
        if feedback is not None:
            feedback.add_to(self.grads)
        weight = weigh(self.compute_deadline, self.grads.arrays.values())
        calls = []
        for dtype, send in self.grads.arrays.items():
            if self.rebalance_due and not self.lc.behind:   # (an exclusion: the rest
                break                                        # waits for new chunks)
            recv = self.shard_grads[dtype]
            if self.compression is not None:
                stats = self.compression.reduce_scatter(self.lc, dtype, send, as_numpy(recv),
                                                        op=self.op, weight=weight)
            else:
                stats = self.lc.reduce_scatter(send, recv, op=self.op,
                                               algorithm="direct" if feedback else "auto",
                                               weight=weight)
            self.recorder.add(stats)
            calls.append((dtype, 0, stats))
            if self.mirrored:
                self.device_grads[dtype].copy_(recv)
        if feedback is not None:
            feedback.record(calls)
        for views in self.shards:
            for view, grad in views:
                view.grad = grad            # (zero_grad of the optimizer may have cleared it)

    def allgather(self) -> None:
        self._download(chunk_only=True)
        calls = []
        for dtype, full in self.host.arrays.items():
            if self.rebalance_due and not self.lc.behind:
                break
            lo, hi = self.bounds[dtype]
            stats = self.lc.allgather(full[lo:hi], full)
            self.recorder.add(stats)
            calls.append((dtype, stats))
        # A block missed here keeps the mirror's previous values; the
        # extrapolation below replaces them from the trend alone.
        self._upload()
        if self.trends is not None:
            for dtype, stats in calls:
                self.trends[dtype].update(self.flat.buffers[dtype], stats)

    def resynchronize(self, root_rank: Optional[int] = None) -> None:
        """Reliable: every owner's chunk to every rank (root_rank None: drift
        exactly 0), or `root_rank`'s whole parameters to every rank."""
        self._download()
        if root_rank is not None:
            bcast_tensors(self.reliable, list(self.host.buffers.values()), root_rank)
        for dtype, buf in self.host.buffers.items():
            if root_rank is None:
                data = as_bytes(buf)
                itemsize = buf.element_size()
                bounds = [self.lc.chunk_bounds(buf.numel(), r) for r in range(self.reliable.size)]
                counts = [(hi - lo) * itemsize for lo, hi in bounds]
                displs = [lo * itemsize for lo, _ in bounds]
                self.reliable.Allgatherv(MPI.IN_PLACE, [data, (counts, displs), MPI.BYTE])
        self._upload()
        if self.trends is not None:
            for dtype, trend in self.trends.items():
                trend.exact(self.flat.buffers[dtype])

    def shard_record(self) -> Dict[str, Any]:
        """What a state_dict of this rank's chunk is: rank, size, the chunk
        of each dtype's flat buffer, and a digest of the parameters' layout."""
        layout = [(tuple(p.shape), str(p.dtype)) for p in self.params]
        return {"rank": self.reliable.rank, "size": self.reliable.size,
                "chunks": [(str(d), self.flat.buffers[d].numel(), lo, hi)
                           for d, (lo, hi) in self.bounds.items()],
                "parameters": hashlib.sha256(repr(layout).encode()).hexdigest()}

    def shard_problem(self, state_dict: Any) -> Optional[Exception]:
        """Why `state_dict` is not a state of this rank's chunk (None if it is)."""
        if not isinstance(state_dict, Mapping) or not isinstance(state_dict.get(SHARD_KEY), dict):
            return ValueError(
                "this state_dict does not say which rank's chunk it holds (a ShardedOptimizer's "
                f"state_dict() has {SHARD_KEY!r}): a sharded optimizer's state covers one "
                "rank's chunk, and loading another's would update the wrong parameters")
        saved, mine = state_dict[SHARD_KEY], self.shard_record()
        if saved.get("size") != mine["size"]:
            return ValueError(f"this state_dict was saved by a run of size {saved.get('size')} "
                              f"(ranks), this run has size {mine['size']}: the chunks differ")
        if saved.get("rank") != mine["rank"]:
            return ValueError(f"this state_dict holds rank {saved.get('rank')}'s chunk, not "
                              f"rank {mine['rank']}'s: each rank loads the state it saved")
        if saved.get("parameters") != mine["parameters"] or saved.get("chunks") != mine["chunks"]:
            return ValueError(f"this state_dict holds rank {mine['rank']}'s chunk of other "
                              f"parameters (chunks {saved.get('chunks')}, here "
                              f"{mine['chunks']})")
        return None


def copy_problem(lc: Communicator, every: Any) -> Optional[Exception]:
    """Why copy_state_every cannot be `every` on `lc` (None if it can)."""
    if every is None:
        return None
    if isinstance(every, bool) or not isinstance(every, int) or every < 0:
        return ValueError(f"copy_state_every must be None or an int >= 0, got {every!r}")
    if every and not lc.elastic:
        return ValueError("copy_state_every keeps copies of the optimizer's state against a "
                          "lost rank: it needs Communicator(elastic=True)")
    return None


def needs_mirror(device: torch.device) -> bool:
    """Whether parameters on `device` travel through a host mirror (all but
    host memory; tests set it for CPU parameters to run the mirror's code)."""
    return device.type != "cpu"


class _ShardedOptimizer(WrappedOptimizer):

    _mpilossy: _ShardedExchange

    per_rank_state = True       # (broadcast_optimizer_state refuses it)

    def step(self, closure: Optional[Callable[[], Any]] = None, **kwargs: Any) -> Any:
        """Reduce-scatter the gradients, update this rank's chunk, all-gather
        the parameters.  A closure is evaluated once, before the exchange."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        engine = self._mpilossy
        params_changed(engine, self)
        if engine.rebalance_due and not engine.lc.behind:
            # (an exclusion between steps, in a reliable call such as the
            # user's barrier: the chunks are cut for the survivors first, and
            # this step's gradients are reduced over them; else the skipped
            # reduce-scatter would leave the last step's gradients in place)
            engine.rebalance()
        engine.reduce_scatter()
        super().step(**kwargs)
        if not engine.rebalance_due or engine.lc.behind:
            engine.allgather()      # (calls that other survivors made before the exclusion)
        if not engine.rebalance_due:
            engine.copy_state()
        if engine.rebalance_due:            # (an elastic exclusion during this step)
            engine.rebalance()
        engine.finish()
        engine.grow(self)                   # (spares=k: cut again if spares joined)
        if engine.rebalance_due:            # (grow() excluded a rank and none joined)
            engine.rebalance()
        return loss

    def resynchronize(self, root_rank: Optional[int] = None) -> None:
        """Collective, reliable, and it restarts the extrapolation of missed
        blocks from the new values.

        - ``resynchronize()``: every owner's chunk to every rank (drift
          exactly 0).  The owners' values win: after changing the
          parameters on *every* rank alike (a checkpoint loaded everywhere).
        - ``resynchronize(root_rank=r)``: rank r's whole parameters to every
          rank: after changing them on rank r alone (a checkpoint loaded
          there), where resynchronize() would mix r's chunk of the new
          values with the other owners' old ones.

        The optimizer state is not touched: it is per rank (state_dict())."""
        engine = self._mpilossy
        problem = None
        if root_rank is not None and (isinstance(root_rank, bool) or
                                      not isinstance(root_rank, int) or
                                      not 0 <= root_rank < engine.reliable.size):
            problem = ValueError(f"root_rank must be None or a rank of the communicator "
                                 f"(0..{engine.reliable.size - 1}), got {root_rank!r}")
        check_everywhere(engine.reliable, problem, [root_rank], "resynchronize arguments")
        engine.resynchronize(root_rank)

    def state_dict(self) -> Dict[str, Any]:
        """The wrapped optimizer's state of this rank's chunk, with a record
        of the rank, the run's size and the chunks (SHARD_KEY), so that
        load_state_dict() can refuse another rank's state."""
        state = super().state_dict()
        state[SHARD_KEY] = self._mpilossy.shard_record()
        return state

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        """Collective: load a state that this rank saved (state_dict()) in a
        run of the same size.  Another rank's state, one from a run of
        another size or of other parameters, or one without the record,
        raises the same ValueError on every rank, and nothing is loaded."""
        engine = self._mpilossy
        check_everywhere(engine.reliable, engine.shard_problem(state_dict), (),
                         "sharded optimizer states")
        super().load_state_dict({k: v for k, v in state_dict.items() if k != SHARD_KEY})

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear the model's gradients (the optimizer itself holds views of
        this rank's chunk, whose gradients are set at every step)."""
        for p in self._mpilossy.params:
            if p.grad is not None:
                if set_to_none:
                    p.grad = None
                else:
                    if p.grad.grad_fn is not None:
                        p.grad.detach_()
                    else:
                        p.grad.requires_grad_(False)
                    p.grad.zero_()


def ShardedOptimizer(optimizer: torch.optim.Optimizer, named_parameters: Any = None,
                     communicator: Optional[Communicator] = None, *, op: str = "avg",
                     resync_every: Optional[int] = None, measure_every: Optional[int] = None,
                     root_rank: int = 0, error_feedback: bool = False,
                     missed: str = "keep",
                     compute_deadline: Optional[ComputeDeadline] = None,
                     compression: Optional[Compression] = None,
                     copy_state_every: Optional[int] = None) -> _ShardedOptimizer:
    """Wrap a freshly built `optimizer` for the sharded, bounded-drift mode
    (see the module documentation).

    At construction the model's parameters are moved into flat buffers (the
    parameter tensors stay the same objects; their ``.data`` becomes a view)
    and set to `root_rank`'s values, and the optimizer's param_groups are
    rewritten to hold views of this rank's chunk, keeping their options.
    The parameters must all be on one device; on a GPU the buffers stay
    there (the optimizer updates the chunk on the GPU) and the collectives
    move a pinned host mirror of them (docs/gpu.md).
    The optimizer must be elementwise (SGD, Adam, AdamW, RMSprop, Adagrad...):
    one that looks at a whole tensor (LARS, LAMB, Adafactor) would see chunks.

    resync_every, measure_every:
        every K steps a reliable all-gather of every owner's chunk (drift 0);
        every M steps the drift meter (``stats.drift``).  Neither is needed
        for the drift to stay bounded.
    error_feedback:
        re-send next step what this step's gradients lost, as for
        DistributedOptimizer (Communicator with scaling="zero-fill"; the
        owner's contributor record says what was lost).
    missed:
        what a rank does with a block of parameters that the all-gather did
        not bring: "keep" its previous values (the reference scheme), or
        "extrapolate" them by the owner's recent update per step (see
        docs/training.md).  Either way the next block that arrives is exact.
    compute_deadline:
        a ComputeDeadline (DropCompute), as for DistributedOptimizer: the
        gradients are reduce-scattered as a weighted average.
    compression:
        LowBit or TopK, as for DistributedOptimizer (TopK all-reduces the
        chosen blocks; each rank keeps its chunk of the result).

    copy_state_every:
        an elastic Communicator only: every K steps (and at the first
        step after the chunks were cut again) each rank sends its chunk of
        the optimizer's elementwise state (AdamW's moments, SGD's
        momentum) to the next rank, which keeps it; when a rank is lost,
        its chunk's state comes back from that copy (at most K steps old)
        instead of restarting from zeros (docs/elastic.md, "A soak").
        Default: 10 on an elastic Communicator, 0 (no copies) otherwise.
        Costs one more chunk of state in memory and one reliable message
        of it every K steps.

    state_dict() holds this rank's chunk of the optimizer state, with a
    record of the rank and chunk; load_state_dict() (collective) refuses,
    on every rank, a state saved by another rank or by a run of another
    size.  A model checkpoint loaded on one rank reaches the others by
    resynchronize(root_rank=that rank) (docs/training.md, "Checkpoints").
    Collective, with the same checks as DistributedOptimizer.

    On a Communicator with spares (elastic=True, spares=k), step() ends
    with Communicator.grow(): where spares joined (``stats.joined``) the
    chunks are cut again over everyone, each old chunk of the parameters
    and of the optimizer's elementwise state sent by its owner (a chunk of
    a rank lost before: the lowest survivor's parameters, and the state
    from the copy kept by the next rank, or zeros without one).  A
    spare wraps its optimizer after stand_by() returned True and receives
    its chunk and the step count there.  Not yet with error_feedback,
    compute_deadline or compression (refused).
    """
    lc = lossy_communicator(communicator)
    comm = reliable_comm(lc)
    problem = (already_wrapped(optimizer) or check_settings(op)
               or every_problem(resync_every=resync_every, measure_every=measure_every)
               or feedback_problem(lc, error_feedback)
               or deadline_problem(lc, op, compute_deadline, error_feedback)
               or compression_problem(compression, error_feedback, lc))
    if problem is None and lc.grows and (error_feedback or compute_deadline is not None
                                         or compression):
        problem = ValueError("with spares or a rendezvous (Communicator(spares=k), "
                             "rendezvous=DIR), error_feedback, "
                             "compute_deadline and compression do not take newcomers in yet "
                             "(docs/elastic.md, 'Growing back')")
    if problem is None and missed not in MISSED:
        problem = ValueError(f"missed must be one of {MISSED}, got {missed!r}")
    problem = problem or copy_problem(lc, copy_state_every)
    copy_every = (copy_state_every if copy_state_every is not None
                  else DEFAULT_COPY_EVERY if lc.elastic else 0)
    try:
        named = optimizer_parameters(optimizer, named_parameters)
    except (TypeError, ValueError) as exc:
        problem, named = problem or exc, []
    if problem is None and len(optimizer.state):
        problem = ValueError("ShardedOptimizer needs a fresh optimizer (its state would not "
                             "match the chunks): wrap it before the first step")
    if not (isinstance(root_rank, int) and 0 <= root_rank < comm.size):
        problem = problem or ValueError(f"root_rank must be a rank, got {root_rank!r}")
    devices = sorted({str(p.device) for _, p in named})
    if problem is None and len(devices) > 1:
        problem = ValueError(f"ShardedOptimizer keeps the parameters in one buffer per dtype, "
                             f"on one device; these are on {', '.join(devices)}")
    extra = ("sharded", op, resync_every, measure_every, root_rank, error_feedback,
             missed, compute_deadline is not None, repr(compression), copy_state_every)
    check_tensors(comm, named, reducible=True, problem=problem, copied=True, extra=extra)
    if compute_deadline is not None:
        fill_in(compute_deadline, comm, [p for _, p in named])
    params = [p for _, p in named]
    groups = [g for g, group in enumerate(optimizer.param_groups) for _ in group["params"]]
    # a spare called in: the survivors' grow() made the same checks; share() below
    joining = lc.newcomer and welcomed.get(lc, 0) < lc.arrivals
    engine = _ShardedExchange(lc, params, groups, len(optimizer.param_groups), op,
                              root_rank, error_feedback, missed, compute_deadline, compression,
                              joining, copy_every)
    engine.agreed = (named, extra)
    if resync_every is not None or measure_every is not None:
        engine.drift = DriftController(named, comm=comm, broadcast_every=resync_every,
                                       measure_every=measure_every,
                                       synchronize=engine.resynchronize)
    for group, views in zip(optimizer.param_groups, engine.shards):
        group["params"] = [view for view, _ in views]
    engine.ids = [id(p) for g in optimizer.param_groups for p in g["params"]]   # the chunks
    wrapped = wrap(optimizer, _ShardedOptimizer, engine)
    engine.optimizer = weakref.ref(wrapped)
    follow_exclusions(engine)
    if joining:
        welcomed[lc] = lc.arrivals
        engine.share(wrapped)
    return wrapped
