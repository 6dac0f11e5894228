"""The background flows' processes on the nodes (cluster/background.py
starts them): a sink that reads and discards, and a source that sends to a
sink in on/off bursts.  Each exits after SECONDS.

    python flows.py sink PORT SECONDS
    python flows.py source HOST PORT ON_MS OFF_MS SEED SECONDS

(Run as a script: the standard library only, no MPI.)
"""

from __future__ import annotations

import os
import random
import socket
import sys
import threading
import time
from typing import Sequence

CHUNK = 256 * 1024          # bytes per send


def _sink(port: int, seconds: float) -> None:
    server = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    server.bind(("0.0.0.0", port))
    server.listen(64)
    ends = threading.Timer(seconds, os._exit, args=(0,))
    ends.daemon = True
    ends.start()

    def drain(conn: socket.socket) -> None:
        buf = bytearray(CHUNK)
        with conn:
            while conn.recv_into(buf):
                pass

    while True:
        conn, _ = server.accept()
        threading.Thread(target=drain, args=(conn,), daemon=True).start()


def _source(host: str, port: int, on: float, off: float, seed: int, seconds: float) -> None:
    end = time.monotonic() + seconds
    rng = random.Random(seed)
    while True:                     # the sink may start a moment later
        try:
            conn = socket.create_connection((host, port), timeout=1.0)
            break
        except OSError:
            if time.monotonic() > end:
                return
            time.sleep(0.05)
    payload = bytes(CHUNK)
    time.sleep(rng.uniform(0, on + off))          # the flows start out of step
    while time.monotonic() < end:
        until = time.monotonic() + rng.uniform(0.5, 1.5) * on
        while time.monotonic() < until:
            conn.settimeout(max(until - time.monotonic(), 1e-3))
            try:
                conn.send(payload)
            except socket.timeout:
                break
        time.sleep(rng.uniform(0.5, 1.5) * off)


def main(argv: Sequence[str]) -> int:
    if argv[:1] == ["sink"] and len(argv) == 3:
        _sink(int(argv[1]), float(argv[2]))
    elif argv[:1] == ["source"] and len(argv) == 7:
        _source(argv[1], int(argv[2]), float(argv[3]) / 1e3, float(argv[4]) / 1e3,
                int(argv[5]), float(argv[6]))
    else:
        print(__doc__, file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main(sys.argv[1:]))
    except (KeyboardInterrupt, BrokenPipeError, ConnectionError):
        sys.exit(0)
