"""The bit writer and reader every coder shares (MSB-first, big-endian bytes).

Writers keep a 64-bit accumulator ``acc`` holding ``nb`` pending bits and flush 32 bits
at a time; a put never exceeds 32 bits, so the accumulator never overflows. Readers
refill up to 57+ bits (eight bytes at a time away from the end) and treat bytes past the
end as zeros; callers check the consumed bit count afterwards. The state travels as
plain values in and out (no objects), which Numba keeps in registers once the helpers
are inlined.

Every bit counter is uint64: mixing signed and unsigned integers makes Numba convert
through floats, which tripled the cost per symbol.
"""

import numpy as np
from numba import types
from numba.extending import intrinsic

from ...util.jit import kernel

Z = np.uint64(0)
U8 = np.uint64(8)
W = np.uint64(32)
REFILL = np.uint64(56)
_MASK8 = np.uint64(0xFF)


@kernel(inline="always")
def write32(out, p, w):
    """Store the 32-bit word ``w`` big-endian at ``out[p:p + 4]``."""
    out[p] = np.uint8(w >> np.uint32(24))
    out[p + 1] = np.uint8(w >> np.uint32(16))
    out[p + 2] = np.uint8(w >> np.uint32(8))
    out[p + 3] = np.uint8(w)


@kernel(inline="always")
def put(acc, nb, code, ln, out, p):
    """Append the ``ln`` low bits of ``code`` (``ln`` <= 32); returns ``(acc, nb, p)``.

    Written with two returns on purpose: the same logic with ``p += 4`` before a single
    return compiled to code twelve times slower per symbol (Numba 0.6x).
    """
    acc = (acc << ln) | code
    nb += ln
    if nb >= W:
        nb -= W
        write32(out, p, np.uint32(acc >> nb))
        return acc, nb, p + 4
    return acc, nb, p


@kernel(inline="always")
def flush(acc, nb, out, p):
    """Write the pending bits, zero-padded to a whole byte; return the new position."""
    while nb > Z:
        if nb >= U8:
            nb -= U8
            out[p] = np.uint8((acc >> nb) & _MASK8)
        else:
            out[p] = np.uint8((acc << (U8 - nb)) & _MASK8)
            nb = Z
        p += 1
    return p


@intrinsic
def clz64(typingctx, x):
    """Leading zero bits of the uint64 ``x`` (64 for 0): LLVM's ``ctlz``, one instruction
    (``lzcnt``) where the CPU has it."""
    sig = types.uint64(types.uint64)

    def codegen(context, builder, signature, args):
        from llvmlite import ir
        return builder.ctlz(args[0], ir.Constant(ir.IntType(1), 0))

    return sig, codegen


@kernel(inline="always")
def load64(buf, p):
    """Eight bytes big-endian from ``buf[p]`` (LLVM fuses the loads into one)."""
    return ((np.uint64(buf[p]) << np.uint64(56)) | (np.uint64(buf[p + 1]) << np.uint64(48))
            | (np.uint64(buf[p + 2]) << np.uint64(40)) | (np.uint64(buf[p + 3]) << np.uint64(32))
            | (np.uint64(buf[p + 4]) << np.uint64(24)) | (np.uint64(buf[p + 5]) << np.uint64(16))
            | (np.uint64(buf[p + 6]) << np.uint64(8)) | np.uint64(buf[p + 7]))


@kernel(inline="always")
def refill(acc, nb, buf, p, end):
    """Load whole bytes until more than 56 bits are pending; returns ``(acc, nb, p)``.

    Away from the end, one 8-byte load takes all the bytes at once: the byte loop, a
    branch per byte, took about 8% of the lossy decoders' time."""
    if nb <= REFILL and p + 8 <= end:
        k8 = (np.uint64(64) - nb) & np.uint64(0x78)          # whole bytes that fit, 8-64
        w = load64(buf, p)
        acc = ((acc << np.uint64(1)) << (k8 - np.uint64(1))) | (w >> (np.uint64(64) - k8))
        return acc, nb + k8, p + np.int64(k8 >> np.uint64(3))
    while nb <= REFILL:
        b = Z
        if p < end:
            b = np.uint64(buf[p])
        acc = (acc << U8) | b
        p += 1
        nb += U8
    return acc, nb, p


@kernel(inline="always")
def lookup(table, acc, nb, tb, tmask):
    """One canonical-Huffman table lookup at the reader's position: ``(letter, length)``;
    length 0 marks an invalid code. Entries are ``letter << 4 | length``."""
    e = table[(acc >> (nb - tb)) & tmask]
    return np.int64(e >> np.uint32(4)), np.uint64(e & np.uint32(15))


@kernel(inline="always")
def reader_at(buf, bp, end):
    """The byte reader's state ``(acc, nb, p)`` at bit ``bp`` (the hand-over from a fast
    loop that loads its windows straight from a bit position)."""
    p = np.int64(bp >> np.uint64(3))
    skip = bp & np.uint64(7)
    if p < end:
        return np.uint64(buf[p]) & (_MASK8 >> skip), U8 - skip, p + 1
    return Z, Z, p

