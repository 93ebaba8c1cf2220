"""Where a container's bytes come from: a buffer in memory, or a file read at offsets
(positional reads, safe from the pool's threads)."""

import os
import threading
from typing import BinaryIO

import numpy as np


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
        if self.owned:
            self.f.close()
