"""The elastic membership's datagrams (mpilossy/control/signals.py), on one
rank talking to itself: what is sent arrives intact; foreign, forged,
truncated and malformed datagrams are dropped and counted, never
mistaken for a message."""

import socket
import time

import pytest
from mpi4py import MPI

from mpilossy.control.signals import HEAD, MAC_BYTES, MAGIC, MpiSignals, Signals


@pytest.fixture
def signals():
    s = Signals(MPI.COMM_SELF)
    yield s
    s.close()


def received(s, count=1, wait=2.0):
    found, ends = [], time.monotonic() + wait
    while len(found) < count and time.monotonic() < ends:
        found += s.receive()
        time.sleep(0.001)
    return found


def raw(s, data):
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as out:
        out.sendto(data, s.addresses[0])


def test_a_datagram_arrives_intact(signals):
    signals.send(0, 3, 7, 12345, {0, 5, 63}, {1})
    (signal,) = received(signals)
    assert (signal.sender, signal.tag, signal.epoch, signal.number) == (0, 3, 7, 12345)
    assert signal.first == {0, 5, 63} and signal.second == {1}
    assert signals.dropped == 0


def test_foreign_forged_and_malformed_datagrams_are_dropped(signals):
    other = Signals(MPI.COMM_SELF)          # (another job: another key)
    try:
        other.send_to(signals.addresses[0], 2, 0, 1, {0})
    finally:
        other.close()
    body = HEAD.pack(MAGIC, 2, 0, 0, 1, 1) + bytes(16)
    # a forged tag: one bit flipped (a fixed last byte was the right one once in 256 runs)
    mac = signals._mac(body)
    raw(signals, body + mac[:-1] + bytes([mac[-1] ^ 1]))
    raw(signals, b"hello, not ours")                           # foreign
    raw(signals, (body + signals._mac(body))[:HEAD.size])      # truncated
    short = HEAD.pack(MAGIC, 2, 0, 0, 1, 3) + bytes(16)        # words disagree with its length
    raw(signals, short + signals._mac(short))
    signals.send(0, 4, 0, 9)                                   # then a good one
    found = received(signals)
    assert [s.tag for s in found] == [4] and found[0].number == 9
    assert signals.dropped == 5


def test_mpi_signals_carry_the_same(comm=MPI.COMM_SELF):
    s = MpiSignals(comm)
    s.send(0, 2, 1, 42, {0}, set())
    (signal,) = received(s)
    assert (signal.tag, signal.epoch, signal.number, signal.first) == (2, 1, 42, {0})


def test_the_mac_is_16_bytes(signals):
    assert len(signals._mac(b"x")) == MAC_BYTES == 16
