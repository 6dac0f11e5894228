"""mpilossy for PyTorch: train under loss without changing model code.

- the torch.distributed backend "mpilossy" (registered on import):
  ``init_process_group("mpilossy")``, then DDP or FSDP2 as with Gloo; the
  gradient collectives run lossy (``BackendOptions``, ``lossy_group``;
  docs/backend.md);
- a DDP communication hook (``ddp.register_comm_hook(AllreduceHookState(lc),
  allreduce_hook)``) and ``init_process_group()`` for DDP under mpiexec;
- without torch.distributed: ``DistributedOptimizer`` (Horovod style),
  ``broadcast_parameters``, ``broadcast_optimizer_state``;
- drift control: ``DriftController`` (periodic reliable broadcast or average,
  drift meter);
- the sharded, bounded-drift mode: ``ShardedOptimizer``;
- error feedback for both (``error_feedback=True``, ``ErrorFeedback``);
- ``ComputeDeadline``: DropCompute's compute budget per step (micro-batches
  until it ends, then a weighted average: ``compute_deadline=`` of both
  optimizer wrappers);
- gradient compression for both and the hook (``compression=``):
  ``LowBit("int8" | "int4")`` and aligned ``TopK(density)``, each with
  error feedback of what compression leaves out;
- ``group_average_parameters``: one round of lossy group averaging
  (``mpilossy.GroupAverager``, Moshpit SGD) for local SGD;
- ``PhaseAwareTolerance``: tight loss tolerance early in training, loose later;
- ``StepStats``: what each step's communication delivered;
- ``WrappedOptimizer``: the type of what the optimizer wrappers return (for
  annotations: ``stats``, ``drift_control``, ``communicator``...).

See docs/training.md.  Devices (docs/gpu.md): everything here takes CUDA
tensors as well as CPU ones.  The optimizers, the broadcasts, drift control,
the averaging functions and the DDP hook with compression copy them into
pinned host buffers of their own (ShardedOptimizer keeps the parameters on
the GPU and a host mirror of them); the DDP hook without compression hands
CUDA buckets to the communicator, which stages them through pinned host
memory and needs CuPy.  Other devices are refused on every rank.
"""

try:
    import torch as _torch  # noqa: F401
except ImportError as _exc:
    raise ImportError("mpilossy.torch needs PyTorch, which is not installed: "
                      "pip install torch (or pip install 'mpilossy[torch]')") from _exc

from .backend import BackendOptions, LossyProcessGroup, lossy_group, register as _register
from .averaging import average_optimizer_state, average_parameters, group_average_parameters
from .broadcast import broadcast_optimizer_state, broadcast_parameters, check_parameters
from .compression import LowBit, TopK
from .compute import ComputeDeadline
from .drift import DriftController, DriftStep, measure_drift
from .feedback import ErrorFeedback
from .hooks import AllreduceHookState, allreduce_hook
from .optimizer import DistributedOptimizer, WrappedOptimizer
from .process_group import destroy_process_group, init_process_group, local_group
from .sharded import ShardedOptimizer
from .stats import StepStats
from .tolerance import PhaseAwareTolerance

__all__ = [
    "AllreduceHookState",
    "BackendOptions",
    "LossyProcessGroup",
    "ComputeDeadline",
    "DistributedOptimizer",
    "DriftController",
    "DriftStep",
    "ErrorFeedback",
    "group_average_parameters",
    "lossy_group",
    "LowBit",
    "PhaseAwareTolerance",
    "ShardedOptimizer",
    "StepStats",
    "TopK",
    "WrappedOptimizer",
    "allreduce_hook",
    "average_optimizer_state",
    "average_parameters",
    "broadcast_optimizer_state",
    "broadcast_parameters",
    "check_parameters",
    "destroy_process_group",
    "init_process_group",
    "local_group",
    "measure_drift",
]

_register()
