"""What the manager measures: iteration times with and without a background write, and
the snapshot, persist, restore and interference costs the plan is built from."""

from __future__ import annotations

import math
import statistics
from collections import deque

KINDS = ("snapshot", "persist", "restore", "interference")


class Costs:
    """Medians of recent measurements; NaN/0 before the first one."""

    def __init__(self, restart_cost: float | None = None):
        self.restart_cost = restart_cost
        self.intervals: deque[float] = deque(maxlen=256)        # with no background job
        self.busy_intervals: deque[float] = deque(maxlen=256)   # with one running
        self._excess = 0.0              # iteration time lost to the current job's contention
        self._tau_ref: tuple[float, float] | None = None        # see reference()
        self._samples: dict[str, deque] = {k: deque(maxlen=5) for k in KINDS}

    def add(self, kind: str, seconds: float) -> None:
        self._samples[kind].append(seconds)

    def load(self, m: dict) -> None:
        """The costs a restored checkpoint's manager measured (its manager section)."""
        for k in ("snapshot", "interference", "persist"):
            if m.get(k) is not None:
                self.add(k, float(m[k]))
        if isinstance(m.get("iter_time"), float) and math.isfinite(m["iter_time"]):
            self.intervals.append(m["iter_time"])

    def clear(self, kind: str) -> None:
        self._samples[kind].clear()

    def cost(self, kind: str) -> float:
        values = self._samples[kind]
        return statistics.median(list(values)) if values else 0.0

    def job_started(self) -> None:
        """A background job starts: iterations from now on are compared with the
        reference taken here."""
        self.book()
        self._tau_ref = self.reference() if len(self.intervals) >= 8 else None

    def record(self, dt: float, job_running: bool) -> None:
        """Keep iteration times apart by whether a background job ran alongside.

        The difference is the contention of the background write with training (CPU
        cores, memory bandwidth, the GIL): time each checkpoint costs besides its stall.
        """
        if not job_running:
            self.intervals.append(dt)
            return
        self.busy_intervals.append(dt)
        if self._tau_ref is not None:
            mean, cap = self._tau_ref
            self._excess += min(dt, cap) - mean

    def book(self) -> None:
        """Record the contention of the job that just ended (if any iteration ran beside it)."""
        if self._excess:
            self._samples["interference"].append(self._excess)
        self._excess = 0.0

    def iter_time(self) -> float:
        """Seconds per iteration without a background job (all iterations if too few)."""
        if len(self.intervals) >= 8 or not self.busy_intervals:
            pool = self.intervals
        else:
            pool = list(self.intervals) + list(self.busy_intervals)
        return statistics.median(list(pool)) if pool else float("nan")

    def reference(self) -> tuple[float, float]:
        """(mean, cap) of the iteration time without a job: intervals are capped at 10x the
        median (an evaluation pass, a pause), and the mean of the capped ones is the
        reference. Means, not medians, on both sides: a write that stalls one iteration
        out of many must count, and the skew of noisy timings cancels."""
        cap = 10 * statistics.median(list(self.intervals))
        return statistics.fmean(min(x, cap) for x in list(self.intervals)), cap

    def checkpoint_cost(self) -> float:
        """Time one checkpoint costs the loop: the snapshot stall plus the measured
        contention of its background write (clamped at 0)."""
        return self.cost("snapshot") + max(0.0, self.cost("interference"))

    def restart(self) -> float:
        """Seconds to load a checkpoint: given, measured, or estimated by the persist time."""
        if self.restart_cost is not None:
            return float(self.restart_cost)
        if self._samples["restore"]:
            return self.cost("restore")
        return self.cost("persist")

    def summary(self) -> dict[str, float]:
        return {"iteration": self.iter_time(), "snapshot": self.cost("snapshot"),
                "interference": max(0.0, self.cost("interference")),
                "checkpoint": self.checkpoint_cost(),
                "persist": self.cost("persist"), "restart": self.restart()}
