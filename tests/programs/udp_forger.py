"""Throw garbage, forgeries and replays at live mpilossy endpoints, from
another process, for FORGER_SECONDS:

- random bytes of random length
- well-formed datagrams with a wrong communicator token
- forgeries: the right token, a wrong key (DATA, HELLO and ERROR datagrams,
  current and future call numbers; an ERROR that were believed would fail the
  call, a HELLO would raise a mismatch, a future call number would make the
  sender look gone)
- replays: authentic datagrams (made with the key, as a capture of the
  network would give them) of an earlier call, and duplicated
- authentic but malformed: an ERROR and a HELLO of the wrong length
- truncated and bit-flipped copies of authentic datagrams
- datagrams claiming an unknown source rank

usage: udp_forger.py KEYHEX TOKEN SEQ ADDR [ADDR ...]   (ADDR = ip:port on loopback)
"""

import os
import random
import socket
import sys
import time

from mpilossy import _core, _testing

key, token, seq = bytes.fromhex(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
wrong_key = bytes(b ^ 0x5A for b in key)
seconds = float(os.environ.get("FORGER_SECONDS", "2"))
targets = []
for a in sys.argv[4:]:
    host, port = a.rsplit(":", 1)
    assert host.startswith("127."), "loopback only"
    targets.append((host, int(port)))
rng = random.Random(1)
sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
sent = 0
end = time.monotonic() + seconds
D, H, E = _core.PKT_DATA, _core.PKT_HELLO, _core.PKT_ERROR
error_record = (5).to_bytes(4, "little") + (0).to_bytes(4, "little") + b"forged".ljust(200, b"\0")
hello_record = bytes(32)
while time.monotonic() < end:
    payload = bytes(rng.getrandbits(8) for _ in range(rng.choice([8, 64, 512])))
    now_seq = seq + int((time.monotonic() - end + seconds) * 200)   # roughly where the ranks are
    authentic = _testing.encode_datagram(key, D, token, max(seq - 1, 1), 0, 0, 0, 1, 0, payload)
    choices = [
        bytes(rng.getrandbits(8) for _ in range(rng.randint(0, 1500))),
        _testing.encode_datagram(key, D, token ^ 0xDEADBEEF, seq, 0, 0, 0, 1, 0, payload),
        _testing.encode_datagram(wrong_key, D, token, now_seq, 0, 0, 0, 1, 0, payload),
        _testing.encode_datagram(wrong_key, D, token, now_seq + 10**6, 1, 0, 0, 1, 0, payload),
        _testing.encode_datagram(wrong_key, E, token, now_seq, 0, 0, 0, 0, 0, error_record),
        _testing.encode_datagram(wrong_key, H, token, now_seq, 1, 0, 0, 0, 0, hello_record),
        authentic,                                                      # replayed, stale call
        _testing.encode_datagram(key, E, token, now_seq, 0, 0, 0, 0, 0, error_record[:20]),
        _testing.encode_datagram(key, H, token, now_seq, 1, 0, 0, 0, 0, hello_record[:8]),
        authentic[: rng.randint(0, len(authentic) - 1)],                # truncated
        authentic[:70] + bytes([authentic[70] ^ 0xFF]) + authentic[71:],  # bit-flipped
        _testing.encode_datagram(key, D, token, seq, 999, 0, 0, 1, 0, payload),   # unknown rank
    ]
    pick = rng.choice(choices)
    for target in targets:
        for _ in range(rng.choice([1, 1, 2])):                         # sometimes twice
            sock.sendto(pick, target)
            sent += 1
    time.sleep(0.0005)
print(f"forger sent {sent} datagrams", flush=True)
