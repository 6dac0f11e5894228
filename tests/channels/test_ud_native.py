"""The datagram channel on mpilossy's own UDP sockets (provider "native":
sendmmsg/recvmmsg batches, UDP segmentation offload): the tests of
test_ud.py again, with this transport, plus what is its own."""

import os

import numpy as np
import pytest

import mpilossy
from mpilossy import _core
from helpers import mpi_sum, small_ints
from test_ud import (dropping_namespace, test_channel_info,  # noqa: F401 (collected here again)
                     test_garbage_and_forged_datagrams_are_dropped_and_counted,
                     test_injected_loss_is_unbiased, test_lossless_equals_mpi,
                     test_mismatch_and_local_errors_reach_every_rank, test_real_kernel_drops,
                     test_reduce_scatter_and_allgather, test_sleeping_rank_is_left_out, udc)

pytestmark = pytest.mark.skipif(not _core.HAVE_DATAGRAM_AUTH,
                                reason="built without OpenSSL headers: channel='ud' absent")


@pytest.fixture(scope="module", autouse=True)
def provider():
    """Every communicator of this module uses the native transport."""
    before = os.environ.get("MPILOSSY_UD_PROVIDER")
    os.environ["MPILOSSY_UD_PROVIDER"] = "native"
    yield "native"
    if before is None:
        del os.environ["MPILOSSY_UD_PROVIDER"]
    else:
        os.environ["MPILOSSY_UD_PROVIDER"] = before


@pytest.mark.mpi(min_size=2)
def test_datagrams_leave_in_batches(comm, udc):
    """Several datagrams per system call (libfabric's udp provider: one).
    The average per call depends on timing (a send the kernel refuses for a
    full socket buffer is a call too), so the check is on the largest batch."""
    before = udc.channel_info()
    x = small_ints(1 << 20, comm.rank, np.float32)
    out = np.empty_like(x)
    udc.allreduce(x, out, algorithm="direct")
    np.testing.assert_array_equal(out, mpi_sum(comm, x))
    after = udc.channel_info()
    sent = after["transport_sent"] - before["transport_sent"]
    calls = after["send_calls"] - before["send_calls"]
    assert sent >= 2 * (comm.size - 1) * (4 << 20) // (comm.size * after["datagram_payload"])
    assert 0 < calls < sent
    assert after["largest_send_batch"] >= 8, after     # a segmented run is up to 64


@pytest.mark.mpi
def test_auto_picks_ud_when_native_is_asked_for(comm):
    with mpilossy.Communicator(comm, channel="auto", timeout=None) as lc:
        assert lc.channel_info()["channel"] == "ud"
        assert lc.channel_info()["provider"] == "native"


@pytest.mark.mpi
def test_an_unknown_interface_is_refused_on_every_rank(comm, monkeypatch):
    from helpers import all_ranks_raise
    monkeypatch.setenv("MPILOSSY_UD_DOMAIN", "no-such-interface0")
    message = all_ranks_raise(comm, lambda: mpilossy.Communicator(comm, channel="ud"),
                              mpilossy.MPILossyError)
    assert "no-such-interface0" in message, message


@pytest.mark.mpi(min_size=2)
def test_receive_offload_merges_and_splits_datagrams(comm, udc):
    """UDP_GRO: the kernel hands over several datagrams of one sender in one
    message (on loopback, a segmented message is never cut at all), and the
    transport splits them into its posted buffers: fewer messages than
    datagrams, the same exact result."""
    info = udc.channel_info()
    if not info["receive_offload"]:
        pytest.skip("the kernel refused UDP_GRO (Linux >= 5.0 has it)")
    x = small_ints(1 << 20, comm.rank, np.float32)
    out = np.empty_like(x)
    before = udc.channel_info()
    for algorithm in ("direct", "ring", "tree"):
        udc.allreduce(x, out, algorithm=algorithm)
        np.testing.assert_array_equal(out, mpi_sum(comm, x))
    after = udc.channel_info()
    datagrams = after["transport_received"] - before["transport_received"]
    messages = after["received_messages"] - before["received_messages"]
    merged = comm.allreduce(datagrams - messages)
    assert 0 < messages <= datagrams
    assert merged > 0, (datagrams, messages)


@pytest.mark.mpi
def test_offload_can_be_turned_off(comm, monkeypatch):
    """MPILOSSY_UD_OFFLOAD=0: one datagram per message each way, exact."""
    monkeypatch.setenv("MPILOSSY_UD_OFFLOAD", "0")
    x = small_ints(1 << 18, comm.rank, np.float32)
    out = np.empty_like(x)
    with mpilossy.Communicator(comm, channel="ud", timeout=None) as lc:
        lc.allreduce(x, out)
        np.testing.assert_array_equal(out, mpi_sum(comm, x))
        info = lc.channel_info()
    assert info["receive_offload"] is False
    assert info["received_messages"] == info["transport_received"]
