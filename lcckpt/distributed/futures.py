"""The future an async save hands back, what becomes of a failure nobody asked about, and
how a failure reaches the caller (:func:`unwrap`).

A background save that fails (a peer died, the state changed under a live save, the disk
filled) reports it through its future. A loop that calls ``ck.async_save(step, state)``
and drops the future, as the save's own docs show, never heard of it: the step was simply
missing at the next restore. :meth:`DistributedCheckpointer.wait` (which the next save,
load and ``close`` call) raises such a failure instead; a caller that asked the future
(``result``, ``exception``) has had it already and is not told twice.
"""

from __future__ import annotations

import os
from concurrent.futures import Future

from ..errors import DistributedCheckpointError, LcckptError
from .exchange import PeerFailedError


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


def unwrap(exc: BaseException, what: str) -> BaseException:
    """DCP's CheckpointException -> this rank's own LcckptError, else a
    DistributedCheckpointError; so is any other failure a surviving rank sees (a peer that
    died surfaces as the process group's RuntimeError). Interrupts pass through."""
    failures = getattr(exc, "failures", None)
    if failures is None:
        if isinstance(exc, LcckptError) or not isinstance(exc, Exception):
            return exc
        return DistributedCheckpointError(
            f"{what} failed on this rank: {type(exc).__name__}: {exc} ({_cause_of(exc)}; "
            "nothing was committed)", {})
    causes = {r: (f[0] if isinstance(f, tuple) else f) for r, f in failures.items()}
    # a rank's own error first: PeerFailedError only says that another rank failed
    for c in sorted(causes.values(), key=lambda c: isinstance(c, PeerFailedError)):
        if isinstance(c, LcckptError):
            return c
    detail = "; ".join(f"rank {r}: {type(c).__name__}: {c}" for r, c in sorted(causes.items()))
    return DistributedCheckpointError(f"{what} failed on rank(s) {sorted(causes)}: {detail}",
                                      causes)


def shm_hint(text: str) -> str:
    """What to do where ``text`` is torch's failure to allocate shared memory ("" if not)."""
    if "unable to allocate shared memory" not in text:
        return ""
    try:
        st = os.statvfs("/dev/shm")
        free = (f"{st.f_bavail * st.f_frsize / 2**20:,.0f} of its "
                f"{st.f_blocks * st.f_frsize / 2**20:,.0f} MiB free")
    except OSError:
        free = "unknown room"
    return (f"process-mode saves stage through shared memory, and /dev/shm has {free}: "
            "give it more, as `docker run --shm-size=...` or a Kubernetes emptyDir with "
            "medium Memory does, or save with process=False")


def _cause_of(exc: BaseException) -> str:
    hint = shm_hint(str(exc))
    if hint:
        return hint
    if "background process is dead" in str(exc):    # DCP's process mode, started by spawn
        return ("DCP starts that process with spawn, which runs the main script again: "
                "training code at the script's top level, outside `if __name__ == "
                "\"__main__\":`, kills it (its traceback is printed above), as can a peer "
                "that died")
    return "a peer that died or a broken process group surfaces this way"
