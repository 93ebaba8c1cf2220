"""Mantissa rounding held to a relative L2 target: an array's low mantissa bits rounded
away, so that the exact byte-plane coder finds its low planes zero.

The uniform quantizer codes levels of 8 bits at most and stores larger ones as escapes:
it is built for deltas, whose values sit within a few hundred steps of zero. An ordinary
array held to a fine target spans thousands of steps, most of its elements become
escapes, and the quantizer stores it exactly instead. Rounding each element to ``keep``
mantissa bits bounds its error by ``2^-(keep+1)`` of its own magnitude, whatever the
array's range. The result is coded exactly, so it decodes with any lcckpt version.
"""

from __future__ import annotations

import math

import numpy as np

from .kernels import rounding as rk

__all__ = ["MANTISSA", "rounded"]

MANTISSA = {np.dtype(np.float16): 10, np.dtype(np.float32): 23, np.dtype(np.float64): 52}
TRIES = 4       # keeps tried below the one whose bound per element holds by itself


def _round(x: np.ndarray, keep: int) -> np.ndarray:
    """``x`` rounded to ``keep`` mantissa bits, half to even; NaN, Inf and values that
    would round up to Inf stay as they are."""
    uint = np.dtype(f"u{x.dtype.itemsize}").type
    bits = x.view(uint)
    drop = uint(MANTISSA[x.dtype] - keep)
    one = uint(1)
    r = bits + ((one << (drop - one)) - one) + ((bits >> drop) & one)
    r &= ~((one << drop) - one)
    y = r.view(x.dtype)      # a NaN's payload may carry into the sign: x's kept
    return np.where(np.isfinite(x) & np.isfinite(y), y, x)


def rounded(x: np.ndarray, target: float) -> np.ndarray | None:
    """``x`` with the fewest mantissa bits whose error over its finite elements is within
    ``target·||x||₂``, or None where no bit can go (the dtype is not fp16/fp32/fp64, or
    ``target`` needs every bit). The bound per element, ``2^-(keep+1) <= target``, fixes
    a first ``keep``; it and up to :data:`TRIES` fewer bits are measured in one read
    (:func:`~lcckpt.codec.kernels.rounding.rounding_errors`, exact in float64): rounding
    errs by about a quarter of its bound on real values, and subnormals, whose leading
    mantissa bits are zeros, by more."""
    bits = MANTISSA.get(x.dtype)
    if bits is None or not 0 < target < 1 or x.size == 0:
        return None
    keep = max(0, math.ceil(-math.log2(target) - 1))
    if keep >= bits:
        return None
    flat = x.reshape(-1)
    finite = np.isfinite(flat)
    scale = float(np.max(np.abs(flat if finite.all() else flat[finite]), initial=0.0))
    if scale == 0.0:
        return None                     # nothing finite to round but zeros
    ebits = 8 * x.itemsize - 1 - bits
    bias = (1 << (ebits - 1)) - 1
    with np.errstate(over="ignore"):    # binades above the largest value: never read
        ulp = np.ldexp(1.0, np.maximum(np.arange((1 << ebits) - 1), 1) - bias - bits) / scale
    keeps = np.arange(keep, max(-1, keep - 1 - TRIES), -1)
    sums = np.zeros(keeps.size + 1)
    rk.rounding_errors(flat.view(f"u{x.itemsize}"), bits, ebits, keeps, ulp, sums)
    within = sums[:-1] <= target * target * sums[-1]
    if not within[0]:
        return None
    return _round(x, int(keeps[np.argmin(within) - 1 if not within.all() else -1]))
