"""The LC-Checkpoint quantizer: delta -> bucket symbols and centroids, chunk-parallel.

Pass 1 reads the floats once: each element's bucket key (``uint16``), per-chunk
bucket statistics (count, sum) and the norms of the state and of the delta. Promotion
then picks the kept buckets from the totals; pass 2 only maps keys to symbols. Symbol
histograms and the reconstruction error follow from the bucket statistics, with no
further pass over the floats. Works in the array's own float width: fp32 (9-bit sign+exponent keys) or fp64
(12-bit keys).
"""

import threading
from dataclasses import dataclass

import numpy as np

from ._pool import run_tasks
from .errors import NonFiniteError
from .kernels import buckets as bk
from .kernels import runs as rk

_LAYOUT = {np.dtype(np.float32): (np.uint32, np.uint32(23), 512),
           np.dtype(np.float64): (np.uint64, np.uint64(52), 4096)}


@dataclass
class Quantized:
    sym: np.ndarray            # uint8 [n]; a per-thread buffer, reused by the next call
    sym_hist: np.ndarray       # int64 [nchunks, 2**bits]
    centroids: np.ndarray      # [2**bits], zero-padded past ``kept``
    kept: int                  # buckets kept (K <= 2**bits - 1)
    key_counts: np.ndarray     # int64 [nkeys]: nonzero elements per bucket, before promotion
    residual_sq: float         # ||delta - centroids[sym]||^2 (fp64, from bucket sums)
    target_sq: float           # ||u||^2
    delta_sq: float            # ||delta||^2
    runs_hist: np.ndarray | None = None    # per-chunk runs-coder letter counts, if asked
    runs_extra: np.ndarray | None = None   # per-chunk raw extra bits of the runs coder

    @property
    def rel_error(self) -> float:
        """Relative L2 error ||u - reconstruction|| / ||u||.

        Measured on the quantized delta; the fp32 rounding of ``ref + centroid``
        (at most 2**-24 relative to the state) is not included.
        """
        if self.target_sq == 0:
            return 0.0 if self.residual_sq == 0 else float("inf")
        return float(np.sqrt(self.residual_sq / self.target_sq))


_workspace = threading.local()


def _buffer(name: str, n: int, dtype) -> np.ndarray:
    """A per-thread buffer of at least ``n`` elements, kept between calls.

    Reusing the memory of the keys and symbols saves the page faults of fresh 3-bytes-
    per-element allocations on every checkpoint. The symbols returned in
    :class:`Quantized` are only valid until the same thread quantizes again.
    """
    buf = getattr(_workspace, name, None)
    if buf is None or buf.size < n:
        buf = np.empty(n, dtype)
        setattr(_workspace, name, buf)
    return buf[:n]


def _scratch(dtype):
    f = np.empty(bk.BLOCK, dtype)
    return f, f.view(_LAYOUT[np.dtype(dtype)][0])


def quantize(u: np.ndarray, ref: np.ndarray | None, bits: int, chunk_size: int,
             midpoint: bool = False, runs_stats: bool = False) -> Quantized:
    """Quantize the delta ``u - ref`` (or ``u`` itself when ``ref`` is None).

    ``u`` and ``ref`` are flat, contiguous, of one float dtype (fp32 or fp64).
    ``runs_stats``: also collect the zero-run coder's letter counts while the symbols are
    written (what :func:`lcckpt.entropy.analyze` would otherwise read them back for).
    Raises :class:`NonFiniteError` if the delta holds NaN or Inf.
    """
    _, shift, nkeys = _LAYOUT[u.dtype]
    n = u.size
    nch = -(-n // chunk_size)
    keys = _buffer("keys", n, np.uint16)
    slots = nkeys + 1                                   # the last one counts zeros
    counts = np.zeros((nch, bk.LANES, slots), np.int64)
    sums = np.zeros((nch, bk.LANES, slots), np.float64)
    mins = np.full((nch, slots), np.inf) if midpoint else np.zeros((1, 1))
    maxs = np.full((nch, slots), -np.inf) if midpoint else np.zeros((1, 1))
    norms = np.zeros((nch, 2), np.float64)              # ||u||^2, ||delta||^2 per chunk
    use_ref = ref is not None
    r = ref if use_ref else u

    def pass1(c):
        sf, su = _scratch(u.dtype)
        lo, hi = c * chunk_size, min(n, (c + 1) * chunk_size)
        mm = c if midpoint else 0
        norms[c] = bk.key_histogram(u, r, use_ref, lo, hi, sf, su, shift, keys, counts[c],
                                    sums[c], mins[mm], maxs[mm], midpoint)
    run_tasks(pass1, nch)

    counts = counts.sum(axis=1)[:, :nkeys]
    total = counts.sum(axis=0)
    half = nkeys // 2
    bad = int(total[half - 1] + total[nkeys - 1])
    if bad:
        raise NonFiniteError(
            f"the delta holds {bad} NaN/Inf values, which no quantizer bucket can represent; "
            "check the state for divergence, or store this step as an exact keyframe")
    s_tot = sums.sum(axis=(0, 1))[:nkeys]
    if midpoint:
        lo_t = np.min(mins[:, :nkeys], axis=0, initial=np.inf)
        hi_t = np.max(maxs[:, :nkeys], axis=0, initial=-np.inf)
    else:
        lo_t = hi_t = np.zeros(nkeys)
    centroids = np.zeros(1 << bits, u.dtype)
    lut, kept = bk.promotion_table(total, s_tot, lo_t, hi_t, bits, midpoint, centroids)

    sym = _buffer("sym", n, np.uint8)
    S = 1 << bits
    rhist = np.zeros((nch, rk.RUN_CLASSES * S), np.int64) if runs_stats else None
    rextra = np.zeros(nch, np.int64) if runs_stats else None

    def pass2(c):
        lo, hi = c * chunk_size, min(n, (c + 1) * chunk_size)
        if runs_stats:
            rextra[c] = rk.map_symbols_runs(keys, lo, hi, lut, sym, S, rhist[c])
        else:
            bk.map_symbols(keys, lo, hi, lut, sym)
    run_tasks(pass2, nch)

    onehot = np.zeros((nkeys, 1 << bits), np.int64)
    onehot[np.arange(nkeys), lut[:nkeys]] = 1
    onehot[:, 0] = 0                                   # dropped buckets are counted below
    sym_hist = counts @ onehot
    chunk_len = np.minimum(chunk_size, n - np.arange(nch) * chunk_size)
    sym_hist[:, 0] = chunk_len - sym_hist[:, 1:].sum(axis=1)

    # sum over buckets of ||delta - c||^2 = sumsq - 2 c sum + count c^2, where the sums of
    # squares of all buckets add up to ||delta||^2 and c = 0 for dropped buckets
    c = centroids.astype(np.float64)[lut[:nkeys]]
    delta_sq = float(norms[:, 1].sum())
    residual = delta_sq - float(np.sum(2 * c * s_tot - total * c * c))
    return Quantized(sym, sym_hist, centroids, int(kept), total, max(residual, 0.0),
                     float(norms[:, 0].sum()), delta_sq, rhist, rextra)
