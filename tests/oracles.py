"""Slow, obviously-correct numpy/Python references: the oracles the tests hold the codec to."""

import heapq
import math
import struct

import numpy as np


def quantize_ref(delta: np.ndarray, bits: int, midpoint: bool = False):
    """LC quantizer by the book: returns (symbols, centroids[2**bits], kept)."""
    delta = np.ascontiguousarray(delta).reshape(-1)
    if delta.dtype == np.float64:
        keys = (delta.view(np.uint64) >> np.uint64(52)).astype(np.int64)
        half = 2048
    else:
        delta = delta.astype(np.float32)
        keys = (delta.view(np.uint32) >> np.uint32(23)).astype(np.int64)
        half = 256
    nz = delta != 0
    buckets = {}
    for k in np.unique(keys[nz]):
        members = delta[nz & (keys == k)].astype(np.float64)
        buckets[int(k)] = members
    # rank: larger exponent, then more members, then positive (smaller key) first
    order = sorted(buckets, key=lambda k: (-(k % half), -buckets[k].size, k))
    kept = order[:(1 << bits) - 1]
    cent = np.zeros(1 << bits, delta.dtype)
    sym = np.zeros(delta.size, np.uint8)
    for s, k in enumerate(kept, start=1):
        m = buckets[k]
        cent[s] = (m.min() + m.max()) / 2 if midpoint else math.fsum(m) / m.size
        sym[nz & (keys == k)] = s
    return sym, cent, len(kept)


def huffman_cost(counts) -> int:
    """Total bits of an optimal (unlimited) Huffman code for ``counts``."""
    w = [int(c) for c in counts if c > 0]
    if len(w) <= 1:
        return sum(w)          # a lone symbol costs 1 bit each in our convention
    heapq.heapify(w)
    total = 0
    while len(w) > 1:
        a, b = heapq.heappop(w), heapq.heappop(w)
        total += a + b
        heapq.heappush(w, a + b)
    return total


def canonical_code_table(lengths):
    """(count per length, symbols in canonical order) as bitarray.canonical_decode wants."""
    maxlen = int(max(lengths)) if len(lengths) else 0
    count = [0] * (maxlen + 1)
    for ln in lengths:
        if ln:
            count[ln] += 1
    symbol = sorted((s for s in range(len(lengths)) if lengths[s]), key=lambda s: (lengths[s], s))
    return count, symbol


def read_lengths_ref(data: bytes, size: int, max_len: int):
    """Code lengths of a table written by ``streams._write_lengths``, parsed with numpy
    and plain Python (the compiled parser's oracle): ``(lengths, bytes used)``, or the
    exception class ("truncated" or "corrupt")."""
    pos = 0

    def take(n):
        nonlocal pos
        if pos + n > len(data):
            raise EOFError
        pos += n
        return np.frombuffer(data[pos - n:pos], np.uint8)

    def uvar(limit):
        v, shift = 0, 0
        while True:
            b = int(take(1)[0])
            v |= (b & 0x7F) << shift
            if not b & 0x80:
                break
            shift += 7
            if shift > 63:
                raise ValueError
        if v > limit:
            raise ValueError
        return v

    def unnibble(packed, n):
        out = np.empty(2 * packed.size, np.uint8)
        out[0::2], out[1::2] = packed >> 4, packed & 15
        if np.any(out[n:]):
            raise ValueError
        return out[:n].copy()
    try:
        kind = int(take(1)[0])
        if kind == 0:
            lengths = unnibble(take((size + 1) // 2), size)
        elif kind == 1:
            bitmap = np.unpackbits(take((size + 7) // 8))
            if np.any(bitmap[size:]):
                raise ValueError
            used = np.flatnonzero(bitmap[:size])
            lengths = np.zeros(size, np.uint8)
            lengths[used] = unnibble(take((used.size + 1) // 2), used.size)
            if not np.all(lengths[used]):
                raise ValueError
        elif kind == 2:
            m, s = uvar(size), -1
            lengths = np.zeros(size, np.uint8)
            for _ in range(m):
                s += uvar(size) + 1
                if s >= size:
                    raise ValueError
                lengths[s] = take(1)[0]
        else:
            raise ValueError
        if lengths.max(initial=0) > max_len or not lengths.any():
            raise ValueError
        if sum(1 << (max_len - int(v)) for v in lengths if v) > 1 << max_len:
            raise ValueError
    except EOFError:
        return "truncated"
    except ValueError:
        return "corrupt"
    return lengths, pos


def model_errors_ref(model, steps, up: float) -> np.ndarray:
    """The uniform quantizer's modelled error of each step in numpy expressions (the
    compiled ``kernels.model.errors_sq`` must give these bits exactly)."""
    st = np.asarray(steps, np.float64).reshape(-1, 1)
    q_lo, q_hi, q = model_levels_ref(model, st, up, edges=True)
    qs1 = (q * model.s1).sum(axis=1, keepdims=True)
    qq = (model.cnt * q * q).sum(axis=1, keepdims=True)
    r = np.where(qq > 0, qs1 / np.where(qq > 0, qq, 1), st)
    e = model.s2 - 2 * q * r * model.s1 + model.cnt * (q * r) ** 2
    f = ((1 - up) ** 3 + up ** 3) / 3
    e = np.where(q_hi - q_lo >= 2, model.cnt * f * st * st, e)
    return e.sum(axis=1)


def error_model_ref(cnt, s1, s2):
    """An error model's per-bin arrays from a survey's histogram in numpy (what
    ``ErrorModel.__init__`` computed before one compiled call did): the nonzero bins among
    the first ``MAG_BINS``, as (count, sum, sum of squares, lower edge, upper edge, mean)."""
    from lcckpt.codec.errmodel import bin_bounds
    from lcckpt.codec.kernels.uniform import MAG_BINS
    c = cnt[:MAG_BINS]
    keep = np.flatnonzero(c)
    cf = c[keep].astype(np.float64)
    bounds = bin_bounds()
    return cf, s1[keep], s2[keep], bounds[keep], bounds[keep + 1], s1[keep] / cf


def symbol_histogram_ref(model, step: float, up: float) -> np.ndarray:
    """``ErrorModel.symbol_histogram`` in numpy (before one compiled call made it): zigzag
    symbol counts, each level's count split between its two signs, all beyond 255 last."""
    q = model.levels(step, up)
    big = q > 128
    h = np.zeros(257)
    h[256] = model.cnt[big].sum()
    small = ~big
    lv = np.bincount(q[small].astype(np.int64), weights=model.cnt[small], minlength=129)
    h[0] = lv[0] + (model.n - model.cnt.sum())
    h[1:257:2] += lv[1:129] / 2
    h[2:257:2] += lv[1:129] / 2
    return h


def step_for_ref(model, tol_sq: float, up: float, start: float) -> float:
    """``ErrorModel.step_for`` as numpy code (before its grids were searched in compiled
    calls): the model's ``errors_sq``, numpy's ``linspace`` and ``flatnonzero``."""
    top = 2 * float(np.max(model.mean)) if model.cnt.size else start
    if top <= 0 or model.error_sq(top, up) <= tol_sq:
        return min(start, top) if top > 0 else start
    lo_exp = -16
    for _ in range(20):
        grid = np.minimum(start * 2.0 ** (np.arange(lo_exp, lo_exp + 25) / 2), top)
        ok = model.errors_sq(grid, up) <= tol_sq
        if not ok[0]:
            lo_exp -= 24
        elif ok[-1] and grid[-1] < top:
            lo_exp += 24
        else:
            break
    else:
        return float(grid[0])
    for _ in range(2):
        i = int(np.flatnonzero(ok)[-1])
        if i == grid.size - 1:
            return float(grid[i])
        grid = np.linspace(grid[i], grid[i + 1], 9)
        ok = model.errors_sq(grid, up) <= tol_sq
    return float(grid[int(np.flatnonzero(ok)[-1])])


def model_levels_ref(model, step, up: float, edges: bool = False):
    """Each magnitude bin's level at ``step`` (a column of steps: a row each)."""
    q_lo = np.floor(model.lo / step + up)
    q_hi = np.floor(np.minimum(model.hi, 1e300) / step + up)
    q = np.where(q_lo == q_hi, q_lo, np.floor(model.mean / step + up))
    return (q_lo, q_hi, q) if edges else q


def choose_ref(score: np.ndarray, coded: list, table: dict) -> np.ndarray:
    """The per-chunk mode choice in numpy (what ``entropy._choose`` computed before it
    was compiled): every subset of the ``coded`` rows, per column the cheapest allowed
    row, plus ``table[row]`` once per row used; the first cheapest subset wins."""
    cols = np.arange(score.shape[1])
    best, best_choice = np.inf, None
    for subset in range(1 << len(coded)):
        masked = score.copy()
        for k, i in enumerate(coded):
            if not subset >> k & 1:
                masked[i] = np.inf
        choice = np.argmin(masked, axis=0)
        total = masked[choice, cols].sum() + sum(table.get(i, 0) for i in np.unique(choice))
        if total < best:
            best, best_choice = total, choice
    return np.argmin(score, axis=0) if best_choice is None else best_choice


def plan_ref(hist: dict, extra, n: int, chunk_size: int, modes, old: dict, slack: float,
             max_len: int):
    """The entropy coder's plan in numpy (what ``entropy._code_lengths`` and
    ``_chunk_bytes`` computed before they were compiled): ``(each coded mode's lengths,
    whether the ``old`` one was kept, bytes of every chunk in every mode, bits per mode
    but const)``."""
    from lcckpt.codec.entropy import CODED_MODES, CONST, HUFFMAN, RAW, RUNS
    from lcckpt.codec.kernels.huffman import code_lengths
    lengths, kept = {}, {}
    for m in modes:
        if m in CODED_MODES:
            counts = hist[m].sum(axis=0)
            fresh = code_lengths(counts, max_len)
            o = old.get(m)
            kept[m] = (o is not None and o.size == fresh.size
                       and not np.any((counts > 0) & (o == 0))
                       and counts @ o.astype(np.int64)
                       <= slack * (counts @ fresh.astype(np.int64)))
            lengths[m] = o if kept[m] else fresh
    starts = np.arange(-(-n // chunk_size), dtype=np.int64) * chunk_size
    sizes = np.minimum(chunk_size, n - starts)
    rows, mode_bits = [], {}
    for m in modes:
        if m in CODED_MODES:
            bits = hist[m] @ lengths[m].astype(np.int64) + (extra if m == RUNS else 0)
        elif m == RAW:
            bits = sizes * 8
        else:
            assert m == CONST
            is_const = (hist[HUFFMAN] == sizes[:, None]).any(axis=1)
            bits = np.where(is_const, 0, np.iinfo(np.int64).max // 4)
        rows.append((bits + 7) // 8)
        if m != CONST:
            mode_bits[m] = int(bits.sum())
    return lengths, kept, np.stack(rows), mode_bits


def try_width_ref(hist, dtype) -> tuple:
    """``(estimated bytes, bits)`` of the uniform quantizer's symbol width for a level
    histogram, every width weighed from the narrowest up (what ``uniform._try_args`` did
    before it weighed them from the widest down)."""
    from lcckpt.codec.uniform import UNIFORM_BITS, _entropy
    best = None
    for b in UNIFORM_BITS:
        S = 1 << b
        h = hist[:S].copy()
        esc = int(hist[S:].sum())
        h[0] += esc
        est = _entropy(h) / 8 + esc * (4 + np.dtype(dtype).itemsize) + (S if b > 4 else 0) / 2
        if best is None or est < best[0]:
            best = (est, b)
        if esc == 0:
            break
    return best


# --- the blob header, field by field ---------------------------------------------------
import zlib  # noqa: E402

from lcckpt.codec import dtypes, entropy, lossless, streams  # noqa: E402
from lcckpt.codec.blob import (  # noqa: E402
    LOSSLESS, LOSSY, MAGIC, MAX_NDIM, PAIRS_VERSION, RUNS_VERSION, UNIFORM, UNIFORM_VERSION,
    VERSION, Parsed, check_body, words_n,
)
from lcckpt.codec.uniform import escape_index_dtype, uniform_table  # noqa: E402
from lcckpt.errors import (  # noqa: E402
    ChecksumError, CorruptDataError, InvalidArgumentError, TruncatedError, UnsupportedVersionError,
)


def parse_ref(blob, check_payload: bool = True, size=None):
    """``lcckpt.codec.blob.parse`` as it was written, field by field in Python: the
    compiled parser must give the same fields, or the same error."""
    from lcckpt.codec.config import MAX_CHUNK_LOG2, MIN_CHUNK_LOG2

    buf = np.frombuffer(blob, np.uint8)
    if size is not None and (check_payload or size < len(buf)):
        raise InvalidArgumentError("parse(size=) reads a header: check_payload=False, "
                                   "and size at least the bytes given")
    total = len(buf) if size is None else size
    r = Reader(buf, what="lcckpt blob", size=total)
    if len(buf) < 4 or bytes(buf[:3]) != MAGIC:
        raise CorruptDataError("not an lcckpt blob (bad magic); was it produced by lcckpt.encode?")
    r.pos = 3
    version = r.u8()
    if version not in (VERSION, UNIFORM_VERSION, PAIRS_VERSION, RUNS_VERSION):
        raise UnsupportedVersionError(
            f"blob format version {version}; this lcckpt reads versions {VERSION} to "
            f"{RUNS_VERSION}: upgrade lcckpt")
    kind = r.u8()
    if (kind not in (LOSSY, LOSSLESS, UNIFORM) or (kind == UNIFORM) != (version == UNIFORM_VERSION)
            or (version >= PAIRS_VERSION and kind != LOSSLESS)):
        raise CorruptDataError(f"lcckpt blob: unknown kind {kind} in a version {version} blob")
    code = r.u8()
    if code not in dtypes.BY_CODE:
        raise CorruptDataError(f"lcckpt blob: unknown dtype code {code}")
    dt = dtypes.BY_CODE[code]
    ndim = r.uvar(MAX_NDIM, "ndim")
    shape = tuple(r.uvar(1 << 48, "dimension") for _ in range(ndim))
    n = math.prod(shape)                 # exact: Python ints, 1 for a scalar
    log2 = r.u8()
    if not MIN_CHUNK_LOG2 <= log2 <= MAX_CHUNK_LOG2:
        raise CorruptDataError(f"lcckpt blob: chunk size 2**{log2} out of range")
    cs = 1 << log2
    if -(-n // cs) > total:                # every chunk costs at least one table byte
        raise CorruptDataError(f"lcckpt blob: shape {shape} is larger than the blob can describe")
    p = Parsed(kind, dt, shape, n, log2, 0)
    {LOSSY: _lossy_header, UNIFORM: _uniform_header, LOSSLESS: _lossless_header}[kind](
        r, p, version)
    hdr_end = r.pos
    stored = r.u32()
    if zlib.crc32(buf[:hdr_end]) != stored:
        raise ChecksumError("lcckpt blob: header checksum mismatch; the blob is damaged")
    p.payload_base = r.pos
    payload = sum(int(lay.offsets[-1]) for lay in p.layouts)
    return check_body(buf, p, payload, total, size, check_payload)   # as parse's, shared


def _work_dtype(p: Parsed, kind: str):
    """The float dtype a lossy blob's values are computed in (a float blob only)."""
    if p.dt.kind != "float":
        raise CorruptDataError(f"lcckpt blob: {kind} kind with dtype {p.dt.name}")
    return np.float64 if p.dt.name == "F64" else np.float32


def _lossy_header(r, p, version: int) -> None:
    """LC buckets: bits, flags, the kept centroids, the symbol tables."""
    work = _work_dtype(p, "lossy")
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
    p.centroids = np.zeros(1 << p.bits, work)
    p.centroids[1:kept + 1] = np.frombuffer(r.raw(kept * np.dtype(work).itemsize), work)
    if not np.all(np.isfinite(p.centroids)):
        raise CorruptDataError("lcckpt blob: non-finite centroid")
    allowed = entropy.modes_for("auto", p.bits)
    p.layouts = [read_tables_py(r, p.n, 1 << p.log2, p.bits, allowed)]


def _uniform_header(r, p, version: int) -> None:
    """The restored-state quantizer: symbol bits, step, escape count, the symbol tables."""
    work = _work_dtype(p, "uniform")
    p.bits = r.u8()
    if not 2 <= p.bits <= 8:
        raise CorruptDataError(f"lcckpt blob: uniform symbols of {p.bits} bits")
    p.step = float(np.frombuffer(r.raw(8), "<f8")[0])
    if not (np.isfinite(p.step) and p.step >= 0):
        raise CorruptDataError(f"lcckpt blob: uniform step {p.step}")
    nesc = r.uvar(p.n, "number of escapes")
    p.centroids = uniform_table(p.step, p.bits, work)
    if not np.all(np.isfinite(p.centroids)):
        raise CorruptDataError("lcckpt blob: uniform step overflows the table")
    p.layouts = [read_tables_py(r, p.n, 1 << p.log2, p.bits,
                                     entropy.uniform_modes("auto", p.bits))]
    p.esc_idx = np.zeros(nesc, escape_index_dtype(p.n))   # located after the header checksum
    p.esc_val = np.zeros(nesc, work)


def _lossless_header(r, p, version: int) -> None:
    """Exact byte planes: their number, the rotation flag, each plane's tables."""
    nplanes = r.u8()
    words, rotate = lossless.words_of(np.empty((0,), p.dt.numpy), p.dt.kind)
    if nplanes != words.dtype.itemsize:
        raise CorruptDataError(f"lcckpt blob: {nplanes} byte planes for dtype {p.dt.name}")
    rot = r.u8()
    if rot != int(rotate):
        raise CorruptDataError("lcckpt blob: rotation flag does not match the dtype")
    p.rotate = rotate
    allowed = (entropy.BYTES_READ + (entropy.RUNS,) if version == RUNS_VERSION
               else entropy.BYTES_READ if version == PAIRS_VERSION
               else entropy.modes_for("bytes", 8))
    p.layouts = [read_tables_py(r, words_n(p.n, p.dt), 1 << p.log2, 8, allowed)
                 for _ in range(nplanes)]


# --- what the blob parser read field by field before kernels/head.py ------------------
from lcckpt.codec.entropy import CODED_MODES, CONST, RAW, alphabet  # noqa: E402
from lcckpt.codec.kernels import huffman as hk, tables as tk  # noqa: E402


def read_lengths_py(r, size: int) -> np.ndarray:
    """A code-length table (see :func:`_write_lengths`), parsed and checked by a compiled
    loop (a restore parses one per blob of every step of a chain)."""
    lengths, pos, err, _ = tk.read_lengths(np.frombuffer(r.buf, np.uint8), r.pos, r.end, size,
                                           hk.MAX_CODE_LEN)
    if err == tk.L_TRUNCATED:
        raise TruncatedError(f"{r.what} is truncated inside a code table at offset {r.pos}; "
                             "the data was cut short or damaged")
    if err != tk.L_OK:
        raise CorruptDataError(f"{r.what}: {streams.LENGTH_ERRORS[err]}")
    r.pos = pos
    return lengths




def read_tables_py(r, n: int, chunk_size: int, b: int, allowed):
    """Parse and validate what :func:`write_tables` wrote, for a stream of ``n`` symbols."""
    nchunks = -(-n // chunk_size)
    mask = r.u8()
    lengths = {}
    for m in CODED_MODES:
        if mask & (1 << m):
            if m not in allowed:
                raise CorruptDataError(f"{r.what}: code table for a mode this stream cannot use")
            lengths[m] = read_lengths_py(r, alphabet(m, b))
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
                                        CONST, RAW, r.size, modes, consts, nbytes)
    if err == tk.TRUNCATED:
        raise TruncatedError(f"{r.what} is truncated: {tk.ERRORS[err]} (chunk {c} of {nchunks})")
    if err != tk.OK:
        raise CorruptDataError(f"{r.what}: chunk {c} {tk.ERRORS[err]}")
    offsets = np.concatenate(([0], np.cumsum(nbytes)))
    return streams.StreamLayout(modes, consts, offsets, lengths)




class Reader:
    """Checked reads of a blob header, field by field (what lcckpt.util.wire held)."""

    def __init__(self, buf, pos: int = 0, end: int | None = None, what: str = "blob",
                 size: int | None = None):
        self.buf = memoryview(buf)
        self.pos = pos
        self.end = len(self.buf) if end is None else end
        self.size = self.end if size is None else size   # the whole object's bytes, where
        self.what = what                                  # buf holds only its beginning

    def _need(self, n: int):
        if n < 0 or self.pos + n > self.end:
            raise TruncatedError(
                f"{self.what} is truncated: needed {n} more bytes at offset {self.pos}, "
                f"only {self.end - self.pos} left; the data was cut short or damaged")

    def u8(self) -> int:
        self._need(1)
        v = self.buf[self.pos]
        self.pos += 1
        return v

    def uvar(self, limit: int = (1 << 63) - 1, name: str = "value") -> int:
        v = 0
        shift = 0
        while True:
            b = self.u8()
            v |= (b & 0x7F) << shift
            if not b & 0x80:
                break
            shift += 7
            if shift > 63:
                raise CorruptDataError(f"{self.what}: malformed varint at offset {self.pos}")
        if v > limit:
            raise CorruptDataError(f"{self.what}: {name} = {v} exceeds its limit {limit}")
        return v

    def raw(self, n: int) -> memoryview:
        self._need(n)
        v = self.buf[self.pos:self.pos + n]
        self.pos += n
        return v

    def u32(self) -> int:
        return struct.unpack("<I", self.raw(4))[0]
