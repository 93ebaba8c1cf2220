"""Entropy coding of a symbol stream: chunked canonical Huffman in several modes.

A stream of ``n`` small symbols (``uint8``, values below ``2**b``) is cut into chunks of
``chunk_size``; every chunk is coded on its own, byte-aligned, so chunks encode and
decode in parallel. Per chunk one mode:

* ``huffman`` - one code word per symbol (LC-Checkpoint's faithful coder);
* ``grouped`` - one code word per ``g`` symbols (sub-bit);
* ``runs``    - one code word per (zero run, symbol) pair plus raw extra bits (sub-bit);
* ``raw``     - the symbol bytes as they are;
* ``const``   - every symbol equal: no payload at all;
* ``pairs``   - byte planes only (blob version 3): a code of the chunk's own over pairs
  of ranked letters, written by lossless.py (layout in kernels/planes.py).

Each mode that any chunk uses has one code per stream, described by its code lengths.
Sizes are computed exactly from histograms before anything is written, so the choice
between modes is by real bytes, and encoding writes straight into one output buffer.
This module knows nothing of floats: the quantizer and the lossless codec feed it.
"""

from dataclasses import dataclass, field
from functools import lru_cache

import numpy as np

from ..util.pool import run_tasks
from ..util.wire import Reader, Writer
from ..errors import CorruptDataError, InvalidArgumentError, TruncatedError
from .kernels import buckets as bk
from .kernels import huffman as hk
from .kernels import planes as pk
from .kernels import runs as rk
from .kernels import tables as tk

HUFFMAN, GROUPED, RUNS, RAW, CONST, PAIRS = range(6)
MODE_NAMES = ("huffman", "grouped", "runs", "raw", "const", "pairs")
BYTES_READ = (HUFFMAN, RAW, CONST, PAIRS)   # what a byte plane may hold (pairs: see
                                            # kernels/planes.py; written by lossless.py)
CODED_MODES = (HUFFMAN, GROUPED, RUNS)
CACHE_SLACK = 1.01          # reuse a cached code while it costs at most 1% more
RAW_MARGIN = 0.97           # code a byte chunk only if that saves at least 3% over raw


def group_size(b: int) -> int:
    """Symbols per grouped letter: as many ``b``-bit symbols as fit in a byte (at least 2)."""
    return max(2, 8 // b)


def alphabet(mode: int, b: int) -> int:
    if mode == HUFFMAN:
        return 1 << b
    if mode == GROUPED:
        return 1 << (b * group_size(b))
    if mode == RUNS:
        return rk.RUN_CLASSES << b
    raise ValueError(mode)


def modes_for(coder: str, b: int) -> tuple:
    """The modes a coder name may choose from, per chunk."""
    table = {
        "huffman": (HUFFMAN,),
        "grouped": (GROUPED,),
        "runs": (RUNS,),
        "auto": (HUFFMAN, GROUPED, RUNS, CONST),
        "bytes": (HUFFMAN, RAW, CONST),         # lossless byte planes
    }
    if coder not in table:
        raise InvalidArgumentError(
            f"unknown coder {coder!r}; choose one of 'auto', 'huffman', 'grouped', 'runs'")
    return table[coder]


def uniform_modes(coder: str, bits: int) -> tuple:
    """Per-chunk modes of a uniform stream: ``coder``'s, less the grouped mode past 4-bit
    symbols (its letters would be wider than a byte)."""
    modes = modes_for(coder, min(bits, 4))
    if bits > 4:
        modes = tuple(m for m in modes if m != GROUPED) or (HUFFMAN,)
    return modes


@dataclass
class Analysis:
    """Per-chunk letter histograms of every candidate mode (what sizes are computed from)."""
    n: int
    chunk_size: int
    b: int
    hist: dict                      # mode -> int64 [nchunks, alphabet]
    extra_bits: np.ndarray | None   # runs: raw extra bits per chunk

    @property
    def nchunks(self) -> int:
        return -(-self.n // self.chunk_size)

    def chunk_len(self, c: int) -> int:
        return min(self.chunk_size, self.n - c * self.chunk_size)


def analyze(sym: np.ndarray, sym_hist: np.ndarray, chunk_size: int, b: int, modes,
            runs=None) -> Analysis:
    """Collect the histograms ``modes`` need; ``sym_hist`` is the per-chunk symbol histogram,
    ``runs`` the runs coder's ``(letter counts, extra bits)`` per chunk if already counted.

    Grouped letters cost at least one bit each, so when the runs code is sure to take
    fewer than ``n / g`` bits (sparse streams) the grouped histogram is not collected
    and that mode drops out of the choice. ``sym`` may be a callable returning the
    symbols, called only if a histogram needs them.
    """
    n = int(sym_hist.sum()) if callable(sym) else sym.size
    get = sym if callable(sym) else (lambda: sym)
    nchunks = -(-n // chunk_size)
    hist = {HUFFMAN: sym_hist}
    extra = None
    g = group_size(b)
    if RUNS in modes and runs is not None and runs[0] is not None:
        hist[RUNS], extra = runs
    elif RUNS in modes:
        hist[RUNS] = np.zeros((nchunks, alphabet(RUNS, b)), np.int64)
        extra = np.zeros(nchunks, np.int64)
        sym = get()

        def runs(c):
            lo, hi = c * chunk_size, min(n, (c + 1) * chunk_size)
            extra[c] = rk.runs_histogram(sym, lo, hi, 1 << b, hist[RUNS][c])
        run_tasks(runs, nchunks)
    if GROUPED in modes:
        if RUNS in modes:
            counts = hist[RUNS].sum(axis=0)
            runs_most = entropy_bits(counts) + counts.sum() + extra.sum()   # Huffman < H + 1
            if len(modes) > 1 and runs_most <= n / g:
                return Analysis(n, chunk_size, b, hist, extra)
        hist[GROUPED] = np.zeros((nchunks, alphabet(GROUPED, b)), np.int64)
        sym = get()

        def grouped(c):
            lo, hi = c * chunk_size, min(n, (c + 1) * chunk_size)
            rk.grouped_histogram(sym, lo, hi, g, b, hist[GROUPED][c])
        run_tasks(grouped, nchunks)
    return Analysis(n, chunk_size, b, hist, extra)


def entropy_bits(counts: np.ndarray) -> float:
    """Order-0 entropy of a histogram, in bits in total."""
    counts = counts[counts > 0].astype(np.float64)
    total = counts.sum()
    if total == 0:
        return 0.0
    p = counts / total
    return float(-(counts * np.log2(p)).sum())


def _cost(hist: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    return hist @ lengths.astype(np.int64)


@dataclass
class CodeCache:
    """Code lengths of the previous stream, reused while they stay near-optimal.

    Symbol statistics drift slowly between checkpoints of one tensor; reusing the code
    keeps decode tables hot in the decoder's cache. Every blob still stores its lengths.
    The previous stream's share of nonzero symbols tells the quantizer which of its two
    equivalent pass layouts will be faster on the next one.
    """
    lengths: dict = field(default_factory=dict)   # mode -> uint8 array
    hits: int = 0
    misses: int = 0
    nonzero: float | None = None    # share of nonzero symbols of the previous stream

    def choose(self, mode: int, counts: np.ndarray, fresh: np.ndarray) -> np.ndarray:
        old = self.lengths.get(mode)
        if old is not None and old.size == fresh.size and not np.any((counts > 0) & (old == 0)):
            if _cost(counts, old) <= CACHE_SLACK * _cost(counts, fresh):
                self.hits += 1
                return old
        self.misses += 1
        self.lengths[mode] = fresh
        return fresh


@dataclass
class Encoded:
    modes: np.ndarray          # uint8 per chunk
    consts: np.ndarray         # uint8 per chunk (the symbol of CONST chunks)
    nbytes: np.ndarray         # int64 per chunk
    lengths: dict              # mode -> uint8 code lengths, for the coded modes in use
    parts: list                # the payload, in order: coded bytes and views of raw chunks
    mode_bits: dict            # mode -> total bits had every chunk used it (for stats)

    @property
    def size(self) -> int:
        return int(self.nbytes.sum())


def raw_stream(sym: np.ndarray, chunk_size: int) -> Encoded:
    """Every chunk stored raw: the payload is a view of ``sym``, nothing is copied."""
    n = sym.size
    nch = -(-n // chunk_size)
    nbytes = np.minimum(chunk_size, n - np.arange(nch, dtype=np.int64) * chunk_size)
    return Encoded(np.full(nch, RAW, np.uint8), np.zeros(nch, np.uint8), nbytes, {},
                   [sym], {RAW: 8 * n})


def _chunk_bits(an: Analysis, mode: int, lengths) -> np.ndarray:
    """Exact coded size in bits of every chunk under ``mode``."""
    nch = an.nchunks
    if mode in CODED_MODES:
        bits = _cost(an.hist[mode], lengths[mode])
        if mode == RUNS:
            bits = bits + an.extra_bits
        return bits
    sizes = np.array([an.chunk_len(c) for c in range(nch)], np.int64)
    if mode == RAW:
        return sizes * 8
    if mode == CONST:
        is_const = (an.hist[HUFFMAN] == sizes[:, None]).any(axis=1)
        return np.where(is_const, 0, np.iinfo(np.int64).max // 4)
    raise ValueError(mode)


def encode(sym: np.ndarray, an: Analysis, modes, cache: CodeCache | None = None,
           apply=None, nonzero=None) -> Encoded:
    """Choose a mode per chunk (fewest bytes among ``modes``) and code the stream.

    ``apply=(centroids, fout)``: while coding, add each nonzero symbol's centroid into
    ``fout`` (the delta encoder's reference update, exactly as the decoder makes it).
    ``nonzero=(listed, starts)``: the nonzero symbols as the quantizer lists them, chunk
    ``c``'s at ``listed[starts[c]:starts[c + 1]]`` (see
    :func:`lcckpt.codec.kernels.runs.encode_runs_listed`); runs chunks are then coded from
    the list alone. ``sym`` may be a callable returning the symbols (see
    :func:`analyze`), called only if some chunk's mode reads them.
    """
    b = an.b
    modes = [m for m in modes if m not in CODED_MODES or m in an.hist]   # analyzed ones
    lengths = _code_lengths(an, modes, cache)
    stacked, mode_bits = _chunk_bytes(an, modes, lengths)
    score = stacked.astype(np.float64)
    if RAW in modes:                 # coding must pay for its slower decode
        score[list(modes).index(RAW)] *= RAW_MARGIN
    choice = _choose(score, modes, lengths)
    chunk_modes = np.asarray(modes, np.uint8)[choice]
    if callable(sym):
        listed = RUNS if nonzero is not None else -1
        reads = ~np.isin(chunk_modes, (CONST, listed))   # modes that read every symbol
        sym = sym() if reads.any() else _NO_SYMBOLS
    nbytes = stacked[choice, np.arange(an.nchunks)].astype(np.int64)
    consts = np.zeros(an.nchunks, np.uint8)
    if CONST in modes:
        is_c = chunk_modes == CONST
        consts[is_c] = np.argmax(an.hist[HUFFMAN][is_c], axis=1)
    used = {m: lengths[m] for m in CODED_MODES if m in lengths and np.any(chunk_modes == m)}
    codes = {m: hk.canonical_codes(l) for m, l in used.items()}
    # Coded chunks go to one new buffer; raw chunks stay views of ``sym`` (no copy).
    is_raw = chunk_modes == RAW
    coded_nbytes = np.where(is_raw, 0, nbytes)
    offsets = np.concatenate(([0], np.cumsum(coded_nbytes)))
    coded = np.empty(int(offsets[-1]), np.uint8)
    g, S = group_size(b), 1 << b
    cs = an.chunk_size

    applying = apply is not None
    cent, fout = apply if applying else (_NO_FLOATS, _NO_FLOATS)
    if applying and RAW in modes:
        raise ValueError("raw chunks cannot advance a reference")

    def task(c):
        lo, hi = c * cs, min(an.n, (c + 1) * cs)
        m, pos = chunk_modes[c], int(offsets[c])
        if m == HUFFMAN:
            end = hk.encode_symbols(sym, lo, hi, codes[m], used[m], coded, pos, cent, fout,
                                    applying)
        elif m == GROUPED:
            end = rk.encode_grouped(sym, lo, hi, g, b, codes[m], used[m], coded, pos, cent, fout,
                                    applying)
        elif m == RUNS and nonzero is not None:
            nz = nonzero[0][nonzero[1][c]:nonzero[1][c + 1]]
            end = rk.encode_runs_listed(sym, lo, hi, nz, S, codes[m], used[m], coded, pos, cent,
                                        fout, applying)
        elif m == RUNS:
            end = rk.encode_runs(sym, lo, hi, S, codes[m], used[m], coded, pos, cent, fout,
                                 applying)
        else:
            end = pos
            if applying and m == CONST and consts[c]:
                fout[lo:hi] += cent[consts[c]]
        if end != offsets[c + 1]:
            raise AssertionError(f"chunk {c}: wrote {end - pos} bytes, planned {nbytes[c]}")
    if not is_raw.all():
        run_tasks(task, an.nchunks)
    parts = _pieces(sym, coded, offsets, is_raw, cs, an.n)
    return Encoded(chunk_modes, consts, nbytes, used, parts, mode_bits)


def _code_lengths(an: Analysis, modes, cache) -> dict:
    """Each coded mode's code lengths, from its symbol counts (or the cached table)."""
    lengths = {}
    for m in modes:
        if m in CODED_MODES:
            counts = an.hist[m].sum(axis=0)
            fresh = hk.code_lengths(counts, hk.MAX_CODE_LEN)
            lengths[m] = cache.choose(m, counts, fresh) if cache is not None else fresh
    return lengths


def _chunk_bytes(an: Analysis, modes, lengths) -> tuple[np.ndarray, dict]:
    """``(bytes of every chunk in every mode, total bits per mode but CONST)``."""
    mode_bits, bits_by_mode = {}, []
    for m in modes:
        bits = _chunk_bits(an, m, lengths)
        bits_by_mode.append(bits)
        if m != CONST:
            mode_bits[m] = int(bits.sum())
    return np.stack([(x + 7) // 8 for x in bits_by_mode]), mode_bits


def _pieces(sym, coded, offsets, is_raw, cs: int, n: int) -> list:
    """The payload in order: runs of coded chunks from ``coded``, runs of raw chunks as
    views of ``sym`` (no copy)."""
    parts, c, nch = [], 0, len(is_raw)
    while c < nch:
        d = c
        while d < nch and is_raw[d] == is_raw[c]:
            d += 1
        parts.append(sym[c * cs:min(n, d * cs)] if is_raw[c] else coded[offsets[c]:offsets[d]])
        c = d
    return parts


def _choose(score: np.ndarray, modes, lengths: dict) -> np.ndarray:
    """Per chunk the cheapest mode, counting each coded mode's table once.

    Every subset of the coded modes is tried (at most 2**3): per chunk the cheapest mode
    in the subset, plus the tables of the modes it uses. On a small tensor a 40-byte
    table can outweigh everything its mode saves.
    """
    cols = np.arange(score.shape[1])
    coded = [i for i, m in enumerate(modes) if m in CODED_MODES]
    tables = {i: lengths_size(lengths[modes[i]]) for i in coded}
    best, best_choice = np.inf, None
    for subset in range(1 << len(coded)):
        masked = score.copy()
        for k, i in enumerate(coded):
            if not subset >> k & 1:
                masked[i] = np.inf
        choice = np.argmin(masked, axis=0)
        total = masked[choice, cols].sum() + sum(tables.get(i, 0) for i in np.unique(choice))
        if total < best:
            best, best_choice = total, choice
    if best_choice is None:                   # nothing finite: let argmin decide
        best_choice = np.argmin(score, axis=0)
    return best_choice


def _uvar_size(v: np.ndarray) -> np.ndarray:
    """Bytes of each value as an unsigned LEB128 varint."""
    v = np.asarray(v, np.int64)
    return 1 + (v >= 1 << 7) + (v >= 1 << 14) + (v >= 1 << 21) + (v >= 1 << 28)


def _layout_sizes(lengths: np.ndarray, used: np.ndarray) -> list:
    """Bytes of the three code table layouts (see :func:`_write_lengths`), kind byte aside."""
    gaps = np.diff(used, prepend=-1) - 1
    sparse = int(_uvar_size([used.size])[0] + _uvar_size(gaps).sum() + used.size)
    return [(lengths.size + 1) // 2, (lengths.size + 7) // 8 + (used.size + 1) // 2, sparse]


def lengths_size(lengths: np.ndarray) -> int:
    """Bytes :func:`_write_lengths` spends on a code table."""
    return 1 + min(_layout_sizes(lengths, np.flatnonzero(lengths)))


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


def _unnibble(packed: np.ndarray, size: int, what: str) -> np.ndarray:
    out = np.empty(2 * packed.size, np.uint8)
    out[0::2] = packed >> 4
    out[1::2] = packed & 15
    if np.any(out[size:]):
        raise CorruptDataError(f"{what}: code table has nonzero padding")
    return out[:size].copy()


def _write_lengths(w: Writer, lengths: np.ndarray):
    """Code lengths in the smallest of three layouts (a table costs bytes in every blob).

    0: a nibble per letter; 1: bitmap of the letters used, then their nibbles;
    2: count, then (gap, length) per letter used.
    """
    used = np.flatnonzero(lengths)
    kind = int(np.argmin(_layout_sizes(lengths, used)))
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


def _read_lengths(r: Reader, size: int) -> np.ndarray:
    kind = r.u8()
    if kind == 0:
        lengths = _unnibble(np.frombuffer(r.raw((size + 1) // 2), np.uint8), size, r.what)
    elif kind == 1:
        bitmap = np.unpackbits(np.frombuffer(r.raw((size + 7) // 8), np.uint8))
        if np.any(bitmap[size:]):
            raise CorruptDataError(f"{r.what}: code table bitmap has bits past its alphabet")
        used = np.flatnonzero(bitmap[:size])
        lengths = np.zeros(size, np.uint8)
        lengths[used] = _unnibble(np.frombuffer(r.raw((used.size + 1) // 2), np.uint8),
                                  used.size, r.what)
        if not np.all(lengths[used]):
            raise CorruptDataError(f"{r.what}: code table marks a letter used with length 0")
    elif kind == 2:
        m = r.uvar(size, "number of coded letters")
        lengths = np.zeros(size, np.uint8)
        s = -1
        for _ in range(m):
            s += r.uvar(size, "letter gap") + 1
            if s >= size:
                raise CorruptDataError(f"{r.what}: code table letter {s} outside alphabet {size}")
            lengths[s] = r.u8()
    else:
        raise CorruptDataError(f"{r.what}: unknown code table kind {kind}")
    if lengths.max(initial=0) > hk.MAX_CODE_LEN or not lengths.any():
        raise CorruptDataError(f"{r.what}: invalid code lengths")
    kraft = int(np.sum(np.left_shift(1, hk.MAX_CODE_LEN - lengths[lengths > 0].astype(np.int64))))
    if kraft > 1 << hk.MAX_CODE_LEN:
        raise CorruptDataError(f"{r.what}: code lengths are over-subscribed (not a prefix code)")
    return lengths


@dataclass
class StreamLayout:
    modes: np.ndarray
    consts: np.ndarray
    offsets: np.ndarray       # int64 [nchunks + 1], relative to the payload start
    lengths: dict


def read_tables(r: Reader, n: int, chunk_size: int, b: int, allowed) -> StreamLayout:
    """Parse and validate what :func:`write_tables` wrote, for a stream of ``n`` symbols."""
    nchunks = -(-n // chunk_size)
    mask = r.u8()
    lengths = {}
    for m in CODED_MODES:
        if mask & (1 << m):
            if m not in allowed:
                raise CorruptDataError(f"{r.what}: code table for a mode this stream cannot use")
            lengths[m] = _read_lengths(r, alphabet(m, b))
    if mask & ~sum(1 << m for m in CODED_MODES):
        raise CorruptDataError(f"{r.what}: unknown code table flags {mask:#x}")
    if 2 * nchunks > r.end - r.pos:             # every entry takes at least two bytes
        raise TruncatedError(f"{r.what} is truncated: no room for a table of {nchunks} chunks")
    modes = np.empty(nchunks, np.uint8)
    consts = np.zeros(nchunks, np.uint8)
    nbytes = np.zeros(nchunks, np.int64)
    state = np.zeros(8, np.uint8)
    for m in allowed:
        state[m] = tk.MODE_NO_TABLE if m in CODED_MODES and m not in lengths else tk.MODE_OK
    buf = np.frombuffer(r.buf, np.uint8)
    r.pos, err, c = tk.read_chunk_table(buf, r.pos, r.end, nchunks, n, chunk_size, b, state,
                                        CONST, RAW, r.end, modes, consts, nbytes)
    if err == tk.TRUNCATED:
        raise TruncatedError(f"{r.what} is truncated: {tk.ERRORS[err]} (chunk {c} of {nchunks})")
    if err != tk.OK:
        raise CorruptDataError(f"{r.what}: chunk {c} {tk.ERRORS[err]}")
    offsets = np.concatenate(([0], np.cumsum(nbytes)))
    return StreamLayout(modes, consts, offsets, lengths)


MULTI_MIN_SYMBOLS = 1 << 16    # below this the multi table costs more than it saves


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


_NO_SYMBOLS = np.zeros(1, np.uint8)
_NO_FLOATS = np.zeros(1, np.float32)


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
        if base + int(layout.offsets[-1]) > buf.size:
            raise CorruptDataError(f"{what}: chunk table points past the end of the data")
        self.buf, self.base, self.layout, self.n, self.cs, self.b = buf, base, layout, n, chunk_size, b
        self.what, self.out = what, out
        self.tables = {m: _table(l.tobytes()) for m, l in layout.lengths.items()}
        self.multi, self.sym_bits = None, 4 if b <= 4 else 8
        if HUFFMAN in layout.lengths and n >= MULTI_MIN_SYMBOLS:
            self.multi = _multi_table(layout.lengths[HUFFMAN].tobytes(), self.sym_bits)
        self.gmulti = None                 # grouped letters are at most 8 bits
        if GROUPED in layout.lengths and n >= MULTI_MIN_SYMBOLS:
            self.gmulti = _multi_table(layout.lengths[GROUPED].tobytes(), 8)
        self.rmulti = _NO_TABLE
        if RUNS in layout.lengths and n >= MULTI_MIN_SYMBOLS:
            self.rmulti = _runs_table(layout.lengths[RUNS].tobytes(), 1 << b)
        self.applying = apply is not None
        self.cent, self.fout = apply if self.applying else (_NO_FLOATS, _NO_FLOATS)
        self.sym = _NO_SYMBOLS if self.applying else out
        self.clear = clear and self.applying

    @property
    def nchunks(self) -> int:
        return -(-self.n // self.cs)

    def chunk(self, c: int, out: np.ndarray | None = None, shift: int = 0):
        """Decode chunk ``c``; symbols go to ``out[i - shift]`` (default: the stream's own
        ``out`` at ``i``), so a caller can decode into a small buffer of its own."""
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


def decode(buf: np.ndarray, base: int, layout: StreamLayout, n: int, chunk_size: int, b: int,
           out: np.ndarray | None, what: str = "blob", apply=None, clear: bool = False):
    """Decode a stream of ``n`` symbols (``buf[base:]`` is its payload); see StreamDecoder."""
    d = StreamDecoder(buf, base, layout, n, chunk_size, b, out, what, apply, clear)
    run_tasks(d.chunk, d.nchunks)
