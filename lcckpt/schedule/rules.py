"""Baseline checkpoint rules the solver is compared with.

Each returns checkpoint iterations for a :class:`~lcckpt.schedule.problem.Problem`;
none of them looks at the expected-cost model. ``young``/``daly`` are periodic in
work seconds; ``checkfreq`` is a CheckFreq-style fixed frequency that bounds the
stall to a fraction of compute and ignores the failure rate; ``density`` places
checkpoints at the first-order local optimum ``sqrt(2C / (lambda u))``;
``coci_code`` is the rule of COCI's public code, kept only as a baseline: it fits
``L(t) = exp(theta1 t + theta2)`` over job time and checkpoints at equal decrements
of the fitted loss, with a decrement in time units, so the schedule changes with
the time unit (their code uses minutes).
"""

from __future__ import annotations

import math

import numpy as np

from ..errors import InvalidArgumentError
from .curves import FittedCurve, fit_exponential_no_offset
from .intervals import young_daly
from .problem import Problem


def periodic(prob: Problem, interval_s: float) -> list[int]:
    """Checkpoint after the iteration where work time first reaches each multiple of ``interval_s``."""
    total = float(prob.t[-1])
    if not math.isfinite(interval_s) or interval_s >= total:
        return []
    interval_s = max(interval_s, 1e-12)
    marks = np.arange(1, int(total // interval_s) + 1) * interval_s
    its = np.searchsorted(prob.t, marks - 1e-9 * interval_s, side="left")
    its = np.unique(np.clip(its, 1, prob.horizon))
    return [int(k) for k in its if k < prob.horizon]


def mean_mtbf(prob: Problem) -> float:
    rate = float(np.dot(prob.lam, prob.tau) / prob.t[-1])
    return math.inf if rate == 0 else 1.0 / rate


def mean_cost(prob: Problem) -> float:
    return float(np.mean(prob.ckpt))


def young(prob: Problem, order=1) -> list[int]:
    m = mean_mtbf(prob)
    return [] if math.isinf(m) else periodic(prob, young_daly(mean_cost(prob), m, order))


def checkfreq(prob: Problem, overhead: float = 0.05) -> list[int]:
    """Fixed frequency with stall <= ``overhead`` of compute, and no overlapping persists."""
    if not 0 < overhead < 1:
        raise InvalidArgumentError(f"checkfreq_overhead must be in (0, 1), got {overhead!r}")
    interval = max(mean_cost(prob) / overhead, float(np.mean(prob.persist)), float(np.min(prob.tau)))
    return periodic(prob, interval)


def density(prob: Problem, u: np.ndarray) -> list[int]:
    """Checkpoint each time the integral of ``1 / T*(k)`` passes an integer."""
    lu = prob.lam * u
    with np.errstate(divide="ignore", invalid="ignore"):
        tstar = np.sqrt(2.0 * prob.ckpt / lu)
        dens = np.where(lu > 0, prob.tau / tstar, 0.0)
    dens = np.where(np.isfinite(dens), dens, 1.0)      # C = 0: checkpoint every iteration
    cum = np.cumsum(dens)
    crossings = np.floor(cum + 1e-12)
    its = np.nonzero(np.diff(np.concatenate([[0.0], crossings])) > 0)[0] + 1
    return [int(k) for k in its if k < prob.horizon]


def coci_code(prob: Problem, curve, start: int = 0, time_unit: float = 60.0) -> list[int]:
    """COCI's public-code rule (baseline): equal fitted-loss decrements in ``time_unit`` units."""
    if curve is None:
        raise InvalidArgumentError("method='coci_code' needs a loss curve: pass curve=(iterations, losses)")
    if not time_unit > 0:
        raise InvalidArgumentError(f"coci_time_unit must be > 0 seconds, got {time_unit!r}")
    tau_mean = float(np.mean(prob.tau))
    if isinstance(curve, FittedCurve):
        ks = start + np.linspace(1, prob.horizon, 200)
        iters, losses = ks, curve(ks)
    else:
        iters, losses = np.asarray(curve[0], dtype=float), np.asarray(curve[1], dtype=float)
    fit = fit_exponential_no_offset(np.asarray(iters) * tau_mean / time_unit, losses)
    th1, th2 = fit.params["theta1"], fit.params["theta2"]
    lam = 1.0 / mean_mtbf(prob) * time_unit
    ts = mean_cost(prob) / time_unit
    if th1 >= 0 or lam <= 0:
        return []
    pc = (1.0 - math.exp(th1 * ts)) * (1.0 / (2.0 * lam) - 1.0 / (2.0 * th1))
    t0 = start * tau_mean / time_unit
    level = math.exp(th1 * t0 + th2)
    out, t_end = [], (start + prob.horizon) * tau_mean / time_unit
    while pc > 0 and level - pc > 0 and len(out) < prob.horizon:
        level -= pc
        t = (math.log(level) - th2) / th1
        if t >= t_end:
            break
        out.append(t)
    secs = (np.asarray(out) - t0) * time_unit
    its = np.searchsorted(prob.t, secs, side="left")
    return sorted({int(k) for k in its if 0 < k < prob.horizon})
