"""Validated, per-iteration inputs of a checkpoint-scheduling problem.

Every cost may be a scalar or one value per iteration; this module checks them
and expands them to arrays once, so the solver, the baseline rules and the
simulator all read the same numbers. It computes no costs.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from ..errors import InvalidArgumentError
from .failures import FailureModel, as_failure_model

MAX_EXPONENT = 30.0    # failures per try as a power of e past which no job finishes


@dataclass(frozen=True)
class Problem:
    """Arrays over iterations k = 1..H (index k-1) unless noted.

    ``tau``: seconds per iteration; ``ckpt``: blocking checkpoint cost after k;
    ``persist``: background persist time of that checkpoint; ``restart``: length
    H + 1, seconds to restart from a checkpoint at k (index 0: from the start);
    ``lam``: failure rate (1/s) while iteration k runs; ``downtime``: seconds
    lost per failure before the restart begins; ``t``: length H + 1, job time at
    the end of iteration k (work only).
    """

    horizon: int
    tau: np.ndarray
    ckpt: np.ndarray
    persist: np.ndarray
    restart: np.ndarray
    lam: np.ndarray
    downtime: float
    t: np.ndarray
    failure_model: FailureModel | None


def build_problem(horizon, *, iter_time, checkpoint_cost, restart_cost, mtbf,
                  downtime=0.0, persist_time=0.0) -> Problem:
    """Check and expand the inputs; raises InvalidArgumentError saying what to fix."""
    if isinstance(horizon, bool) or not isinstance(horizon, (int, np.integer)) or horizon < 1:
        raise InvalidArgumentError(f"horizon must be an int >= 1 (iterations to plan), got {horizon!r}")
    h = int(horizon)
    tau = _per_iter("iter_time", iter_time, h, positive=True)
    ckpt = _per_iter("checkpoint_cost", checkpoint_cost, h)
    persist = _per_iter("persist_time", persist_time, h)
    if np.ndim(restart_cost) == 0:
        restart = _per_iter("restart_cost", restart_cost, h + 1)
    else:
        r = np.asarray(restart_cost, dtype=np.float64)
        if r.shape == (h,):
            r = np.concatenate([r[:1], r])
        restart = _per_iter("restart_cost", r, h + 1)
    d = _scalar("downtime", downtime)
    t = np.concatenate([[0.0], np.cumsum(tau)])
    model = as_failure_model(mtbf)
    if model is None:
        m = _per_iter("mtbf", mtbf, h, positive=True, allow_inf=True)
        lam = 1.0 / m
    else:
        lam = np.asarray(model.expected_failures(t), dtype=np.float64) / tau
    if np.any(~np.isfinite(lam)) or np.any(lam < 0):
        raise InvalidArgumentError("failure rates must be finite and >= 0; check mtbf")
    _check_finishes(lam, tau + ckpt + persist, restart[1:])
    return Problem(h, tau, ckpt, persist, restart, lam, d, t, model)


def _check_finishes(lam: np.ndarray, step: np.ndarray, restart: np.ndarray) -> None:
    """Refuse failure rates under which one iteration with its checkpoint, or a restart,
    is expected to fail about e^MAX_EXPONENT times before it gets through: no schedule
    finishes such a job, and its expected times grow past any sense (NaN at an MTBF of 1 ms)."""
    k = lam * np.maximum(step, restart)
    if np.any(k > MAX_EXPONENT):
        i = int(np.argmax(k))
        raise InvalidArgumentError(
            f"mtbf {1 / lam[i]:.3g} s is too short for these costs: an iteration with its "
            f"checkpoint takes {step[i]:.3g} s and a restart {restart[i]:.3g} s, so the job is "
            f"expected to fail about e^{k[i]:.0f} times in one of them and never finish; "
            "mtbf is in seconds")


def _scalar(name: str, value) -> float:
    try:
        v = float(value)
    except (TypeError, ValueError) as exc:
        raise InvalidArgumentError(f"{name} must be a number of seconds, got {value!r}") from exc
    if not (math.isfinite(v) and v >= 0):
        raise InvalidArgumentError(f"{name} must be finite and >= 0 seconds, got {value!r}")
    return v


def _per_iter(name: str, value, n: int, positive: bool = False, allow_inf: bool = False) -> np.ndarray:
    try:
        a = np.asarray(value, dtype=np.float64)
    except (TypeError, ValueError) as exc:
        raise InvalidArgumentError(f"{name} must be seconds: a number or an array, got {value!r}") from exc
    if a.ndim == 0:
        a = np.full(n, float(a))
    if a.shape != (n,):
        raise InvalidArgumentError(
            f"{name} must be a scalar or have one value per iteration ({n}), got shape {a.shape}"
        )
    bad = np.isnan(a) | (np.isinf(a) & (not allow_inf)) | ((a <= 0) if positive else (a < 0))
    if np.any(bad):
        i = int(np.argmax(bad))
        need = "> 0" if positive else ">= 0"
        raise InvalidArgumentError(f"{name} must be finite and {need}; element {i} is {a[i]!r}")
    return a
