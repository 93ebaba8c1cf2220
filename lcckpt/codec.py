"""The tensor codec: one array in, one self-describing blob out, and back.

Blob layout (little-endian; ``uvar`` = unsigned LEB128):

    "LCC" version:u8  kind:u8 (1 lossy, 2 lossless)  dtype:u8  ndim:uvar  dims:uvar*
    log2(chunk_size):u8
    lossy:    bits:u8  flags:u8 (bit0 midpoint)  kept:u8  centroids[1..kept] (fp32; fp64 for F64)
              stream tables (see entropy.write_tables)
    lossless: nplanes:u8  rotate:u8  stream tables per plane
    crc32(header):u32   payload   crc32(payload):u32

A lossy blob holds a quantized *delta*: decoding adds it to a reference (zeros for a
stand-alone ``encode``). A lossless blob holds exact values. See docs/algorithm.md.
"""

import zlib
from dataclasses import dataclass, field

import numpy as np

from . import _crc, dtypes, entropy, lossless
from ._pool import run_tasks
from ._wire import Reader, Writer
from .errors import (ChecksumError, CorruptDataError, InvalidArgumentError, TruncatedError,
                     UnsupportedDtypeError, UnsupportedVersionError)
from .quantize import Quantized, quantize

MAGIC = b"LCC"
VERSION = 1
LOSSY, LOSSLESS = 1, 2
DEFAULT_CHUNK_LOG2 = 18          # 256 Ki elements: L2-sized symbol chunks, many per thread
MIN_CHUNK_LOG2, MAX_CHUNK_LOG2 = 10, 24
MAX_NDIM = 64


@dataclass
class EncodeStats:
    """What one encode did; every number comes from the passes the encode made anyway."""
    n: int
    dtype: str
    kind: str                          # "lossy" or "lossless"
    bits: int | None = None            # bits actually used (the guard may raise them)
    coder: str | None = None
    nbytes: int = 0
    payload_bytes: int = 0             # the coded symbols alone, without header and tables
    chunk_modes: dict = field(default_factory=dict)   # mode name -> number of chunks
    kept_buckets: int = 0
    nonzero_fraction: float = 0.0
    bucket_entropy: float = 0.0        # bits/element of the (sign, exponent) keys, before promotion
    symbol_entropy: float = 0.0        # bits/element of the symbols (order-0): per-element floor
    mode_bits: dict = field(default_factory=dict)     # mode -> bits/element were it used alone
                                                      # (the modes evaluated; see analyze)
    rel_error: float = 0.0             # ||u - reconstruction|| / ||u||
    symbol_counts: list = field(default_factory=list)  # elements per symbol (0 = zero)
    tried_bits: list = field(default_factory=list)
    fallback: str | None = None        # why a lossy request became lossless

    @property
    def bits_per_element(self) -> float:
        return 8 * self.nbytes / self.n if self.n else 0.0


def _chunk_log2(chunk_size: int | None) -> int:
    if chunk_size is None:
        return DEFAULT_CHUNK_LOG2
    c = int(chunk_size)
    if c & (c - 1) or not (1 << MIN_CHUNK_LOG2) <= c <= (1 << MAX_CHUNK_LOG2):
        raise InvalidArgumentError(
            f"chunk_size must be a power of two in [2**{MIN_CHUNK_LOG2}, 2**{MAX_CHUNK_LOG2}],"
            f" got {chunk_size}")
    return c.bit_length() - 1


def _check_bits(bits):
    if not isinstance(bits, (int, np.integer)) or not 1 <= bits <= 4:
        raise InvalidArgumentError(f"bits must be an integer from 1 to 4, got {bits!r}")


def _header(kind: int, dt: dtypes.DType, shape, log2: int) -> Writer:
    w = Writer()
    w.raw(MAGIC)
    w.u8(VERSION)
    w.u8(kind)
    w.u8(dt.code)
    w.uvar(len(shape))
    for d in shape:
        w.uvar(int(d))
    w.u8(log2)
    return w


def _finish(w: Writer, payloads) -> bytes:
    """Header, its checksum, the payloads and theirs, joined with a single copy."""
    return b"".join(_finish_parts(w, payloads))


def _finish_parts(w: Writer, payloads) -> list:
    """The blob as a list of pieces: header with its checksum, payloads, their checksum.

    A container section can be written from the pieces directly, so a large keyframe is
    never copied into one buffer (:func:`blob_nbytes` is its size).
    """
    w.u32(zlib.crc32(w.buf))
    crc = 0
    parts = [bytes(w.buf)]
    for p in payloads:
        mv = memoryview(p).cast("B")
        crc = _crc.crc32(mv, crc)
        parts.append(mv)
    parts.append(crc.to_bytes(4, "little"))
    return parts


def blob_nbytes(blob) -> int:
    """Size of a blob given as bytes or as a list of pieces."""
    if isinstance(blob, list):
        return sum(memoryview(p).nbytes for p in blob)
    return len(blob)


def _entropy_stats(st: EncodeStats, q: Quantized, enc, n: int):
    counts = q.sym_hist.sum(axis=0)
    keys = np.append(q.key_counts, n - q.key_counts.sum())       # zeros as one more key
    st.kept_buckets = q.kept
    st.payload_bytes = enc.size
    st.symbol_counts = counts.tolist()
    st.nonzero_fraction = 1 - counts[0] / n if n else 0.0
    st.symbol_entropy = entropy.entropy_bits(counts) / n if n else 0.0
    st.bucket_entropy = entropy.entropy_bits(keys) / n if n else 0.0
    st.mode_bits = {entropy.MODE_NAMES[m]: b / n for m, b in enc.mode_bits.items()} if n else {}
    names, cnt = np.unique(enc.modes, return_counts=True)
    st.chunk_modes = {entropy.MODE_NAMES[m]: int(c) for m, c in zip(names, cnt)}
    st.rel_error = q.rel_error


def encode_lossy(q: Quantized, dt: dtypes.DType, shape, bits: int, coder: str, log2: int,
                 midpoint: bool = False, cache=None, ref: np.ndarray | None = None):
    """Code a quantized delta; returns (blob, EncodeStats).

    With ``ref`` the reference advances by the delta while it is coded (the add the
    decoder makes), so the delta encoder needs no further pass over the symbols.
    """
    cs = 1 << log2
    n = q.sym.size
    modes = entropy.modes_for(coder, bits)
    an = entropy.analyze(q.sym, q.sym_hist, cs, bits, modes, (q.runs_hist, q.runs_extra))
    enc = entropy.encode(q.sym, an, modes, cache,
                         apply=None if ref is None else (q.centroids, ref))
    w = _header(LOSSY, dt, shape, log2)
    w.u8(bits)
    w.u8(1 if midpoint else 0)
    w.u8(q.kept)
    w.raw(q.centroids[1:q.kept + 1].tobytes())
    entropy.write_tables(w, enc)
    blob = _finish(w, enc.parts)
    st = EncodeStats(n, dt.name, "lossy", bits, coder, len(blob))
    _entropy_stats(st, q, enc, n)
    return blob, st


def encode_exact(a: np.ndarray, dt: dtypes.DType, log2: int, raw: bool = False) -> list:
    """Lossless blob of a numpy array (carrier view for bf16/fp8), as a list of pieces
    (:func:`_finish_parts`; ``b"".join`` them for one bytes object).

    When coding does not pay (small or random data: the code tables outweigh the saving)
    every plane is stored raw, so the blob is never more than a small header above the
    raw bytes; arrays of fewer than ``CODE_MIN_WORDS`` words are not analysed at all.
    ``raw=True`` stores the planes raw from the start: larger, but decoding is a single
    interleaving pass (for keyframes that must restore fast).
    """
    words, rotate = lossless.words_of(a, dt.kind)
    if raw or words.size < CODE_MIN_WORDS:
        return _exact_blob(a, dt, log2, words, rotate, lossless.raw_planes(words, rotate, 1 << log2))
    blob = _exact_blob(a, dt, log2, words, rotate, lossless.encode_planes(words, rotate, 1 << log2))
    if blob_nbytes(blob) > a.nbytes + RAW_SLACK:
        blob = _exact_blob(a, dt, log2, words, rotate,
                           lossless.raw_planes(words, rotate, 1 << log2))
    return blob


RAW_SLACK = 32
CODE_MIN_WORDS = 256    # below this a code table outweighs what coding saves (tens of bytes
                        # at most), and analysing four planes costs a millisecond of Python


def _exact_blob(a, dt, log2, words, rotate, encs) -> list:
    w = _header(LOSSLESS, dt, a.shape, log2)
    w.u8(len(encs))
    w.u8(1 if rotate else 0)
    for e in encs:
        entropy.write_tables(w, e)
    return _finish_parts(w, [p for e in encs for p in e.parts])


def encode(x, bits: int = 2, coder: str = "auto", *, lossless: bool = False,
           error_bound: float | None = None, midpoint: bool = False,
           chunk_size: int | None = None, report: bool = False):
    """Encode an array or tensor to a self-describing blob.

    Lossy (default): LC-Checkpoint's exponent-bucket quantizer with ``2**bits - 1``
    buckets, then ``coder``: ``"huffman"`` (the paper's per-element code), ``"grouped"``,
    ``"runs"``, or ``"auto"`` (fewest bytes per chunk). ``error_bound`` caps the relative
    L2 error: more bits are tried (up to 4), then an exact blob. ``lossless=True`` codes
    any dtype exactly. With ``report=True`` returns ``(blob, EncodeStats)``.
    """
    a, dt = dtypes.to_numpy(x)
    log2 = _chunk_log2(chunk_size)
    if lossless:
        blob = b"".join(encode_exact(a, dt, log2))
        st = EncodeStats(a.size, dt.name, "lossless", nbytes=len(blob))
        return (blob, st) if report else blob
    _check_bits(bits)
    entropy.modes_for(coder, bits)
    if dt.kind != "float":
        raise UnsupportedDtypeError(
            f"lossy coding needs a floating dtype, got {dt.name}; use lossless=True")
    u = dtypes.to_float_work(a, dt).reshape(-1)
    blob, st, _ = guarded_encode(u, None, dt, a.shape, bits, coder, log2, midpoint,
                                 error_bound, exact=lambda: b"".join(encode_exact(a, dt, log2)))
    return (blob, st) if report else blob


def guarded_encode(u, ref, dt, shape, bits, coder, log2, midpoint, error_bound, exact,
                   cache=None, advance=False):
    """Lossy encode honouring ``error_bound``; returns (blob, stats, lossy).

    The quantizer runs at ``bits``, then with more bits while the error exceeds the bound;
    only the accepted quantization is entropy-coded. ``exact()`` makes the lossless
    fallback (then ``lossy`` is False). ``advance``: ``ref`` becomes the decoder's
    reconstruction of ``u`` when a lossy blob is returned (the caller resets it otherwise).
    """
    tried = []
    top = 4 if error_bound is not None else bits
    cs = 1 << log2
    for b in range(bits, top + 1):
        q = quantize(u, ref, b, cs, midpoint,
                     runs_stats=entropy.RUNS in entropy.modes_for(coder, b))
        tried.append(b)
        if error_bound is None or q.rel_error <= error_bound:
            blob, st = encode_lossy(q, dt, shape, b, coder, log2, midpoint, cache,
                                    ref if advance else None)
            st.tried_bits = tried
            return blob, st, True
    blob = exact()
    st = EncodeStats(u.size, dt.name, "lossless", nbytes=blob_nbytes(blob), tried_bits=tried,
                     fallback=f"relative error {q.rel_error:.3g} at {tried[-1]} bits "
                              f"exceeds the bound {error_bound:g}")
    return blob, st, False


# --- decoding --------------------------------------------------------------------------

@dataclass
class Parsed:
    kind: int
    dt: dtypes.DType
    shape: tuple
    n: int
    log2: int
    payload_base: int
    bits: int = 0
    midpoint: bool = False
    centroids: np.ndarray | None = None
    layouts: list = field(default_factory=list)
    rotate: bool = False


def parse(blob, check_payload: bool = True) -> tuple[np.ndarray, Parsed]:
    """Validate a blob completely (structure, sizes, both checksums) before any decode.

    ``check_payload=False`` skips the payload checksum, for callers that have just
    verified the same bytes themselves (a container section's CRC covers the whole blob).
    """
    buf = np.frombuffer(blob, np.uint8)
    r = Reader(buf, what="lcckpt blob")
    if len(buf) < 4 or bytes(buf[:3]) != MAGIC:
        raise CorruptDataError("not an lcckpt blob (bad magic); was it produced by lcckpt.encode?")
    r.pos = 3
    version = r.u8()
    if version != VERSION:
        raise UnsupportedVersionError(
            f"blob format version {version}; this lcckpt reads version {VERSION}: upgrade lcckpt")
    kind = r.u8()
    if kind not in (LOSSY, LOSSLESS):
        raise CorruptDataError(f"lcckpt blob: unknown kind {kind}")
    code = r.u8()
    if code not in dtypes.BY_CODE:
        raise CorruptDataError(f"lcckpt blob: unknown dtype code {code}")
    dt = dtypes.BY_CODE[code]
    ndim = r.uvar(MAX_NDIM, "ndim")
    shape = tuple(r.uvar(1 << 48, "dimension") for _ in range(ndim))
    n = int(np.prod(shape, dtype=object)) if shape else 1
    log2 = r.u8()
    if not MIN_CHUNK_LOG2 <= log2 <= MAX_CHUNK_LOG2:
        raise CorruptDataError(f"lcckpt blob: chunk size 2**{log2} out of range")
    cs = 1 << log2
    if -(-n // cs) > len(buf):             # every chunk costs at least one table byte
        raise CorruptDataError(f"lcckpt blob: shape {shape} is larger than the blob can describe")
    p = Parsed(kind, dt, shape, n, log2, 0)
    if kind == LOSSY:
        if dt.kind != "float":
            raise CorruptDataError(f"lcckpt blob: lossy kind with dtype {dt.name}")
        p.bits = r.u8()
        if not 1 <= p.bits <= 4:
            raise CorruptDataError(f"lcckpt blob: bits = {p.bits}")
        flags = r.u8()
        if flags & ~1:
            raise CorruptDataError(f"lcckpt blob: unknown flags {flags:#x}")
        p.midpoint = bool(flags & 1)
        kept = r.u8()
        if kept > (1 << p.bits) - 1:
            raise CorruptDataError(f"lcckpt blob: {kept} buckets exceed {p.bits} bits")
        work = np.float64 if dt.name == "F64" else np.float32
        p.centroids = np.zeros(1 << p.bits, work)
        p.centroids[1:kept + 1] = np.frombuffer(r.raw(kept * np.dtype(work).itemsize), work)
        if not np.all(np.isfinite(p.centroids)):
            raise CorruptDataError("lcckpt blob: non-finite centroid")
        allowed = entropy.modes_for("auto", p.bits)
        p.layouts = [entropy.read_tables(r, n, cs, p.bits, allowed)]
    else:
        nplanes = r.u8()
        words, rotate = lossless.words_of(np.empty((0,), dt.numpy), dt.kind)
        if nplanes != words.dtype.itemsize:
            raise CorruptDataError(f"lcckpt blob: {nplanes} byte planes for dtype {dt.name}")
        rot = r.u8()
        if rot != int(rotate):
            raise CorruptDataError("lcckpt blob: rotation flag does not match the dtype")
        p.rotate = rotate
        allowed = entropy.modes_for("bytes", 8)
        p.layouts = [entropy.read_tables(r, _words_n(n, dt), cs, 8, allowed)
                     for _ in range(nplanes)]
    hdr_end = r.pos
    stored = r.u32()
    if zlib.crc32(buf[:hdr_end]) != stored:
        raise ChecksumError("lcckpt blob: header checksum mismatch; the blob is damaged")
    p.payload_base = r.pos
    size = sum(int(lay.offsets[-1]) for lay in p.layouts)
    expect = p.payload_base + size + 4
    if len(buf) < expect:
        raise TruncatedError(f"lcckpt blob is truncated: {len(buf)} bytes, header promises {expect}")
    if len(buf) > expect:
        raise CorruptDataError(f"lcckpt blob has {len(buf) - expect} trailing bytes")
    crc = int.from_bytes(bytes(buf[expect - 4:expect]), "little")
    if check_payload and zlib.crc32(buf[p.payload_base:expect - 4]) != crc:
        raise ChecksumError("lcckpt blob: payload checksum mismatch; the blob is damaged")
    return buf, p


def _words_n(n, dt):
    return 2 * n if dt.kind == "complex" else n


def decode_symbols_into(buf, p: Parsed, out: np.ndarray):
    """Lossy blob: ``out += centroids[sym]`` (flat, work dtype), applied as the symbols are
    decoded, never stored."""
    entropy.decode(buf, p.payload_base, p.layouts[0], p.n, 1 << p.log2, p.bits, None,
                   "lcckpt blob", apply=(p.centroids, out))


def apply_deltas(parsed: list, ref: np.ndarray, base=None):
    """Add several lossy blobs to ``ref`` in order, chunk by chunk across the blobs.

    The result is bit-identical to decoding them one after another (each element sees the
    same adds in the same order), but every chunk of ``ref`` is loaded into cache once
    for all blobs instead of once per blob: replaying N deltas over a model larger than
    the cache costs one pass over memory, not N.

    ``base``: a lossless blob ``(buf, parsed)`` holding exactly ``ref``'s dtype and size
    (a keyframe), decoded into ``ref`` chunk by chunk before the deltas, in the same pass.
    """
    log2s = {p.log2 for _, p in parsed}
    if base is not None:
        if base[1].dt.numpy != ref.dtype or base[1].n != ref.size:
            raise ValueError("the base blob does not hold the reference's dtype and size")
        log2s.add(base[1].log2)
    if len(log2s) > 1:                           # different chunking: one blob at a time
        if base is not None:
            _run_exact(base[0], base[1], ref)
        for buf, p in parsed:
            decode_symbols_into(buf, p, ref)
        return
    if not log2s:
        return
    steps = [] if base is None else [_exact_decoder(base[0], base[1], ref)]
    steps += [entropy.StreamDecoder(buf, p.payload_base, p.layouts[0], p.n, 1 << p.log2,
                                    p.bits, None, "lcckpt blob", apply=(p.centroids, ref)).chunk
              for buf, p in parsed]

    def task(c):
        for step in steps:
            step(c)
    run_tasks(task, -(-ref.size // (1 << log2s.pop())))


def _exact_decoder(buf, p: Parsed, a: np.ndarray):
    """Per-chunk task decoding a lossless blob into the carrier array ``a``."""
    words, rotate = lossless.words_of(a, p.dt.kind)
    return lossless.plane_decoder(buf, p.payload_base, p.layouts, words.size, 1 << p.log2,
                                  rotate, words, "lcckpt blob")


def _run_exact(buf, p: Parsed, a: np.ndarray):
    run_tasks(_exact_decoder(buf, p, a), -(-_words_n(p.n, p.dt) // (1 << p.log2)))


def decode_exact(buf, p: Parsed) -> np.ndarray:
    """Lossless blob -> carrier array of the blob's shape."""
    a = np.empty(p.shape, p.dt.numpy)
    _run_exact(buf, p, a)
    return a


def decode(blob, *, check_payload: bool = True):
    """Decode a blob from :func:`encode`: same shape and dtype (numpy; torch for bf16/fp8)."""
    buf, p = parse(blob, check_payload)
    if p.kind == LOSSLESS:
        return dtypes.from_carrier(decode_exact(buf, p), p.dt)
    work = np.zeros(p.n, p.centroids.dtype)          # fresh zero pages: nothing to clear
    decode_symbols_into(buf, p, work)
    return dtypes.from_float_work(work.reshape(p.shape), p.dt)


def warmup():
    """Load (or compile, on the very first run) every kernel, so later calls are fast.

    Numba caches compiled kernels on disk; the first call in a process still pays for
    loading them. Call this at start-up to move that cost out of the first checkpoint.
    """
    rng = np.random.default_rng(0)
    for dt in (np.float32, np.float64):
        x = rng.standard_normal(4096).astype(dt)
        x[::3] = 0
        for coder in ("huffman", "grouped", "runs", "auto"):
            decode(encode(x, bits=2, coder=coder))
        decode(encode(x, lossless=True))
    for dt in (np.int64, np.float16, np.uint8):
        decode(encode(np.arange(64).astype(dt), lossless=True))
