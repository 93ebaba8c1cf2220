"""Tiny binary reader/writer for blob headers: unsigned LEB128 varints, fixed ints.

The reader never trusts the data: every read checks the remaining length and raises
:class:`TruncatedError`, and varints are capped at 64 bits.
"""

import struct

from ..errors import CorruptDataError, TruncatedError


class Writer:
    def __init__(self):
        self.buf = bytearray()

    def u8(self, v: int):
        self.buf.append(v)

    def uvar(self, v: int):
        if v < 0:
            raise ValueError("varint must be non-negative")
        while True:
            b = v & 0x7F
            v >>= 7
            if v:
                self.buf.append(b | 0x80)
            else:
                self.buf.append(b)
                return

    def raw(self, b):
        self.buf += b

    def u32(self, v: int):
        self.buf += struct.pack("<I", v)


class Reader:
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
