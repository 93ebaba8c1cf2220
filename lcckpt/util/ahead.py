"""Jobs of an ordered list coded by two threads: the caller, which takes their results
in order, and one helper.

A save of a transformer codes hundreds of tensors of 10^5-10^6 elements one after
another. Each is too small to keep both cores busy through its own passes (the pool's
hand-offs and the Python between the kernels leave them idle), and the caller writes
each coded tensor to the file before it asks for the next. Here the helper codes the
next jobs meanwhile, and the caller, when the job it needs is still being coded, codes
a later one instead of waiting. Both take the next job not started, at most
:data:`WINDOW` beyond the one the caller took last, so few results wait for the caller.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

from .pool import finish

WINDOW = 2             # jobs started beyond the one the caller took last


class Ahead:
    """``jobs`` (callables) whose results :meth:`take` returns in order, coded by the
    caller and one helper thread. :meth:`close` must follow, also after an error: it
    waits until the helper has let go of every job (a save must not return while a
    thread still reads the state it was given)."""

    def __init__(self, jobs: list[Callable]):
        self._jobs = jobs
        self._out: dict[int, tuple] = {}     # job -> (ok, result or exception)
        self._next = 0                  # the first job not started
        self._pos = -1                  # the job the caller took last
        self._closed = False
        self._cv = threading.Condition()
        # a daemon: a caller that never closes (a bug) must not keep the process alive
        self._thread: threading.Thread | None = threading.Thread(
            target=self._helper, name="lcckpt-ahead", daemon=True)
        try:
            self._thread.start()
        except RuntimeError:            # no new threads (interpreter shutdown): the caller
            self._thread = None         # codes every job

    def _claim(self) -> int | None:
        """The next job to start (the lock held), None if none may start now."""
        j = self._next
        if self._closed or self._pos < 0 or j >= len(self._jobs) or j > self._pos + WINDOW:
            return None                 # (the first job is the caller's: it asks at once)
        self._next += 1
        return j

    def _code(self, j: int, caller: bool = False) -> None:
        """Run job ``j``; its result or error waits for ``take(j)``. On the caller's
        thread an interrupt (KeyboardInterrupt, SystemExit) goes up at once instead."""
        try:
            out = (True, self._jobs[j]())
        except Exception as e:          # handed to the caller's take(j)
            out = (False, e)
        except BaseException as e:
            if caller:
                raise
            out = (False, e)
        with self._cv:
            self._out[j] = out
            self._cv.notify_all()

    def _helper(self) -> None:
        while True:
            with self._cv:
                j = self._claim()
                while j is None and not self._closed and self._next < len(self._jobs):
                    self._cv.wait()
                    j = self._claim()
            if j is None:
                return
            self._code(j)

    def take(self, i: int):
        """Job ``i``'s result (its exception raised); ``i`` must grow from call to call."""
        with self._cv:
            self._pos = i
            self._cv.notify_all()               # the helper may start more
            while i not in self._out:
                j = self._claim()
                if j is None:
                    self._cv.wait()
                    continue
                self._cv.release()
                try:
                    self._code(j, caller=True)
                finally:
                    self._cv.acquire()
            ok, value = self._out.pop(i)
        if ok:
            return value
        raise value

    def close(self) -> None:
        """No job starts from now on; returns once the helper's job (if any) is over."""
        with self._cv:
            self._closed = True
            self._cv.notify_all()
        if self._thread is not None:
            t = self._thread                    # the helper reads the caller's state
            finish(t.join, lambda: not t.is_alive())
