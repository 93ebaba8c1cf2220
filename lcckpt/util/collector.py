"""Python's cyclic garbage collector held off while a save or a load runs in the main thread
or in a writer beside training.

Coding a state allocates a few Python objects per tensor (headers, stats, plans) that live
until the file is written. Enough of them start a full collection, which in a process that
has imported torch walks a few hundred thousand objects: in a chain of 2,000 small tensors,
8 full collections took 2.7-3.7 s of 22-28 s runs of saves and loads (docs/benchmarks.md,
"The garbage collector"). The objects are freed by their reference counts when the call
ends, so the collections are not put off but avoided: 0.11-0.16 s of collecting held off.

Only the main thread pauses the collector unless told otherwise, and only if it was on.
A writer that saves beside training (the manager's, the framework callbacks', the write
of a distributed async save in DCP's thread) pauses it too (``background=True``): a full
collection started there holds the GIL and stalls training, 2.8-4.3 s of them in 43-58 s
runs of a manager's background saves (docs/benchmarks.md). Cyclic garbage that training
makes meanwhile waits until the save ends; ``gc.collect()`` still runs when called. A
block that finds the collector off leaves it so; the block that turned it off turns it
back on. A process forked meanwhile (a DataLoader's worker, started as an epoch begins)
gets it back on: the block that would turn it on runs in the parent alone, and the
worker ran its whole life without it."""

from __future__ import annotations

import contextlib
import functools
import gc
import os
import threading
from typing import Callable, Iterator, TypeVar

F = TypeVar("F", bound=Callable)

HOLD_OFF = True     # False: the collector is left alone (benchmarks/collector.py compares)
_held = False       # a block of this module holds the collector off


def _after_fork_in_child() -> None:
    global _held
    if _held:
        _held = False
        gc.enable()


os.register_at_fork(after_in_child=_after_fork_in_child)


@contextlib.contextmanager
def paused(background: bool = False) -> Iterator[None]:
    """The block runs with the collector off (in the main thread, or in any with
    ``background=True``); it is turned back on at the end, also on an exception."""
    main = threading.current_thread() is threading.main_thread()
    if not HOLD_OFF or not (main or background) or not gc.isenabled():
        yield
        return
    global _held
    gc.disable()
    _held = True
    try:
        yield
    finally:
        _held = False
        gc.enable()


def pausing(fn: F) -> F:
    """``fn`` run in :func:`paused`; its frame is lcckpt's, so that a warning from inside
    still names the caller's line (util/caller.py)."""
    @functools.wraps(fn)
    def call(*args, **kwargs):
        with paused():
            return fn(*args, **kwargs)
    return call  # type: ignore[return-value]
