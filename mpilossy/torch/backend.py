"""mpilossy as a torch.distributed backend.

``import mpilossy.torch`` registers the backend "mpilossy";
``init_process_group("mpilossy")`` (ours under mpiexec, or torch's own when
the ranks are MPI's) then gives a process group whose gradient collectives
(all_reduce, reduce_scatter_tensor and their coalesced forms) run lossy
through an mpilossy.Communicator and whose every other operation runs
exactly through a Gloo process group on the same store.  DDP without a
hook and FSDP2's ``fully_shard`` use it as they use Gloo (docs/backend.md).

Work objects: a lossy call is synchronous (it ends by its deadline) and
returns completed work; exact calls return Gloo's own work.
"""

# torch's stubs of the pybind ProcessGroup spell each method's overloads and
# argument names; an override that forwards them all as torch calls them
# cannot match those spellings, hence:
# mypy: disable-error-code="override,assignment"
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, FrozenSet, Iterable, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
from mpi4py import MPI
from torch._C._distributed_c10d import AllgatherOptions

from .. import CollectiveStats, Communicator
from .stats import Recorder, StepStats
from .tensors import REDUCIBLE

__all__ = ["BACKEND", "BackendOptions", "LossyProcessGroup", "lossy_group"]

BACKEND = "mpilossy"
LOSSY_OPS = ("all_reduce", "reduce_scatter", "all_gather")


@dataclass
class BackendOptions:
    """What the "mpilossy" backend runs lossy and on which Communicator
    (``init_process_group("mpilossy", pg_options=BackendOptions(...))``).

    communicator:
        the mpilossy.Communicator of the lossy calls (deadline, learned
        deadline, redundancy, compression, elastic).  Default: the module's
        default communicator (settings from MPILOSSY_* variables) for the
        world group, a Communicator on the matching MPI group for others.
    lossy:
        which collectives run lossy: any of "all_reduce", "reduce_scatter"
        (gradients: the default) and "all_gather" (FSDP's parameters: a
        lost shard leaves the output's previous contents, which FSDP2
        allocates fresh; leave it exact unless you know the buffer).
    exact_below:
        tensors of fewer elements go exactly (loss values, gradient norms,
        counters that training loops all-reduce).
    line_up:
        a barrier before each lossy call.  For benchmarks on machines whose
        ranks time-share cores: they enter a call up to ~100 ms apart,
        which a deadline counts as loss; lined up, the loss measured is the
        network's.  Costs a round trip per call; off by default.
    """
    communicator: Optional[Communicator] = None
    lossy: Iterable[str] = ("all_reduce", "reduce_scatter")
    exact_below: int = 1024
    line_up: bool = False
    _lossy: FrozenSet[str] = field(init=False, repr=False, default=frozenset())

    def __post_init__(self) -> None:
        if self.communicator is not None and not isinstance(self.communicator, Communicator):
            raise TypeError(f"communicator must be an mpilossy.Communicator, not "
                            f"{type(self.communicator).__name__}")
        if isinstance(self.lossy, str):
            raise TypeError('lossy takes a collection of names, e.g. ("all_reduce",)')
        lossy = frozenset(self.lossy)
        unknown = sorted(lossy - set(LOSSY_OPS))
        if unknown:
            raise ValueError(f"lossy: unknown collective(s) {unknown}; choose from {LOSSY_OPS}")
        if isinstance(self.exact_below, bool) or not isinstance(self.exact_below, int) \
                or self.exact_below < 0:
            raise ValueError(f"exact_below must be an int >= 0, not {self.exact_below!r}")
        if not isinstance(self.line_up, bool):
            raise TypeError(f"line_up must be a bool, not {type(self.line_up).__name__}")
        self._lossy = lossy


class _Done(dist.Work):
    """Work of a call that already ran (the lossy ones end by their deadline)."""

    def __init__(self, result: Any) -> None:
        super().__init__()
        self._future: torch.futures.Future[Any] = torch.futures.Future()
        self._future.set_result(result)

    def wait(self, timeout: Any = None) -> bool:
        return True

    def is_completed(self) -> bool:
        return True

    def is_success(self) -> bool:
        return True

    def get_future(self) -> torch.futures.Future[Any]:
        return self._future


def _op_name(op: Any) -> Optional[str]:
    """mpilossy's name for a torch reduce op it runs lossy (None: exact).
    (opts carry a ReduceOp, which equals but does not hash as RedOpType.)"""
    if op == dist.ReduceOp.SUM:
        return "sum"
    if op == dist.ReduceOp.AVG:
        return "avg"
    return None


def _lossy_op(op: Any) -> str:
    name = _op_name(op)
    assert name is not None         # (_lossy let only these through)
    return name


def gloo_group(store: dist.Store, rank: int, size: int, timeout: Any) -> dist.ProcessGroup:
    """A process group whose every operation is Gloo's, on `store`."""
    group = dist.ProcessGroup(store, rank, size)
    gloo = dist.ProcessGroupGloo(dist.PrefixStore("gloo/", store), rank, size, timeout)
    group._register_backend(torch.device("cpu"), dist.ProcessGroup.BackendType.GLOO, gloo)
    group._set_default_backend(dist.ProcessGroup.BackendType.GLOO)
    return group


class LossyProcessGroup(dist.ProcessGroup):
    """The process group of the "mpilossy" backend (made by
    init_process_group / new_group, not by hand).

    ``counts``: lossy and exact calls by collective; ``last``: the
    CollectiveStats of the latest lossy call; ``step_stats()``: a StepStats
    of the lossy calls since the previous step_stats() (delivered,
    contributors, deadline hits), for the training loop's log."""

    def __init__(self, store: dist.Store, rank: int, size: int, timeout: Any,
                 communicator: Communicator, options: BackendOptions) -> None:
        super().__init__(rank, size)  # type: ignore[call-arg]  # (the stubs know one overload)
        self.exact = gloo_group(store, rank, size, timeout)
        self.communicator = communicator
        self.options = options
        self.counts: Dict[str, List[int]] = {}
        self.last: Optional[CollectiveStats] = None
        self._recorder = Recorder()
        self._name = ""
        self._desc = ""

    # -- identity (torch asks a Python group for these) -----------------------
    def getBackendName(self) -> str:
        return BACKEND

    def _set_group_name(self, name: str) -> None:
        self._name = name
        self.exact._set_group_name(name + ":exact")  # type: ignore[arg-type]

    def getGroupName(self) -> str:
        return self._name

    def _set_group_desc(self, desc: str) -> None:
        self._desc = desc

    def getGroupDesc(self) -> str:
        return self._desc

    def step_stats(self) -> StepStats:
        """A StepStats of the lossy calls since the previous call of this."""
        return self._recorder.finish()

    # -- what goes lossy --------------------------------------------------------
    def _lossy(self, what: str, tensors: Sequence[torch.Tensor], op: Any = None) -> bool:
        """Whether this call runs lossy: the collective is chosen, the op is
        a sum or average, and every tensor is a large enough CPU float
        tensor.  All of it is the same on every rank (as torch requires)."""
        return (what in self.options._lossy
                and (op is None or _op_name(op) is not None)
                and all(t.device.type == "cpu" and t.dtype in REDUCIBLE
                        and t.numel() >= self.options.exact_below for t in tensors))

    def _begin(self, what: str, lossy: bool) -> None:
        """Count the call; line the ranks up before a lossy one if asked."""
        self.counts.setdefault(what, [0, 0])[0 if lossy else 1] += 1
        if lossy and self.options.line_up:
            self.communicator.comm.Barrier()

    def _record(self, stats: CollectiveStats) -> None:
        self.last = stats
        self._recorder.add(stats)

    # -- lossy collectives ------------------------------------------------------
    def allreduce(self, tensors: Any, opts: Any = None) -> dist.Work:
        tensors = [tensors] if isinstance(tensors, torch.Tensor) else list(tensors)
        return self._all_reduce(tensors, opts if opts is not None else dist.AllreduceOptions(),
                                self.exact.allreduce)

    def allreduce_coalesced(self, tensors: List[torch.Tensor], opts: Any = None) -> dist.Work:
        return self._all_reduce(list(tensors), opts if opts is not None
                                else dist.AllreduceCoalescedOptions(),
                                self.exact.allreduce_coalesced)

    def _all_reduce(self, tensors: List[torch.Tensor], opts: Any, exactly: Any) -> dist.Work:
        lossy = self._lossy("all_reduce", tensors, opts.reduceOp)
        self._begin("all_reduce", lossy)
        if not lossy:
            return exactly(tensors, opts)
        for tensor in tensors:
            self._record(self.communicator.allreduce(tensor, op=_lossy_op(opts.reduceOp)))
        return _Done(tensors)

    def _reduce_scatter_one(self, output: torch.Tensor, input: torch.Tensor, op: Any) -> None:
        if input.numel() != output.numel() * self.size():
            raise ValueError(f"reduce_scatter: the input has {input.numel()} elements, not "
                             f"the output's {output.numel()} times the group's {self.size()}")
        self._record(self.communicator.reduce_scatter(input, output, op=_lossy_op(op)))

    def reduce_scatter_single(self, output: torch.Tensor, input: torch.Tensor,
                              opts: Any = None) -> dist.Work:
        opts = opts if opts is not None else dist.ReduceScatterOptions()
        lossy = self._lossy("reduce_scatter", [input, output], opts.reduceOp)
        self._begin("reduce_scatter", lossy)
        if not lossy:
            return self.exact.reduce_scatter_single(output, input, opts)
        self._reduce_scatter_one(output, input, opts.reduceOp)
        return _Done(output)

    _reduce_scatter_base = reduce_scatter_single

    def reduce_scatter_single_coalesced(self, outputs: List[torch.Tensor],
                                        inputs: List[torch.Tensor],
                                        opts: Any = None) -> dist.Work:
        opts = opts if opts is not None else dist.ReduceScatterOptions()
        lossy = self._lossy("reduce_scatter", list(inputs) + list(outputs), opts.reduceOp)
        self._begin("reduce_scatter", lossy)
        if not lossy:
            return self.exact.reduce_scatter_single_coalesced(outputs, inputs, opts)
        for output, input in zip(outputs, inputs):
            self._reduce_scatter_one(output, input, opts.reduceOp)
        return _Done(outputs)

    reduce_scatter_tensor_coalesced = reduce_scatter_single_coalesced

    def _all_gather_one(self, output: torch.Tensor, input: torch.Tensor) -> None:
        if output.numel() != input.numel() * self.size():
            raise ValueError(f"all_gather: the output has {output.numel()} elements, not "
                             f"the input's {input.numel()} times the group's {self.size()}")
        self._record(self.communicator.allgather(input, output))

    def all_gather_single(self, output: torch.Tensor, input: torch.Tensor,
                          opts: Any = None) -> dist.Work:
        opts = opts if opts is not None else AllgatherOptions()
        lossy = self._lossy("all_gather", [input, output])
        self._begin("all_gather", lossy)
        if not lossy:
            return self.exact.all_gather_single(output, input, opts)
        self._all_gather_one(output, input)
        return _Done(output)

    _allgather_base = all_gather_single

    def all_gather_single_coalesced(self, outputs: List[torch.Tensor],
                                    inputs: List[torch.Tensor], opts: Any = None) -> dist.Work:
        opts = opts if opts is not None else AllgatherOptions()
        lossy = self._lossy("all_gather", list(inputs) + list(outputs))
        self._begin("all_gather", lossy)
        if not lossy:
            return self.exact.all_gather_single_coalesced(outputs, inputs, opts)
        for output, input in zip(outputs, inputs):
            self._all_gather_one(output, input)
        return _Done(outputs)

    allgather_into_tensor_coalesced = all_gather_single_coalesced

    # -- exact collectives: Gloo's, with its semantics (EXACT, below) ------------
    def _get_backend(self, device: Any) -> Any:
        return self.exact._get_backend(device)


# What always runs exactly: forwarded to the Gloo group as torch called it.
# (reduce_scatter is the list form: FSDP and DDP use the tensor forms)
EXACT = ("allgather", "allgather_coalesced", "alltoall", "all_to_all_single", "barrier",
         "broadcast", "gather", "monitored_barrier", "recv", "recv_anysource", "reduce",
         "reduce_scatter", "scatter", "send")


def _exactly(name: str) -> Any:
    def forward(self: LossyProcessGroup, *args: Any, **kwargs: Any) -> Any:
        self._begin(name, False)
        return getattr(self.exact, name)(*args, **kwargs)
    forward.__name__ = forward.__qualname__ = name
    forward.__doc__ = f"{name}, exactly (Gloo)."
    return forward


for _name in EXACT:
    setattr(LossyProcessGroup, _name, _exactly(_name))
del _name


def _matching_ranks(opts: Any) -> Tuple[int, ...]:
    """The world ranks of the group being made (all of them for the world)."""
    ranks = tuple(int(r) for r in (opts.global_ranks_in_group or ()))
    return ranks or tuple(range(opts.group_size))


# The MPI communicator whose ranks are torch's world ranks: set by
# mpilossy.torch.init_process_group(comm=...), COMM_WORLD otherwise.
_base: Optional[MPI.Intracomm] = None


def _create(opts: Any, options: Any) -> LossyProcessGroup:
    """Backend creator (extended API): the lossy group of one torch group."""
    if options is None:
        options = BackendOptions()
    elif not isinstance(options, BackendOptions):
        raise TypeError(f'pg_options of the "mpilossy" backend must be '
                        f"mpilossy.torch.BackendOptions, not {type(options).__name__}")
    base = _base if _base is not None else MPI.COMM_WORLD
    ranks = _matching_ranks(opts)
    world_size = dist.get_world_size() if dist.is_initialized() else opts.group_size
    whole = ranks == tuple(range(world_size))
    if whole:
        # (told on every rank: a rank that went on alone would wait forever)
        torch_ranks = base.allgather((opts.group_rank, opts.group_size))
        wrong = [(r, t) for r, t in enumerate(torch_ranks) if t != (r, base.size)]
        if wrong:
            raise RuntimeError(
                f'the "mpilossy" backend runs with torch\'s ranks equal to MPI\'s: MPI rank '
                f"{wrong[0][0]} of {base.size} is torch rank {wrong[0][1][0]} of "
                f"{wrong[0][1][1]} (use mpilossy.torch.init_process_group under mpiexec)")
    communicator = options.communicator
    if communicator is None:
        if whole and MPI.Comm.Compare(base, MPI.COMM_WORLD) in (MPI.IDENT, MPI.CONGRUENT):
            from .. import default_communicator
            communicator = default_communicator()
        else:
            group = base.group.Incl(list(ranks))
            sub = base.Create_group(group)
            group.Free()
            communicator = Communicator(sub)
            sub.Free()
    if communicator.size != opts.group_size or communicator.rank != opts.group_rank:
        raise ValueError(f"BackendOptions.communicator has rank {communicator.rank} of "
                         f"{communicator.size}; the group being made, rank {opts.group_rank} "
                         f"of {opts.group_size}")
    return LossyProcessGroup(opts.store, opts.group_rank, opts.group_size, opts.timeout,
                             communicator, options)


def use_comm(comm: Optional[MPI.Intracomm]) -> None:
    """The MPI communicator whose ranks are torch's world ranks (None:
    COMM_WORLD); init_process_group(comm=...) tells it here."""
    global _base
    _base = comm


def register() -> None:
    """Register the backend (done by ``import mpilossy.torch``; idempotent)."""
    if BACKEND.upper() not in dist.Backend._plugins:
        dist.Backend.register_backend(BACKEND, _create, extended_api=True, devices=["cpu"])


def lossy_group(group: Optional[dist.ProcessGroup] = None) -> LossyProcessGroup:
    """The LossyProcessGroup behind `group` (default: the world group), for
    its statistics; TypeError if it is another backend's."""
    pg = group if group is not None else dist.group.WORLD
    if not isinstance(pg, LossyProcessGroup):
        raise TypeError(f'{pg!r} is not a process group of the "mpilossy" backend '
                        f'(init_process_group("mpilossy"))')
    return pg
