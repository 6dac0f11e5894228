"""The torch optimizers on Communicator(elastic=True) going on after a rank
is lost (tests/programs/elastic_torch.py, under its own ``mpiexec
-disable-auto-cleanup``; docs/elastic.md)."""

import pytest

pytest.importorskip("torch", reason="PyTorch is not installed (pip install torch)")

from helpers import elastic_run  # noqa: E402
from mpilossy.control.failures import reports_failures  # noqa: E402

needs_failures = pytest.mark.skipif(not reports_failures(),
                                    reason="this MPI does not report failed ranks")


@needs_failures
@pytest.mark.parametrize("wrapper, ranks, channel, lose", [
    ("sharded", 4, "rma", "exit:2@10"), ("sharded", 3, "ud", "stop:0@8"),
    ("distributed", 4, "ud", "exit:3@10"), ("distributed", 3, "rma", "exit:0@10"),
    ("sharded", 4, "ud", "late:1@10,3"), ("ddp", 3, "rma", "exit:1@10"),
    ("ddp", 4, "ud", "stop:2@8"), ("distributed", 3, "rma", "stop:1@8"),
    ("distributed", 4, "ud", "stop:0@8")])
def test_torch_wrappers_go_on_after_an_exclusion(wrapper, ranks, channel, lose):
    """The survivors train on: their models equal each other's and, within
    float32 rounding, an exact MPI_Allreduce run over the survivors from
    the exclusion on (sharded: SGD with momentum, the reference starting
    from the momenta the survivors carried over); the sharded optimizer's
    chunks are cut again for them, and its momenta travel with them, the
    lost owner's from the copy of it that the next rank kept
    (tests/programs/elastic_torch.py).  `late`: rank 3 notices the loss
    one call after the others, which answer that call (the all-gather of
    step 10) alone and line up.  The replicated wrapper re-synchronising
    every step with a rank stopped (its root, too) once hung in its
    broadcast: the broadcast is a bounded wait now, which excludes it."""
    victim = int(lose.split(":")[1].split("@")[0])
    momentum = "0.9" if wrapper == "sharded" else "0"    # (ddp: no optimizer state re-synced)
    late = lose.partition(",")[2]
    for attempt in range(3):    # (`late`: until the path ran, at most three runs)
        lines, output = elastic_run("elastic_torch.py", ranks, wrapper, channel, lose, "30",
                                    momentum)
        if not late or any(r.get("alone") == [10] for r in lines) or attempt == 2:
            break
    if late:
        assert any(r.get("alone") == [10] for r in lines), f"no rank answered alone: {output}"
    survivors = [r for r in range(ranks) if r != victim]
    assert sorted(r["rank"] for r in lines) == survivors, output
    for r in lines:
        assert r["members"] == survivors and len(r["exclusions"]) == 1, r
        # (a datagram the loopback dropped after the exclusion makes a step
        # lossy: one such step at most, or the survivors lose data for real)
        assert r["lossy_after"] <= 1, r
        bound = 1e-4 if r["delivered_after"] == 1.0 else 1e-2
        assert r["same"] and r["from_reference"] < bound, r
        assert r["last"] < r["first"], r
        # (the others answer step 10's all-gather alone; on loaded cores MPI
        # may report the exit late to everyone, and then nobody does)
        assert r["alone"] in (([10], []) if late and r["rank"] != int(late) else ([],)), r
    if lose.partition(",")[2]:
        early = [r["alone"] for r in lines if r["rank"] != int(lose.partition(",")[2])]
        assert all(a == early[0] for a in early), early
    chunks = [r["chunk"] for r in lines]
    if wrapper == "sharded":
        assert sum(chunks) == lines[0]["total"] and max(chunks) - min(chunks) <= 1, chunks
        # the momenta travelled with the chunks, the lost owner's from the copy
        # the next rank kept of it (copy_state_every: 10 by default, the first
        # at step 1; tests/torch/test_torch_spares.py checks its values)
        assert all(r["momentum_kept"] == 1.0 for r in lines), \
            [r["momentum_kept"] for r in lines]
    else:
        assert chunks == [lines[0]["total"]] * len(survivors), chunks


@needs_failures
@pytest.mark.parametrize("wrapper, ranks, channel, lose", [
    ("sharded+feedback", 4, "rma", "exit:2@10/feedback"),
    ("sharded+feedback", 3, "ud", "stop:0@8/feedback"),
    ("sharded+topk", 4, "rma", "stop:3@8/choice"),
    ("sharded", 4, "ud", "stop:1@8/recut:3")])
def test_sharded_optimizer_goes_on_after_a_loss_in_its_reliable_waits(wrapper, ranks, channel,
                                                                      lose):
    """A rank lost inside one of the sharded optimizer's reliable waits:
    error feedback's bitmap all-reduce, TopK's block choice of a
    reduce-scatter, or the re-cut of the chunks after an earlier loss (a
    second rank lost during it).  Each is made again over the survivors
    (before: MembershipChanged out of step(), on every survivor); they
    train on, equal to each other and to the exact reference within float32
    rounding (error feedback: the reference sends each survivor's residual
    again, the gradient of the lost owner's chunk, whose update never
    reached them)."""
    victim = int(lose.split(":")[1].split("@")[0])
    gone = {victim} | ({int(lose.rpartition(":")[2])} if "/recut:" in lose else set())
    lines, output = elastic_run("elastic_torch.py", ranks, wrapper, channel, lose, "30", "0.9")
    survivors = [r for r in range(ranks) if r not in gone]
    assert sorted(r["rank"] for r in lines) == survivors, output
    total = lines[0]["total"]
    for r in lines:
        assert r["members"] == survivors and len(r["exclusions"]) == 1, r
        assert r["lossy_after"] <= 1, r
        bound = 1e-4 if r["delivered_after"] == 1.0 else 1e-2
        assert r["same"] and r["from_reference"] < bound and r["last"] < r["first"], r
        # every momentum travelled, the lost owners' from the copies kept of
        # them (rank 3's on rank 0, rank 1's on rank 2: the ring of the chunks)
        assert r["momentum_kept"] == 1.0, r
        if wrapper == "sharded+feedback":
            assert r["residual"] > 0, r
    chunks = [r["chunk"] for r in lines]
    assert sum(chunks) == total and max(chunks) - min(chunks) <= 1, chunks


@needs_failures
@pytest.mark.parametrize("wrapper, ranks, channel, lose", [
    ("sharded", 4, "rma", "stop:1@8/barrier"), ("sharded", 3, "ud", "exit:2@8/barrier"),
    ("distributed", 3, "rma", "stop:0@8/barrier")])
def test_a_step_whose_barrier_excluded_a_rank_reduces_over_the_survivors(wrapper, ranks,
                                                                         channel, lose):
    """Every rank makes lc.barrier() before opt.step(), as the example lines
    its ranks up; the victim leaves before step 8 and the survivors exclude
    it in that barrier.  Step 8's update itself is the survivors' exact
    average gradient of step 8: the sharded optimizer cuts its chunks for
    them before the step's reduce-scatter (before: the reduce-scatter was
    skipped, and the optimizer applied step 7's gradients a second time),
    as the replicated one reduces over them."""
    victim = int(lose.split(":")[1].split("@")[0])
    lines, output = elastic_run("elastic_torch.py", ranks, wrapper, channel, lose, "20", "0")
    survivors = [r for r in range(ranks) if r != victim]
    assert sorted(r["rank"] for r in lines) == survivors, output
    for r in lines:
        assert r["members"] == survivors and r["exclusions"][0]["step"] == 8, r
        assert r["lossy_after"] <= 1, r
        bound = 1e-5 if r["delivered_after"] == 1.0 else 1e-2
        assert r["same"] and r["from_reference"] < bound, r
