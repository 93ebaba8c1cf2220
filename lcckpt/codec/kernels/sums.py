"""numpy's float64 sum, bit for bit, for compiled code that must reproduce a numpy
expression's result exactly (a sequential sum differs in the last bits, and a step or a
mode chosen by comparing such sums could then change)."""

import numpy as np

from ...util.jit import kernel

_BLOCK = 128           # numpy's PW_BLOCKSIZE


@kernel
def _block_sum(a, lo, n):
    """numpy's pairwise summation of at most 128 elements: in order below 8, else 8
    interleaved accumulators, joined pairwise, then the tail in order."""
    if n < 8:
        res = 0.0
        for i in range(lo, lo + n):
            res += a[i]
        return res
    r0, r1, r2, r3 = a[lo], a[lo + 1], a[lo + 2], a[lo + 3]
    r4, r5, r6, r7 = a[lo + 4], a[lo + 5], a[lo + 6], a[lo + 7]
    i = 8
    m = n - n % 8
    while i < m:
        r0 += a[lo + i]
        r1 += a[lo + i + 1]
        r2 += a[lo + i + 2]
        r3 += a[lo + i + 3]
        r4 += a[lo + i + 4]
        r5 += a[lo + i + 5]
        r6 += a[lo + i + 6]
        r7 += a[lo + i + 7]
        i += 8
    res = ((r0 + r1) + (r2 + r3)) + ((r4 + r5) + (r6 + r7))
    while i < n:
        res += a[lo + i]
        i += 1
    return res


@kernel
def pairwise_sum(a):
    """``np.sum(a)`` of a contiguous float64 array, bit for bit: numpy's
    ``pairwise_sum`` (blocks of at most 128 elements, longer spans halved on a multiple
    of 8, the halves' sums added), its recursion unrolled onto a stack (a recursive
    kernel crashed the interpreter when numba loaded it from its disk cache)."""
    return pairwise_sum_in(a, np.empty((64, 3), np.int64), np.empty(64))


@kernel
def pairwise_sum_in(a, stack, vals):
    """:func:`pairwise_sum` on the work arrays given (``(64, 3)`` int64 spans: start,
    length, halves done; ``64`` float64 sums of finished spans): a loop that sums many
    arrays allocates them once (the error model's search summed three per step tried,
    and the allocations took a quarter of its time)."""
    if a.size <= _BLOCK:
        return 0.0 + _block_sum(a, 0, a.size)
    sp, vp = 1, 0
    stack[0, 0], stack[0, 1], stack[0, 2] = 0, a.size, 0
    while sp:
        lo, n = stack[sp - 1, 0], stack[sp - 1, 1]
        if n <= _BLOCK:
            sp -= 1
            vals[vp] = _block_sum(a, lo, n)
            vp += 1
            continue
        n2 = n // 2
        n2 -= n2 % 8
        if stack[sp - 1, 2] < 2:             # the first half, then the second
            first = stack[sp - 1, 2] == 0
            stack[sp - 1, 2] += 1
            stack[sp, 0] = lo if first else lo + n2
            stack[sp, 1] = n2 if first else n - n2
            stack[sp, 2] = 0
            sp += 1
        else:
            sp -= 1
            vp -= 1
            vals[vp - 1] = vals[vp - 1] + vals[vp]
    return 0.0 + vals[0]


@kernel
def choose_modes(score, coded, table, out):
    """``entropy._choose``, compiled: for every subset of the coded modes (rows
    ``coded``), each chunk (column of ``score``) takes its cheapest allowed row (the
    first on a tie, as ``np.argmin``), and the subset costs its chunks' sum (numpy's
    order) plus ``table[r]`` once per row it uses; the first cheapest subset's choice
    goes to ``out``. Returns False when no subset is finite (``out`` untouched)."""
    m, nch = score.shape
    if out.size < nch:
        return False
    allowed = np.empty(m, np.bool_)
    used = np.empty(m, np.bool_)
    choice = np.empty(nch, np.int64)
    vals = np.empty(nch)
    best = np.inf
    found = False
    for subset in range(1 << coded.size):
        allowed[:] = True
        for k in range(coded.size):
            if not (subset >> k) & 1:
                allowed[coded[k]] = False
        used[:] = False
        for c in range(nch):
            bi = 0
            bv = score[0, c] if allowed[0] else np.inf
            for r in range(1, m):
                v = score[r, c] if allowed[r] else np.inf
                if v < bv:
                    bv, bi = v, r
            choice[c] = bi
            vals[c] = bv
            used[bi] = True
        extra = 0
        for r in range(m):
            if used[r]:
                extra += table[r]
        total = pairwise_sum(vals) + extra
        if total < best:
            best = total
            for c in range(nch):       # not ``out[:] = choice``: its shape check's
                out[c] = choice[c]     # error message took 3 s to compile
            found = True
    return found
