"""The torch.distributed backend "mpilossy" (mpilossy/torch/backend.py):
lossy gradient collectives, everything else exact, DDP without a hook and
FSDP2 over it, at 1-4 ranks.  The world group is the backend's own; a few
groups of all ranks over Communicators of their own (BackendOptions) are
made once for the module: with a dozen torch groups (each with its Gloo
process group) up, creating a Communicator took up to 18 s now and then on
the 2-core development machine (MPI window allocation; docs/backend.md)."""

import itertools

import numpy as np
import pytest
from mpi4py import MPI

torch = pytest.importorskip("torch", reason="PyTorch is not installed (pip install torch)")

import torch.distributed as dist  # noqa: E402

import mpilossy  # noqa: E402
import mpilossy.torch as mt  # noqa: E402
from torch_helpers import (assert_matches_reference, gather_check, loss_of,  # noqa: E402
                           make_model, train_reference)

pytestmark = pytest.mark.mpi


@pytest.fixture(scope="module", autouse=True)
def process_group():
    mt.init_process_group("mpilossy")
    yield
    mt.destroy_process_group()


def group_of(communicator, **options):
    """A group of every rank over `communicator` (collective)."""
    return dist.new_group(list(range(dist.get_world_size())), backend="mpilossy",
                          pg_options=mt.BackendOptions(communicator=communicator, **options))


@pytest.fixture(scope="module")
def lossless_lc(process_group):
    with mpilossy.Communicator(MPI.COMM_WORLD, timeout=None, loss=None) as lc:
        yield lc


@pytest.fixture(scope="module")
def lossless(lossless_lc):
    """A group over a lossless communicator, every float tensor lossy."""
    return group_of(lossless_lc, exact_below=0)


@pytest.fixture(scope="module")
def lossless_gathers(lossless_lc):
    """The same, the all-gathers lossy as well."""
    return group_of(lossless_lc, exact_below=0,
                    lossy=("all_reduce", "reduce_scatter", "all_gather"))


@pytest.fixture(scope="module")
def lossy(process_group):
    """30% of the blocks dropped on the way, a deadline of 0.3 s."""
    with mpilossy.Communicator(MPI.COMM_WORLD, timeout=0.3,
                               loss=mpilossy.loss.Bernoulli(0.3, seed=5),
                               algorithm="direct", block_bytes=1024) as lc:
        yield group_of(lc, exact_below=0)


def counted(group, what):
    """(lossy, exact) calls of `what` on `group` so far."""
    return tuple(mt.lossy_group(group).counts.get(what, (0, 0)))


def test_the_world_group_is_the_backends_and_counts_what_went_lossy(comm):
    pg = mt.lossy_group()
    assert pg.getBackendName() == "mpilossy" and dist.get_backend() == "mpilossy"
    before = {k: list(v) for k, v in pg.counts.items()}
    big = torch.full((4096,), float(comm.rank + 1))
    dist.all_reduce(big)
    small = torch.full((8,), float(comm.rank + 1))
    dist.all_reduce(small)
    biggest = torch.full((4096,), float(comm.rank + 1))
    dist.all_reduce(biggest, op=dist.ReduceOp.MAX)
    total = comm.size * (comm.size + 1) / 2
    lossy, exact = (pg.counts["all_reduce"][i] - before.get("all_reduce", [0, 0])[i]
                    for i in (0, 1))
    gather_check(comm, (lossy, exact) == (1, 2), (lossy, exact))
    # (the default communicator's settings; loss-free on one machine, so exact values)
    gather_check(comm, bool(torch.all(small == total)) and bool(torch.all(biggest == comm.size)))
    gather_check(comm, pg.last is not None and pg.last.nbytes == 4096 * 4, pg.last)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
@pytest.mark.parametrize("op", ["sum", "avg"])
def test_lossless_all_reduce_is_exact(comm, lossless, dtype, op):
    group = lossless
    before = counted(group, "all_reduce")
    n = 5000 + comm.size                       # (not a multiple of the rank count)
    mine = (torch.arange(n, dtype=torch.float64) % 7 + comm.rank).to(dtype)
    got = mine.clone()
    reduce_op = dist.ReduceOp.SUM if op == "sum" else dist.ReduceOp.AVG
    work = dist.all_reduce(got, op=reduce_op, group=group, async_op=True)
    work.wait()
    assert work.is_completed() and work.get_future().value()[0] is got
    want = sum((torch.arange(n, dtype=torch.float64) % 7 + r).to(dtype).to(torch.float64)
               for r in range(comm.size))
    if op == "avg":
        want = want / comm.size
    gather_check(comm, torch.equal(got, want.to(dtype)),
                 (got[:4].tolist(), want[:4].tolist()))
    after = counted(group, "all_reduce")
    gather_check(comm, (after[0] - before[0], after[1] - before[1]) == (1, 0))


def subset_means(values):
    """Every mean over a non-empty set of the values."""
    return {float(np.mean(chosen)) for k in range(1, len(values) + 1)
            for chosen in itertools.combinations(values, k)}


def test_lossy_all_reduce_averages_the_ranks_that_arrived(comm, lossy):
    """Rank r sends 2^r: each element of the average is the mean over a
    set of ranks (those whose data reached it), never a scaled partial sum."""
    group = lossy
    mt.lossy_group(group).step_stats()
    means = subset_means([2.0 ** r for r in range(comm.size)])
    got = torch.full((16384,), 2.0 ** comm.rank, dtype=torch.float64)
    dist.all_reduce(got, op=dist.ReduceOp.AVG, group=group)
    stats = mt.lossy_group(group).last
    values = set(got.tolist())
    unnamed = [v for v in values if not any(abs(v - m) <= 1e-12 * m for m in means)]
    gather_check(comm, not unnamed, unnamed[:5])
    if comm.size > 1:
        gather_check(comm, 0.5 < stats.delivered < 0.95, stats.delivered)
        gather_check(comm, len(values) > 1, "every element had every rank: no loss happened")
    step = mt.lossy_group(group).step_stats()
    gather_check(comm, step.calls == 1 and step.delivered == stats.delivered, step)


def test_small_and_integer_tensors_are_exact_under_loss(comm, lossy):
    """Under 30% injected loss, what its dtype (integers) or its size
    (fewer than exact_below elements, on the world group) keeps exact goes
    through Gloo: exact sums."""
    counts = torch.arange(5000, dtype=torch.int64) + comm.rank
    dist.all_reduce(counts, group=lossy)
    want = torch.arange(5000, dtype=torch.int64) * comm.size + sum(range(comm.size))
    small = torch.full((100,), float(comm.rank))
    dist.all_reduce(small)
    gather_check(comm, torch.equal(counts, want)
                 and bool(torch.all(small == sum(range(comm.size)))))


def test_lossy_sum_is_unbiased(comm, lossy):
    """op=SUM scales by ranks / contributors: the mean over the elements of
    the estimated sum of all-ones is the rank count (every element of it
    exactly size when the element's data all arrived)."""
    group = lossy
    got = torch.ones(1 << 16, dtype=torch.float64)
    dist.all_reduce(got, group=group)
    gather_check(comm, bool(torch.all(got == comm.size)), got.unique()[:5].tolist())


@pytest.mark.parametrize("lossy_gather", [False, True])
def test_lossless_reduce_scatter_and_all_gather_match_torch_layout(comm, lossless,
                                                                   lossless_gathers, lossy_gather):
    group = lossless_gathers if lossy_gather else lossless
    before = counted(group, "reduce_scatter") + counted(group, "all_gather")
    n = 2048
    full = torch.arange(n * comm.size, dtype=torch.float32) + 100 * comm.rank
    out = torch.empty(n)
    dist.reduce_scatter_single(out, full, group=group)
    base = torch.arange(n * comm.size, dtype=torch.float32)[comm.rank * n:(comm.rank + 1) * n]
    want = comm.size * base + 100 * sum(range(comm.size))
    gather_check(comm, torch.equal(out, want), (out[:3].tolist(), want[:3].tolist()))
    gathered = torch.zeros(n * comm.size)
    dist.all_gather_single(gathered, torch.full((n,), float(comm.rank)), group=group)
    want_gathered = torch.arange(comm.size, dtype=torch.float32).repeat_interleave(n)
    gather_check(comm, torch.equal(gathered, want_gathered))
    after = counted(group, "reduce_scatter") + counted(group, "all_gather")
    change = tuple(a - b for a, b in zip(after, before))
    gather_check(comm, change == ((1, 0, 1, 0) if lossy_gather else (1, 0, 0, 1)), change)


def test_everything_else_is_exact(comm):
    t = torch.full((3,), float(comm.rank))
    dist.broadcast(t, src=comm.size - 1)
    gathered = [torch.empty(2) for _ in range(comm.size)]
    dist.all_gather(gathered, torch.full((2,), float(comm.rank)))
    objects = [None] * comm.size
    dist.all_gather_object(objects, {"rank": comm.rank})
    dist.barrier()
    gather_check(comm, torch.all(t == comm.size - 1).item()
                 and [g[0].item() for g in gathered] == list(range(comm.size))
                 and objects == [{"rank": r} for r in range(comm.size)])


def train(comm, model, steps, same_batch=False):
    """SGD steps on this rank's batches; the losses."""
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    losses = []
    for step in range(steps):
        opt.zero_grad()
        loss = loss_of(model, comm.rank, 0 if same_batch else step)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def test_ddp_without_a_hook_matches_the_reliable_reference(comm, lossless):
    group = lossless
    before = counted(group, "all_reduce")
    model, ref = make_model(3), make_model(3)
    train(comm, torch.nn.parallel.DistributedDataParallel(model, process_group=group), 4)
    train_reference(comm, ref, torch.optim.SGD(ref.parameters(), lr=0.1), 4)
    assert_matches_reference(comm, model, ref)
    gather_check(comm, counted(group, "all_reduce")[0] - before[0] >= 4,
                 mt.lossy_group(group).counts)


def test_ddp_under_loss_trains_and_reports_what_was_delivered(comm, lossy):
    group = lossy
    mt.lossy_group(group).step_stats()
    ddp = torch.nn.parallel.DistributedDataParallel(make_model(4), process_group=group)
    losses = train(comm, ddp, 6, same_batch=True)
    first, last = losses[0], losses[-1]
    stats = mt.lossy_group(group).step_stats()
    gather_check(comm, stats.calls >= 6 and last < first, (stats.calls, first, last))
    if comm.size > 1:
        gather_check(comm, stats.delivered < 0.97, stats.delivered)


def test_fsdp2_lossless_equals_the_reliable_reference(comm, lossless):
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import fully_shard
    group = lossless
    before = counted(group, "reduce_scatter")[0], counted(group, "all_gather")[0]
    mesh = DeviceMesh.from_group(group, "cpu")
    model, ref = make_model(5), make_model(5)
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    train(comm, model, 4)
    train_reference(comm, ref, torch.optim.SGD(ref.parameters(), lr=0.1), 4)
    full = [p.full_tensor() for p in model.parameters()]
    assert_matches_reference(comm, full, ref)
    scattered = counted(group, "reduce_scatter")[0] - before[0]
    gathered = counted(group, "all_gather")[0] - before[1]
    gather_check(comm, (scattered >= 4 or comm.size == 1) and gathered == 0,
                 (scattered, gathered))


@pytest.mark.skipif(MPI.COMM_WORLD.size < 3, reason="needs a rank outside the group")
def test_a_group_of_some_ranks_gets_a_communicator_of_its_own(comm):
    members = list(range(comm.size - 1))
    group = dist.new_group(members, backend="mpilossy")
    if comm.rank in members:
        pg = mt.lossy_group(group)
        t = torch.ones(4096)
        dist.all_reduce(t, group=group)
        ok = pg.communicator.size == len(members) and pg.counts["all_reduce"] == [1, 0] \
            and bool(torch.all(t == len(members)))
    else:
        ok = group == dist.GroupMember.NON_GROUP_MEMBER
    gather_check(comm, ok)


def test_bad_options_are_refused():
    with pytest.raises(ValueError, match="unknown collective"):
        mt.BackendOptions(lossy=("broadcast",))
    with pytest.raises(TypeError, match="collection of names"):
        mt.BackendOptions(lossy="all_reduce")
    with pytest.raises(ValueError, match="exact_below"):
        mt.BackendOptions(exact_below=-1)
    with pytest.raises(TypeError, match="Communicator"):
        mt.BackendOptions(communicator="world")
    with pytest.raises(TypeError, match="line_up"):
        mt.BackendOptions(line_up=1)


def test_wrong_pg_options_and_wrong_groups_raise_on_every_rank(comm, lossless):
    with pytest.raises(TypeError, match="BackendOptions"):
        dist.new_group(list(range(comm.size)), backend="mpilossy", pg_options={"lossy": ()})
    gloo = dist.new_group(list(range(comm.size)), backend="gloo")
    with pytest.raises(TypeError, match="not a process group of the"):
        mt.lossy_group(gloo)
    group = lossless
    with pytest.raises(ValueError, match="times the group"):
        dist.reduce_scatter_single(torch.empty(2048), torch.empty(2048 * comm.size + 1),
                                   group=group)


def test_a_mismatched_all_reduce_raises_on_every_rank(comm, lossless):
    """Tensors of different lengths on different ranks: the communicator's
    MismatchError on every rank, not a hang."""
    if comm.size == 1:
        pytest.skip("needs two ranks to disagree")
    group = lossless
    t = torch.ones(4096 + comm.rank)
    with pytest.raises(mpilossy.MismatchError):
        dist.all_reduce(t, group=group)
