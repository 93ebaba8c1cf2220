"""Fused kernels of the exact codec's fast path for floats (fp16, bf16, fp32).

The byte-plane format is that of :mod:`lcckpt.codec.kernels.floats`: the word rotated left by
one bit, its top byte (the exponent) Huffman-coded per chunk, the lower bytes stored raw.
These kernels make that in as few passes over memory as possible:

* ``top_histogram`` counts the top plane exactly (and samples the others) reading only
  the words: nothing is written, so no plane array is ever allocated;
* ``split_code`` writes the raw planes of one chunk and its Huffman-coded exponents
  straight into the blob's final buffer;
* ``decode_top``/``decode_top4`` read the exponent code with a branch-free 64-bit
  window, one or four chunks at a time (independent bit streams keep the core busy while
  one waits on its table lookup: four ran 1.9x faster than one, two 1.6x),
  into a small buffer the merge consumes while in cache; ``decode4``, under
  ``decode_top4``, makes four lookups per 8-byte load, as ``pairs_decode`` does, and
  also takes four buffers with their own tables (a replay's four deltas of one chunk).

* ``pairs_encode``/``pairs_decode`` code one chunk of exponents with a code of its own
  over pairs of exponent ranks (chunk mode "pairs", layout below), four streams per
  chunk decoded side by side, four table lookups per 8-byte load and one 8-byte store
  per lookup (byte stores and a load per lookup made that loop 1.8x slower);
* ``decode_float_chunks`` decodes a run of chunks in any of the top plane's modes and
  merges each into the output words while its exponents are in cache (one call per
  run: no Python between chunks);

They do not choose modes or parse blob headers: lossless.py plans, streams.py owns the
stream layout, and bits.py's careful reader decodes the last bytes of each chunk. Every
size read from a "pairs" chunk is checked against the chunk's end before it is used.
"""

import numpy as np

from ...util.jit import kernel
from .bits import U8, Z, flush, load64, lookup, put, reader_at, refill
from .huffman import _decode_from, canonical_codes, code_lengths, decode_table
from .runs import _count_letter

SAMPLE = 32                    # every 32nd word: 2048+ samples on the fast path
WIN = np.uint64(52)            # 64 - MULTI_BITS: the multi table's window is 12 bits
ROOM = 8                       # bytes of output a multi-table lookup stores


@kernel(inline="always")
def _shift(width):
    """Where the top byte of the word rotated left by one starts in the unrotated word
    (that byte is the exponent of fp32 and bf16)."""
    return np.uint32(8 * width - 9)


@kernel(inline="always")
def _top(x, sh):
    return (np.uint32(x) >> sh) & np.uint32(0xFF)


@kernel(inline="always")
def _rot(x, width):
    if width == 4:
        y = np.uint32(x)
        return (y << np.uint32(1)) | (y >> np.uint32(31))
    y = np.uint32(x)
    return ((y << np.uint32(1)) | (y >> np.uint32(15))) & np.uint32(0xFFFF)


@kernel
def top_histogram(words, start, stop, width, hist):
    """``hist[width-1]``: exact counts of the top plane of ``words[start:stop]``; the
    lower planes of every SAMPLE-th word into ``hist[k]``. Eight interleaved sub-counts
    break the store-to-load chain when one exponent dominates (1.7x faster than one)."""
    w = words[start:stop]
    m = stop - start
    h = np.zeros((8, 256), np.uint32)            # a chunk holds < 2**32 words
    sh = _shift(width)
    q = m - m % 8
    for i in range(0, q, 8):
        for j in range(8):
            h[j, _top(w[i + j], sh)] += 1
    for i in range(q, m):
        h[0, _top(w[i], sh)] += 1
    for s in range(256):
        t = 0
        for j in range(8):
            t += h[j, s]
        hist[width - 1, s] += t
    first = (-start) % SAMPLE
    for i in range(first, m, SAMPLE):
        x = _rot(w[i], width)
        for k in range(width - 1):
            hist[k, (x >> np.uint32(8 * k)) & np.uint32(0xFF)] += 1


@kernel
def lower_histogram(words, start, stop, width, hist):
    """``hist[k]``: exact counts of lower plane ``k`` of ``words[start:stop]``.

    Zero words are counted apart: in a chunk of mostly zeros (a fine-tune's moments of
    unused embedding rows) every word would add to the same counters, each add waiting
    for the one before it in memory."""
    w = words[start:stop]
    zeros = 0
    i, m = 0, stop - start
    while i < m:
        if i + 8 <= m and _zero_eight(w, i):       # eight words at a time, or one by one
            zeros += 8
            i += 8
            continue
        for j in range(i, min(m, i + 8)):
            x = _rot(w[j], width)
            if x == 0:
                zeros += 1
                continue
            for k in range(width - 1):
                hist[k, (x >> np.uint32(8 * k)) & np.uint32(0xFF)] += 1
        i += 8
    for k in range(width - 1):
        hist[k, 0] += zeros


@kernel(inline="always")
def _zero_eight(w, i):
    """``w[i:i + 8]`` are all 0, without a branch per word."""
    u = np.uint64(i)                    # unsigned: no negative-index fix-up per load
    o = w[u] | w[u + np.uint64(1)] | w[u + np.uint64(2)] | w[u + np.uint64(3)]
    o |= w[u + np.uint64(4)] | w[u + np.uint64(5)] | w[u + np.uint64(6)] | w[u + np.uint64(7)]
    return o == 0


@kernel
def lower_runs_histogram(words, start, stop, width, hist, extra):
    """``hist[k]``: the letters (run of zero bytes, the byte that ends it) of lower plane
    ``k`` of ``words[start:stop]``, as :func:`lcckpt.codec.kernels.runs.runs_histogram`
    counts them over that plane's bytes (256 symbols); ``extra[k]``: its extra bits."""
    w = words[start:stop]
    run = np.zeros(width - 1, np.int64)
    z = 0                                  # zero words since the last other one: every
    i, m = 0, stop - start                 # plane's run goes on (counted in a register)
    while i < m:
        if i + 8 <= m and _zero_eight(w, i):       # eight words at a time, or one by one
            z += 8
            i += 8
            continue
        for j in range(i, min(m, i + 8)):
            x = _rot(w[j], width)
            if x == 0:
                z += 1
                continue
            for k in range(width - 1):
                run[k] += z
                s = np.int64((x >> np.uint32(8 * k)) & np.uint32(0xFF))
                if s == 0:
                    run[k] += 1
                else:
                    extra[k] += _count_letter(hist[k], run[k], 256, s)
                    run[k] = 0
            z = 0
        i += 8
    for k in range(width - 1):
        if run[k] + z > 0:
            extra[k] += _count_letter(hist[k], run[k] + z, 256, 0)


TOP_HUFFMAN, TOP_RAW, TOP_CONST = 0, 1, 2


@kernel(inline="always")
def _write64(out, p, v):
    """``v`` big-endian at ``out[p:p + 8]`` (LLVM fuses the stores into one)."""
    u = np.uint64(p)                    # unsigned: no negative-index fix-up per store
    for k in range(8):
        out[u + np.uint64(k)] = np.uint8((v >> np.uint64(56 - 8 * k)) & np.uint64(0xFF))


@kernel
def pair_codes(codes, lengths):
    """``(code of a, code of b) << 5 | length`` for every letter pair ``a << 8 | b``: one
    put per two exponents (a pair is at most 24 bits with 12-bit codes)."""
    t = np.zeros(1 << 16, np.uint32)
    for a in range(256):
        for b in range(256):
            ln = np.uint32(lengths[a]) + np.uint32(lengths[b])
            code = (np.uint32(codes[a]) << np.uint32(lengths[b])) | np.uint32(codes[b])
            t[(a << 8) | b] = (code << np.uint32(5)) | ln
    return t
BLOCK = 4096                   # words split per step: the coder re-reads them from L1


@kernel
def split_code(words, start, stop, width, out, raw_pos, top_mode, top_pos, limit, codes,
               lengths, pairs):
    """Chunk ``words[start:stop]``: lower plane ``k`` raw to ``out[raw_pos[k]:]``, the top
    plane to ``out[top_pos:limit]`` Huffman-coded, raw, or not at all (constant). Returns
    the end of the top plane's bytes. Nothing is written at or past ``limit``."""
    m = stop - start
    sh = _shift(width)
    acc = Z
    nb = Z
    p = top_pos
    for b0 in range(0, m, BLOCK):
        b1 = min(m, b0 + BLOCK)
        w = words[start + b0:start + b1]
        if width == 4:
            o0 = out[raw_pos[0] + b0:raw_pos[0] + b1]
            o1 = out[raw_pos[1] + b0:raw_pos[1] + b1]
            o2 = out[raw_pos[2] + b0:raw_pos[2] + b1]
            for i in range(b1 - b0):            # views from 0: the loop vectorizes
                x = np.uint32(w[i])
                x = (x << np.uint32(1)) | (x >> np.uint32(31))
                o0[i] = np.uint8(x & np.uint32(0xFF))
                o1[i] = np.uint8((x >> np.uint32(8)) & np.uint32(0xFF))
                o2[i] = np.uint8((x >> np.uint32(16)) & np.uint32(0xFF))
        else:
            o0 = out[raw_pos[0] + b0:raw_pos[0] + b1]
            for i in range(b1 - b0):
                x = np.uint16(w[i])
                x = np.uint16((x << np.uint16(1)) | (x >> np.uint16(15)))
                o0[i] = np.uint8(x & np.uint16(0xFF))
        if top_mode == TOP_HUFFMAN:
            k = b1 - b0
            i = 0
            while nb >= U8:                           # whole bytes out: fewer than 8
                nb -= U8                              # bits pending from here on
                out[p] = np.uint8((acc >> nb) & np.uint64(0xFF))
                p += 1
            while i + 3 < k and p + 8 <= limit:      # four letters (two pairs, <= 48
                e1 = pairs[(_top(w[i], sh) << np.uint32(8)) | _top(w[i + 1], sh)]   # bits)
                e2 = pairs[(_top(w[i + 2], sh) << np.uint32(8)) | _top(w[i + 3], sh)]
                l2 = np.uint64(e2 & np.uint32(31))
                ln = np.uint64(e1 & np.uint32(31)) + l2
                acc = ((acc << ln) | (np.uint64(e1 >> np.uint32(5)) << l2)
                       | np.uint64(e2 >> np.uint32(5)))
                nb += ln                              # <= 55: the pending bits fit
                _write64(out, p, acc << (np.uint64(64) - nb))   # top-aligned, 8 bytes; only
                p += np.int64(nb >> np.uint64(3))     # the whole ones are kept (the rest is
                nb &= np.uint64(7)                    # written again next time)
                i += 4
            while i + 1 < k:
                e = pairs[(_top(w[i], sh) << np.uint32(8)) | _top(w[i + 1], sh)]
                acc, nb, p = put(acc, nb, np.uint64(e >> np.uint32(5)),
                                 np.uint64(e & np.uint32(31)), out, p)
                i += 2
            if k % 2:
                s = _top(w[k - 1], sh)
                acc, nb, p = put(acc, nb, np.uint64(codes[s]), np.uint64(lengths[s]), out, p)
        elif top_mode == TOP_RAW:
            t = out[top_pos + b0:top_pos + b1]
            for i in range(b1 - b0):
                t[i] = np.uint8(_top(w[i], sh))
    if top_mode == TOP_HUFFMAN:
        return flush(acc, nb, out, p)
    if top_mode == TOP_RAW:
        return top_pos + m
    return top_pos


# --- decoding --------------------------------------------------------------------------

@kernel(inline="always")
def _put_entry(win, multi, out, o):
    """The multi-table entry for the top 12 bits of ``win``; stores its six bytes at
    ``out[o:]`` and two bytes of no meaning after them (the caller leaves ROOM bytes)."""
    e = multi[win >> WIN]
    x = (e >> np.uint64(8)) | (e << np.uint64(56))     # every byte of x depends on e:
    u = np.uint64(o)                    # LLVM merges the eight stores into one (six
    for k in range(8):                  # byte stores were 1.8x slower in the pairs loop)
        out[u + np.uint64(k)] = np.uint8((x >> np.uint64(8 * k)) & np.uint64(0xFF))
    return e


@kernel(inline="always")
def _lookup(buf, bp, multi, out, o):
    """One multi-table lookup at bit ``bp`` (see :func:`_put_entry`); the entry's low
    byte says how many bits were used and how much was decoded."""
    return _put_entry(load64(buf, bp >> np.uint64(3)) << (bp & np.uint64(7)), multi, out, o)


@kernel(inline="always")
def _step(buf, bp, multi, out, o):
    """:func:`_lookup` of letters: returns ``(bits used, letters)``; 0 letters marks an
    invalid code."""
    e = _lookup(buf, bp, multi, out, o)
    return e & np.uint64(15), np.int64((e >> np.uint64(4)) & np.uint64(15))


@kernel(inline="always")
def _fast(buf, bp, end, i, n, multi, out, o):
    """Lookups while eight bytes can be loaded and stored; returns the
    reader's bit position and letter count, or letter count -1 on an invalid code."""
    if end < 8:
        return bp, i
    last = np.uint64(end - 8) << np.uint64(3)
    while i + ROOM <= n and bp <= last:
        used, cnt = _step(buf, bp, multi, out, o + i)
        if cnt == 0:
            return bp, -1
        bp += used
        i += cnt
    return bp, i


@kernel(inline="always")
def _tail(buf, start, bp, end, i, n, single, tb, out, o):
    """The rest of a chunk with the careful reader; returns the bits consumed in all."""
    acc, nb, p = reader_at(buf, bp, end)
    dummy = np.zeros(1, np.float32)
    t = _decode_from(buf, p, end, acc, nb, i, n, single, tb, out, o, dummy, dummy, False)
    if t < 0:
        return -1
    return np.int64(bp) - 8 * start + t


@kernel
def decode_top(buf, start, end, n, multi, single, tb, out, o):
    """Decode ``n`` letters of one chunk (bytes ``buf[start:end]``) into ``out[o:o + n]``.
    Returns the bits consumed, -1 if invalid."""
    bp, i = _fast(buf, np.uint64(8 * start), end, 0, n, multi, out, o)
    if i < 0:
        return -1
    return _tail(buf, start, bp, end, i, n, single, tb, out, o)


@kernel
def decode4(bufs, s, e, n, multis, singles, tbs, out, o, used):
    """Four Huffman streams of byte letters side by side: stream ``j`` is
    ``bufs[j][s[j]:e[j]]`` (``n[j]`` letters, multi table ``multis[j]``, single table
    ``singles[j]`` of ``tbs[j]`` bits), decoded into ``out[o[j]:]``; ``used[j]`` gets the
    bits it consumed, -1 if invalid. ``o`` keeps ``n[j]`` bytes of ``out`` apart per
    stream. Four chains hide the table lookup's latency better than two. Each stream
    has its buffer and tables (one chunk of four deltas, each its own blob and code, in a
    chain's replay), or all share them (:func:`decode_top4`)."""
    buf0, buf1, buf2, buf3 = bufs
    m0, m1, m2, m3 = multis
    b0 = np.uint64(8 * s[0])
    b1 = np.uint64(8 * s[1])
    b2 = np.uint64(8 * s[2])
    b3 = np.uint64(8 * s[3])
    ok = True
    for j in range(4):
        if e[j] < 8:
            ok = False
    l0 = np.uint64(max(e[0], 8) - 8) << np.uint64(3)
    l1 = np.uint64(max(e[1], 8) - 8) << np.uint64(3)
    l2 = np.uint64(max(e[2], 8) - 8) << np.uint64(3)
    l3 = np.uint64(max(e[3], 8) - 8) << np.uint64(3)
    i0 = np.int64(0)        # not the literal 0: _finish is compiled for int64 only
    i1 = np.int64(0)
    i2 = np.int64(0)
    i3 = np.int64(0)
    o0, o1, o2, o3 = o[0], o[1], o[2], o[3]      # scalars: ``out`` could alias ``o``
    f4 = np.uint64(15)
    bad = False
    while ok:
        # as in pairs_decode: four lookups per 8-byte load (<= 48 bits, <= 24 letters,
        # stores reaching 26 bytes on), the safe number of steps without a test; an
        # invalid code stalls its stream, which _fast then reports
        room = min(min(n[0] - i0, n[1] - i1), min(n[2] - i2, n[3] - i3)) - 26
        bits = min(min(np.int64(l0) - np.int64(b0), np.int64(l1) - np.int64(b1)),
                   min(np.int64(l2) - np.int64(b2), np.int64(l3) - np.int64(b3)))
        if room < 0 or bits < 0:
            break
        before = i0 + i1 + i2 + i3
        for _ in range(min(room // 24, bits // 48) + 1):
            w0 = load64(buf0, b0 >> np.uint64(3)) << (b0 & np.uint64(7))
            w1 = load64(buf1, b1 >> np.uint64(3)) << (b1 & np.uint64(7))
            w2 = load64(buf2, b2 >> np.uint64(3)) << (b2 & np.uint64(7))
            w3 = load64(buf3, b3 >> np.uint64(3)) << (b3 & np.uint64(7))
            for _k in range(4):
                x0 = _put_entry(w0, m0, out, o0 + i0)
                x1 = _put_entry(w1, m1, out, o1 + i1)
                x2 = _put_entry(w2, m2, out, o2 + i2)
                x3 = _put_entry(w3, m3, out, o3 + i3)
                w0 <<= x0 & f4
                w1 <<= x1 & f4
                w2 <<= x2 & f4
                w3 <<= x3 & f4
                b0 += x0 & f4
                b1 += x1 & f4
                b2 += x2 & f4
                b3 += x3 & f4
                i0 += np.int64((x0 >> np.uint64(4)) & f4)
                i1 += np.int64((x1 >> np.uint64(4)) & f4)
                i2 += np.int64((x2 >> np.uint64(4)) & f4)
                i3 += np.int64((x3 >> np.uint64(4)) & f4)
        if i0 + i1 + i2 + i3 == before:              # every stream stalled
            bad = True
            break
    for j in range(4):
        used[j] = -1
    if bad:
        return
    # unpacked, as the buffers: the four tables need not share a type
    t0, t1, t2, t3 = singles
    used[0] = _finish(buf0, s[0], b0, e[0], i0, n[0], m0, t0, tbs[0], out, o0)
    used[1] = _finish(buf1, s[1], b1, e[1], i1, n[1], m1, t1, tbs[1], out, o1)
    used[2] = _finish(buf2, s[2], b2, e[2], i2, n[2], m2, t2, tbs[2], out, o2)
    used[3] = _finish(buf3, s[3], b3, e[3], i3, n[3], m3, t3, tbs[3], out, o3)


@kernel
def _finish(buf, start, bp, end, i, n, multi, single, tb, out, o):
    """One stream's rest: fast lookups while eight bytes can be loaded, then the careful
    reader; the bits consumed in all, or -1. A call, not inlined: the four copies that
    :func:`decode4` inlined took half of its compile time (seconds on a fresh install)."""
    bp, i = _fast(buf, bp, end, i, n, multi, out, o)
    if i < 0:
        return -1
    return _tail(buf, start, bp, end, i, n, single, tb, out, o)


@kernel
def decode_top4(buf, s, e, n, multi, single, tb, out, o, used):
    """Four chunks of one buffer and code at once (:func:`decode4`; ``s``, ``e``, ``n``,
    ``o``: int64[4] of starts, ends, letter counts and output offsets)."""
    decode4((buf, buf, buf, buf), s, e, n, (multi, multi, multi, multi),
            (single, single, single, single), (tb, tb, tb, tb), out, o, used)


# --- chunk mode "pairs": a code of its own per chunk, one letter per two exponents -----
# A Huffman code spends whole bits per letter: on trained weights' exponents (2.4 bits of
# entropy, the top letter at p = 0.35) that wastes 3.5%, and one code for the whole
# tensor misses how the exponents drift from tensor to tensor. Here every chunk carries
# its own code over pairs of exponent ranks: its 15 most frequent exponents get ranks
# 0-14, rank 15 escapes (the exponent itself follows the bit streams), and each pair of
# ranks ``a * 16 + b`` is one 8-bit letter. Half the letters, so half the rounding loss,
# and a table that fits the chunk: 1.6% smaller exponent planes than ZipNN's per-chunk
# Huffman on the benchmark's weights. The pairs are cut into four streams of equal
# letter counts, decoded side by side (independent chains hide the table latency).
#
# Payload of one chunk of m exponents (P = ceil(m / 2) pairs, the last one padded with
# rank 0 when m is odd; Q = ceil(P / 4) pairs per stream, the last stream the rest):
#   u8 nr (1..15) | nr exponent bytes, rank order | 128 bytes: 4-bit code lengths of the
#   256 pair letters | u32 escapes | u32 bytes of streams 0, 1, 2 | four byte-aligned
#   MSB-first bit streams | the escaped exponents, in element order.

PAIR_RANKS = 15
PAIR_STREAMS = 4
PAIR_BITS = 12                 # longest code, and the decode table's window
PAIRS_OK, PAIRS_BAD_HEADER, PAIRS_BAD_CODE, PAIRS_BAD_SIZE, PAIRS_BAD_ESCAPES = range(5)
PAIRS_ERRORS = {
    PAIRS_BAD_HEADER: "has an invalid code header",
    PAIRS_BAD_CODE: "holds an invalid code word",
    PAIRS_BAD_SIZE: "does not decode to its recorded size",
    PAIRS_BAD_ESCAPES: "has escapes that do not match its code",
}


def pairs_bound(m: int) -> int:
    """Bytes :func:`pairs_encode` may write for a chunk of ``m`` exponents."""
    return 2 * m + 256


@kernel(inline="always")
def _put32(out, p, v):
    for k in range(4):
        out[p + k] = np.uint8((v >> (8 * k)) & 0xFF)


@kernel(inline="always")
def _get32(buf, p):
    return (np.int64(buf[p]) | (np.int64(buf[p + 1]) << 8) | (np.int64(buf[p + 2]) << 16)
            | (np.int64(buf[p + 3]) << 24))


RANK_SAMPLE = 32               # ranks come from every 32nd exponent of the chunk


@kernel
def pairs_encode(words, start, stop, width, escaped, out, hist, max_escapes):
    """Code the exponents (top bytes of the rotated words) of ``words[start:stop]`` into
    ``out`` (at least :func:`pairs_bound` bytes); ``escaped`` is scratch of ``m`` bytes.
    The ranks come from every RANK_SAMPLE-th exponent, counted into ``hist`` with the
    lower planes' bytes (what :func:`top_histogram` samples). Returns the bytes written,
    or -1 without coding when more than ``max_escapes`` of the exponents (as the sample
    says, or as counted) fall outside the 15 ranks (top bytes spread wide, as fp16's, or
    repeating with a period that the sample aliases: one code for the whole plane does
    better)."""
    m = stop - start
    w = words[start:stop]
    sh = _shift(width)
    counts = np.zeros(256, np.int64)
    first = (-start) % RANK_SAMPLE
    sampled = 0
    for i in range(first, m, RANK_SAMPLE):
        y = _rot(w[i], width)
        counts[(y >> np.uint32(8 * width - 8)) & np.uint32(0xFF)] += 1
        for k in range(width - 1):
            hist[k, (y >> np.uint32(8 * k)) & np.uint32(0xFF)] += 1
        sampled += 1
    if sampled == 0:
        counts[_top(w[0], sh)] += 1
        sampled = 1
    for x in range(256):
        hist[width - 1, x] += counts[x]
    order = np.argsort(-counts, kind="mergesort")    # most frequent first, ties by value
    nr = 0
    while nr < PAIR_RANKS and counts[order[nr]] > 0:
        nr += 1
    outside = sampled
    for r in range(nr):
        outside -= counts[order[r]]
    if outside > max_escapes * sampled / m:
        return -1
    digit = np.full(256, nr, np.uint8)                # rank, or nr: escaped
    for r in range(nr):
        digit[order[r]] = r
    npairs = (m + 1) // 2
    letters = np.empty(npairs, np.uint8)
    ph4 = np.zeros((4, 256), np.int64)
    nesc = 0
    for k in range(m // 2):
        x = _top(w[2 * k], sh)
        y = _top(w[2 * k + 1], sh)
        a = digit[x]
        b = digit[y]
        v = (a << 4) | b
        letters[k] = v
        ph4[k & 3, v] += 1
        if a == nr or b == nr:
            if a == nr:
                escaped[nesc] = x
                nesc += 1
            if b == nr:
                escaped[nesc] = y
                nesc += 1
    if m % 2:                                         # the last pair: padded with rank 0
        x = _top(w[m - 1], sh)
        a = digit[x]
        letters[npairs - 1] = a << 4
        ph4[0, a << 4] += 1
        if a == nr:
            escaped[nesc] = x
            nesc += 1
    if nesc > max_escapes:       # the sample missed them (a period of the sampling step)
        return -1
    ph = np.zeros(256, np.int64)      # ``ph4.sum(axis=0)``, whose axis check's error
    for r in range(ph4.shape[0]):     # message took a second to compile
        for v in range(256):
            ph[v] += ph4[r, v]
    lengths = code_lengths(ph, np.int64(PAIR_BITS))
    codes = canonical_codes(lengths).astype(np.uint64)
    lens = lengths.astype(np.uint64)
    p = 0
    out[p] = nr
    p += 1
    for r in range(nr):
        out[p] = order[r]
        p += 1
    for t in range(128):
        out[p + t] = (lengths[2 * t] << 4) | lengths[2 * t + 1]
    p += 128
    _put32(out, p, nesc)
    sizes = p + 4
    p += 16
    qs = (npairs + PAIR_STREAMS - 1) // PAIR_STREAMS
    for j in range(PAIR_STREAMS):
        a0 = min(npairs, j * qs)
        a1 = min(npairs, (j + 1) * qs)
        first = p
        acc = Z
        nb = Z
        k = a0
        while k + 3 < a1:                 # four letters (<= 48 bits) per 8-byte store
            v0 = letters[k]
            v1 = letters[k + 1]
            v2 = letters[k + 2]
            v3 = letters[k + 3]
            l1 = lens[v1]
            l2 = lens[v2]
            l3 = lens[v3]
            ln = lens[v0] + l1 + l2 + l3
            acc = ((acc << ln) | (codes[v0] << (l1 + l2 + l3)) | (codes[v1] << (l2 + l3))
                   | (codes[v2] << l3) | codes[v3])
            nb += ln
            _write64(out, p, acc << (np.uint64(64) - nb))
            p += np.int64(nb >> np.uint64(3))
            nb &= np.uint64(7)
            k += 4
        while k < a1:
            v = letters[k]
            acc, nb, p = put(acc, nb, codes[v], lens[v], out, p)
            k += 1
        p = flush(acc, nb, out, p)
        if j < PAIR_STREAMS - 1:
            _put32(out, sizes + 4 * j, p - first)
    _copy(out, p, escaped, 0, nesc)
    p += nesc
    return p


@kernel(inline="always")
def _copy(dst, d0, src, s0, m):
    """``dst[d0:d0 + m] = src[s0:s0 + m]``, whose sizes the caller has checked; a loop,
    not a slice assignment, whose shape-mismatch error took seconds to compile."""
    d = dst[d0:d0 + m]
    s = src[s0:s0 + m]
    for k in range(m):
        d[k] = s[k]


PAIR_USED = np.uint64(58)      # pair-table entry: bits used << 58 | bytes decoded << 48
PAIR_GOT = np.uint64(48)       # | the six exponent bytes (three pairs) in the low 48 bits


@kernel
def _pair_tables(lengths, lut):
    """The one-letter table ``(letter << 4) | length`` and the pair table: per 12-bit
    window up to three whole pairs, ``bits used << 58 | bytes << 48 | the six bytes``.
    The bytes sit in the low 48 bits so that one 8-byte store writes them (its two top
    bytes land past what was decoded and are overwritten next); the bits used in the
    top six, so one shift reads them. 32 KB: the table stays in L1."""
    single = decode_table(lengths, np.int64(PAIR_BITS))
    mask = (1 << PAIR_BITS) - 1
    multi = np.zeros(1 << PAIR_BITS, np.uint64)
    for win in range(1 << PAIR_BITS):
        pos = 0
        cnt = 0
        ent = np.uint64(0)
        while cnt < 3:
            t = single[(win << pos) & mask]
            ln = t & 15
            if ln == 0 or ln > PAIR_BITS - pos:
                break
            v = t >> 4
            two = np.uint64(lut[v >> 4]) | (np.uint64(lut[v & 15]) << np.uint64(8))
            ent |= two << np.uint64(16 * cnt)
            pos += ln
            cnt += 1
        multi[win] = ent | (np.uint64(2 * cnt) << PAIR_GOT) | (np.uint64(pos) << PAIR_USED)
    return single, multi


@kernel(inline="always")
def _pair_lookup(win, multi, out, o):
    """The pair-table entry for the top 12 bits of ``win``; its six bytes are stored at
    ``out[o:o + 8]`` (the caller leaves eight bytes of room) with one 8-byte store."""
    x = multi[win >> WIN]
    u = np.uint64(o)                    # unsigned: no negative-index fix-up per store
    for k in range(8):                  # all eight bytes of x: LLVM merges the stores
        out[u + np.uint64(k)] = np.uint8((x >> np.uint64(8 * k)) & np.uint64(0xFF))
    return x


@kernel(inline="always")
def _pair_got(x):
    """Bytes decoded by pair-table entry ``x`` (0: an invalid code)."""
    return np.int64((x >> PAIR_GOT) & np.uint64(7))


@kernel
def pairs_decode(buf, s, e, m, out, o):
    """Decode one "pairs" chunk, bytes ``buf[s:e]``, into ``out[o:o + m]`` (nothing is
    written outside it). Every size is checked against ``e`` before it is used; returns
    PAIRS_OK or an error code (see PAIRS_ERRORS)."""
    if m <= 0 or s < 0 or e > buf.size or e - s < 1 + 128 + 16:
        return PAIRS_BAD_HEADER
    p = s
    nr = np.int64(buf[p])
    p += 1
    if nr < 1 or nr > PAIR_RANKS or p + nr + 128 + 16 > e:
        return PAIRS_BAD_HEADER
    lut = np.zeros(16, np.uint8)
    seen = np.zeros(256, np.bool_)
    for r in range(nr):
        lut[r] = buf[p + r]
        seen[buf[p + r]] = True
    p += nr
    hole = 0                                 # a byte no rank decodes to: marks escapes
    while seen[hole]:
        hole += 1
    for d in range(nr, 16):
        lut[d] = hole
    lengths = np.empty(256, np.uint8)
    for t in range(128):
        b = buf[p + t]
        lengths[2 * t] = b >> 4
        lengths[2 * t + 1] = b & 15
    p += 128
    kraft = 0
    for v in range(256):
        ln = lengths[v]
        if ln:
            if ln > PAIR_BITS or (v >> 4) > nr or (v & 15) > nr:
                return PAIRS_BAD_HEADER
            kraft += 1 << (PAIR_BITS - ln)
    if kraft == 0 or kraft > 1 << PAIR_BITS:
        return PAIRS_BAD_HEADER
    nesc = _get32(buf, p)
    ss = np.empty(PAIR_STREAMS + 1, np.int64)
    ss[0] = p + 16
    for j in range(PAIR_STREAMS - 1):
        ss[j + 1] = ss[j] + _get32(buf, p + 4 + 4 * j)
    esc = e - nesc
    if nesc > m or esc < ss[PAIR_STREAMS - 1]:
        return PAIRS_BAD_SIZE
    ss[PAIR_STREAMS] = esc
    single, multi = _pair_tables(lengths, lut)
    npairs = (m + 1) // 2
    qs = (npairs + PAIR_STREAMS - 1) // PAIR_STREAMS
    lim = np.empty(PAIR_STREAMS, np.int64)         # bytes of out each stream fills
    oo = np.empty(PAIR_STREAMS, np.int64)
    bp = np.empty(PAIR_STREAMS, np.uint64)
    got = np.zeros(PAIR_STREAMS, np.int64)
    for j in range(PAIR_STREAMS):
        a0 = min(npairs, j * qs)
        a1 = min(npairs, (j + 1) * qs)
        oo[j] = o + 2 * a0
        lim[j] = min(m, 2 * a1) - 2 * a0
        bp[j] = np.uint64(8 * ss[j])
    last = np.uint64(max(e - 8, 0) * 8)             # 8-byte loads stay inside the chunk
    if e - s >= 8:
        b0, b1, b2, b3 = bp[0], bp[1], bp[2], bp[3]
        # scalars, not array reads: the stores to ``out`` could alias the arrays
        o0, o1, o2, o3 = oo[0], oo[1], oo[2], oo[3]
        e0, e1, e2, e3 = o0 + lim[0], o1 + lim[1], o2 + lim[2], o3 + lim[3]
        while True:
            # a step loads 8 bytes per stream and makes four lookups in them (at most
            # 48 bits, 24 bytes out, stores reaching 26 bytes on): the steps that are
            # safe whatever they decode run without a test. An invalid code stalls its
            # stream (it decodes nothing); the stream's own loop below reports it.
            room = min(min(e0 - o0, e1 - o1), min(e2 - o2, e3 - o3)) - 26
            bits = np.int64(last) - np.int64(max(max(b0, b1), max(b2, b3)))
            if room < 0 or bits < 0:
                break
            before = o0 + o1 + o2 + o3
            for _ in range(min(room // 24, bits // 48) + 1):
                w0 = load64(buf, b0 >> np.uint64(3)) << (b0 & np.uint64(7))
                w1 = load64(buf, b1 >> np.uint64(3)) << (b1 & np.uint64(7))
                w2 = load64(buf, b2 >> np.uint64(3)) << (b2 & np.uint64(7))
                w3 = load64(buf, b3 >> np.uint64(3)) << (b3 & np.uint64(7))
                for _k in range(4):              # 57+ bits in each window: four lookups
                    x0 = _pair_lookup(w0, multi, out, o0)
                    x1 = _pair_lookup(w1, multi, out, o1)
                    x2 = _pair_lookup(w2, multi, out, o2)
                    x3 = _pair_lookup(w3, multi, out, o3)
                    w0 <<= x0 >> PAIR_USED
                    w1 <<= x1 >> PAIR_USED
                    w2 <<= x2 >> PAIR_USED
                    w3 <<= x3 >> PAIR_USED
                    b0 += x0 >> PAIR_USED
                    b1 += x1 >> PAIR_USED
                    b2 += x2 >> PAIR_USED
                    b3 += x3 >> PAIR_USED
                    o0 += _pair_got(x0)
                    o1 += _pair_got(x1)
                    o2 += _pair_got(x2)
                    o3 += _pair_got(x3)
            if o0 + o1 + o2 + o3 == before:          # every stream stalled
                return PAIRS_BAD_CODE
        bp[0], bp[1], bp[2], bp[3] = b0, b1, b2, b3
        got[0], got[1], got[2], got[3] = o0 - oo[0], o1 - oo[1], o2 - oo[2], o3 - oo[3]
        for j in range(PAIR_STREAMS):               # each stream alone, then the tail
            b = bp[j]
            i = got[j]
            while i + 8 <= lim[j] and b <= last:
                w = load64(buf, b >> np.uint64(3)) << (b & np.uint64(7))
                x = _pair_lookup(w, multi, out, oo[j] + i)
                c = _pair_got(x)
                if c == 0:
                    return PAIRS_BAD_CODE
                b += x >> PAIR_USED
                i += c
            bp[j] = b
            got[j] = i
    tb = np.uint64(PAIR_BITS)
    tmask = np.uint64((1 << PAIR_BITS) - 1)
    for j in range(PAIR_STREAMS):
        end = ss[j + 1]
        q = np.int64(bp[j] >> np.uint64(3))
        skip = bp[j] & np.uint64(7)
        acc = Z
        nb = Z
        if q < end:
            acc = np.uint64(buf[q]) & (np.uint64(0xFF) >> skip)
            nb = U8 - skip
            q += 1
        used = np.int64(bp[j]) - 8 * ss[j]
        i = got[j]
        while i < lim[j]:
            if nb < tb:
                acc, nb, q = refill(acc, nb, buf, q, end)
            v, ln = lookup(single, acc, nb, tb, tmask)
            if ln == Z:
                return PAIRS_BAD_CODE
            nb -= ln
            used += np.int64(ln)
            out[oo[j] + i] = lut[v >> 4]
            if i + 1 < lim[j]:
                out[oo[j] + i + 1] = lut[v & 15]
            i += 2
        if used < 0 or (used + 7) // 8 != end - ss[j]:
            return PAIRS_BAD_SIZE
    if nesc == 0:
        return PAIRS_OK
    return _patch_escapes(buf, esc, nesc, hole, out, o, m)


@kernel
def _patch_escapes(buf, esc, nesc, hole, out, o, m):
    """Replace every ``hole`` byte of ``out[o:o + m]``, in order, by the next escaped
    exponent. Escapes are rare: 64 bytes are tested at a time by a count that
    vectorizes, and only a block that holds one is walked."""
    k = 0
    h = np.uint8(hole)
    v = out[o:o + m]
    q = m - m % 64
    for i in range(0, q, 64):
        c = 0
        for t in range(64):
            c += np.int32(v[i + t] == h)
        if c:
            for t in range(i, i + 64):
                if v[t] == h:
                    if k == nesc:
                        return PAIRS_BAD_ESCAPES
                    v[t] = buf[esc + k]
                    k += 1
    for t in range(q, m):
        if v[t] == h:
            if k == nesc:
                return PAIRS_BAD_ESCAPES
            v[t] = buf[esc + k]
            k += 1
    return PAIRS_OK if k == nesc else PAIRS_BAD_ESCAPES


# --- one call decodes a run of chunks --------------------------------------------------
# Chunk modes, as entropy.py numbers them (lossless.py checks they agree).
CHUNK_HUFFMAN, CHUNK_RAW, CHUNK_CONST, CHUNK_PAIRS = 0, 3, 4, 5


@kernel(inline="always")
def _merge_chunk(buf, raw_base, lo, hi, top, words, width):
    """Words ``lo:hi`` from the raw lower planes in ``buf`` and the exponents ``top``,
    rotated back (loops over views from 0: they vectorize)."""
    m = hi - lo
    w = words[lo:hi]
    if width == 4:
        p0 = buf[raw_base[0] + lo:raw_base[0] + hi]
        p1 = buf[raw_base[1] + lo:raw_base[1] + hi]
        p2 = buf[raw_base[2] + lo:raw_base[2] + hi]
        for i in range(m):
            x = (np.uint32(p0[i]) | (np.uint32(p1[i]) << np.uint32(8))
                 | (np.uint32(p2[i]) << np.uint32(16)) | (np.uint32(top[i]) << np.uint32(24)))
            w[i] = (x >> np.uint32(1)) | (x << np.uint32(31))
    else:
        p0 = buf[raw_base[0] + lo:raw_base[0] + hi]
        for i in range(m):
            x = np.uint16(p0[i]) | (np.uint16(top[i]) << np.uint16(8))
            w[i] = np.uint16((x >> np.uint16(1)) | (x << np.uint16(15)))


@kernel
def decode_float_chunks(buf, raw_base, tbase, offsets, modes, consts, c0, c1, cs, n,
                        width, words, block, multi, single, tb):
    """Chunks ``c0:c1`` of a float blob whose lower planes are raw (at ``raw_base[k]``
    in ``buf``) and whose exponents are coded per chunk (``tbase + offsets[c]``): the
    exponents into ``block`` (4 chunks long), merged into ``words`` while in cache;
    four Huffman chunks in a row are decoded side by side. Returns -1, or
    ``8 * chunk + error`` (1: a Huffman chunk, 1 + PAIRS_ERRORS key: a pairs chunk)."""
    s4 = np.empty(4, np.int64)
    e4 = np.empty(4, np.int64)
    n4 = np.empty(4, np.int64)
    o4 = np.empty(4, np.int64)
    used = np.empty(4, np.int64)
    c = c0
    while c < c1:
        if (c + 4 <= c1 and modes[c] == CHUNK_HUFFMAN and modes[c + 1] == CHUNK_HUFFMAN
                and modes[c + 2] == CHUNK_HUFFMAN and modes[c + 3] == CHUNK_HUFFMAN):
            for k in range(4):
                s4[k] = tbase + offsets[c + k]
                e4[k] = tbase + offsets[c + k + 1]
                n4[k] = min(n, (c + k + 1) * cs) - (c + k) * cs
                o4[k] = k * cs
            decode_top4(buf, s4, e4, n4, multi, single, tb, block, o4, used)
            for k in range(4):
                if used[k] < 0 or (used[k] + 7) // 8 != e4[k] - s4[k]:
                    return 8 * (c + k) + 1
                lo = (c + k) * cs
                _merge_chunk(buf, raw_base, lo, lo + n4[k], block[k * cs:], words, width)
            c += 4
            continue
        lo = c * cs
        hi = min(n, lo + cs)
        m = hi - lo
        s = tbase + offsets[c]
        e = tbase + offsets[c + 1]
        mode = modes[c]
        if mode == CHUNK_PAIRS:
            err = pairs_decode(buf, s, e, m, block, 0)
            if err:
                return 8 * c + 1 + err
        elif mode == CHUNK_HUFFMAN:
            u = decode_top(buf, s, e, m, multi, single, tb, block, 0)
            if u < 0 or (u + 7) // 8 != e - s:
                return 8 * c + 1
        elif mode == CHUNK_CONST:
            block[:m] = consts[c]
        else:                                   # raw: its size was checked with the table
            _copy(block, 0, buf, s, m)
        _merge_chunk(buf, raw_base, lo, hi, block, words, width)
        c += 1
    return -1
