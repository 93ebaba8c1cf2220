"""Termination models: the probability that a job is still wanted at iteration k.

Exploratory jobs (hyper-parameter searches) are often stopped early: ASHA and
Hyperband keep only the best 1/eta of the trials at each rung. A checkpoint that
protects work nobody will use is waste, and the end of a job needs no checkpoint,
so the solver weighs costs by the survival ``S(k) = P(K >= k)``, where K is the
last iteration the job runs. Iterations are absolute (counted from the job's
start). This module only describes survival; it does not schedule.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from ..errors import InvalidArgumentError


class Termination:
    """Base class: :meth:`survival` gives ``P(K >= k)`` for absolute iterations k."""

    def survival(self, k: np.ndarray) -> np.ndarray:
        raise NotImplementedError


@dataclass(frozen=True)
class NoTermination(Termination):
    """The job always runs to its horizon."""

    def survival(self, k: np.ndarray) -> np.ndarray:
        return np.ones(np.shape(k))


@dataclass(frozen=True)
class ExponentialTermination(Termination):
    """Memoryless early stopping: ``S(k) = exp(-k / mean_iterations)``."""

    mean_iterations: float

    def __post_init__(self) -> None:
        m = float(self.mean_iterations)
        if not (m > 0) or math.isinf(m):
            raise InvalidArgumentError(
                f"mean_iterations must be a finite number > 0, got {self.mean_iterations!r}"
            )

    def survival(self, k: np.ndarray) -> np.ndarray:
        k = np.asarray(k, dtype=np.float64)
        return np.exp(-np.maximum(k - 1.0, 0.0) / float(self.mean_iterations))


@dataclass(frozen=True)
class Rungs(Termination):
    """ASHA / successive-halving rungs: at each rung only ``1/eta`` of jobs go on.

    A job stopped at rung ``r`` has run iterations 1..r. ``S(k) = eta**-(number of
    rungs < k)``. ``Rungs.geometric(first, eta, horizon)`` gives the usual
    ``first, first*eta, first*eta**2, ...`` ladder.
    """

    rungs: tuple[int, ...]
    eta: float = 3.0

    def __post_init__(self) -> None:
        r = np.asarray(self.rungs)
        if r.ndim != 1 or r.size == 0 or np.any(r < 1) or np.any(np.diff(r) <= 0):
            raise InvalidArgumentError(
                f"rungs must be strictly increasing iterations >= 1, got {self.rungs!r}"
            )
        if not (float(self.eta) > 1.0) or math.isinf(float(self.eta)):
            raise InvalidArgumentError(f"eta must be a finite number > 1, got {self.eta!r}")

    @classmethod
    def geometric(cls, first: int, eta: float, horizon: int) -> "Rungs":
        """Rungs at ``first * eta**i`` below ``horizon``."""
        if first < 1 or horizon <= first:
            raise InvalidArgumentError(f"need 1 <= first < horizon, got first={first}, horizon={horizon}")
        rungs, r = [], float(first)
        while r < horizon:
            rungs.append(int(round(r)))
            r *= eta
        return cls(tuple(sorted(set(rungs))), eta)

    def survival(self, k: np.ndarray) -> np.ndarray:
        k = np.asarray(k)
        passed = np.searchsorted(np.asarray(self.rungs), k, side="left")
        return float(self.eta) ** (-passed.astype(np.float64))


@dataclass(frozen=True)
class Empirical(Termination):
    """Survival from observed lengths (last iteration) of comparable past jobs."""

    lengths: tuple[int, ...]

    def __post_init__(self) -> None:
        n = np.asarray(self.lengths)
        if n.ndim != 1 or n.size == 0 or np.any(n < 1):
            raise InvalidArgumentError("lengths must be a non-empty list of job lengths >= 1 iteration")

    def survival(self, k: np.ndarray) -> np.ndarray:
        n = np.sort(np.asarray(self.lengths))
        k = np.asarray(k)
        return 1.0 - np.searchsorted(n, k, side="left") / n.size


def conditional_survival(termination: Termination | None, start: int, horizon: int) -> np.ndarray:
    """``S_rel[k] = P(K >= start + k | K >= start + 1)`` for k = 0..horizon+1.

    ``S_rel[0] = S_rel[1] = 1`` and ``S_rel[horizon + 1] = 0``: the plan ends at the
    horizon whatever happens.
    """
    s = np.ones(horizon + 2)
    s[horizon + 1] = 0.0
    if termination is None:
        return s
    if not isinstance(termination, Termination):
        raise InvalidArgumentError(
            f"termination must be a Termination model (Rungs, ExponentialTermination, "
            f"Empirical, NoTermination) or None; got {type(termination).__name__}"
        )
    k = start + np.arange(1, horizon + 1)
    raw = np.asarray(termination.survival(k), dtype=np.float64)
    if raw[0] <= 0:
        raise InvalidArgumentError(
            f"the termination model says the job is already over at iteration {start + 1}; "
            "plan only for jobs that are still running"
        )
    s[1:horizon + 1] = np.minimum.accumulate(np.clip(raw / raw[0], 0.0, 1.0))
    return s
