"""The future an async save hands back, and what becomes of a failure nobody asked about.

A background save that fails (a peer died, the state changed under a live save, the disk
filled) reports it through its future. A loop that calls ``ck.async_save(step, state)``
and drops the future, as the save's own docs show, never heard of it: the step was simply
missing at the next restore. :meth:`DistributedCheckpointer.wait` (which the next save,
load and ``close`` call) raises such a failure instead; a caller that asked the future
(``result``, ``exception``) has had it already and is not told twice.
"""

from __future__ import annotations

from concurrent.futures import Future


class Outcome(Future):
    """A Future that remembers whether its caller asked for its result."""

    asked = False

    def result(self, timeout=None):
        self.asked = True
        return super().result(timeout)

    def exception(self, timeout=None):
        self.asked = True
        return super().exception(timeout)


def raise_unasked(fut: Future, step: int | None) -> None:
    """Wait for ``fut``; raise its failure if nobody has asked for it yet."""
    err = Future.exception(fut)               # waits, and does not count as asking
    if err is not None and not getattr(fut, "asked", True):
        fut.asked = True
        err.add_note(f"(the async_save of step {step}, raised by the next call on the "
                     "checkpointer: its future was not asked)")
        raise err
