"""Closed-form periodic checkpoint intervals: Young, Daly, and the exact optimum.

These are the classic answers for a constant failure rate, a constant checkpoint
cost and work that is all worth the same; they are the baselines the solver must
reproduce when progress is weighted uniformly. They do not know about iterations,
loss curves or termination (see :mod:`lcckpt.schedule.solver` for that).
"""

from __future__ import annotations

import math

from ..errors import InvalidArgumentError

_INV_E = math.exp(-1.0)


def lambert_w0(z: float) -> float:
    """Principal branch W0 of the Lambert W function, for real z >= -1/e.

    Halley iteration from a branch-point series (near -1/e) or a log guess.
    ``W0(-exp(-1-x))`` for small ``x`` is better computed with
    :func:`lambert_w0_branch`, which does not lose the digits of ``x``.
    """
    z = float(z)
    if not math.isfinite(z) or z < -_INV_E * (1 + 1e-15):
        raise InvalidArgumentError(f"lambert_w0 needs a finite z >= -1/e, got {z!r}")
    if z <= -_INV_E:
        return -1.0
    if z == 0.0:
        return 0.0
    p2 = 2.0 * (math.e * z + 1.0)
    return _halley(z, _guess(z, math.sqrt(max(p2, 0.0))))


def lambert_w0_branch(x: float) -> float:
    """``W0(-exp(-1 - x))`` for ``x >= 0``, accurate even for tiny ``x``.

    This is the form the exact periodic optimum needs (x = C / MTBF); the
    branch-point distance ``1 + e*z = -expm1(-x)`` is computed without cancellation.
    """
    x = float(x)
    if not (x >= 0.0) or math.isinf(x):
        raise InvalidArgumentError(f"lambert_w0_branch needs a finite x >= 0, got {x!r}")
    if x == 0.0:
        return -1.0
    z = -math.exp(-1.0 - x)
    p = math.sqrt(2.0 * -math.expm1(-x))
    w = _guess(z, p)
    # Halley on f(w) = w e^w - z, written around the branch point so that
    # the residual keeps its digits: w e^w - z = e^w (w - z e^-w).
    for _ in range(50):
        ew = math.exp(w)
        f = w * ew - z
        if f == 0.0:
            break
        wp1 = w + 1.0
        if wp1 == 0.0:
            break
        step = f / (ew * wp1 - (w + 2.0) * f / (2.0 * wp1))
        w_new = w - step
        if abs(w_new - w) <= 4e-16 * max(1.0, abs(w_new)):
            w = w_new
            break
        w = w_new
    return w


def _guess(z: float, p: float) -> float:
    if z < -0.25:  # series at the branch point, p = sqrt(2 (e z + 1))
        return -1.0 + p - p * p / 3.0 + 11.0 / 72.0 * p ** 3
    if z < 3.0:
        return math.log1p(z)
    lz = math.log(z)
    return lz - math.log(lz)


def _halley(z: float, w: float) -> float:
    for _ in range(60):
        ew = math.exp(w)
        f = w * ew - z
        wp1 = w + 1.0
        if wp1 == 0.0:
            return w
        w_new = w - f / (ew * wp1 - (w + 2.0) * f / (2.0 * wp1))
        if abs(w_new - w) <= 4e-16 * max(1.0, abs(w_new)):
            return w_new
        w = w_new
    return w


def young_daly(checkpoint_cost: float, mtbf: float, order: int | str = 1) -> float:
    """Seconds of work between checkpoints for a constant failure rate.

    ``order=1``: Young's ``sqrt(2 C M)``. ``order=2``: Daly's series
    ``sqrt(2 C M) (1 + sqrt(C / 2M) / 3 + C / 18M) - C`` (``M`` once ``C >= 2M``).
    ``order="exact"``: the exact periodic optimum ``M (1 + W0(-exp(-1 - C/M)))``.
    Any consistent time unit works; the answer is in that unit.
    """
    c, m = _check_cm(checkpoint_cost, mtbf)
    if math.isinf(m):
        return math.inf
    if order == 1:
        return math.sqrt(2.0 * c * m)
    if order == 2:
        if c >= 2.0 * m:
            return m
        r = c / (2.0 * m)
        return math.sqrt(2.0 * c * m) * (1.0 + math.sqrt(r) / 3.0 + r / 9.0) - c
    if order == "exact":
        return m * (1.0 + lambert_w0_branch(c / m))
    raise InvalidArgumentError(f"order must be 1 (Young), 2 (Daly) or 'exact', got {order!r}")


def _check_cm(checkpoint_cost: float, mtbf: float) -> tuple[float, float]:
    try:
        c, m = float(checkpoint_cost), float(mtbf)
    except (TypeError, ValueError) as exc:
        raise InvalidArgumentError(
            f"checkpoint_cost and mtbf must be numbers, got {checkpoint_cost!r}, {mtbf!r}"
        ) from exc
    if not (math.isfinite(c) and c >= 0.0):
        raise InvalidArgumentError(f"checkpoint_cost must be finite and >= 0 seconds, got {c!r}")
    if not (m > 0.0) or math.isnan(m):
        raise InvalidArgumentError(f"mtbf must be > 0 seconds (inf for no failures), got {m!r}")
    return c, m
