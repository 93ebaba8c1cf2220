"""Byte-plane split for the lossless codec (ALGORITHM.md §6, after ZipNN).

A float's exponent straddles two bytes; rotating the word left by one bit moves the
sign to the bottom so the top byte holds exactly the 8-bit exponent (bf16, fp32; the
top 8 exponent bits of fp64, the 5 exponent bits and 3 mantissa bits of fp16). Each byte
of the rotated word then becomes its own plane, which an order-0 coder can squeeze
where it is skewed (the exponents) and store raw where it is not (the mantissas).

Kernels take the data as an unsigned-integer view of the element width, so one
function serves every width.
"""

import numpy as np
from numba import njit


@njit(cache=True, nogil=True)
def split_planes(words, start, stop, width, rotate, planes, hist):
    """Scatter the bytes of ``words[start:stop]`` into ``planes[k, i]``; count ``hist[k]``."""
    nplanes = width // 8
    top = np.uint64(width - 1)
    mask = np.uint64((1 << width) - 1) if width < 64 else np.uint64(0xFFFFFFFFFFFFFFFF)
    for i in range(start, stop):
        x = np.uint64(words[i])
        if rotate:
            x = ((x << np.uint64(1)) | (x >> top)) & mask
        for k in range(nplanes):
            v = (x >> np.uint64(8 * k)) & np.uint64(0xFF)
            planes[k, i] = v
            hist[k, v] += 1


@njit(cache=True, nogil=True)
def merge_planes(planes, start, stop, width, rotate, words):
    """Inverse of :func:`split_planes`."""
    nplanes = width // 8
    top = np.uint64(width - 1)
    for i in range(start, stop):
        x = np.uint64(0)
        for k in range(nplanes):
            x |= np.uint64(planes[k, i]) << np.uint64(8 * k)
        if rotate:
            x = (x >> np.uint64(1)) | ((x & np.uint64(1)) << top)
        words[i] = x
