"""The datagram decoder, without a network: every datagram the channel
accepts is authentic (keyed MAC), well formed for its kind and addressed to
this call; everything else is dropped and counted, nothing is written out of
place, and a peer seen ahead is given up only after the reorder grace.

Needs no libfabric (the decoder is compiled without it), only the OpenSSL MAC."""

import time

import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from mpilossy import _core, _testing

pytestmark = pytest.mark.skipif(not _core.HAVE_DATAGRAM_AUTH,
                                reason="built without OpenSSL libcrypto: no datagram MAC")

KEY = bytes(range(16))
TOKEN, SEQ, SIG = 0x1234_5678_9ABC_DEF0, 42, 0xC0FFEE
STREAMS = [(1, 0), (2, 1), (3, 2)]          # (peer, slot) this rank reads
NSLOTS, NBLOCKS, BLOCK = 4, 3, 384     # BLOCK: the payload bound, >= ERROR_BYTES
HELLO_BYTES, ERROR_BYTES = 32, 328          # sizeof(mpl_hello_t), sizeof(mpl_error_t)


def judge():
    return _testing.DatagramJudge(KEY, TOKEN, 4, 0, SEQ, NSLOTS, NBLOCKS, BLOCK, SIG, STREAMS)


def datagram(src=1, slot=0, block=0, count=1, payload=b"\x01" * 64, seq=SEQ, token=TOKEN,
             sig=SIG, kind=_core.PKT_DATA, key=KEY):
    return _testing.encode_datagram(key, kind, token, seq, src, slot, block, count, sig, payload)


def error_record(kind=5, rank=1, msg=b"boom"):
    return (kind.to_bytes(4, "little", signed=True) + rank.to_bytes(4, "little")
            + msg.ljust(ERROR_BYTES - 8, b"\0"))


def nothing_placed(j):
    return not any(j.arrived(s, b)[0] for s in range(3) for b in range(NBLOCKS))


def test_valid_datagram_lands_where_it_belongs():
    j = judge()
    j.feed(datagram(src=2, slot=1, block=2, count=2, payload=b"\x07" * 100))
    assert j.arrived(1, 2) == (True, 2, b"\x07" * 100)
    assert not j.arrived(0, 2)[0] and j.guards_intact()


@pytest.mark.parametrize("bad,counter", [
    (dict(token=TOKEN + 1), "foreign"), (dict(src=0), "foreign"), (dict(src=4), "foreign"),
    (dict(key=bytes(16)), "forged"), (dict(key=KEY[:-1] + b"\xff"), "forged"),
    (dict(seq=SEQ - 1), "stale"), (dict(seq=SEQ + 2), "future"), (dict(sig=SIG + 1), "mismatch"),
    (dict(src=3, slot=0), "unexpected"), (dict(block=NBLOCKS), "unexpected"),
    (dict(payload=b"x" * (BLOCK + 1)), "malformed"), (dict(count=5), "unexpected"),
    (dict(kind=_core.PKT_END), "malformed"),
])
def test_each_kind_of_bad_datagram_is_dropped_and_counted(bad, counter):
    j = judge()
    j.feed(datagram(**bad))
    assert j.counters()[counter] == 1
    assert nothing_placed(j) and j.guards_intact()


def test_a_forged_datagram_changes_nothing_a_real_one_would():
    """With the wrong key: no data, no error, no mismatch, no peer seen ahead."""
    j = judge()
    wrong = bytes(16)
    j.feed(datagram(key=wrong, kind=_core.PKT_ERROR, payload=error_record()))
    j.feed(datagram(key=wrong, kind=_core.PKT_HELLO, payload=bytes(HELLO_BYTES)))
    j.feed(datagram(key=wrong, seq=SEQ + 10**9))
    assert j.counters()["forged"] == 3
    assert j.error == "" and j.peer_seen_in(1) == 0
    # With the key: a peer far ahead, and an error.
    j.feed(datagram(seq=SEQ + 10**9))
    assert j.peer_seen_in(1) == SEQ + 10**9
    j.feed(datagram(kind=_core.PKT_ERROR, payload=error_record()))
    assert "boom" in j.error


@pytest.mark.parametrize("kind,size", [
    (_core.PKT_ERROR, 0), (_core.PKT_ERROR, 8), (_core.PKT_ERROR, ERROR_BYTES - 1),
    (_core.PKT_ERROR, ERROR_BYTES + 1), (_core.PKT_HELLO, 8), (_core.PKT_HELLO, HELLO_BYTES + 8),
    (_core.PKT_NACK, 6), (_core.PKT_END, 4),
])
def test_control_datagrams_of_the_wrong_length_are_malformed(kind, size):
    """An ERROR is read as a whole error record only if it is exactly one."""
    j = judge()
    j.feed(datagram(kind=kind, payload=b"\x05" * size))
    assert j.counters()["malformed"] == 1
    assert j.error == "" and j.guards_intact()


def test_an_unknown_error_kind_fails_the_call_as_a_protocol_error():
    j = judge()
    j.feed(datagram(kind=_core.PKT_ERROR, payload=error_record(kind=1000)))
    assert j.error_kind == _core.ERRORS["protocol"]


def test_replay_and_next_call():
    j = judge()
    d = datagram()
    j.feed(d)
    j.feed(d)                                        # the same datagram again
    assert j.counters()["duplicate"] == 1
    j.feed(datagram(seq=SEQ + 1))                    # a peer that is ahead: kept for later
    assert j.stashed == 1


def test_truncated_and_corrupt():
    j = judge()
    d = datagram()
    for cut in (0, 1, 63, 64, len(d) - 1):
        j.feed(d[:cut])
    j.feed(d[:80] + bytes([d[80] ^ 1]) + d[81:])     # a payload bit
    j.feed(d[:20] + bytes([d[20] ^ 1]) + d[21:])     # a header bit (the call number)
    c = j.counters()
    assert c["truncated"] == 5 and c["forged"] == 2 and j.guards_intact()


def test_reordered_datagrams_of_a_peer_that_moved_on_are_still_taken():
    """FI_EP_DGRAM does not promise order: a peer's first datagram of the next
    call can overtake its last of this one.  The block is not given up at once."""
    j = judge()
    j.feed(datagram(src=1, seq=SEQ + 2, payload=b""))        # seen in a later call
    assert j.peer_seen_in(1) == SEQ + 2
    assert j.poll(0, 1) == "wait"                            # within the reorder grace
    j.feed(datagram(src=1, block=1, payload=b"\x09" * 32))   # the overtaken one
    assert j.poll(0, 1) == "ready"
    time.sleep(0.01)
    assert j.poll(0, 2) == "gone"                            # after the grace


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.binary(max_size=2048))
def test_fuzz_random_bytes(data):
    j = judge()
    j.feed(data)
    assert j.guards_intact()
    assert nothing_placed(j)


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(kind=st.integers(0, 6), seq=st.sampled_from([SEQ - 1, SEQ, SEQ + 1, SEQ + 2, 2**63]),
       payload=st.binary(max_size=BLOCK + 64), authentic=st.booleans())
def test_fuzz_every_kind_any_payload(kind, seq, payload, authentic):
    """Control datagrams of any length and call number, with and without the
    key: never a crash, never a write out of place; without the key, no effect."""
    j = judge()
    j.feed(datagram(kind=kind, seq=seq, payload=payload, key=KEY if authentic else bytes(16)))
    assert j.guards_intact()
    if not authentic:
        assert j.error == "" and j.peer_seen_in(1) == 0 and nothing_placed(j)


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(src=st.integers(0, 6), slot=st.integers(0, 5), block=st.integers(0, 5),
       count=st.integers(0, 6), size=st.integers(0, BLOCK + 64), flips=st.lists(
           st.tuples(st.integers(0, 4000), st.integers(0, 7)), max_size=3))
def test_fuzz_mutated_datagrams(src, slot, block, count, size, flips):
    """A datagram is placed only if it is intact and addressed to a stream of
    this call, and then exactly as sent; nothing is ever written out of place."""
    original = datagram(src=src, slot=slot, block=block, count=count,
                        payload=bytes((i * 7) & 255 for i in range(size)))
    data = bytearray(original)
    for at, bit in flips:
        if at < len(data):
            data[at] ^= 1 << bit
    j = judge()
    j.feed(bytes(data))
    assert j.guards_intact()
    placed = [(s, b) for s in range(3) for b in range(NBLOCKS) if j.arrived(s, b)[0]]
    legit = (bytes(data) == original and (src, slot) in STREAMS and block < NBLOCKS
             and size <= BLOCK and count <= 4)
    if legit:
        assert placed == [(STREAMS.index((src, slot)), block)]
        assert j.arrived(*placed[0])[1:] == (count, bytes(data[64:]))
    else:
        assert placed == []


def test_a_call_that_failed_to_begin_places_none_of_its_datagrams():
    """begin() raised (no memory for the call's buffers): fail() installs the
    call without its layout, so peers' datagrams of that call, laid out for
    far larger buffers than this rank holds, are refused as unexpected.
    Before: fail() installed the new layout over the old buffers and a DATA
    for block 500 of 1000 was written far past the inbox (issue 27, item 1)."""
    j = judge()
    j.fail_call(SEQ + 1, 4, 1000, 8192, SIG + 1)
    for block in (0, 2, 500, 999):
        j.feed(datagram(seq=SEQ + 1, src=1, slot=0, block=block, sig=SIG + 1,
                        payload=b"\x05" * 256))
    j.feed(datagram(seq=SEQ + 1, src=2, slot=1, kind=_core.PKT_END, payload=b"", sig=SIG + 1))
    counters = j.counters()
    assert counters["unexpected"] == 5 and j.stashed == 0, counters
    assert counters["duplicate"] == 0 and j.guards_intact()


@pytest.mark.parametrize("need", [1 << 40, 1 << 62])
def test_a_buffer_that_cannot_grow_stays_as_it_was(need):
    """Buffers grow by allocating first: a failure leaves the old memory and
    its recorded capacity in agreement (before: freed first, the old
    capacity kept, a later smaller call wrote through NULL)."""
    assert _testing.grow_refused(16, need) == (True, 16, True)
    assert _testing.grow_refused(16, 64) == (False, 64, True)


def nack(number, blocks, src=1, slot=0, seq=SEQ):
    payload = b"".join(b.to_bytes(4, "little") for b in blocks)
    return datagram(kind=_core.PKT_NACK, src=src, slot=slot, block=number, count=0,
                    payload=payload, seq=seq, sig=0)


def test_a_replayed_nack_makes_no_resends():
    """A NACK carries a number that grows with every NACK its sender sends
    in a call: one answered already (a capture replayed on the path) is not
    answered again.  Before: every replay resent the blocks it listed
    (issue 27, item 11)."""
    j = judge()
    j.hold_outbox(SEQ, NSLOTS, NBLOCKS)
    j.feed(nack(5, [0, 1, 2]))
    assert j.counters()["resent"] == 3
    for _ in range(100):
        j.feed(nack(5, [0, 1, 2]))
        j.feed(nack(4, [0]))
    counters = j.counters()
    assert counters["resent"] == 3 and counters["nacks_replayed"] == 200, counters
    j.feed(nack(6, [2]))                        # the sender's next one is answered
    j.feed(nack(1, [1], src=2))                 # numbers are per sender
    assert j.counters()["resent"] == 5


def test_a_nack_inside_a_waiting_send_waits_for_the_next_one():
    """Answering a NACK from inside a send that waits for room (drain ->
    accept -> answer -> send -> drain ...) would nest without bound: there
    it is left for the sender's next NACK (issue 27, item 11)."""
    j = judge()
    j.hold_outbox(SEQ, NSLOTS, NBLOCKS)
    j.set_draining(2)
    j.feed(nack(1, [0, 1]))
    assert j.counters()["resent"] == 0 and j.counters()["nacks_deferred"] == 1
    j.set_draining(1)                           # a drain at the top: answered
    j.feed(nack(2, [0, 1]))
    assert j.counters()["resent"] == 2


def test_mac_key_and_tag_sizes():
    assert _core.MAC_KEY_BYTES == len(KEY)
    with pytest.raises(ValueError):
        _testing.encode_datagram(b"short", _core.PKT_DATA, TOKEN, SEQ, 1, 0, 0, 1, SIG, b"")


# -- the same tests under AddressSanitizer ---------------------------------------------
@pytest.mark.timeout(1000)     # (a build beside the one-rank suite: its own bounds)
@pytest.mark.builds
def test_decoder_under_address_sanitizer(tmp_path):
    """Build the core with -fsanitize=address (meson's b_sanitize) and run this
    file's decoder tests, the quantiser's and, at 2 ranks, the weighted and
    float16 reductions with the ASan runtime preloaded: zero reports."""
    import os
    import subprocess
    import sys

    from helpers import HERE, build_package, importing_from, is_singleton, module_path, run_bounded

    if not is_singleton():
        pytest.skip("builds its own copy: runs at size 1")
    if os.environ.get("MPILOSSY_UNDER_ASAN"):
        pytest.skip("already under AddressSanitizer")
    libasan = subprocess.run(["cc", "-print-file-name=libasan.so"], capture_output=True,
                             text=True).stdout.strip()
    if not os.path.isabs(libasan) or not os.path.exists(libasan):
        pytest.skip("the C compiler has no AddressSanitizer runtime (libasan)")
    pkg = build_package(tmp_path, "-Db_sanitize=address", "-Db_lundef=false",
                        "-Dbuildtype=debugoptimized")
    env = importing_from(pkg, HERE, LD_PRELOAD=libasan,
                         ASAN_OPTIONS="detect_leaks=0:abort_on_error=1:allocator_may_return_null=1", MPILOSSY_UNDER_ASAN="1")
    proc = run_bounded([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                        "-k", "not address_sanitizer",
                        str(module_path("test_datagram_decoder.py")),
                        str(module_path("test_quant_kernels.py"))],
                       600, env, cwd=tmp_path)
    assert "AddressSanitizer" not in proc.stderr, proc.stderr[-4000:]
    assert proc.returncode == 0 and " passed" in proc.stdout, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "skipped" not in proc.stdout, proc.stdout[-2000:]
    from helpers import mpiexec
    proc = run_bounded([mpiexec(), "-n", "2", sys.executable, "-m", "pytest", "--with-mpi", "-q",
                        "-p", "no:cacheprovider", "-m", "mpi", "-k", "any_size or float16",
                        str(module_path("test_weighted.py")),
                        str(module_path("test_float16.py"))],
                       600, env, cwd=tmp_path)
    assert "AddressSanitizer" not in proc.stderr, proc.stderr[-4000:]
    assert proc.returncode == 0 and " passed" in proc.stdout, proc.stdout[-3000:] + proc.stderr[-3000:]
