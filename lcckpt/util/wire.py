"""Tiny binary writer for blob headers: unsigned LEB128 varints, fixed ints. Headers
are read back, every read checked, by one compiled call (codec/kernels/head.py)."""

import struct


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
