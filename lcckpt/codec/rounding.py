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

__all__ = ["MANTISSA", "rounded"]

MANTISSA = {np.dtype(np.float16): 10, np.dtype(np.float32): 23, np.dtype(np.float64): 52}
TRIES = 3       # keeps tried below the one whose bound per element holds by itself


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
    a first ``keep``; its measured error (about a quarter of the bound on real values;
    subnormals, whose leading mantissa bits are zeros, err more) then predicts how many
    more bits can go, each doubling it, and the prediction is measured in turn."""
    bits = MANTISSA.get(x.dtype)
    if bits is None or not 0 < target < 1 or x.size == 0:
        return None
    keep = max(0, math.ceil(-math.log2(target) - 1))
    if keep >= bits:
        return None
    finite = np.isfinite(x)
    xf = x.reshape(-1) if finite.all() else x[finite]
    work = np.float64 if x.dtype == np.float64 else np.float32    # y - x exact in it
    scale = float(np.max(np.abs(xf))) if xf.size else 0.0
    if scale == 0.0:
        return None                     # nothing finite to round but zeros
    # fp32 sums of squares err by well under a thousandth: that much is kept in hand
    allowed = target * float(np.linalg.norm(xf.astype(work) / work(scale))) * (1 - 1e-3)

    def error(k: int) -> float:         # scaled: no square overflows near the largest
        d = _round(xf, k).astype(work)
        d -= xf
        d /= work(scale)
        return float(np.sqrt(np.dot(d, d)))
    e = error(keep)
    if e > allowed:
        return None
    k = max(0, keep - (min(TRIES, int(math.log2(allowed / e))) if e > 0 else TRIES))
    while k < keep and error(k) > allowed:
        k += 1
    return _round(x, k)
