"""Background saves from the live state (``async_save(..., staging="live")``).

DCP's async saves stage the state first: a host copy of every tensor, which the save then
works from while training goes on. For a rank whose state fills its host memory that copy
is what does not fit. A live save skips it: the background thread encodes the tensors as
they are, one piece at a time (a device tensor is copied to the host piece by piece), and
the training loop must leave them alone until the save has read them, which
:meth:`~lcckpt.distributed.DistributedCheckpointer.wait_before` arranges for an optimizer.

Anything that changes a tensor in place meanwhile bumps its version counter. Each rank
compares the counters once it has written its share (its last byte, before that is
synced and the save commits); a change fails the save on every rank with
:class:`~lcckpt.errors.StateChangedError`, so no torn step becomes visible, and the
previous step stays the newest. From then on this rank no longer reads the state, and
``wait_before`` lets its optimizer step while the save syncs and commits.
"""

from __future__ import annotations

from typing import Any

import torch

from ..errors import StateChangedError
from ..util.versions import VersionWatch


class LiveStager:
    """A DCP ``AsyncStager`` that stages nothing: the save reads the state itself."""

    @property
    def should_synchronize_after_execute(self) -> bool:
        return False

    def stage(self, state_dict):
        return state_dict

    def synchronize_staging(self) -> None:
        pass

    def close(self) -> None:
        pass


def _local(t: torch.Tensor) -> torch.Tensor:
    return t._local_tensor if hasattr(t, "_local_tensor") else t    # a DTensor's shard


def _walk(obj: Any, path: str, out: list) -> None:
    if isinstance(obj, torch.Tensor):
        out.append((path, _local(obj)))
    elif isinstance(obj, dict):
        for k, v in obj.items():
            _walk(v, f"{path}[{k!r}]", out)
    elif isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            _walk(v, f"{path}[{i}]", out)
    elif hasattr(obj, "state_dict") and callable(obj.state_dict):   # a DCP Stateful
        _walk(obj.state_dict(), path, out)


class Versions(VersionWatch):
    """The version counters of every tensor of a state, as a live save found them."""

    def __init__(self, state: Any, step: int):
        tensors: list = []
        _walk(state, "state", tensors)
        super().__init__(tensors)
        self.step = step

    def check(self) -> None:
        """Raise :class:`StateChangedError` if a tensor changed in place before
        :meth:`release` (which this calls, if nothing did)."""
        changed = self.release()
        if changed:
            raise changed_error(changed, f"step {self.step}")


def changed_error(changed: list[str], what: str) -> StateChangedError:
    """The error of a live save of ``what`` during which the tensors at paths ``changed``
    changed in place."""
    more = f" (and {len(changed) - 1} more)" if len(changed) > 1 else ""
    return StateChangedError(
        f"{changed[0]}{more} changed in place while {what} was written from the live state "
        "(staging='live'), so the step was not committed. Leave the state alone until the "
        "save is done (wait_before(optimizer), or wait()), or use staging='copy'")
