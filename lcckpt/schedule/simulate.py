"""Monte-Carlo failure simulator: an independent check on any checkpoint schedule.

It plays the job forward, trial by trial (vectorised over trials in numpy):
attempts of each segment, failures sampled from the failure process (a hazard
per iteration for exponential and non-homogeneous Poisson failures, or a Weibull
renewal clock that restarts at each failure), failures during checkpoint stalls
and during restarts, downtime, backpressure (a checkpoint waits for the previous
persist), rollback past a checkpoint whose persist had not finished, and early
termination sampled from the termination model. It never calls the solver's cost
code, so agreement between the two is evidence, not tautology. It does not
choose schedules.
"""

from __future__ import annotations

import math

import numpy as np

from ..errors import InvalidArgumentError
from .curves import as_curve
from .failures import Weibull
from .plan import Plan
from .problem import Problem, build_problem
from .termination import conditional_survival
from .weights import Accounting, as_accounting, value_weights

_MAX_ROUNDS = 1_000_000


def simulate(schedule, *, horizon=None, iter_time=None, checkpoint_cost=None, restart_cost=None,
             mtbf=None, downtime=0.0, persist_time=0.0, termination=None, accountings=None,
             curve=None, start=0, trials=2000, seed=0) -> dict:
    """Simulate checkpoints after ``schedule`` (a :class:`Plan` or iterations 1..horizon).

    With a Plan, its problem, termination, curve and start are used and
    ``accountings`` defaults to plain time plus the plan's policy; otherwise give
    the same inputs as :func:`solve`. ``accountings`` maps a name to a policy name,
    an :class:`Accounting` or an array of per-iteration weights. ``mtbf`` may be a
    :class:`Weibull`, which is simulated as a renewal process.

    Returns ``{"trials", "failures", "wall_time", "accountings": {name: {component:
    {"mean", "se"}}}}`` with components ``total``, ``stall``, ``lost`` (re-executed
    work, weighted, including work lost to an unfinished persist), ``restart``,
    ``downtime`` and ``controllable`` (= stall + lost).
    """
    if isinstance(trials, bool) or not isinstance(trials, (int, np.integer)) or trials < 1:
        raise InvalidArgumentError(f"trials must be an int >= 1, got {trials!r}")
    if isinstance(schedule, Plan):
        prob = schedule.problem
        iterations = schedule.iterations
        termination = schedule.termination if termination is None else termination
        curve = schedule.curve if curve is None else curve
        start = schedule.start
        if accountings is None:
            accountings = {"time": np.ones(prob.horizon), schedule.policy: schedule.weights}
    else:
        if horizon is None or iter_time is None or checkpoint_cost is None or restart_cost is None \
                or mtbf is None:
            raise InvalidArgumentError(
                "simulate(iterations, ...) needs horizon, iter_time, checkpoint_cost, restart_cost "
                "and mtbf (or pass a Plan)"
            )
        prob = build_problem(horizon, iter_time=iter_time, checkpoint_cost=checkpoint_cost,
                             restart_cost=restart_cost, mtbf=mtbf, downtime=downtime,
                             persist_time=persist_time)
        iterations = schedule
    h = prob.horizon
    its = np.asarray(sorted({int(k) for k in np.asarray(iterations, dtype=np.int64).ravel()}), dtype=np.int64)
    if its.size and (its[0] < 1 or its[-1] > h):
        raise InvalidArgumentError(f"checkpoint iterations must lie in 1..{h}")
    its = its[its < h]
    survival = conditional_survival(termination, int(start), h)
    weights = _weights(accountings, prob, as_curve(curve), survival, int(start))
    rng = np.random.default_rng(seed)
    per_trial = _run(prob, its, survival, weights, int(trials), rng)
    out = {"trials": int(trials), "failures": _stat(per_trial["failures"]),
           "wall_time": _stat(per_trial["wall"]), "accountings": {}}
    for name, lost in per_trial["lost"].items():
        comp = dict(stall=per_trial["stall"], lost=lost, restart=per_trial["restart"],
                    downtime=per_trial["downtime"])
        comp["controllable"] = comp["stall"] + comp["lost"]
        comp["total"] = comp["controllable"] + comp["restart"] + comp["downtime"]
        out["accountings"][name] = {k: _stat(v) for k, v in comp.items()}
    return out


def _stat(x: np.ndarray) -> dict:
    n = x.size
    return {"mean": float(x.mean()), "se": float(x.std(ddof=1) / math.sqrt(n)) if n > 1 else math.nan}


def _weights(accountings, prob: Problem, curve, survival, start) -> dict:
    if accountings is None:
        accountings = {"time": Accounting(0.0, 0.0)}
    if not isinstance(accountings, dict) or not accountings:
        raise InvalidArgumentError("accountings must be a non-empty dict: name -> policy, Accounting or weights")
    out = {}
    for name, acc in accountings.items():
        if isinstance(acc, (str, Accounting)):
            out[name] = value_weights(as_accounting(acc), iter_time=prob.tau, start=start,
                                      curve=curve, survival=survival)
        else:
            u = np.asarray(acc, dtype=np.float64)
            if u.shape != (prob.horizon,) or np.any(~np.isfinite(u)) or np.any(u < 0):
                raise InvalidArgumentError(
                    f"weights for accounting {name!r} must be {prob.horizon} finite values >= 0"
                )
            out[name] = u
    return out


def _run(prob: Problem, its: np.ndarray, survival: np.ndarray, weights: dict, n: int, rng) -> dict:
    h = prob.horizon
    t, tau, lam = prob.t, prob.tau, prob.lam
    hz = np.concatenate([[0.0], np.cumsum(lam * tau)])          # hazard accumulated over work
    weibull = prob.failure_model if isinstance(prob.failure_model, Weibull) else None
    names = list(weights)
    ucum = np.stack([np.concatenate([[0.0], np.cumsum(weights[k] * tau)]) for k in names])
    ustep = np.stack([weights[k] * tau for k in names])
    starts = np.concatenate([[0], its]).astype(np.int64)
    ends = np.concatenate([its, [h]]).astype(np.int64)

    # Termination: K = last iteration run, P(K >= k) = survival[k].
    draw = 1.0 - rng.random(n)
    k_end = np.searchsorted(-survival[1:h + 1], -draw, side="right").astype(np.int64)
    k_end = np.clip(k_end, 1, h)

    seg = np.zeros(n, dtype=np.int64)
    clock = np.zeros(n)
    age = np.zeros(n)
    durable_at = np.full(n, -np.inf)
    stall = np.zeros(n)
    restart = np.zeros(n)
    down = np.zeros(n)
    fails = np.zeros(n)
    executed = np.zeros((len(names), n))
    active = np.ones(n, dtype=bool)

    for _ in range(_MAX_ROUNDS):
        idx = np.nonzero(active)[0]
        if idx.size == 0:
            break
        i = seg[idx]
        b = starts[i]
        e = np.minimum(ends[i], k_end[idx])
        ck = (ends[i] < k_end[idx]) & (ends[i] < h)
        work = t[e] - t[b]
        wait = np.where(ck, np.maximum(0.0, durable_at[idx] - (clock[idx] + work)), 0.0)
        length = np.where(ck, prob.ckpt[e - 1] + wait, 0.0)
        ex = rng.exponential(size=idx.size)
        f_work, f_stall, m, frac, stall_off = _failure_point(
            prob, hz, weibull, age[idx], ex, b, e, ck, work, length)
        fail = f_work | f_stall
        work_off = t[m - 1] - t[b] + frac * tau[m - 1]
        elapsed = np.where(f_work, work_off, np.where(f_stall, work + stall_off, work + length))
        done_w = np.where(f_work, ucum[:, m - 1] - ucum[:, b] + frac * ustep[:, m - 1],
                          ucum[:, e] - ucum[:, b])
        executed[:, idx] += done_w
        stall[idx] += np.where(f_work, 0.0, np.where(f_stall, stall_off, length))
        fail_clock = clock[idx] + elapsed
        clock[idx] = fail_clock
        age[idx] += elapsed

        ok = idx[~fail]
        ok_ck = ck[~fail]
        durable_at[ok[ok_ck]] = clock[ok[ok_ck]] + prob.persist[e[~fail][ok_ck] - 1]
        seg[ok[ok_ck]] += 1
        active[ok[~ok_ck]] = False

        bad = idx[fail]
        if bad.size:
            # A failure before the last checkpoint was persisted loses that checkpoint too.
            lost_ck = fail_clock[fail] < durable_at[bad]
            seg[bad[lost_ck]] -= 1
            durable_at[bad] = -np.inf
            _restart(prob, bad, starts[seg[bad]], clock, age, restart, down, fails, weibull, rng)

    else:  # pragma: no cover - needs an absurd failure rate
        raise InvalidArgumentError("simulation did not finish: the failure rate is too high for any progress")

    useful = ucum[:, k_end]
    lost = {name: executed[j] - useful[j] for j, name in enumerate(names)}
    return dict(lost=lost, stall=stall, restart=restart, downtime=down, failures=fails,
                wall=clock + down)


def _failure_point(prob: Problem, hz, weibull, age, ex, b, e, ck, work, length):
    """Where each run of segments ``[b, e)`` fails, given unit-exponential draws ``ex``:
    ``(failed in the work, failed in the checkpoint's stall, iteration m it failed in, the
    fraction of iteration m done, time into the stall)``. Exponential failures read the
    hazard accumulated over work, ``hz``; Weibull ones the residual life at ``age``."""
    h, t, tau, lam = prob.horizon, prob.t, prob.tau, prob.lam
    if weibull is None:
        h_work = hz[e] - hz[b]
        f_work = ex < h_work
        lam_s = lam[e - 1]
        rest = ex - h_work
        f_stall = ~f_work & ck & (rest < lam_s * length)
        target = hz[b] + ex
        m = np.clip(np.searchsorted(hz, target, side="left"), 1, h)
        step = hz[m] - hz[m - 1]
        with np.errstate(divide="ignore", invalid="ignore"):
            frac = np.where(step > 0, (target - hz[m - 1]) / step, 1.0)
            stall_off = np.where(lam_s > 0, rest / lam_s, 0.0)
    else:
        x = _weibull_residual(weibull, age, ex)
        f_work = x < work
        f_stall = ~f_work & ck & (x < work + length)
        pos = t[b] + x
        m = np.clip(np.searchsorted(t, pos, side="left"), 1, h)
        frac = np.clip((pos - t[m - 1]) / tau[m - 1], 0.0, 1.0)
        stall_off = x - work
    return f_work, f_stall, m, np.clip(frac, 0.0, 1.0), stall_off


def _restart(prob, who, points, clock, age, restart, down, fails, weibull, rng) -> None:
    """Downtime then restart from ``points``, until a restart completes without failing."""
    h = prob.horizon
    pending = who.copy()
    pts = points.copy()
    while pending.size:
        fails[pending] += 1
        down[pending] += prob.downtime
        age[pending] = 0.0
        r = prob.restart[pts]
        ex = rng.exponential(size=pending.size)
        if weibull is None:
            lr = prob.lam[np.minimum(pts, h - 1)]
            with np.errstate(divide="ignore", invalid="ignore"):
                x = np.where(lr > 0, ex / lr, np.inf)
        else:
            x = _weibull_residual(weibull, np.zeros(pending.size), ex)
        failed = x < r
        spent = np.where(failed, x, r)
        restart[pending] += spent
        clock[pending] += spent
        age[pending] += spent
        pending, pts = pending[failed], pts[failed]


def _weibull_residual(model: Weibull, age: np.ndarray, ex: np.ndarray) -> np.ndarray:
    """Time to the next failure of a Weibull clock of ``age``, given an Exp(1) draw."""
    k, s = model.shape, model.scale
    return s * ((age / s) ** k + ex) ** (1.0 / k) - age
