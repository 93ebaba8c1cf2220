"""The LC-Checkpoint quantizer: delta -> bucket symbols and centroids, chunk-parallel.

Two passes over the data (histogram, then symbol assignment), each fanned out over
chunks; nothing but the ``uint8`` symbols is materialized. Works in the array's own
float width: fp32 (9-bit sign+exponent keys) or fp64 (12-bit keys).
"""

from dataclasses import dataclass

import numpy as np

from ._pool import run_tasks
from .errors import NonFiniteError
from .kernels import buckets as bk

_LAYOUT = {np.dtype(np.float32): (np.uint32, 23, 512), np.dtype(np.float64): (np.uint64, 52, 4096)}


@dataclass
class Quantized:
    sym: np.ndarray            # uint8 [n]
    sym_hist: np.ndarray       # int64 [nchunks, 2**bits]
    centroids: np.ndarray      # [2**bits], zero-padded past ``kept``
    kept: int                  # buckets kept (K <= 2**bits - 1)
    key_counts: np.ndarray     # int64 [nkeys]: nonzero elements per bucket, before promotion
    residual_sq: float         # ||u - reconstruction||^2
    target_sq: float           # ||u||^2
    delta_sq: float            # ||delta||^2

    @property
    def rel_error(self) -> float:
        """Relative L2 error of the reconstruction against the target state."""
        if self.target_sq == 0:
            return 0.0 if self.residual_sq == 0 else float("inf")
        return float(np.sqrt(self.residual_sq / self.target_sq))


def _scratch(dtype):
    f = np.empty(bk.BLOCK, dtype)
    return f, f.view(_LAYOUT[np.dtype(dtype)][0])


def key_histograms(u, ref, chunk_size, midpoint=False):
    """Per-chunk bucket counts and fp64 sums (and min/max for the midpoint rule)."""
    _, shift, nkeys = _LAYOUT[u.dtype]
    n = u.size
    nch = -(-n // chunk_size)
    counts = np.zeros((nch, nkeys), np.int64)
    sums = np.zeros((nch, nkeys), np.float64)
    mins = np.full((nch, nkeys), np.inf) if midpoint else np.zeros((1, 1))
    maxs = np.full((nch, nkeys), -np.inf) if midpoint else np.zeros((1, 1))
    use_ref = ref is not None
    r = ref if use_ref else u

    def task(c):
        sf, su = _scratch(u.dtype)
        lo, hi = c * chunk_size, min(n, (c + 1) * chunk_size)
        mm = c if midpoint else 0
        bk.key_histogram(u, r, use_ref, lo, hi, sf, su, shift, counts[c], sums[c],
                         mins[mm], maxs[mm], midpoint)
    run_tasks(task, nch)
    counts_t = counts.sum(axis=0)
    sums_t = sums.sum(axis=0)
    if midpoint:
        return (counts_t, sums_t, np.min(mins, axis=0, initial=np.inf),
                np.max(maxs, axis=0, initial=-np.inf))
    return counts_t, sums_t, np.zeros(nkeys), np.zeros(nkeys)


def quantize(u: np.ndarray, ref: np.ndarray | None, bits: int, chunk_size: int,
             midpoint: bool = False) -> Quantized:
    """Quantize the delta ``u - ref`` (or ``u`` itself when ``ref`` is None).

    ``u`` and ``ref`` are flat, contiguous, of one float dtype (fp32 or fp64).
    Raises :class:`NonFiniteError` if the delta holds NaN or Inf.
    """
    _, shift, nkeys = _LAYOUT[u.dtype]
    n = u.size
    nch = -(-n // chunk_size)
    counts, sums, mins, maxs = key_histograms(u, ref, chunk_size, midpoint)
    half = nkeys // 2
    bad = int(counts[half - 1] + counts[nkeys - 1])
    if bad:
        raise NonFiniteError(
            f"the delta holds {bad} NaN/Inf values, which no quantizer bucket can represent; "
            "check the state for divergence, or store this step as an exact keyframe")
    centroids = np.zeros(1 << bits, u.dtype)
    lut, kept = bk.promotion_table(counts, sums, mins, maxs, bits, midpoint, centroids)
    sym = np.empty(n, np.uint8)
    sym_hist = np.zeros((nch, 1 << bits), np.int64)
    err = np.zeros((nch, 3), np.float64)
    use_ref = ref is not None
    r = ref if use_ref else u

    def task(c):
        sf, su = _scratch(u.dtype)
        lo, hi = c * chunk_size, min(n, (c + 1) * chunk_size)
        bk.assign_symbols(u, r, use_ref, lo, hi, sf, su, shift, lut, centroids,
                          sym, sym_hist[c], err[c])
    run_tasks(task, nch)
    e = err.sum(axis=0)
    return Quantized(sym, sym_hist, centroids, int(kept), counts, float(e[0]), float(e[1]),
                     float(e[2]))


def reconstruct(sym, centroids, out, chunk_size, accumulate):
    """``out = centroids[sym]`` (or ``out += ...``), chunk-parallel; the decoder's kernel."""
    n = sym.size
    nch = -(-n // chunk_size)

    def task(c):
        lo, hi = c * chunk_size, min(n, (c + 1) * chunk_size)
        bk.apply_symbols(sym, lo, hi, centroids, out, accumulate)
    run_tasks(task, nch)
