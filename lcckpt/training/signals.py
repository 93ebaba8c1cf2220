"""SIGTERM (or the signals a manager names, such as the SIGUSR1 that SLURM's
``--signal=USR1@90`` sends first): noted when it arrives, acted on between iterations (an
emergency checkpoint), then handed to the handler that was installed before.

Under a process group of several ranks (DDP) the ranks must act at the same iteration:
one that left the loop alone would leave the others waiting in their next collective,
and the writer would never write. About once a second (every so many iterations, a
count the ranks agree on) they agree on a pending SIGTERM (an all-reduce of a flag and
the next count), and before handing it on they wait for each other, so that no rank
exits before the writer's checkpoint is durable. That holds only where every
rank has such a manager (a loop that creates one on rank 0 alone would wait in the first
all-reduce for ever), so each registers in the group's store first
(:func:`every_rank_has_one`) and agrees with the others only if all of them did."""

from __future__ import annotations

import os
import signal
import threading
from typing import Any

from ..errors import InvalidArgumentError
from .ranks import all_meet, comm_device, in_group

AGREE_EVERY = 1.0             # seconds between two agreements on a SIGTERM, about ...
AGREE_MAX_GAP = 100           # ... and at most this many iterations


def every_rank_has_one(wait: float | None = None) -> bool:
    """Whether every rank of the default process group creates a manager with
    ``sigterm=True`` (:func:`lcckpt.training.ranks.all_meet`)."""
    return all_meet("sigterm", "sigterm=True: not every rank of the process group created "
                    "a CheckpointManager with it, so a SIGTERM is acted on by each rank "
                    "alone and a rank that stops may leave the others waiting in a "
                    "collective; create the manager on every rank (docs/manager.md)", wait)


_IGNORED_BY_DEFAULT = {getattr(signal, n) for n in ("SIGCHLD", "SIGCONT", "SIGURG", "SIGWINCH")
                       if hasattr(signal, n)}


def signals_of(sigterm) -> tuple[int, ...]:
    """The signals a manager's ``sigterm`` names: True is SIGTERM; else a signal, or
    several (SLURM's ``--signal=USR1@90`` warns with SIGUSR1 before its SIGTERM)."""
    if sigterm is True:
        return (signal.SIGTERM,)
    many = sigterm if isinstance(sigterm, (list, tuple, set, frozenset)) else (sigterm,)
    out = []
    for s in many:
        try:
            sig = signal.Signals(s) if type(s) is not bool else None
        except (TypeError, ValueError):
            sig = None
        if sig is None or sig in (getattr(signal, "SIGKILL", None),
                                  getattr(signal, "SIGSTOP", None)) or sig in _IGNORED_BY_DEFAULT:
            raise InvalidArgumentError(
                f"sigterm must be True, False or the signals to checkpoint on (such as "
                f"signal.SIGUSR1), got {s!r}: a signal that can be caught and that ends a "
                "process by default")
        out.append(sig)
    if not out:
        raise InvalidArgumentError("sigterm=() names no signal: pass False for none")
    return tuple(dict.fromkeys(out))


class SigtermHook:
    """Installed in the main thread only (Python delivers signals only there)."""

    def __init__(self, group: bool | None = None, signals: tuple[int, ...] = (signal.SIGTERM,)):
        """``group``: agree with the other ranks of the default process group (None: if
        there is one of several ranks and each of them has a hook). ``signals``: those
        acted on (SIGTERM unless told)."""
        if threading.current_thread() is not threading.main_thread():
            raise InvalidArgumentError("sigterm=True needs the manager to be created in the "
                                       "main thread (Python delivers signals only there)")
        self.pending = False
        self.received: int | None = None    # the signal that came (the last, if several)
        self._group = in_group() and every_rank_has_one() if group is None else group
        self._next = 0                  # the iteration of the next agreement (a group's)
        self._pid = os.getpid()
        self._prev: dict[int, Any] | None = {}
        for sig in signals:
            prev = signal.signal(sig, self._on_sigterm)
            self._prev[sig] = signal.SIG_DFL if prev is None else prev   # None: set from C

    @property
    def group(self) -> bool:
        """Whether the ranks of a process group agree on acting (then only at a step)."""
        return self._group

    def _on_sigterm(self, signum, frame) -> None:
        if os.getpid() != self._pid:    # a forked child (a worker) has no manager to act:
            prev = (self.uninstall() or {}).get(signum)   # it ignored SIGTERM, and
            if callable(prev):                            # terminate() hung on it
                prev(signum, frame)
            elif prev == signal.SIG_DFL:
                os.kill(os.getpid(), signum)
            return
        self.pending, self.received = True, signum    # acted on at the next step()

    def due(self, iteration: int = 0, iter_time=lambda: float("nan")) -> bool:
        """Whether to act now: a SIGTERM pending here, or in a group, at an iteration the
        ranks agree at, on any rank. ``iter_time()``: seconds an iteration takes, for the
        gap to the next agreement (each rank proposes one; the shortest is taken)."""
        if not self._group:
            return self.pending
        if iteration < self._next:
            return False
        import torch
        import torch.distributed as dist
        t = iter_time()
        gap = max(1, min(AGREE_MAX_GAP, int(AGREE_EVERY / t))) if t > 0 else 1
        flag = torch.tensor([int(self.pending), -gap], device=comm_device())
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        pending, gap = flag.tolist()
        self._next, self.pending = iteration - gap, bool(pending)
        return self.pending

    def generators(self, writer: bool) -> dict | None:
        """At the iteration the ranks agreed to act at: every rank's random generators,
        on the ``writer`` (for its checkpoint: each rank resumes its own); None elsewhere
        and without a group."""
        if not self._group:
            return None
        from .broadcast import gather_generators
        return gather_generators(writer)

    def uninstall(self) -> dict[int, Any] | None:
        """Put the previous handlers back; returns them by signal (None if already)."""
        prev, self._prev = self._prev, None
        for sig, handler in (prev or {}).items():
            signal.signal(sig, handler)
        return prev

    def pass_on(self) -> None:
        """After the emergency checkpoint (in a group, once every rank is past it): call
        the previous handler of the signal that came, or exit with 128 + its number (143
        for SIGTERM, and on a rank that received none)."""
        self.pending = False
        if self._group:
            import torch.distributed as dist
            dist.barrier()
        sig = self.received or signal.SIGTERM
        prev = (self.uninstall() or {}).get(sig, signal.SIG_DFL)
        if callable(prev):
            prev(sig, None)
        elif prev != signal.SIG_IGN:
            raise SystemExit(128 + sig)
