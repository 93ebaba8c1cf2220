"""Exact coding of any fixed-width array: byte planes, each Huffman-coded or raw.

Floats are rotated left by one bit first so their exponent fills one plane (ZipNN's
observation: the exponent carries ~2.6 bits of entropy in 8, the mantissa is near
random). Every plane then goes through :mod:`lcckpt.codec.entropy` in the ``bytes`` modes:
per chunk the cheapest of Huffman, raw, or constant. Integers and bools use the same
path without rotation, so step counters and masks shrink too.

fp16, bf16 and fp32 arrays take a fused path (:func:`plan_floats`, :func:`fill_blob`;
read by :mod:`lcckpt.codec.floatread`): each chunk of exponents gets a code of its own
over pairs of exponent ranks (chunk mode "pairs", kernels/planes.py; on trained weights
1.6% smaller exponent planes than ZipNN's), or, when its exponents spread too wide for
that (fp16), the plane's shared Huffman code. Lower planes stay raw (trained weights'
mantissas are near random) but where a chunk's sample says coding pays: those chunks
(a pretrained embedding's untrained rows, values of few mantissas) share one code per
plane. The blob is written straight into one ``bytes`` object, and a run of chunks
decodes and merges in one compiled call; chunks go to whichever pool thread is free.
This module does not write headers or parse blobs: codec.py and blob.py do.
"""

import sys
import threading

import numpy as np

from ..util import crc as _crc, memory as _memory, pool as _pool
from . import entropy, streams
from ..util.pool import run_tasks
from ..errors import CorruptDataError
from .kernels import floats as fk
from .kernels import huffman as hk
from .kernels import planes as pk
from .kernels import runs as rk

_WORD = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}


def words_of(a: np.ndarray, kind: str) -> tuple[np.ndarray, bool]:
    """Flat unsigned-integer view of the element bits, and whether to rotate."""
    flat = a.reshape(-1)
    if kind == "complex":                 # a pair of floats per element
        flat = flat.view(np.float32 if a.dtype.itemsize == 8 else np.float64)
    item = flat.dtype.itemsize
    return flat.view(_WORD[item]), kind in ("float", "complex") and item > 1


CODE_IF_BELOW = 0.8     # code a mantissa plane only if it promises to save 20%: a 256-letter
                        # code decodes at ~4 ns per byte, a raw plane is read in place


def encode_planes(words: np.ndarray, rotate: bool, chunk_size: int):
    """Split into planes and code each; returns the list of :class:`entropy.Encoded`.

    The top plane of a float (its exponent) is counted exactly during the split; the
    other planes are sampled, recounted exactly only when the sample says coding pays,
    and otherwise stored raw as views of the plane.
    """
    n = words.size
    item = words.dtype.itemsize
    nch = -(-n // chunk_size)
    modes = entropy.modes_for("bytes", 8)
    if item == 1:
        planes = words.view(np.uint8).reshape(1, n)
        hist = np.zeros((nch, 1, 256), np.int64)
        sampled = [0]
    else:
        planes, hist = _split(words, rotate, chunk_size)
        sampled = list(range(item - 1)) + ([] if rotate else [item - 1])
    out = []
    for k in range(item):
        plane = planes[k]
        if k in sampled:
            if item > 1:
                sample = hist[:, k, :].sum(axis=0)
                total = int(sample.sum())
                if total == 0 or _sample_entropy(sample, total) > 8 * CODE_IF_BELOW:
                    out.append(entropy.raw_stream(plane, chunk_size))
                    continue
                hist[:, k, :] = 0

            def count(c, plane=plane, k=k):
                lo, hi = c * chunk_size, min(n, (c + 1) * chunk_size)
                fk.byte_histogram(plane, lo, hi, hist[c, k])
            run_tasks(count, nch)
        if nch == 1:                    # a small tensor: the same stream, less Python
            out.append(entropy.encode_bytes_chunk(plane, hist[0, k]))
            continue
        an = entropy.Analysis(n, chunk_size, 8, {entropy.HUFFMAN: hist[:, k, :]}, None)
        out.append(entropy.encode(plane, an, modes))
    return out


def _sample_entropy(sample: np.ndarray, total: int) -> float:
    """Bits per byte estimated from a sample, with the Miller-Madow correction: a small
    sample of a near-random plane looks skewed (80 draws from 256 values cannot show more
    than 6.3 bits), and coding it would cost a table for nothing."""
    used = int(np.count_nonzero(sample))
    return entropy.entropy_bits(sample) / total + (used - 1) / (2 * total * np.log(2))


def _split(words: np.ndarray, rotate: bool, chunk_size: int):
    """Planes and per-chunk histograms (top plane exact, the others sampled), chunk-parallel."""
    n = words.size
    item = words.dtype.itemsize
    nch = -(-n // chunk_size)
    planes = np.empty((item, n), np.uint8)
    hist = np.zeros((nch, item, 256), np.int64)
    split = fk.SPLIT[item]

    def task(c):
        lo, hi = c * chunk_size, min(n, (c + 1) * chunk_size)
        split(words, lo, hi, rotate, planes, hist[c])
    run_tasks(task, nch)
    return planes, hist


def raw_planes(words: np.ndarray, rotate: bool, chunk_size: int):
    """Every plane stored raw (still split, so the blob layout stays the same)."""
    if words.dtype.itemsize == 1:
        return [entropy.raw_stream(words.view(np.uint8), chunk_size)]
    planes, _ = _split(words, rotate, chunk_size)
    return [entropy.raw_stream(plane, chunk_size) for plane in planes]


def plane_decoder(buf: np.ndarray, base: int, layouts, n: int, chunk_size: int,
                  rotate: bool, words: np.ndarray, what: str):
    """``task(c)`` that decodes chunk ``c`` of every plane and interleaves it into ``words``.

    A plane stored raw throughout is read in place from ``buf``; a coded plane is decoded
    into a small per-thread buffer and merged right away, while it is in cache. The
    caller runs the task for every chunk, alone or as the first step of a larger
    per-chunk task (a keyframe followed by its deltas).
    """
    item = words.dtype.itemsize
    if item == 1:
        return streams.StreamDecoder(buf, base, layouts[0], n, chunk_size, 8,
                                     words.view(np.uint8), what).chunk
    raw, coded = {}, {}                  # plane -> its bytes in buf / its decoder
    for k, layout in enumerate(layouts):
        size = int(layout.offsets[-1])
        if base + size > buf.size:
            raise CorruptDataError(f"{what}: chunk table points past the end of the data")
        if np.all(layout.modes == entropy.RAW):      # read_tables checked every raw size
            raw[k] = _memory.read_only(buf[base:base + n])
        else:
            coded[k] = streams.StreamDecoder(buf, base, layout, n, chunk_size, 8, None, what)
        base += size
    merge = fk.MERGE[item]

    def task(c):
        lo, hi = c * chunk_size, min(n, (c + 1) * chunk_size)
        planes = []
        for k in range(item):
            if k in raw:
                planes.append(raw[k][lo:hi])
            else:
                block = _block(k, chunk_size)
                coded[k].chunk(c, block, lo)
                planes.append(_memory.read_only(block[:hi - lo]))
        merge(tuple(planes), 0, hi - lo, rotate, words[lo:hi])
    return task


_blocks = threading.local()


def _block(k: int, size: int) -> np.ndarray:
    """A per-thread buffer for decoded plane ``k`` of one chunk: small, reused, in cache,
    instead of a whole decoded plane in fresh memory."""
    bufs = getattr(_blocks, "bufs", None)
    if bufs is None:
        bufs = _blocks.bufs = {}
    b = bufs.get(k)
    if b is None or b.size < size:
        b = bufs[k] = np.empty(size, np.uint8)
    return b


# --- the fast path for floats -----------------------------------------------------------
# fp16, bf16 and fp32 with their exponent coded and the other planes raw (what trained
# weights always give): one counting pass over the words, then one pass that writes the
# raw planes and the coded exponents straight into the blob's buffer, the CRC of each
# piece taken while it is in cache. Same blobs as the general path, byte for byte in
# layout; anything else (integers, fp64, a lower plane worth coding) takes that path.

FAST_WIDTHS = (2, 4)
FAST_MIN_WORDS = 1 << 16      # blobs this large are written by the fast path,
FAST_DECODE_MIN_WORDS = 1 << 14     # and read by it from here on (docs/algorithm.md §6)


def plan_floats(words: np.ndarray, chunk_size: int):
    """Per-plane :class:`entropy.Encoded` descriptions for the fast path (no payload but
    the top plane's "pairs" chunks, coded here and kept in its ``parts``, one entry per
    chunk). A lower plane is raw but where its sample, as a whole or in some chunks (a
    pretrained embedding's untrained rows), promises that coding pays
    (:func:`_plan_lower`).

    Each chunk of exponents gets its own pair code (:func:`pk.pairs_encode`) unless its
    exponents spread too wide for 15 ranks; then, and wherever it is smaller, the
    chunk takes the plane's shared Huffman code, raw bytes, or a constant.
    """
    n = words.size
    item = words.dtype.itemsize
    nch = -(-n // chunk_size)
    hist = np.zeros((nch, item, 256), np.int64)
    pieces = [None] * nch

    def code(c):
        lo, hi = c * chunk_size, min(n, (c + 1) * chunk_size)
        escaped, scratch = _scratch(hi - lo)
        size = pk.pairs_encode(words, lo, hi, item, escaped, scratch, hist[c],
                               int(PAIRS_MAX_ESCAPES * (hi - lo)))
        if size >= 0:
            pieces[c] = scratch[:size].copy()
        else:                            # exact counts for the plane's shared code
            hist[c] = 0
            pk.top_histogram(words, lo, hi, item, hist[c])
    _pool.run_balanced(code, nch)
    lower = {}                       # plane -> the chunks whose samples look codeable
    for k in range(item - 1):
        sample = hist[:, k, :].sum(axis=0)
        total = int(sample.sum())
        if total and _sample_entropy(sample, total) <= 8 * CODE_IF_BELOW:
            lower[k] = np.ones(nch, bool)               # the plane as a whole
            continue
        chunks = codeable_chunks(hist[:, k, :])
        if chunks.any():
            lower[k] = chunks
    sizes = np.minimum(chunk_size, n - np.arange(nch, dtype=np.int64) * chunk_size)
    raw = entropy.Encoded(np.full(nch, entropy.RAW, np.uint8), np.zeros(nch, np.uint8),
                          sizes, {}, [], {entropy.RAW: 8 * n})
    paired = np.array([x is not None for x in pieces])
    top = np.where(paired[:, None], 0, hist[:, item - 1, :])    # exact counts, unpaired
    lengths = hk.code_lengths(top.sum(axis=0), hk.MAX_CODE_LEN)
    coded = (top @ lengths.astype(np.int64) + 7) // 8
    modes = np.where(coded < entropy.RAW_MARGIN * sizes, entropy.HUFFMAN, entropy.RAW)
    is_const = (top == sizes[:, None]).any(axis=1)
    consts = np.argmax(top, axis=1)
    nbytes = np.where(modes == entropy.HUFFMAN, coded, sizes)
    for c in np.flatnonzero(paired):
        piece = pieces[c]
        if piece[0] == 1 and not piece[1 + 1 + 128:1 + 1 + 128 + 4].any():
            is_const[c], consts[c] = True, piece[1]     # one exponent, no escapes
        elif piece.size < entropy.RAW_MARGIN * sizes[c]:
            modes[c], nbytes[c] = entropy.PAIRS, piece.size
        else:
            modes[c], nbytes[c] = entropy.RAW, sizes[c]
    modes = np.where(is_const, entropy.CONST, modes).astype(np.uint8)
    consts = np.where(is_const, consts, 0).astype(np.uint8)
    huff = modes == entropy.HUFFMAN
    if huff.any() and (sizes - coded)[huff].sum() <= entropy.lengths_size(lengths):
        modes[huff] = entropy.RAW               # the table would cost more than it saves
        nbytes[huff] = sizes[huff]
        huff[:] = False
    nbytes = np.where(is_const, 0, nbytes).astype(np.int64)
    used = {entropy.HUFFMAN: lengths} if huff.any() else {}
    parts = [x if m == entropy.PAIRS else None for x, m in zip(pieces, modes)]
    top_enc = entropy.Encoded(modes, consts, nbytes, used, parts, {})
    counts, letters = _lower_counts(words, chunk_size, lower) if lower else (None, None)
    runs = _runs_sizes(letters, nch, item - 1) if lower else None
    return [_plan_lower(counts[:, k], sizes, lower[k], runs[0][k], runs[1][:, k])
            if k in lower else raw for k in range(item - 1)] + [top_enc]


PAIRS_MAX_ESCAPES = 1 / 32    # past this share of escaped exponents a chunk is not paired
CHUNK_MIN_SAMPLES = 1024      # a chunk's sample this large is judged on its own


def codeable_chunks(samples: np.ndarray) -> np.ndarray:
    """Per chunk (a row of sampled byte counts), whether its sample of at least
    :data:`CHUNK_MIN_SAMPLES` bytes promises what coding a plane must save."""
    totals = samples.sum(axis=1)
    big = totals >= CHUNK_MIN_SAMPLES
    if not big.any():
        return big
    h, t = samples[big].astype(np.float64), totals[big].astype(np.float64)[:, None]
    with np.errstate(divide="ignore", invalid="ignore"):
        bits = -np.where(h > 0, h * np.log2(h / t), 0.0).sum(axis=1) / t[:, 0]
    bits += (np.count_nonzero(h, axis=1) - 1) / (2 * t[:, 0] * np.log(2))   # as _sample_entropy
    out = np.zeros(len(samples), bool)
    out[big] = bits <= 8 * CODE_IF_BELOW
    return out


def _lower_counts(words: np.ndarray, chunk_size: int, lower: dict):
    """Exact counts ``[chunk, plane, byte]`` of the lower planes, in the chunks that some
    plane of ``lower`` picked (zeros elsewhere): one read of each such chunk; and where a
    chunk's planes are mostly zero bytes, their zero-runs letters (:func:`_runs_sizes`),
    read again while the chunk is in cache."""
    n, item = words.size, words.dtype.itemsize
    nch = -(-n // chunk_size)
    counts = np.zeros((nch, item - 1, 256), np.int64)
    picked = np.flatnonzero(np.any(list(lower.values()), axis=0))
    letters = {}                          # chunk -> per plane (letters used, counts, extra)
    local = threading.local()

    def count(j):
        c = picked[j]
        lo, hi = c * chunk_size, min(n, (c + 1) * chunk_size)
        pk.lower_histogram(words, lo, hi, item, counts[c])
        if counts[c, :, 0].max() < RUNS_MIN_ZEROS * (hi - lo):
            return
        if not hasattr(local, "hist"):
            local.hist = np.zeros((item - 1, entropy.alphabet(entropy.RUNS, 8)), np.int64)
        hist, extra = local.hist, np.zeros(item - 1, np.int64)
        hist[:] = 0
        pk.lower_runs_histogram(words, lo, hi, item, hist, extra)
        used = [np.flatnonzero(h) for h in hist]          # a few hundred letters each
        letters[c] = [(u.astype(np.int16), hist[k, u].astype(np.int32), int(extra[k]))
                      for k, u in enumerate(used)]     # (a chunk holds < 2**24 letters)
    run_tasks(count, picked.size)
    return counts, letters


RUNS_MIN_ZEROS = 0.5    # a chunk whose lower planes are this much zero bytes is also sized
NOT_CODED = np.int64(1) << 62   # as zero runs; the bytes of a chunk that is not


def _runs_sizes(letters: dict, nch: int, planes: int):
    """Zero runs for the lower planes (a fine-tune's moments of unused embedding rows are
    exact zeros, which a Huffman code cannot store in under a bit a byte): per plane a
    code fitted to the letters of the chunks whose planes are mostly zero bytes, and
    each such chunk's bytes under it, NOT_CODED for the others."""
    alphabet = entropy.alphabet(entropy.RUNS, 8)
    lengths = np.zeros((planes, alphabet), np.uint8)
    nbytes = np.full((nch, planes), NOT_CODED, np.int64)
    for k in range(planes):
        total = np.zeros(alphabet, np.int64)
        for per_plane in letters.values():
            used, n, _ = per_plane[k]
            total[used] += n
        if not total.any() or not entropy.fit_codes(total):
            continue
        lengths[k] = hk.code_lengths(total, hk.MAX_CODE_LEN)
        for c, per_plane in letters.items():
            used, n, extra = per_plane[k]
            nbytes[c, k] = (int(n.astype(np.int64) @ lengths[k, used]) + extra + 7) // 8
    return lengths, nbytes


def _plan_lower(hist: np.ndarray, sizes: np.ndarray, chunks: np.ndarray,
                runs_lengths: np.ndarray, runs_bytes: np.ndarray):
    """A lower plane from its chunks' exact counts ``hist``: the chunks of ``chunks``
    coded where that beats raw (or constant), every other chunk raw. A coded chunk takes
    one Huffman code fitted to them all, or, mostly zero bytes, the zero runs' code
    (``runs_lengths``, under which it takes ``runs_bytes``; see :func:`_runs_sizes`):
    whichever is smaller. A code whose chunks save less than its table is dropped."""
    hist = np.where(chunks[:, None], hist, 0)
    lengths = hk.code_lengths(hist.sum(axis=0), hk.MAX_CODE_LEN)
    coded = (hist @ lengths.astype(np.int64) + 7) // 8
    is_const = chunks & (hist == sizes[:, None]).any(axis=1)
    fits = chunks & ~is_const
    runs = fits & (runs_bytes < coded) & (runs_bytes < entropy.RAW_MARGIN * sizes)
    if runs.any() and (np.minimum(coded, sizes) - runs_bytes)[runs].sum() \
            <= entropy.lengths_size(runs_lengths):
        runs[:] = False                       # the table would cost more than it saves
    huff = fits & ~runs & (coded < entropy.RAW_MARGIN * sizes)
    if huff.any() and (sizes - coded)[huff].sum() <= entropy.lengths_size(lengths):
        huff[:] = False
    modes = np.where(is_const, entropy.CONST, np.where(
        huff, entropy.HUFFMAN, np.where(runs, entropy.RUNS, entropy.RAW)))
    nbytes = np.where(is_const, 0, np.where(huff, coded, np.where(runs, runs_bytes, sizes)))
    consts = np.where(is_const, np.argmax(hist, axis=1), 0).astype(np.uint8)
    used = {m: t for m, t, on in ((entropy.HUFFMAN, lengths, huff),
                                  (entropy.RUNS, runs_lengths, runs)) if on.any()}
    return entropy.Encoded(modes.astype(np.uint8), consts, nbytes.astype(np.int64), used,
                           [], {})


def _scratch(m: int):
    """Per-thread buffers for coding one chunk of ``m`` exponents in pairs."""
    bufs = getattr(_blocks, "pairs", None)
    if bufs is None or bufs[0].size < m:
        bufs = _blocks.pairs = (np.empty(m, np.uint8), np.empty(pk.pairs_bound(m), np.uint8))
    return bufs


def fill_blob(words: np.ndarray, encs, chunk_size: int, head: bytes):
    """The whole blob: ``head``, the payload planned by :func:`plan_floats`, and the
    payload's CRC-32, written into one new ``bytes`` object (a blob of hundreds of MB is
    never assembled by copying pieces)."""
    size = sum(e.size for e in encs)
    blob, out = _new_bytes(len(head) + size + 4)
    out[:len(head)] = np.frombuffer(head, np.uint8)
    crc = fill_floats(words, encs, chunk_size, out, len(head))
    out[len(head) + size:] = np.frombuffer(crc.to_bytes(4, "little"), np.uint8)
    return blob if isinstance(blob, bytes) else bytes(blob)


def _new_bytes(size: int):
    """A new ``bytes`` object of ``size`` bytes and a writable array over its storage,
    which the caller fills completely before the object is shared or hashed (CPython;
    elsewhere a bytearray that :func:`fill_blob` copies into ``bytes``)."""
    if _PyBytes is None:                       # pragma: no cover - not CPython
        b = bytearray(size)
        return b, np.frombuffer(b, np.uint8)
    b = _PyBytes(None, size)
    view = (ctypes.c_char * size).from_address(id(b) + _BYTES_DATA)
    return b, np.frombuffer(view, np.uint8)


try:                             # the storage of a bytes object starts at this offset
    import ctypes
    _BYTES_DATA = bytes.__basicsize__ - 1
    _PyBytes = ctypes.pythonapi.PyBytes_FromStringAndSize
    _PyBytes.restype = ctypes.py_object
    _PyBytes.argtypes = (ctypes.c_char_p, ctypes.c_ssize_t)
    if sys.implementation.name != "cpython":
        _PyBytes = None
except (ImportError, AttributeError):      # pragma: no cover - not CPython
    _PyBytes = None


def fill_floats(words: np.ndarray, encs, chunk_size: int, out: np.ndarray, base: int) -> int:
    """Write the payload planned by :func:`plan_floats` into ``out[base:]``; returns its
    CRC-32 (zlib's), combined from per-chunk pieces taken while they are in cache. A
    chunk with a coded lower plane is split into a per-thread buffer first, and coded
    from there."""
    n = words.size
    item = words.dtype.itemsize
    nch = -(-n // chunk_size)
    starts = base + np.concatenate(([0], np.cumsum([e.size for e in encs])))
    at = np.stack([starts[k] + np.concatenate(([0], np.cumsum(encs[k].nbytes)))
                   for k in range(item)])               # where each plane's chunks begin
    top = encs[-1]
    lengths = top.lengths.get(entropy.HUFFMAN, np.zeros(256, np.uint8))
    codes = hk.canonical_codes(lengths)
    pairs = pk.pair_codes(codes, lengths) if entropy.HUFFMAN in top.lengths else _NO_PAIRS
    mode_map = {entropy.HUFFMAN: pk.TOP_HUFFMAN, entropy.RAW: pk.TOP_RAW,
                entropy.CONST: pk.TOP_CONST, entropy.PAIRS: pk.TOP_CONST}
    lower = {(k, m): (hk.canonical_codes(t), t) for k, e in enumerate(encs[:-1])
             for m, t in e.lengths.items()}       # (plane, mode) -> its code
    split = np.zeros(nch, bool)
    for e in encs[:-1]:
        split |= e.modes != entropy.RAW
    crcs = np.zeros((item, nch), np.int64)

    def task(c):
        lo, hi = c * chunk_size, min(n, (c + 1) * chunk_size)
        s, e = int(at[-1, c]), int(at[-1, c + 1])
        mode = int(top.modes[c])
        if split[c]:
            end = s + _split_chunk(words, c, lo, hi, encs, lower, out, at[:, c],
                                   mode_map[mode], e - s, codes, lengths, pairs)
        else:
            end = pk.split_code(words, lo, hi, item, out, at[:-1, c], mode_map[mode], s, e,
                                codes, lengths, pairs)
        if mode == entropy.PAIRS:
            out[s:e] = top.parts[c]
            end = e
        if end != e:
            raise AssertionError(f"chunk {c}: wrote {end - s} bytes, planned {e - s}")
        for k in range(item):
            crcs[k, c] = _crc.piece_crc32(out[at[k, c]:at[k, c + 1]])
    _pool.run_balanced(task, nch)
    sizes = [e.nbytes for e in encs]
    return _crc.combine_all(crcs, sizes)


def _split_chunk(words, c, lo, hi, encs, lower, out, at, top_mode, top_size, codes,
                 lengths, pairs) -> int:
    """Chunk ``c``'s planes split into a per-thread buffer, then each written to ``out``
    at ``at[k]``: raw, coded with its plane's code, or nothing (constant); returns the
    top plane's bytes written."""
    item, m = len(encs), hi - lo
    buf = getattr(_blocks, "split", None)
    if buf is None or buf.size < item * m + 8:
        buf = _blocks.split = np.empty(item * (m + 8), np.uint8)
    raw_pos = np.arange(item - 1, dtype=np.int64) * m
    t0 = (item - 1) * m
    wrote = pk.split_code(words, lo, hi, item, buf, raw_pos, top_mode, t0, t0 + top_size,
                          codes, lengths, pairs) - t0
    out[at[-1]:at[-1] + wrote] = buf[t0:t0 + wrote]
    for k, e in enumerate(encs[:-1]):
        mode, pos = e.modes[c], int(at[k])
        if mode == entropy.RAW:
            out[pos:pos + m] = buf[k * m:(k + 1) * m]
        elif mode != entropy.CONST:
            pc, pl = lower[k, mode]
            if mode == entropy.HUFFMAN:
                end = hk.encode_symbols(buf, k * m, (k + 1) * m, pc, pl, out, pos,
                                        entropy.NO_FLOATS, entropy.NO_FLOATS, False)
            else:
                end = rk.encode_runs(buf, k * m, (k + 1) * m, 256, pc, pl, out, pos,
                                     entropy.NO_FLOATS, entropy.NO_FLOATS, False)
            if end != pos + int(e.nbytes[c]):
                raise AssertionError(f"chunk {c}, plane {k}: wrote {end - pos} bytes, "
                                     f"planned {int(e.nbytes[c])}")
    return wrote


_NO_PAIRS = np.zeros(1 << 16, np.uint32)
