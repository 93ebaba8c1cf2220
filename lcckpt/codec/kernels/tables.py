"""Parsing a stream's chunk table: one entry per chunk, read from untrusted bytes.

A 20M-element tensor has hundreds of chunks and a restore reads every file of a chain,
so this loop is compiled rather than run byte by byte in Python. Every read is checked
against ``end``; errors come back as codes (see :data:`ERRORS`) that the caller turns
into exceptions naming the chunk.
"""

import numpy as np
from numba import njit

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


@njit(cache=True, nogil=True)
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
