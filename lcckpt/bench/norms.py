"""Squared distances between states for the benchmarks' error columns, NaN/Inf-aware.

A model may hold NaN or Inf by design (an attention mask of ``-inf`` registered as a
buffer): a restore that gives those elements back as they were has no error there, and
a norm leaves them out; one that does not is infinitely wrong.
"""

from __future__ import annotations

import numpy as np


def sq_dist(a: np.ndarray, b: np.ndarray | None = None) -> float:
    """``||a - b||²`` in float64 (``||a||²`` without ``b``). An element that is the same
    NaN/Inf in both counts 0, as one that is NaN/Inf in ``a`` alone does in a norm; one
    that differs counts inf."""
    if b is None:
        return float(np.sum(a[np.isfinite(a)] ** 2))
    with np.errstate(invalid="ignore", over="ignore"):
        d = np.where((a == b) | (np.isnan(a) & np.isnan(b)), 0.0, a - b)
        return float(np.sum(np.where(np.isnan(d), np.inf, d) ** 2))
