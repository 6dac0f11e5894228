"""Throw garbage and forged datagrams at live mpilossy endpoints, from
another process, for `--seconds`:

- random bytes of random length
- well-formed datagrams with a wrong communicator token
- datagrams with the right token but an earlier call number (a replay)
- truncated and checksum-broken copies of well-formed datagrams
- datagrams claiming an unknown source rank

usage: udp_forger.py TOKEN SEQ ADDR [ADDR ...]   (ADDR = ip:port on loopback)
"""

import os
import random
import socket
import sys
import time

from mpilossy import _core

token, seq = int(sys.argv[1]), int(sys.argv[2])
seconds = float(os.environ.get("FORGER_SECONDS", "2"))
targets = []
for a in sys.argv[3:]:
    host, port = a.rsplit(":", 1)
    assert host.startswith("127."), "loopback only"
    targets.append((host, int(port)))
rng = random.Random(1)
sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
sent = 0
end = time.monotonic() + seconds
while time.monotonic() < end:
    payload = bytes(rng.getrandbits(8) for _ in range(rng.choice([8, 64, 512])))
    valid = _core.encode_datagram(_core.PKT_DATA, token, max(seq - 1, 1), 0, 0, 0, 1, 0, payload)
    choices = [
        bytes(rng.getrandbits(8) for _ in range(rng.randint(0, 1500))),
        _core.encode_datagram(_core.PKT_DATA, token ^ 0xDEADBEEF, seq, 0, 0, 0, 1, 0, payload),
        valid,                                                          # replayed, stale call
        valid[: rng.randint(0, len(valid) - 1)],                        # truncated
        valid[:70] + bytes([valid[70] ^ 0xFF]) + valid[71:],            # corrupt
        _core.encode_datagram(_core.PKT_DATA, token, seq, 999, 0, 0, 1, 0, payload),   # unknown rank
    ]
    for target in targets:
        sock.sendto(rng.choice(choices), target)
        sent += 1
    time.sleep(0.0005)
print(f"forger sent {sent} datagrams", flush=True)
