"""Uniform quantizer kernels (docs/algorithm.md §7b): levels, histograms, reconstruction.

Pure Numba functions over one element range ``[start, stop)`` each, so callers fan
chunks out over the thread pool (the kernels release the GIL). The level of a delta
``d`` is ``copysign(floor(|d / step| + 1 - deadzone), d)``, zigzag-mapped to a symbol
(0, -1, 1, -2, 2, ... -> 0, 1, 2, 3, 4, ...); they know nothing of blobs or coders.

``floor > 0`` is the mode for tensors without negative values (Adam's second moment,
a norm layer's running variance: states a step divides by): a level that would restore
an element below ``floor`` times its true value (or below zero) is raised to the
smallest level that does not, so a restored optimizer never divides by a collapsed
second moment.
"""

import numpy as np
from numba import njit

BIG = 1 << 62          # the zigzag value of an escape forced by step 0 or by a huge level


@njit(cache=True, nogil=True)
def _zigzag(d, step, up):
    if step == 0.0:
        return 0 if d == 0 else BIG
    a = np.float64(d) / step
    m = np.floor(abs(a) + up)
    if m > 1e15:
        return BIG
    q = np.int64(m)
    if q == 0:
        return 0
    return 2 * q - 1 if a < 0 else 2 * q


@njit(cache=True, nogil=True)
def _floored(z, r, ui, step, floor):
    """Zigzag level ``z`` raised so that ``r + level·step >= floor·ui`` (``ui >= 0``;
    ``step``: the reconstruction step)."""
    if z >= BIG or step == 0.0:
        return z
    q = (z + 1) >> 1
    level = -q if z & 1 else q
    need = floor * np.float64(ui)
    if np.float64(r) + level * step >= need:
        return z
    m = np.ceil((need - np.float64(r)) / step)
    if m > 1e15:
        return BIG
    level = np.int64(m)
    while np.float64(r) + level * step < need:     # the division may round down
        level += 1
    if level <= 0:
        return -2 * level - 1 if level < 0 else 0
    return 2 * level


@njit(cache=True, nogil=True)
def level_histogram(u, ref, use_ref, start, stop, step, up, floor, rstep, hist):
    """``hist[min(z, 256)] += 1`` for the zigzag level ``z`` of every element (levels
    decided with ``step``, restored with ``rstep``)."""
    for i in range(start, stop):
        r = ref[i] if use_ref else u[i] - u[i]
        d = u[i] - ref[i] if use_ref else u[i]
        z = _zigzag(d, step, up)
        if floor > 0.0:
            z = _floored(z, r, u[i], rstep, floor)
        hist[z if z < 256 else 256] += 1


@njit(cache=True, nogil=True)
def quantize_range(u, ref, use_ref, start, stop, step, up, floor, rstep, S, table, limit,
                   use_limit, sym, esc, hist):
    """Symbols and escape flags of ``[start, stop)``, and the error of its reconstruction.

    Levels are decided with ``step``; ``table`` (levels times ``rstep``) restores them.
    ``sym[i]`` is the level's symbol, or 0 for an escape (a level of ``S`` or more, or a
    reconstruction past ``limit`` when ``use_limit``, or one below ``floor·u[i]`` after
    the table's rounding), flagged by bit ``i % 8`` of ``esc[i // 8]`` (a zeroed bitmap:
    1/8 byte per element; ``start`` is a multiple of 8, so ranges share no byte). The
    reconstruction, not written here, is ``ref[i] + table[sym[i]]`` (symbol 0 adds
    nothing, as decoding) or ``u[i]`` for an escape; ``hist`` counts the symbols.
    Returns ``||u - reconstruction||^2`` in fp64.
    """
    err = 0.0
    for i in range(start, stop):
        r = ref[i] if use_ref else u[i] - u[i]      # +0.0 in the work dtype (u is finite)
        d = u[i] - ref[i] if use_ref else u[i]
        z = _zigzag(d, step, up)
        if floor > 0.0:
            z = _floored(z, r, u[i], rstep, floor)
        e = z >= S
        v = r
        if not e and z != 0:
            v = r + table[z]
            if use_limit and abs(v) > limit:
                e = True
        if floor > 0.0 and not e and np.float64(v) < floor * np.float64(u[i]):
            e = True
        if e:
            v = u[i]
            s = 0
        else:
            s = z
        sym[i] = s
        if e:
            esc[i >> 3] |= np.uint8(1 << (i & 7))
        hist[s] += 1
        x = np.float64(u[i]) - np.float64(v)
        err += x * x
    return err


@njit(cache=True, nogil=True)
def set_bits(bitmap, n):
    """Indices (int64, increasing) of the set bits among the first ``n`` of ``bitmap``
    (bit ``i % 8`` of byte ``i // 8``)."""
    count = 0
    for j in range(bitmap.size):
        x = np.int64(bitmap[j])
        while x:
            x &= x - 1
            count += 1
    out = np.empty(count, np.int64)
    k = 0
    for j in range(bitmap.size):
        x = np.int64(bitmap[j])
        for bit in range(8):
            if (x >> bit) & 1 and 8 * j + bit < n:
                out[k] = 8 * j + bit
                k += 1
    return out[:k]


@njit(cache=True, nogil=True, inline="always")
def _nan_if_inf(x):
    """0.0 for a finite ``x``, NaN for NaN or ±Inf (``x * 0``)."""
    return np.float64(x) * 0.0


@njit(cache=True, nogil=True)
def state_stats(u, ref, use_ref, start, stop, out):
    """``out[:] = (all of u and ref finite, sum of u² in fp64, min of u)`` over
    ``[start, stop)``: what the quantizer checks and scales by, in one read of ``u``
    instead of numpy's four passes (a finiteness mask each, a widened copy, a minimum).
    Sums run in four interleaved parts, so no add waits for the one before."""
    s0 = s1 = s2 = s3 = 0.0
    z0 = z1 = z2 = z3 = 0.0                  # stay 0 unless a value is NaN or ±Inf
    mn = np.inf
    last = stop - (stop - start) % 4
    for i in range(start, last, 4):
        a = np.float64(u[i])
        b = np.float64(u[i + 1])
        c = np.float64(u[i + 2])
        d = np.float64(u[i + 3])
        s0 += a * a
        s1 += b * b
        s2 += c * c
        s3 += d * d
        z0 += a * 0.0
        z1 += b * 0.0
        z2 += c * 0.0
        z3 += d * 0.0
        mn = min(mn, min(min(a, b), min(c, d)))
    for i in range(last, stop):
        a = np.float64(u[i])
        s0 += a * a
        z0 += a * 0.0
        mn = min(mn, a)
    if use_ref:
        for i in range(start, last, 4):
            z0 += _nan_if_inf(ref[i])
            z1 += _nan_if_inf(ref[i + 1])
            z2 += _nan_if_inf(ref[i + 2])
            z3 += _nan_if_inf(ref[i + 3])
        for i in range(last, stop):
            z0 += _nan_if_inf(ref[i])
    out[0] = 1.0 if (z0 + z1) + (z2 + z3) == 0.0 else 0.0
    out[1] = (s0 + s1) + (s2 + s3)
    out[2] = mn


MAG_BINS = 1 << 14     # float32 exponent (8 bits) and the top 6 mantissa bits of |d|


@njit(cache=True, nogil=True)
def magnitude_histogram(u, ref, use_ref, start, stop, cnt, s1, s2):
    """Per magnitude bin of ``|d|`` (64 bins per octave, by its float32 bits): count,
    sum and sum of squares, in fp64. Exact zeros are not counted. From these the error
    and the level counts of any step follow without another pass over the tensor."""
    tmp = np.empty(1, np.float32)
    bits = tmp.view(np.uint32)
    for i in range(start, stop):
        d = np.float64(u[i] - ref[i]) if use_ref else np.float64(u[i])
        if d == 0.0:
            continue
        a = abs(d)
        tmp[0] = a
        b = bits[0] >> 17
        cnt[b] += 1
        s1[b] += a
        s2[b] += a * a
