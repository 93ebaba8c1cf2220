"""Python's cyclic garbage collector held off while a save or a load runs in the main thread.

Coding a state allocates a few Python objects per tensor (headers, stats, plans) that live
until the file is written. Enough of them start a full collection, which in a process that
has imported torch walks a few hundred thousand objects: in a chain of 2,000 small tensors,
12 full collections took 14 s of a 56 s run of saves and loads (docs/benchmarks.md, "The
garbage collector"). The objects are freed by their reference counts when the call ends,
so the collections are not put off but avoided: 0.45 s of collection in the same run.

Only the main thread pauses the collector, and only if it was on: a save there stops the
program anyway, while one in a background thread (the manager's writer, an async save)
leaves it alone, since training goes on beside it and may make cyclic garbage. A block
inside another finds the collector off and leaves it so."""

from __future__ import annotations

import contextlib
import functools
import gc
import threading
from typing import Callable, Iterator, TypeVar

F = TypeVar("F", bound=Callable)


@contextlib.contextmanager
def paused() -> Iterator[None]:
    """The block runs with the collector off; it is turned back on at the end, also on an
    exception."""
    if threading.current_thread() is not threading.main_thread() or not gc.isenabled():
        yield
        return
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


def pausing(fn: F) -> F:
    """``fn`` run in :func:`paused`; its frame is lcckpt's, so that a warning from inside
    still names the caller's line (util/caller.py)."""
    @functools.wraps(fn)
    def call(*args, **kwargs):
        with paused():
            return fn(*args, **kwargs)
    return call  # type: ignore[return-value]
