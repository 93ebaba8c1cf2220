"""Objects bound to this process: a checkpointer holds its directory's writer lock and the
references its next delta is coded against, a manager its threads and signal handler.
A pickled or copied one would hold them twice (two writers of one chain), so pickling
and copying are refused with a message that says what to pass instead, where they failed
on an inner lock with "cannot pickle '_thread.lock' object"."""

from __future__ import annotations

from ..errors import NotCopiedError

__all__ = ["Owned"]


class Owned:
    """Refuses ``pickle`` and ``copy`` (:class:`~lcckpt.errors.NotCopiedError`, a
    ``TypeError`` as pickle's own refusals are, so that code probing whether an object
    pickles goes on)."""

    def __reduce_ex__(self, protocol):
        name = type(self).__name__
        raise NotCopiedError(
            f"a {name} cannot be pickled or copied: it holds its directory's writer lock and "
            f"the state its next save goes on from; pass the directory "
            f"({getattr(self, 'directory', '?')!r}) instead, and make a {name} there in the "
            "process that saves")
