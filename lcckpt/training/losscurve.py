"""The training loss as a compact curve of bin means, fed one value per iteration.

Values may be Python numbers or tensors on any device. Tensors are only detached and kept;
they are moved to the host in batches (:meth:`LossCurve.flush`, at most every
``FLUSH_EVERY`` values), so a CUDA loss costs one device synchronization per batch rather
than one per iteration. Bins double in width whenever there are more than ``MAX_BINS``, so
memory stays bounded however long the run.

It does not fit or smooth anything: the scheduler fits the curve.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import torch

from ..errors import InvalidArgumentError
from ..util.caller import warn_user

MAX_BINS = 512
FLUSH_EVERY = 1024
COUNTING = 3       # integer losses in a row that equal the loop's counter: warned once


class LossCurve:
    """Mean loss per bin of ``width`` iterations; NaN and Inf values are not counted."""

    def __init__(self) -> None:
        self.width = 1
        self.start = 0                      # iteration index of bin 0's first iteration
        self.sums: list[float] = []
        self.counts: list[int] = []
        self._pending: list[tuple[int, torch.Tensor]] = []
        self._counting = 0                  # integer losses in a row that were the counter

    def add(self, iteration: int, loss: Any) -> None:
        """Record the loss of ``iteration`` (1-based); tensors are converted later."""
        if isinstance(loss, torch.Tensor):
            if loss.numel() != 1:
                raise InvalidArgumentError(
                    f"step(loss) needs a scalar loss, got a tensor of shape {tuple(loss.shape)}; "
                    "pass loss.mean() or the value you minimize")
            self._pending.append((iteration, loss.detach()))
            if len(self._pending) >= FLUSH_EVERY:
                self.flush()
            return
        try:
            value = float(loss)
        except (TypeError, ValueError):
            raise InvalidArgumentError(
                f"step(loss) needs a number or a scalar tensor, got {type(loss).__name__}") from None
        self._check_counter(iteration, loss)
        self._put(iteration, value)

    def _check_counter(self, iteration: int, loss: Any) -> None:
        """``mgr.step(it)``, the loop's counter given as the loss, would plan checkpoints on a
        rising curve of step numbers: warned once, at the ``COUNTING``-th integer in a row
        that equals the iteration (counted from 0 or 1)."""
        if self._counting < 0:
            return                          # warned already
        if (isinstance(loss, (int, np.integer)) and not isinstance(loss, bool)
                and loss in (iteration, iteration - 1)):
            self._counting += 1
        else:
            self._counting = 0
        if self._counting == COUNTING:
            self._counting = -1
            warn_user(f"step(loss) got {loss} at iteration {iteration}, the loop's counter: the "
                      "convergence-aware plan reads it as the training loss; pass the loss (or "
                      "nothing: step())", UserWarning)

    def flush(self) -> None:
        """Move pending tensor losses to the host (one synchronization per device)."""
        if not self._pending:
            return
        pending, self._pending = self._pending, []
        by_device: dict[torch.device, list[tuple[int, torch.Tensor]]] = {}
        for it, t in pending:
            by_device.setdefault(t.device, []).append((it, t))
        for items in by_device.values():
            try:        # one stack, one copy to the host
                values = torch.stack([t for _, t in items]).reshape(-1).double().cpu().tolist()
            except RuntimeError:        # mixed dtypes: one at a time
                values = [t.double().item() for _, t in items]
            for (it, _), v in zip(items, values):
                self._put(it, v)

    def _put(self, iteration: int, value: float) -> None:
        if not math.isfinite(value):
            return
        if not self.counts:
            self.start = iteration - iteration % self.width
        b = (iteration - self.start) // self.width
        if b < 0:                           # older than the curve (after a rewind): drop
            return
        while b >= len(self.counts):
            self.sums.append(0.0)
            self.counts.append(0)
        self.sums[b] += value
        self.counts[b] += 1
        if len(self.counts) > MAX_BINS:
            self._coarsen()

    def _coarsen(self) -> None:
        if (self.start // self.width) % 2:   # keep bins aligned to multiples of the width
            self.sums.insert(0, 0.0)
            self.counts.insert(0, 0)
            self.start -= self.width
        if len(self.counts) % 2:
            self.sums.append(0.0)
            self.counts.append(0)
        self.sums = [a + b for a, b in zip(self.sums[::2], self.sums[1::2])]
        self.counts = [a + b for a, b in zip(self.counts[::2], self.counts[1::2])]
        self.width *= 2

    def points(self) -> tuple[np.ndarray, np.ndarray]:
        """(iterations, mean losses) of the non-empty bins; iteration = the bin's centre."""
        self.flush()
        counts = np.asarray(self.counts, dtype=np.float64)
        keep = counts > 0
        centres = self.start + self.width * np.arange(len(counts)) + (self.width - 1) / 2
        sums = np.asarray(self.sums, dtype=np.float64)
        return centres[keep], sums[keep] / counts[keep]

    def __len__(self) -> int:
        """Number of values recorded in the bins (pending tensors not yet counted)."""
        return int(sum(self.counts))

    def state(self) -> dict:
        """Storable state (plain Python values), for a checkpoint."""
        self.flush()
        return {"width": self.width, "start": self.start, "sums": list(self.sums),
                "counts": list(self.counts)}

    def load(self, state: dict, upto: int) -> None:
        """Restore :meth:`state`, keeping only what was recorded up to iteration ``upto``."""
        self._pending = []
        self.width, self.start = int(state["width"]), int(state["start"])
        self.sums = [float(x) for x in state["sums"]]
        self.counts = [int(x) for x in state["counts"]]
        last = (upto - self.start) // self.width + 1 if upto >= self.start else 0
        del self.sums[last:], self.counts[last:]
