"""``solve``: where to checkpoint a training job, given costs, failures and progress.

It validates the inputs, builds the policy's value weights from the loss curve and
termination model, picks checkpoint iterations by the chosen method (the dynamic
program by default, or a baseline rule), and scores the result with the exact
expected-cost model of :mod:`lcckpt.schedule.cost`. It does not run or watch
training; a checkpoint manager calls it again when costs or the curve move.
"""

from __future__ import annotations

import math
import numbers

import numpy as np

from ..errors import InvalidArgumentError
from . import rules
from .cost import dp_schedule, evaluate
from .curves import MIN_POINTS, as_curve
from .plan import Plan
from .problem import build_problem
from .termination import conditional_survival
from .weights import as_accounting, value_weights

METHODS = ("dp", "density", "young", "daly", "checkfreq", "coci_code")


def solve(horizon, *, iter_time, checkpoint_cost, restart_cost, mtbf, downtime=0.0,
          persist_time=0.0, curve=None, termination=None, policy="young_daly", method="dp",
          start=0, candidates=None, max_candidates=5000, max_pairs=6_000_000, window=4.0,
          checkfreq_overhead=0.05, coci_time_unit=60.0) -> Plan:
    """Plan checkpoints for the next ``horizon`` iterations.

    Times are seconds (any unit works if all agree, except ``coci_code``). Costs may
    be scalars or per-iteration arrays; ``restart_cost`` may also have
    ``horizon + 1`` entries (index 0: restarting from the start). ``mtbf`` is
    seconds, a per-iteration array or a failure model. ``curve`` is a
    :class:`FittedCurve` or the raw pair ``(iterations, losses)`` in absolute
    iterations (``start`` iterations are already done); with fewer than
    ``MIN_POINTS`` points progress counts as uniform. ``policy`` is
    ``"young_daly"`` (plain time), ``"convergence"`` (lost work weighted by progress
    rate), ``"exploratory"`` (also by the chance the job is still wanted) or an
    :class:`Accounting`. The DP considers checkpoints on a grid of at most
    ``max_candidates`` iterations (or ``candidates``) and segments up to ``window``
    times the longest local optimal interval; if that means more than ``max_pairs``
    (start, end) pairs, the grid is coarsened until it does not (the cost is flat
    near the optimum, so a few iterations of resolution cost little).
    """
    if method not in METHODS:
        raise InvalidArgumentError(f"method must be one of {METHODS}, got {method!r}")
    if isinstance(start, bool) or not isinstance(start, (int, np.integer)) or start < 0:
        raise InvalidArgumentError(f"start must be an int >= 0 (iterations already done), got {start!r}")
    accounting = as_accounting(policy)
    policy_name = policy if isinstance(policy, str) else f"omega={accounting.omega},gamma={accounting.gamma}"
    prob = build_problem(horizon, iter_time=iter_time, checkpoint_cost=checkpoint_cost,
                         restart_cost=restart_cost, mtbf=mtbf, downtime=downtime,
                         persist_time=persist_time)
    notes = []
    raw_curve = curve
    if (isinstance(curve, (tuple, list)) and len(curve) == 2
            and np.size(curve[0]) < MIN_POINTS and np.size(curve[0]) == np.size(curve[1])):
        notes.append(f"only {np.size(curve[0])} loss points (< {MIN_POINTS}): progress taken as uniform")
        curve = None
    else:
        curve = as_curve(curve)
    survival = conditional_survival(termination, int(start), prob.horizon)
    u = value_weights(accounting, iter_time=prob.tau, start=int(start), curve=curve, survival=survival)

    if method == "dp":
        cand = _candidates(prob.horizon, candidates, max_candidates)
        win = _window_time(prob, u, window, cand)
        if candidates is None:
            cand, win = _fit_budget(prob, u, window, cand, win, max_pairs)
        its, _ = dp_schedule(prob, u, survival, cand, win)
    elif method == "young":
        its = rules.young(prob, 1)
    elif method == "daly":
        its = rules.young(prob, 2)
    elif method == "checkfreq":
        its = rules.checkfreq(prob, checkfreq_overhead)
    elif method == "density":
        its = rules.density(prob, u)
    else:
        coci_curve = raw_curve if raw_curve is not None else curve
        its = rules.coci_code(prob, coci_curve, int(start), coci_time_unit)
    return make_plan(prob, its, u, survival, policy=policy_name, method=method, start=int(start),
                     curve=curve, termination=termination, notes=tuple(notes))


def score(iterations, horizon, *, iter_time, checkpoint_cost, restart_cost, mtbf, downtime=0.0,
          persist_time=0.0, curve=None, termination=None, policy="young_daly", start=0) -> Plan:
    """Expected costs of a given schedule under the same model and accounting as :func:`solve`."""
    if isinstance(start, bool) or not isinstance(start, (int, np.integer)) or start < 0:
        raise InvalidArgumentError(f"start must be an int >= 0 (iterations already done), got {start!r}")
    accounting = as_accounting(policy)
    prob = build_problem(horizon, iter_time=iter_time, checkpoint_cost=checkpoint_cost,
                         restart_cost=restart_cost, mtbf=mtbf, downtime=downtime,
                         persist_time=persist_time)
    its = np.asarray(iterations, dtype=np.int64).ravel()
    if its.size and (its.min() < 1 or its.max() > prob.horizon):
        raise InvalidArgumentError(f"checkpoint iterations must lie in 1..{prob.horizon}")
    curve = as_curve(curve)
    survival = conditional_survival(termination, int(start), prob.horizon)
    u = value_weights(accounting, iter_time=prob.tau, start=int(start), curve=curve, survival=survival)
    name = policy if isinstance(policy, str) else f"omega={accounting.omega},gamma={accounting.gamma}"
    return make_plan(prob, its, u, survival, policy=name, method="given", start=int(start),
                     curve=curve, termination=termination)


def make_plan(prob, iterations, u, survival, *, policy, method, start=0, curve=None,
              termination=None, notes=()) -> Plan:
    """Score ``iterations`` under the policy weights ``u`` and under plain time."""
    its = tuple(sorted({int(k) for k in iterations if 0 < int(k) < prob.horizon}))
    ev = evaluate(prob, u, survival, its)
    ev_t = ev if np.all(u == 1.0) else evaluate(prob, np.ones(prob.horizon), survival, its)
    comp = {k: float(v) for k, v in ev.items() if k != "segments"}
    tcomp = {k: float(v) for k, v in ev_t.items() if k != "segments"}
    return Plan(iterations=its, expected_overhead=comp["total"],
                expected_time_overhead=tcomp["total"], expected_failures=comp["failures"],
                horizon=prob.horizon, start=start, policy=policy, method=method,
                components=comp, time_components=tcomp, notes=tuple(notes), curve=curve,
                termination=termination, weights=u, survival=survival, problem=prob)


def _candidates(h: int, candidates, max_candidates) -> np.ndarray:
    if candidates is not None:
        c = np.unique(np.asarray(candidates, dtype=np.int64))
        if c.size and (c[0] < 1 or c[-1] > h):
            raise InvalidArgumentError(f"candidates must be iterations in 1..{h}")
        c = c[c < h]
    else:
        if isinstance(max_candidates, bool) or not isinstance(max_candidates, (int, np.integer)) \
                or max_candidates < 1:
            raise InvalidArgumentError(f"max_candidates must be an int >= 1, got {max_candidates!r}")
        stride = max(1, math.ceil(h / max_candidates))
        c = np.arange(stride, h, stride, dtype=np.int64)
    return np.concatenate([[0], c, [h]]).astype(np.int64)


def _fit_budget(prob, u, window, cand, win, max_pairs):
    """Coarsen a uniform grid until candidates x window stays within ``max_pairs``."""
    if isinstance(max_pairs, bool) or not isinstance(max_pairs, (int, np.integer)) or max_pairs < 1:
        raise InvalidArgumentError(f"max_pairs must be an int >= 1, got {max_pairs!r}")
    h = prob.horizon
    for _ in range(64):
        m = cand.size - 1
        per_window = win / float(prob.t[-1]) * m
        pairs = m * min(m, max(per_window, 1.0))
        if pairs <= max_pairs or m <= 2:
            return cand, win
        stride = int(cand[1]) if cand.size > 2 else h
        stride = max(stride + 1, math.ceil(stride * math.sqrt(pairs / max_pairs)))
        cand = np.concatenate([[0], np.arange(stride, h, stride), [h]]).astype(np.int64)
        win = _window_time(prob, u, window, cand)
    return cand, win


def _window_time(prob, u, window, cand) -> float:
    if isinstance(window, bool) or not isinstance(window, numbers.Real) or not window >= 1:
        raise InvalidArgumentError(f"window must be a number >= 1 (times the local optimal interval), got {window!r}")
    total = float(prob.t[-1])
    lu = prob.lam * u
    if np.any(lu <= 0):
        return total
    # Persisting makes a checkpoint dearer (backpressure, rollback past it), so the
    # bound uses C + P; short horizons get no cap at all.
    tstar = float(np.max(np.sqrt(2.0 * (prob.ckpt + prob.persist) / lu)))
    spacing = float(np.max(np.diff(prob.t[cand])))
    w = max(window * tstar, 2.0 * spacing)
    return total if w >= 0.5 * total else w
