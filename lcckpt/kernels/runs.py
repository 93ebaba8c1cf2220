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
from numba import njit

from .huffman import flush_bits, peek, put_bits, refill

RUN_CLASSES = 26                  # runs up to 2**25 - 1: chunks are at most 2**24 long


@njit(cache=True, nogil=True, inline="always")
def _bit_length(r):
    c = 0
    while r > 0:
        r >>= 1
        c += 1
    return c


# --- grouped ---------------------------------------------------------------------------

@njit(cache=True, nogil=True)
def grouped_histogram(sym, start, stop, g, b, hist):
    """Count the letters of ``g`` packed ``b``-bit symbols over ``sym[start:stop]``."""
    for i in range(start, stop, g):
        letter = 0
        for j in range(g):
            s = 0
            if i + j < stop:
                s = sym[i + j]
            letter = (letter << b) | s
        hist[letter] += 1


@njit(cache=True, nogil=True)
def encode_grouped(sym, start, stop, g, b, codes, lengths, out, pos):
    acc = np.uint64(0)
    nb = 0
    p = pos
    for i in range(start, stop, g):
        letter = 0
        for j in range(g):
            s = 0
            if i + j < stop:
                s = sym[i + j]
            letter = (letter << b) | s
        acc, nb, p = put_bits(acc, nb, codes[letter], lengths[letter], out, p)
    return flush_bits(acc, nb, out, p)


@njit(cache=True, nogil=True)
def decode_grouped(buf, start, end, n, g, b, table, table_bits, out, out_start):
    """Decode ``n`` symbols; returns bits consumed or -1 on an invalid code."""
    acc = np.uint64(0)
    nb = 0
    p = start
    consumed = 0
    mask = (1 << b) - 1
    for i in range(0, n, g):
        if nb < table_bits:
            acc, nb, p = refill(acc, nb, buf, p, end)
        e = table[peek(acc, nb, table_bits)]
        ln = e & 15
        if ln == 0:
            return -1
        letter = e >> 4
        nb -= ln
        consumed += ln
        for j in range(g):
            if i + j < n:
                out[out_start + i + j] = (letter >> (b * (g - 1 - j))) & mask
    return consumed


# --- zero runs -------------------------------------------------------------------------

@njit(cache=True, nogil=True)
def runs_histogram(sym, start, stop, S, hist):
    """Count (run class, symbol) letters; return the number of raw extra bits."""
    extra = 0
    run = 0
    for i in range(start, stop):
        s = sym[i]
        if s == 0:
            run += 1
        else:
            c = _bit_length(run)
            hist[c * S + s] += 1
            if c > 1:
                extra += c - 1
            run = 0
    if run > 0:
        c = _bit_length(run)
        hist[c * S] += 1
        if c > 1:
            extra += c - 1
    return extra


@njit(cache=True, nogil=True)
def encode_runs(sym, start, stop, S, codes, lengths, out, pos):
    acc = np.uint64(0)
    nb = 0
    p = pos
    run = 0
    for i in range(start, stop):
        s = sym[i]
        if s == 0:
            run += 1
            continue
        c = _bit_length(run)
        letter = c * S + s
        acc, nb, p = put_bits(acc, nb, codes[letter], lengths[letter], out, p)
        if c > 1:
            acc, nb, p = put_bits(acc, nb, run - (1 << (c - 1)), c - 1, out, p)
        run = 0
    if run > 0:
        c = _bit_length(run)
        acc, nb, p = put_bits(acc, nb, codes[c * S], lengths[c * S], out, p)
        if c > 1:
            acc, nb, p = put_bits(acc, nb, run - (1 << (c - 1)), c - 1, out, p)
    return flush_bits(acc, nb, out, p)


@njit(cache=True, nogil=True)
def decode_runs(buf, start, end, n, S, table, table_bits, out, out_start):
    """Decode ``n`` symbols; returns bits consumed or -1 on any inconsistency."""
    acc = np.uint64(0)
    nb = 0
    p = start
    consumed = 0
    pos = 0
    while pos < n:
        if nb < 40:
            acc, nb, p = refill(acc, nb, buf, p, end)
        e = table[peek(acc, nb, table_bits)]
        ln = e & 15
        if ln == 0:
            return -1
        letter = e >> 4
        nb -= ln
        consumed += ln
        c = letter // S
        s = letter - c * S
        run = 0
        if c == 1:
            run = 1
        elif c > 1:
            run = (1 << (c - 1)) + np.int64(peek(acc, nb, c - 1))
            nb -= c - 1
            consumed += c - 1
        if run > n - pos:
            return -1
        for k in range(run):
            out[out_start + pos + k] = 0
        pos += run
        if s != 0:
            if pos >= n:
                return -1
            out[out_start + pos] = s
            pos += 1
        elif pos != n:
            return -1
    return consumed
