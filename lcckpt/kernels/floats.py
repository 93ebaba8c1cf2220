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
from numba import njit

SAMPLE = 8


@njit(cache=True, nogil=True, inline="always")
def _sample(planes, start, stop, top, hist):
    """Count the planes below ``top`` on every SAMPLE-th element (a strided second loop:
    no modulo test in the hot one)."""
    first = start + (-start) % SAMPLE
    for k in range(top):
        for i in range(first, stop, SAMPLE):
            hist[k, planes[k, i]] += 1


@njit(cache=True, nogil=True)
def split16(words, start, stop, rotate, planes, hist):
    for i in range(start, stop):
        x = np.uint16(words[i])
        if rotate:
            x = np.uint16((x << np.uint16(1)) | (x >> np.uint16(15)))
        hi = np.uint8(x >> np.uint16(8))
        planes[0, i] = np.uint8(x & np.uint16(0xFF))
        planes[1, i] = hi
        hist[1, hi] += 1
    _sample(planes, start, stop, 1, hist)


@njit(cache=True, nogil=True)
def split32(words, start, stop, rotate, planes, hist):
    for i in range(start, stop):
        x = np.uint32(words[i])
        if rotate:
            x = (x << np.uint32(1)) | (x >> np.uint32(31))
        b3 = np.uint8(x >> np.uint32(24))
        planes[0, i] = np.uint8(x & np.uint32(0xFF))
        planes[1, i] = np.uint8((x >> np.uint32(8)) & np.uint32(0xFF))
        planes[2, i] = np.uint8((x >> np.uint32(16)) & np.uint32(0xFF))
        planes[3, i] = b3
        hist[3, b3] += 1
    _sample(planes, start, stop, 3, hist)


@njit(cache=True, nogil=True)
def split64(words, start, stop, rotate, planes, hist):
    for i in range(start, stop):
        x = np.uint64(words[i])
        if rotate:
            x = (x << np.uint64(1)) | (x >> np.uint64(63))
        for k in range(8):
            planes[k, i] = np.uint8((x >> np.uint64(8 * k)) & np.uint64(0xFF))
        hist[7, planes[7, i]] += 1
    _sample(planes, start, stop, 7, hist)


@njit(cache=True, nogil=True)
def byte_histogram(plane, start, stop, hist):
    for i in range(start, stop):
        hist[plane[i]] += 1


# The merges take the planes as a tuple of read-only 1-D arrays, so a plane stored raw
# is read straight from the blob's bytes instead of being copied into a plane array.

@njit(cache=True, nogil=True)
def merge16(planes, start, stop, rotate, words):
    p0, p1 = planes[0], planes[1]
    if rotate:                            # one loop per case: each vectorizes
        for i in range(start, stop):
            x = np.uint16(p0[i]) | (np.uint16(p1[i]) << np.uint16(8))
            words[i] = np.uint16((x >> np.uint16(1)) | (x << np.uint16(15)))
    else:
        for i in range(start, stop):
            words[i] = np.uint16(p0[i]) | (np.uint16(p1[i]) << np.uint16(8))


@njit(cache=True, nogil=True)
def merge32(planes, start, stop, rotate, words):
    p0, p1, p2, p3 = planes[0], planes[1], planes[2], planes[3]
    if rotate:                            # one loop per case: each vectorizes
        for i in range(start, stop):
            x = (np.uint32(p0[i]) | (np.uint32(p1[i]) << np.uint32(8))
                 | (np.uint32(p2[i]) << np.uint32(16)) | (np.uint32(p3[i]) << np.uint32(24)))
            words[i] = (x >> np.uint32(1)) | (x << np.uint32(31))
    else:
        for i in range(start, stop):
            words[i] = (np.uint32(p0[i]) | (np.uint32(p1[i]) << np.uint32(8))
                        | (np.uint32(p2[i]) << np.uint32(16)) | (np.uint32(p3[i]) << np.uint32(24)))


@njit(cache=True, nogil=True)
def merge64(planes, start, stop, rotate, words):
    for i in range(start, stop):
        x = np.uint64(0)
        for k in range(8):
            x |= np.uint64(planes[k][i]) << np.uint64(8 * k)
        if rotate:
            x = (x >> np.uint64(1)) | (x << np.uint64(63))
        words[i] = x


SPLIT = {2: split16, 4: split32, 8: split64}
MERGE = {2: merge16, 4: merge32, 8: merge64}
