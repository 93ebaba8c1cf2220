"""SIGTERM: noted when it arrives, acted on between iterations (an emergency checkpoint),
then handed to the handler that was installed before.

Under a process group of several ranks (DDP) the ranks must act at the same iteration:
one that left the loop alone would leave the others waiting in their next collective,
and the writer would never write. Each iteration the ranks agree on a pending SIGTERM
(an all-reduce of one flag), and before handing it on they wait for each other, so that
no rank exits before the writer's checkpoint is durable."""

from __future__ import annotations

import signal
import threading
from typing import Any

from ..errors import InvalidArgumentError

SIGTERM_EXIT = 128 + signal.SIGTERM


class SigtermHook:
    """Installed in the main thread only (Python delivers signals only there)."""

    def __init__(self, group: bool = False):
        """``group``: agree with the other ranks of the default process group."""
        if threading.current_thread() is not threading.main_thread():
            raise InvalidArgumentError("sigterm=True needs the manager to be created in the "
                                       "main thread (Python delivers signals only there)")
        self.pending = False
        self._group = group
        prev = signal.signal(signal.SIGTERM, self._on_sigterm)
        self._prev: Any = signal.SIG_DFL if prev is None else prev   # None: set from C

    def _on_sigterm(self, signum, frame) -> None:
        self.pending = True             # acted on at the next step(), between iterations

    def due(self) -> bool:
        """Whether to act now: a SIGTERM pending here or, in a group, on any rank."""
        if not self._group:
            return self.pending
        import torch
        import torch.distributed as dist
        cuda = "nccl" in str(dist.get_backend()).lower()
        flag = torch.tensor([int(self.pending)],
                            device=f"cuda:{torch.cuda.current_device()}" if cuda else "cpu")
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        self.pending = bool(flag.item())
        return self.pending

    def uninstall(self) -> Any:
        """Put the previous handler back; returns it (None if already uninstalled)."""
        prev, self._prev = self._prev, None
        if prev is not None:
            signal.signal(signal.SIGTERM, prev)
        return prev

    def pass_on(self) -> None:
        """After the emergency checkpoint (in a group, once every rank is past it): call
        the previous handler, or exit with 143."""
        self.pending = False
        if self._group:
            import torch.distributed as dist
            dist.barrier()
        prev = self.uninstall()
        if callable(prev):
            prev(signal.SIGTERM, None)
        elif prev != signal.SIG_IGN:
            raise SystemExit(SIGTERM_EXIT)
