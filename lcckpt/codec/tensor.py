"""The tensor codec: one array in, one self-describing blob out, and back.

Dispatch only: the quantizers (quantize.py, uniform.py), the entropy coders
(entropy.py), the exact byte-plane coder (lossless.py) and the blob format (blob.py) do
the work. The error
guard lives here because it decides between them: it retries with more bits and falls
back to an exact blob when a bound is not met. Streams of states (references, replay)
are delta.py's job.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

import numpy as np

from ..util import crc as _crc, memory as _memory
from . import blob as _blob
from . import dtypes, entropy, floatread, lossless, streams
from .. import limits
from ..util.pool import run_balanced, run_tasks
from .blob import LOSSLESS, UNIFORM, Parsed, parse
from .config import CodecConfig
from ..errors import (
    ChecksumError, CorruptDataError, InvalidArgumentError, NonFiniteError, UnsupportedDtypeError,
)
from .quantize import SPLIT_SHARE, Quantized, quantize
from .kernels import runs as rk, uniform as uk
from .uniform import Uniform, escape_index_dtype, uniform_quantize

__all__ = ["EncodeStats", "decode", "encode", "warmup"]


@dataclass
class EncodeStats:
    """What one encode did; every number comes from the passes the encode made anyway."""
    n: int
    dtype: str
    kind: str                          # "lossy" (LC), "uniform" or "lossless"
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
    step: float | None = None          # uniform: the quantization step chosen
    escapes: int = 0                   # uniform: elements stored exactly

    @property
    def bits_per_element(self) -> float:
        return 8 * self.nbytes / self.n if self.n else 0.0


# --- encoding --------------------------------------------------------------------------

def encode(x, bits: int = 2, coder: str = "auto", *, lossless: bool = False,
           error_bound: float | None = None, midpoint: bool = False,
           chunk_size: int | None = None, report: bool = False, config: CodecConfig | None = None,
           target: float | None = None):
    """Encode an array or tensor to a self-describing blob.

    Lossy (default): LC-Checkpoint's exponent-bucket quantizer with ``2**bits - 1``
    buckets, then ``coder``: ``"huffman"`` (the paper's per-element code), ``"grouped"``,
    ``"runs"``, or ``"auto"`` (fewest bytes per chunk). ``error_bound`` caps the relative
    L2 error: more bits are tried (up to 4), then an exact blob. ``target``: the
    error-bounded uniform quantizer instead, ``||x - decode(blob)||₂ <= target·||x||₂``
    (see :class:`~lcckpt.codec.config.CodecConfig`). ``lossless=True`` codes
    any dtype exactly. ``config``: a :class:`~lcckpt.codec.config.CodecConfig` instead of the
    keywords (giving both raises). With ``report=True`` returns ``(blob, EncodeStats)``.
    """
    if config is not None:
        given = [k for k, v, d in (("bits", bits, 2), ("coder", coder, "auto"),
                                   ("lossless", lossless, False), ("error_bound", error_bound, None),
                                   ("midpoint", midpoint, False), ("chunk_size", chunk_size, None),
                                   ("target", target, None)) if v != d]
        if given:
            raise InvalidArgumentError(
                f"give either config or the keywords, not both: {', '.join(given)} would be "
                "ignored; put them in the CodecConfig")
    cfg = config if config is not None else CodecConfig(
        bits, coder, error_bound, midpoint, chunk_size, lossless, target)
    if not isinstance(cfg, CodecConfig):
        raise InvalidArgumentError(f"config must be a CodecConfig, got {type(cfg).__name__}")
    a, dt = dtypes.to_numpy(x)
    if cfg.lossless:
        blob = b"".join(encode_exact(a, dt, cfg.log2))
        st = EncodeStats(a.size, dt.name, "lossless", nbytes=len(blob))
        return (blob, st) if report else blob
    if dt.kind != "float":
        raise UnsupportedDtypeError(
            f"lossy coding needs a floating dtype, got {dt.name}; use lossless=True")
    u = dtypes.to_float_work(a, dt).reshape(-1)
    try:
        parts, st, _ = guarded_encode(u, None, dt, a.shape, cfg,
                                      exact=lambda: encode_exact(a, dt, cfg.log2))
    except NonFiniteError:      # the quantizers speak of chains; here there is one array
        raise NonFiniteError(f"the array holds {int(np.sum(~np.isfinite(u)))} NaN/Inf values, "
                             "which no quantizer can bound: encode it with lossless=True "
                             "(or lcckpt.numcodecs.LcckptLossy, which does so)") from None
    blob = b"".join(parts)
    return (blob, st) if report else blob


def guarded_encode(u, ref, dt, shape, cfg: CodecConfig, exact, cache=None, advance=False,
                   surveyed=None, lazy=False):
    """Lossy encode honouring ``cfg.error_bound``; returns (blob pieces, stats, lossy).

    The quantizer runs at ``cfg.bits``, then with more bits while the error exceeds the
    bound; only the accepted quantization is entropy-coded. ``exact()`` makes the
    lossless fallback (then ``lossy`` is False). ``advance``: ``ref`` becomes the
    decoder's reconstruction of ``u`` when a lossy blob is returned (the caller resets
    it otherwise). ``surveyed``: the uniform quantizer's survey of ``u`` and ``ref``, if
    the caller took it. ``lazy``: a uniform delta comes as a :class:`~lcckpt.codec.blob.LazyBlob`
    (coded, and ``ref`` advanced, while a file takes it; see :func:`encode_uniform`).
    """
    if cfg.target is not None:
        return _uniform_encode(u, ref, dt, shape, cfg, exact, cache, advance, surveyed, lazy)
    tried = []
    top = 4 if cfg.error_bound is not None else cfg.bits
    cs = 1 << cfg.log2
    split = cache is None or cache.nonzero is None or cache.nonzero <= SPLIT_SHARE
    for b in range(cfg.bits, top + 1):
        q = quantize(u, ref, b, cs, cfg.midpoint,
                     runs_stats=entropy.RUNS in entropy.modes_for(cfg.coder, b), split=split)
        tried.append(b)
        if cfg.error_bound is None or q.rel_error <= cfg.error_bound:
            parts, st = encode_lossy(q, dt, shape, b, cfg, cache, ref if advance else None)
            st.tried_bits = tried
            if cache is not None:
                cache.nonzero = st.nonzero_fraction
            return parts, st, True
    parts = exact()
    st = EncodeStats(u.size, dt.name, "lossless", nbytes=_blob.nbytes(parts), tried_bits=tried,
                     fallback=f"relative error {q.rel_error:.3g} at {tried[-1]} bits "
                              f"exceeds the bound {cfg.error_bound:g}")
    return parts, st, False


_FINITE_MAX = {"F16": 65504.0, "BF16": 3.3895313892515355e38}   # narrower than the work dtype
# A streamed delta (``lazy``) of a tensor of more elements than this holds no symbols:
# each chunk's are quantized again as it is coded (one more quantizing pass, ~0.04 s per
# 20M elements and thread), so that it never holds a byte per element beside the state
# and the reference (docs/benchmarks.md, memory).
HELD_SYMBOLS = 1 << 22
ESCAPE_SHARE = 0.5      # past this share of an exact blob's bytes in escapes, store exactly


def _uniform_encode(u, ref, dt, shape, cfg: CodecConfig, exact, cache, advance, surveyed,
                    lazy=False):
    """The uniform quantizer's half of :func:`guarded_encode`."""
    modes = entropy.uniform_modes(cfg.coder, 4)
    free = lazy and u.size > HELD_SYMBOLS and entropy.RAW not in modes
    uq = uniform_quantize(u, ref, cfg.target, 1 << cfg.log2, _FINITE_MAX.get(dt.name),
                          surveyed, count=modes if free else None)
    why = None
    if uq is None:
        why = f"no step meets the target {cfg.target:g} (fp rounding): stored exactly"
    elif uq.escapes * (4 + u.dtype.itemsize) > ESCAPE_SHARE * u.size * np.dtype(dt.numpy).itemsize:
        why = f"{uq.escapes} of {u.size} elements need escapes: stored exactly"
    if why is not None:
        parts = exact()
        return parts, EncodeStats(u.size, dt.name, "lossless", nbytes=_blob.nbytes(parts),
                                  fallback=why), False
    parts, st = encode_uniform(uq, dt, shape, cfg, cache, ref if advance else None, lazy)
    return parts, st, True


def encode_uniform(uq: Uniform, dt: dtypes.DType, shape, cfg: CodecConfig, cache=None,
                   ref: np.ndarray | None = None, lazy: bool = False):
    """Code a uniformly quantized delta; returns (blob pieces, EncodeStats).

    With ``ref`` the reference advances to the decoder's reconstruction while the symbols
    are coded (each nonzero symbol's table value added, as decoding adds it), then the
    escapes are set: no pass of its own, and no reconstruction array.

    ``lazy``: the pieces are a :class:`~lcckpt.codec.blob.LazyBlob`, the symbols coded a
    batch at a time and the escapes listed a range at a time as it is read, so that a
    file written as it is encoded never holds the tensor's coded bytes nor its escape
    list; ``ref`` has advanced once it has been read to the end (the stats are known
    before)."""
    cs = 1 << cfg.log2
    n = uq.source.size
    modes = entropy.uniform_modes(cfg.coder, uq.bits)
    held = uq.sym is not None
    an = entropy.analyze(uq.sym, uq.sym_hist, cs, uq.bits, modes, counted=uq.counted,
                         chunks=None if held else uq.chunk_symbols)
    lazy = lazy and entropy.RAW not in modes
    if not (held or lazy):
        raise ValueError("a quantization that holds no symbols is coded lazily")
    enc = entropy.encode(uq.sym, an, modes, cache,
                         apply=None if ref is None else (uq.table, ref), lazy=lazy,
                         chunks=None if held else uq.chunk_symbols)
    w = _blob.uniform_header(dt, shape, cfg.log2, uq.bits, uq.step, uq.escapes, enc)
    if lazy:
        esc_bytes = uq.escapes * (escape_index_dtype(n).itemsize + uq.source.dtype.itemsize)
        parts = _blob.LazyBlob(w, itertools.chain(enc.parts, _blob.lazy_escapes(
            n, uq.escf, uq.escapes, uq.source, ref)), enc.size + esc_bytes)
    else:
        if ref is not None:
            set_escapes(ref, uq.esc_idx, uq.esc_val)
        parts = _blob.finish(w, enc.parts + _blob.escape_parts(n, uq.esc_idx, uq.esc_val))
    st = EncodeStats(n, dt.name, "uniform", uq.bits, cfg.coder, _blob.nbytes(parts),
                     step=uq.step, escapes=uq.escapes)
    counts = uq.sym_hist.sum(axis=0)
    st.payload_bytes = enc.size
    st.symbol_counts = counts.tolist()
    st.nonzero_fraction = 1 - counts[0] / n if n else 0.0
    st.symbol_entropy = entropy.entropy_bits(counts) / n if n else 0.0
    st.chunk_modes = _mode_counts(enc.modes)
    st.rel_error = uq.rel_error
    return parts, st


def encode_lossy(q: Quantized, dt: dtypes.DType, shape, bits: int, cfg: CodecConfig,
                 cache=None, ref: np.ndarray | None = None):
    """Code a delta quantized at ``bits``; returns (blob pieces, EncodeStats).

    With ``ref`` the reference advances by the delta while it is coded (the add the
    decoder makes), so the delta encoder needs no further pass over the symbols.
    """
    cs = 1 << cfg.log2
    n = q.sym_buf.size
    modes = entropy.modes_for(cfg.coder, bits)
    sym = q.symbols()                # written out only if a chunk's mode reads them all
    an = entropy.analyze(sym, q.sym_hist, cs, bits, modes, (q.runs_hist, q.runs_extra))
    enc = entropy.encode(sym, an, modes, cache,
                         apply=None if ref is None else (q.centroids, ref), nonzero=q.nonzero)
    w = _blob.lossy_header(dt, shape, cfg.log2, bits, cfg.midpoint,
                           q.centroids[1:q.kept + 1], enc)
    parts = _blob.finish(w, enc.parts)
    st = EncodeStats(n, dt.name, "lossy", bits, cfg.coder, _blob.nbytes(parts))
    _entropy_stats(st, q, enc, n)
    return parts, st


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
    st.chunk_modes = _mode_counts(enc.modes)
    st.rel_error = q.rel_error


def _mode_counts(modes: np.ndarray) -> dict:
    """Chunks per coding mode, by name, in mode order (``np.unique`` costs tens of
    microseconds on the few chunks of a small tensor)."""
    counts = np.bincount(modes, minlength=len(entropy.MODE_NAMES))
    return {entropy.MODE_NAMES[m]: int(c) for m, c in enumerate(counts) if c}


RAW_SLACK = 32
CODE_MIN_WORDS = 256    # below this a code table outweighs what coding saves (tens of bytes
                        # at most), and analysing four planes costs a millisecond of Python


def encode_exact(a: np.ndarray, dt: dtypes.DType, log2: int, raw: bool = False) -> list:
    """Lossless blob of a numpy array (carrier view for bf16/fp8), as a list of pieces.

    When coding does not pay (small or random data: the code tables outweigh the saving)
    every plane is stored raw, so the blob is never more than a small header above the
    raw bytes; arrays of fewer than ``CODE_MIN_WORDS`` words are not analysed at all.
    ``raw=True`` stores the planes raw from the start: larger, but decoding is a single
    interleaving pass (for keyframes that must restore fast). fp16, bf16 and fp32 arrays
    take the fused path of :func:`lossless.plan_floats` (the same layout, fewer passes).
    """
    words, rotate = lossless.words_of(a, dt.kind)
    cs = 1 << log2
    if raw or words.size < CODE_MIN_WORDS:
        return _exact_blob(a, dt, log2, rotate, lossless.raw_planes(words, rotate, cs))
    encs = _fast_plan(words, log2, rotate)
    if encs is not None:
        head = _blob.header_bytes(_blob.lossless_header(dt, a.shape, log2, rotate, encs))
        return [lossless.fill_blob(words, encs, cs, head)]
    parts = _exact_blob(a, dt, log2, rotate, lossless.encode_planes(words, rotate, cs))
    if _blob.nbytes(parts) > a.nbytes + RAW_SLACK:
        parts = _exact_blob(a, dt, log2, rotate, lossless.raw_planes(words, rotate, cs))
    return parts


def _fast_plan(words, log2, rotate):
    """:func:`lossless.plan_floats` where the float fast path may apply, else None."""
    if not (rotate and words.dtype.itemsize in lossless.FAST_WIDTHS
            and words.size >= lossless.FAST_MIN_WORDS):
        return None
    return lossless.plan_floats(words, 1 << log2)


def _exact_blob(a, dt, log2, rotate, encs) -> list:
    w = _blob.lossless_header(dt, a.shape, log2, rotate, encs)
    return _blob.finish(w, [p for e in encs for p in e.parts])


# --- decoding --------------------------------------------------------------------------

def decode(blob, *, out=None, check_payload: bool = True, max_bytes=None):
    """Decode a blob from :func:`encode`: same shape and dtype (numpy; torch for bf16/fp8).

    ``out``: a C-contiguous numpy array or CPU tensor of the blob's dtype and size to
    decode into (returned, reshaped views aside); no other memory is allocated for the
    values when its dtype is the one decoding works in.
    ``max_bytes``: the most bytes decoding may allocate, checked against what the blob's
    header declares before anything is allocated (as :func:`lcckpt.load`'s: an int,
    "auto" or ``lcckpt.limits.DEFAULT`` for the process default). None (the default):
    no limit, for blobs this program made; pass one for bytes from elsewhere (a blob
    of a constant can describe gigabytes in a few hundred bytes). The numcodecs codecs
    pass the process default.
    """
    buf, p = parse(blob, False)            # the payload CRC: below, or while decoding
    if out is None and max_bytes is not None:
        work = 0 if p.kind == LOSSLESS else (8 if p.dt.name == "F64" else 4)
        limits.check(p.n * (p.dt.itemsize + work), buf.size, max_bytes, "the blob")
    crc = _stored_crc(buf) if check_payload else None
    if crc is not None and p.kind != LOSSLESS:
        _check_payload(buf, p, crc)
    if out is not None:
        return _decode_into(buf, p, out, crc)
    if p.kind == LOSSLESS:
        return dtypes.from_carrier(decode_exact(buf, p, crc), p.dt)
    work = _memory.zeros(p.n, p.centroids.dtype)     # fresh zero pages: nothing to clear
    decode_symbols_into(buf, p, work)
    return dtypes.from_float_work(work.reshape(p.shape), p.dt)


def _stored_crc(buf) -> int:
    return int.from_bytes(bytes(buf[-4:]), "little")


def _check_payload(buf, p: Parsed, crc: int):
    if _crc.crc32(buf[p.payload_base:buf.size - 4]) != crc:
        raise ChecksumError("lcckpt blob: payload checksum mismatch; the blob is damaged")


def _decode_into(buf, p: Parsed, out, crc=None):
    if isinstance(out, np.ndarray):
        in_place = out.flags.c_contiguous and out.flags.writeable
    else:
        in_place = hasattr(out, "is_contiguous") and out.device.type == "cpu" \
            and out.is_contiguous()
    if not in_place:
        raise InvalidArgumentError("out must be a writeable, C-contiguous array or CPU tensor")
    try:
        a, dt = dtypes.to_numpy(out)                  # a view of out's memory
    except UnsupportedDtypeError:
        raise InvalidArgumentError(f"out has dtype {out.dtype}; the blob holds {p.dt.name}") from None
    if dt != p.dt or a.size != p.n:
        raise InvalidArgumentError(
            f"out is {dt.name} with {a.size} elements; the blob holds {p.dt.name}{list(p.shape)}")
    flat = a.reshape(-1)
    if p.kind == LOSSLESS:
        _run_exact(buf, p, flat, crc)
    elif flat.dtype == p.centroids.dtype:
        decode_symbols_into(buf, p, flat, clear=True)
    else:                                             # fp16/bf16: decoded in fp32
        work = _memory.zeros(p.n, p.centroids.dtype)
        decode_symbols_into(buf, p, work)
        flat[:] = dtypes.to_numpy(dtypes.from_float_work(work, p.dt))[0]
    return out


def decode_symbols_into(buf, p: Parsed, out: np.ndarray, clear: bool = False):
    """Lossy or uniform blob: ``out += centroids[sym]`` (flat, work dtype), applied as the
    symbols are decoded, never stored; then a uniform blob's escapes are set. ``clear``:
    ``out = centroids[sym]`` instead (each chunk set to 0 by the task that decodes it)."""
    streams.decode(buf, p.payload_base, p.layouts[0], p.n, 1 << p.log2, p.bits, None,
                   "lcckpt blob", apply=(p.centroids, out), clear=clear)
    if p.kind == UNIFORM and p.esc_idx.size:
        set_escapes(out, p.esc_idx, p.esc_val)


def set_escapes(out: np.ndarray, idx: np.ndarray, val: np.ndarray) -> None:
    """``out[idx] = val`` for a uniform blob's escapes, compiled (see
    :func:`lcckpt.codec.kernels.uniform.set_escapes`)."""
    _escapes_set(uk.set_escapes(out, idx, val), out)


def _escapes_set(outside: int, out: np.ndarray) -> None:
    if outside:
        raise CorruptDataError(f"escape index past the end of {out.size} elements")


def apply_escapes(p: Parsed, out: np.ndarray, c: int) -> None:
    """Set the escaped elements of chunk ``c`` (a uniform blob; nothing for others)."""
    if p.esc_idx is None or not p.esc_idx.size:
        return
    cs = 1 << p.log2
    _escapes_set(uk.set_range_escapes(out, p.esc_idx, p.esc_val, c * cs, (c + 1) * cs), out)


def exact_chunk_decoder(buf, p: Parsed, a: np.ndarray):
    """Per-chunk task decoding a lossless blob into the carrier array ``a``."""
    words, rotate = lossless.words_of(a, p.dt.kind)
    n, item = words.size, words.dtype.itemsize
    if floatread.FastDecoder.applies(p.layouts, n, rotate, item):
        return floatread.FastDecoder(buf, p.payload_base, p.layouts, n, 1 << p.log2, words,
                                     "lcckpt blob").chunk
    if floatread.MixedDecoder.applies(p.layouts, n, rotate, item):
        return floatread.MixedDecoder(buf, p.payload_base, p.layouts, n, 1 << p.log2, words,
                                      "lcckpt blob").chunk
    return lossless.plane_decoder(buf, p.payload_base, p.layouts, n, 1 << p.log2,
                                  rotate, words, "lcckpt blob")


def chunk_spans(p: Parsed, k0: int, k1: int) -> list[tuple[int, int]]:
    """Where chunks ``k0 .. k1-1`` of each stream of a lossless blob lie, as ``(offset in
    the blob, bytes)`` per stream: what :func:`decode_exact_chunks` needs read."""
    spans, base = [], p.payload_base
    for lay in p.layouts:
        lo, hi = int(lay.offsets[k0]), int(lay.offsets[k1])
        spans.append((base + lo, hi - lo))
        base += int(lay.offsets[-1])
    return spans


def decode_exact_chunks(p: Parsed, k0: int, k1: int, data: np.ndarray,
                        out: np.ndarray | None = None) -> np.ndarray:
    """Chunks ``k0 .. k1-1`` of lossless blob ``p`` alone, from ``data`` (the bytes of
    :func:`chunk_spans`, in order), into a fresh flat carrier array of their elements (or
    ``out``, a contiguous one of exactly their size): the chunks as a blob of their own,
    so the decoders run unchanged."""
    cs = 1 << p.log2
    per = 2 if p.dt.kind == "complex" else 1             # words per element
    words = min(_blob.words_n(p.n, p.dt), k1 * cs) - k0 * cs
    layouts = []
    for lay in p.layouts:
        off = lay.offsets[k0:k1 + 1]
        layouts.append(streams.StreamLayout(lay.modes[k0:k1], lay.consts[k0:k1], off - off[0],
                                            lay.lengths))
    if data.size != sum(int(lay.offsets[-1]) for lay in layouts):
        raise InvalidArgumentError("decode_exact_chunks: data is not the chunks' spans")
    sub = Parsed(p.kind, p.dt, (words // per,), words // per, p.log2, 0, layouts=layouts,
                 rotate=p.rotate)
    if out is None:
        a = np.empty(words // per, p.dt.numpy)
    elif out.dtype != p.dt.numpy or out.shape != (words // per,) or not out.flags.c_contiguous:
        raise InvalidArgumentError("decode_exact_chunks: out is not the chunks' carrier array")
    else:
        a = out
    task = exact_chunk_decoder(data, sub, a)
    for k in range(k1 - k0):
        task(k)
    return a


def _run_exact(buf, p: Parsed, a: np.ndarray, crc: int | None = None):
    """Decode a lossless blob into ``a``; with ``crc`` (the stored payload CRC) check it,
    on the fast path while decoding (``a`` holds garbage if that check fails)."""
    words, rotate = lossless.words_of(a, p.dt.kind)
    n, item = words.size, words.dtype.itemsize
    if floatread.FastDecoder.applies(p.layouts, n, rotate, item):
        floatread.FastDecoder(buf, p.payload_base, p.layouts, n, 1 << p.log2, words,
                              "lcckpt blob", crc=crc is not None).run(crc)
        return
    if crc is not None:
        _check_payload(buf, p, crc)
    if floatread.MixedDecoder.applies(p.layouts, n, rotate, item):
        mixed = floatread.MixedDecoder(buf, p.payload_base, p.layouts, n, 1 << p.log2, words,
                                       "lcckpt blob")
        run_balanced(mixed.task, mixed.ntasks)
        return
    run_tasks(exact_chunk_decoder(buf, p, a), -(-_blob.words_n(p.n, p.dt) // (1 << p.log2)))


def decode_exact(buf, p: Parsed, crc: int | None = None) -> np.ndarray:
    """Lossless blob -> carrier array of the blob's shape (``crc``: see :func:`_run_exact`)."""
    a = _memory.empty(p.shape, p.dt.numpy)
    _run_exact(buf, p, a, crc)
    return a


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
        decode(encode(x, target=0.01))                  # the uniform quantizer and its model
    for dt in (np.int64, np.float16, np.uint8):
        decode(encode(np.arange(64).astype(dt), lossless=True))
    for dt in (np.float32, np.float16):                 # the fused float path
        decode(encode(rng.standard_normal(lossless.FAST_MIN_WORDS).astype(dt), lossless=True))
        sparse = np.zeros(lossless.FAST_MIN_WORDS, dt)  # and its zero runs (blob version 4)
        sparse[::97] = rng.standard_normal(sparse[::97].size)
        decode(encode(sparse, lossless=True))
    # LC mode writes a sparse delta's listed symbols out only where a chunk's coder reads
    # every symbol, which inputs this small do not reach
    rk.fill_listed(np.zeros(8, np.uint8), 0, 8, np.array([3 | 1 << 24], np.uint32))
