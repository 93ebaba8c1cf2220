"""How far training has moved a tensor since its chain's keyframe, without a copy of it.

A chain's default target bounds each restored tensor's error by a share of its
*movement*, ``||u - k||₂`` with ``k`` the tensor in the chain's keyframe (zeros for a
tensor first saved after it): a fine-tune that moves a pretrained encoder by 1% of its
norm keeps that 1%, where a target relative to ``||u||`` would let the error swallow it.

Keeping ``k`` would cost the writer a third copy of the state. A :class:`Movement` keeps
``k`` itself only for small tensors; for larger ones it keeps a linear sketch of ``k``
(:mod:`lcckpt.codec.kernels.sketch`, :data:`BUCKETS` fp64 values) and estimates the movement
from the sketch of ``u``: unbiased in the square, with a relative standard deviation
below ``sqrt(2/BUCKETS)`` (2.2%, so about 1.1% on the norm) whatever the values, and
scaled down by :data:`SAFETY` (three of those deviations) so the target is seldom
overestimated (with few changed elements a collision of two large ones can pass that:
docs/chain.md). While the reference a delta is coded against is still the base (the
first delta after a keyframe or a merge), the movement is that delta's own norm, which
the delta's survey measures exactly: no estimate, and no sketch of ``u`` to take.
A base that holds NaN/Inf (a keyframe of a diverged step, or a mask buffer of ``-inf``)
measures nothing: the movement of a finite ``u`` is then taken from zeros, ``||u||``.
It knows nothing of files or chains.
"""

from __future__ import annotations

import math

import numpy as np

from ..util.pool import run_tasks
from .kernels import sketch as sk

__all__ = ["Movement", "BUCKETS", "CHUNK", "LOG2", "SAFETY", "copy_sketched"]

LOG2 = 12
BUCKETS = 1 << LOG2         # sketch size; tensors this small keep their base exactly
SAFETY = 1 - 3 * np.sqrt(2 / BUCKETS) / 2   # ~0.967: a lower estimate of the norm
CHUNK = 1 << 20              # elements per sketch task (a part of its own)


def sketch(x: np.ndarray) -> tuple[np.ndarray, float]:
    """The :data:`BUCKETS`-value sketch of flat ``x`` and its squared norm (fp64)."""
    n = x.size
    nch = max(1, -(-n // CHUNK))
    parts = np.zeros((nch, BUCKETS))
    ss = run_tasks(lambda c: sk.add_sketch(x, c * CHUNK, min(n, (c + 1) * CHUNK),
                                           parts[c], LOG2), nch)
    return parts.sum(axis=0), float(sum(ss))


def copy_sketched(dst: np.ndarray, src: np.ndarray, parts: np.ndarray, c: int) -> None:
    """Chunk ``c`` of ``dst[:] = src`` with its part of :func:`sketch` of ``src``."""
    lo, hi = c * CHUNK, min(src.size, (c + 1) * CHUNK)
    sk.copy_sketch(dst, src, lo, hi, parts[c], LOG2)


class Movement:
    """The base (keyframe) of one tracked tensor, kept to measure ``||u - base||₂``."""

    __slots__ = ("n", "_base", "parts", "at_base")

    def __init__(self, base: np.ndarray | None, n: int | None = None):
        """``base``: the flat keyframe values (None: zeros of ``n`` elements)."""
        self.n = base.size if base is not None else int(n)
        self.parts = None
        # the reference deltas are coded against is still ``base`` itself; the owner
        # clears this once a delta advances it
        self.at_base = base is not None
        if base is None:
            self._base = None
        elif base.size <= BUCKETS:
            with np.errstate(invalid="ignore"):     # a signalling NaN is cast quiet
                self._base = base.astype(np.float64)
        else:
            self._base = sketch(base)[0]

    @classmethod
    def pending(cls, n: int) -> "Movement":
        """The base of a large tensor whose sketch is still to be added, a chunk of
        :data:`CHUNK` elements at a time, into :attr:`parts` (a keyframe's reference
        copy takes it in the same read: :func:`copy_sketched`); :meth:`finish` then
        makes it what ``Movement(base)`` would be, bit for bit."""
        m = cls(None, n)
        m.parts = np.zeros((max(1, -(-n // CHUNK)), BUCKETS))
        m.at_base = True
        return m

    def finish(self) -> None:
        """The parts summed into the base, once all were added (a no-op after)."""
        if self.parts is not None:
            self._base, self.parts = self.parts.sum(axis=0), None

    @property
    def sketched(self) -> bool:
        """Whether :meth:`measure` needs the sketch of ``u`` (a large tensor's base that
        the reference has moved away from)."""
        return (self._base is not None or self.parts is not None) and self.n > BUCKETS \
            and not self.at_base

    def measure(self, u: np.ndarray, sketch_of_u: tuple | None = None,
                to_ref_sq: float | None = None) -> tuple[float, float]:
        """``(movement, ||u||)`` for flat ``u``: the movement exact for a zero or small
        base, or while the reference is the base, else the sketch's lower estimate.
        ``sketch_of_u``: :func:`sketch` of ``u`` (or ``(None, ||u||²)`` when not
        :attr:`sketched`), when the caller took it already (in the delta's one read of
        the state); ``to_ref_sq``: ``||u - ref||²`` against the delta's reference, which
        is the movement's square while :attr:`at_base`."""
        with np.errstate(invalid="ignore", over="ignore"):
            moved, norm = self._measure(u, sketch_of_u, to_ref_sq)
        if not math.isfinite(moved) and math.isfinite(norm):
            return norm, norm           # a base (or reference) of NaN/Inf: from zeros
        return moved, norm

    def _measure(self, u, sketch_of_u, to_ref_sq) -> tuple[float, float]:
        if self.parts is not None:
            raise RuntimeError("the base's sketch is not finished (Movement.finish)")
        if self.at_base and to_ref_sq is not None and u.size > BUCKETS:
            if sketch_of_u is None:
                return float(np.sqrt(to_ref_sq)), float(np.linalg.norm(u.astype(np.float64)))
            return float(np.sqrt(to_ref_sq)), float(np.sqrt(sketch_of_u[1]))
        if self._base is None:
            if u.size <= BUCKETS:
                norm = float(np.sqrt(np.dot(u.astype(np.float64), u.astype(np.float64))))
            else:
                norm = float(np.sqrt((sketch(u) if sketch_of_u is None else sketch_of_u)[1]))
            return norm, norm
        if u.size <= BUCKETS:
            u64 = u.astype(np.float64)
            return float(np.linalg.norm(u64 - self._base)), float(np.linalg.norm(u64))
        s, ss = sketch(u) if sketch_of_u is None else sketch_of_u
        return SAFETY * float(np.linalg.norm(s - self._base)), float(np.sqrt(ss))
