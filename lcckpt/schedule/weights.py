"""What lost work is worth: the accounting behind each policy.

A failure destroys progress; a checkpoint stall is plain time. Lost work in
iteration k is weighted by ``u(k) = (1 - omega) + omega * g(k)`` where
``g ~ rho(k) * S(k)**gamma`` (progress rate of the fitted loss curve times the
chance the job is still wanted, to the power gamma), normalized to a
time-weighted mean of 1 over the horizon. ``omega = 0`` is plain time (Young/Daly).
This module defines the accounting; it does not compute costs or schedules, so
the solver and the independent simulator can share it.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..errors import InvalidArgumentError


@dataclass(frozen=True)
class Accounting:
    """``omega`` mixes plain time (0) and progress (1); ``gamma`` weights by survival."""

    omega: float
    gamma: float

    def __post_init__(self) -> None:
        if not (0.0 <= float(self.omega) <= 1.0) or not (float(self.gamma) >= 0.0):
            raise InvalidArgumentError(
                f"need 0 <= omega <= 1 and gamma >= 0, got omega={self.omega!r}, gamma={self.gamma!r}"
            )


POLICIES = {
    "young_daly": Accounting(0.0, 0.0),
    "convergence": Accounting(1.0, 0.0),
    "exploratory": Accounting(1.0, 1.0),
}


def as_accounting(policy) -> Accounting:
    """The accounting of a policy name or an :class:`Accounting`."""
    if isinstance(policy, Accounting):
        return policy
    if isinstance(policy, str) and policy in POLICIES:
        return POLICIES[policy]
    raise InvalidArgumentError(
        f"policy must be one of {sorted(POLICIES)} or an Accounting(omega, gamma); got {policy!r}"
    )


def value_weights(accounting: Accounting, *, iter_time: np.ndarray, start: int = 0,
                  curve=None, survival: np.ndarray | None = None) -> np.ndarray:
    """``u(k)`` for the plan's iterations k = 1..H (relative to ``start``).

    ``survival`` is the conditional survival array of length H + 2 (see
    :func:`lcckpt.schedule.termination.conditional_survival`). Without a curve,
    progress is taken as uniform (g = S**gamma only).
    """
    tau = np.asarray(iter_time, dtype=np.float64)
    h = tau.size
    if accounting.omega == 0.0:
        return np.ones(h)
    k = start + np.arange(1, h + 1)
    g = np.ones(h) if curve is None else np.asarray(curve.rate(k), dtype=np.float64)
    if survival is not None and accounting.gamma > 0:
        g = g * np.asarray(survival[1:h + 1]) ** accounting.gamma
    g = np.where(np.isfinite(g) & (g > 0), g, 0.0)
    total = float(np.dot(g, tau))
    if total <= 0.0:
        g = np.ones(h)
    else:
        g = g * (tau.sum() / total)
    return (1.0 - accounting.omega) + accounting.omega * g
