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


def read_lengths_ref(data: bytes, size: int, max_len: int):
    """Code lengths of a table written by ``streams._write_lengths``, parsed with numpy
    and plain Python (the compiled parser's oracle): ``(lengths, bytes used)``, or the
    exception class ("truncated" or "corrupt")."""
    pos = 0

    def take(n):
        nonlocal pos
        if pos + n > len(data):
            raise EOFError
        pos += n
        return np.frombuffer(data[pos - n:pos], np.uint8)

    def uvar(limit):
        v, shift = 0, 0
        while True:
            b = int(take(1)[0])
            v |= (b & 0x7F) << shift
            if not b & 0x80:
                break
            shift += 7
            if shift > 63:
                raise ValueError
        if v > limit:
            raise ValueError
        return v

    def unnibble(packed, n):
        out = np.empty(2 * packed.size, np.uint8)
        out[0::2], out[1::2] = packed >> 4, packed & 15
        if np.any(out[n:]):
            raise ValueError
        return out[:n].copy()
    try:
        kind = int(take(1)[0])
        if kind == 0:
            lengths = unnibble(take((size + 1) // 2), size)
        elif kind == 1:
            bitmap = np.unpackbits(take((size + 7) // 8))
            if np.any(bitmap[size:]):
                raise ValueError
            used = np.flatnonzero(bitmap[:size])
            lengths = np.zeros(size, np.uint8)
            lengths[used] = unnibble(take((used.size + 1) // 2), used.size)
            if not np.all(lengths[used]):
                raise ValueError
        elif kind == 2:
            m, s = uvar(size), -1
            lengths = np.zeros(size, np.uint8)
            for _ in range(m):
                s += uvar(size) + 1
                if s >= size:
                    raise ValueError
                lengths[s] = take(1)[0]
        else:
            raise ValueError
        if lengths.max(initial=0) > max_len or not lengths.any():
            raise ValueError
        if sum(1 << (max_len - int(v)) for v in lengths if v) > 1 << max_len:
            raise ValueError
    except EOFError:
        return "truncated"
    except ValueError:
        return "corrupt"
    return lengths, pos


def model_errors_ref(model, steps, up: float) -> np.ndarray:
    """The uniform quantizer's modelled error of each step in numpy expressions (the
    compiled ``kernels.model.errors_sq`` must give these bits exactly)."""
    st = np.asarray(steps, np.float64).reshape(-1, 1)
    q_lo, q_hi, q = model_levels_ref(model, st, up, edges=True)
    qs1 = (q * model.s1).sum(axis=1, keepdims=True)
    qq = (model.cnt * q * q).sum(axis=1, keepdims=True)
    r = np.where(qq > 0, qs1 / np.where(qq > 0, qq, 1), st)
    e = model.s2 - 2 * q * r * model.s1 + model.cnt * (q * r) ** 2
    f = ((1 - up) ** 3 + up ** 3) / 3
    e = np.where(q_hi - q_lo >= 2, model.cnt * f * st * st, e)
    return e.sum(axis=1)


def error_model_ref(cnt, s1, s2):
    """An error model's per-bin arrays from a survey's histogram in numpy (what
    ``ErrorModel.__init__`` computed before one compiled call did): the nonzero bins among
    the first ``MAG_BINS``, as (count, sum, sum of squares, lower edge, upper edge, mean)."""
    from lcckpt.codec.errmodel import bin_bounds
    from lcckpt.codec.kernels.uniform import MAG_BINS
    c = cnt[:MAG_BINS]
    keep = np.flatnonzero(c)
    cf = c[keep].astype(np.float64)
    bounds = bin_bounds()
    return cf, s1[keep], s2[keep], bounds[keep], bounds[keep + 1], s1[keep] / cf


def step_for_ref(model, tol_sq: float, up: float, start: float) -> float:
    """``ErrorModel.step_for`` as numpy code (before its grids were searched in compiled
    calls): the model's ``errors_sq``, numpy's ``linspace`` and ``flatnonzero``."""
    top = 2 * float(np.max(model.mean)) if model.cnt.size else start
    if top <= 0 or model.error_sq(top, up) <= tol_sq:
        return min(start, top) if top > 0 else start
    lo_exp = -16
    for _ in range(20):
        grid = np.minimum(start * 2.0 ** (np.arange(lo_exp, lo_exp + 25) / 2), top)
        ok = model.errors_sq(grid, up) <= tol_sq
        if not ok[0]:
            lo_exp -= 24
        elif ok[-1] and grid[-1] < top:
            lo_exp += 24
        else:
            break
    else:
        return float(grid[0])
    for _ in range(2):
        i = int(np.flatnonzero(ok)[-1])
        if i == grid.size - 1:
            return float(grid[i])
        grid = np.linspace(grid[i], grid[i + 1], 9)
        ok = model.errors_sq(grid, up) <= tol_sq
    return float(grid[int(np.flatnonzero(ok)[-1])])


def model_levels_ref(model, step, up: float, edges: bool = False):
    """Each magnitude bin's level at ``step`` (a column of steps: a row each)."""
    q_lo = np.floor(model.lo / step + up)
    q_hi = np.floor(np.minimum(model.hi, 1e300) / step + up)
    q = np.where(q_lo == q_hi, q_lo, np.floor(model.mean / step + up))
    return (q_lo, q_hi, q) if edges else q


def choose_ref(score: np.ndarray, coded: list, table: dict) -> np.ndarray:
    """The per-chunk mode choice in numpy (what ``entropy._choose`` computed before it
    was compiled): every subset of the ``coded`` rows, per column the cheapest allowed
    row, plus ``table[row]`` once per row used; the first cheapest subset wins."""
    cols = np.arange(score.shape[1])
    best, best_choice = np.inf, None
    for subset in range(1 << len(coded)):
        masked = score.copy()
        for k, i in enumerate(coded):
            if not subset >> k & 1:
                masked[i] = np.inf
        choice = np.argmin(masked, axis=0)
        total = masked[choice, cols].sum() + sum(table.get(i, 0) for i in np.unique(choice))
        if total < best:
            best, best_choice = total, choice
    return np.argmin(score, axis=0) if best_choice is None else best_choice
