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
The stream's wire format (code tables, chunk table) and its decoder are streams.py's.
"""

import threading
from dataclasses import dataclass, field

import numpy as np

from ..util.pool import run_tasks, threads
from ..errors import InvalidArgumentError
from .kernels import huffman as hk
from .kernels import plan as pk
from .kernels import runs as rk
from .kernels import sums as sk
from .kernels import tables as tk

HUFFMAN, GROUPED, RUNS, RAW, CONST, PAIRS = range(6)
MODE_NAMES = ("huffman", "grouped", "runs", "raw", "const", "pairs")
BYTES_READ = (HUFFMAN, RAW, CONST, PAIRS)   # what a byte plane may hold (pairs: see
                                            # kernels/planes.py; written by lossless.py)
CODED_MODES = (HUFFMAN, GROUPED, RUNS)
CACHE_SLACK = 1.01          # reuse a cached code while it costs at most 1% more
RAW_MARGIN = 0.97           # code a byte chunk only if that saves at least 3% over raw
LETTERS = np.int32          # a chunk's letter counts (a chunk holds at most 2**24 symbols)
DENSE_ZEROS = 4             # a chunk under 1/4 zeros counts its runs letters by its zeros


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

    def chunk_lens(self) -> np.ndarray:
        """Every chunk's length (int64)."""
        return np.minimum(self.chunk_size,
                          self.n - np.arange(self.nchunks, dtype=np.int64) * self.chunk_size)


def analyze(sym: np.ndarray, sym_hist: np.ndarray, chunk_size: int, b: int, modes,
            runs=None, counted: dict | None = None, chunks=None) -> Analysis:
    """Collect the histograms ``modes`` need; ``sym_hist`` is the per-chunk symbol histogram,
    ``runs`` the runs coder's ``(letter counts, extra bits)`` per chunk if already counted.

    Grouped letters cost at least one bit each, so when the runs code is sure to take
    fewer than ``n / g`` bits (sparse streams) the grouped histogram is not collected
    and that mode drops out of the choice. ``sym`` may be a callable returning the
    symbols, called only if a histogram needs them. ``counted``: what
    :func:`count_chunk` counted already, chunk by chunk, as the symbols were made;
    ``chunks(c, out)`` (``sym`` None): writes chunk ``c``'s symbols into ``out``, for
    what is still to count.
    """
    counted = counted or {}
    n = int(sym_hist.sum()) if callable(sym) or sym is None else sym.size
    get = sym if callable(sym) else (lambda: sym if chunks is None else chunks)
    nchunks = -(-n // chunk_size)
    hist = {HUFFMAN: sym_hist}
    extra = None
    runs = counted.get("runs", runs)
    if RUNS in modes and runs is not None and runs[0] is not None:
        hist[RUNS], extra = runs
    elif RUNS in modes:
        hist[RUNS] = np.zeros((nchunks, alphabet(RUNS, b)), LETTERS)
        extra = np.zeros(nchunks, np.int64)
        _count_all(get(), n, chunk_size, b, {"runs": (hist[RUNS], extra)}, sym_hist)
    if GROUPED in modes:
        if RUNS in modes:
            counts = hist[RUNS].sum(axis=0)
            runs_most = entropy_bits(counts) + counts.sum() + extra.sum()   # Huffman < H + 1
            if len(modes) > 1 and runs_most <= n / group_size(b):
                return Analysis(n, chunk_size, b, hist, extra)
        if "grouped" in counted:
            hist[GROUPED] = counted["grouped"]
        else:
            hist[GROUPED] = np.zeros((nchunks, alphabet(GROUPED, b)), LETTERS)
            _count_all(get(), n, chunk_size, b, {"grouped": hist[GROUPED]}, sym_hist)
    return Analysis(n, chunk_size, b, hist, extra)


def count_chunk(sym: np.ndarray, lo: int, hi: int, b: int, counts: dict, c: int,
                sym_hist: np.ndarray) -> None:
    """Chunk ``c``'s letters (``sym[lo:hi]``) into ``counts``: ``"runs"`` ``(letter counts,
    extra bits)`` and ``"grouped"`` letter counts, each ``[nchunks, ...]`` if present."""
    if "runs" in counts:
        hist, extra = counts["runs"]
        if sym_hist[c, 0] * DENSE_ZEROS < hi - lo:       # few zeros: walk those
            extra[c] = rk.runs_histogram_dense(sym, lo, hi, 1 << b, hist[c], sym_hist[c])
        else:
            extra[c] = rk.runs_histogram(sym, lo, hi, 1 << b, hist[c])
    if "grouped" in counts:
        rk.grouped_histogram(sym, lo, hi, group_size(b), b, counts["grouped"][c])


_scratch = threading.local()


def chunk_buffer(n: int) -> np.ndarray:
    """A per-thread byte buffer of ``n`` bytes, kept between calls (one chunk's symbols,
    quantized again where a stream's symbols are not held)."""
    buf = getattr(_scratch, "buf", None)
    if buf is None or buf.size < n:
        buf = _scratch.buf = np.empty(n, np.uint8)
    return buf[:n]


def _count_all(sym, n: int, chunk_size: int, b: int, counts: dict, sym_hist) -> None:
    """Count every chunk; ``sym``: the symbols, or ``chunks(c, out)`` making a chunk's."""
    def one(c):
        lo, hi = c * chunk_size, min(n, (c + 1) * chunk_size)
        if callable(sym):
            count_chunk(sym(c, chunk_buffer(chunk_size)), 0, hi - lo, b, counts, c, sym_hist)
        else:
            count_chunk(sym, lo, hi, b, counts, c, sym_hist)
    run_tasks(one, -(-n // chunk_size))


def entropy_bits(counts: np.ndarray) -> float:
    """Order-0 entropy of a histogram, in bits in total."""
    counts = counts[counts > 0].astype(np.float64)
    total = counts.sum()
    if total == 0:
        return 0.0
    p = counts / total
    return float(-(counts * np.log2(p)).sum())


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


@dataclass
class Encoded:
    modes: np.ndarray          # uint8 per chunk
    consts: np.ndarray         # uint8 per chunk (the symbol of CONST chunks)
    nbytes: np.ndarray         # int64 per chunk
    lengths: dict              # mode -> uint8 code lengths, for the coded modes in use
    parts: list                # the payload, in order: coded bytes and views of raw chunks
                               # (``encode(lazy=True)``: an iterator coding them)
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


_NOT_CONST_BITS = np.iinfo(np.int64).max // 4    # a chunk that is not constant, as CONST
_NOT_CONST_BYTES = (_NOT_CONST_BITS + 7) // 8


def encode_bytes_chunk(sym: np.ndarray, counts: np.ndarray) -> Encoded:
    """:func:`encode` of a byte stream of one chunk in the "bytes" modes (a small
    tensor's plane), ``counts`` its exact 256-bin histogram: the same choice, bytes and
    fields, without the per-chunk arrays (a tensor of a few hundred elements spent 0.1
    ms a plane in them, more than coding it)."""
    n = sym.size
    lengths = hk.code_lengths(counts, hk.MAX_CODE_LEN)
    bits = int(counts @ lengths.astype(np.int64))
    const = bool((counts == n).any())
    score = np.array([[float((bits + 7) // 8)], [float(n)],
                      [0.0 if const else float(_NOT_CONST_BYTES)]])
    score[1] *= RAW_MARGIN
    modes = modes_for("bytes", 8)                 # HUFFMAN, RAW, CONST: score's rows
    mode = modes[int(_choose(score, modes, {HUFFMAN: lengths})[0])]
    nbytes = {HUFFMAN: (bits + 7) // 8, RAW: n, CONST: 0}[mode]
    consts = np.zeros(1, np.uint8)
    used = {}
    if mode == HUFFMAN:
        used[HUFFMAN] = lengths
        coded = np.empty(nbytes, np.uint8)
        end = hk.encode_symbols(sym, 0, n, hk.canonical_codes(lengths), lengths, coded, 0,
                                NO_FLOATS, NO_FLOATS, False)
        if end != nbytes:
            raise AssertionError(f"chunk 0: wrote {end} bytes, planned {nbytes}")
        part = coded
    elif mode == CONST:
        consts[0] = int(np.argmax(counts))
        part = np.empty(0, np.uint8)
    else:
        part = sym[:n]
    return Encoded(np.full(1, mode, np.uint8), consts, np.full(1, nbytes, np.int64), used,
                   [part], {HUFFMAN: bits, RAW: 8 * n})


LAZY_BATCH = 1 << 20    # coded bytes per batch of chunks when coding as the file is written


def encode(sym: np.ndarray, an: Analysis, modes, cache: CodeCache | None = None,
           apply=None, nonzero=None, lazy: bool = False, chunks=None) -> Encoded:
    """Choose a mode per chunk (fewest bytes among ``modes``) and code the stream.

    ``lazy``: sizes are planned here, but ``parts`` is an iterator coding the chunks a
    batch at a time (:func:`_batches`) as a file takes them, once, so the tensor's coded
    bytes are never all held; ``apply`` advances as they are coded. Raw modes refused.

    ``apply=(centroids, fout)``: while coding, add each nonzero symbol's centroid into
    ``fout`` (the delta encoder's reference update, exactly as the decoder makes it).
    ``nonzero=(listed, starts)``: the nonzero symbols as the quantizer lists them, chunk
    ``c``'s at ``listed[starts[c]:starts[c + 1]]`` (see
    :func:`lcckpt.codec.kernels.runs.encode_runs_listed`); runs chunks are then coded from
    the list alone. ``sym`` may be a callable returning the symbols (see
    :func:`analyze`), called only if some chunk's mode reads them. ``chunks(c, out)``
    (with ``lazy``, ``sym`` unused): writes chunk ``c``'s symbols into ``out`` just
    before it is coded, so no more than a chunk per thread is ever held.
    """
    _check(modes, apply, nonzero, lazy, chunks)
    b = an.b
    modes = _codeable(an, modes)
    chunk_modes, nbytes, lengths, mode_bits = _plan(an, modes, cache)
    present = set(chunk_modes.tolist())
    if callable(sym):               # called only if some chunk's mode reads every symbol
        listed = RUNS if nonzero is not None else -1
        sym = sym() if present - {CONST, listed} else NO_SYMBOLS
    consts = np.zeros(an.nchunks, np.uint8)
    if CONST in present:
        is_c = chunk_modes == CONST
        consts[is_c] = np.argmax(an.hist[HUFFMAN][is_c], axis=1)
    used = {m: lengths[m] for m in CODED_MODES if m in present}
    codes = {m: hk.canonical_codes(l) for m, l in used.items()}
    # Coded chunks go to one new buffer; raw chunks stay views of ``sym`` (no copy).
    is_raw = chunk_modes == RAW
    offsets = np.zeros(an.nchunks + 1, np.int64)
    np.cumsum(np.where(is_raw, 0, nbytes) if RAW in present else nbytes, out=offsets[1:])
    coded = np.empty(0 if lazy else int(offsets[-1]), np.uint8)
    g, S = group_size(b), 1 << b
    cs = an.chunk_size

    applying = apply is not None
    cent, fout = apply if applying else (NO_FLOATS, NO_FLOATS)

    sym_all = sym

    def task(c, coded=coded, base=0):
        lo, hi = c * cs, min(an.n, (c + 1) * cs)
        m, pos = chunk_modes[c], int(offsets[c]) - base
        if chunks is not None and m != CONST:     # this chunk's symbols, at 0..hi-lo
            sym, f = chunks(c, chunk_buffer(cs)), fout[lo:hi] if applying else fout
            lo, hi = 0, hi - lo
        else:
            sym, f = sym_all, fout
        if m == HUFFMAN:
            end = hk.encode_symbols(sym, lo, hi, codes[m], used[m], coded, pos, cent, f,
                                    applying)
        elif m == GROUPED:
            end = rk.encode_grouped(sym, lo, hi, g, b, codes[m], used[m], coded, pos, cent, f,
                                    applying)
        elif m == RUNS and nonzero is not None:
            nz = nonzero[0][nonzero[1][c]:nonzero[1][c + 1]]
            end = rk.encode_runs_listed(sym, lo, hi, nz, S, codes[m], used[m], coded, pos, cent,
                                        f, applying)
        elif m == RUNS:
            end = rk.encode_runs(sym, lo, hi, S, codes[m], used[m], coded, pos, cent, f,
                                 applying)
        else:
            end = pos
            if applying and m == CONST and consts[c]:
                f[lo:hi] += cent[consts[c]]
        if end != offsets[c + 1] - base:
            raise AssertionError(f"chunk {c}: wrote {end - pos} bytes, planned {nbytes[c]}")
    if lazy:
        return Encoded(chunk_modes, consts, nbytes, used, _batches(task, offsets), mode_bits)
    if not is_raw.all():
        run_tasks(task, an.nchunks)
    parts = _pieces(sym, coded, offsets, is_raw, cs, an.n)
    return Encoded(chunk_modes, consts, nbytes, used, parts, mode_bits)


def _check(modes, apply, nonzero, lazy: bool, chunks) -> None:
    if RAW in modes and (lazy or apply is not None):
        raise ValueError("raw chunks are not coded lazily, nor advance a reference")
    if chunks is not None and (not lazy or nonzero is not None):
        raise ValueError("symbols made chunk by chunk are coded lazily, without a list")


def _plan(an: Analysis, modes, cache) -> tuple:
    """``(mode of every chunk, its bytes, each coded mode's code lengths, total bits per
    mode)``: per chunk the mode of fewest bytes (see :func:`_choose`)."""
    lengths = _code_lengths(an, modes, cache)
    stacked, mode_bits = _chunk_bytes(an, modes, lengths)
    score = stacked.astype(np.float64)
    if RAW in modes:                 # coding must pay for its slower decode
        score[list(modes).index(RAW)] *= RAW_MARGIN
    choice = _choose(score, modes, lengths)
    nbytes = stacked[choice, np.arange(an.nchunks)].astype(np.int64)
    return np.asarray(modes, np.uint8)[choice], nbytes, lengths, mode_bits


def _codeable(an: Analysis, modes) -> list:
    """``modes`` less the coded ones not analyzed, and those whose letters :func:`fit_codes`
    does not fit: Huffman if none is left."""
    return [m for m in modes if m not in CODED_MODES
            or (m in an.hist and fit_codes(an.hist[m].sum(axis=0)))] or [HUFFMAN]


def fit_codes(counts: np.ndarray) -> bool:
    """Whether the letters used in ``counts`` can all have codes of at most MAX_CODE_LEN
    bits (2**12 of them: a stream of 8-bit symbols after zero runs of many lengths can
    use more runs letters than that, and :func:`hk.code_lengths` would over-subscribe)."""
    return np.count_nonzero(counts) <= 1 << hk.MAX_CODE_LEN


def _code_lengths(an: Analysis, modes, cache) -> dict:
    """Each coded mode's code lengths, from its symbol counts (or the cached table, kept
    while :data:`CACHE_SLACK` allows: see :func:`lcckpt.codec.kernels.plan.code_for`)."""
    lengths = {}
    for m in modes:
        if m in CODED_MODES:
            old = cache.lengths.get(m) if cache is not None else None
            fresh, keep = pk.code_for(an.hist[m], NO_CODE if old is None else old,
                                      hk.MAX_CODE_LEN, CACHE_SLACK)
            if cache is None:
                lengths[m] = fresh
            elif keep:
                cache.hits += 1
                lengths[m] = old
            else:
                cache.misses += 1
                lengths[m] = cache.lengths[m] = fresh
    return lengths


def _chunk_bytes(an: Analysis, modes, lengths) -> tuple[np.ndarray, dict]:
    """``(bytes of every chunk in every mode, total bits per mode but CONST)``."""
    stacked = np.empty((len(modes), an.nchunks), np.int64)
    mode_bits = {}
    for i, m in enumerate(modes):
        if m in CODED_MODES:
            extra = an.extra_bits if m == RUNS else NO_EXTRA
            mode_bits[m] = pk.coded_bytes(an.hist[m], lengths[m], extra, stacked[i])
        elif m == RAW:
            stacked[i] = an.chunk_lens()
            mode_bits[m] = 8 * an.n
        elif m == CONST:
            pk.const_bytes(an.hist[HUFFMAN], an.n, an.chunk_size, _NOT_CONST_BYTES, stacked[i])
        else:
            raise ValueError(m)
    return stacked, mode_bits


def _batches(task, offsets: np.ndarray):
    """Code chunks ``[c, d)`` at a time into a buffer of their own and yield it; batches
    end where the coded bytes pass :data:`LAZY_BATCH`, but hold a chunk per thread at
    least (a chunk is never split)."""
    nch, c = offsets.size - 1, 0
    while c < nch:
        d = int(np.searchsorted(offsets, offsets[c] + LAZY_BATCH, side="right")) - 1
        d = min(nch, max(d, c + threads()))
        base = int(offsets[c])
        buf = np.empty(int(offsets[d]) - base, np.uint8)
        run_tasks(lambda k, c=c, buf=buf, base=base: task(c + k, buf, base), d - c)
        yield buf
        c = d


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
    table can outweigh everything its mode saves. (Compiled: in numpy this took more
    time than coding a small tensor.)
    """
    coded = np.array([i for i, m in enumerate(modes) if m in CODED_MODES], np.int64)
    table = np.zeros(len(modes), np.int64)
    for i in coded:
        table[i] = lengths_size(lengths[modes[i]])
    choice = np.empty(score.shape[1], np.int64)
    if not sk.choose_modes(np.ascontiguousarray(score, np.float64), coded, table, choice):
        choice = np.argmin(score, axis=0)       # nothing finite: let argmin decide
    return choice


def lengths_size(lengths: np.ndarray) -> int:
    """Bytes :func:`lcckpt.codec.streams._write_lengths` spends on a code table: the kind
    byte and the smallest of its layouts."""
    return 1 + min(tk.layout_sizes(np.ascontiguousarray(lengths, np.uint8)))


NO_SYMBOLS = np.zeros(1, np.uint8)
NO_FLOATS = np.zeros(1, np.float32)
NO_CODE = np.zeros(0, np.uint8)         # no cached code
NO_EXTRA = np.zeros(0, np.int64)        # a coded mode without raw extra bits
