"""The blob wire format: header layout, checksums, and a parser that validates it all.

Blob layout (little-endian; ``uvar`` = unsigned LEB128):

    "LCC" version:u8  kind:u8 (1 lossy, 2 lossless)  dtype:u8  ndim:uvar  dims:uvar*
    log2(chunk_size):u8
    lossy:    bits:u8  flags:u8 (bit0 midpoint)  kept:u8  centroids[1..kept] (fp32; fp64 for F64)
              stream tables (see streams.write_tables)
    lossless: nplanes:u8  rotate:u8  stream tables per plane
    uniform:  bits:u8 (2-8)  step:f64  escapes:uvar  stream tables        (version 2 only)
    crc32(header):u32   payload   crc32(payload):u32

A uniform blob's payload is its symbol stream, then the escapes: their element indices
(u32, or u64 when the tensor has 2**32 elements or more; strictly increasing) and their
exact values (fp32; fp64 for F64). Symbol ``s`` adds ``level(s)·step`` (levels 0, -1, 1,
-2, 2, ...; :func:`lcckpt.codec.uniform.uniform_table`); an escaped element is *set* to its
value. Blobs of the first two kinds are written as version 1, exactly as before; a
uniform blob is version 2, and a lossless blob with "pairs" chunks (a code per chunk of
exponents, kernels/planes.py) version 3, so a reader that predates them says "upgrade"
instead of misreading them.

A lossy blob holds a quantized *delta*: decoding adds it to a reference (zeros for a
stand-alone ``encode``). A lossless blob holds exact values. See docs/algorithm.md §8.

This module writes and reads every header byte; it codes nothing (tensor.py does).
"""

from __future__ import annotations

import math
import zlib
from dataclasses import dataclass, field

import numpy as np

from ..util import crc as _crc
from . import dtypes, entropy, lossless, streams
from .kernels import tables as tk
from .kernels import uniform as uk
from ..util.wire import Reader, Writer
from ..errors import (
    ChecksumError, CorruptDataError, InvalidArgumentError, TruncatedError, UnsupportedVersionError,
)
from .uniform import escape_index_dtype, uniform_table

MAGIC = b"LCC"
VERSION = 1                 # lossy and lossless blobs
UNIFORM_VERSION = 2         # uniform blobs (the only kind version 2 adds)
PAIRS_VERSION = 3           # lossless blobs whose planes hold "pairs" chunks
LOSSY, LOSSLESS, UNIFORM = 1, 2, 3
MAX_NDIM = 64


def _header(kind: int, dt: dtypes.DType, shape, log2: int, version: int | None = None) -> Writer:
    """A writer holding the common header fields."""
    w = Writer()
    w.raw(MAGIC)
    w.u8(version or (UNIFORM_VERSION if kind == UNIFORM else VERSION))
    w.u8(kind)
    w.u8(dt.code)
    w.uvar(len(shape))
    for d in shape:
        w.uvar(int(d))
    w.u8(log2)
    return w


# Every byte of a blob's header is written by one of these three (and its stream tables
# by streams.write_tables, which they call), then closed by :func:`finish` or
# :func:`header_bytes`; :func:`parse` reads them back.

def lossy_header(dt: dtypes.DType, shape, log2: int, bits: int, midpoint: bool,
                 centroids: np.ndarray, enc) -> Writer:
    """LC-Checkpoint's buckets: ``centroids`` are the kept buckets' (1..kept)."""
    w = _header(LOSSY, dt, shape, log2)
    w.u8(bits)
    w.u8(1 if midpoint else 0)
    w.u8(centroids.size)
    w.raw(centroids.tobytes())
    streams.write_tables(w, enc)
    return w


def uniform_header(dt: dtypes.DType, shape, log2: int, bits: int, step: float, escapes: int,
                   enc) -> Writer:
    """The uniform quantizer's delta: symbol width, step and the number of escapes."""
    w = _header(UNIFORM, dt, shape, log2)
    w.u8(bits)
    w.raw(np.float64(step).astype("<f8").tobytes())
    w.uvar(int(escapes))
    streams.write_tables(w, enc)
    return w


def lossless_header(dt: dtypes.DType, shape, log2: int, rotate: bool, encs) -> Writer:
    """Exact planes; version 3 when a plane holds "pairs" chunks, so that a reader that
    predates them asks for an upgrade instead of misreading them."""
    pairs = any(np.any(e.modes == entropy.PAIRS) for e in encs)
    w = _header(LOSSLESS, dt, shape, log2, PAIRS_VERSION if pairs else None)
    w.u8(len(encs))
    w.u8(1 if rotate else 0)
    for e in encs:
        streams.write_tables(w, e)
    return w


def header_bytes(w: Writer) -> bytes:
    """The header closed by its CRC-32, for a caller that writes the payload itself."""
    w.u32(zlib.crc32(w.buf))
    return bytes(w.buf)


def finish(w: Writer, payloads) -> list:
    """The blob as a list of pieces: header with its checksum, payloads, their checksum.

    A container section can be written from the pieces directly, so a large keyframe is
    never copied into one buffer (:func:`nbytes` is its size; ``b"".join`` makes bytes).
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


class LazyBlob:
    """A blob whose payload is made while it is read (a uniform delta coded batch by batch
    as a file takes it, lcckpt/format/stream.py): its size is known, its pieces come
    once, in order, each a byte view; the checksum is taken on the way."""

    def __init__(self, w: Writer, payloads, payload_nbytes: int):
        w.u32(zlib.crc32(w.buf))
        self._head = bytes(w.buf)
        self._payloads = payloads
        self.nbytes = len(self._head) + int(payload_nbytes) + 4
        self._it = None

    def __iter__(self):
        if self._it is None:
            self._it = self._pieces()
        return self._it

    def __next__(self):
        return next(iter(self))

    def _pieces(self):
        yield memoryview(self._head)
        crc, n = 0, len(self._head) + 4
        for p in self._payloads:
            mv = memoryview(p).cast("B")
            crc = _crc.crc32(mv, crc)
            n += mv.nbytes
            yield mv
        if n != self.nbytes:
            raise AssertionError(f"lazy blob: made {n} bytes, planned {self.nbytes}")
        yield memoryview(crc.to_bytes(4, "little"))


def nbytes(blob) -> int:
    """Size of a blob given as bytes, as a list of pieces or as a :class:`LazyBlob`."""
    if isinstance(blob, LazyBlob):
        return blob.nbytes
    if isinstance(blob, list):
        return sum(memoryview(p).nbytes for p in blob)
    return len(blob)


@dataclass
class Parsed:
    """Everything the header says, validated; ``layouts`` locate each chunk's bytes."""
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
    step: float = 0.0
    esc_idx: np.ndarray | None = None    # uniform: escaped elements (stored index dtype) ...
    esc_val: np.ndarray | None = None    # ... and their exact values (work dtype)


def parse(blob, check_payload: bool = True, size: int | None = None) -> tuple[np.ndarray, Parsed]:
    """Validate a blob completely (structure, sizes, both checksums) before any decode.

    ``check_payload=False`` skips the payload checksum, for callers that have just
    verified the same bytes themselves (a container section's CRC covers the whole blob).
    ``size``: the blob's whole size where ``blob`` holds only its beginning, for a
    partial read. The header is then parsed and checked against ``size``; the payload
    (and a uniform blob's escapes) are not read, and a header that runs past ``blob``
    raises :class:`TruncatedError` (read more and parse again).
    """
    from .config import MAX_CHUNK_LOG2, MIN_CHUNK_LOG2

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
    if version not in (VERSION, UNIFORM_VERSION, PAIRS_VERSION):
        raise UnsupportedVersionError(
            f"blob format version {version}; this lcckpt reads versions {VERSION} to "
            f"{PAIRS_VERSION}: upgrade lcckpt")
    kind = r.u8()
    if (kind not in (LOSSY, LOSSLESS, UNIFORM) or (kind == UNIFORM) != (version == UNIFORM_VERSION)
            or (version == PAIRS_VERSION and kind != LOSSLESS)):
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
    esc_bytes = 0
    if kind == UNIFORM:
        isz = escape_index_dtype(n).itemsize
        esc_bytes = p.esc_idx.size * (isz + p.esc_val.dtype.itemsize)
    expect = p.payload_base + payload + esc_bytes + 4
    if total < expect:
        raise TruncatedError(f"lcckpt blob is truncated: {total} bytes, header promises {expect}")
    if total > expect:
        raise CorruptDataError(f"lcckpt blob has {total - expect} trailing bytes")
    if size is not None:
        return buf, p
    crc = int.from_bytes(bytes(buf[expect - 4:expect]), "little")
    if check_payload and _crc.crc32(buf[p.payload_base:expect - 4]) != crc:
        raise ChecksumError("lcckpt blob: payload checksum mismatch; the blob is damaged")
    if kind == UNIFORM and p.esc_idx.size:
        read_escapes(buf, p.payload_base + payload, p)
    return buf, p


def _work_dtype(p: Parsed, kind: str):
    """The float dtype a lossy blob's values are computed in (a float blob only)."""
    if p.dt.kind != "float":
        raise CorruptDataError(f"lcckpt blob: {kind} kind with dtype {p.dt.name}")
    return np.float64 if p.dt.name == "F64" else np.float32


def _lossy_header(r: Reader, p: Parsed, version: int) -> None:
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
    p.layouts = [streams.read_tables(r, p.n, 1 << p.log2, p.bits, allowed)]


def _uniform_header(r: Reader, p: Parsed, version: int) -> None:
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
    p.layouts = [streams.read_tables(r, p.n, 1 << p.log2, p.bits, entropy.uniform_modes("auto", p.bits))]
    p.esc_idx = np.zeros(nesc, escape_index_dtype(p.n))   # located after the header checksum
    p.esc_val = np.zeros(nesc, work)


def _lossless_header(r: Reader, p: Parsed, version: int) -> None:
    """Exact byte planes: their number, the rotation flag, each plane's tables."""
    nplanes = r.u8()
    words, rotate = lossless.words_of(np.empty((0,), p.dt.numpy), p.dt.kind)
    if nplanes != words.dtype.itemsize:
        raise CorruptDataError(f"lcckpt blob: {nplanes} byte planes for dtype {p.dt.name}")
    rot = r.u8()
    if rot != int(rotate):
        raise CorruptDataError("lcckpt blob: rotation flag does not match the dtype")
    p.rotate = rotate
    allowed = (entropy.BYTES_READ if version == PAIRS_VERSION
               else entropy.modes_for("bytes", 8))
    p.layouts = [streams.read_tables(r, words_n(p.n, p.dt), 1 << p.log2, 8, allowed)
                 for _ in range(nplanes)]


def escape_parts(n: int, idx: np.ndarray, val: np.ndarray) -> list:
    """The payload pieces of a uniform blob's escapes (see the layout above)."""
    if not idx.size:
        return []
    return [idx.astype(escape_index_dtype(n), copy=False),      # copies only when needed
            np.ascontiguousarray(val).astype(val.dtype.newbyteorder("<"), copy=False)]


ESCAPE_RANGE = 1 << 20     # elements whose escapes are listed at a time (lazy_escapes)


def lazy_escapes(n: int, escf: np.ndarray, count: int, source: np.ndarray, ref):
    """:func:`escape_parts` made range by range from the escape bitmap (bit ``i % 8`` of
    byte ``i // 8``), never listing all ``count`` escapes at once: first their indices,
    then their values, which are also set in ``ref`` (the encoder's reference; None:
    nothing set). One index buffer serves both passes, sized for the range with the
    most escapes."""
    it = escape_index_dtype(n)
    step = ESCAPE_RANGE // 8
    most = max((int(uk.count_bits(escf[j:j + step])) for j in range(0, escf.size, step)),
               default=0)
    buf = np.empty(most, it)

    def listed():
        for j in range(0, escf.size, step):
            k = uk.list_bits(escf[j:j + step], min(n - 8 * j, ESCAPE_RANGE), buf)
            if k:
                buf[:k] += it.type(8 * j)
                yield buf[:k]        # valid until the next is asked for
    total = 0
    for idx in listed():
        total += idx.size
        yield idx
    if total != count:
        raise AssertionError(f"escapes: listed {total}, counted {count}")
    vals = np.empty(most, source.dtype)
    for idx in listed():
        val = vals[:idx.size]
        if uk.take(source, idx, val) or (ref is not None and uk.set_escapes(ref, idx, val)):
            raise AssertionError("escapes: an index past the tensor")
        yield val.astype(val.dtype.newbyteorder("<"), copy=False)   # valid until the next


def read_escapes(buf, at: int, p: Parsed) -> None:
    """The escapes as views of the blob's bytes where the machine is little-endian (no
    copy: a delta early in Adam's run holds millions of them)."""
    k = p.esc_idx.size
    it = escape_index_dtype(p.n)
    idx = np.frombuffer(buf, it, k, at).astype(it.newbyteorder("="), copy=False)
    val = np.frombuffer(buf, p.esc_val.dtype.newbyteorder("<"), k, at + k * it.itemsize)
    val = val.astype(p.esc_val.dtype, copy=False)
    if not tk.escapes_valid(idx, p.n, val):
        raise CorruptDataError("lcckpt blob: escape indices out of range or out of order, "
                               "or a non-finite escape value")
    p.esc_idx, p.esc_val = idx, val


def words_n(n: int, dt: dtypes.DType) -> int:
    """Words of the lossless planes: complex numbers are two floats each."""
    return 2 * n if dt.kind == "complex" else n
