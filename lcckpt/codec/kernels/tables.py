"""Parsing a stream's chunk table: one entry per chunk, read from untrusted bytes.

A 20M-element tensor has hundreds of chunks and a restore reads every file of a chain,
so this loop is compiled rather than run byte by byte in Python. Every read is checked
against ``end``; errors come back as codes (see :data:`ERRORS`) that the caller turns
into exceptions naming the chunk.
"""

import numpy as np

from ...util.jit import kernel

OK, TRUNCATED, NOT_ALLOWED, NO_TABLE, CONST_WIDE, BAD_SIZE, RAW_SIZE = range(7)
ERRORS = {
    TRUNCATED: "the chunk table is truncated",
    NOT_ALLOWED: "has a mode not allowed here",
    NO_TABLE: "uses a mode with no code table",
    CONST_WIDE: "has a constant wider than the symbols",
    BAD_SIZE: "has a size past the end of the data",
    RAW_SIZE: "is raw with the wrong size",
}
MODE_OK, MODE_NO_TABLE = 1, 2        # values of ``mode_state``; 0: not allowed


@kernel
def read_chunk_table(buf, pos, end, nchunks, n, chunk_size, b, mode_state, const_mode,
                     raw_mode, size_limit, modes, consts, nbytes):
    """Fill ``modes``/``consts``/``nbytes`` from ``buf[pos:end]``.

    Entry: a mode byte, then the constant (one byte) for ``const_mode`` or the chunk's
    byte size as an unsigned LEB128 varint. The sizes must add up to at most
    ``size_limit``, so every offset derived from them is in bounds.
    Returns ``(pos after the table, error code, chunk at fault)``.
    """
    total = 0
    for c in range(nchunks):
        if pos >= end:
            return pos, TRUNCATED, c
        m = buf[pos]
        pos += 1
        state = mode_state[m] if m < mode_state.size else 0
        if state == 0:
            return pos, NOT_ALLOWED, c
        if state == MODE_NO_TABLE:
            return pos, NO_TABLE, c
        modes[c] = m
        if m == const_mode:
            if pos >= end:
                return pos, TRUNCATED, c
            v = buf[pos]
            pos += 1
            if v >> b:
                return pos, CONST_WIDE, c
            consts[c] = v
            continue
        v = 0
        shift = 0
        while True:
            if pos >= end:
                return pos, TRUNCATED, c
            byte = np.int64(buf[pos])
            pos += 1
            if shift > 35:                # sizes beyond 2**42 bytes: no real chunk
                return pos, BAD_SIZE, c
            v |= (byte & 0x7F) << shift
            if not byte & 0x80:
                break
            shift += 7
        total += v
        if total > size_limit:
            return pos, BAD_SIZE, c
        nbytes[c] = v
        if m == raw_mode and v != min(chunk_size, n - c * chunk_size):
            return pos, RAW_SIZE, c
    return pos, OK, nchunks


# --- code-length tables (streams._write_lengths' three layouts) ------------------------
L_OK, L_TRUNCATED, L_PADDING, L_BITMAP, L_ZERO_USED, L_COUNT, L_GAP, L_LETTER, L_VARINT, \
    L_KIND, L_INVALID, L_KRAFT = range(12)


@kernel(inline="always")
def _uvar_len(v):
    """Bytes of ``v >= 0`` as an unsigned LEB128 varint (at most 5: values below 2**35)."""
    n = 1
    for bound in (1 << 7, 1 << 14, 1 << 21, 1 << 28):
        if v >= bound:
            n += 1
    return n


@kernel
def layout_sizes(lengths):
    """Bytes of a code table in each of its three layouts, the kind byte aside: a nibble
    per letter; a bitmap of the letters used, then their nibbles; their count, then a
    (gap, length) pair per letter used. A save sizes two tables per small tensor, and in
    numpy this was an eighth of a delta save of hundreds of small tensors."""
    n = lengths.size
    used = 0
    gaps = 0
    prev = -1
    for s in range(n):
        if lengths[s] != 0:
            gaps += _uvar_len(s - prev - 1)
            used += 1
            prev = s
    return (n + 1) // 2, (n + 7) // 8 + (used + 1) // 2, _uvar_len(used) + gaps + used


@kernel(inline="always")
def uvar(buf, pos, end, limit):
    """(value, pos, error) of an unsigned LEB128 varint at most ``limit``: L_TRUNCATED,
    L_VARINT (over 64 bits) or L_COUNT (past ``limit``; the value -1 where it is 2**63
    or more)."""
    v = 0
    shift = 0
    big = False                       # bit 63 or above set: past any limit
    while True:
        if pos >= end:
            return 0, pos, L_TRUNCATED
        b = np.int64(buf[pos])
        pos += 1
        if shift == 63:
            big = big or (b & 0x7F) != 0
        else:
            v |= (b & 0x7F) << shift
        if not b & 0x80:
            break
        shift += 7
        if shift > 63:
            return 0, pos, L_VARINT
    if big or v > limit:
        return (-1 if big else v), pos, L_COUNT
    return v, pos, L_OK


@kernel
def read_lengths(buf, pos, end, size, max_len):
    """Code lengths of an alphabet of ``size`` letters from ``buf[pos:end]``: a kind byte,
    then 0: a nibble per letter (high nibble first, zero padding); 1: a bitmap of the
    letters used (MSB first), then their nibbles; 2: a count, then (gap, length) per
    letter. Returns ``(lengths, pos after, error code, detail)``; the lengths must be at
    most ``max_len``, not all zero, and not over-subscribed (Kraft)."""
    lengths = np.zeros(size, np.uint8)
    if pos >= end:
        return lengths, pos, L_TRUNCATED, 0
    kind = buf[pos]
    pos += 1
    if kind == 0 or kind == 1:
        if kind == 1:
            nb = (size + 7) // 8
            if pos + nb > end:
                return lengths, pos, L_TRUNCATED, 0
            used = 0
            for i in range(8 * nb):
                if (buf[pos + (i >> 3)] >> (7 - (i & 7))) & 1:
                    if i >= size:
                        return lengths, pos, L_BITMAP, 0
                    lengths[i] = 1           # marked; the nibbles follow
                    used += 1
            pos += nb
        else:
            used = size
        nn = (used + 1) // 2
        if pos + nn > end:
            return lengths, pos, L_TRUNCATED, 0
        k = 0
        for i in range(size):
            if kind == 1 and lengths[i] == 0:
                continue
            b = buf[pos + (k >> 1)]
            v = (b >> 4) if k & 1 == 0 else (b & 15)
            if kind == 1 and v == 0:
                return lengths, pos, L_ZERO_USED, 0
            lengths[i] = v
            k += 1
        if used & 1 and buf[pos + nn - 1] & 15:
            return lengths, pos, L_PADDING, 0
        pos += nn
    elif kind == 2:
        m, pos, err = uvar(buf, pos, end, size)
        if err != L_OK:
            return lengths, pos, err, m
        s = -1
        for _ in range(m):
            g, pos, err = uvar(buf, pos, end, size)
            if err != L_OK:
                return lengths, pos, (L_GAP if err == L_COUNT else err), g
            s += g + 1
            if s >= size:
                return lengths, pos, L_LETTER, s
            if pos >= end:
                return lengths, pos, L_TRUNCATED, 0
            lengths[s] = buf[pos]
            pos += 1
    else:
        return lengths, pos, L_KIND, kind
    kraft = 0
    top = 0
    for i in range(size):
        v = np.int64(lengths[i])
        if v > top:
            top = v
        if v > 0 and v <= max_len:
            kraft += np.int64(1) << (max_len - v)
    if top > max_len or top == 0:
        return lengths, pos, L_INVALID, 0
    if kraft > np.int64(1) << max_len:
        return lengths, pos, L_KRAFT, 0
    return lengths, pos, L_OK, 0


@kernel
def escapes_valid(idx, n, val):
    """Whether a uniform blob's escapes are strictly increasing indices below ``n`` with
    finite values."""
    prev = -1
    for i in range(idx.size):
        x = np.int64(idx[i])                 # uint32 or uint64 (below 2**63: checked here)
        if x <= prev or x >= n:
            return False
        prev = x
    for i in range(val.size):
        if not np.isfinite(val[i]):
            return False
    return True
