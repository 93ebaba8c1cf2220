"""Slow, obviously-correct numpy/Python references: the oracles the tests hold the codec to."""

import heapq
import math

import numpy as np


def quantize_ref(delta: np.ndarray, bits: int, midpoint: bool = False):
    """LC quantizer by the book: returns (symbols, centroids[2**bits], kept)."""
    delta = np.ascontiguousarray(delta).reshape(-1)
    if delta.dtype == np.float64:
        keys = (delta.view(np.uint64) >> np.uint64(52)).astype(np.int64)
        half = 2048
    else:
        delta = delta.astype(np.float32)
        keys = (delta.view(np.uint32) >> np.uint32(23)).astype(np.int64)
        half = 256
    nz = delta != 0
    buckets = {}
    for k in np.unique(keys[nz]):
        members = delta[nz & (keys == k)].astype(np.float64)
        buckets[int(k)] = members
    # rank: larger exponent, then more members, then positive (smaller key) first
    order = sorted(buckets, key=lambda k: (-(k % half), -buckets[k].size, k))
    kept = order[:(1 << bits) - 1]
    cent = np.zeros(1 << bits, delta.dtype)
    sym = np.zeros(delta.size, np.uint8)
    for s, k in enumerate(kept, start=1):
        m = buckets[k]
        cent[s] = (m.min() + m.max()) / 2 if midpoint else math.fsum(m) / m.size
        sym[nz & (keys == k)] = s
    return sym, cent, len(kept)


def huffman_cost(counts) -> int:
    """Total bits of an optimal (unlimited) Huffman code for ``counts``."""
    w = [int(c) for c in counts if c > 0]
    if len(w) <= 1:
        return sum(w)          # a lone symbol costs 1 bit each in our convention
    heapq.heapify(w)
    total = 0
    while len(w) > 1:
        a, b = heapq.heappop(w), heapq.heappop(w)
        total += a + b
        heapq.heappush(w, a + b)
    return total


def canonical_code_table(lengths):
    """(count per length, symbols in canonical order) as bitarray.canonical_decode wants."""
    maxlen = int(max(lengths)) if len(lengths) else 0
    count = [0] * (maxlen + 1)
    for ln in lengths:
        if ln:
            count[ln] += 1
    symbol = sorted((s for s in range(len(lengths)) if lengths[s]), key=lambda s: (lengths[s], s))
    return count, symbol
