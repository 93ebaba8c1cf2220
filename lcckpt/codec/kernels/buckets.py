"""Exponent-bucket quantizer kernels (LC-Checkpoint, ALGORITHM.md §1-3).

Pure Numba functions over numpy arrays; they know nothing of files, torch or threads.
Every kernel works on one element range ``[start, stop)`` so that callers can fan
chunks out over a thread pool (the kernels release the GIL).

A float's bucket key is its sign and biased exponent: ``bits >> 23`` for fp32 (512 keys)
and ``bits >> 52`` for fp64 (4096 keys). Reading the bits of a computed delta needs a
reinterpreting view, so callers pass a small scratch array ``scratch_f`` together with
its unsigned view ``scratch_u`` (``scratch_f.view(np.uint32)``); the kernels compute a
block of deltas into it and read the keys back. One scratch pair per thread. Without a
reference the delta is ``u`` itself, whose bits callers pass as ``u_bits``
(``u.view(np.uint32)``): the keys are read from the input, with no copy.
"""

import numpy as np

from ...util.jit import kernel

BLOCK = 2048


LANES = 4      # interleaved histogram copies: consecutive elements of one bucket update
               # different memory, so the adds do not wait on each other
COUNT_LANES = 8    # the same for counts alone (key_counts): integer counts come out the
                   # same in any lanes; 8 of uint32 measured ~10% faster than 4 of int64


@kernel(inline="always")
def _block_keys(u, u_bits, ref, use_ref, i, m, scratch_f, scratch_u, shift, kb, zero_key,
                norm_u, norm_d):
    """Block ``[i, i + m)`` of :func:`key_histogram` and :func:`key_counts`: the deltas
    (in ``scratch_f``, or ``u`` itself without a reference) and their keys into ``kb``,
    branch-free over views from 0 so the loops vectorize; returns ``(deltas, norm_u,
    norm_d)`` with the norms carried on."""
    ub = u[i:i + m]
    if use_ref:
        rb = ref[i:i + m]
        for j in range(m):
            a = ub[j]
            d = a - rb[j]
            scratch_f[j] = d
            norm_u += np.float64(a) * np.float64(a)
            norm_d += np.float64(d) * np.float64(d)
        fb, bb = scratch_f[:m], scratch_u[:m]
    else:
        for j in range(m):
            a = ub[j]
            norm_u += np.float64(a) * np.float64(a)
        fb, bb = ub, u_bits[i:i + m]
    for j in range(m):
        kb[j] = zero_key if fb[j] == 0 else np.uint16(bb[j] >> shift)
    return fb, norm_u, norm_d


@kernel(fastmath={"reassoc", "contract"})
def key_histogram(u, u_bits, ref, use_ref, start, stop, scratch_f, scratch_u, shift, keys,
                  counts, sums, mins, maxs, want_minmax):
    """One pass: every element's bucket key, per key the count and sum, and the norms.

    The delta is ``u - ref`` when ``use_ref`` else ``u``. ``keys[i]`` receives the key,
    or ``counts.shape[1] - 1`` (a key no float has) for a zero of either sign, which
    belongs to no bucket and whose slot callers ignore. ``counts``/``sums`` are
    ``[LANES, nkeys + 1]``: element ``j`` of a group of ``LANES`` goes to lane ``j``;
    callers add the lanes. Sums are fp64. With ``want_minmax`` also track each key's min
    and max. ``shift`` has the unsigned type of ``scratch_u``.
    Returns ``(||u||^2, ||delta||^2)`` in fp64.

    Per block, the deltas and keys are computed branch-free first (those loops
    vectorize), then histogrammed from the stored keys (reading them back from L1 is
    faster than from a wider block of their own). Reassociation is allowed only so that
    the two norms vectorize: every other operation is a single rounding (the
    subtraction) or a scatter in element order, so keys and counts are exact and each
    lane's sum is accumulated in element order (the caller adds the lanes, chunks in a
    fixed order: deterministic).
    """
    zero_key = counts.shape[1] - 1
    norm_u = 0.0
    norm_d = 0.0
    i = start
    while i < stop:
        m = min(BLOCK, stop - i)
        kb = keys[i:i + m]
        fb, norm_u, norm_d = _block_keys(u, u_bits, ref, use_ref, i, m, scratch_f, scratch_u,
                                         shift, kb, zero_key, norm_u, norm_d)
        j = 0
        while j + LANES <= m:
            for lane in range(LANES):
                k = kb[j + lane]
                counts[lane, k] += 1
                sums[lane, k] += np.float64(fb[j + lane])
            j += LANES
        while j < m:
            k = kb[j]
            counts[0, k] += 1
            sums[0, k] += np.float64(fb[j])
            j += 1
        if want_minmax:                   # a loop of its own keeps the hot one branch-free
            for j in range(m):
                k = kb[j]
                v = np.float64(fb[j])
                if v < mins[k]:
                    mins[k] = v
                if v > maxs[k]:
                    maxs[k] = v
        i += m
    return norm_u, (norm_d if use_ref else norm_u)


@kernel(fastmath={"reassoc", "contract"})
def key_counts(u, u_bits, ref, use_ref, start, stop, scratch_f, scratch_u, shift, keys,
               counts):
    """:func:`key_histogram` without the sums: keys, per-lane counts and the norms.

    ``counts`` is ``[COUNT_LANES, nkeys + 1]``, of any integer type wide enough for the
    range (the quantizer's is uint32).

    Centroids need the sums of the kept buckets only, and which buckets are kept follows
    from the counts alone; the quantizer's pass 2 adds those sums while it maps the
    symbols (:func:`lcckpt.codec.kernels.runs.map_symbols_sums`), in the same lanes and order
    as this kernel's sibling would have, so the centroids are bit for bit the same. What
    this pass saves is the fp64 read-modify-write per element, the slowest part of it.
    """
    zero_key = counts.shape[1] - 1
    norm_u = 0.0
    norm_d = 0.0
    i = start
    while i < stop:
        m = min(BLOCK, stop - i)
        kb = keys[i:i + m]
        _, norm_u, norm_d = _block_keys(u, u_bits, ref, use_ref, i, m, scratch_f, scratch_u,
                                        shift, kb, zero_key, norm_u, norm_d)
        j = 0
        while j + COUNT_LANES <= m:
            for lane in range(COUNT_LANES):
                counts[lane, kb[j + lane]] += 1
            j += COUNT_LANES
        while j < m:
            counts[0, kb[j]] += 1
            j += 1
        i += m
    return norm_u, (norm_d if use_ref else norm_u)


@kernel
def key_sums(u, ref, use_ref, start, stop, keys, sums):
    """Per-lane fp64 sums of the deltas by bucket, from the keys of :func:`key_counts`.

    The sums :func:`key_histogram` makes, bit for bit (the same lanes, the same order),
    for a layout that learns only after counting that many symbols will be nonzero.
    """
    db = np.empty(BLOCK, u.dtype)
    i = start
    while i < stop:
        m = min(BLOCK, stop - i)
        ub, kb = u[i:i + m], keys[i:i + m]
        if use_ref:
            rb = ref[i:i + m]
            for j in range(m):
                db[j] = ub[j] - rb[j]
        else:
            for j in range(m):
                db[j] = ub[j]
        j = 0
        while j + LANES <= m:
            for lane in range(LANES):
                sums[lane, kb[j + lane]] += np.float64(db[j + lane])
            j += LANES
        while j < m:
            sums[0, kb[j]] += np.float64(db[j])
            j += 1
        i += m


@kernel
def promotion_table(counts, sums, mins, maxs, nbits, midpoint, centroids):
    """Keep the 2**nbits - 1 highest-priority buckets; return the key -> symbol table.

    The table has one extra entry, for the zero key, which maps to symbol 0.

    Priority: larger exponent first; on equal exponent more members first; then the
    positive bucket before the negative one. Symbol s (1..K) is the s-th kept bucket,
    symbol 0 means zero. ``centroids[s]`` receives the bucket's representative (mean,
    or midpoint of min and max); ``centroids[0] = 0``. Returns (lut, K).
    """
    nkeys = counts.size
    half = nkeys // 2
    keep = (1 << nbits) - 1
    lut = np.zeros(nkeys + 1, np.uint8)
    taken = np.zeros(nkeys, np.bool_)
    centroids[0] = 0
    kept = 0
    for s in range(1, keep + 1):
        best = -1
        for k in range(nkeys):
            if counts[k] == 0 or taken[k]:
                continue
            if best < 0:
                best = k
                continue
            e, eb = k % half, best % half
            if e > eb or (e == eb and (counts[k] > counts[best]
                                       or (counts[k] == counts[best] and k < best))):
                best = k
        if best < 0:
            break
        taken[best] = True
        lut[best] = s
        if midpoint:
            centroids[s] = (mins[best] + maxs[best]) * 0.5
        else:
            centroids[s] = sums[best] / counts[best]
        kept = s
    return lut, kept


@kernel
def map_symbols(keys, start, stop, lut, sym):
    """``sym[i] = lut[keys[i]]``: 0 for zeros and dropped buckets, 1..K for kept ones."""
    for i in range(start, stop):
        sym[i] = lut[keys[i]]


@kernel
def apply_symbols(sym, start, stop, centroids, out):
    """``out[i] += centroids[sym[i]]`` for every nonzero symbol, in fp32.

    The reference form of the reconstruction step: the coding kernels perform the same
    add inline (encoder and decoder alike), and tests hold them to this one.
    """
    for i in range(start, stop):
        s = sym[i]
        if s != 0:
            out[i] = out[i] + centroids[s]
