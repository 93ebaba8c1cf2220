"""One save at a time on a thread of its own, its error handed back to the caller.

The training-framework callbacks (``hf.ChainCallback``, ``lightning.ChainCallback``) copy
a checkpoint into host buffers and let a thread write it while training goes on; the
next save and the end of the run wait for that thread here, and raise what it raised, in
the training thread.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

from ..util.caller import warn_user
from ..util.collector import paused


class Writer:
    """Runs one job at a time on a thread; :meth:`wait` joins it and raises its error."""

    def __init__(self, name: str) -> None:
        self.name = name
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None

    def start(self, job: Callable, *args) -> None:
        """Run ``job(*args)`` on a new thread (after :meth:`wait` for the one before)."""
        self.wait()
        self._thread = threading.Thread(target=self._guarded, args=(job, args), name=self.name)
        self._thread.start()

    def wait(self) -> None:
        """Wait for the job in flight; raise its error if it failed."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self._error is not None:
            error, self._error = self._error, None
            raise error

    def finish(self, checkpointer) -> None:
        """:meth:`wait`, then close ``checkpointer`` (if any) whether or not the job
        failed."""
        try:
            self.wait()
        finally:
            if checkpointer is not None:
                checkpointer.close()

    def _guarded(self, job: Callable, args: tuple) -> None:
        try:
            with paused(background=True):       # collections here would stall training
                job(*args)
        except BaseException as e:          # raised in the caller's thread by wait()
            self._error = e
            said_at_exit(e)


def said_at_exit(e: BaseException) -> None:
    """Warn of a background checkpoint's error ``e`` where the program has ended (its
    main thread is done): no later call will raise it, and the checkpoint is lost."""
    if not threading.main_thread().is_alive():
        warn_user(f"a background checkpoint failed as the program ended: {e!r}")
