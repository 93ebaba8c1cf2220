"""The entropy coder's plan, compiled (``lcckpt.codec.entropy._plan``): each mode's code,
each chunk's bytes in each mode.

Every stream is planned, and a small tensor's stream is one chunk: in numpy the plan was
a dozen calls on arrays of a few dozen entries, a third of the entropy coder's time on a
4,096-element delta. These loops give the same integers (counts, bits and bytes are exact
sums, in any order), so the choice, and the blob, do not change.
"""

import numpy as np

from ...util.jit import kernel
from .huffman import code_lengths


@kernel
def code_for(hist, old, max_len, slack):
    """``(fresh code lengths of hist's letters, whether old stays)``: ``hist`` is a mode's
    per-chunk letter counts; ``old`` (a cached code, or empty) stays while it codes every
    letter used at most ``slack`` times the fresh code's bits."""
    nch, a = hist.shape
    counts = np.zeros(a, np.int64)
    for c in range(nch):
        for j in range(a):
            counts[j] += hist[c, j]
    fresh = code_lengths(counts, max_len)
    if old.size != a:
        return fresh, False
    old_bits = 0
    fresh_bits = 0
    for j in range(a):
        if counts[j] > 0 and old[j] == 0:
            return fresh, False
        old_bits += counts[j] * np.int64(old[j])
        fresh_bits += counts[j] * np.int64(fresh[j])
    return fresh, old_bits <= slack * fresh_bits


@kernel
def coded_bytes(hist, lengths, extra, out):
    """A coded mode's chunks: bytes of each (its letters' code lengths, plus ``extra[c]``
    raw bits where ``extra`` is not empty) into ``out``; returns the bits of them all."""
    nch, a = hist.shape
    total = 0
    for c in range(nch):
        bits = 0
        for j in range(a):
            bits += np.int64(hist[c, j]) * np.int64(lengths[j])
        if extra.size:
            bits += extra[c]
        out[c] = (bits + 7) // 8
        total += bits
    return total


@kernel
def const_bytes(sym_hist, n, chunk_size, not_const, out):
    """The const mode's chunks: 0 bytes where one symbol fills the chunk, else
    ``not_const``, into ``out``."""
    nch, a = sym_hist.shape
    for c in range(nch):
        size = min(chunk_size, n - c * chunk_size)
        out[c] = not_const
        for j in range(a):
            if sym_hist[c, j] == size:
                out[c] = 0
                break
