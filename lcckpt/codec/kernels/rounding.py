"""Mantissa rounding's errors, compiled (``lcckpt.codec.rounding``).

One read of an array's bits gives the squared error of rounding it to each of several
mantissa bit counts, where numpy took a rounded copy, a difference and a dot product per
count. The rounding is ``rounding._round``'s, on the same bits; its error is the change
of the mantissa field times the weight of its last bit in the value's binade (a carry
into the exponent adds the binade's leading bit), exact in float64.
"""

import numpy as np

from ...util.jit import kernel


@kernel
def rounding_errors(bits, mant, ebits, keeps, ulp, out):
    """``out[j]``: the sum over the finite elements of ``(round(x, keeps[j]) - x)²``
    scaled, and ``out[keeps.size]`` that of ``x²``, ``x`` the values of ``bits`` (a uint
    view of an fp16/fp32/fp64 array, its format's ``mant`` mantissa and ``ebits`` exponent
    bits); ``ulp[e]``: the weight of a mantissa's last bit at exponent field ``e``, over
    the scale. A value that would round up to Inf counts 0 (it is kept as it is)."""
    emask = (1 << ebits) - 1
    one = np.uint64(1)
    um = np.uint64(mant)
    field = (one << um) - one
    for j in range(keeps.size + 1):
        out[j] = 0.0
    for i in range(bits.size):
        b = np.uint64(bits[i])
        e = np.int64((b >> um) & np.uint64(emask))
        if e == emask:
            continue                                    # NaN or Inf: kept as they are
        m = np.int64(b & field)
        w = ulp[e]
        v = (m + (np.int64(1) << mant if e > 0 else 0)) * w
        out[keeps.size] += v * v
        for j in range(keeps.size):
            drop = np.uint64(mant - keeps[j])
            r = b + ((one << (drop - one)) - one) + ((b >> drop) & one)
            r &= ~((one << drop) - one)
            er = np.int64((r >> um) & np.uint64(emask))
            if er == emask:
                continue                                # rounded up to Inf: x kept
            mr = np.int64(r & field) + (np.int64(1) << mant if er != e else 0)
            d = (mr - m) * w
            out[j] += d * d
