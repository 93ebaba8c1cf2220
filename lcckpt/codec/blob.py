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
uniform blob is version 2, a lossless blob with "pairs" chunks (a code per chunk of
exponents, kernels/planes.py) version 3, and one with a lower plane's chunks coded as zero
runs (lossless.py, the mostly-zero rows of a fine-tune's moments) version 4, so a reader
that predates them says "upgrade" instead of misreading them.

A lossy blob holds a quantized *delta*: decoding adds it to a reference (zeros for a
stand-alone ``encode``). A lossless blob holds exact values. See docs/algorithm.md §8.

This module writes and reads every header byte; it codes nothing (tensor.py does).
"""

from __future__ import annotations

import math
import zlib
from dataclasses import dataclass, field
from functools import lru_cache

import numpy as np

from ..util import crc as _crc, memory as _memory
from . import dtypes, entropy, lossless, streams
from .kernels import head, huffman as hk, runs as rk, tables as tk, uniform as uk
from ..util.wire import Writer
from ..errors import (
    ChecksumError, CorruptDataError, InvalidArgumentError, TruncatedError, UnsupportedVersionError,
)
from .uniform import escape_index_dtype, uniform_table

MAGIC = b"LCC"
VERSION = 1                 # lossy and lossless blobs
UNIFORM_VERSION = 2         # uniform blobs (the only kind version 2 adds)
PAIRS_VERSION = 3           # lossless blobs whose planes hold "pairs" chunks
RUNS_VERSION = 4            # lossless blobs with zero-runs chunks (and maybe "pairs" ones)
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
    """Exact planes; version 3 when a plane holds "pairs" chunks, 4 when one holds zero
    runs, so that a reader that predates them asks for an upgrade instead of misreading
    them."""
    used = set().union(*(e.modes.tolist() for e in encs))     # (np.any per plane: 36 us)
    pairs, runs = entropy.PAIRS in used, entropy.RUNS in used
    w = _header(LOSSLESS, dt, shape, log2,
                RUNS_VERSION if runs else PAIRS_VERSION if pairs else None)
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
    buf = np.frombuffer(blob, np.uint8)
    buf.flags.writeable = False     # a view of its own: decode kernels get read-only bytes
    if size is not None and (check_payload or size < len(buf)):
        raise InvalidArgumentError("parse(size=) reads a header: check_payload=False, "
                                   "and size at least the bytes given")
    total = len(buf) if size is None else size
    ints, u8, step = head.read_head(buf, total, *_head_tables())
    f = ints[:head.NF].tolist()
    shape = tuple(ints[head.NF:head.NF + f[head.F_NDIM]].tolist())
    if f[head.F_ERR] != head.H_OK:
        raise _head_error(f, shape, step, len(buf))
    kind, dt = f[head.F_KIND], dtypes.BY_CODE[f[head.F_CODE]]
    p = Parsed(kind, dt, shape, math.prod(shape), f[head.F_LOG2], f[head.F_END])
    p.layouts = _layouts(ints, u8, f)
    work = np.float64 if dt.name == "F64" else np.float32
    if kind == LOSSY:
        p.bits, p.midpoint, kept = f[head.F_BITS], bool(f[head.F_FLAGS] & 1), f[head.F_KEPT]
        p.centroids = np.zeros(1 << p.bits, work)
        p.centroids[1:kept + 1] = np.frombuffer(buf, work, kept, f[head.F_CENTROIDS])
    elif kind == UNIFORM:
        p.bits, p.step = f[head.F_BITS], float(step)
        p.centroids = uniform_table(p.step, p.bits, work)
        p.esc_idx = np.zeros(f[head.F_ESCAPES], escape_index_dtype(p.n))   # after the CRC
        p.esc_val = np.zeros(f[head.F_ESCAPES], work)
    else:
        p.rotate = bool(f[head.F_ROTATE])
    if zlib.crc32(buf[:f[head.F_HEADER_END]]) != f[head.F_CRC]:
        raise ChecksumError("lcckpt blob: header checksum mismatch; the blob is damaged")
    return check_body(buf, p, f[head.F_PAYLOAD], total, size, check_payload)


def check_body(buf, p: Parsed, payload: int, total: int, size, check_payload: bool):
    """After a parsed header: the blob's size against what it promises (payload, a
    uniform blob's escapes, the payload CRC), that CRC, and the escapes read; ``size``
    as in :func:`parse` (a partial read stops before the payload)."""
    esc_bytes = 0
    if p.kind == UNIFORM:
        esc_bytes = p.esc_idx.size * (escape_index_dtype(p.n).itemsize + p.esc_val.dtype.itemsize)
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
    if p.kind == UNIFORM and p.esc_idx.size:
        read_escapes(buf, p.payload_base + payload, p)
    return buf, p


@lru_cache(maxsize=1)
def _head_tables() -> tuple:
    """What :func:`head.read_head` checks a header's fields against, after its buffer and
    size: per version and dtype code, the modes each stream allows, the constants."""
    from .config import MAX_CHUNK_LOG2, MIN_CHUNK_LOG2
    codes = np.zeros((5, 256), np.int64)    # versions' kinds, dtypes' kind, work, planes, rotate
    codes[0, VERSION] = (1 << LOSSY) | (1 << LOSSLESS)
    codes[0, UNIFORM_VERSION] = 1 << UNIFORM
    codes[0, PAIRS_VERSION] = 1 << LOSSLESS
    codes[0, RUNS_VERSION] = 1 << LOSSLESS
    for code, dt in dtypes.BY_CODE.items():
        words, rot = lossless.words_of(np.empty((0,), dt.numpy), dt.kind)
        codes[1:, code] = ({"float": 1, "complex": 3}.get(dt.kind, 2),
                           8 if dt.name == "F64" else 4, words.dtype.itemsize, rot)
    allowed = np.zeros((5, 9, 8), np.uint8)   # lossy, uniform, lossless, pairs, runs
    for bits in range(1, 5):
        allowed[0, bits, list(entropy.modes_for("auto", bits))] = 1
    for bits in range(2, 9):
        allowed[1, bits, list(entropy.uniform_modes("auto", bits))] = 1
    allowed[2, 8, list(entropy.modes_for("bytes", 8))] = 1
    allowed[3, 8, list(entropy.BYTES_READ)] = 1
    allowed[4, 8, list(entropy.BYTES_READ) + [entropy.RUNS]] = 1
    params = np.array(list(MAGIC) + [MAX_NDIM, MIN_CHUNK_LOG2, MAX_CHUNK_LOG2, entropy.CONST,
                      entropy.RAW, PAIRS_VERSION, UNIFORM, LOSSLESS, rk.RUN_CLASSES,
                      hk.MAX_CODE_LEN], np.int64)
    return codes, allowed, params


def _layouts(ints, u8, f: list) -> list:
    """Each stream's code lengths and chunk table, as views of :func:`head.read_head`'s
    outputs."""
    planes, room, cap = max(f[head.F_PLANES], 1), f[head.F_ROOM], f[head.F_CAP]
    lo0 = head.NF + MAX_NDIM
    bounds = ints[lo0:lo0 + 4 * planes].tolist()
    out = []
    for k in range(planes):
        at = bounds[4 * k:4 * k + 4]
        mo, co, of = (planes * room + k * cap, planes * (room + cap) + k * cap,
                      lo0 + 4 * planes + k * (cap + 1))
        out.append(streams.StreamLayout(u8[mo:mo + cap], u8[co:co + cap],
                                        ints[of:of + cap + 1], {
            m: u8[at[m]:at[m + 1]] for m in entropy.CODED_MODES if at[m + 1] > at[m]}))
    return out


def _head_error(f: list, shape: tuple, step: float, have: int) -> Exception:
    """The exception for :func:`head.read_head`'s error code and details."""
    H, what = head, "lcckpt blob"
    err, d1, d2 = f[H.F_ERR], f[H.F_D1], f[H.F_D2]
    kind, version = f[H.F_KIND], f[H.F_VERSION]
    name = dtypes.BY_CODE[f[H.F_CODE]].name if f[H.F_CODE] in dtypes.BY_CODE else "?"
    if err == H.H_MAGIC:
        return CorruptDataError("not an lcckpt blob (bad magic); was it produced by lcckpt.encode?")
    if err == H.H_VERSION:
        return UnsupportedVersionError(
            f"blob format version {version}; this lcckpt reads versions {VERSION} to "
            f"{RUNS_VERSION}: upgrade lcckpt")
    if err == H.H_TRUNCATED:
        return TruncatedError(f"{what} is truncated: needed {d1} more bytes at offset {d2}, "
                              f"only {have - d2} left; the data was cut short or damaged")
    if err == H.H_LIMIT:
        field, limit = {H.V_NDIM: ("ndim", MAX_NDIM), H.V_DIM: ("dimension", H.MAX_DIM),
                        H.V_ESCAPES: ("number of escapes", math.prod(shape))}[d2]
        value = f"= {d1}" if d1 >= 0 else "of 2**63 or more"
        return CorruptDataError(f"{what}: {field} {value} exceeds its limit {limit}")
    if err == H.H_LENGTHS and d1 == tk.L_TRUNCATED:
        return TruncatedError(f"{what} is truncated inside a code table at offset {d2}; "
                              "the data was cut short or damaged")
    if err == H.H_ROOM:
        return TruncatedError(f"{what} is truncated: no room for a table of {d1} chunks")
    if err == H.H_CHUNKS:
        nchunks = -(-f[H.F_SYMBOLS] // (1 << f[H.F_LOG2]))
        if d1 == tk.TRUNCATED:
            return TruncatedError(f"{what} is truncated: {tk.ERRORS[d1]} (chunk {d2} of {nchunks})")
        return CorruptDataError(f"{what}: chunk {d2} {tk.ERRORS[d1]}")
    uniform = kind == UNIFORM
    return CorruptDataError(f"{what}: " + {
        H.H_KIND: f"unknown kind {d1} in a version {d2} blob",
        H.H_CODE: f"unknown dtype code {d1}",
        H.H_VARINT: f"malformed varint at offset {d1}",
        H.H_LOG2: f"chunk size 2**{d1} out of range",
        H.H_SHAPE: f"shape {shape} is larger than the blob can describe",
        H.H_WORK: f"{'uniform' if uniform else 'lossy'} kind with dtype {name}",
        H.H_BITS: f"uniform symbols of {d1} bits" if uniform else f"bits = {d1}",
        H.H_FLAGS: f"unknown flags {d1:#x}",
        H.H_KEPT: f"{d1} buckets exceed {d2} bits",
        H.H_CENTROID: "non-finite centroid",
        H.H_STEP: f"uniform step {step}",
        H.H_OVERFLOW: "uniform step overflows the table",
        H.H_PLANES: f"{d1} byte planes for dtype {name}",
        H.H_ROTATE: "rotation flag does not match the dtype",
        H.H_NOT_ALLOWED: "code table for a mode this stream cannot use",
        H.H_LENGTHS: streams.LENGTH_ERRORS.get(d1, "invalid code table"),
        H.H_MASK: f"unknown code table flags {d1:#x}",
    }[err])


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
    idx, val = _memory.read_only(idx), _memory.read_only(val)
    if not tk.escapes_valid(idx, p.n, val):
        raise CorruptDataError("lcckpt blob: escape indices out of range or out of order, "
                               "or a non-finite escape value")
    p.esc_idx, p.esc_val = idx, val


def words_n(n: int, dt: dtypes.DType) -> int:
    """Words of the lossless planes: complex numbers are two floats each."""
    return 2 * n if dt.kind == "complex" else n
