"""The corpus: the Python standard library's own .py sources, which every
machine that runs Python has offline.  Bytes are the tokens (vocabulary 256).

The split is by top-level module, fixed by a hash of its name: a module
whose CRC-32 is 0 modulo 10 is validation, every other one is training, so
no file is in both and the split does not depend on file order.  Test
suites, the IDE and the Tk demos are left out (they dwarf the rest).  The
corpus is that of the running Python (3.11 here: about 10.8 MB, 644 files).
"""

from __future__ import annotations

import pathlib
import sysconfig
import zlib
from typing import List, NamedTuple, Set

import numpy as np

__all__ = ["Corpus", "load", "VOCAB"]

VOCAB = 256
LEFT_OUT = ("site-packages", "test", "idlelib", "lib2to3", "tkinter", "turtledemo", "ensurepip")


class Corpus(NamedTuple):
    train: np.ndarray       # uint8 tokens
    val: np.ndarray
    train_modules: int
    val_modules: int


def module_of(path: pathlib.Path, root: pathlib.Path) -> str:
    first = path.relative_to(root).parts[0]
    return first[:-3] if first.endswith(".py") else first


def is_validation(module: str) -> bool:
    return zlib.crc32(module.encode()) % 10 == 0


def load(root: str = "") -> Corpus:
    base = pathlib.Path(root or sysconfig.get_paths()["stdlib"])
    # the left-out folders are not walked at all (site-packages alone can
    # hold tens of thousands of files)
    files = sorted(p for top in base.iterdir() if not top.name.startswith(LEFT_OUT)
                   for p in ([top] if top.is_file() else top.rglob("*.py"))
                   if p.suffix == ".py")
    if not files:
        raise FileNotFoundError(f"no Python sources under {base}")
    train: List[bytes] = []
    val: List[bytes] = []
    train_mods: Set[str] = set()
    val_mods: Set[str] = set()
    for path in files:
        module = module_of(path, base)
        (val if is_validation(module) else train).append(path.read_bytes())
        (val_mods if is_validation(module) else train_mods).add(module)
    return Corpus(np.frombuffer(b"\n".join(train), dtype=np.uint8),
                  np.frombuffer(b"\n".join(val), dtype=np.uint8),
                  len(train_mods), len(val_mods))
