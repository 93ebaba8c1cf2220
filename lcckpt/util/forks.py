"""File descriptors that hold a lock, closed in a forked child.

A ``flock`` belongs to the open file, which ``fork`` shares: a child that keeps its copy
(a DataLoader worker forked while a save held a lock) keeps the lock after the parent
closes its own, or dies. Every lock lcckpt takes registers its descriptor here while
held, and a forked child closes them at once (never ``LOCK_UN``, which would release
the parent's lock too).
"""

from __future__ import annotations

import os

__all__ = ["hold", "drop"]

_HELD: set[int] = set()


def hold(fd: int) -> int:
    """Close ``fd`` in any process forked from now until :func:`drop`."""
    _HELD.add(fd)
    return fd


def drop(fd: int) -> None:
    _HELD.discard(fd)


def _close_in_child() -> None:
    for fd in _HELD:
        try:
            os.close(fd)
        except OSError:
            pass
    _HELD.clear()


os.register_at_fork(after_in_child=_close_in_child)
