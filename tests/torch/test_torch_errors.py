"""Bad use raises a clear exception on every rank, never a hang: parameters
that differ across ranks, tensors off the CPU, non-contiguous buckets,
settings that disagree."""

import subprocess
import sys

import pytest

torch = pytest.importorskip("torch", reason="PyTorch is not installed (pip install torch)")

import mpilossy  # noqa: E402
import mpilossy.torch as mt  # noqa: E402
from helpers import all_ranks_raise, clean_subprocess_env, is_singleton  # noqa: E402
from torch_helpers import make_model  # noqa: E402


class FakeBucket:
    """What the hook uses of dist.GradBucket."""

    def __init__(self, tensor, index=0):
        self.tensor, self.i = tensor, index

    def buffer(self):
        return self.tensor

    def index(self):
        return self.i

    def is_last(self):
        return True


def shapes_differ(comm):
    """The last rank's model has one more hidden unit."""
    torch.manual_seed(0)
    hidden = 8 + (comm.rank == comm.size - 1)
    return torch.nn.Sequential(torch.nn.Linear(4, hidden), torch.nn.Linear(hidden, 2))


@pytest.mark.mpi(min_size=2)
def test_parameter_shapes_differ_across_ranks(comm, lc):
    model = shapes_differ(comm)
    params = list(model.parameters())
    attempts = {
        "DistributedOptimizer": lambda: mt.DistributedOptimizer(
            torch.optim.SGD(params, lr=0.1), model.named_parameters(), lc),
        "ShardedOptimizer": lambda: mt.ShardedOptimizer(
            torch.optim.SGD(params, lr=0.1), model.named_parameters(), lc),
        "AllreduceHookState": lambda: mt.AllreduceHookState(lc, model=model),
        "check_parameters": lambda: mt.check_parameters(model),
        "DriftController": lambda: mt.DriftController(model, comm=lc, broadcast_every=5),
        "broadcast_parameters": lambda: mt.broadcast_parameters(model),
        "measure_drift": lambda: mt.measure_drift(params),
    }
    for name, attempt in attempts.items():
        message = all_ranks_raise(comm, attempt, mpilossy.MismatchError)
        assert "differ across ranks" in message and str(comm.size - 1) in message, (name, message)
    assert torch.equal(model[0].weight, shapes_differ(comm)[0].weight)   # nothing moved


@pytest.mark.mpi
def test_mixed_devices(comm, lc):
    """One parameter on another device (meta: there is no GPU here)."""
    model = make_model()
    model[2].weight = torch.nn.Parameter(torch.empty(48, 48, device="meta"))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    message = all_ranks_raise(
        comm, lambda: mt.DistributedOptimizer(opt, model.named_parameters(), lc), BufferError)
    assert "'2.weight' is on device meta" in message and "several devices: cpu, meta" in message
    all_ranks_raise(comm, lambda: mt.AllreduceHookState(lc, model=model), BufferError)
    all_ranks_raise(comm, lambda: mt.broadcast_parameters(model), BufferError)


@pytest.mark.mpi(min_size=2)
def test_device_differs_across_ranks(comm, lc):
    """Only the last rank is off the CPU: every rank raises."""
    model = make_model()
    if comm.rank == comm.size - 1:
        model = model.to("meta")
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    message = all_ranks_raise(comm, lambda: mt.DistributedOptimizer(opt, communicator=lc),
                              BufferError)
    assert message.startswith(f"rank {comm.size - 1}: ")


@pytest.mark.mpi
def test_hook_non_contiguous_bucket(comm, lc):
    state = mt.AllreduceHookState(lc)
    bucket = FakeBucket(torch.ones(6, 5).t())
    message = all_ranks_raise(comm, lambda: mt.allreduce_hook(state, bucket).wait(),
                              BufferError)
    assert "contiguous=False" in message and "not C-contiguous" in message
    ok = torch.ones(30)
    mt.allreduce_hook(state, FakeBucket(ok)).wait()      # the communicator still works
    assert torch.equal(ok, torch.ones(30))


@pytest.mark.mpi
def test_hook_bucket_off_the_cpu(comm, lc):
    state = mt.AllreduceHookState(lc, background=True)
    message = all_ranks_raise(
        comm, lambda: mt.allreduce_hook(state, FakeBucket(torch.empty(8, device="meta"))).wait(),
        BufferError)
    assert "device meta" in message
    state.close()


@pytest.mark.mpi(min_size=2)
def test_hook_bucket_sizes_differ(comm, lc):
    state = mt.AllreduceHookState(lc)
    bucket = FakeBucket(torch.ones(100 + (comm.rank == 0)))
    all_ranks_raise(comm, lambda: mt.allreduce_hook(state, bucket).wait(),
                    mpilossy.MismatchError)


@pytest.mark.mpi
def test_unsupported_tensors(comm, lc):
    complex_model = torch.nn.Linear(4, 4).to(torch.complex64)
    message = all_ranks_raise(
        comm, lambda: mt.DistributedOptimizer(torch.optim.SGD(complex_model.parameters(), lr=0.1),
                                              communicator=lc), TypeError)
    assert "torch.complex64" in message
    emb = torch.nn.Embedding(10, 3, sparse=True)
    opt = mt.DistributedOptimizer(torch.optim.SGD(emb.parameters(), lr=0.1), communicator=lc)
    emb(torch.tensor([1, 2])).sum().backward()
    all_ranks_raise(comm, opt.step, TypeError)


@pytest.mark.mpi
def test_settings_disagree_or_are_bad(comm, lc):
    model = make_model()
    last = comm.rank == comm.size - 1

    def wrap(**options):
        return lambda: mt.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                               communicator=lc, **options)

    all_ranks_raise(comm, wrap(op="max" if last else "avg"), ValueError)
    all_ranks_raise(comm, wrap(bucket_bytes=0 if last else 1024), ValueError)
    all_ranks_raise(comm, wrap(broadcast_every=-1 if last else 5), ValueError)
    if comm.size > 1:
        all_ranks_raise(comm, wrap(op="sum" if last else "avg"), mpilossy.MismatchError)
    all_ranks_raise(comm, lambda: mt.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.1), [("only", model[0].weight)], lc), ValueError)
    all_ranks_raise(comm, lambda: mt.broadcast_parameters(model, root_rank=comm.size), ValueError)
    sharded = mt.ShardedOptimizer(torch.optim.SGD(make_model().parameters(), lr=0.1),
                                  communicator=lc)
    all_ranks_raise(comm, lambda: mt.broadcast_optimizer_state(sharded), ValueError)
    used = torch.optim.Adam(model.parameters())
    used.state[model[0].weight]["step"] = torch.tensor(1.0)
    all_ranks_raise(comm, lambda: mt.ShardedOptimizer(used, communicator=lc), ValueError)

    def shard(**options):
        return lambda: mt.ShardedOptimizer(torch.optim.SGD(make_model().parameters(), lr=0.1),
                                           communicator=lc, **options)

    # copies of the optimizer's state need an elastic communicator; a bad count
    # on one rank, or counts that differ, raise everywhere
    all_ranks_raise(comm, shard(copy_state_every=-1 if last else None), ValueError)
    all_ranks_raise(comm, shard(copy_state_every=True), ValueError)
    all_ranks_raise(comm, shard(copy_state_every=5), ValueError)
    if comm.size > 1:
        all_ranks_raise(comm, shard(copy_state_every=0 if last else None),
                        mpilossy.MismatchError)


@pytest.mark.skipif(not is_singleton(), reason="starts its own Python: runs at size 1")
def test_import_without_torch():
    """`import mpilossy` works without torch; `import mpilossy.torch` says what to install."""
    code = ("import sys; sys.modules['torch'] = None\n"
            "import mpilossy\n"
            "try:\n"
            "    import mpilossy.torch\n"
            "except ImportError as exc:\n"
            "    print('ImportError:', exc)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=60, cwd="/", env=clean_subprocess_env())
    assert out.returncode == 0, out.stderr
    assert "ImportError:" in out.stdout and "pip install torch" in out.stdout
