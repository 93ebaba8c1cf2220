"""Failure models: how often the job is interrupted.

A model turns job time into a failure rate. The solver needs one number per
iteration (the hazard while that iteration runs); the simulator samples failure
times. ``Exponential`` is the classic constant rate (per job: node MTBF divided by
node count). ``Piecewise`` is a non-homogeneous Poisson process whose rate varies
with job time. ``Weibull`` is a renewal process (the clock restarts at each
failure); the solver plans with its renewal density from a fresh start (high
early for shape < 1, tending to ``1 / mtbf``) as if failures were Poisson with that
rate, the simulator samples the renewals exactly, so the gap is measurable.
This module does not decide anything about checkpoints.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from ..errors import InvalidArgumentError


class FailureModel:
    """Base class; subclasses give :meth:`rate` and :attr:`mtbf`."""

    mtbf: float

    def rate(self, t: np.ndarray) -> np.ndarray:
        """Failure rate (1/s) the solver plans with at job times ``t`` (seconds)."""
        raise NotImplementedError

    def expected_failures(self, edges: np.ndarray) -> np.ndarray:
        """Expected failures in each interval between consecutive job times ``edges``."""
        edges = np.asarray(edges, dtype=np.float64)
        return self.rate(0.5 * (edges[:-1] + edges[1:])) * np.diff(edges)


@dataclass(frozen=True)
class Exponential(FailureModel):
    """Constant failure rate ``1 / mtbf``; ``mtbf=inf`` means no failures."""

    mtbf: float

    def __post_init__(self) -> None:
        _check_positive("mtbf", self.mtbf, allow_inf=True)

    def rate(self, t: np.ndarray) -> np.ndarray:
        return np.full(np.shape(t), 0.0 if math.isinf(self.mtbf) else 1.0 / self.mtbf)


@dataclass(frozen=True)
class Piecewise(FailureModel):
    """Non-homogeneous Poisson failures: rate ``rates[i]`` on ``[edges[i], edges[i+1])``.

    ``edges`` are job times in seconds starting at 0; the last rate holds after the
    last edge. Useful for infant mortality (high early rate) or a cluster that gets
    busier. ``mtbf`` is reported as ``1 / rates[-1]`` (the long-run rate).
    """

    edges: tuple[float, ...]
    rates: tuple[float, ...]

    def __post_init__(self) -> None:
        e = np.asarray(self.edges, dtype=np.float64)
        r = np.asarray(self.rates, dtype=np.float64)
        if e.ndim != 1 or r.shape != e.shape or e.size == 0 or e[0] != 0.0:
            raise InvalidArgumentError(
                "Piecewise needs equally long 1-D edges and rates with edges[0] == 0; "
                f"got {len(self.edges)} edges and {len(self.rates)} rates"
            )
        if np.any(np.diff(e) <= 0) or not np.all(np.isfinite(e)):
            raise InvalidArgumentError("Piecewise edges must be finite and strictly increasing")
        if np.any(~np.isfinite(r)) or np.any(r < 0):
            raise InvalidArgumentError("Piecewise rates must be finite and >= 0 (failures per second)")

    @property
    def mtbf(self) -> float:  # type: ignore[override]
        last = float(self.rates[-1])
        return math.inf if last == 0 else 1.0 / last

    def rate(self, t: np.ndarray) -> np.ndarray:
        idx = np.searchsorted(np.asarray(self.edges), np.asarray(t, dtype=np.float64), side="right") - 1
        return np.asarray(self.rates, dtype=np.float64)[np.clip(idx, 0, len(self.rates) - 1)]


@dataclass(frozen=True)
class Weibull(FailureModel):
    """Weibull renewal failures with ``shape`` k and mean time between failures ``mtbf``.

    k < 1 is the usual infant-mortality shape of cluster failure logs. The scale is
    ``mtbf / Gamma(1 + 1/k)``. The solver plans with the renewal density ``dM/dt``
    of a clock that starts fresh at the start of the plan.
    """

    shape: float
    mtbf: float

    def __post_init__(self) -> None:
        _check_positive("shape", self.shape)
        _check_positive("mtbf", self.mtbf)

    @property
    def scale(self) -> float:
        return self.mtbf / math.gamma(1.0 + 1.0 / self.shape)

    def rate(self, t: np.ndarray) -> np.ndarray:
        """Renewal density at job time ``t`` (the clock starts fresh at t = 0)."""
        t = np.asarray(t, dtype=np.float64)
        grid, m = self._renewal_function(float(np.max(t, initial=0.0)))
        h = grid[1] - grid[0]
        return np.interp(t, 0.5 * (grid[1:] + grid[:-1]), np.diff(m) / h)

    def expected_failures(self, edges: np.ndarray) -> np.ndarray:
        edges = np.asarray(edges, dtype=np.float64)
        grid, m = self._renewal_function(float(edges[-1]))
        return np.diff(np.interp(edges, grid, m))

    def _renewal_function(self, t_max: float, n: int = 4000):
        """``M(t)``, expected failures by t from a fresh start: M = F + M * dF (discretised)."""
        t_max = max(t_max, self.mtbf) * 1.001
        grid = np.linspace(0.0, t_max, n + 1)
        cdf = -np.expm1(-(grid / self.scale) ** self.shape)
        df = np.diff(cdf)
        m = np.zeros(n + 1)
        for i in range(1, n + 1):
            # M(t_i) = F(t_i) + sum_j M(t_i - s) dF over [s_j-1, s_j], trapezoid in M;
            # the j = 1 term holds M(t_i) itself and is solved for.
            back = m[i - 1::-1][:i]                       # M(t_i - s_j), j = 1..i
            acc = np.dot(back, df[:i]) + np.dot(back[:-1], df[1:i])
            m[i] = (cdf[i] + 0.5 * acc) / (1.0 - 0.5 * df[0])
        return grid, m


def as_failure_model(mtbf) -> FailureModel | None:
    """A model from a number (MTBF seconds) or a model; ``None`` for an array."""
    if isinstance(mtbf, FailureModel):
        return mtbf
    if np.ndim(mtbf) == 0:
        try:
            value = float(mtbf)
        except (TypeError, ValueError) as exc:
            raise InvalidArgumentError(
                f"mtbf must be seconds (a number), a per-iteration array or a FailureModel; got {mtbf!r}"
            ) from exc
        return Exponential(value)
    return None


def _check_positive(name: str, value: float, allow_inf: bool = False) -> None:
    try:
        v = float(value)
    except (TypeError, ValueError) as exc:
        raise InvalidArgumentError(f"{name} must be a number, got {value!r}") from exc
    if not (v > 0) or math.isnan(v) or (math.isinf(v) and not allow_inf):
        extra = " (inf allowed: no failures)" if allow_inf else ""
        raise InvalidArgumentError(f"{name} must be > 0{extra}, got {value!r}")
