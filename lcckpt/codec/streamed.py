"""A lossless keyframe decoded straight from its file, chunk by chunk.

A restore used to read a keyframe's section whole into a fresh buffer, check its CRC,
and then decode it. On the 2-core VM the benchmarks ran on, first-touching the pages of
that buffer cost more than the copy itself: reading a 206 MB keyframe into fresh memory
took 0.25-0.35 s on one thread, into a reused 1 MB buffer 0.03-0.13 s (``os.preadv`` of
the file from the page cache, three tries each). Here each task
reads the bytes of its chunk (one span per byte plane, :func:`chunk_spans`) into a
buffer of its thread that is reused, decodes them into the output while they are in
cache, and keeps their CRCs; the blob's own checksums, of its header (when it is
parsed) and of its payload (combined from the pieces once every chunk is decoded), then
vouch for every byte, as the section's CRC does on the other path. The output holds
garbage if that last check fails, and the restore raises.
"""

from __future__ import annotations

import contextlib
import threading
from typing import Callable

import numpy as np

from ..errors import ChecksumError, CorruptDataError, LcckptError, TruncatedError
from ..util import crc as _crc, memory as _memory
from ..util.pool import on_pool_thread, run_tasks
from . import blob as _blob
from .tensor import chunk_spans, decode_exact_chunks

STREAM_MIN = 8 << 20        # sections smaller than this are read whole (format/sections.py)
HEADER_PREFIX = 1 << 16     # bytes of a blob read first for its header (grown as needed)
READ_PIECE = 1 << 22        # bytes per task of a deferred blob's read
DEFERRED_PREFIX = 1 << 13   # a chain blob's first header read (a delta's code tables fit; grown)
BY_CHUNK_MIN = 1 << 22      # a replay's deferred deltas, together, read chunk by chunk from here


def read_header(read: Callable, size: int, prefix: int = HEADER_PREFIX) -> _blob.Parsed:
    """The parsed header of a blob of ``size`` bytes that ``read(offset, out)`` gives: a
    prefix is read, grown until the header and its checksum are whole."""
    want = min(size, prefix)
    while True:
        head = np.empty(want, np.uint8)
        read(0, head)
        try:
            return _blob.parse(head, check_payload=False, size=size)[1]
        except TruncatedError:
            if want == size:
                raise
        want = min(size, 4 * want)


class StreamedBlob:
    """A lossless blob whose header is ``parsed``, read through ``part`` (a
    :class:`~lcckpt.format.sources.PartReader`, closed once the blob is decoded). Its
    errors carry ``origin`` (the file's step and path, for the caller) as ``.origin``."""

    def __init__(self, parsed: _blob.Parsed, part, what: str, origin=None):
        self.parsed, self.part, self.what, self.origin = parsed, part, what, origin
        self.read, size = part.read, part.length
        p = parsed
        self.nch = -(-_blob.words_n(p.n, p.dt) // (1 << p.log2))
        self.crcs = np.zeros((len(p.layouts), self.nch), np.int64)
        tail = np.empty(4, np.uint8)
        self.read(size - 4, tail)
        self.stored_crc = int.from_bytes(tail.tobytes(), "little")
        self._local = threading.local()

    def _buffer(self, n: int) -> np.ndarray:
        buf = getattr(self._local, "buf", None)
        if buf is None or buf.size < n:
            buf = self._local.buf = np.empty(max(n, 1 << 20), np.uint8)
        return buf[:n]

    def chunk_decoder(self, a: np.ndarray) -> Callable[[int], None]:
        """Per-chunk task decoding chunk ``c`` into the flat carrier array ``a``."""
        p = self.parsed
        cs = 1 << p.log2
        per = 2 if p.dt.kind == "complex" else 1

        def chunk(c: int) -> None:
            spans = chunk_spans(p, c, c + 1)
            data = self._buffer(sum(n for _, n in spans))
            pos = 0
            with _marked(self):
                for k, (off, n) in enumerate(spans):
                    piece = data[pos:pos + n]
                    self.read(off, piece)
                    self.crcs[k, c] = _crc.piece_crc32(piece)
                    pos += n
                lo = c * cs // per
                decode_exact_chunks(p, c, c + 1, data, out=a[lo:lo + len_of(c)])

        def len_of(c: int) -> int:
            return (min(_blob.words_n(p.n, p.dt), (c + 1) * cs) - c * cs) // per
        return chunk

    def check_whole(self) -> None:
        """Read the whole payload and raise :class:`ChecksumError` if its CRC is wrong
        (after a decode failed: damage is reported as such, as on the other path)."""
        _check_payload(self, self.part, self.parsed.payload_base, self.stored_crc,
                       self._buffer(min(READ_PIECE, self.part.length)))

    def verify(self) -> None:
        """Raise :class:`ChecksumError` unless the pieces read make the stored payload
        CRC; the file is let go either way."""
        self.part.close()
        sizes = [np.diff(lay.offsets.astype(np.int64)) for lay in self.parsed.layouts]
        if _crc.combine_all(self.crcs, sizes) != self.stored_crc:
            with _marked(self):
                raise _damaged(self)


def streamed(part, work: str, what: str, origin=None) -> StreamedBlob | None:
    """The blob that ``part`` (a :class:`~lcckpt.format.sources.PartReader`) reads, as a
    :class:`StreamedBlob` if it is lossless and stored as ``work`` (a chain's keyframe:
    the tracking precision, decoded into the reference itself); else None, ``part``
    closed (as it is when its header is damaged)."""
    try:
        p = read_header(part.read, part.length)
    except BaseException:
        part.close()
        raise
    if p.kind != _blob.LOSSLESS or p.dt.name != work:
        part.close()
        return None
    return StreamedBlob(p, part, what, origin)


class DeferredBlob:
    """A blob of a chain file (a delta, or a keyframe too small to stream) whose header is
    ``parsed`` and whose bytes are read through ``part`` only when it is decoded
    (:meth:`load`): a restore then holds the blobs of the tensor it replays, not those of
    every tensor of every file at once. ``check(buf)`` vouches for the bytes (the
    section's checksum); errors carry ``origin`` as :class:`StreamedBlob`'s do."""

    def __init__(self, parsed: _blob.Parsed, part, check: Callable, what: str, origin=None):
        self.parsed, self.part, self.check, self.what = parsed, part, check, what
        self.origin = origin

    def by_chunk(self) -> bool:
        """Whether the blob is a delta of one stream, which :class:`DeltaChunks` can read."""
        return self.parsed.kind != _blob.LOSSLESS and len(self.parsed.layouts) == 1

    def load(self) -> tuple[np.ndarray, _blob.Parsed]:
        """``(buf, parsed)`` of the blob's checked bytes (parsed again: what a header
        parse defers, such as its escapes, reads the whole blob); the file is let go."""
        n = self.part.length
        buf = _memory.bulk_empty(n, np.uint8)
        try:                            # pieces on the pool: their pages fault in side by side
            with _marked(self):
                if n <= READ_PIECE or on_pool_thread():
                    self.part.read(0, buf)
                else:
                    run_tasks(lambda k: self.part.read(k * READ_PIECE,
                                                       buf[k * READ_PIECE:(k + 1) * READ_PIECE]),
                              -(-n // READ_PIECE))
                self.check(buf)
                return _blob.parse(buf, check_payload=False)
        finally:
            self.part.close()


class DeltaChunks:
    """A deferred delta (:meth:`DeferredBlob.by_chunk`) read chunk by chunk by the tasks
    that replay it (:func:`lcckpt.codec.replay.replay`), each into a buffer of its thread:
    a restore of a large tensor holds a task's bytes of each delta, not all of them. The
    blob's own checksums vouch for every byte, as on :class:`StreamedBlob`'s path: its
    header's when it was parsed, its payload's (combined from each chunk's and the
    escapes') once every chunk was read (:meth:`finish`). Before that, the chunk table
    bounds every decode of bytes not yet vouched for, and a decode that fails is
    reported as damage where the checksum says so (:meth:`check_whole`)."""

    def __init__(self, blob: DeferredBlob):
        p = blob.parsed
        self.blob, self.parsed, self.offsets = blob, p, p.layouts[0].offsets
        self.crcs = np.zeros(len(self.offsets), np.int64)     # each chunk's, the escapes'
        self._local = threading.local()
        try:
            with _marked(blob):
                at = p.payload_base + int(self.offsets[-1])
                tail = np.empty(blob.part.length - at, np.uint8)
                blob.part.read(at, tail)
                self.crcs[-1] = _crc.piece_crc32(tail[:-4])
                self.stored_crc = int.from_bytes(tail[-4:].tobytes(), "little")
                if p.kind == _blob.UNIFORM and p.esc_idx.size:
                    try:
                        _blob.read_escapes(tail, 0, p)      # validated, as parse() does
                    except CorruptDataError:
                        self.check_whole()                  # damage is reported as such
                        raise
        except BaseException:
            self.close()
            raise

    def read(self, lo: int, hi: int) -> np.ndarray:
        """Chunks ``lo..hi-1``'s bytes, into a buffer of this thread (reused), each
        chunk's CRC kept."""
        off = self.offsets
        n = int(off[hi]) - int(off[lo])
        buf = getattr(self._local, "buf", None)
        if buf is None or buf.size < n:
            buf = self._local.buf = np.empty(n, np.uint8)
        view = buf[:n]
        with _marked(self.blob):
            self.blob.part.read(self.parsed.payload_base + int(off[lo]), view)
        for c in range(lo, hi):
            self.crcs[c] = _crc.piece_crc32(view[int(off[c]) - int(off[lo]):
                                                 int(off[c + 1]) - int(off[lo])])
        return view

    def finish(self) -> None:
        """Raise :class:`ChecksumError` unless the chunks read (every one of them) and the
        escapes make the payload's stored CRC."""
        sizes = np.diff(self.offsets.astype(np.int64))
        sizes = np.append(sizes, self.blob.part.length - self.parsed.payload_base
                          - int(self.offsets[-1]) - 4)
        if _crc.combine_all(self.crcs[None, :], [sizes]) != self.stored_crc:
            with _marked(self.blob):
                raise _damaged(self.blob)

    def check_whole(self) -> None:
        """After a decode failed: raise :class:`ChecksumError` if the payload is damaged."""
        part = self.blob.part
        _check_payload(self.blob, part, self.parsed.payload_base, self.stored_crc,
                       np.empty(min(READ_PIECE, part.length), np.uint8))

    def close(self) -> None:
        self._local = threading.local()
        self.blob.part.close()


def _check_payload(blob, part, start: int, stored: int, piece: np.ndarray) -> None:
    """Raise :class:`ChecksumError` (marked as ``blob``'s) unless the payload that ``part``
    reads from ``start`` to its CRC makes ``stored``, read a ``piece`` at a time."""
    crc, end = 0, part.length - 4
    with _marked(blob):
        for off in range(start, end, piece.size):
            view = piece[:min(piece.size, end - off)]
            part.read(off, view)
            crc = _crc.piece_crc32(view, crc)
        if crc != stored:
            raise _damaged(blob)


def _damaged(blob) -> ChecksumError:
    return ChecksumError(f"{blob.what}: payload checksum mismatch; the blob is damaged")


@contextlib.contextmanager
def _marked(blob):
    """Errors inside say which file ``blob`` came from (``.origin``)."""
    try:
        yield
    except (LcckptError, OSError) as e:
        e.origin = blob.origin
        raise


def read_later(part, work: str, check: Callable, what: str, origin=None, *,
               stream: bool, defer: bool) -> StreamedBlob | DeferredBlob | None:
    """The blob that ``part`` reads, its header read once: a :class:`StreamedBlob` where
    ``stream`` and it is lossless and stored as ``work``, else a :class:`DeferredBlob`
    where ``defer``, else None (``part`` closed: the caller reads it whole; also closed
    if its header is damaged)."""
    try:
        p = read_header(part.read, part.length, DEFERRED_PREFIX)
        if stream and p.kind == _blob.LOSSLESS and p.dt.name == work:
            return StreamedBlob(p, part, what, origin)
    except BaseException:
        part.close()
        raise
    if defer:
        return DeferredBlob(p, part, check, what, origin)
    part.close()
    return None
