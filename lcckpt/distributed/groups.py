"""Process groups: the one an async save runs on, and letting ``destroy_process_group``
really destroy the default group.

**A background save's own group.** A thread-mode async save runs DCP's collectives (the
plan's gather and scatter, the commit's) in its thread while the training loop goes on,
and under DDP every backward all-reduces on the default group: the two streams of
collectives on one group meet in a different order on each rank, and the job hangs
(DCP's documentation asks for a separate group for async saves). :class:`Background`
gives each saver one, made beside each default group.

**Destroying the default group.** ``torch.distributed.nn.functional`` (which DCP imports,
through its sharded-tensor support) writes ``group=group.WORLD`` as a default argument of
each of its collectives. Imported before ``init_process_group`` that default is ``None``;
imported after it, it is the default process group itself, held by the functions for as
long as the interpreter lives. Then
``destroy_process_group()`` drops torch's own references but not that one: the group is
not destroyed, its gloo worker threads are never joined, and one that releases a finished
collective's tensor after the interpreter has begun to exit asks for the GIL there and
aborts the process ("terminate called without an active exception"). Importing
``lcckpt.distributed`` inside a worker, after ``init_process_group``, is the common way in.

``None`` means "the default group, looked up at call time" to every one of those
functions, which is what the default was written to mean (and still right after a second
``init_process_group``); so restoring it changes nothing but the lifetime.
"""

from __future__ import annotations

import sys
import types
import weakref

import torch.distributed as dist

class Background:
    """Where one saver keeps its background group: weak references only (a held group
    would outlive ``destroy_process_group``, as below) to the default group it was made
    beside and to the group itself, which torch's own registry keeps alive."""

    def __init__(self):
        self._world = self._group = None

    def group(self, process_group):
        """The group a thread-mode async save runs on: ``process_group`` where one is given
        (the caller's choice) or where there is no process group of several ranks; else a
        gloo group over every rank, made at this saver's first such save beside each
        default group (every rank makes it at the same call, as an async save is called
        on every rank). One per saver: two savers' saves in flight at once would meet
        on one group as a save and the loop do on the default one."""
        if process_group is not None or not (dist.is_available() and dist.is_initialized()) \
                or dist.get_world_size() < 2:
            return process_group
        world, group = (ref() if ref is not None else None for ref in (self._world, self._group))
        if world is not dist.group.WORLD or group is None:
            group = dist.new_group(backend="gloo")
            self._world, self._group = weakref.ref(dist.group.WORLD), weakref.ref(group)
        return group


_shared = Background()      # lcckpt.distributed.async_save's, one for every such call


def background_group(process_group, saver: Background | None = None):
    """``saver``'s (default: the module functions' shared one) :meth:`Background.group`."""
    return (saver or _shared).group(process_group)


def release_captured_default_group() -> int:
    """Reset every ``ProcessGroup`` default argument of ``torch.distributed.nn.functional``'s
    functions to ``None``; returns how many were reset (0 when it was imported first)."""
    module = sys.modules.get("torch.distributed.nn.functional")
    if module is None or not dist.is_available():
        return 0
    reset = 0
    for fn in vars(module).values():
        if isinstance(fn, types.FunctionType) and fn.__defaults__:
            groups = [isinstance(d, dist.ProcessGroup) for d in fn.__defaults__]
            if any(groups):
                fn.__defaults__ = tuple(None if g else d for g, d in zip(groups, fn.__defaults__))
                reset += sum(groups)
    return reset
