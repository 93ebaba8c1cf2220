"""Tensors a writer reads from the live state, with their version counters as it found
them: the one check behind ``CheckpointManager(background="overlap")`` and the
distributed ``staging="live"``.

An in-place change of a tensor bumps its counter (changes through ``.data`` do not), so a
writer that notes the counters when it starts reading and compares them once it has
read everything knows whether what it wrote is one state. :meth:`VersionWatch.release`
makes that comparison once and sets :attr:`VersionWatch.read`, which whoever would
change the tensors next (an optimizer's step) waits for.
"""

from __future__ import annotations

import threading

import torch


class VersionWatch:
    """``(path, tensor)`` pairs and their version counters, compared once."""

    def __init__(self, tensors: list[tuple[str, torch.Tensor]]):
        self._seen = [(path, t, t._version) for path, t in tensors]
        self.changed: list[str] | None = None     # set by release()
        self.read = threading.Event()

    def release(self) -> list[str]:
        """The writer reads the tensors no more: the paths of those changed in place
        since (compared at the first call), and :attr:`read` set."""
        if self.changed is None:
            self.changed = [path for path, t, v in self._seen if t._version != v]
            self._seen = []
        self.read.set()
        return self.changed

    def wait(self, busy: "threading.Thread | None" = None, done=None) -> None:
        """Until :meth:`release`, or until the writer is gone (``busy`` not alive, or
        ``done()`` true): a writer that failed before it released must not hang anyone."""
        while not self.read.wait(0.05):
            if (busy is not None and not busy.is_alive()) or (done is not None and done()):
                return
