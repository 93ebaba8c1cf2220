"""The float fast path's readers: :class:`FastDecoder` for blobs whose lower planes are
raw throughout (trained weights), :class:`MixedDecoder` for those where some chunks of a
lower plane are coded (a pretrained embedding's untrained rows). The layouts are those of
every lossless blob (:mod:`lcckpt.codec.lossless` writes them); these read them faster."""

from functools import lru_cache

import numpy as np

from ..errors import ChecksumError, CorruptDataError
from ..util import crc as _crc, memory as _memory, pool as _pool
from . import entropy
from .kernels import huffman as hk
from .kernels import planes as pk
from .lossless import FAST_DECODE_MIN_WORDS, FAST_WIDTHS, _block, plane_decoder


_NO_TABLES = (np.zeros(1 << hk.MULTI_BITS, np.uint64), np.zeros(2, np.uint32), 1)
assert (pk.CHUNK_HUFFMAN, pk.CHUNK_RAW, pk.CHUNK_CONST, pk.CHUNK_PAIRS) == \
    (entropy.HUFFMAN, entropy.RAW, entropy.CONST, entropy.PAIRS)


@lru_cache(maxsize=64)
def _tables(lengths_bytes: bytes):
    lengths = np.frombuffer(lengths_bytes, np.uint8)
    bits = int(lengths.max())
    return (hk.multi_decode_table(lengths, 8), hk.decode_table(lengths, bits), bits)


class MixedDecoder:
    """A float blob whose lower planes are raw but in some chunks (those
    :func:`lcckpt.codec.lossless.plan_floats` codes): a chunk with a coded lower plane by
    the general plane decoder, runs of the others by the fused kernel, told where their
    raw bytes lie."""

    GROUP = 4

    def __init__(self, buf, base, layouts, n, chunk_size, words, what):
        self.fast = FastDecoder(buf, base, layouts, n, chunk_size, words, what)
        self.general = plane_decoder(buf, base, layouts, n, chunk_size, True, words, what)
        self.nch = self.fast.nch
        self.ntasks = -(-self.nch // self.GROUP)
        lower = layouts[:-1]
        self.coded = np.zeros(len(lower[0].modes), bool)
        for lay in lower:
            self.coded |= lay.modes != entropy.RAW
        start = np.arange(len(self.coded), dtype=np.int64) * chunk_size
        # where chunk c's raw bytes of plane k lie, less c's offset in the words
        self.shift = np.stack([lay.offsets[:-1] - start for lay in lower], axis=1)

    @staticmethod
    def applies(layouts, n: int, rotate: bool, item: int) -> bool:
        return (rotate and item in FAST_WIDTHS and n >= FAST_DECODE_MIN_WORDS
                and all(np.all(np.isin(lay.modes, (entropy.RAW, entropy.HUFFMAN,
                                                   entropy.CONST))) for lay in layouts[:-1]))

    def chunk(self, c):
        if self.coded[c]:
            self.general(c)
        else:
            self.fast._decode(c, c + 1, self.fast.raw_base + self.shift[c])

    def task(self, j):
        """Chunks ``GROUP * j`` on: in one fused call where none has a coded lower plane
        (their raw bytes then lie at one shift from where an all-raw blob has them)."""
        c0, c1 = j * self.GROUP, min(self.nch, (j + 1) * self.GROUP)
        if not self.coded[c0:c1].any():
            self.fast._decode(c0, c1, self.fast.raw_base + self.shift[c0])
            return
        for c in range(c0, c1):
            self.chunk(c)


class FastDecoder:
    """Decodes a float blob whose lower planes are raw throughout: a run of chunks per
    compiled call (:func:`pk.decode_float_chunks`: the exponents into a small per-thread
    buffer, merged while in cache), and with ``crc`` the CRC of each run's pieces."""

    GROUP = 4                    # chunks per task: four Huffman chunks decode side by side

    def __init__(self, buf, base, layouts, n, chunk_size, words, what, crc=False):
        self.buf, self.n, self.cs = _memory.read_only(buf), n, chunk_size
        self.words, self.what = words, what
        self.item = item = words.dtype.itemsize
        self.pbase = base
        self.raw_base = np.zeros(item - 1, np.int64)
        for k, layout in enumerate(layouts[:-1]):
            self.raw_base[k] = base
            base += int(layout.offsets[-1])
        self.top = layouts[-1]
        self.tbase = base
        if base + int(self.top.offsets[-1]) > buf.size:
            raise CorruptDataError(f"{what}: chunk table points past the end of the data")
        lengths = self.top.lengths.get(entropy.HUFFMAN)
        self.tables = _tables(lengths.tobytes()) if lengths is not None else _NO_TABLES
        self.nch = -(-n // chunk_size)
        self.ntasks = -(-self.nch // self.GROUP)
        self.crcs = np.zeros((item, self.ntasks), np.int64) if crc else None

    @staticmethod
    def applies(layouts, n: int, rotate: bool, item: int) -> bool:
        return (rotate and item in FAST_WIDTHS and n >= FAST_DECODE_MIN_WORDS
                and all(np.all(lay.modes == entropy.RAW) for lay in layouts[:-1]))

    def _decode(self, c0, c1, raw_base=None):
        multi, single, tb = self.tables
        block = _block(self.item - 1, self.GROUP * self.cs)
        raw_base = self.raw_base if raw_base is None else raw_base
        r = pk.decode_float_chunks(self.buf, raw_base, self.tbase, self.top.offsets,
                                   self.top.modes, self.top.consts, c0, c1, self.cs, self.n,
                                   self.item, self.words, block, multi, single, tb)
        if r >= 0:
            c, err = divmod(int(r), 8)
            why = ("does not decode to its recorded size" if err == 1
                   else pk.PAIRS_ERRORS[err - 1])
            raise CorruptDataError(f"{self.what}: chunk {c} "
                                   f"({entropy.MODE_NAMES[self.top.modes[c]]}) {why}; "
                                   "the data is damaged")

    def chunk(self, c):
        """Decode chunk ``c`` alone (a step of a larger per-chunk task)."""
        self._decode(c, c + 1)

    def task(self, j):
        """Chunks ``GROUP * j`` on, and their pieces' CRCs when asked."""
        c0 = j * self.GROUP
        c1 = min(self.nch, c0 + self.GROUP)
        self._decode(c0, c1)
        if self.crcs is not None:
            lo, hi = c0 * self.cs, min(self.n, c1 * self.cs)
            for k, b in enumerate(self.raw_base):
                self.crcs[k, j] = _crc.piece_crc32(self.buf[b + lo:b + hi])
            off = self.top.offsets
            self.crcs[-1, j] = _crc.piece_crc32(
                self.buf[self.tbase + off[c0]:self.tbase + off[c1]])

    def run(self, stored_crc: int | None = None):
        """Decode every chunk on the pool; with ``stored_crc`` compare the payload's CRC
        (damage that stops the decoding is reported as a checksum mismatch too)."""
        try:
            _pool.run_balanced(self.task, self.ntasks)
        except CorruptDataError:
            end = self.tbase + int(self.top.offsets[-1])
            if stored_crc is not None and _crc.crc32(self.buf[self.pbase:end]) != stored_crc:
                raise ChecksumError(f"{self.what}: payload checksum mismatch; the blob is "
                                    "damaged") from None
            raise
        if stored_crc is not None:
            g = self.GROUP * self.cs
            raw = np.minimum(g, self.n - np.arange(self.ntasks) * g)
            edges = np.minimum(self.nch, np.arange(self.ntasks + 1) * self.GROUP)
            top = np.diff(self.top.offsets[edges])
            sizes = [raw] * (self.item - 1) + [top]
            if _crc.combine_all(self.crcs, sizes) != stored_crc:
                raise ChecksumError(f"{self.what}: payload checksum mismatch; the blob is damaged")
