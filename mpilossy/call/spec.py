"""One call, resolved: the per-call arguments of a collective (op, weight,
compression, residual, timeout, algorithm, redundancy) checked against the
communicator's config and the call's buffers, into one `CallSpec` that the
three collectives share and the core runs."""

from __future__ import annotations

import numbers
import math
from typing import Any, Optional

import numpy as np

from .._core import ALLGATHER, AVG, DIRECT, PART_WHOLE, REDUCE_SCATTER, SUM, CallSpec
from ..control.deadline import AutoDeadline, size_bucket
from ..control.redundancy import AutoRedundancy
from .config import AUTO, COMPRESSIONS, UNSET, Config, check_algorithm, check_compression, \
    check_redundancy, check_timeout, core_timeout
from .dtypes import DTYPE_CODES, is_float
from .plan import TREE_MAX_BYTES, flat_algorithm, tree_max_bytes
from .request import Request

__all__ = ["CallSpec", "CallResolver", "asks_for_auto", "check_residual", "TREE_MAX_BYTES"]

OPS = {"sum": SUM, "avg": AVG}
# What is gone of a call's deadline when a call (or a pipeline's segment)
# starts comes out of it, down to this share of the deadline (shared by
# the segments of a pipelined call): a pipelined call ends within
# (1 + FLOOR_SHARE) times its deadline.
FLOOR_SHARE = 0.25
# Bits of CallSpec.tag: what every rank must share and the wire does not
# show (the learned deadline; a residual; a weighted stage of the hierarchy).
TAG_AUTO, TAG_RESIDUAL, TAG_WEIGHTED = 1, 2, 4


def asks_for_auto(timeout: Any, config: Config) -> bool:
    """Does a call with this `timeout=` argument use the learned deadline?"""
    if timeout is UNSET:
        return config.timeout == "auto"
    return isinstance(timeout, str) and timeout == "auto"


class CallResolver:
    """Resolves the calls of one communicator (its config, rank count and
    learned deadlines)."""

    def __init__(self, config: Config, size: int, deadlines: AutoDeadline,
                 codes: Optional[AutoRedundancy] = None) -> None:
        self.config = config
        self.deadlines = deadlines
        self.codes = codes                        # redundancy="auto": the agreed code
        self.tree_max_bytes: int = tree_max_bytes(config.tree_max_bytes, size)
        self.timeout = config.core_timeout        # (read on every call)

    def asks_for_auto(self, timeout: Any) -> bool:
        """Does a call with this `timeout=` argument use the learned deadline?"""
        return asks_for_auto(timeout, self.config)

    def resolve(self, request: Request, send: np.ndarray, recv: np.ndarray,
                spent: float = 0.0, part: int = PART_WHOLE, segments: int = 1) -> CallSpec:
        """The spec of `request` on the host views `send` and `recv`
        (checked by call/buffers.py; for a segment of a pipelined call, the
        segment's).  `spent`: seconds of the call's deadline already gone
        (agreements at its start; a pipeline's earlier segments), taken out
        of it down to a floor: a quarter of the deadline, shared by the
        `segments` of a pipelined call (call/pipeline.py); `part`: PART_*.
        Raises TypeError or ValueError that say what is wrong.  (Called on
        every call: the common arguments take the short way.)"""
        config = self.config
        collective, timeout, weight = request.collective, request.timeout, request.weight
        tmo = self.timeout if timeout is UNSET else core_timeout(check_timeout("timeout", timeout))
        auto = tmo == AUTO
        if collective == ALLGATHER:
            if request.algorithm not in (None, "auto", "direct", "hierarchical"):
                raise ValueError(f"allgather's algorithm must be 'direct', 'hierarchical' or "
                                 f"'auto', got {request.algorithm!r}")
            opcode, algo, w, bits, err = SUM, DIRECT, 0.0, 0, None
        else:
            algorithm = request.algorithm
            if collective == REDUCE_SCATTER:
                algorithm = "auto" if algorithm is None else algorithm
                if algorithm not in ("ring", "direct", "auto", "hierarchical"):
                    raise ValueError(f"reduce_scatter's algorithm must be 'ring', 'direct', "
                                     f"'hierarchical' or 'auto', got {algorithm!r}")
                chosen = algorithm
            elif algorithm is None:
                chosen = config.algorithm
            else:
                chosen = check_algorithm("algorithm", algorithm)
            if chosen == "hierarchical":
                chosen = "auto"     # (only where the layout has one level: one node, or one rank per node)
            opcode = _op(request.op, send)
            w = 0.0 if weight is None else self.weight(weight, request.op, chosen)
            compression = request.compression
            if compression is UNSET:
                compression = config.compression
            bits = 0 if compression is None else self._bits(compression, send, chosen)
            residual = request.residual
            err = None if residual is None else check_residual(residual, send, recv)
            if w or bits:
                algo = DIRECT
            else:
                algo = flat_algorithm(chosen, send.nbytes, tmo != -1.0,
                                      collective != REDUCE_SCATTER, self.tree_max_bytes)
        nbytes = send.nbytes
        kind = (collective, algo, size_bucket(nbytes))
        if auto:
            tmo = self.deadlines.timeout(kind)
        budget = tmo
        if tmo > 0:
            if spent:       # (what is gone of the deadline, down to the floor)
                budget = max(tmo - spent, FLOOR_SHARE * tmo / segments)
            if request.limit is not None:
                budget = min(budget, max(request.limit, 0.0))
        redundancy = request.redundancy
        if redundancy is UNSET:
            redundancy = config.redundancy
        elif redundancy is not None:
            redundancy = check_redundancy("redundancy", redundancy)
        if redundancy == "auto":
            if self.codes is None:
                raise ValueError("redundancy='auto' in a call needs a communicator built with "
                                 "redundancy='auto' (where the ranks agree on the loss rate)")
            redundancy = self.codes.code()
        k, m = redundancy or (0, 0)
        # (what the ranks must share beyond what travels: a difference
        # fails the call on every rank as a mismatch)
        tag = (TAG_AUTO if auto else 0) | (TAG_RESIDUAL if err is not None else 0)
        return CallSpec(collective=collective, algorithm=algo, dtype=DTYPE_CODES[send.dtype],
                        op=opcode, timeout=tmo, budget=budget, weight=w, qbits=bits,
                        qgroup=config.compression_group, residual=err, nbytes=nbytes,
                        elements=recv.size if collective == ALLGATHER else send.size,
                        kind=kind, fec_k=k, fec_m=m, part=part, tag=tag | request.tag)

    def weight(self, weight: Any, op: str, algorithm: str) -> float:
        """The weight to pass to the core (a weight was given); raises
        TypeError or ValueError for one the call cannot take."""
        if isinstance(weight, bool) or not isinstance(weight, numbers.Real):
            raise TypeError(f"weight must be a real number or None, got {type(weight).__name__}")
        w = float(weight)
        if not (math.isfinite(w) and w > 0):
            raise ValueError(f"weight must be finite and > 0, got {weight!r}")
        if op != "avg":
            raise ValueError(f"weight needs op='avg' (a weighted average), got op={op!r}")
        if algorithm not in ("direct", "auto"):
            raise ValueError(f"weight needs algorithm='direct' (or 'auto', which then picks "
                             f"it), got {algorithm!r}")
        if self.config.scaling != "unbiased":
            raise ValueError("weight needs scaling='unbiased' (a weighted average divides by "
                             "the weights that arrived)")
        return w

    @staticmethod
    def _bits(compression: Any, send: np.ndarray, algorithm: str) -> int:
        """Bits per value of this call's payloads (a compression was given)."""
        check_compression("compression", compression)
        if send.dtype != np.float32:
            raise TypeError(f"compression={compression!r} needs float32 data (float16 and "
                            f"bfloat16 are widened to it), got {send.dtype}")
        if algorithm not in ("direct", "auto"):
            raise ValueError(f"compression needs algorithm='direct' (or 'auto', which then "
                             f"picks it), got {algorithm!r}")
        return COMPRESSIONS[compression]


def _op(op: Any, send: np.ndarray) -> int:
    opcode = OPS.get(op) if isinstance(op, str) else None
    if opcode is None:
        raise ValueError(f"op must be one of {sorted(OPS)}, got {op!r}")
    if opcode == AVG and not is_float(send.dtype):
        raise TypeError(f"op='avg' needs a floating-point dtype, got {send.dtype}")
    return opcode


def check_residual(residual: Any, send: np.ndarray, recv: np.ndarray) -> Optional[np.ndarray]:
    """The error-feedback buffer of a call (one was given), validated."""
    if not isinstance(residual, np.ndarray):
        raise TypeError(f"residual must be a NumPy array, got {type(residual).__name__}")
    if residual.dtype != np.float32 or send.dtype != np.float32:
        raise TypeError(f"residual needs float32 data and a float32 residual, got "
                        f"{send.dtype} and {residual.dtype}")
    if residual.size != send.size:
        raise ValueError(f"residual has {residual.size} elements, sendbuf {send.size}")
    if not residual.flags.c_contiguous or not residual.flags.writeable:
        raise ValueError("residual must be C-contiguous and writable")
    if np.may_share_memory(residual, send) or np.may_share_memory(residual, recv):
        raise ValueError("residual overlaps sendbuf or recvbuf")
    return residual.reshape(-1)
