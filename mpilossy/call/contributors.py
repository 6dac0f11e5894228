"""Who contributed to each block of a direct call's or an all-gather's result.

The direct algorithm's reduced blocks carry a bitmap of the ranks whose data
they hold (src_cython/direct.pxi); the all-gather records which blocks
arrived (src_cython/gather.pxi).  The core hands the bitmaps of the last
call over as bytes; this record decodes them only when asked, so a call that
nobody asks about pays for one small copy.
"""

from __future__ import annotations

from typing import Optional, Sequence, Tuple

import numpy as np

__all__ = ["Contributors"]


class Contributors:
    """Which ranks' data is in each block of this rank's result.

    Blocks are numbered as the result is laid out: chunk by chunk
    (``Communicator.chunk_bounds``), ``block_elems`` elements per block within
    a chunk.  A reduced block that this rank did not receive holds its own
    contribution only (its fallback) and is recorded as such; with
    scaling="zero-fill" it holds zeros and nobody.  In an all-gather a block
    holds its owner's data if it arrived, and nobody's (the previous
    contents) if not.
    """

    __slots__ = ("size", "rank", "count", "block_elems", "_bits", "_entries", "_nblocks",
                 "_chunks", "_members", "_spans")

    def __init__(self, raw: Optional[Tuple[bytes, int, int, int, int]], *, size: int, rank: int, count: int,
                 chunks: Tuple[int, ...]) -> None:
        """`raw`: the core's (bitmap bytes, entries, nblocks, block_elems,
        words), or None for a job of one rank.  `count`: elements of the
        reduced vector; `chunks`: the chunks that make up this rank's result,
        in order."""
        self.size, self.rank, self.count = size, rank, count
        self._chunks = chunks
        self._members: Optional[np.ndarray] = None
        self._spans: Optional[Tuple[np.ndarray, np.ndarray]] = None
        if raw is None:                         # one rank: everything is its own
            self._bits = np.ones((1, 1), np.uint64)
            self._entries, self._nblocks, self.block_elems = 1, 1, max(count, 1)
            return
        data, self._entries, self._nblocks, self.block_elems, words = raw
        self._bits = np.frombuffer(data, np.uint64).reshape(self._entries, words)

    @classmethod
    def of_blocks(cls, bits: np.ndarray, firsts: np.ndarray, lengths: np.ndarray, *,
                  size: int, rank: int) -> "Contributors":
        """A record of a result cut into the given blocks (first, length),
        every block on every rank, with one bitmap row (uint64 words) per
        block: the hierarchical all-reduce's (mpilossy/hierarchy/record.py)."""
        bits = np.ascontiguousarray(bits, np.uint64)
        record = cls(None, size=size, rank=rank, count=int(np.sum(lengths)),
                     chunks=tuple(range(size)))
        record._bits, record._entries = bits, bits.shape[0]
        record._nblocks = bits.shape[0]
        record.block_elems = int(lengths.max()) if lengths.size else 0
        record._spans = (np.asarray(firsts, np.int64), np.asarray(lengths, np.int64))
        return record

    @classmethod
    def concatenate(cls, records: Sequence["Contributors"], lengths: Sequence[int], *,
                    size: int, rank: int) -> "Contributors":
        """One record of results laid end to end, `lengths` elements each
        (the segments of a pipelined call, mpilossy/call/pipeline.py)."""
        bits, firsts, spans, offset = [], [], [], 0
        for record, length in zip(records, lengths):
            first, span = record.blocks()
            bits.append(record._bits)
            firsts.append(first + offset)
            spans.append(span)
            offset += length
        return cls.of_blocks(np.vstack(bits), np.concatenate(firsts), np.concatenate(spans),
                             size=size, rank=rank)

    def members(self) -> np.ndarray:
        """Bool array (blocks, size): [b, r] is True if rank r's data is in block b."""
        if self._members is None:
            as_bytes = self._bits.astype("<u8").view(np.uint8)
            bits = np.unpackbits(as_bytes, axis=1, bitorder="little")
            self._members = bits[:, :self.size].astype(bool)
        return self._members

    def blocks(self) -> Tuple[np.ndarray, np.ndarray]:
        """(first, length) of every block, as offsets into this rank's result."""
        if self._spans is not None:
            return self._spans
        firsts, lengths = [], []
        offset = 0
        base, extra = divmod(self.count, self.size)
        starts = np.arange(self._nblocks, dtype=np.int64) * self.block_elems
        for chunk in self._chunks:          # never empty: all chunks, or mine
            chunk_len = base + (1 if chunk < extra else 0)
            firsts.append(offset + starts)
            lengths.append(np.clip(chunk_len - starts, 0, self.block_elems))
            offset += chunk_len
        return np.concatenate(firsts), np.concatenate(lengths)

    def fraction(self, rank: Optional[int] = None) -> float:
        """Fraction of this rank's result elements whose value holds `rank`'s
        data (default: this rank's own)."""
        rank = self.rank if rank is None else rank
        if not 0 <= rank < self.size:
            raise ValueError(f"rank {rank} is not in 0..{self.size - 1}")
        _, lengths = self.blocks()
        total = int(lengths.sum())
        if total == 0:
            return 1.0
        return float(lengths[self.members()[:, rank]].sum()) / total

    def mask(self, rank: Optional[int] = None) -> np.ndarray:
        """Bool per element of this rank's result: does its value hold
        `rank`'s data?  (For error feedback: what a sender's data missed.)"""
        rank = self.rank if rank is None else rank
        if not 0 <= rank < self.size:
            raise ValueError(f"rank {rank} is not in 0..{self.size - 1}")
        _, lengths = self.blocks()
        return np.repeat(self.members()[:, rank], lengths)

    def received(self) -> np.ndarray:
        """Bool per element of this rank's result: does its value hold
        anyone's data?  (All-gather: did its block arrive?)"""
        _, lengths = self.blocks()
        return np.repeat(self.members().any(axis=1), lengths)

    def layout_bits(self) -> np.ndarray:
        """Bitmaps (size * nblocks, words) of every chunk's blocks, chunk by
        chunk, with this rank's where its result has the chunk and zeros
        elsewhere: the same shape on every rank, ready for a bitwise OR.
        (A record of_blocks() holds every block already: its own bitmaps.)"""
        if self._spans is not None:
            return self._bits.copy()
        out = np.zeros((self.size * self._nblocks, self._bits.shape[1]), np.uint64)
        for i, chunk in enumerate(self._chunks):
            out[chunk * self._nblocks:(chunk + 1) * self._nblocks] = \
                self._bits[i * self._nblocks:(i + 1) * self._nblocks]
        return out

    def of_every_chunk(self, bits: np.ndarray) -> "Contributors":
        """A record of the whole reduced vector (every chunk) with the given
        bitmaps, laid out as layout_bits(): for instance the OR of every
        rank's layout_bits(), which is exact wherever one rank knew."""
        if self._spans is not None:
            return Contributors.of_blocks(bits, *self._spans, size=self.size, rank=self.rank)
        raw = (np.ascontiguousarray(bits, np.uint64).tobytes(), self.size * self._nblocks,
               self._nblocks, self.block_elems, self._bits.shape[1])
        return Contributors(raw, size=self.size, rank=self.rank, count=self.count,
                            chunks=tuple(range(self.size)))

    def __repr__(self) -> str:
        return (f"<Contributors of {self._entries} block(s), rank {self.rank} of {self.size}: "
                f"own data in {self.fraction():.3f}>")
