"""Hardening of the compiled core: records read once and bounded, integer
rescaling that saturates, a bounded tree radix, channels that must override
the interface, and failed calls whose wait at the end is bounded.

The record tests drive the one-sided channel's shared-memory read path
through _testing.RecordJudge (a peer window in plain memory, no MPI); the
direct test runs one rank of an all-reduce on peers' records in memory
(_testing.DirectRank, no MPI); the others run at any number of ranks, with
expected values computed from rank and size."""

import struct
import sys
import threading
import time

import numpy as np
import pytest

import mpilossy
from mpilossy import _core, _testing
from helpers import all_ranks_raise, clean_subprocess_env, run_bounded

WAIT, READY, GONE, FAIL = 0, 1, 2, 3
SIZE, BLOCK = 4, 256


# -- one-sided channel: a record's header is read once and bounded -------------
@pytest.fixture
def judge():
    return _testing.RecordJudge(size=SIZE, nslots=2, nblocks=2, block_bytes=BLOCK, seq=5)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("stable", [False, True], ids=["in-place", "copied"])
def test_valid_record_is_taken(judge, stable):
    judge.write(1, 1, count=3, nbytes=BLOCK, fill=0x5A)
    verdict, count, nbytes, data = judge.poll(1, 1, stable)
    assert (verdict, count, nbytes) == (READY, 3, BLOCK)
    assert data == b"\x5a" * BLOCK
    assert judge.guards_intact()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("stable", [False, True], ids=["in-place", "copied"])
@pytest.mark.parametrize("count, nbytes", [(1, BLOCK + 8), (1, 1 << 31), (SIZE + 1, BLOCK),
                                           (0xFFFFFFFF, 8)],
                         ids=["nbytes>block", "nbytes-huge", "count>size", "count-huge"])
def test_record_that_breaks_the_rule_is_never_taken(judge, stable, count, nbytes):
    """A header with a count above the ranks or a length above the call's
    block is not there: WAIT while its producer is in the call, GONE once it
    moved on; nothing is copied outside the destination."""
    judge.write(0, 1, count=count, nbytes=nbytes)
    assert judge.poll(0, 1, stable)[0] == WAIT
    judge.set_status(6)                     # the producer is past this call
    assert judge.poll(0, 1, stable)[0] == GONE
    assert judge.guards_intact()


@pytest.mark.timeout(60)
def test_confirm_checks_the_check_word(judge):
    """Payload of a later call with another layout can land on a header read
    in place and keep its sequence number by chance: confirm must see that
    the check word changed."""
    judge.write(0, 0, count=2, nbytes=BLOCK)
    assert judge.poll(0, 0, False)[0] == READY
    assert judge.confirm(0, 0)
    judge.set_check(0, 0, 0x0123456789ABCDEF)
    assert not judge.confirm(0, 0)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("stable", [False, True], ids=["in-place", "copied"])
def test_header_rewritten_while_polled(judge, stable):
    """A second thread flips (count, nbytes) between a valid pair and one
    that breaks the rule, as a producer two calls ahead can: no READY answer
    may carry the bad pair, and a copy never leaves its destination.  (Read
    twice, the header passed validation and then gave its length to the
    copy.)"""
    judge.write(0, 0, count=1, nbytes=BLOCK)
    judge.arm()
    flipper = threading.Thread(target=judge.flip, args=(0, 0, 1, BLOCK, SIZE + 100, BLOCK + 64))
    flipper.start()
    try:
        polls, ready, bad = judge.hammer(1.0, 0, 0, stable)
    finally:
        judge.halt()        # (hammer has stopped it already, unless it raised)
        flipper.join(timeout=10)
    assert not flipper.is_alive()
    assert polls > 1000 and ready > 0
    assert bad == 0, f"{bad} of {ready} READY answers had a header that breaks the rule"
    assert judge.guards_intact()


@pytest.mark.timeout(60)
def test_mismatch_names_are_bounds_safe(judge):
    """A peer's status is untrusted: names of out-of-range codes print as '?'."""
    judge.set_status(5, sig=0xBAD, dtype=7, op=9, algo=(5 << 4) | 9, count=11)
    assert judge.poll(0, 0, False)[0] == FAIL
    kind, message = judge.error()
    assert kind == _core.ERRORS["mismatch"]
    # (bit 24 of the layout, clear here: the peer's call has a deadline)
    assert "rank 1: ? of 11 x ? op=? algorithm=? with a deadline;" in message, message


# -- direct with redundancy: a row is what was confirmed -----------------------
def xor(*rows: bytes) -> bytes:
    out = bytearray(rows[0])
    for row in rows[1:]:
        for i, b in enumerate(row):
            out[i] ^= b
    return bytes(out)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("torn_peer", [1, 2])
def test_a_row_rewritten_after_its_block_was_taken_never_feeds_a_rebuild(torn_peer):
    """Rank 0 of 3 reduces chunk 0 with redundancy (2, 1): while it takes
    one peer's block, it sums the other peer's block too (fused, read in
    place), leaving that block's row where it is (ROW_IN_PLACE) until a
    rebuild needs it.  The channel confirms that block, and right after its
    check the producer (two calls ahead) rewrites it.  The next block of
    that group is dropped: a rebuild would read the row again, find it
    rewritten, and must not use it, so that block is lost (never rebuilt
    from the rewritten bytes, which once passed the trailer check and were
    summed as delivered), and every other block is the exact sum.  Both
    peers take the torn role: rank 0 reads peer 2's stream first and fuses
    peer 1's blocks into it, and the test must not depend on which stream
    the engine reads first."""
    size, nblocks, elems, torn_block = 3, 4, 4, 2
    rank = _testing.DirectRank(size, _core.DTYPE_F64, size * nblocks * elems, elems * 8,
                               fec_k=2, fec_m=1)
    lay = rank.layout
    assert (lay["nblocks"], lay["block_elems"], lay["ngroups"]) == (nblocks, elems, 2)
    pad = lay["block_bytes"]
    # every rank's contribution to chunk 0: distinct small integers (exact sums)
    contrib = [np.arange(nblocks * elems, dtype=np.float64) * (p + 1) + 100 * p
               for p in range(size)]
    block = [[c[b * elems:(b + 1) * elems].tobytes() for b in range(nblocks)] for c in contrib]
    for peer in range(1, size):
        for b in range(nblocks):
            rank.put(peer, 0, b, 1, block[peer][b])
        for g in range(lay["ngroups"]):     # parity: XOR of the rows of the group
            rows = [block[peer][b].ljust(pad, b"\0") + struct.pack("<II", 1, len(block[peer][b]))
                    for b in (2 * g, 2 * g + 1)]
            rank.put(peer, 0, nblocks + g, 0, xor(*rows))
    rank.tear(torn_peer, 0, torn_block, np.full(elems, -1e6).tobytes())
    send = np.concatenate([contrib[0], np.zeros((size - 1) * nblocks * elems)])
    dropped = torn_block + 1
    out = rank.run(send.tobytes(), drops=[(torn_peer, 0, dropped)])
    assert not out["failed"], out["error"]
    assert out["tears"] == 1, "the torn record was never confirmed: the test proves nothing"
    assert out["rebuilt"] == 0
    # (injected, late, gone, torn; gone: the other chunks' stage-2 records, never put)
    assert out["lost"][0] == 1 and out["lost"][3] == 0, out["lost"]
    reduced = np.frombuffer(out["recv"], np.float64)[:nblocks * elems].reshape(nblocks, elems)
    exact = sum(contrib).reshape(nblocks, elems)
    kept = [b for b in range(nblocks) if b != dropped]
    np.testing.assert_array_equal(reduced[kept], exact[kept])
    # the dropped block: the two contributions left, scaled without bias (3 / 2)
    others = (contrib[0] + contrib[3 - torn_peer]).reshape(nblocks, elems)[dropped]
    np.testing.assert_allclose(reduced[dropped], others * size / 2, rtol=1e-15)


# -- integers saturate when rescaled -------------------------------------------
I32, I64 = np.iinfo(np.int32), np.iinfo(np.int64)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("dtype", [np.int32, np.int64])
def test_rescale_saturates(dtype):
    info = np.iinfo(dtype)
    big = info.max - 10
    a = np.array([big, -big, info.max, info.min, 5, -5, 0, big // 4], dtype)
    out = np.zeros_like(a)
    _core.kernel("scale", out, a, scale=4.0)
    # big // 4 of an int64 rounds up to 2**61 in double: times 4 it saturates
    expected = np.array([info.max, info.min, info.max, info.min, 20, -20, 0,
                         info.max if dtype == np.int64 else big // 4 * 4], dtype)
    np.testing.assert_array_equal(out, expected)
    _core.kernel("scale", out, a, scale=1.5)
    assert out[0] == info.max and out[1] == info.min and out[4] == 8 and out[5] == -8


@pytest.mark.mpi
@pytest.mark.timeout(120)
@pytest.mark.parametrize("dtype", [np.int32, np.int64])
def test_sum_under_loss_saturates(comm, dtype):
    """Rank 0 sends +-(max - 10), the others zeros: a block that holds rank 0's
    data but misses someone is scaled by N/K > 1 and must saturate at the
    type's range, not wrap.  The direct algorithm says whose data each block
    holds, so every element is exact."""
    info = np.iinfo(dtype)
    n, big = 1000, info.max - 10
    sign = np.where(np.arange(n) % 2 == 0, 1, -1).astype(dtype)
    x = sign * big if comm.rank == 0 else np.zeros(n, dtype)
    saturated = np.where(sign > 0, info.max, info.min).astype(dtype)
    loss = mpilossy.loss.Bernoulli(0.3, seed=11)
    wrong, overflowed = [], 0
    with mpilossy.Communicator(comm, timeout=0.5, loss=loss, block_bytes=64) as lc:
        for call in range(8):
            out = np.full(n, 7, dtype)
            st = lc.allreduce(x, out, op="sum", algorithm="direct")
            members = st.contributors.members()
            firsts, lengths = st.contributors.blocks()
            for first, length, who in zip(firsts, lengths, members):
                part = slice(first, first + length)
                if not who[0]:
                    expected = np.zeros(length, dtype)
                elif who.all():
                    expected = sign[part] * big
                else:
                    expected = saturated[part]
                    overflowed += int(length > 0)
                if not np.array_equal(out[part], expected):
                    wrong.append(f"call {call} block at {first} members {np.flatnonzero(who)}: "
                                 f"{out[part][:4]} != {expected[:4]}")
    everyone = comm.allgather((wrong[:5], overflowed))
    assert not any(w for w, _ in everyone), everyone
    if comm.size > 1:
        assert sum(o for _, o in everyone) > 0, "no block overflowed: the test proves nothing"


# -- tree radix ----------------------------------------------------------------
@pytest.mark.mpi
@pytest.mark.timeout(60)
@pytest.mark.parametrize("radix", [1000, 65, 1 << 40])
def test_tree_radix_out_of_range_raises_everywhere(comm, clean_env, radix):
    message = all_ranks_raise(
        comm, lambda: mpilossy.Communicator(comm, tree_radix=radix).free(), ValueError)
    assert "tree_radix" in message


@pytest.mark.mpi
@pytest.mark.timeout(60)
def test_tree_radix_from_environment_is_checked(comm, clean_env, monkeypatch):
    monkeypatch.setenv("MPILOSSY_TREE_RADIX", "1000")
    all_ranks_raise(comm, lambda: mpilossy.Communicator(comm).free(), ValueError)


@pytest.mark.mpi
@pytest.mark.timeout(60)
def test_widest_tree_is_exact(comm, clean_env):
    x = np.arange(100, dtype=np.int64) + comm.rank
    with mpilossy.Communicator(comm, timeout=None, loss=None,
                               tree_radix=_core.MAX_TREE_RADIX) as lc:
        out = np.empty_like(x)
        lc.allreduce(x, out, algorithm="tree")
    np.testing.assert_array_equal(out, comm.size * np.arange(100) + sum(range(comm.size)))


# -- the channel interface -----------------------------------------------------
@pytest.mark.timeout(120)
@pytest.mark.parametrize("method", ["claim", "mine", "publish", "poll", "confirm"])
def test_channel_without_override_aborts(method):
    """A channel that does not provide a method the algorithms need stops
    the process with a message, instead of losing data or waiting forever."""
    code = f"from mpilossy import _testing; _testing.BareChannel().call({method!r})"
    proc = run_bounded([sys.executable, "-c", code], 60, clean_subprocess_env())
    assert proc.returncode != 0, proc.stdout + proc.stderr
    assert f"Channel.{method} is not implemented" in proc.stderr, proc.stderr[-2000:]


# -- a failed call's wait at the end is bounded ----------------------------------
@pytest.mark.mpi(min_size=2)
@pytest.mark.timeout(90)
def test_failed_call_with_infinite_timeout_returns(comm, clean_env, monkeypatch):
    """Rank 0 rejects its buffers with timeout=inf while its peers never
    enter the call, so nobody tells it they are done: the failed call must
    still return, not wait forever.  (Network path, where end() lingers:
    MPILOSSY_RMA_SHM=0.  The failure path now uses the communicator's
    deadline, and end() caps its linger at 10 s whatever it is given.)"""
    monkeypatch.setenv("MPILOSSY_RMA_SHM", "0")
    took = 0.0
    with mpilossy.Communicator(comm, timeout=0.5, loss=None) as lc:
        assert lc._state.core.shared_peers == 0
        if comm.rank == 0:
            began = time.monotonic()
            with pytest.raises(ValueError):
                lc.allreduce(np.ones(4, np.float32), np.ones(5, np.float32),
                             timeout=float("inf"))
            took = time.monotonic() - began
        comm.Barrier()
    assert took < 30, f"the failed call waited {took:.1f} s"
