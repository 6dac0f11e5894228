"""The elastic membership's messages (heartbeats, the agreement's rounds,
OUT): small authenticated UDP datagrams for a job across nodes, MPI
messages for a job on one node.

An MPI send to a rank that has exited is not harmless on MPICH's netmods:
it crashed the sender over UCX and hung it, rarely, over libfabric's tcp
provider (docs/elastic.md).  A datagram to a rank that is gone is simply
lost, and what must arrive is sent again until it is no longer needed.
Within one node MPICH moves MPI messages through shared memory, where such
a send is harmless, at a fifth of a datagram's cost on the test machine
(its wakeups of oversubscribed ranks): MpiSignals there.

Each rank binds one socket for the membership's life; the addresses travel
by MPI allgather when the membership binds to a communicator (collective,
among ranks that are alive), the key by MPI broadcast from rank 0 at the
start.  A datagram is a header (magic, tag, epoch, sender, a number, the
words of two rank bitmaps), the bitmaps, and an HMAC-SHA256 tag (16
bytes) under the key: foreign, forged and malformed datagrams are dropped
and counted."""

from __future__ import annotations

import hashlib
import hmac
import os
import pickle
import socket
import struct
from typing import FrozenSet, Iterable, List, NamedTuple, Optional, Tuple, Union

from mpi4py import MPI

__all__ = ["Signal", "Signals", "MpiSignals", "signals_for"]

MAGIC = b"MLMB"
HEAD = struct.Struct("<4sBIIqH")        # magic, tag, epoch, sender, number, words per bitmap
MAC_BYTES = 16
RECEIVE_BUFFER = 1 << 20                # (a stopped rank's heartbeats wait here)

Address = Tuple[str, int]


class Signal(NamedTuple):
    """One datagram, checked."""
    sender: int
    tag: int
    epoch: int
    number: int
    first: FrozenSet[int]
    second: FrozenSet[int]
    address: Address


class Signals:
    """One rank's control socket.  Construction and bind() are collective."""

    # (datagrams may be lost: a round's message is sent again until its peers
    # confirm it (ACK, Membership._round); a rank that stopped reading costs its
    # senders nothing, the kernel drops)
    reliable = False

    def __init__(self, comm: MPI.Intracomm) -> None:
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        try:
            self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, RECEIVE_BUFFER)
            self.sock.bind(("0.0.0.0", 0))
            self.sock.setblocking(False)
        except OSError:
            self.sock.close()
            raise
        self._key = os.urandom(32)
        self.dropped = 0                    # foreign, forged or malformed datagrams
        self.addresses: List[Address] = []
        self.rank = self.size = self.words = 0
        self.bind(comm)

    def bind(self, comm: MPI.Intracomm) -> None:
        """Collective over `comm`: learn every rank's address and rank 0's
        key (a spare called in learns the survivors'); ranks are `comm`'s
        from now on."""
        self._key = comm.bcast(self._key if comm.Get_rank() == 0 else None, root=0)
        self._keyed = hmac.new(self._key, digestmod=hashlib.sha256)     # (copied per datagram)
        name = MPI.Get_processor_name()
        names = comm.allgather(name)
        host = "127.0.0.1" if all(n == name for n in names) else _address_of(name)
        self.addresses = comm.allgather((host, self.sock.getsockname()[1]))
        self.rank, self.size = comm.Get_rank(), comm.Get_size()
        self.words = (self.size + 63) // 64

    def close(self) -> None:
        self.sock.close()

    def send(self, dest: int, tag: int, epoch: int, number: int = 0,
             first: Iterable[int] = (), second: Iterable[int] = ()) -> None:
        self.send_to(self.addresses[dest], tag, epoch, number, first, second)

    def send_to(self, address: Address, tag: int, epoch: int, number: int = 0,
                first: Iterable[int] = (), second: Iterable[int] = ()) -> None:
        first, second = tuple(first), tuple(second)
        # (a message naming no ranks, a heartbeat or a confirmation, carries no
        # bitmaps: its size does not grow with the job)
        words = self.words if first or second else 0
        body = (HEAD.pack(MAGIC, tag, epoch, self.rank, number, words)
                + _bitmap(first, words) + _bitmap(second, words))
        try:
            self.sock.sendto(body + self._mac(body), address)
        except OSError:         # (a peer that is gone, a full buffer: lost, sent again later)
            pass

    def receive(self) -> List[Signal]:
        """Every datagram waiting, checked; the rest dropped and counted."""
        found: List[Signal] = []
        while True:
            try:
                data, address = self.sock.recvfrom(65536)
            except (BlockingIOError, InterruptedError):
                return found
            except OSError:
                return found
            signal = self._check(data, address)
            if signal is None:
                self.dropped += 1
            else:
                found.append(signal)

    def _mac(self, body: bytes) -> bytes:
        keyed = self._keyed.copy()
        keyed.update(body)
        return keyed.digest()[:MAC_BYTES]

    def _check(self, data: bytes, address: Address) -> Optional[Signal]:
        if len(data) < HEAD.size + MAC_BYTES or not data.startswith(MAGIC):
            return None
        body, mac = data[:-MAC_BYTES], data[-MAC_BYTES:]
        if not hmac.compare_digest(mac, self._mac(body)):
            return None
        _, tag, epoch, sender, number, words = HEAD.unpack_from(body)
        if len(body) != HEAD.size + 16 * words:
            return None
        first = _ranks(body[HEAD.size:HEAD.size + 8 * words])
        second = _ranks(body[HEAD.size + 8 * words:])
        return Signal(sender, tag, epoch, number, first, second, address)


def _address_of(name: str) -> str:
    try:
        return socket.gethostbyname(name)
    except OSError:
        return socket.gethostbyname(socket.gethostname())


def _bitmap(ranks: Iterable[int], words: int) -> bytes:
    bits = 0
    for r in ranks:
        bits |= 1 << r
    return bits.to_bytes(8 * words, "little")


def _ranks(data: bytes) -> FrozenSet[int]:
    bits = int.from_bytes(data, "little")
    return frozenset(r for r in range(8 * len(data)) if bits >> r & 1)


class MpiSignals:
    """The same interface over MPI point-to-point (pickled, on a duplicate
    of the communicator whose sends never block), for a job on one node.
    A rank excluded and woken reads its OUT message once, on the old
    duplicate; nothing there is sent again."""

    # (every message arrives, once: nothing is sent again.  A message that
    # its receiver has not read holds one of the sender's shared-memory
    # cells, and once they are all held MPI postpones the sender's sends to
    # every peer: Membership bounds what a rank that stopped reading has
    # unread)
    reliable = True
    dropped = 0

    def __init__(self, comm: MPI.Intracomm) -> None:
        self._left: List[object] = []       # duplicates of earlier communicators, and sends
        self.ctl: Optional[MPI.Intracomm] = None
        self.bind(comm)

    def bind(self, comm: MPI.Intracomm) -> None:
        if self.ctl is not None:
            # (freeing it is collective over ranks that are gone; its sends in flight
            # (an OUT to a stopped rank) need their requests and data until they leave)
            self._left.append((self.ctl, self.sends))
        ctl = self.ctl = comm.Dup()
        ctl.Set_errhandler(MPI.ERRORS_RETURN)
        self.rank, self.size = ctl.Get_rank(), ctl.Get_size()
        # (addresses name the duplicate too: ranks are numbered again after an exclusion)
        self._name = f"mpi-{len(self._left)}"
        self.addresses: List[Address] = [(self._name, r) for r in range(self.size)]
        self.sends: List[MPI.Request] = []

    def close(self) -> None:
        """(Nothing: the duplicate is freed with the process.)"""

    def send(self, dest: int, tag: int, epoch: int, number: int = 0,
             first: Iterable[int] = (), second: Iterable[int] = ()) -> None:
        assert self.ctl is not None
        try:
            self.sends.append(self.ctl.isend((epoch, number, frozenset(first),
                                              frozenset(second)), dest, tag))
        except MPI.Exception:       # a peer that is gone: it needs to hear nothing
            pass

    def send_to(self, address: Address, tag: int, epoch: int, number: int = 0,
                first: Iterable[int] = (), second: Iterable[int] = ()) -> None:
        self.send(address[1], tag, epoch, number, first, second)

    def receive(self) -> List[Signal]:
        found: List[Signal] = []
        status = MPI.Status()
        assert self.ctl is not None
        try:
            while self.ctl.iprobe(MPI.ANY_SOURCE, MPI.ANY_TAG, status):
                source, tag = status.Get_source(), status.Get_tag()
                try:
                    epoch, number, first, second = self.ctl.recv(source=source, tag=tag)
                except (pickle.UnpicklingError, EOFError, ValueError, TypeError):
                    # Not a signal: a message left on a freed communicator whose
                    # context MPI gave to this duplicate.  Taken off, ignored.
                    continue
                found.append(Signal(source, tag, epoch, number, first, second,
                                    (self._name, source)))
        except MPI.Exception:
            pass
        still = []
        for request in self.sends:
            try:
                if not request.Test():
                    still.append(request)
            except MPI.Exception:
                pass
        self.sends = still
        return found


def signals_for(comm: MPI.Intracomm, across_nodes: bool) -> "Union[Signals, MpiSignals]":
    """Collective: datagrams for a job across nodes, MPI on one node."""
    return Signals(comm) if across_nodes else MpiSignals(comm)
