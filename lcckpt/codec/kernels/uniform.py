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

from ...util.jit import kernel
from .sketch import signed_buckets

BIG = 1 << 62          # the zigzag value of an escape forced by step 0 or by a huge level


@kernel
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


@kernel
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


@kernel
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


@kernel(inline="always")
def _element(ui, r, step, up, floor, rstep, S, table, limit, use_limit):
    """One element the plain way: ``(symbol, escape, squared error)``. The reference
    for the blocked kernel, and what it falls back to where it cannot decide."""
    z = _zigzag(ui - r, step, up)
    if floor > 0.0:
        z = _floored(z, r, ui, rstep, floor)
    e = z >= S
    v = r
    if not e and z != 0:
        v = r + table[z]
        if use_limit and abs(v) > limit:
            e = True
    if floor > 0.0 and not e and np.float64(v) < floor * np.float64(ui):
        e = True
    if e:
        v = ui
    x = np.float64(ui) - np.float64(v)
    return (0 if e else z), e, x * x


@kernel
def quantize_scalar(u, ref, use_ref, start, stop, step, up, floor, rstep, S, table, limit,
                    use_limit, sym, esc, hist):
    """:func:`quantize_range` one element at a time: for ``step == 0`` (every change an
    escape), and the oracle the tests hold the blocked kernel to."""
    err = 0.0
    for i in range(start, stop):
        r = ref[i] if use_ref else u[i] - u[i]      # +0.0 in the work dtype (u is finite)
        s, e, x2 = _element(u[i], r, step, up, floor, rstep, S, table, limit, use_limit)
        sym[i] = s
        if e:
            esc[i >> 3] |= np.uint8(1 << (i & 7))
        hist[s] += 1
        err += x2
    return err


BLOCK = 1024           # elements per block of the blocked kernel: its buffers stay in L1
NEAR = 1e-9            # how close to a rounding boundary a level is decided the slow way


@kernel(inline="always")
def _levels(u, ref, b0, nb, inv, up, floor, rstep, inv_r, S, limit, use_floor, use_ref, sym,
            x2, flags, dtype_of):
    """The vectorizable half of a block: symbols, squared errors and per-element flags
    (bit 0: decide it the slow way, bit 1: escape) of ``[b0, b0 + nb)``; returns how many
    elements are flagged. ``use_floor`` and ``use_ref`` are constants where it is
    inlined, so each combination compiles to a loop without branches (no limit is an
    infinite one)."""
    fS = np.float64(S)
    flagged = 0
    ub, rb, sb = u[b0:b0 + nb], ref[b0:b0 + nb], sym[b0:b0 + nb]   # indexed from 0: plain
    for j in range(nb):                                           # vector loads, no gathers
        ui = ub[j]
        r = rb[j] if use_ref else ui - ui          # +0.0 in the work dtype (u is finite)
        a = np.float64(ui - r) * inv
        t = abs(a) + up
        m = np.floor(t)
        fr = t - m
        slow = (fr < NEAR) | (fr > 1.0 - NEAR)    # d * (1/step) may round past a boundary
        m = min(m, fS)                             # any level of S or more escapes
        q = np.int64(m)
        neg = a < 0.0
        z = 2 * q - np.int64(neg & (q > 0))
        lv = -m if neg else m
        if use_floor:                               # _floored, without its branches
            rr = np.float64(r)
            need = floor * np.float64(ui)
            low = rr + lv * rstep < need
            c = (need - rr) * inv_r
            lift = np.ceil(c)
            fc = lift - c
            slow = slow | (m >= fS) | (low & ((fc < NEAR) | (fc > 1.0 - NEAR) | (lift > fS)
                                              | (rr + lift * rstep < need)))
            lift = max(min(lift, fS), -fS)
            k = np.int64(lift)
            zl = 2 * k if k > 0 else -2 * k - np.int64(k < 0)
            z = zl if low else z
            lv = lift if low else lv
            q = abs(k) if low else q
        e = z >= S
        lv = 0.0 if e else lv
        v = r + dtype_of.dtype.type(lv * rstep)      # = r + table[z], table[0] = 0
        e = e | ((q > 0) & (abs(v) > limit))
        if use_floor:
            e = e | (np.float64(v) < floor * np.float64(ui))
        sb[j] = 0 if e else z
        x = np.float64(ui) - np.float64(v)
        x = 0.0 if e else x
        x2[j] = x * x
        f = np.int64(slow) | (np.int64(e) << 1)
        flags[j] = f
        flagged += np.int64(f != 0)
    return flagged


@kernel(inline="always")
def _levels_plain(u, ref, b0, nb, inv, up, rstep, S, limit, use_ref, sym, x2, flags,
                  dtype_of):
    """:func:`_levels` without the floor, its levels and symbols kept as floats (whole
    numbers up to ``2·S``, exact) instead of int64s: AVX2 has no vector conversion from
    float64 to int64, so the int64s took a scalar loop (1.3x faster on one thread; the
    same symbols, errors and flags bit for bit)."""
    fS = np.float64(S)
    flagged = 0
    ub, rb, sb = u[b0:b0 + nb], ref[b0:b0 + nb], sym[b0:b0 + nb]
    for j in range(nb):
        ui = ub[j]
        r = rb[j] if use_ref else ui - ui
        a = np.float64(ui - r) * inv
        t = abs(a) + up
        m = np.floor(t)
        fr = t - m
        slow = (fr < NEAR) | (fr > 1.0 - NEAR)
        m = min(m, fS)
        neg = a < 0.0
        z = 2.0 * m - (1.0 if neg & (m > 0.0) else 0.0)
        e = z >= fS
        lv = -m if neg else m
        lv = 0.0 if e else lv
        v = r + dtype_of.dtype.type(lv * rstep)      # = r + table[z], table[0] = 0
        e = e | ((m > 0.0) & (abs(v) > limit))
        sb[j] = np.uint8(np.int32(0.0 if e else z))
        x = np.float64(ui) - np.float64(v)
        x = 0.0 if e else x
        x2[j] = x * x
        f = np.int32(slow) | (np.int32(e) << 1)
        flags[j] = f
        flagged += np.int32(f != 0)
    return flagged


@kernel
def quantize_range(u, ref, use_ref, start, stop, step, up, floor, rstep, S, table, limit,
                   use_limit, sym, esc, hist, skip_zeros=True):
    """Symbols and escape flags of ``[start, stop)``, and the error of its reconstruction.

    Levels are decided with ``step``; ``table`` (levels times ``rstep``) restores them.
    ``sym[i]`` is the level's symbol, or 0 for an escape (a level of ``S`` or more, or a
    reconstruction past ``limit`` when ``use_limit``, or one below ``floor·u[i]`` after
    the table's rounding), flagged by bit ``i % 8`` of ``esc[i // 8]`` (a zeroed bitmap:
    1/8 byte per element; ``start`` is a multiple of 8, so ranges share no byte). The
    reconstruction, not written here, is ``ref[i] + table[sym[i]]`` (symbol 0 adds
    nothing, as decoding) or ``u[i]`` for an escape; ``hist`` counts the symbols.
    Returns ``||u - reconstruction||^2`` in fp64.

    Blocks of :data:`BLOCK` elements: a branch-free loop over the block (levels by a
    multiply with ``1/step``, a floored element's raised level by one with
    ``1/rstep``; an element within :data:`NEAR` of a rounding boundary of either is
    flagged and redone by :func:`quantize_scalar`'s element), then the error sum, the
    symbol counts and the escape bits. The symbols are those of the element-wise code,
    bit for bit; the error sum differs from it only by the order of its additions.
    1.7-3.4x faster than one element at a time on real deltas (one thread; the floored
    second moments at the low end). ``skip_zeros``: a block of +0.0 in ``u`` (and
    ``ref``) is level 0 throughout, its symbols zeros and its error +0.0, and is written
    as such without the block loops (the same outputs bit for bit; see
    :func:`survey_range`).
    """
    if step == 0.0 or rstep == 0.0:
        return quantize_scalar(u, ref, use_ref, start, stop, step, up, floor, rstep, S,
                               table, limit, use_limit, sym, esc, hist)
    x2 = np.empty(BLOCK)
    flags = np.empty(BLOCK, np.uint8)
    h4 = np.zeros((4, S), np.int64)
    inv = 1.0 / step
    inv_r = 1.0 / rstep
    lim = limit if use_limit else np.inf
    use_floor = floor > 0.0
    zero_level = skip_zeros and NEAR <= up <= 1.0 - NEAR     # a zero delta: level 0, exact
    err = 0.0
    for b0 in range(start, stop, BLOCK):
        nb = min(stop, b0 + BLOCK) - b0
        if zero_level and _plus_zeros(u[b0:b0 + nb], ref[b0:b0 + nb], use_ref, nb):
            sym[b0:b0 + nb] = 0
            h4[0, 0] += nb
            continue
        if use_floor and use_ref:
            flagged = _levels(u, ref, b0, nb, inv, up, floor, rstep, inv_r, S, lim, True, True,
                              sym, x2, flags, table)
        elif use_ref:
            flagged = _levels_plain(u, ref, b0, nb, inv, up, rstep, S, lim, True, sym, x2,
                                    flags, table)
        elif use_floor:
            flagged = _levels(u, ref, b0, nb, inv, up, floor, rstep, inv_r, S, lim, True, False,
                              sym, x2, flags, table)
        else:
            flagged = _levels_plain(u, ref, b0, nb, inv, up, rstep, S, lim, False, sym, x2,
                                    flags, table)
        if flagged:
            for j in range(nb):
                if flags[j] & 1:
                    i = b0 + j
                    r = ref[i] if use_ref else u[i] - u[i]
                    s, e, x = _element(u[i], r, step, up, floor, rstep, S, table, limit,
                                       use_limit)
                    sym[i] = s
                    x2[j] = x
                    flags[j] = np.uint8(2) if e else np.uint8(0)
        s0 = s1 = s2 = s3 = 0.0
        j = 0
        while j + 4 <= nb:
            s0 += x2[j]
            s1 += x2[j + 1]
            s2 += x2[j + 2]
            s3 += x2[j + 3]
            h4[0, sym[b0 + j]] += 1
            h4[1, sym[b0 + j + 1]] += 1
            h4[2, sym[b0 + j + 2]] += 1
            h4[3, sym[b0 + j + 3]] += 1
            j += 4
        while j < nb:
            s0 += x2[j]
            h4[0, sym[b0 + j]] += 1
            j += 1
        err += (s0 + s1) + (s2 + s3)
        if flagged:
            for g in range(0, nb, 8):
                f = 0
                for k in range(min(8, nb - g)):
                    f |= np.int64(flags[g + k] >> 1) << k
                if f:
                    esc[(b0 + g) >> 3] |= np.uint8(f)
    for k in range(4):
        for s in range(S):
            hist[s] += h4[k, s]
    return err


@kernel
def count_bits(bitmap):
    """The number of set bits of ``bitmap`` (zero bytes skipped: escapes are rare)."""
    count = 0
    for j in range(bitmap.size):
        x = np.int64(bitmap[j])
        if x == 0:
            continue
        while x:
            x &= x - 1
            count += 1
    return count


@kernel
def list_bits(bitmap, n, out):
    """Write the indices (increasing) of the set bits among the first ``n`` of ``bitmap``
    (bit ``i % 8`` of byte ``i // 8``) into ``out`` (any integer dtype that holds them, at
    least :func:`count_bits` long); returns how many. Zero bytes are skipped, since
    escapes are rare (a 20M-element tensor's bitmap is 2.5 MB)."""
    k = 0
    for j in range(bitmap.size):
        x = np.int64(bitmap[j])
        if x == 0:
            continue
        for bit in range(8):
            if (x >> bit) & 1 and 8 * j + bit < n:
                out[k] = 8 * j + bit
                k += 1
    return k


@kernel(inline="always")
def _nan_if_inf(x):
    """0.0 for a finite ``x``, NaN for NaN or ±Inf (``x * 0``)."""
    return np.float64(x) * 0.0


MAG_BINS = 1 << 14     # float32 exponent (8 bits) and the top 6 mantissa bits of |d|
NO_SPAN = np.zeros(0, np.int64)


@kernel(inline="always")
def _plus_zeros(ub, rb, use_ref, nb):
    """Whether ``ub[:nb]`` (and ``rb[:nb]`` with ``use_ref``) are all +0.0: no bit set
    (not -0.0, not NaN). A dense block is told by its first element; the others by an
    OR of their words, a loop that vectorizes (0.15 ns per element, one thread)."""
    if ub[0] != 0:
        return False
    acc = np.uint32(0)
    w = ub[:nb].view(np.uint32)
    for i in range(w.size):
        acc |= w[i]
    if use_ref:
        w = rb[:nb].view(np.uint32)
        for i in range(w.size):
            acc |= w[i]
    return acc == 0


@kernel
def survey_range(u, ref, use_ref, start, stop, out, sketch, log2m, cnt, s1, s2,
                 skip_zeros=True, span=NO_SPAN):
    """One read of ``u`` (and ``ref``) over ``[start, stop)`` for everything a delta
    needs before its step is chosen, added into the caller's arrays:

    * ``out[0]``: 0.0 while ``u`` and ``ref`` are finite (NaN otherwise), ``out[1]``:
      the sum of ``u²`` in fp64, ``out[2]``: the least ``u``;
    * ``sketch`` (unless ``log2m == 0``): the movement sketch of ``u``
      (:func:`lcckpt.codec.kernels.sketch.add_sketch`, the same buckets and signs);
    * ``cnt``/``s1``/``s2`` (``MAG_BINS + 1`` each): per magnitude bin of ``|d|``,
      ``d = u - ref`` (64 bins per octave, by the top bits of its float32 value): count,
      sum and sum of squares in fp64; the last bin takes the exact zeros and is not used.
      From these the error and the level counts of any step follow without another pass
      over the tensor;
    * ``span`` (if given, ``int64[2]``): lowered to the least and raised to the greatest
      bin counted into (the zeros' bin included), so the bins outside are known to be
      untouched (a small tensor's few hundred of the 16K bins).

    Three passes over the state become one. Block by block (:data:`BLOCK`): the sums in
    four interleaved parts (no add waits for the one before), then the sketch and the
    histogram: each element's magnitude, bin, bucket and signed value by a loop that
    vectorizes, then the scattered adds in element order (the same sums, bit for bit;
    15% faster than computing them one element at a time, one thread).

    ``skip_zeros``: a block of +0.0 in ``u`` (and ``ref``) only counts its elements into
    the zeros' bin and lowers the minima to 0: every sum would gain +0.0, which leaves it
    bit for bit as it is. An optimizer's moments for rows that no batch touched (a
    fine-tune's unused tokens: 97-98% of a MiniLM embedding's) are such blocks."""
    mag = np.empty(BLOCK)                       # |d| of the block, fp64
    mag32 = np.empty(BLOCK, np.float32)         # and as float32, whose top bits bin it
    bits = mag32.view(np.uint32)
    signed = np.empty(BLOCK)                    # the sketch's +-u
    bucket = np.empty(BLOCK, np.int64)
    shift = np.uint64(64 - log2m)
    do_sketch = log2m > 0
    s0 = s1_ = s2_ = s3 = 0.0
    z0 = z1 = z2 = z3 = 0.0
    m0 = m1 = m2 = m3 = out[2]
    k_lo, k_hi = np.int64(MAG_BINS + 1), np.int64(-1)
    for b0 in range(start, stop, BLOCK):
        b1 = min(stop, b0 + BLOCK)
        nb = b1 - b0
        ub, rb = u[b0:b1], ref[b0:b1]           # indexed from 0: these loops vectorize;
        if skip_zeros and _plus_zeros(ub, rb, use_ref, nb):
            cnt[MAG_BINS] += nb                 # as the element loops below would leave it
            k_lo = min(k_lo, np.int64(MAG_BINS))
            k_hi = np.int64(MAG_BINS)
            if nb >= 4:                         # (lanes 1-3 see elements from 4 on)
                m1 = 0.0 if 0.0 < m1 else m1
                m2 = 0.0 if 0.0 < m2 else m2
                m3 = 0.0 if 0.0 < m3 else m3
            m0 = 0.0 if 0.0 < m0 else m0
            continue
        last = nb - nb % 4
        for i in range(0, last, 4):
            a = np.float64(ub[i])
            b = np.float64(ub[i + 1])
            c = np.float64(ub[i + 2])
            d = np.float64(ub[i + 3])
            s0 += a * a
            s1_ += b * b
            s2_ += c * c
            s3 += d * d
            m0 = a if a < m0 else m0
            m1 = b if b < m1 else m1
            m2 = c if c < m2 else m2
            m3 = d if d < m3 else m3
            z0 += a * 0.0                 # stay 0 unless a value is NaN or ±Inf
            z1 += b * 0.0
            z2 += c * 0.0
            z3 += d * 0.0
            if use_ref:
                z0 += _nan_if_inf(rb[i])
                z1 += _nan_if_inf(rb[i + 1])
                z2 += _nan_if_inf(rb[i + 2])
                z3 += _nan_if_inf(rb[i + 3])
        for i in range(last, nb):
            a = np.float64(ub[i])
            s0 += a * a
            m0 = a if a < m0 else m0
            z0 += a * 0.0
            if use_ref:
                z0 += _nan_if_inf(rb[i])
        for j in range(nb):                     # the scattered adds below stay in order
            d = np.float64(ub[j] - rb[j]) if use_ref else np.float64(ub[j])
            mag[j] = abs(d)
            mag32[j] = abs(d)
        if do_sketch:
            signed_buckets(ub, b0, nb, shift, bucket, signed, ub, False)
        for j in range(nb):
            if do_sketch:
                sketch[bucket[j]] += signed[j]
            m = mag[j]
            k = np.int64(bits[j] >> np.uint32(17))
            k = np.int64(MAG_BINS) if m == 0.0 else k
            k_lo = k if k < k_lo else k_lo
            k_hi = k if k > k_hi else k_hi
            cnt[k] += 1
            s1[k] += m
            s2[k] += m * m
    out[0] += (z0 + z1) + (z2 + z3)
    out[1] += (s0 + s1_) + (s2_ + s3)
    out[2] = min(min(m0, m1), min(m2, m3))
    if span.size == 2:
        span[0] = min(span[0], k_lo)
        span[1] = max(span[1], k_hi)


@kernel
def direction_range(u, ref, use_ref, m, start, stop, a, b):
    """Per magnitude bin of ``|d|`` (the bins of :func:`survey_range`), ``d = u - ref``,
    over ``[start, stop)``: the sum of ``m·sign(d)`` into ``a`` and of ``m·d`` into
    ``b`` (fp64; ``m``: the direction the restored error is to be orthogonal to,
    ``lcckpt.codec.errmodel.ErrorModel.recon_step``)."""
    mag32 = np.empty(BLOCK, np.float32)
    bits = mag32.view(np.uint32)
    sd = np.empty(BLOCK)
    for b0 in range(start, stop, BLOCK):
        b1 = min(stop, b0 + BLOCK)
        nb = b1 - b0
        ub, rb, mb = u[b0:b1], ref[b0:b1], m[b0:b1]
        for j in range(nb):
            d = np.float64(ub[j] - rb[j]) if use_ref else np.float64(ub[j])
            mag32[j] = abs(d)
            sd[j] = d
        for j in range(nb):
            d = sd[j]
            if d != 0.0:
                k = np.int64(bits[j] >> np.uint32(17))
                w = np.float64(mb[j])
                a[k] += w if d > 0 else -w
                b[k] += w * d


@kernel(inline="always")
def _index(idx, i, n):
    """``idx[i]`` as an int64, or -1 when it falls outside ``[0, n)``."""
    j = np.int64(idx[i])
    return j if 0 <= j < n else np.int64(-1)


@kernel
def set_escapes(out, idx, val):
    """``out[idx[i]] = val[i]``: a uniform blob's escaped elements set (numpy's fancy
    assignment converts the indices and holds the GIL: 21 ms for the 3.2M escapes of a
    delta early in Adam's run, 4.4 ms here). Returns how many indices fall outside
    ``out`` (not set; a parsed blob's were checked already)."""
    bad = 0
    for i in range(idx.size):
        j = _index(idx, i, out.size)
        if j < 0:
            bad += 1
        else:
            out[j] = val[i]
    return bad


@kernel
def take(src, idx, out):
    """``out[i] = src[idx[i]]`` (the escaped elements' values), bounds checked as
    :func:`set_escapes`."""
    bad = 0
    for i in range(idx.size):
        j = _index(idx, i, src.size)
        if j < 0:
            bad += 1
        else:
            out[i] = src[j]
    return bad


@kernel
def _lower_bound(idx, x):
    """The first ``i`` with ``idx[i] >= x`` in increasing ``idx`` (its size if none)."""
    lo, hi = 0, idx.size
    while lo < hi:
        mid = (lo + hi) >> 1
        if np.int64(idx[mid]) < x:
            lo = mid + 1
        else:
            hi = mid
    return lo


@kernel
def set_range_escapes(out, idx, val, start, stop):
    """:func:`set_escapes` of the escapes whose index is in ``[start, stop)`` (a chunk's),
    found by binary search in the increasing ``idx``; ``np.searchsorted`` would first
    convert the whole index array to the bounds' dtype, for every chunk."""
    a = _lower_bound(idx, start)
    b = _lower_bound(idx, stop)
    return set_escapes(out, idx[a:b], val[a:b])
