"""Sub-bit symbol coders (ALGORITHM.md §5): grouped symbols and zero runs.

Both stay canonical Huffman; only the letters change.

* grouped: ``g`` consecutive ``b``-bit symbols form one letter (first symbol in the high
  bits, the last group zero-padded), so a letter can cost less than one bit per symbol.
* runs: the stream is cut after every nonzero symbol into (zero run, symbol) pairs. The
  run's length class ``c = bit_length(run)`` and the symbol form one letter
  ``c * S + s`` (``S = 2**b``), coded jointly as JPEG codes (run, size) pairs, followed
  by ``c - 1`` raw extra bits holding ``run - 2**(c-1)``. Trailing zeros end the chunk
  with the letter ``c * S + 0``, which only ever appears last.
"""

import numpy as np

from ...util.jit import kernel
from .bits import W, Z, flush, load64, lookup, put, reader_at, refill
from .buckets import LANES
from .huffman import MULTI_BITS, additive, decode_table

RUN_CLASSES = 26                  # runs up to 2**25 - 1: chunks are at most 2**24 long
_BIT_LENGTH = np.array([int(r).bit_length() for r in range(512)], np.int64)
_SCAN = 4096                      # block of the branch-free scans for nonzero symbols
_LANE_MASK = LANES - 1            # LANES is a power of two: no division per element
CMP_KEYS = 7                      # kept buckets up to which pass 2 compares instead of gathers
_OFFSET_MASK = np.uint32((1 << 24) - 1)  # a listed nonzero: offset in its chunk | symbol << 24


@kernel(inline="always")
def _bit_length(r):
    c = 0
    while r > 0:
        r >>= 1
        c += 1
    return c


@kernel(inline="always")
def _count_letter(hist, run, S, s):
    """Count the letter of ``run`` zeros then symbol ``s`` (0: the run that closes a
    chunk); returns its raw extra bits."""
    c = _BIT_LENGTH[run] if run < 512 else _bit_length(run)
    hist[c * S + s] += 1
    return c - 1 if c > 1 else 0


@kernel(inline="always")
def _list_nonzero(sb, base, pos, dense):
    """Write ``base + j`` for every nonzero ``sb[j]`` into ``pos``; return how many.

    Branch-free (store every position, advance past the nonzero ones only). Unless
    ``dense``, groups of 8 symbols that read as one zero 64-bit word are skipped: 1.3x
    faster where few symbols are nonzero, 1.6x slower where most words hold one, so
    callers pass ``dense`` when the previous block had more than one nonzero in 8.
    (Testing the OR of 8 words first to skip 64 symbols at once was 1.5x slower on a
    real delta with 1.7% nonzero symbols: a quarter of those blocks hold one.)
    """
    m = sb.size
    ng = m >> 3 if sb.itemsize == 1 and not dense else 0   # words need byte symbols
    words = sb[:8 * ng].view(np.uint64) if ng else np.zeros(0, np.uint64)
    k = 0
    for g in range(ng):
        if words[g] != 0:
            for j in range(8 * g, 8 * g + 8):
                pos[k] = base + j
                k += sb[j] != 0
    for j in range(8 * ng, m):
        pos[k] = base + j
        k += sb[j] != 0
    return k


# --- grouped ---------------------------------------------------------------------------

@kernel(inline="always")
def _letter(sym, i, stop, g, b):
    """The ``g`` symbols from ``i`` packed into one letter, first in the high bits;
    positions at or past ``stop`` count as zeros."""
    letter = 0
    for j in range(g):
        s = 0
        if i + j < stop:
            s = sym[i + j]
        letter = (letter << b) | s
    return letter


@kernel(inline="always")
def _whole_letter(sym, i, g, b):
    """:func:`_letter` of a group that lies wholly before the end: no test per symbol."""
    letter = 0
    for j in range(g):
        letter = (letter << b) | sym[i + j]
    return letter


@kernel
def grouped_histogram(sym, start, stop, g, b, hist):
    """Count the letters of ``g`` packed ``b``-bit symbols over ``sym[start:stop]``."""
    whole = start + (stop - start) // g * g
    for i in range(start, whole, g):
        hist[_whole_letter(sym, i, g, b)] += 1
    if whole < stop:
        hist[_letter(sym, whole, stop, g, b)] += 1


@kernel
def encode_grouped(sym, start, stop, g, b, codes, lengths, out, pos, cent, fout, apply):
    """``apply``: advance the reference as in :func:`lcckpt.codec.kernels.huffman.encode_symbols`."""
    acc = Z
    nb = Z
    p = pos
    cz = additive(cent)
    whole = start + (stop - start) // g * g
    for i in range(start, stop, g):
        if i < whole:
            letter = _whole_letter(sym, i, g, b)
            if apply:
                for j in range(g):
                    fout[i + j] += cz[sym[i + j]]
        else:
            letter = _letter(sym, i, stop, g, b)
            if apply:
                for j in range(stop - i):
                    fout[i + j] += cz[sym[i + j]]
        ln = np.uint64(lengths[letter])
        acc, nb, p = put(acc, nb, np.uint64(codes[letter]), ln, out, p)
    return flush(acc, nb, out, p)


@kernel(inline="always")
def _emit_letter(letter, i, n, g, b, out, out_start, cz, fout, apply):
    """Unpack one letter into symbols ``i..i+g-1`` (those below ``n``): stored, or with
    ``apply`` added as centroids into ``fout``."""
    mask = (1 << b) - 1
    if apply:
        for j in range(g):
            if i + j < n:
                fout[out_start + i + j] += cz[(letter >> (b * (g - 1 - j))) & mask]
    else:
        for j in range(g):
            if i + j < n:
                out[out_start + i + j] = (letter >> (b * (g - 1 - j))) & mask


_NO_MULTI = np.zeros(0, np.uint64)


def decode_grouped(buf, start, end, n, g, b, table, table_bits, out, out_start, cent, fout,
                   apply):
    """Decode ``n`` symbols; returns bits consumed or -1 on an invalid code.

    ``apply``: add centroids into ``fout`` instead of storing symbols (see
    :func:`lcckpt.codec.kernels.huffman.decode_symbols`). One table lookup per letter: for
    chunks too short to pay for a multi-letter table (:func:`decode_grouped_multi`). Not
    compiled itself: the empty table it passes has a real table's type, so one compiled
    form serves both (compiled, it passed a constant, whose type compiled a second form).
    """
    return decode_grouped_multi(buf, start, end, n, g, b, _NO_MULTI, table, table_bits, out,
                                out_start, cent, fout, apply)


@kernel
def decode_grouped_multi(buf, start, end, n, g, b, multi, table, table_bits, out, out_start,
                         cent, fout, apply):
    """:func:`decode_grouped` in two passes: the chunk's letters into a byte buffer with
    a multi-letter table (up to six 8-bit letters a lookup, see
    :func:`lcckpt.codec.kernels.huffman.multi_decode_table`; an empty ``multi``: one letter a
    lookup), then their symbols stored or added. The one-pass form, which added each
    letter's floats between lookups, was 1.4-1.9x slower on a dense 4-bit delta: the
    lookups are a chain of dependent loads, and the adds no longer wait on it.
    """
    nletters = (n + g - 1) // g
    letters = np.empty(nletters + 8, np.uint8)          # 8-byte stores: room for the last
    consumed = _grouped_letters(buf, start, end, nletters, multi, table, table_bits, letters)
    if consumed < 0:
        return -1
    mask = (1 << b) - 1
    full = n // g
    o = out_start
    if apply:
        cz = additive(cent)
        lt = _letter_adds(cz, g, b)
        if g == 2:
            for k in range(full):
                r = 2 * np.int64(letters[k])
                fout[o + 2 * k] += lt[r]
                fout[o + 2 * k + 1] += lt[r + 1]
        elif g == 4:                                    # 2-bit symbols
            for k in range(full):
                r = 4 * np.int64(letters[k])
                fout[o + 4 * k] += lt[r]
                fout[o + 4 * k + 1] += lt[r + 1]
                fout[o + 4 * k + 2] += lt[r + 2]
                fout[o + 4 * k + 3] += lt[r + 3]
        else:
            for k in range(full):
                r = g * np.int64(letters[k])
                for j in range(g):
                    fout[o + g * k + j] += lt[r + j]
    else:
        for k in range(full):
            letter = np.int64(letters[k])
            for j in range(g):
                out[o + g * k + j] = (letter >> (b * (g - 1 - j))) & mask
    if full < nletters:                                 # the last, partial letter
        _emit_letter(np.int64(letters[full]), full * g, n, g, b, out, out_start,
                     additive(cent) if apply else cent, fout, apply)
    return consumed


@kernel(inline="always")
def _grouped_letters(buf, start, end, nletters, multi, table, table_bits, letters):
    """Decode ``nletters`` 8-bit letters into ``letters`` (which has 8 bytes of room
    past them); returns the bits consumed, -1 on an invalid code. With a ``multi`` table,
    away from the end, every lookup loads its window straight from the bit position (no
    reader state) and stores all six letter bytes of the entry at once; the rest goes
    letter by letter."""
    li = 0
    bp = np.uint64(8 * start)
    if multi.size and end - start >= 8:
        last = np.uint64(end - 8) << np.uint64(3)
        while li + 8 <= nletters and bp <= last:
            win = load64(buf, bp >> np.uint64(3)) << (bp & np.uint64(7))
            e = multi[win >> np.uint64(64 - MULTI_BITS)]
            cnt = np.int64((e >> np.uint64(4)) & np.uint64(15))
            if cnt == 0:                  # codes are at most MULTI_BITS long: invalid
                return -1
            x = e >> np.uint64(8)         # LLVM merges the eight stores into one
            for k in range(8):
                letters[li + k] = np.uint8((x >> np.uint64(8 * k)) & np.uint64(0xFF))
            li += cnt
            bp += e & np.uint64(15)
    acc, nb, p = reader_at(buf, bp, end)  # the rest with the careful reader
    consumed = np.int64(bp) - 8 * start
    tb = np.uint64(table_bits)
    tmask = (np.uint64(1) << tb) - np.uint64(1)
    while li < nletters:
        if nb < tb:
            acc, nb, p = refill(acc, nb, buf, p, end)
        letter, ln = lookup(table, acc, nb, tb, tmask)
        if ln == Z:
            return -1
        nb -= ln
        consumed += np.int64(ln)
        letters[li] = letter
        li += 1
    return consumed


@kernel(inline="always")
def _letter_adds(cz, g, b):
    """Row ``l`` (flat, ``g`` wide): what each of the ``g`` symbols packed in letter ``l`` adds (``cz`` of
    :func:`~lcckpt.codec.kernels.huffman.additive`, so zeros add -0.0); the decoder adds a row
    per letter instead of unpacking it symbol by symbol. The very same adds, bit for bit."""
    mask = (1 << b) - 1
    lt = np.empty((1 << (b * g)) * g, cz.dtype)
    for letter in range(1 << (b * g)):
        for j in range(g):
            lt[letter * g + j] = cz[(letter >> (b * (g - 1 - j))) & mask]
    return lt


# --- zero runs -------------------------------------------------------------------------

@kernel
def runs_histogram(sym, start, stop, S, hist):
    """Count (run class, symbol) letters; return the number of raw extra bits."""
    extra = 0
    run = 0
    for i in range(start, stop):
        s = sym[i]
        if s == 0:
            run += 1
        else:
            extra += _count_letter(hist, run, S, s)
            run = 0
    if run > 0:
        extra += _count_letter(hist, run, S, 0)
    return extra


@kernel
def runs_histogram_dense(sym, start, stop, S, hist, counts):
    """:func:`runs_histogram` of a chunk that is mostly nonzero, from its symbol counts
    ``counts``: every nonzero symbol is first counted as a letter with no zeros before
    it, then each run of zeros, found by a scan, moves the letter of the symbol that
    closes it. The work is per zero, not per symbol, and the scan's branch is taken
    rarely (a per-symbol branch on zero mispredicts on a mixed chunk). Same counts."""
    for s in range(1, S):
        hist[s] += counts[s]
    extra = 0
    i = start
    while i < stop:
        while i < stop and sym[i] != 0:
            i += 1
        if i == stop:
            break
        k = i + 1
        while k < stop and sym[k] == 0:
            k += 1
        if k < stop:
            s = sym[k]
            hist[s] -= 1
            extra += _count_letter(hist, k - i, S, s)
            i = k + 1
        else:
            extra += _count_letter(hist, k - i, S, 0)
            i = k
    return extra


@kernel
def encode_runs(sym, start, stop, S, codes, lengths, out, pos, cent, fout, apply):
    """One code word (plus extra bits) per nonzero symbol, and one for the trailing zeros.

    The nonzero positions are listed per block (:func:`_list_nonzero`); ``apply``
    advances the reference as in huffman.encode_symbols. The code word and its extra bits are two puts: a put holds
    at most 32 bits, and 31 + 24 bits fit where 31 + 36 would not.
    """
    acc = Z
    nb = Z
    p = pos
    last = start - 1                  # the previous nonzero's position
    nzpos = np.empty(_SCAN, np.int64)
    k = 0
    i = start
    while i <= stop:
        if i < stop:
            m = min(_SCAN, stop - i)
            k = _list_nonzero(sym[i:i + m], i, nzpos, k > m >> 3)
            i += m
        else:                         # the end: the trailing zeros, if any
            i += 1
            if stop - last - 1 == 0:
                break
            nzpos[0] = stop
            k = 1
        for t in range(k):
            q = nzpos[t]
            run = q - last - 1
            last = q
            s = 0
            if q < stop:
                s = sym[q]
                if apply:
                    fout[q] += cent[s]
            c = _BIT_LENGTH[run] if run < 512 else _bit_length(run)
            letter = c * S + s
            ln = np.uint64(lengths[letter])
            acc, nb, p = put(acc, nb, np.uint64(codes[letter]), ln, out, p)
            if c > 1:
                xb = np.uint64(c - 1)
                acc, nb, p = put(acc, nb, np.uint64(run - (1 << (c - 1))), xb, out, p)
    return flush(acc, nb, out, p)


@kernel
def encode_runs_listed(sym, start, stop, nz, S, codes, lengths, out, pos, cent, fout, apply):
    """:func:`encode_runs` from the list of nonzero symbols the quantizer made while it
    wrote them (``nz``: for every ``i`` in ``[start, stop)`` with ``sym[i] != 0``,
    ascending, ``(i - start) | sym[i] << 24``; see :func:`map_symbols_sums`).

    The same bits: the zeros between listed positions are the runs. Sparse symbols
    then cost one visit per nonzero, not a scan of the whole chunk, and the list
    carries the symbols, so ``sym`` (long out of cache by now) is not read at all.
    """
    acc = Z
    nb = Z
    p = pos
    last = start - 1                  # the previous nonzero's position
    for t in range(nz.size + 1):
        if t < nz.size:
            e = nz[t]
            q = start + np.int64(e & _OFFSET_MASK)
            s = np.int64(e >> np.uint32(24))
            if apply:
                fout[q] += cent[s]
        else:                         # the end: the trailing zeros, if any
            q = stop
            s = 0
            if stop - last - 1 == 0:
                break
        run = q - last - 1
        last = q
        c = _BIT_LENGTH[run] if run < 512 else _bit_length(run)
        letter = c * S + s
        ln = np.uint64(lengths[letter])
        code = np.uint64(codes[letter])
        xb = np.uint64(c - 1) if c > 1 else Z
        if ln + xb <= W:              # the code word and its extra bits in one put
            x = np.uint64(run - (1 << (c - 1))) if c > 1 else Z
            acc, nb, p = put(acc, nb, (code << xb) | x, ln + xb, out, p)
        else:
            acc, nb, p = put(acc, nb, code, ln, out, p)
            acc, nb, p = put(acc, nb, np.uint64(run - (1 << (c - 1))), xb, out, p)
    return flush(acc, nb, out, p)


RUNS_WINDOW = 12
RUNS_ITEMS = 3
RUNS_BURST = 4                    # multi lookups per refill test: 4 x 12 bits, and a refill
                                  # leaves at least 57
_ITEM_BITS = 16
_USED_MASK = np.uint64(31)
_COUNT_SHIFT = np.uint64(5)
_ITEMS_AT = 8


@kernel
def runs_decode_table(lengths, S):
    """Multi-item table for the runs stream: each 12-bit window maps to up to three whole
    (code word, extra bits) items with runs below 256 and nonzero symbols.

    Entry: ``consumed | count << 5 | (run_k | sym_k << 8) << (8 + 16 k)``; count 0 sends
    the decoder to its one-letter path (long runs, the closing letter, items that do not
    fit the window, invalid codes). Items hold 8-bit symbols: with 4-bit items, a
    quantizer's 5-8-bit symbols above 15 went to the one-letter path. (A 13-bit window,
    64 KB, decoded slower than this one, which stays in L1.)
    """
    single = decode_table(lengths, np.int64(RUNS_WINDOW))
    mask = (1 << RUNS_WINDOW) - 1
    sbits = _bit_length(S) - 1
    table = np.zeros(1 << RUNS_WINDOW, np.uint64)
    for w in range(1 << RUNS_WINDOW):
        pos = 0
        cnt = 0
        entry = np.uint64(0)
        while cnt < RUNS_ITEMS:
            e = single[(w << pos) & mask]
            ln = np.int64(e & np.uint32(15))
            if ln == 0:
                break
            letter = np.int64(e >> np.uint32(4))
            c = letter >> sbits
            s = letter & (S - 1)
            xb = c - 1 if c > 1 else 0
            if s == 0 or s > 255 or c > 8 or pos + ln + xb > RUNS_WINDOW:
                break
            run = c                                   # 0 or 1
            if c > 1:
                extra = (w >> (RUNS_WINDOW - pos - ln - xb)) & ((1 << xb) - 1)
                run = (1 << (c - 1)) + extra
            entry |= np.uint64(run | (s << 8)) << np.uint64(_ITEMS_AT + _ITEM_BITS * cnt)
            pos += ln + xb
            cnt += 1
        table[w] = entry | np.uint64(pos) | (np.uint64(cnt) << _COUNT_SHIFT)
    return table


@kernel(inline="always")
def _count(e):
    return np.int64((e >> _COUNT_SHIFT) & np.uint64(3))


@kernel(inline="always")
def _add_items(e, cz, fout, at):
    """Add multi-table entry ``e``'s items from ``fout[at]``; returns the offset after
    them. A fixed count, so no branch: an empty item adds ``-0.0`` at the offset reached
    and moves nothing."""
    cnt = _count(e)
    for k in range(RUNS_ITEMS):
        item = np.int64(e >> np.uint64(_ITEMS_AT + _ITEM_BITS * k))
        run = item & 255
        fout[at + run] += cz[(item >> 8) & 255]
        at += run + 1 if k < cnt else 0
    return at


@kernel(inline="always")
def _put_items(e, out, at):
    """Write multi-table entry ``e``'s items as symbols from ``out[at]``; the offset after."""
    for k in range(_count(e)):
        item = np.int64(e >> np.uint64(_ITEMS_AT + _ITEM_BITS * k))
        run = item & 255
        for q in range(run):
            out[at + q] = 0
        out[at + run] = (item >> 8) & 255
        at += run + 1
    return at


@kernel
def decode_runs(buf, start, end, n, S, table, table_bits, out, out_start, cent, fout, apply,
                multi):
    """Decode ``n`` symbols; returns bits consumed or -1 on any inconsistency.

    ``apply``: add centroids into ``fout`` instead of storing symbols; zero runs are
    then skipped without touching memory, so the cost follows the nonzero count.
    ``multi`` (from :func:`runs_decode_table`, or an empty array) decodes up to three
    short-run items per lookup; adding, up to RUNS_BURST lookups follow each other
    without a test for the bits left (both together 1.13-1.33x faster than 4-bit items
    and one lookup per test on a fine-tune's runs chunks: benchmarks/runs_decode.py).
    """
    acc = Z
    nb = Z
    tb = np.uint64(table_bits)
    tmask = (np.uint64(1) << tb) - np.uint64(1)
    mw = np.uint64(RUNS_WINDOW)
    mmask = (np.uint64(1) << mw) - np.uint64(1)
    use_multi = multi.size > 0
    cz = additive(cent)
    p = start
    consumed = Z
    pos = 0
    sbits = _bit_length(S) - 1
    smask = S - 1
    burst_bits = np.uint64(RUNS_BURST * RUNS_WINDOW)
    while pos < n:
        if nb < np.uint64(40):            # a code word and up to 24 extra bits
            acc, nb, p = refill(acc, nb, buf, p, end)
        # every item of a lookup surely ends inside the chunk: up to 3 x 256 symbols
        if use_multi and apply and nb >= burst_bits and n - pos > RUNS_BURST * 3 * 256:
            hit = False
            for _ in range(RUNS_BURST):
                e = multi[(acc >> (nb - mw)) & mmask]
                if _count(e) == 0:
                    break
                hit = True
                pos = _add_items(e, cz, fout, out_start + pos) - out_start
                used = e & _USED_MASK
                nb -= used
                consumed += used
            if hit:
                continue
        elif use_multi and n - pos > 3 * 256:
            e = multi[(acc >> (nb - mw)) & mmask]
            if _count(e) > 0:
                if apply:
                    pos = _add_items(e, cz, fout, out_start + pos) - out_start
                else:
                    pos = _put_items(e, out, out_start + pos) - out_start
                used = e & _USED_MASK
                nb -= used
                consumed += used
                continue
        letter, ln = lookup(table, acc, nb, tb, tmask)
        if ln == Z:
            return -1
        nb -= ln
        consumed += ln
        c = letter >> sbits                  # S is a power of two: no division
        s = letter & smask
        run = 0
        if c == 1:
            run = 1
        elif c > 1:
            xb = np.uint64(c - 1)
            run = (1 << (c - 1)) + np.int64((acc >> (nb - xb)) & ((np.uint64(1) << xb) - np.uint64(1)))
            nb -= xb
            consumed += xb
        if run > n - pos:
            return -1
        if not apply:
            zeros = out[out_start + pos:out_start + pos + run]    # from 0: a memset
            for k in range(run):
                zeros[k] = 0
        pos += run
        if s != 0:
            if pos >= n:
                return -1
            if apply:
                fout[out_start + pos] += cent[s]
            else:
                out[out_start + pos] = s
            pos += 1
        elif pos != n:
            return -1
    return np.int64(consumed)


@kernel
def map_symbols_runs(keys, start, stop, lut, sym, S, hist, nz):
    """The quantizer's pass 2 (``sym = lut[keys]``) fused with :func:`runs_histogram`.

    Per block: map the keys, list the nonzero positions branch-free (store every
    position, advance only past nonzeros), then count one letter per listed position
    from the gap to the previous one. About 1.3x faster than the branch per element of
    :func:`runs_histogram` on dense symbols, where that branch is unpredictable. The
    nonzero symbols are listed in ``nz`` too, as ``(i - start) | sym[i] << 24`` (chunks
    are at most ``2**24`` long; ``nz`` must have room for every nonzero symbol of the
    range, or be empty to list none), for :func:`encode_runs_listed`.
    """
    extra = 0
    last = start - 1                  # the previous nonzero's position
    pos = np.empty(_SCAN, np.int64)
    keep = nz.size > 0
    nk = 0
    i = start
    while i < stop:
        m = min(_SCAN, stop - i)
        kb, sb = keys[i:i + m], sym[i:i + m]      # views from 0: tighter loops
        for j in range(m):
            sb[j] = lut[kb[j]]
        k = 0
        for j in range(m):
            pos[k] = i + j
            k += sb[j] != 0
        if keep:
            for t in range(k):
                nz[nk + t] = np.uint32(pos[t] - start) | np.uint32(sym[pos[t]]) << np.uint32(24)
            nk += k
        for t in range(k):
            p = pos[t]
            run = p - last - 1
            last = p
            extra += _count_letter(hist, run, S, sym[p])
        i += m
    run = stop - last - 1
    if run > 0:
        extra += _count_letter(hist, run, S, 0)
    return extra


@kernel
def map_symbols_sums(keys, u, ref, use_ref, start, stop, lut, kept_keys, sym, S, runs, hist,
                     sums, nz, write):
    """The quantizer's pass 2 after :func:`lcckpt.codec.kernels.buckets.key_counts`.

    ``sym = lut[keys]``; for every nonzero symbol (a kept bucket) its delta (``u - ref``
    or ``u``, the same fp32 rounding as pass 1) is added to ``sums[lane, key]`` with the
    lane :func:`~lcckpt.codec.kernels.buckets.key_histogram` gives that element (element ``i``
    of the range in lane ``(i - start) % LANES``, the last incomplete group in lane 0), in
    element order: the kept buckets' sums come out bit for bit as that kernel makes them.
    With ``runs`` the runs coder's letters are counted as in :func:`map_symbols_runs`
    (returns the extra bits; 0 without).

    ``kept_keys``: the keys ``lut`` maps to a nonzero symbol. Up to ``CMP_KEYS`` of them
    the symbols are built by one vectorized compare pass per kept key instead of a table
    gather per element (5x faster at 2 bits). The nonzero positions are listed by
    :func:`_list_nonzero`, which skips all-zero groups of 8 symbols, and kept in ``nz``
    as in :func:`map_symbols_runs`. Unless ``write``, the symbols go to a block of the
    kernel's own and ``sym`` is not touched: the list in ``nz`` is then all that holds
    them (:func:`fill_listed` writes them out), which saves writing a byte per element
    that a sparse stream's runs coder never reads.
    """
    cmp = kept_keys.size <= CMP_KEYS
    keep = nz.size > 0
    nk = 0
    tail = start + ((stop - start) & ~_LANE_MASK)
    extra = 0
    last = start - 1
    pos = np.empty(_SCAN, np.int64)
    own = np.empty(_SCAN, np.uint8)
    k = 0
    i = start
    while i < stop:
        m = min(_SCAN, stop - i)
        kb = keys[i:i + m]
        sb = sym[i:i + m] if write else own[:m]
        if cmp and kept_keys.size:        # the first compare pass also clears
            kk = kept_keys[0]
            sv = lut[kk]
            for j in range(m):
                sb[j] = sv if kb[j] == kk else np.uint8(0)
            for t in range(1, kept_keys.size):
                kk = kept_keys[t]
                sv = lut[kk]
                for j in range(m):
                    sb[j] |= sv if kb[j] == kk else np.uint8(0)
        elif cmp:
            for j in range(m):
                sb[j] = 0
        else:
            for j in range(m):
                sb[j] = lut[kb[j]]
        k = _list_nonzero(sb, 0, pos, k > m >> 3)
        if keep:
            for t in range(k):
                nz[nk + t] = np.uint32(i + pos[t] - start) | np.uint32(sb[pos[t]]) << np.uint32(24)
            nk += k
        for t in range(k):
            j = pos[t]
            p = i + j
            lane = (p - start) & _LANE_MASK if p < tail else 0
            if use_ref:
                d = u[p] - ref[p]
            else:
                d = u[p]
            sums[lane, kb[j]] += np.float64(d)
            if runs:
                run = p - last - 1
                last = p
                extra += _count_letter(hist, run, S, sb[j])
        i += m
    if runs:
        run = stop - last - 1
        if run > 0:
            extra += _count_letter(hist, run, S, 0)
    return extra


@kernel
def fill_listed(sym, start, stop, nz):
    """Write ``sym[start:stop]`` from its list of nonzero symbols ``nz`` (as
    :func:`map_symbols_sums` makes it): zeros, then each listed symbol in its place."""
    sb = sym[start:stop]
    for j in range(sb.size):
        sb[j] = 0
    for t in range(nz.size):
        e = nz[t]
        sb[np.int64(e & _OFFSET_MASK)] = np.uint8(e >> np.uint32(24))
