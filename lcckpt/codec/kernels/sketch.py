"""A linear sketch of a float array: the norm of a difference without keeping the array.

Element ``i`` adds ``±x[i]`` to bucket ``h(i) mod m``, with bucket and sign from one
64-bit mix of ``i`` (splitmix64's finalizer). The sketch is linear, so
``sketch(u) - sketch(k) = sketch(u - k)``, and the squared norm of a sketch estimates the
squared norm of what it sketches without bias, with relative standard deviation at most
``sqrt(2 / m)`` whatever the values (the AMS / CountSketch second-moment estimate). Pure
Numba over one element range, so callers fan chunks out over the thread pool.
"""

import numpy as np

from ...util.jit import kernel

BLOCK = 1024        # elements whose mixes are computed before their adds (L1-resident)


@kernel
def _mix(i):
    z = np.uint64(i) * np.uint64(0x9E3779B97F4A7C15)
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return z ^ (z >> np.uint64(31))


@kernel
def add_sketch(x, start, stop, out, log2m):
    """``out[h(i) % m] += s(i) * x[i]`` for ``i`` in ``[start, stop)``, ``m = out.size =
    2**log2m`` with ``1 <= log2m <= 32`` (the bucket is the mix's top bits, the sign its lowest); returns
    the sum of ``x[i]²`` over the range (fp64), read in the same pass."""
    shift = np.uint64(64 - log2m)
    ss = 0.0
    for i in range(start, stop):
        v = np.float64(x[i])
        ss += v * v
        h = _mix(i)
        # the sign as a factor, not a branch: a random sign mispredicts half the time
        # (3x slower); v * -1.0 is -v exactly, so the sums are the same bit for bit
        out[np.int64(h >> shift)] += np.float64(2 * np.int64(h & np.uint64(1)) - 1) * v
    return ss


@kernel(inline="always")
def signed_buckets(x, b0, nb, shift, bucket, signed, copy_to, copy):
    """Bucket and signed value of ``x[j]``, element ``b0 + j`` of the sketched range, for
    ``j < nb`` (``x`` indexed from 0, so the loop vectorizes); ``copy``: also
    ``copy_to[j] = x[j]`` in the same loop. The caller adds them in element order (the
    same sums as :func:`add_sketch`, bit for bit)."""
    for j in range(nb):
        v = x[j]
        if copy:
            copy_to[j] = v
        h = _mix(np.uint64(b0) + np.uint64(j))
        bucket[j] = np.int64(h >> shift)
        signed[j] = np.float64(2 * np.int64(h & np.uint64(1)) - 1) * np.float64(v)


@kernel
def copy_sketch(dst, src, start, stop, out, log2m):
    """``dst[start:stop] = src[start:stop]`` and :func:`add_sketch` of ``src`` over the
    range, in one read (a keyframe's reference copy and its movement base: the same
    buckets, signs and adds, bit for bit). Block by block: :func:`signed_buckets` with
    the copy, then the scattered adds in element order."""
    shift = np.uint64(64 - log2m)
    bucket = np.empty(BLOCK, np.int64)
    signed = np.empty(BLOCK)
    for b0 in range(start, stop, BLOCK):
        nb = min(stop, b0 + BLOCK) - b0
        signed_buckets(src[b0:b0 + nb], b0, nb, shift, bucket, signed, dst[b0:b0 + nb], True)
        for j in range(nb):
            out[bucket[j]] += signed[j]
