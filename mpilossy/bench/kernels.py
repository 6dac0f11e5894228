"""``python -m mpilossy.bench kernels``: the reduction kernels against the
machine's memory bandwidth, measured in the same run as a plain copy
(np.copyto) of the same size.

Bandwidth counts the bytes each operation must move: a copy reads one array
and writes one (2 x size), an add reads two and writes one (3 x size), an
accumulate reads two and writes one (3 x size), a scale reads one and writes
one (2 x size).  efficiency = kernel bandwidth / copy bandwidth.

`--mac` also measures the datagram channel's authentication: seal and check
(two SipHash MACs) per datagram of the udp provider's and of InfiniBand UD's
payload, as datagrams per second and GB/s of payload, against np.copyto of
the same payload.

`--quant` measures the low-bit payload kernels (compression="int8"/"int4"):
quantise (read 4 bytes per value, write the codes and scales) and
dequantise-add (read the codes and 4 bytes, write 4), in float32 values per
second and GB/s of float32 data, against np.copyto of the float32 data.

`--fec` measures the erasure-code kernels of redundancy=(k, m): encode (the
m parity blocks of a group of k data blocks) and decode (rebuild two lost
data blocks, one where m = 1), in GB/s of the group's data bytes on one
core, against np.copyto of those bytes.  m >= 2 needs Intel ISA-L."""

from __future__ import annotations

import argparse
import sys
import time
from typing import Callable, Dict, TypedDict

import numpy as np

from mpilossy import _core

from .harness import parse_sizes

STREAMS = {"copy": 2, "add": 3, "acc": 3, "scale": 2, "add_scale": 3}


def best_of(fn: Callable[[], object], repeat: int) -> float:
    best = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


class Measured(TypedDict):
    bytes: int
    dtype: str
    gbs: Dict[str, float]               # operation: GB/s
    efficiency: Dict[str, float]        # kernel: its GB/s / the copy's


def measure(nbytes: int, dtype: str, repeat: int) -> Measured:
    n = nbytes // np.dtype(dtype).itemsize
    a = np.ones(n, dtype)
    b = np.full(n, 2, dtype)
    dst = np.empty(n, dtype)
    ops: Dict[str, Callable[[], object]] = {
        "copy": lambda: np.copyto(dst, a),
        "add": lambda: _core.kernel("add", dst, a, b),
        "acc": lambda: _core.kernel("acc", dst, a),
        "scale": lambda: _core.kernel("scale", dst, a, scale=0.25),
        "add_scale": lambda: _core.kernel("add_scale", dst, a, b, scale=0.25),
    }
    # Interleave the operations so that load changes hit all alike.
    best = {name: float("inf") for name in ops}
    for _ in range(repeat):
        for name, fn in ops.items():
            best[name] = min(best[name], best_of(fn, 1))
    gbs = {name: STREAMS[name] * nbytes / best[name] / 1e9 for name in ops}
    return {"bytes": nbytes, "dtype": dtype, "gbs": gbs,
            "efficiency": {k: gbs[k] / gbs["copy"] for k in ops if k != "copy"}}


def copies(dst: np.ndarray, src: np.ndarray, times: int) -> None:
    for _ in range(times):
        np.copyto(dst, src)


def print_mac_cost(count: int = 200_000) -> None:
    print(f"# datagram MAC (SipHash-2-4, 128-bit tag): seal + check per datagram, {count} datagrams")
    print("#  payload   us/datagram   Mdatagrams/s   payload GB/s   copy GB/s   MAC/copy")
    for payload in (1408, 3968, 8192):
        seconds = min(_core.mac_seconds(payload, count) for _ in range(3))
        a = np.ones(payload, np.uint8)
        dst = np.empty_like(a)
        copy = best_of(lambda: copies(dst, a, 10_000), 3) / 10_000
        gbs = payload * count / seconds / 1e9
        print(f"{payload:10d} {1e6 * seconds / count:13.3f} {count / seconds / 1e6:14.2f} "
              f"{gbs:14.2f} {payload / copy / 1e9:11.2f} {gbs / (payload / copy / 1e9):10.3f}")


def print_quant_cost(sizes: list, repeat: int, group: int = 64) -> None:
    print(f"# low-bit payload kernels (group {group}), best of {repeat}: GB/s of float32 "
          f"values, and / np.copyto of them")
    print("#      bytes   copy GB/s   q8 GB/s   /copy   dq8+ GB/s   /copy   q4 GB/s   /copy "
          "  dq4+ GB/s   /copy")
    for size in sizes:
        n = size // 4
        x = np.random.default_rng(0).standard_normal(n).astype(np.float32)
        acc = np.zeros(n, np.float32)
        dst = np.empty_like(x)
        line = [f"{size:12d}"]
        copy = best_of(lambda: np.copyto(dst, x), repeat)
        line.append(f"{size / copy / 1e9:11.1f}")
        for bits in (8, 4):
            coded = np.empty(_core.quant_bytes(n, group, bits), np.uint8)
            q = best_of(lambda: _core.quant_kernel("quantize", coded, x, bits, group), repeat)
            d = best_of(lambda: _core.quant_kernel("dequantize_add", acc, coded, bits, group),
                        repeat)
            for seconds in (q, d):
                line.append(f"{size / seconds / 1e9:9.1f} {copy / seconds:7.2f}")
        print(" ".join(line))


FEC_CODES = ((4, 1), (8, 1), (16, 1), (4, 2), (8, 2), (16, 2), (16, 4))


def print_fec_cost(sizes: list, repeat: int) -> None:
    """Erasure-code kernels (redundancy=(k, m)): encode the m parity blocks of
    k data blocks, and rebuild min(m, 2) lost data blocks; GB/s of the
    group's data bytes, one core, against np.copyto of the same bytes."""
    print(f"# erasure-code kernels, best of {repeat}: GB/s of data bytes (k blocks), "
          "and / np.copyto of them")
    print("#      bytes    k  m   copy GB/s   encode GB/s   /copy   decode GB/s   /copy   lost")
    for size in sizes:
        for k, m in FEC_CODES:
            if _core.fec_check(k, m) is not None:
                print(f"{size:12d} {k:4d} {m:2d}   not built: {_core.fec_check(k, m)}")
                continue
            length = max(64, size // k)
            group = np.random.default_rng(k + m).integers(0, 256, (k + m) * length, np.uint8)
            data = group[:k * length]
            dst = np.empty_like(data)
            copy = best_of(lambda: np.copyto(dst, data), repeat)
            encode = best_of(lambda: _core.fec_kernel("encode", group, k, m), repeat)
            lost = min(m, 2)
            present = np.ones(k + m, np.uint8)
            present[:lost] = 0          # the first data blocks lost (rebuilt in place)
            decode = best_of(lambda: _core.fec_kernel("decode", group, k, m, present), repeat)
            nbytes = k * length
            print(f"{nbytes:12d} {k:4d} {m:2d} {nbytes / copy / 1e9:11.1f} "
                  f"{nbytes / encode / 1e9:13.1f} {copy / encode:7.2f} "
                  f"{nbytes / decode / 1e9:13.1f} {copy / decode:7.2f} {lost:6d}")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--sizes", default="256K,4M,64M")
    p.add_argument("-d", "--dtype", default="float32")
    p.add_argument("-r", "--repeat", type=int, default=20)
    p.add_argument("--mac", action="store_true",
                   help="also the cost of authenticating datagrams (channel='ud')")
    p.add_argument("--quant", action="store_true",
                   help="also the low-bit payload kernels (compression='int8'/'int4')")
    p.add_argument("--fec", action="store_true",
                   help="also the erasure-code kernels (encode and rebuild, k data and "
                        "m parity blocks per group)")


def run(args: argparse.Namespace) -> int:
    if args.mac:
        print_mac_cost()
    if args.quant:
        print_quant_cost(parse_sizes(args.sizes), args.repeat)
    if args.fec:
        print_fec_cost(parse_sizes(args.sizes), args.repeat)
    print(f"# reduction kernels vs np.copyto, {args.dtype}, best of {args.repeat}")
    print("#      bytes   copy GB/s    add GB/s  eff   acc GB/s  eff  scale GB/s  eff "
          " add_scale GB/s  eff")
    for size in parse_sizes(args.sizes):
        r = measure(size, args.dtype, args.repeat)
        g, e = r["gbs"], r["efficiency"]
        print(f"{size:12d} {g['copy']:11.1f} {g['add']:11.1f} {e['add']:4.2f} {g['acc']:10.1f} "
              f"{e['acc']:4.2f} {g['scale']:11.1f} {e['scale']:4.2f} {g['add_scale']:15.1f} "
              f"{e['add_scale']:4.2f}")
    return 0


if __name__ == "__main__":          # the old spelling: python -m mpilossy.bench.kernels
    from .__main__ import main
    sys.exit(main(["kernels", *sys.argv[1:]]))
