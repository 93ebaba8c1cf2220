"""Canonical Huffman kernels: length-limited code construction, encode, table decode.

Bit order is MSB-first within big-endian bytes (the order of DEFLATE's canonical code
values and of ``bitarray(endian="big")``), and codes are canonical in the DEFLATE sense:
shorter codes first, equal lengths in increasing symbol order. So a code is fully
described by its length per symbol, and bitarray's ``canonical_decode`` is an
independent oracle for our streams.

The bit writer and reader are those of :mod:`lcckpt.codec.kernels.bits`, shared by every coder.
"""

import numpy as np

from ...util.jit import kernel
from .bits import Z, clz64, flush, lookup, put, refill

MAX_CODE_LEN = 12          # one 4096-entry lookup table decodes any code


@kernel
def code_lengths(counts, max_len):
    """Huffman code lengths for ``counts``, limited to ``max_len`` bits.

    Unused symbols get length 0; a lone used symbol gets length 1. Lengths come from a
    two-queue Huffman build, then the JPEG (Annex K.3) adjustment moves over-long leaves
    up while keeping the code complete; the most frequent symbols take the shortest.
    """
    n = counts.size
    lengths = np.zeros(n, np.uint8)
    m = 0
    for s in range(n):
        if counts[s] > 0:
            m += 1
    if m == 0:
        return lengths
    used = np.empty(m, np.int64)
    w = np.empty(m, np.int64)
    j = 0
    for s in range(n):
        if counts[s] > 0:
            used[j] = s
            w[j] = counts[s]
            j += 1
    order = np.argsort(w, kind="mergesort")        # ascending count, stable by symbol
    if m == 1:
        lengths[used[0]] = 1
        return lengths
    weight = np.empty(2 * m - 1, np.int64)
    parent = np.empty(2 * m - 1, np.int64)
    for j in range(m):
        weight[j] = w[order[j]]
    leaf = 0
    node = m                                       # next internal node to consume
    pick = np.empty(2, np.int64)
    for k in range(m - 1):
        for t in range(2):
            if leaf < m and (node >= m + k or weight[leaf] <= weight[node]):
                pick[t] = leaf
                leaf += 1
            else:
                pick[t] = node
                node += 1
        new = m + k
        weight[new] = weight[pick[0]] + weight[pick[1]]
        parent[pick[0]] = new
        parent[pick[1]] = new
    depth = np.zeros(2 * m - 1, np.int64)
    for v in range(2 * m - 3, -1, -1):
        depth[v] = depth[parent[v]] + 1
    maxd = 0
    for j in range(m):
        if depth[j] > maxd:
            maxd = depth[j]
    bl = np.zeros(max(maxd, max_len) + 1, np.int64)
    for j in range(m):
        bl[depth[j]] += 1
    for i in range(maxd, max_len, -1):
        while bl[i] > 0:
            k = i - 2
            while bl[k] == 0:
                k -= 1
            bl[i] -= 2
            bl[i - 1] += 1
            bl[k + 1] += 2
            bl[k] -= 1
    # most frequent (end of `order`) gets the shortest length
    j = m - 1
    for length in range(1, max_len + 1):
        for _ in range(bl[length]):
            lengths[used[order[j]]] = length
            j -= 1
    return lengths


@kernel
def canonical_codes(lengths):
    """Canonical code values for ``lengths`` (DEFLATE's assignment)."""
    n = lengths.size
    bl = np.zeros(64, np.int64)
    for s in range(n):
        bl[lengths[s]] += 1
    bl[0] = 0
    next_code = np.zeros(64, np.int64)
    code = 0
    for b in range(1, 64):
        code = (code + bl[b - 1]) << 1
        next_code[b] = code
    codes = np.zeros(n, np.uint32)
    for s in range(n):
        ln = lengths[s]
        if ln > 0:
            codes[s] = next_code[ln]
            next_code[ln] += 1
    return codes


@kernel
def decode_table(lengths, table_bits):
    """Lookup table of ``2**table_bits`` entries: ``(symbol << 4) | length``; 0 = invalid.

    Kernels pass ``np.int64(CONSTANT)``, not the constant: Numba types a constant argument
    as its literal value and compiles a form of the callee for each (seconds, once)."""
    codes = canonical_codes(lengths)
    table = np.zeros(1 << table_bits, np.uint32)
    for s in range(lengths.size):
        ln = lengths[s]
        if ln > 0:
            lo = np.int64(codes[s]) << (table_bits - ln)
            hi = (np.int64(codes[s]) + 1) << (table_bits - ln)
            for t in range(lo, hi):
                table[t] = (s << 4) | ln
    return table


# --- encoding --------------------------------------------------------------------------


@kernel(inline="always")
def additive(cent):
    """The centroids with symbol 0 adding ``-0.0``, so reconstruction adds need no branch.

    ``x + -0.0`` is ``x`` bit for bit for every ``x`` but NaN (``+0.0`` keeps its sign,
    which adding ``+0.0`` would not guarantee), so every symbol's add can run
    unconditionally. That pays on dense streams (grouped letters, runs items), where a
    branch on zero symbols mispredicts; the per-symbol Huffman kernels keep the branch,
    since their streams are mostly zeros. A reference that receives deltas holds no NaN:
    a NaN delta is refused and becomes a keyframe.
    """
    cz = cent.copy()
    cz[0] = -0.0
    return cz


@kernel
def encode_symbols(sym, start, stop, codes, lengths, out, pos, cent, fout, apply):
    """Per-element Huffman: code ``sym[start:stop]`` into ``out`` from byte ``pos``.

    Returns the end byte position. ``out`` must hold the exact size computed from the
    symbol counts and code lengths. With ``apply`` each nonzero symbol also adds its
    centroid, ``fout[i] += cent[s]``: the encoder's reference update, the very add the
    decoder makes, in a loop of its own that vectorizes (:func:`add_decoded`).
    """
    z = _run_symbol(sym, start, stop, codes, lengths)
    if z < 0:
        acc, nb, p = _put_each(sym, start, stop, codes, lengths, out, pos)
    else:
        acc, nb, p = _put_runs(sym, start, stop, codes, lengths, out, pos, z)
    if apply:
        add_decoded(sym, start, stop - start, additive(cent), fout, start)
    return flush(acc, nb, out, p)


@kernel
def _run_symbol(sym, start, stop, codes, lengths):
    """The symbol whose code is the one bit "0" where it comes in runs (three in four of
    up to 64 blocks of eight spread over the stream are all of it: a sparse plane), for
    :func:`_put_runs`; else -1 (testing every stream's blocks coded 4-bit symbols, half
    of them zeros, 1.6-1.8x slower)."""
    z = -1
    for s in range(lengths.size):
        if lengths[s] == 1 and codes[s] == 0:
            z = s
    blocks = (stop - start) // 8
    if z < 0 or blocks < 8:
        return -1
    hits = tried = 0
    for b in range(0, blocks, max(1, blocks // 64)):
        tried += 1
        if _all_eight(sym, start + 8 * b, z):
            hits += 1
    return z if 4 * hits >= 3 * tried else -1


@kernel
def _put_each(sym, start, stop, codes, lengths, out, pos):
    """Every symbol's code word, one put each: the writer's state ``(acc, nb, p)``."""
    acc = Z
    nb = Z
    p = pos
    for i in range(start, stop):
        s = sym[i]
        acc, nb, p = put(acc, nb, np.uint64(codes[s]), np.uint64(lengths[s]), out, p)
    return acc, nb, p


@kernel
def _put_runs(sym, start, stop, codes, lengths, out, pos, z):
    """:func:`_put_each` for a stream of mostly ``z``, whose code is the bit 0: eight
    symbols at a time, and eight of ``z`` are eight 0 bits (runs of them 32 bits a put);
    the same bits."""
    acc = Z
    nb = Z
    p = pos
    i = start
    while i < stop:
        j = i
        while j + 8 <= stop and _all_eight(sym, j, z):
            j += 8
        r = j - i
        while r > 0:
            k = min(r, 32)
            acc, nb, p = put(acc, nb, Z, np.uint64(k), out, p)
            r -= k
        e = min(stop, j + 8)
        for q in range(j, e):
            s = sym[q]
            acc, nb, p = put(acc, nb, np.uint64(codes[s]), np.uint64(lengths[s]), out, p)
        i = e
    return acc, nb, p


@kernel(inline="always")
def _all_eight(sym, j, z):
    """``sym[j:j + 8]`` all equal ``z``, without a branch per symbol."""
    d = 0
    u = np.uint64(j)                    # unsigned: no negative-index fix-up per load
    for k in range(8):
        d |= np.int64(sym[u + np.uint64(k)]) ^ z
    return d == 0


# --- decoding --------------------------------------------------------------------------



@kernel
def decode_symbols(buf, start, end, n, table, table_bits, out, out_start, cent, fout, apply):
    """Decode ``n`` symbols from ``buf[start:end]`` into ``out[out_start:]``.

    With ``apply`` the symbols are not stored: each nonzero one adds its centroid,
    ``fout[out_start + i] += cent[s]`` (the reconstruction step of the delta decoder,
    fused so no symbol array is written or read back). Returns the number of bits
    consumed, or -1 if an invalid code is met. The caller checks that the consumed bits
    fill exactly the chunk's bytes.
    """
    return _decode_from(buf, start, end, Z, Z, 0, n, table, table_bits, out, out_start,
                        cent, fout, apply)


@kernel(inline="always")
def _decode_from(buf, p, end, acc, nb, i, n, table, table_bits, out, out_start, cent, fout,
                 apply):
    """Symbols ``i..n-1``, one table lookup each, from the reader state ``(acc, nb, p)``;
    returns the bits consumed from that state, or -1 on an invalid code."""
    tb = np.uint64(table_bits)
    mask = (np.uint64(1) << tb) - np.uint64(1)
    consumed = Z
    for k in range(i, n):
        if nb < tb:
            acc, nb, p = refill(acc, nb, buf, p, end)
        sy, ln = lookup(table, acc, nb, tb, mask)
        if ln == Z:
            return -1
        if apply:
            if sy != 0:
                fout[out_start + k] += cent[sy]
        else:
            out[out_start + k] = sy
        nb -= ln
        consumed += ln
    return np.int64(consumed)


# --- multi-symbol decoding -------------------------------------------------------------
# A low-entropy stream spends ~1 bit per symbol, so one 12-bit window often holds ten
# whole code words. The multi table maps each window to every complete code word in
# it (up to twelve 4-bit or six 8-bit symbols), so one lookup decodes them all.

MULTI_BITS = 12


@kernel
def multi_decode_table(lengths, sym_bits):
    """Window -> ``consumed | count << 4 | sym_k << (8 + sym_bits * k)``; count 0 = invalid.

    ``sym_bits`` is 4 (alphabets up to 16) or 8 (up to 256); at most ``48 // sym_bits``
    symbols per entry.
    """
    single = decode_table(lengths, np.int64(MULTI_BITS))
    mask = (1 << MULTI_BITS) - 1
    most = 48 // sym_bits
    table = np.zeros(1 << MULTI_BITS, np.uint64)
    for w in range(1 << MULTI_BITS):
        pos = 0
        cnt = 0
        entry = np.uint64(0)
        while cnt < most:
            e = single[(w << pos) & mask]
            ln = e & 15
            if ln == 0 or ln > MULTI_BITS - pos:
                break
            entry |= np.uint64(e >> 4) << np.uint64(8 + sym_bits * cnt)
            pos += ln
            cnt += 1
        table[w] = entry | np.uint64(pos) | np.uint64(cnt << 4)
    return table


SPARSE_BITS = 1.1         # coded bits per symbol under which a chunk is mostly zeros


@kernel
def decode_symbols_multi(buf, start, end, n, multi, sym_bits, single, table_bits, out, out_start,
                         cent, fout, apply):
    """As :func:`decode_symbols`, several symbols per lookup; the tail goes one by one.

    ``apply`` on a chunk of more than :data:`SPARSE_BITS` bits per symbol runs in two
    passes: the symbols into a byte buffer, then one add per symbol (zeros add -0.0, see
    :func:`additive`). Adding between lookups, with a branch on zero symbols, was 1.5-3x
    slower there: the lookups are a chain of dependent loads, and the adds and
    mispredicted branches stalled it. A sparser chunk (the faithful LC stream, ~1 bit
    per symbol) adds only its nonzero symbols between lookups: every element's add
    would read and write all of the output, which the zeros leave untouched.
    """
    if not apply or (end - start) * 8 <= SPARSE_BITS * n:
        if sym_bits == 8:       # the width as a constant: fixed shifts, an unrolled store
            return _multi_into(buf, start, end, n, multi, 8, single, table_bits, out,
                               out_start, cent, fout, apply)
        return _multi_into(buf, start, end, n, multi, 4, single, table_bits, out,
                           out_start, cent, fout, apply)
    sym = np.empty(n, np.uint8)
    if sym_bits == 8:
        used = _multi_into(buf, start, end, n, multi, 8, single, table_bits, sym, 0,
                           cent, fout, False)
    else:
        used = _multi_into(buf, start, end, n, multi, 4, single, table_bits, sym, 0,
                           cent, fout, False)
    if used >= 0:
        add_decoded(sym, np.int64(0), n, additive(cent), fout, out_start)
    return used


@kernel
def add_decoded(sym, so, n, cz, fout, fo):
    """``fout[fo + k] += cz[sym[so + k]]`` for ``k < n``: the second pass of a dense
    chunk decoded apart from its adds (``cz``: :func:`additive` centroids)."""
    f, s = fout[fo:fo + n], sym[so:so + n]      # views from 0: the loop vectorizes
    for k in range(n):
        f[k] += cz[s[k]]


@kernel(inline="always")
def _multi_into(buf, start, end, n, multi, sym_bits, single, table_bits, out, out_start,
                cent, fout, apply):
    """:func:`decode_symbols_multi` in one pass: symbols stored into ``out[out_start:]``,
    or with ``apply`` the nonzero ones added into ``fout``."""
    acc = Z
    nb = Z
    p = start
    consumed = Z
    i = 0
    mb = np.uint64(MULTI_BITS)
    mmask = (np.uint64(1) << mb) - np.uint64(1)
    most = 48 // sym_bits
    sb = np.uint64(sym_bits)
    smask = (np.uint64(1) << sb) - np.uint64(1)
    # a one-bit code is "0" (canonical codes): then a run of 0 bits is a run of that symbol
    zrun = (single[0] & np.uint32(15)) == np.uint32(1)
    zsym = np.uint8(single[0] >> np.uint32(4))
    while i + most <= n:
        if nb < mb:
            acc, nb, p = refill(acc, nb, buf, p, end)
        w = (acc >> (nb - mb)) & mmask
        if zrun and w == Z:                # mb or more of them: count them all at once
            r = np.int64(min(clz64(acc << (np.uint64(64) - nb)), nb))
            r = min(r, n - i)
            if not apply:
                run = out[out_start + i:out_start + i + r]     # from 0: a memset
                for k in range(r):
                    run[k] = zsym
            elif zsym != 0:
                for k in range(r):
                    fout[out_start + i + k] += cent[zsym]
            nb -= np.uint64(r)
            consumed += np.uint64(r)
            i += r
            continue
        e = multi[w]
        cnt = np.int64((e >> np.uint64(4)) & np.uint64(15))
        if cnt == 0:
            return -1
        if apply:             # zeros skipped: these streams are mostly zeros, and adds
            for k in range(cnt):           # past cnt would chain through memory
                sy = (e >> (np.uint64(8) + sb * np.uint64(k))) & smask
                if sy != 0:
                    fout[out_start + i + k] += cent[sy]
        else:
            for k in range(most):                  # a fixed count: no branch per symbol
                out[out_start + i + k] = np.uint8((e >> (np.uint64(8) + sb * np.uint64(k))) & smask)
        used = e & np.uint64(15)
        nb -= used
        consumed += used
        i += cnt
    tail = decode_tail(buf, p, end, acc, nb, i, n, single, table_bits, out, out_start,
                       cent, fout, apply)
    return -1 if tail < 0 else np.int64(consumed) + tail


@kernel
def decode_tail(buf, p, end, acc, nb, i, n, table, table_bits, out, out_start, cent, fout,
                apply):
    """:func:`_decode_from` as a call of its own: the multi-symbol readers' tails (one
    per chunk) are compiled once, not into each of their inlined copies, which took
    seconds of a fresh install's first compile."""
    return _decode_from(buf, p, end, acc, nb, i, n, table, table_bits, out, out_start,
                        cent, fout, apply)
