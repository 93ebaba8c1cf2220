"""CRC-32 (zlib's) and CRC-32C of large buffers on several threads: pieces, then combine.

``zlib.crc32`` runs at about 1-4 GB/s on one core (ISA-L's, the same checksum, used when
the ``speed`` extra is installed, at 8+) and releases the GIL, but it is sequential. The
CRC of a concatenation follows from the CRCs of its parts (zlib's ``crc32_combine``,
which Python does not expose): appending ``n`` zero bytes to a message is a linear map
of its CRC register, a 32x32 matrix over GF(2). The matrices for ``2**k`` zero bytes are
built once by repeated squaring; combining is then a few matrix-vector products,
microseconds per piece. CRC-32C (the container's section checksum from format version 2,
see crc32c.py) combines the same way with its own polynomial.
"""

import zlib
from functools import lru_cache

import numpy as np

from .pool import gather, submit
from . import crc32c as _c

try:                     # the same CRC-32, 5-8x faster (carry-less multiply): optional extra
    from isal.isal_zlib import crc32 as piece_crc32
except ImportError:      # pragma: no cover - without the extra
    piece_crc32 = zlib.crc32

PIECE = 4 << 20          # bytes per CRC task
_POLY = 0xEDB88320       # reflected CRC-32 polynomial
_POLY_C = _c.POLY        # reflected CRC-32C polynomial


def _times(mat: tuple, vec: int) -> int:
    out, i = 0, 0
    while vec:
        if vec & 1:
            out ^= mat[i]
        vec >>= 1
        i += 1
    return out


def _square(mat: tuple) -> tuple:
    return tuple(_times(mat, row) for row in mat)


@lru_cache(maxsize=None)
def _zeros(k: int, poly: int = _POLY) -> tuple:
    """The operator appending ``2**k`` zero bytes to a CRC register."""
    if k == 0:
        one_bit = (poly,) + tuple(1 << i for i in range(31))    # one zero bit
        m = one_bit
        for _ in range(3):                                      # 8 bits = one byte
            m = _square(m)
        return m
    return _square(_zeros(k - 1, poly))


def crc32_combine(crc1: int, crc2: int, len2: int, poly: int = _POLY) -> int:
    """CRC-32 of ``a + b`` from ``crc1 = crc32(a)``, ``crc2 = crc32(b)``, ``len2 = len(b)``
    (``poly``: the reflected polynomial; CRC-32C's for :func:`crc32c` values)."""
    k = 0
    while len2:
        if len2 & 1:
            crc1 = _times(_zeros(k, poly), crc1)
        len2 >>= 1
        k += 1
    return crc1 ^ crc2


def crc32c_piece(view, value: int = 0) -> int:
    """CRC-32C of one buffer on this thread (the kernel releases the GIL)."""
    buf = np.frombuffer(memoryview(view).cast("B"), np.uint8)
    return int(_c.kernel()(buf, value, _c.TABLES))


def crc32c(view, value: int = 0) -> int:
    """CRC-32C of ``view`` continuing from ``value``, in pieces on the pool when large."""
    return _pieced(view, value, crc32c_piece, _POLY_C)


def crc32(view, value: int = 0) -> int:
    """``zlib.crc32(view, value)``, computed in pieces on the thread pool when it is large."""
    return _pieced(view, value, piece_crc32, _POLY)


def _pieced(view, value: int, piece, poly: int) -> int:
    view = memoryview(view).cast("B")
    if view.nbytes < 2 * PIECE:
        return piece(view, value)
    pieces = [view[off:off + PIECE] for off in range(0, view.nbytes, PIECE)]
    for p, c in zip(pieces, gather([submit(piece, p) for p in pieces])):
        value = crc32_combine(value, c, len(p), poly)
    return value


# --- the CRC-32 of many pieces at once (the exact codec's planes) ---------------------

def combine_all(crcs: np.ndarray, sizes, poly: int = _POLY) -> int:
    """CRC-32 (CRC-32C with ``poly=_POLY_C``) of the pieces in plane-major order from
    their own CRCs and sizes."""
    sizes = np.asarray(np.stack([np.asarray(x, np.int64) for x in sizes]), np.int64)
    if sizes.max(initial=0) >= 1 << _OP_BITS:
        raise AssertionError("a CRC piece of 2**40 bytes or more")
    return int(_c.crc_combine_all(np.asarray(crcs, np.int64), sizes, _zero_ops(poly)))


_OP_BITS = 40


@lru_cache(maxsize=2)
def _zero_ops(poly: int = _POLY) -> np.ndarray:
    """Byte-sliced operators appending ``2**k`` zero bytes to a CRC-32 register: the
    first from the images of the 32 unit registers (it is linear over GF(2)), each next
    one the previous applied twice."""
    ops = np.zeros((_OP_BITS, 4, 256), np.uint32)
    bits = np.arange(256)
    units = np.array([crc32_combine(1 << i, 0, 1, poly) for i in range(32)], np.uint32)
    basis = np.uint32(1) << np.arange(32, dtype=np.uint32)
    for k in range(_OP_BITS):
        if k:
            units = _apply(ops[k - 1], _apply(ops[k - 1], basis))
        for j in range(4):
            for i in range(8):
                ops[k, j, (bits >> i) & 1 == 1] ^= units[8 * j + i]
    return ops


def _apply(op: np.ndarray, v: np.ndarray) -> np.ndarray:
    return op[0, v & 0xFF] ^ op[1, (v >> 8) & 0xFF] ^ op[2, (v >> 16) & 0xFF] ^ op[3, v >> 24]


# --- the CRC-32C of each window of a section (checked reads of its parts) ----------------

class Windows:
    """CRC-32C (seed 0) of each ``2**log2``-byte window of a byte stream fed in pieces of
    any size, the last window shorter; whole windows of a large piece on the pool."""

    def __init__(self, log2: int):
        self.size, self.crcs, self._fill, self._crc, self.nbytes = 1 << log2, [], 0, 0, 0

    def update(self, view) -> None:
        view, pos = memoryview(view).cast("B"), 0
        self.nbytes += view.nbytes
        if self._fill:                                  # the window a piece left open
            pos = min(view.nbytes, self.size - self._fill)
            self._add(view[:pos])
        whole = (view.nbytes - pos) // self.size * self.size
        batch = 16 * self.size                         # windows per pool task
        for crcs in gather([submit(self._each, view[at:at + min(batch, pos + whole - at)])
                            for at in range(pos, pos + whole, batch)]):
            self.crcs.extend(crcs)
        if pos + whole < view.nbytes:
            self._add(view[pos + whole:])

    def _each(self, view) -> list:
        return [crc32c_piece(view[at:at + self.size]) for at in range(0, view.nbytes, self.size)]

    def _add(self, view) -> None:
        self._crc = crc32c_piece(view, self._crc)
        self._fill += view.nbytes
        if self._fill == self.size:
            self.crcs.append(self._crc)
            self._fill = self._crc = 0

    def finish(self) -> np.ndarray:
        """The windows' CRCs, little-endian u32."""
        if self._fill:
            self.crcs.append(self._crc)
            self._fill = self._crc = 0
        return np.asarray(self.crcs, "<u4")

    def continued(self, value: int) -> int:
        """The CRC-32C continued from ``value`` over every byte fed, from the windows'
        CRCs: no second pass over the bytes (what came before ``value`` needs no length:
        combining shifts only what is before each piece)."""
        crcs = self.finish()
        if not crcs.size:
            return value
        sizes = np.full(crcs.size + 1, self.size, np.int64)
        sizes[0], sizes[-1] = 0, self.nbytes - self.size * (crcs.size - 1)
        return combine_all(np.concatenate([[value], crcs.astype(np.int64)])[None],
                           sizes[None], _POLY_C)
