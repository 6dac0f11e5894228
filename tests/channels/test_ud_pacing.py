"""Pacing of the datagram channel (MPILOSSY_UD_RATE): each rank sends at
its share of its node's port rate, on both transports; a paced call that
runs out of time gives up what has not left and the next call is sound;
datagrams to ranks on the same node cost nothing.  The effect on a switch
port is measured on the emulated cluster (docs/ud.md, "Pacing"); here the
pacer itself is checked, every peer charged as if on another node
(PACE_LOCAL_FREE off) but in the last test."""

import time

import numpy as np
import pytest
from mpi4py import MPI

import mpilossy
from mpilossy import _core
from mpilossy.call import channel
from mpilossy.call.channel import PACE_SHARE
from helpers import mpi_sum, small_ints

pytestmark = pytest.mark.skipif(not _core.HAVE_DATAGRAM_AUTH,
                                reason="built without OpenSSL headers: channel='ud' absent")

PROVIDERS = ["udp", "native"]
RATE = 40e6                      # bits per second, per node


def ranks_on_this_node(comm: MPI.Intracomm) -> int:
    node = comm.Split_type(MPI.COMM_TYPE_SHARED)
    try:
        return node.Get_size()
    finally:
        node.Free()


def paced(comm, monkeypatch, provider, rate="40mbit", local_free=False, **kwargs):
    monkeypatch.setattr(channel, "PACE_LOCAL_FREE", local_free)
    monkeypatch.setenv("MPILOSSY_UD_PROVIDER", provider)
    monkeypatch.setenv("MPILOSSY_UD_RATE", rate)
    return mpilossy.Communicator(comm, channel="ud", **kwargs)


@pytest.mark.mpi
@pytest.mark.timeout(60)
@pytest.mark.parametrize("provider", PROVIDERS)
def test_each_rank_takes_its_share_of_the_node_rate(comm, monkeypatch, provider):
    with paced(comm, monkeypatch, provider) as lc:
        share = lc.channel_info()["pace_bytes_per_s"]
    assert share == pytest.approx(PACE_SHARE * RATE / 8 / ranks_on_this_node(comm))
    monkeypatch.setenv("MPILOSSY_UD_RATE", "none")
    with mpilossy.Communicator(comm, channel="ud") as lc:
        assert lc.channel_info()["pace_bytes_per_s"] == 0


@pytest.mark.mpi(min_size=2)
@pytest.mark.timeout(90)
@pytest.mark.parametrize("provider", PROVIDERS)
def test_a_paced_call_leaves_no_faster_than_the_rate(comm, monkeypatch, provider):
    """A lossless 1 MiB direct allreduce sends 2 (n-1)/n of the buffer per
    rank: paced, it cannot end before that many bytes left at the rate
    (less the first burst); unpaced on the loopback it takes milliseconds.
    The result is still exactly MPI's."""
    x = small_ints(1 << 18, comm.rank, np.float32)
    out = np.empty_like(x)
    with paced(comm, monkeypatch, provider, timeout=None) as lc:
        share = lc.channel_info()["pace_bytes_per_s"]
        comm.Barrier()
        start = time.perf_counter()
        stats = lc.allreduce(x, out, algorithm="direct")
        took = time.perf_counter() - start
    np.testing.assert_array_equal(out, mpi_sum(comm, x))
    assert stats.delivered == 1.0
    wire = 2 * (comm.size - 1) / comm.size * x.nbytes
    assert took >= 0.9 * (wire - 16384) / share, (took, wire / share)


@pytest.mark.mpi(min_size=2)
@pytest.mark.timeout(90)
@pytest.mark.parametrize("provider", PROVIDERS)
def test_a_paced_call_past_its_deadline_gives_up_what_has_not_left(comm, monkeypatch,
                                                                   provider):
    """At 8 Mbit/s a 1 MiB call needs about a second per rank; with a 0.2 s
    deadline it returns by the deadline with part of the contributions, what
    did not leave counted unsent (native: still queued at the end) or never
    sent, and the next call on the same channel is exact."""
    x = small_ints(1 << 18, comm.rank, np.float32)
    out = np.empty_like(x)
    with paced(comm, monkeypatch, provider, rate="8mbit") as lc:
        comm.Barrier()
        start = time.perf_counter()
        stats = lc.allreduce(x, out, algorithm="direct", timeout=0.2)
        took = time.perf_counter() - start
        info = lc.channel_info()
        assert took < 0.2 + 0.5, took
        assert stats.delivered < 1.0 and stats.deadline_hit, stats
        if provider == "native":
            assert info["unsent"] > 0, info
        small = small_ints(1000, comm.rank, np.float64)
        got = np.empty_like(small)
        lc.allreduce(small, got, timeout=None)
    np.testing.assert_array_equal(got, mpi_sum(comm, small))


@pytest.mark.parametrize("text, bits", [("1gbit", 1e9), ("800mbit", 800e6), ("10g", 10e9),
                                        ("2.5e9", 2.5e9), ("none", 0.0), ("0", 0.0)])
def test_rates_are_read_in_bits_per_second(text, bits):
    from mpilossy.call.environment import parse_rate
    assert parse_rate(text) == bits


@pytest.mark.parametrize("text", ["fast", "-1gbit", "1gbyte", "inf", "nan", "1e400"])
def test_bad_rates_are_refused(text):
    from mpilossy.call.environment import parse_rate
    with pytest.raises(ValueError):
        parse_rate(text)


@pytest.mark.mpi(min_size=2)
@pytest.mark.timeout(90)
@pytest.mark.parametrize("provider", PROVIDERS)
def test_datagrams_within_the_node_cost_nothing(comm, monkeypatch, provider):
    """Every rank of the suite's jobs is on one node: nothing crosses a
    port, so at 8 Mbit/s a 1 MiB direct allreduce takes what it takes
    unpaced, not the second per rank the rate would make it (the test
    above, with every peer charged)."""
    x = small_ints(1 << 18, comm.rank, np.float32)
    out = np.empty_like(x)
    with paced(comm, monkeypatch, provider, rate="8mbit", local_free=True, timeout=None) as lc:
        info = lc.channel_info()
        comm.Barrier()
        start = time.perf_counter()
        lc.allreduce(x, out, algorithm="direct")
        took = comm.allreduce(time.perf_counter() - start, op=MPI.MAX)
    np.testing.assert_array_equal(out, mpi_sum(comm, x))
    assert info["pace_free_peers"] == ranks_on_this_node(comm) == comm.size
    wire = 2 * (comm.size - 1) / comm.size * x.nbytes
    assert took < 0.25 * (wire - 16384) / info["pace_bytes_per_s"], took
