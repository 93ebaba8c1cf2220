"""The uniform quantizer's error model, compiled (``lcckpt.codec.errmodel.ErrorModel``).

The step search evaluates the model a few times per tensor over its magnitude bins (up to
:data:`lcckpt.codec.kernels.uniform.MAG_BINS`, a few thousand nonzero). In numpy each
evaluation is a dozen array expressions, and a state of hundreds of small tensors spent
more time there than quantizing them. These loops compute the same numbers bit for bit:
the same operations in the same order per bin, and every sum in numpy's own pairwise
order (:func:`lcckpt.codec.kernels.sums.pairwise_sum_in`), so the chosen steps, and the
blobs, do not change.
"""

import numpy as np

from ...util.jit import kernel
from .sums import pairwise_sum_in

_HUGE = 1e300          # an infinite bin edge, capped as the numpy code caps it


@kernel
def compact(cnt, s1, s2, bounds, j0=0, j1=-1):
    """The histogram's nonzero bins among the first ``bounds.size - 1``: ``(count as
    float, sum, sum of squares, lower edge, upper edge, mean)`` per bin, in bin order (as
    numpy's ``flatnonzero`` and fancy indexing gave them, in one call instead of eight).
    ``[j0, j1]``: the bins to look at, where the caller knows every other one is empty
    (the survey's span); by default all."""
    nb = bounds.size - 1
    j1 = nb - 1 if j1 < 0 or j1 >= nb else j1
    j0 = max(j0, 0)
    k = 0
    for j in range(j0, j1 + 1):
        if cnt[j] != 0:
            k += 1
    c = np.empty(k)
    a = np.empty(k)
    b = np.empty(k)
    lo = np.empty(k)
    hi = np.empty(k)
    mean = np.empty(k)
    i = 0
    for j in range(j0, j1 + 1):
        if cnt[j] != 0:
            c[i] = np.float64(cnt[j])
            a[i] = s1[j]
            b[i] = s2[j]
            lo[i] = bounds[j]
            hi[i] = bounds[j + 1]
            mean[i] = s1[j] / c[i]
            i += 1
    return c, a, b, lo, hi, mean


@kernel(inline="always")
def _bin_level(lo, hi, mean, step, up):
    """``(level of the bin, True when it spans two levels or more)``: the level of its
    edges where both round alike, else of its mean."""
    q_lo = np.floor(lo / step + up)
    q_hi = np.floor(min(hi, _HUGE) / step + up)
    q = q_lo if q_lo == q_hi else np.floor(mean / step + up)
    return q, q_hi - q_lo >= 2


@kernel
def bin_levels(lo, hi, mean, step, up, q):
    """Each bin's level at ``step`` into ``q`` (``ErrorModel.levels``)."""
    for j in range(lo.size):
        q[j] = _bin_level(lo[j], hi[j], mean[j], step, up)[0]


@kernel
def symbol_histogram(lo, hi, mean, cnt, n, step, up, h):
    """``ErrorModel.symbol_histogram`` into ``h`` (``[257]`` zeros): the same numbers,
    each a sum of whole counts or of their halves, exact in any order. False, leaving
    ``h`` unfinished, where a level is not a number >= 0."""
    lv = np.zeros(129)
    total = 0.0
    big = 0.0
    for j in range(lo.size):
        q = _bin_level(lo[j], hi[j], mean[j], step, up)[0]
        if not q >= 0.0:
            return False
        total += cnt[j]
        if q > 128:
            big += cnt[j]
        else:
            lv[np.int64(q)] += cnt[j]
    h[256] = big
    h[0] = lv[0] + (n - total)
    for i in range(1, 129):             # -i, +i: symbols 2i - 1 and 2i
        h[2 * i - 1] += lv[i] / 2
        h[2 * i] += lv[i] / 2
    return True


@kernel
def errors_sq(lo, hi, mean, cnt, s1, s2, steps, up, wide_err, out):
    """``ErrorModel.errors_sq``: the modelled ``||u - ũ||²`` of each decision step,
    its levels restored with their least-squares step, into ``out``; a bin wider than a
    level errs by ``wide_err·step²`` per element (computed by the caller, as before)."""
    k = lo.size
    q = np.empty(k)
    wide = np.empty(k, np.bool_)
    a = np.empty(k)
    b = np.empty(k)
    stack, vals = np.empty((64, 3), np.int64), np.empty(64)     # the sums' work arrays
    for t in range(steps.size):
        st = steps[t]
        for j in range(k):
            q[j], wide[j] = _bin_level(lo[j], hi[j], mean[j], st, up)
            a[j] = q[j] * s1[j]
            b[j] = cnt[j] * q[j] * q[j]
        qs1 = pairwise_sum_in(a, stack, vals)
        qq = pairwise_sum_in(b, stack, vals)
        r = qs1 / qq if qq > 0 else st
        for j in range(k):
            if wide[j]:
                a[j] = cnt[j] * wide_err * st * st
            else:
                qr = q[j] * r
                a[j] = s2[j] - 2 * q[j] * r * s1[j] + cnt[j] * (qr * qr)
        out[t] = pairwise_sum_in(a, stack, vals)


@kernel
def last_within(lo, hi, mean, cnt, s1, s2, steps, up, wide_err, tol_sq, out):
    """:func:`errors_sq` of ``steps`` into ``out``; the index of the last step whose error
    is within ``tol_sq`` (-1 if none)."""
    errors_sq(lo, hi, mean, cnt, s1, s2, steps, up, wide_err, out)
    last = -1
    for t in range(steps.size):
        if out[t] <= tol_sq:
            last = t
    return last


@kernel
def refine(lo, hi, mean, cnt, s1, s2, grid, i, up, wide_err, tol_sq):
    """``ErrorModel.step_for``'s two finer grids: 9 steps from ``grid[i]`` (within
    ``tol_sq``) to ``grid[i + 1]`` (not), as ``np.linspace`` spaces them, twice; the
    last step within ``tol_sq``. One call instead of six numpy ones per grid."""
    fine = np.empty(9)
    out = np.empty(9)
    for _ in range(2):
        if i == grid.size - 1:
            return grid[i]
        a, b = grid[i], grid[i + 1]
        delta = b - a
        step = delta / 8
        for k in range(9):              # np.linspace's arithmetic, the end point exact
            fine[k] = (np.float64(k) / 8) * delta + a if step == 0 else np.float64(k) * step + a
        fine[8] = b
        i = max(0, last_within(lo, hi, mean, cnt, s1, s2, fine, up, wide_err, tol_sq, out))
        grid = fine.copy()
    return grid[i]
