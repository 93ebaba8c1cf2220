"""The uniform quantizer's error model: from a magnitude histogram of a delta (the
survey, :func:`lcckpt.codec.survey.survey`), the restored error and the symbol counts
of any step, without quantizing (docs/algorithm.md §7b; compiled in
:mod:`lcckpt.codec.kernels.model`)."""

from functools import lru_cache

import numpy as np

from .kernels import model as mk
from .kernels import uniform as uk

STEER_RANGE = 2.0   # a steered restore step stays within this factor of the least-squares one


@lru_cache(maxsize=None)
def bin_bounds() -> np.ndarray:
    """The magnitude bins' edges as floats (``MAG_BINS + 1``, read-only; computed once:
    a small tensor's delta would otherwise spend a fifth of its survey on them)."""
    edges = (np.arange(uk.MAG_BINS + 1, dtype=np.uint64) << np.uint64(17)).astype(np.uint32)
    with np.errstate(invalid="ignore"):
        bounds = edges.view(np.float32).astype(np.float64)
    bounds[~np.isfinite(bounds)] = np.inf       # inf and NaN bit patterns: the top
    bounds.flags.writeable = False
    return bounds


def _wide_err(up: float) -> float:
    """The squared error per element, in units of step², of a bin wider than a level: it
    holds every rounding offset, so the mean over a uniform offset under the dead zone,
    ∫ min(f, 1-f past 1-up)² = (1-up)³/3 + up³/3."""
    return float(((1 - up) ** 3 + up ** 3) / 3)


class ErrorModel:
    """The restored error and level counts of any step, from the magnitude histogram of
    the delta that :func:`survey` takes.

    Within a bin that one level covers, the error ``sum (|d| - q·step)²`` is exact from
    the bin's count and sums; a bin that straddles a rounding boundary (a few per level
    with 64 bins per octave) is taken at its mean. So the step search costs one pass to
    build the model and one to quantize, instead of two passes per tried step."""

    def __init__(self, n: int, cnt: np.ndarray, s1: np.ndarray, s2: np.ndarray,
                 span: tuple = (0, -1)):
        """From a :class:`Survey`'s histogram of ``n`` elements (bins ``[:MAG_BINS]``);
        ``span``: the bins it counted into, first and last (default: all)."""
        self.n = n
        self.cnt, self.s1, self.s2, self.lo, self.hi, self.mean = mk.compact(
            cnt, s1, s2, bin_bounds(), *span)
        self.direction = None       # per bin: sums of m·sign(d) and of m·d (steer)

    def steer(self, a: np.ndarray, b: np.ndarray, cnt: np.ndarray) -> None:
        """Restore levels so that the error is orthogonal to a direction ``m``:
        ``a``/``b``, per bin of the survey's histogram ``cnt``, the sums of ``m·sign(d)``
        and of ``m·d`` (:func:`lcckpt.codec.kernels.uniform.direction_range`)."""
        nz = np.flatnonzero(cnt[:uk.MAG_BINS])
        self.direction = (a[nz], b[nz])

    def total_sq(self) -> float:
        """``||d||²``, the whole delta's square (exact: every bin's sum of squares)."""
        return float(self.s2.sum())

    def levels(self, step: float, up: float) -> np.ndarray:
        """Level magnitude per bin (straddling bins at their mean)."""
        q = np.empty(self.lo.size)
        mk.bin_levels(self.lo, self.hi, self.mean, float(step), float(up), q)
        return q

    def recon_step(self, step: float, up: float) -> float:
        """The step to restore levels decided with ``step``. Without a direction, the
        least-squares one, ``sum q·|d| / sum q²``: rounding with a dead zone drops the
        small changes, which mostly point the way training moves, so plain ``q·step``
        leaves the restored model behind; the fitted step makes the error orthogonal to
        what was sent, lowering the error (a coarser decision step meets the target:
        fewer bits). With a direction ``m`` (:meth:`steer`; a weight's first moment, the
        way training moves), the step that makes the error orthogonal to ``m``,
        ``sum m·d / sum m·q``: the loss of the restored model then has no first-order
        term along it (docs/algorithm.md §7b). That step is kept within
        :data:`STEER_RANGE` of the least-squares one (where ``m`` is nearly orthogonal
        to the levels, it would swing far for little); the error it leaves is measured
        on the reconstruction like any other. Levels past 127 (escapes at any width)
        are left out of both sums."""
        return self._steps(step, up)[1]

    def _steps(self, step: float, up: float) -> tuple[float, float, float]:
        """``(least-squares step, the step recon_step takes, sum q²)``."""
        q = self.levels(step, up)
        qq = float(np.sum(self.cnt * q * q))
        ls = r = float(np.sum(q * self.s1)) / qq if qq > 0 else step
        if self.direction is not None and qq > 0:
            a, b = self.direction
            sent = q <= 127
            mq = float(np.sum((q * a)[sent]))
            if mq != 0:
                rm = float(np.sum(b[sent])) / mq
                if r / STEER_RANGE < rm < r * STEER_RANGE:
                    r = rm
        return ls, r, qq

    def steered_excess_sq(self, step: float, up: float) -> float:
        """What steering adds to the modelled error² of ``step``: ``(r − r_ls)²·Σq²``
        (the error is least at the least-squares step and grows as a parabola away from
        it; :meth:`errors_sq` models the least-squares step)."""
        ls, r, qq = self._steps(step, up)
        return (r - ls) ** 2 * qq

    def errors_sq(self, steps: np.ndarray, up: float) -> np.ndarray:
        """Modelled ``||u - ũ||²`` for each decision step of ``steps``, its levels
        restored with their least-squares step (:meth:`recon_step`)."""
        st = np.ascontiguousarray(steps, np.float64).reshape(-1)
        out = np.empty(st.size)
        mk.errors_sq(self.lo, self.hi, self.mean, self.cnt, self.s1, self.s2, st, float(up),
                     _wide_err(up), out)
        return out

    def error_sq(self, step: float, up: float) -> float:
        """:meth:`errors_sq` of one step."""
        return float(self.errors_sq(np.array([step]), up)[0])

    def symbol_histogram(self, step: float, up: float) -> np.ndarray:
        """Zigzag symbol counts (``[257]``, the last bin all beyond 255), each nonzero
        level split evenly between its two signs: enough to choose the symbol width.
        Compiled (:func:`lcckpt.codec.kernels.model.symbol_histogram`)."""
        h = np.zeros(257)
        # a NaN level comes only from a non-finite delta, which is refused before this
        if not mk.symbol_histogram(self.lo, self.hi, self.mean, self.cnt, self.n, float(step),
                                   float(up), h):
            raise ValueError(f"no symbol counts at step {step}: the model's levels are "
                             "not numbers >= 0")
        return h

    def step_for(self, tol_sq: float, up: float, start: float) -> float:
        """About the largest step whose modelled error stays within ``tol_sq``: a grid
        of steps around ``start`` (factors of √2, widened while the answer is at its
        edge), then two finer grids inside the bracket found, each evaluated in one
        vectorized call (within about 0.5%)."""
        top = 2 * float(np.max(self.mean)) if self.cnt.size else start  # all levels 0 past it
        if top <= 0 or self.error_sq(top, up) <= tol_sq:
            return min(start, top) if top > 0 else start
        lo_exp = -16                                     # in half-octaves from ``start``
        args = (self.lo, self.hi, self.mean, self.cnt, self.s1, self.s2)
        f, err = _wide_err(up), np.empty(25)
        for _ in range(20):
            grid = np.minimum(start * 2.0 ** (np.arange(lo_exp, lo_exp + 25) / 2), top)
            last = mk.last_within(*args, grid, float(up), f, float(tol_sq), err)
            if not err[0] <= tol_sq:
                lo_exp -= 24                             # even the finest misses: go finer
            elif last == grid.size - 1 and grid[-1] < top:
                lo_exp += 24                             # even the coarsest meets it: coarser
            else:
                break
        else:
            return float(grid[0])
        return float(mk.refine(*args, grid, last, float(up), f, float(tol_sq)))
