"""Failure models: how often the job is interrupted.

A model turns job time into a failure rate. The solver needs one number per
iteration (the hazard while that iteration runs); the simulator samples failure
times. ``Exponential`` is the classic constant rate (per job: node MTBF divided by
node count). ``Piecewise`` is a non-homogeneous Poisson process whose rate varies
with job time. ``Weibull`` is a renewal process (the clock restarts at each
failure); the solver can only plan for its long-run rate ``1 / mtbf``, the
simulator samples it exactly, so the gap between the two is measurable.
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
    ``mtbf / Gamma(1 + 1/k)``. The solver plans with the long-run rate ``1/mtbf``.
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
        return np.full(np.shape(t), 1.0 / self.mtbf)


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
