"""The symbol stream's wire format: which codes are in use and their lengths, the chunk
table, and the decoder that reads a stream back chunk by chunk (coding: entropy.py).

A stream description is written into a blob header by :func:`write_tables` (the blob's
writers in blob.py call it) and read back, validated, with the rest of the header by
kernels/head.py, before any kernel sees an offset.
"""

from dataclasses import dataclass
from functools import lru_cache

import numpy as np

from ..util import memory as _memory
from ..util.pool import run_tasks
from ..util.wire import Writer
from ..errors import CorruptDataError
from .entropy import (
    NO_FLOATS, NO_SYMBOLS, CODED_MODES, CONST, GROUPED, HUFFMAN, MODE_NAMES, PAIRS, RAW,
    RUNS, Encoded, group_size,
)
from .kernels import buckets as bk
from .kernels import huffman as hk
from .kernels import planes as pk
from .kernels import runs as rk
from .kernels import tables as tk


# --- stream description: code tables and chunk table -----------------------------------

def write_tables(w: Writer, enc: Encoded):
    """Serialize the code lengths in use and the chunk table."""
    mask = 0
    for m in enc.lengths:
        mask |= 1 << m
    w.u8(mask)
    for m in CODED_MODES:
        if m in enc.lengths:
            _write_lengths(w, enc.lengths[m])
    for c in range(enc.modes.size):
        m = int(enc.modes[c])
        w.u8(m)
        if m == CONST:
            w.u8(int(enc.consts[c]))
        else:
            w.uvar(int(enc.nbytes[c]))


def _nibbles(values: np.ndarray) -> bytes:
    padded = np.zeros(2 * ((values.size + 1) // 2), np.uint8)
    padded[:values.size] = values
    return ((padded[0::2] << 4) | padded[1::2]).astype(np.uint8).tobytes()


def _write_lengths(w: Writer, lengths: np.ndarray, kind: int | None = None):
    """Code lengths in the smallest of three layouts (a table costs bytes in every blob),
    or in layout ``kind``.

    0: a nibble per letter; 1: bitmap of the letters used, then their nibbles;
    2: count, then (gap, length) per letter used.
    """
    lengths = np.ascontiguousarray(lengths, np.uint8)
    used = np.flatnonzero(lengths)
    if kind is None:
        sizes = tk.layout_sizes(lengths)
        kind = sizes.index(min(sizes))
    w.u8(kind)
    if kind == 0:
        w.raw(_nibbles(lengths))
    elif kind == 1:
        w.raw(np.packbits(lengths > 0).tobytes())
        w.raw(_nibbles(lengths[used]))
    else:
        w.uvar(used.size)
        prev = -1
        for s in used:
            w.uvar(int(s) - prev - 1)
            w.u8(int(lengths[s]))
            prev = int(s)


LENGTH_ERRORS = {
    tk.L_PADDING: "code table has nonzero padding",
    tk.L_BITMAP: "code table bitmap has bits past its alphabet",
    tk.L_ZERO_USED: "code table marks a letter used with length 0",
    tk.L_COUNT: "number of coded letters exceeds the alphabet",
    tk.L_GAP: "letter gap exceeds the alphabet",
    tk.L_LETTER: "code table letter outside the alphabet",
    tk.L_VARINT: "malformed varint in the code table",
    tk.L_KIND: "unknown code table kind",
    tk.L_INVALID: "invalid code lengths",
    tk.L_KRAFT: "code lengths are over-subscribed (not a prefix code)",
}


@dataclass
class StreamLayout:
    modes: np.ndarray
    consts: np.ndarray
    offsets: np.ndarray       # int64 [nchunks + 1], relative to the payload start
    lengths: dict


MULTI_MIN_SYMBOLS = 1 << 16    # below this the multi table costs more than it saves
RUNS_MULTI_MIN_BYTES = 32 << 10  # a runs stream smaller than this decodes one letter at a
                                 # time in less than its multi table takes to build (~50 us)


@lru_cache(maxsize=256)
def _table(lengths_bytes: bytes):
    lengths = np.frombuffer(lengths_bytes, np.uint8)
    bits = int(lengths.max())
    return hk.decode_table(lengths, bits), bits


_NO_TABLE = np.zeros(0, np.uint64)


@lru_cache(maxsize=64)
def _runs_table(lengths_bytes: bytes, S: int):
    return rk.runs_decode_table(np.frombuffer(lengths_bytes, np.uint8), S)


@lru_cache(maxsize=64)
def _multi_table(lengths_bytes: bytes, sym_bits: int):
    return hk.multi_decode_table(np.frombuffer(lengths_bytes, np.uint8), sym_bits)


class StreamDecoder:
    """Decodes one stream chunk by chunk; :func:`decode` runs every chunk on the pool.

    Symbols go into ``out`` (uint8), or, with ``apply=(centroids, fout)``, straight into
    the floats: ``fout[i] += centroids[s]`` for every nonzero symbol, in the same fp32 add
    the encoder's reference update makes; zero runs and all-zero chunks cost nothing.
    ``clear``: each chunk's floats are set to 0 first, by the task that then decodes into
    them (a decode into a caller's buffer: cleared on every thread, while in cache).
    """

    def __init__(self, buf: np.ndarray, base: int, layout: StreamLayout, n: int,
                 chunk_size: int, b: int, out: np.ndarray | None, what: str = "blob", apply=None,
                 clear: bool = False):
        if buf is not None and base + int(layout.offsets[-1]) > buf.size:
            raise CorruptDataError(f"{what}: chunk table points past the end of the data")
        self.buf = None if buf is None else _memory.read_only(buf)
        self.base, self.layout, self.n, self.cs, self.b = base, layout, n, chunk_size, b
        self.span = None if buf is not None else (0, 0)    # buf None: :meth:`window` first
        self.what, self.out = what, out
        self.tables = {m: _table(l.tobytes()) for m, l in layout.lengths.items()}
        self.multi, self.sym_bits = None, 4 if b <= 4 else 8
        if HUFFMAN in layout.lengths and n >= MULTI_MIN_SYMBOLS:
            self.multi = _multi_table(layout.lengths[HUFFMAN].tobytes(), self.sym_bits)
        self.gmulti = None                 # grouped letters are at most 8 bits
        if GROUPED in layout.lengths and n >= MULTI_MIN_SYMBOLS:
            self.gmulti = _multi_table(layout.lengths[GROUPED].tobytes(), 8)
        self.rmulti = _NO_TABLE
        if RUNS in layout.lengths and n >= MULTI_MIN_SYMBOLS and \
                int(layout.offsets[-1]) >= RUNS_MULTI_MIN_BYTES:
            self.rmulti = _runs_table(layout.lengths[RUNS].tobytes(), 1 << b)
        self.multi8 = None                 # the 8-bit-letter multi table of four streams
        if HUFFMAN in layout.lengths and n >= MULTI_MIN_SYMBOLS:
            self.multi8 = self.multi if self.sym_bits == 8 else \
                _multi_table(layout.lengths[HUFFMAN].tobytes(), 8)
        self.applying = apply is not None
        self.cent, self.fout = apply if self.applying else (NO_FLOATS, NO_FLOATS)
        self.sym = NO_SYMBOLS if self.applying else out
        self.clear = clear and self.applying
        self.cz = None                     # additive centroids, for chunks4

    @property
    def nchunks(self) -> int:
        return -(-self.n // self.cs)

    def window(self, buf: np.ndarray, lo: int, hi: int) -> None:
        """Decode chunks ``lo..hi-1`` from ``buf``, which holds only their bytes (a blob
        read chunk by chunk, :class:`~lcckpt.codec.streamed.DeltaChunks`); another chunk
        then raises."""
        if not 0 <= lo < hi <= self.nchunks or \
                buf.size < int(self.layout.offsets[hi]) - int(self.layout.offsets[lo]):
            raise ValueError(f"window {lo}..{hi} does not fit the stream or its buffer")
        self.buf, self.base = _memory.read_only(buf), -int(self.layout.offsets[lo])
        self.span = (lo, hi)

    def _in_window(self, c: int) -> None:
        if self.span is not None and not self.span[0] <= c < self.span[1]:
            raise ValueError(f"chunk {c} is outside the window {self.span} read")

    def chunks4(self, c: int, block: np.ndarray) -> bool:
        """Add chunks ``c..c+3`` when all four are :meth:`dense`: their four bit streams
        decoded side by side (:func:`decode_side_by_side`), then added; the same adds, in
        the same order, as :meth:`chunk` of each (3.9x faster decoding than one stream at
        a time on a real delta's 7-bit symbols). False, with nothing done, for any other
        four."""
        if c + 4 > self.nchunks or not all(self.dense(c + j) for j in range(4)):
            return False
        at = decode_side_by_side([(self, c + j) for j in range(4)], block)
        for j in range(4):
            self.add_block(c + j, block, at[j])
        return True

    def dense(self, c: int) -> bool:
        """Whether chunk ``c`` is a dense Huffman chunk that :func:`decode_side_by_side`
        may decode (one added two passes: symbols, then adds)."""
        self._in_window(c)
        if not self.applying or self.clear or self.multi8 is None \
                or self.layout.modes[c] != HUFFMAN:
            return False
        n = min(self.cs, self.n - c * self.cs)
        return (int(self.layout.offsets[c + 1]) - int(self.layout.offsets[c])) * 8 \
            > hk.SPARSE_BITS * n

    def add_block(self, c: int, block: np.ndarray, at: int) -> None:
        """Add chunk ``c``'s symbols, decoded into ``block[at:]``, as :meth:`chunk` would."""
        if self.cz is None:
            self.cz = hk.additive(self.cent)
        lo = c * self.cs
        hk.add_decoded(block, at, min(self.cs, self.n - lo), self.cz, self.fout, lo)

    def chunk(self, c: int, out: np.ndarray | None = None, shift: int = 0):
        """Decode chunk ``c``; symbols go to ``out[i - shift]`` (default: the stream's own
        ``out`` at ``i``), so a caller can decode into a small buffer of its own."""
        self._in_window(c)
        buf, b, cent, fout, applying = self.buf, self.b, self.cent, self.fout, self.applying
        sym = self.sym if out is None else out
        lo, hi = c * self.cs, min(self.n, (c + 1) * self.cs)
        o = lo - shift
        if self.clear:
            fout[lo:hi] = 0
        start = self.base + int(self.layout.offsets[c])
        end = self.base + int(self.layout.offsets[c + 1])
        m = self.layout.modes[c]
        if m == CONST:
            v = self.layout.consts[c]
            if not applying:
                sym[o:o + hi - lo] = v
            elif v:
                fout[lo:hi] += cent[v]
            used = 0
        elif m == RAW:
            raw = buf[start:end]
            if b < 8 and int(raw.max(initial=0)) >> b:
                raise CorruptDataError(f"{self.what}: raw chunk {c} holds symbols wider than {b} bits")
            if applying:
                bk.apply_symbols(raw, 0, hi - lo, cent, fout[lo:hi])
            else:
                sym[o:o + hi - lo] = raw
            used = 8 * (end - start)
        elif m == PAIRS:
            err = pk.pairs_decode(buf, start, end, hi - lo, sym, o)
            if err:
                raise CorruptDataError(f"{self.what}: chunk {c} (pairs) {pk.PAIRS_ERRORS[err]}; "
                                       "the data is damaged")
            used = 8 * (end - start)
        else:
            table, tb = self.tables[m]
            if m == HUFFMAN and self.multi is not None:
                used = hk.decode_symbols_multi(buf, start, end, hi - lo, self.multi, self.sym_bits,
                                               table, tb, sym, o, cent, fout, applying)
            elif m == HUFFMAN:
                used = hk.decode_symbols(buf, start, end, hi - lo, table, tb, sym, o, cent, fout,
                                         applying)
            elif m == GROUPED and self.gmulti is not None:
                used = rk.decode_grouped_multi(buf, start, end, hi - lo, group_size(b), b,
                                               self.gmulti, table, tb, sym, o, cent, fout,
                                               applying)
            elif m == GROUPED:
                used = rk.decode_grouped(buf, start, end, hi - lo, group_size(b), b, table, tb, sym,
                                         o, cent, fout, applying)
            else:
                used = rk.decode_runs(buf, start, end, hi - lo, 1 << b, table, tb, sym, o, cent,
                                      fout, applying, self.rmulti)
        if used < 0 or (used + 7) // 8 != end - start:
            raise CorruptDataError(
                f"{self.what}: chunk {c} ({MODE_NAMES[m]}) does not decode to its recorded "
                "size; the data is damaged")


def decode_side_by_side(chunks: list, block: np.ndarray) -> list[int]:
    """Two to four ``(decoder, chunk)`` whose chunk is :meth:`StreamDecoder.dense` (four
    chunks of one delta, or one chunk of several deltas, each its own blob and code), their
    bit streams decoded side by side (:func:`lcckpt.codec.kernels.planes.decode4`; fewer
    than four repeat the last) into ``block`` (``4 * (chunk_size + 8)`` bytes); returns
    where each one's symbols start, for :meth:`StreamDecoder.add_block` in their order."""
    pad = list(chunks) + [chunks[-1]] * (4 - len(chunks))
    s = np.array([d.base + int(d.layout.offsets[c]) for d, c in pad], np.int64)
    e = np.array([d.base + int(d.layout.offsets[c + 1]) for d, c in pad], np.int64)
    n = np.array([min(d.cs, d.n - c * d.cs) for d, c in pad], np.int64)
    o = np.arange(4, dtype=np.int64) * (pad[0][0].cs + 8)
    used = np.empty(4, np.int64)
    pk.decode4(tuple(d.buf for d, _ in pad), s, e, n, tuple(d.multi8 for d, _ in pad),
               tuple(d.tables[HUFFMAN][0] for d, _ in pad),
               tuple(int(d.tables[HUFFMAN][1]) for d, _ in pad), block, o, used)
    for j, (d, c) in enumerate(chunks):
        if used[j] < 0 or (used[j] + 7) // 8 != e[j] - s[j]:
            raise CorruptDataError(f"{d.what}: chunk {c} (huffman) does not decode to its "
                                   "recorded size; the data is damaged")
    return [int(x) for x in o[:len(chunks)]]


def decode(buf: np.ndarray, base: int, layout: StreamLayout, n: int, chunk_size: int, b: int,
           out: np.ndarray | None, what: str = "blob", apply=None, clear: bool = False):
    """Decode a stream of ``n`` symbols (``buf[base:]`` is its payload); see StreamDecoder."""
    d = StreamDecoder(buf, base, layout, n, chunk_size, b, out, what, apply, clear)
    run_tasks(d.chunk, d.nchunks)
