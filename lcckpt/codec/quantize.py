"""The LC-Checkpoint quantizer: delta -> bucket symbols and centroids, chunk-parallel.

Pass 1 reads the floats once: each element's bucket key (``uint16``), per-chunk
bucket counts and the norms of the state and of the delta. Promotion then picks the
kept buckets from the counts; pass 2 maps keys to symbols and sums the deltas of the
kept buckets only (for their centroids), reading the floats again just where a symbol
is nonzero. With ``midpoint`` pass 1 collects every bucket's sum, min and max instead. Symbol
histograms and the reconstruction error follow from the bucket statistics, with no
further pass over the floats. Works in the array's own float width: fp32 (9-bit sign+exponent keys) or fp64
(12-bit keys).
"""

import threading
from dataclasses import dataclass

import numpy as np

from ..util.pool import run_tasks
from ..errors import NonFiniteError
from .kernels import buckets as bk
from .kernels import runs as rk

_LAYOUT = {np.dtype(np.float32): (np.uint32, np.uint32(23), 512),
           np.dtype(np.float64): (np.uint64, np.uint64(52), 4096)}


@dataclass
class Quantized:
    sym_buf: np.ndarray        # uint8 [n]; a per-thread buffer, reused by the next call
    sym_hist: np.ndarray       # int64 [nchunks, 2**bits]
    centroids: np.ndarray      # [2**bits], zero-padded past ``kept``
    kept: int                  # buckets kept (K <= 2**bits - 1)
    key_counts: np.ndarray     # int64 [nkeys]: nonzero elements per bucket, before promotion
    residual_sq: float         # ||delta - centroids[sym]||^2 (fp64, from bucket sums)
    target_sq: float           # ||u||^2
    delta_sq: float            # ||delta||^2
    runs_hist: np.ndarray | None = None    # per-chunk runs-coder letter counts, if asked
    runs_extra: np.ndarray | None = None   # per-chunk raw extra bits of the runs coder
    nonzero: tuple | None = None   # (uint32 offset in the chunk | symbol << 24, int64 starts
                                   # [nchunks + 1]): the nonzero symbols, if listed (quantize)
    chunk_size: int = 0
    written: bool = True       # False: only ``nonzero`` holds the symbols so far

    @property
    def sym(self) -> np.ndarray:
        """The symbols (``uint8 [n]``), written out from the nonzero list on first use
        where pass 2 left them there (:meth:`symbols`)."""
        if not self.written:
            nz, starts = self.nonzero
            cs, n = self.chunk_size, self.sym_buf.size
            run_tasks(lambda c: rk.fill_listed(self.sym_buf, c * cs, min(n, (c + 1) * cs),
                                               nz[starts[c]:starts[c + 1]]), starts.size - 1)
            self.written = True
        return self.sym_buf

    def symbols(self):
        """``sym``, or while only the nonzero list holds them a callable that writes
        them out (what :func:`lcckpt.codec.entropy.analyze` and :func:`~lcckpt.codec.entropy.encode`
        take, calling it only if a chunk's mode needs every symbol)."""
        return self.sym_buf if self.written else (lambda: self.sym)

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


SPLIT_SHARE = 0.08      # past this share of nonzero symbols, split=False is faster
LIST_SHARE = 0.125      # up to this share of nonzero symbols, pass 2 keeps their positions


def quantize(u: np.ndarray, ref: np.ndarray | None, bits: int, chunk_size: int,
             midpoint: bool = False, runs_stats: bool = False, split: bool = True) -> Quantized:
    """Quantize the delta ``u - ref`` (or ``u`` itself when ``ref`` is None).

    ``u`` and ``ref`` are flat, contiguous, of one float dtype (fp32 or fp64).
    ``runs_stats``: also collect the zero-run coder's letter counts while the symbols are
    written (what :func:`lcckpt.codec.entropy.analyze` would otherwise read them back for),
    and, while at most :data:`LIST_SHARE` of the symbols are nonzero, keep the nonzero
    symbols pass 2 lists anyway, with their positions (``Quantized.nonzero``): the runs
    coder then visits them instead of scanning every symbol again, and the symbol array
    itself is only written out if something reads ``Quantized.sym``.
    ``split``: pass 1 only counts, and the sums come after, from the counts' verdict:
    for the kept buckets alone at their nonzero symbols (a random access each) while at
    most :data:`SPLIT_SHARE` of the symbols are nonzero, else for every bucket in a
    streaming pass. ``split=False`` sums every bucket in pass 1, the fastest layout when
    many symbols are known to be nonzero. The output is the same bit for bit.
    Raises :class:`NonFiniteError` if the delta holds NaN or Inf.
    """
    _, shift, nkeys = _LAYOUT[u.dtype]
    n = u.size
    nch = -(-n // chunk_size)
    keys = _buffer("keys", n, np.uint16)
    full = midpoint or not split
    use_ref = ref is not None
    r = ref if use_ref else u
    counts, sums, mins, maxs, norms = _pass1(u, r, use_ref, keys, chunk_size, full, midpoint)

    counts = counts.sum(axis=1, dtype=np.int64)[:, :nkeys]
    total = counts.sum(axis=0)
    _refuse_non_finite(total, nkeys)
    lo_t, hi_t = _bucket_bounds(mins, maxs, nkeys, midpoint)
    centroids = np.zeros(1 << bits, u.dtype)
    # which buckets are kept follows from the counts alone; without the midpoint the
    # centroids are computed again below, once pass 2 has summed the kept buckets
    pre = sums.sum(axis=(0, 1))[:nkeys]          # zeros here unless full
    lut, kept = bk.promotion_table(total, pre, lo_t, hi_t, bits, midpoint, centroids)

    sym = _buffer("sym", n, np.uint8)
    S = 1 << bits
    rhist = np.zeros((nch, rk.RUN_CLASSES * S), np.int64) if runs_stats else None
    rextra = np.zeros(nch, np.int64) if runs_stats else None
    no_hist = np.zeros(1, np.int64)
    kept_keys = np.flatnonzero(lut).astype(keys.dtype)
    # counted now: if many symbols will be nonzero, sum every bucket in a streaming pass
    # (cheaper than a random access per nonzero symbol), then map as the full layout does
    nonzero = float(total[kept_keys].sum())
    late = not full and nonzero > SPLIT_SHARE * n
    listed = _nonzero_list(counts, kept_keys, nch) if runs_stats and nonzero <= LIST_SHARE * n \
        else None
    no_pos = np.zeros(0, np.uint32)
    # the sparse layout leaves the symbols in the list alone until someone reads them
    write = listed is None or full or late

    def pass2(c):
        lo, hi = c * chunk_size, min(n, (c + 1) * chunk_size)
        nz = listed[0][listed[1][c]:listed[1][c + 1]] if listed is not None else no_pos
        if late:
            bk.key_sums(u, r, use_ref, lo, hi, keys, sums[c])
        if not (full or late):
            e = rk.map_symbols_sums(keys, u, r, use_ref, lo, hi, lut, kept_keys, sym, S,
                                    runs_stats, rhist[c] if runs_stats else no_hist, sums[c],
                                    nz, write)
            if runs_stats:
                rextra[c] = e
        elif runs_stats:
            rextra[c] = rk.map_symbols_runs(keys, lo, hi, lut, sym, S, rhist[c], nz)
        else:
            bk.map_symbols(keys, lo, hi, lut, sym)
    run_tasks(pass2, nch)
    s_tot = sums.sum(axis=(0, 1))[:nkeys]
    if not full:                         # the same table again, now with the centroids
        bk.promotion_table(total, s_tot, lo_t, hi_t, bits, False, centroids)

    sym_hist = _symbol_histogram(counts, lut, nkeys, bits, chunk_size, n)
    delta_sq = float(norms[:, 1].sum())
    residual = _residual(centroids, lut, nkeys, s_tot, total, delta_sq)
    return Quantized(sym, sym_hist, centroids, int(kept), total, max(residual, 0.0),
                     float(norms[:, 0].sum()), delta_sq, rhist, rextra, listed, chunk_size,
                     write)


def _bucket_bounds(mins, maxs, nkeys: int, midpoint: bool):
    """Each bucket's least and greatest delta (the midpoint centroid's), else zeros."""
    if not midpoint:
        return np.zeros(nkeys), np.zeros(nkeys)
    return (np.min(mins[:, :nkeys], axis=0, initial=np.inf),
            np.max(maxs[:, :nkeys], axis=0, initial=-np.inf))


def _nonzero_list(counts, kept_keys, nch: int):
    """(buffer, per-chunk offsets) for the positions of the nonzero symbols pass 2 lists."""
    nz_off = np.zeros(nch + 1, np.int64)
    np.cumsum(counts[:, kept_keys].sum(axis=1), out=nz_off[1:])
    return _buffer("nonzero", int(nz_off[-1]), np.uint32), nz_off


def _pass1(u, r, use_ref: bool, keys, chunk_size: int, full: bool, midpoint: bool):
    """Pass 1 of :func:`quantize`, chunk by chunk on the pool: every element's bucket key
    into ``keys``, and per chunk the keys' counts, ``||u||^2`` and ``||delta||^2``; with
    ``full`` also each bucket's sum (and, for the midpoint, its min and max).
    Returns ``(counts, sums, mins, maxs, norms)``."""
    _, shift, nkeys = _LAYOUT[u.dtype]
    n = u.size
    nch = -(-n // chunk_size)
    slots = nkeys + 1                                   # the last one counts zeros
    counts = (np.zeros((nch, bk.LANES, slots), np.int64) if full else
              np.zeros((nch, bk.COUNT_LANES, slots), np.uint32))   # chunks < 2**32 elements
    sums = np.zeros((nch, bk.LANES, slots), np.float64)
    mins = np.full((nch, slots), np.inf) if midpoint else np.zeros((1, 1))
    maxs = np.full((nch, slots), -np.inf) if midpoint else np.zeros((1, 1))
    norms = np.zeros((nch, 2), np.float64)              # ||u||^2, ||delta||^2 per chunk
    ub = u.view(_LAYOUT[u.dtype][0])

    def task(c):
        sf, su = _scratch(u.dtype)
        lo, hi = c * chunk_size, min(n, (c + 1) * chunk_size)
        if full:
            mm = c if midpoint else 0
            norms[c] = bk.key_histogram(u, ub, r, use_ref, lo, hi, sf, su, shift, keys,
                                        counts[c], sums[c], mins[mm], maxs[mm], midpoint)
        else:                            # the sums come in pass 2, for kept buckets only
            norms[c] = bk.key_counts(u, ub, r, use_ref, lo, hi, sf, su, shift, keys, counts[c])
    run_tasks(task, nch)
    return counts, sums, mins, maxs, norms


def _refuse_non_finite(total: np.ndarray, nkeys: int) -> None:
    """The NaN/Inf keys (the top key of each sign half) must be empty."""
    half = nkeys // 2
    bad = int(total[half - 1] + total[nkeys - 1])
    if bad:
        raise NonFiniteError(
            f"the delta holds {bad} NaN/Inf values, which no quantizer bucket can represent; "
            "check the state for divergence, or store this step as an exact keyframe")


def _symbol_histogram(counts, lut, nkeys: int, bits: int, chunk_size: int, n: int):
    """Per chunk, how many elements got each symbol: the kept buckets' counts, and the
    rest of the chunk as symbol 0."""
    nch = counts.shape[0]
    onehot = np.zeros((nkeys, 1 << bits), np.int64)
    onehot[np.arange(nkeys), lut[:nkeys]] = 1
    onehot[:, 0] = 0                                   # dropped buckets are counted below
    sym_hist = counts @ onehot
    chunk_len = np.minimum(chunk_size, n - np.arange(nch) * chunk_size)
    sym_hist[:, 0] = chunk_len - sym_hist[:, 1:].sum(axis=1)
    return sym_hist


def _residual(centroids, lut, nkeys: int, s_tot, total, delta_sq: float) -> float:
    """||delta - restored||^2 from the bucket sums: over buckets, sumsq - 2 c sum +
    count c^2, where the sums of squares of all buckets add up to ||delta||^2 and c = 0
    for dropped buckets."""
    c = centroids.astype(np.float64)[lut[:nkeys]]
    return delta_sq - float(np.sum(2 * c * s_tot - total * c * c))
