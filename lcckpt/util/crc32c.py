"""CRC-32C (Castagnoli) of a byte array: the container's section checksum (format v2).

Why not zlib's CRC-32: a tensor blob ends with the CRC-32 of its own payload, and the
CRC-32 of a message followed by its own CRC-32 is a constant, so a CRC-32 over a blob
says nothing about its content. A different polynomial has no such identity.

Two kernels with the same result: one using the SSE4.2 ``crc32`` instruction (x86-64),
one table-driven (slicing by 8) everywhere else. :func:`kernel` picks one once, by
compiling and checking the instruction kernel against the table on a known input.
"""

import platform

import numpy as np
from numba import types
from numba.extending import intrinsic

from . import jit

POLY = 0x82F63B78                      # reflected Castagnoli polynomial


def _tables() -> np.ndarray:
    t = np.zeros((8, 256), np.uint32)
    for i in range(256):
        c = i
        for _ in range(8):
            c = (c >> 1) ^ POLY if c & 1 else c >> 1
        t[0, i] = c
    for k in range(1, 8):
        t[k] = (t[k - 1] >> 8) ^ t[0, t[k - 1] & 0xFF]
    return t


TABLES = _tables()


@jit.kernel
def crc32c_table(buf, crc, t):
    """CRC-32C of ``buf`` (uint8) continuing from ``crc`` (zlib's convention)."""
    c = np.uint32(crc) ^ np.uint32(0xFFFFFFFF)
    n = buf.size
    i = 0
    m = n - (n % 8)
    while i < m:
        lo = c ^ (np.uint32(buf[i]) | (np.uint32(buf[i + 1]) << 8)
                  | (np.uint32(buf[i + 2]) << 16) | (np.uint32(buf[i + 3]) << 24))
        c = (t[7, lo & 0xFF] ^ t[6, (lo >> 8) & 0xFF] ^ t[5, (lo >> 16) & 0xFF]
             ^ t[4, lo >> 24] ^ t[3, buf[i + 4]] ^ t[2, buf[i + 5]] ^ t[1, buf[i + 6]]
             ^ t[0, buf[i + 7]])
        i += 8
    while i < n:
        c = t[0, (c ^ buf[i]) & 0xFF] ^ (c >> 8)
        i += 1
    return c ^ np.uint32(0xFFFFFFFF)


@intrinsic
def _sse42_crc64(typingctx, crc, data):
    sig = types.uint64(types.uint64, types.uint64)

    def codegen(context, builder, signature, args):
        from llvmlite import ir
        i64 = ir.IntType(64)
        fn = builder.module.declare_intrinsic("llvm.x86.sse42.crc32.64.64",
                                              fnty=ir.FunctionType(i64, [i64, i64]))
        return builder.call(fn, args)

    return sig, codegen


@intrinsic
def _sse42_crc8(typingctx, crc, data):
    sig = types.uint32(types.uint32, types.uint8)

    def codegen(context, builder, signature, args):
        from llvmlite import ir
        i32, i8 = ir.IntType(32), ir.IntType(8)
        fn = builder.module.declare_intrinsic("llvm.x86.sse42.crc32.32.8",
                                              fnty=ir.FunctionType(i32, [i32, i8]))
        return builder.call(fn, args)

    return sig, codegen


@jit.kernel
def crc32c_sse42(buf, crc, t):
    """:func:`crc32c_table` with the SSE4.2 instruction, 8 bytes at a time."""
    c = np.uint32(crc) ^ np.uint32(0xFFFFFFFF)
    n = buf.size
    m = n - (n % 8)
    if m:
        words = buf[:m].view(np.uint64)
        c64 = np.uint64(c)
        for j in range(words.size):
            c64 = _sse42_crc64(c64, words[j])
        c = np.uint32(c64)
    for i in range(m, n):
        c = _sse42_crc8(c, buf[i])
    return c ^ np.uint32(0xFFFFFFFF)


_chosen = None


def kernel():
    """The fastest kernel that gives the right answer on this machine."""
    global _chosen
    if _chosen is None:
        _chosen = crc32c_table
        if platform.machine().lower() in ("x86_64", "amd64"):
            probe = np.frombuffer(b"123456789abcdefgh", np.uint8)
            try:
                if int(crc32c_sse42(probe, 0, TABLES)) == int(crc32c_table(probe, 0, TABLES)):
                    _chosen = crc32c_sse42
            except Exception:   # no SSE4.2 or the intrinsic cannot be compiled: tables
                pass
    return _chosen


# --- combining CRC-32 pieces -----------------------------------------------------------

@jit.kernel
def crc_combine_all(crcs, sizes, ops):
    """CRC-32 of pieces in row-major order from their CRCs and byte sizes. ``ops[k]`` is
    the operator that appends ``2**k`` zero bytes to a CRC register, byte-sliced:
    ``ops[k, j, b]`` is its image of byte value ``b`` in byte ``j`` of the register."""
    value = np.uint32(0)
    for r in range(crcs.shape[0]):
        for c in range(crcs.shape[1]):
            n = sizes[r, c]
            k = 0
            while n:
                if n & 1:
                    v = value
                    value = (ops[k, 0, v & 0xFF] ^ ops[k, 1, (v >> 8) & 0xFF]
                             ^ ops[k, 2, (v >> 16) & 0xFF] ^ ops[k, 3, v >> 24])
                n >>= 1
                k += 1
            value ^= np.uint32(crcs[r, c])
    return value
