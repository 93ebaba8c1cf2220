"""Where a container's bytes come from: a buffer in memory, or a file read at offsets
(positional reads, safe from the pool's threads)."""

from __future__ import annotations

import os
import threading
from typing import BinaryIO

import numpy as np

from ..errors import CorruptDataError, TruncatedError


class BufferSource:
    """Container bytes already in memory."""

    def __init__(self, view: memoryview):
        self.view = view
        self.size = view.nbytes

    def read(self, offset: int, n: int) -> memoryview:
        return self.view[offset : offset + n]

    def readinto(self, offset: int, out: memoryview) -> int:
        chunk = self.view[offset : offset + out.nbytes]
        out[: chunk.nbytes] = chunk
        return chunk.nbytes

    def close(self) -> None:
        pass


class FileSource:
    """A seekable file; ``base`` is where the container starts in it."""

    def __init__(self, f: BinaryIO, base: int, owned: bool):
        self.f, self.base, self.owned = f, base, owned
        self.size = f.seek(0, os.SEEK_END) - base
        self.dup = None              # a descriptor shared by PartReaders (PartReader.of)
        self.lock = threading.Lock()

    def read(self, offset: int, n: int) -> memoryview:
        buf = np.empty(n, np.uint8)
        got = self.readinto(offset, memoryview(buf))
        return memoryview(buf)[:got]

    def readinto(self, offset: int, out: memoryview) -> int:
        """Read up to ``out.nbytes`` bytes at ``offset``; safe from several threads at once
        (positional reads on a file lcckpt opened itself, else one seek+read at a time)."""
        if self.owned and hasattr(os, "preadv"):
            fd, got = self.f.fileno(), 0
            while got < out.nbytes:
                n = os.preadv(fd, [out[got:]], self.base + offset + got)
                if not n:
                    break
                got += n
            return got
        with self.lock:
            self.f.seek(self.base + offset)
            got = 0
            while got < out.nbytes:
                n = self.f.readinto(out[got:])
                if not n:
                    break
                got += n
            return got

    def close(self) -> None:
        self.dup = None              # its PartReaders keep it while they read
        if self.owned:
            self.f.close()


class _Dup:
    """A duplicate of a file's descriptor, closed when the last holder lets it go."""

    def __init__(self, fd: int):
        self.fd = -1
        self.fd = os.dup(fd)

    def __del__(self):
        if self.fd >= 0:
            os.close(self.fd)


class PartReader:
    """Positional reads of one span of a file lcckpt opened, through a duplicate of its
    descriptor (one per file, shared by its spans): it outlives the container it came
    from (a keyframe decoded after its chain's files were closed), and lets it go on
    :meth:`close` or when collected."""

    def __init__(self, dup: _Dup, start: int, length: int):
        self._dup, self.start, self.length = dup, start, length

    @staticmethod
    def of(source, start: int, length: int) -> PartReader | None:
        """Reads of ``length`` bytes from ``start`` of a container's ``source``, where it
        is a file lcckpt opened itself (and ``os.preadv`` exists); else None (also when
        no descriptor is left to duplicate: the caller reads the span whole)."""
        if not isinstance(source, FileSource) or not source.owned or not hasattr(os, "preadv"):
            return None
        if source.dup is None:
            try:
                source.dup = _Dup(source.f.fileno())
            except OSError:
                return None
        return PartReader(source.dup, source.base + start, length)

    @staticmethod
    def of_path(path: str, start: int, length: int) -> PartReader | None:
        """Reads of ``length`` bytes from ``start`` of the local file ``path`` (None where
        ``os.preadv`` is missing or the file cannot be opened: the caller reads whole)."""
        if not hasattr(os, "preadv"):
            return None
        try:
            fd = os.open(path, os.O_RDONLY | getattr(os, "O_BINARY", 0))
        except OSError:
            return None
        try:
            return PartReader(_Dup(fd), start, length)
        except OSError:
            return None
        finally:
            os.close(fd)

    def read(self, offset: int, out) -> None:
        """Fill ``out`` with the span's bytes from ``offset`` on."""
        view = memoryview(out).cast("B")
        if not 0 <= offset <= offset + view.nbytes <= self.length:
            raise CorruptDataError(f"bytes {offset}..{offset + view.nbytes} asked for, the "
                                   f"section holds {self.length}")
        if self._dup is None:
            raise ValueError("read from a closed PartReader")
        got = 0
        while got < view.nbytes:
            n = os.preadv(self._dup.fd, [view[got:]], self.start + offset + got)
            if not n:
                raise TruncatedError("the file ends inside a section: it was truncated or "
                                     "changed while being read")
            got += n

    def close(self) -> None:
        self._dup = None
