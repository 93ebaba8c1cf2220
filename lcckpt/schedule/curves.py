"""Loss-curve fitting without scipy: how fast is the job still making progress?

The scheduler needs the progress rate ``rho(k) = -dL/dk`` of a smooth curve
``L(k)`` fitted to noisy (iteration, loss) pairs. Three families are fitted by
variable projection (for a fixed nonlinear parameter the rest is a weighted
linear least-squares problem, so only a 1-D search remains):

* ``exponential``: ``a * exp(-b k) + c``
* ``optimus``:     ``1 / (beta0 k + beta1) + beta2``  (fitted as ``a / (k + s) + c``)
* ``power``:       ``a * (k + 1) ** -p + c``

Recent points weigh more (the future looks more like the recent past), and
positive losses are fitted by relative error (minibatch noise scales with the
loss, and a plateau at 0.1 matters as much as the drop from 2). The family
is chosen on a held-out tail (the last 20% of the points), then refitted on all of
them. If no family beats a monotone (isotonic) fit on the tail, the isotonic fit
is used. This module does not decide how much progress is worth; see
:mod:`lcckpt.schedule.weights`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from ..errors import InvalidArgumentError

FAMILIES = ("exponential", "optimus", "power")
MIN_POINTS = 16
_HOLDOUT = 0.2
_GRID = 48


@dataclass(frozen=True)
class FittedCurve:
    """A fitted loss curve ``L(k)`` over absolute iterations k."""

    family: str
    params: dict = field(default_factory=dict)
    n_points: int = 0
    rmse: float = math.nan
    holdout_rmse: float = math.nan

    def __call__(self, k) -> np.ndarray:
        k = np.asarray(k, dtype=np.float64)
        p = self.params
        if self.family == "exponential":
            return p["a"] * np.exp(-p["b"] * k) + p["c"]
        if self.family == "optimus":
            return p["a"] / (k + p["s"]) + p["c"]
        if self.family == "power":
            return p["a"] * (k + 1.0) ** (-p["p"]) + p["c"]
        if self.family == "coci_exp":
            return np.exp(p["theta1"] * k + p["theta2"])
        if self.family == "isotonic":
            x, y = np.asarray(p["x"]), np.asarray(p["y"])
            out = np.interp(k, x, y)
            beyond = k > x[-1]
            return np.where(beyond, y[-1] - p["tail_rate"] * (k - x[-1]), out)
        raise InvalidArgumentError(f"unknown curve family {self.family!r}")

    def rate(self, k) -> np.ndarray:
        """Progress rate ``-dL/dk`` (loss per iteration), never negative."""
        k = np.asarray(k, dtype=np.float64)
        p = self.params
        if self.family == "exponential":
            r = p["a"] * p["b"] * np.exp(-p["b"] * k)
        elif self.family == "optimus":
            r = p["a"] / (k + p["s"]) ** 2
        elif self.family == "power":
            r = p["a"] * p["p"] * (k + 1.0) ** (-p["p"] - 1.0)
        elif self.family == "coci_exp":
            r = -p["theta1"] * np.exp(p["theta1"] * k + p["theta2"])
        elif self.family == "isotonic":
            x, y = np.asarray(p["x"]), np.asarray(p["y"])
            dx = np.diff(x)         # 0 between blocks at one iteration (repeated logs)
            with np.errstate(divide="ignore", invalid="ignore"):
                slopes = np.where(dx > 0, -np.diff(y) / dx, 0.0)
            idx = np.clip(np.searchsorted(x, k, side="right") - 1, 0, max(slopes.size - 1, 0))
            r = slopes[idx] if slopes.size else np.zeros_like(k)
            r = np.where(k >= x[-1], p["tail_rate"], r)
        else:
            raise InvalidArgumentError(f"unknown curve family {self.family!r}")
        return np.maximum(r, 0.0)


def fit_curve(iterations, losses, families=FAMILIES, min_points: int = MIN_POINTS) -> FittedCurve:
    """Fit the family that best predicts a held-out tail of ``(iterations, losses)``.

    Raises :class:`~lcckpt.errors.InvalidArgumentError` with fewer than
    ``min_points`` finite points (plan with ``curve=None`` until then).
    """
    k, y = _clean(iterations, losses, min_points)
    for fam in families:
        if fam not in FAMILIES:
            raise InvalidArgumentError(f"unknown curve family {fam!r}; choose from {FAMILIES}")
    w = _recency_weights(k.size)
    if np.all(y > 0):  # noise in a loss scales with the loss: fit relative errors
        w = w / y ** 2
    n_test = max(2, int(round(_HOLDOUT * k.size)))
    tr, te = slice(0, k.size - n_test), slice(k.size - n_test, k.size)
    best, best_err = "isotonic", _holdout_err(_isotonic(k[tr], y[tr], w[tr]), k[te], y[te], w[te])
    for fam in families:
        c = _fit_family(fam, k[tr], y[tr], w[tr])
        if c is None:
            continue
        err = _holdout_err(c, k[te], y[te], w[te])
        if err < best_err:
            best, best_err = fam, err
    final = _isotonic(k, y, w) if best == "isotonic" else _fit_family(best, k, y, w)
    if final is None:  # refit on all points failed where the training part succeeded
        best, final = "isotonic", _isotonic(k, y, w)
    resid = final(k) - y
    return FittedCurve(final.family, final.params, int(k.size),
                       float(np.sqrt(np.average(resid ** 2, weights=w))), float(np.sqrt(best_err)))


def fit_exponential_no_offset(iterations, losses) -> FittedCurve:
    """``L = exp(theta1 k + theta2)``, the form COCI's public code fits (no floor)."""
    k, y = _clean(iterations, losses, 3)
    w = np.ones_like(k)
    span = max(k[-1] - k[0], 1.0)

    def solve(t1: float):
        e = np.exp(t1 * (k - k[0]))
        amp = float(np.dot(w * e, y) / np.dot(w * e, e))
        return float(np.dot(w, (amp * e - y) ** 2)), amp

    t1 = _search(lambda v: solve(-v)[0], 1e-3 / span, 1e2 / span)
    amp = max(solve(-t1)[1], 1e-300)
    params = {"theta1": -t1, "theta2": math.log(amp) + t1 * k[0]}
    return FittedCurve("coci_exp", params, int(k.size))


def _clean(iterations, losses, min_points: int) -> tuple[np.ndarray, np.ndarray]:
    try:
        k = np.asarray(iterations, dtype=np.float64).ravel()
        y = np.asarray(losses, dtype=np.float64).ravel()
    except (TypeError, ValueError) as exc:
        raise InvalidArgumentError("iterations and losses must be numeric sequences") from exc
    if k.shape != y.shape:
        raise InvalidArgumentError(
            f"iterations and losses must have the same length, got {k.size} and {y.size}"
        )
    ok = np.isfinite(k) & np.isfinite(y)
    k, y = k[ok], y[ok]
    if k.size < min_points:
        raise InvalidArgumentError(
            f"need at least {min_points} finite (iteration, loss) points to fit a curve, got {k.size}; "
            "plan with curve=None until more losses are recorded"
        )
    order = np.argsort(k, kind="stable")
    return k[order], y[order]


def _recency_weights(n: int) -> np.ndarray:
    return 1.0 + np.arange(n) / max(n - 1, 1)


def _basis(fam: str, k: np.ndarray, theta: float) -> np.ndarray:
    if fam == "exponential":
        return np.exp(-theta * (k - k[0]))
    if fam == "optimus":
        return 1.0 / (k + theta)
    return (k + 1.0) ** (-theta)


def _linear(phi: np.ndarray, y: np.ndarray, w: np.ndarray):
    """Weighted least squares for ``a * phi + c`` with ``a >= 0``; (sse, a, c)."""
    sw, sp, spp = w.sum(), np.dot(w, phi), np.dot(w, phi * phi)
    sy, spy = np.dot(w, y), np.dot(w, phi * y)
    det = sw * spp - sp * sp
    if det <= 1e-12 * max(sw * spp, 1e-300):
        a = 0.0
    else:
        a = (sw * spy - sp * sy) / det
    a = max(a, 0.0)
    c = (sy - a * sp) / sw
    r = a * phi + c - y
    return float(np.dot(w, r * r)), float(a), float(c)


def _fit_family(fam: str, k: np.ndarray, y: np.ndarray, w: np.ndarray) -> FittedCurve | None:
    span = max(k[-1] - k[0], 1.0)
    lo, hi = {"exponential": (1e-2 / span, 50.0 / span),
              "optimus": (1e-3 * max(k[0], 1.0), 10.0 * (k[-1] + 1.0)),
              "power": (1e-2, 5.0)}[fam]
    theta = _search(lambda t: _linear(_basis(fam, k, t), y, w)[0], lo, hi)
    _, a, c = _linear(_basis(fam, k, theta), y, w)
    if a <= 0.0:
        return None  # no decay: nothing for this family to say
    if fam == "exponential":
        params = {"a": a * math.exp(theta * k[0]), "b": theta, "c": c}
        if not math.isfinite(params["a"]):
            return None
    elif fam == "optimus":
        params = {"a": a, "s": theta, "c": c}
    else:
        params = {"a": a, "p": theta, "c": c}
    return FittedCurve(fam, params, int(k.size))


def _search(f, lo: float, hi: float) -> float:
    """Minimise ``f`` over ``[lo, hi]``: log grid, then golden section on the best bracket."""
    grid = np.geomspace(lo, hi, _GRID)
    vals = np.array([f(g) for g in grid])
    i = int(np.nanargmin(vals))
    a, b = math.log(grid[max(i - 1, 0)]), math.log(grid[min(i + 1, _GRID - 1)])
    g = (math.sqrt(5.0) - 1.0) / 2.0
    x1, x2 = b - g * (b - a), a + g * (b - a)
    f1, f2 = f(math.exp(x1)), f(math.exp(x2))
    for _ in range(40):
        if f1 <= f2:
            b, x2, f2 = x2, x1, f1
            x1 = b - g * (b - a)
            f1 = f(math.exp(x1))
        else:
            a, x1, f1 = x1, x2, f2
            x2 = a + g * (b - a)
            f2 = f(math.exp(x2))
    best = math.exp((a + b) / 2.0)
    return best if f(best) <= vals[i] else float(grid[i])


def _isotonic(k: np.ndarray, y: np.ndarray, w: np.ndarray) -> FittedCurve:
    """Non-increasing least-squares fit (pool adjacent violators)."""
    vals, wts, cnt = [], [], []
    for yi, wi in zip(y.tolist(), w.tolist()):
        vals.append(yi); wts.append(wi); cnt.append(1)
        while len(vals) > 1 and vals[-2] < vals[-1]:
            v2, w2, c2 = vals.pop(), wts.pop(), cnt.pop()
            vals[-1] = (vals[-1] * wts[-1] + v2 * w2) / (wts[-1] + w2)
            wts[-1] += w2
            cnt[-1] += c2
    # One knot per block, at the block's weighted-mean iteration.
    xs, ys, start = [], [], 0
    for v, c in zip(vals, cnt):
        xs.append(float(np.mean(k[start:start + c])))
        ys.append(v)
        start += c
    xs, ys = np.asarray(xs), np.asarray(ys)
    # Tail slope: average decline over the last half of the data.
    half = k.size // 2
    span = k[-1] - k[half] if k.size > 1 else 0.0
    fitted = np.interp(k, xs, ys)
    tail = max((fitted[half] - fitted[-1]) / span, 0.0) if span > 0 else 0.0
    return FittedCurve("isotonic", {"x": xs.tolist(), "y": ys.tolist(), "tail_rate": float(tail)},
                       int(k.size))


def _holdout_err(c: FittedCurve, k: np.ndarray, y: np.ndarray, w: np.ndarray) -> float:
    r = c(k) - y
    return float(np.average(r * r, weights=w))


def as_curve(curve) -> FittedCurve | None:
    """A fitted curve from ``None``, a :class:`FittedCurve` or a pair ``(iterations, losses)``."""
    if curve is None or isinstance(curve, FittedCurve):
        return curve
    if isinstance(curve, (tuple, list)) and len(curve) == 2:
        return fit_curve(curve[0], curve[1])
    raise InvalidArgumentError(
        "curve must be None, a FittedCurve (from fit_curve) or a pair (iterations, losses); "
        f"got {type(curve).__name__}"
    )
