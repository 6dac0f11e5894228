"""Fake device memory for the GPU paths on machines without a GPU (the way
mpi4py tests its GPU paths): host arrays that present themselves through
__cuda_array_interface__, and copy backends that stand in for CuPy's."""

import ctypes
from collections import defaultdict

import numpy as np


class FakeDevice:
    """A host array that presents itself as device memory."""

    def __init__(self, array, readonly=False, stream=None, strides=None):
        self.array, self.readonly, self.stream, self.strides = array, readonly, stream, strides

    @property
    def __cuda_array_interface__(self):
        return {"shape": self.array.shape, "typestr": self.array.dtype.str,
                "data": (self.array.ctypes.data, self.readonly), "version": 3,
                "strides": self.strides, "stream": self.stream}


class HostCopies:
    """The copy backend, over host memory, copying at once; records what
    it did."""

    def __init__(self):
        self.pinned_calls, self.log = 0, []

    def pinned(self, nbytes):
        self.pinned_calls += 1
        return np.zeros(nbytes, np.uint8)

    def stream_of(self, buf):
        return 7 if buf.stream is None else buf.stream

    def to_host(self, host, buf, stream):
        ctypes.memmove(host.ctypes.data, buf.ptr, buf.nbytes)
        self.log.append(("to_host", stream))

    def to_device(self, buf, host, stream):
        ctypes.memmove(buf.ptr, host.ctypes.data, buf.nbytes)
        self.log.append(("to_device", stream))

    def synchronize(self, stream):
        self.log.append(("sync", stream))

    def event(self):
        return object()

    def record(self, event, stream):
        self.log.append(("record", stream))

    def wait_event(self, event):
        self.log.append(("wait",))


class QueuedCopies(HostCopies):
    """Copies that run only when something waits for them, as a GPU's run
    once their stream gets to them: queued per stream, carried out in order
    up to an event waited for, or all of them at a synchronisation.  Code
    that reads staged data before waiting for it reads stale bytes."""

    def __init__(self):
        super().__init__()
        self.queues = defaultdict(list)
        self.where = {}                     # event -> stream it was recorded on

    def to_host(self, host, buf, stream):
        self.queues[stream].append((host.ctypes.data, buf.ptr, buf.nbytes))
        self.log.append(("to_host", stream))

    def to_device(self, buf, host, stream):
        self.queues[stream].append((buf.ptr, host.ctypes.data, buf.nbytes))
        self.log.append(("to_device", stream))

    def record(self, event, stream):
        self.queues[stream].append(event)
        self.where[event] = stream
        self.log.append(("record", stream))

    def _run(self, stream, until=None):
        queue = self.queues[stream]
        while queue:
            op = queue.pop(0)
            if isinstance(op, tuple):
                ctypes.memmove(*op)
            elif op is until:
                return

    def wait_event(self, event):
        self._run(self.where[event], until=event)
        self.log.append(("wait",))

    def synchronize(self, stream):
        self._run(stream)
        self.log.append(("sync", stream))
