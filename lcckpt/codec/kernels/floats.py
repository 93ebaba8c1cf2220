"""Byte-plane split for the lossless codec (ALGORITHM.md §6, after ZipNN).

A float's exponent straddles two bytes; rotating the word left by one bit moves the
sign to the bottom so the top byte holds exactly the 8-bit exponent (bf16, fp32; the
top 8 exponent bits of fp64, the 5 exponent bits and 3 mantissa bits of fp16). Each byte
of the rotated word then becomes its own plane, which an order-0 coder can squeeze
where it is skewed (the exponents) and store raw where it is not (the mantissas).

One kernel per word width: with the plane count a compile-time constant the byte loop
unrolls, which made the split twice as fast as a width-generic loop. The split counts
the top plane exactly (``hist[top]``) and the other planes on every 8th element only
(enough to tell whether coding them can pay; the caller recounts a plane exactly when
it will code it).
"""

import numpy as np

from ...util.jit import kernel

SAMPLE = 8


@kernel(inline="always")
def _sample(planes, start, stop, top, hist):
    """Count the planes below ``top`` on every SAMPLE-th element (a strided second loop:
    no modulo test in the hot one)."""
    first = start + (-start) % SAMPLE
    for k in range(top):
        for i in range(first, stop, SAMPLE):
            hist[k, planes[k, i]] += 1


@kernel
def split16(words, start, stop, rotate, planes, hist):
    w, q0, q1 = words[start:stop], planes[0, start:stop], planes[1, start:stop]
    r = np.uint16(1 if rotate else 0)
    for i in range(stop - start):        # views from 0: the loop vectorizes
        x = np.uint16(w[i])
        x = np.uint16((x << r) | (x >> np.uint16((16 - r) & 15)))
        q0[i] = np.uint8(x & np.uint16(0xFF))
        q1[i] = np.uint8(x >> np.uint16(8))
    byte_histogram(q1, 0, stop - start, hist[1])
    _sample(planes, start, stop, 1, hist)


@kernel
def split32(words, start, stop, rotate, planes, hist):
    w = words[start:stop]
    q0, q1 = planes[0, start:stop], planes[1, start:stop]
    q2, q3 = planes[2, start:stop], planes[3, start:stop]
    r = np.uint32(1 if rotate else 0)
    for i in range(stop - start):        # views from 0: the loop vectorizes
        x = np.uint32(w[i])
        x = (x << r) | (x >> np.uint32((32 - r) & 31))
        q0[i] = np.uint8(x & np.uint32(0xFF))
        q1[i] = np.uint8((x >> np.uint32(8)) & np.uint32(0xFF))
        q2[i] = np.uint8((x >> np.uint32(16)) & np.uint32(0xFF))
        q3[i] = np.uint8(x >> np.uint32(24))
    byte_histogram(q3, 0, stop - start, hist[3])
    _sample(planes, start, stop, 3, hist)


@kernel
def split64(words, start, stop, rotate, planes, hist):
    w = words[start:stop]
    r = np.uint64(1 if rotate else 0)
    for k in range(8):
        q = planes[k, start:stop]
        sh = np.uint64(8 * k)
        for i in range(stop - start):
            x = np.uint64(w[i])
            x = (x << r) | (x >> np.uint64((64 - r) & 63))
            q[i] = np.uint8((x >> sh) & np.uint64(0xFF))
    byte_histogram(planes[7, start:stop], 0, stop - start, hist[7])
    _sample(planes, start, stop, 7, hist)


@kernel
def byte_histogram(plane, start, stop, hist):
    for i in range(start, stop):
        hist[plane[i]] += 1


# The merges take the planes as a tuple of read-only 1-D arrays, so a plane stored raw
# is read straight from the blob's bytes instead of being copied into a plane array.
# They loop over views that start at the range's first element: with a loop counter
# from zero LLVM vectorizes the byte interleave (8x faster than indexing from ``start``).

@kernel
def merge16(planes, start, stop, rotate, words):
    p0, p1 = planes[0][start:stop], planes[1][start:stop]
    w = words[start:stop]
    if rotate:                            # one loop per case: each vectorizes
        for i in range(stop - start):
            x = np.uint16(p0[i]) | (np.uint16(p1[i]) << np.uint16(8))
            w[i] = np.uint16((x >> np.uint16(1)) | (x << np.uint16(15)))
    else:
        for i in range(stop - start):
            w[i] = np.uint16(p0[i]) | (np.uint16(p1[i]) << np.uint16(8))


@kernel
def merge32(planes, start, stop, rotate, words):
    p0, p1 = planes[0][start:stop], planes[1][start:stop]
    p2, p3 = planes[2][start:stop], planes[3][start:stop]
    w = words[start:stop]
    if rotate:
        for i in range(stop - start):
            x = (np.uint32(p0[i]) | (np.uint32(p1[i]) << np.uint32(8))
                 | (np.uint32(p2[i]) << np.uint32(16)) | (np.uint32(p3[i]) << np.uint32(24)))
            w[i] = (x >> np.uint32(1)) | (x << np.uint32(31))
    else:
        for i in range(stop - start):
            w[i] = (np.uint32(p0[i]) | (np.uint32(p1[i]) << np.uint32(8))
                    | (np.uint32(p2[i]) << np.uint32(16)) | (np.uint32(p3[i]) << np.uint32(24)))


@kernel
def merge64(planes, start, stop, rotate, words):
    w = words[start:stop]
    w[:] = 0
    for k in range(8):
        p = planes[k][start:stop]
        sh = np.uint64(8 * k)
        for i in range(stop - start):
            w[i] |= np.uint64(p[i]) << sh
    if rotate:
        for i in range(stop - start):
            w[i] = (w[i] >> np.uint64(1)) | (w[i] << np.uint64(63))


SPLIT = {2: split16, 4: split32, 8: split64}
MERGE = {2: merge16, 4: merge32, 8: merge64}
