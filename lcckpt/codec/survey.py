"""The survey: one read of a state and its reference before a delta's step is chosen.

Everything the step search needs from the tensor (finiteness, ``||u||²``, the least
value, the movement sketch, the magnitude histogram of ``u - ref`` that the
:class:`~lcckpt.codec.errmodel.ErrorModel` is built from) comes from one compiled pass
(:func:`lcckpt.codec.kernels.uniform.survey_range`), split over the pool for large tensors.
"""

import threading
from dataclasses import dataclass

import numpy as np

from ..util.pool import run_tasks, threads
from .errmodel import ErrorModel
from .kernels import uniform as uk


SURVEY_MIN = 1 << 16   # elements per survey task at least


@dataclass
class Survey:
    """What one read of a state and its reference tells before the step is chosen
    (:func:`lcckpt.codec.kernels.uniform.survey_range`): whether both are finite,
    ``||u||²``, the least element, the movement sketch of ``u`` (if asked) and the
    magnitude histogram of ``u - ref``. Three passes over memory become one."""
    finite: bool
    norm_sq: float
    least: float
    sketch: np.ndarray | None
    model: ErrorModel


def survey(u: np.ndarray, ref: np.ndarray | None, sketch_log2: int = 0,
           direction: np.ndarray | None = None) -> Survey:
    """:class:`Survey` of flat ``u`` against ``ref`` (None: zeros), on the thread pool;
    ``sketch_log2``: the sketch's log2 size (0: no sketch); ``direction``: a flat array
    of ``u``'s size that the restored error is to be orthogonal to (one more read, of
    it, ``u`` and ``ref``: :meth:`ErrorModel.steer`)."""
    n = u.size
    tasks = max(1, min(threads(), -(-n // SURVEY_MIN)))
    if tasks == 1:
        return _survey_one(u, ref, sketch_log2, direction)
    per = -(-n // tasks)
    out = np.zeros((tasks, 3))
    out[:, 2] = np.inf
    sk = np.zeros((tasks, 1 << sketch_log2 if sketch_log2 else 1))
    cnt = np.zeros((tasks, uk.MAG_BINS + 1), np.int64)
    s1 = np.zeros((tasks, uk.MAG_BINS + 1))
    s2 = np.zeros((tasks, uk.MAG_BINS + 1))
    span = np.array([[uk.MAG_BINS + 1, -1]] * tasks, np.int64)
    use_ref = ref is not None
    r = ref if use_ref else u
    run_tasks(lambda t: uk.survey_range(u, r, use_ref, t * per, min(n, (t + 1) * per), out[t],
                                        sk[t], sketch_log2, cnt[t], s1[t], s2[t], True,
                                        span[t]), tasks)
    with np.errstate(invalid="ignore", over="ignore"):     # NaN/Inf: not finite, refused
        hist = [h.sum(axis=0) for h in (cnt, s1, s2)]
        sketch = sk.sum(axis=0) if sketch_log2 else None
    model = ErrorModel(n, *hist, (int(span[:, 0].min()), int(span[:, 1].max())))
    finite = bool(np.all(out[:, 0] == 0.0))
    least = float(out[:, 2].min()) if n else 0.0
    # a tensor without negative values is floored (raised levels, which the steered
    # step's sums miss): not steered
    if direction is not None and finite and least < 0:
        a = np.zeros((tasks, uk.MAG_BINS + 1))
        b = np.zeros((tasks, uk.MAG_BINS + 1))
        run_tasks(lambda t: uk.direction_range(u, r, use_ref, direction, t * per,
                                               min(n, (t + 1) * per), a[t], b[t]), tasks)
        model.steer(a.sum(axis=0), b.sum(axis=0), hist[0])
    return Survey(finite, float(out[:, 1].sum()), least, sketch, model)


_scratch = threading.local()     # per thread: a single-task survey's histograms, kept zero


def _survey_one(u: np.ndarray, ref: np.ndarray | None, sketch_log2: int,
                direction: np.ndarray | None) -> Survey:
    """:func:`survey` in one task, on this thread: the same kernel and the same numbers,
    into histograms this thread keeps and clears again over the bins counted into (a
    small tensor's survey spent more time allocating and scanning the 16K bins than
    reading its elements)."""
    kept = not getattr(_scratch, "busy", False)    # else a survey this one interrupted
    h = getattr(_scratch, "hist", None) if kept else None      # (a signal handler's save)
    if h is None:
        h = (np.zeros(uk.MAG_BINS + 1, np.int64), np.zeros(uk.MAG_BINS + 1),
             np.zeros(uk.MAG_BINS + 1))
        if kept:
            _scratch.hist = h
    cnt, s1, s2 = h
    out = np.array([0.0, 0.0, np.inf])
    sk = np.zeros(1 << sketch_log2 if sketch_log2 else 1)
    span = np.array([uk.MAG_BINS + 1, -1], np.int64)
    use_ref = ref is not None
    r = ref if use_ref else u
    try:
        _scratch.busy = True
        uk.survey_range(u, r, use_ref, 0, u.size, out, sk, sketch_log2, cnt, s1, s2, True,
                        span)
        model = ErrorModel(u.size, cnt, s1, s2, (int(span[0]), int(span[1])))
        finite = bool(out[0] == 0.0)             # NaN/Inf: not finite, refused
        least = float(out[2]) if u.size else 0.0
        if direction is not None and finite and least < 0:      # as in survey
            a = np.zeros(uk.MAG_BINS + 1)
            b = np.zeros(uk.MAG_BINS + 1)
            uk.direction_range(u, r, use_ref, direction, 0, u.size, a, b)
            model.steer(a, b, cnt)
    finally:
        if kept:
            _scratch.busy = False
            if span[0] <= span[1]:
                for x in h:
                    x[span[0]:span[1] + 1] = 0
    return Survey(finite, float(out[1]), least, sk if sketch_log2 else None, model)
