"""The result of :func:`lcckpt.schedule.solve`: where to checkpoint, and why.

A plan is a value: the sorted iterations (counted from the start of the planned
horizon, 1..horizon) after which to checkpoint, the expected costs under the
policy's accounting and in plain seconds, and what ``explain(k)`` needs to say why
the interval near iteration k is what it is. It does not re-plan or act.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from ..errors import InvalidArgumentError
from .problem import Problem


@dataclass(frozen=True, eq=False)
class Plan:
    """Checkpoint after each of ``iterations`` (relative to ``start``; 1..horizon).

    ``expected_overhead``: seconds under the policy's accounting (lost work weighted
    by the value of progress, stalls and restarts in plain seconds);
    ``expected_time_overhead``: plain seconds; ``expected_failures``: a count.
    ``components`` / ``time_components`` split the two overheads into stall,
    lost work, restart, downtime and durability lag.
    """

    iterations: tuple[int, ...]
    expected_overhead: float
    expected_time_overhead: float
    expected_failures: float
    horizon: int
    start: int
    policy: str
    method: str
    components: dict = field(default_factory=dict)
    time_components: dict = field(default_factory=dict)
    notes: tuple[str, ...] = ()
    curve: object = field(default=None, repr=False)
    termination: object = field(default=None, repr=False)
    weights: np.ndarray = field(default=None, repr=False)
    survival: np.ndarray = field(default=None, repr=False)
    problem: Problem = field(default=None, repr=False)

    @property
    def controllable_overhead(self) -> float:
        """Overhead minus the (R + D) per failure no schedule can avoid (policy accounting)."""
        c = self.components
        return float(c.get("stall", 0.0) + c.get("lost", 0.0) + c.get("lag", 0.0))

    def next_checkpoint(self, k: int) -> int | None:
        """The first planned checkpoint at or after iteration ``k``, or None."""
        i = int(np.searchsorted(np.asarray(self.iterations, dtype=np.int64), k, side="left"))
        return self.iterations[i] if i < len(self.iterations) else None

    def explain(self, k: int) -> str:
        """Why the checkpoint interval around iteration ``k`` (1..horizon) is what it is."""
        if isinstance(k, bool) or not isinstance(k, (int, np.integer)) or not 1 <= k <= self.horizon:
            raise InvalidArgumentError(
                f"explain(k) needs an iteration 1..{self.horizon} of this plan, got {k!r}"
            )
        k = int(k)
        p = self.problem
        its = np.asarray(self.iterations, dtype=np.int64)
        i = int(np.searchsorted(its, k, side="left"))
        prev = int(its[i - 1]) if i > 0 else 0
        nxt = int(its[i]) if i < its.size else None
        lam = float(p.lam[k - 1])
        c = float(p.ckpt[k - 1])
        u = float(self.weights[k - 1])
        tau = float(p.tau[k - 1])
        lines = [f"iteration {k} of {self.horizon} (absolute {self.start + k}); "
                 f"policy {self.policy!r}, method {self.method!r}"]
        if nxt is None:
            lines.append(f"no checkpoint after iteration {prev}: finishing the last "
                         f"{self.horizon - prev} iterations without one is expected to cost less")
        else:
            gap = nxt - prev
            secs = float(p.t[nxt] - p.t[prev])
            lines.append(f"segment {prev} -> {nxt}: {gap} iterations, {secs:.4g} s of work")
        mtbf = math.inf if lam == 0 else 1.0 / lam
        young = math.sqrt(2.0 * c * mtbf) if lam > 0 else math.inf
        local = math.sqrt(2.0 * c / (lam * u)) if lam * u > 0 else math.inf
        lines.append(f"failure rate 1/{mtbf:.4g} s, checkpoint stall {c:.4g} s: "
                     f"Young interval sqrt(2*C*MTBF) = {young:.4g} s ({young / tau:.4g} iterations)")
        why = []
        if self.curve is not None:
            why.append(f"loss-curve progress rate {float(self.curve.rate(self.start + k)):.3g}/iteration "
                       f"({self.curve.family} fit)")
        if self.survival is not None and self.termination is not None:
            why.append(f"P(job still wanted) {float(self.survival[k]):.3g}")
        lines.append(f"value of work here u = {u:.3g} x average"
                     + (f" ({'; '.join(why)})" if why else "")
                     + f": local rule sqrt(2*C/(lambda*u)) = {local:.4g} s ({local / tau:.4g} iterations)")
        lines.append(f"plan: {len(self.iterations)} checkpoints, expected overhead "
                     f"{self.expected_overhead:.4g} s ({self.expected_time_overhead:.4g} s plain time), "
                     f"{self.expected_failures:.3g} failures expected")
        lines.extend(self.notes)
        return "\n".join(lines)

    def to_dict(self) -> dict:
        """A JSON-able summary (no arrays)."""
        return dict(iterations=list(self.iterations), expected_overhead=self.expected_overhead,
                    expected_time_overhead=self.expected_time_overhead,
                    expected_failures=self.expected_failures, horizon=self.horizon,
                    start=self.start, policy=self.policy, method=self.method,
                    components=self.components, time_components=self.time_components,
                    notes=list(self.notes))
