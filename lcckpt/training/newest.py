"""The checkpoint a manager restores (the newest that loads, or a step rolled back to),
and which process of a job writes.

Under ``torch.distributed`` (DDP: every rank holds the same state) one process writes
the checkpoints, global rank 0 unless told otherwise, and every rank restores from them;
the others neither snapshot nor lock the directory, and keep no references. Where every
rank restores, the writer alone reads the checkpoint and sends it to the others
(broadcast.py).
"""

from __future__ import annotations

import os

from ..chain.checkpointer import DeltaCheckpointer
from ..chain.retention import DAMAGED, set_aside
from ..errors import InvalidArgumentError, LcckptError, NotFoundError, proves_damage
from ..format.into import Into
from .ranks import all_meet, in_group
from ..util.caller import warn_user


def is_writer(writer: bool | None) -> bool:
    """``writer`` if given; else whether this process is global rank 0 of an initialized
    process group (True without one)."""
    if writer is not None:
        if type(writer) is not bool:
            raise InvalidArgumentError(f"writer must be None, True or False, got {writer!r}")
        return writer
    import torch.distributed as dist
    return not (dist.is_available() and dist.is_initialized()) or dist.get_rank() == 0


def generators_to_restore(writer: bool) -> bool | int:
    """``Capture.apply``'s ``rng``: the writer restores the saved generators, another rank
    its own where the checkpoint holds every rank's (its global rank), else none."""
    if writer:
        return True
    import torch.distributed as dist
    return dist.get_rank() if in_group() else False


def _quiet(into):
    """The model's targets, without the load's warning about tensors it could not fill:
    ``load_state_dict`` then raises, naming every missing and mismatched key."""
    return None if into is None else Into.of(into, warn=False)


def load_newest(reader: DeltaCheckpointer, into, max_bytes, writer: bool, step=None):
    """``(state, step)`` of ``step`` of ``reader``'s chain, the later steps then set aside
    by the ``writer`` as ``*.rolledback`` files, newest first (a rollback); without
    ``step``, of the newest step that loads, or None if it holds none. A step proven
    damaged is passed over with a warning and, by the ``writer`` (the only process that
    changes the directory), renamed to ``*.damaged`` once an older one loaded, so the run
    continues its chain from there (another rank passes over a step the writer set aside
    while it read it). Anything else is raised as it is. The writer's reader keeps the
    references its next save goes on from (``resume``)."""
    steps = reader.steps()
    if step is not None:
        if type(step) is not int or step not in steps:
            raise NotFoundError(f"no checkpoint step {step!r} in {reader.directory} to roll "
                                f"back to; it holds steps {steps}")
        state = reader.load(step, map_location="cpu", max_bytes=max_bytes, resume=writer,
                            into=_quiet(into))
        if writer:
            reader.rollback(step)           # under the writer's lock
        return state, step
    if not steps:
        return None
    failed = []
    for s in reversed(steps):
        try:
            state = reader.load(s, map_location="cpu", max_bytes=max_bytes, resume=writer,
                                into=_quiet(into))
            break
        except (LcckptError, OSError) as e:
            if not writer and not os.path.exists(reader.path(s)):
                continue            # set aside by the writer meanwhile: proven damaged
            if not proves_damage(e):
                raise
            failed.append((s, e))
            warn_user(f"cannot restore checkpoint step {s} in {reader.directory} ({e}); "
                      "trying the previous one" + (f" ({os.path.basename(reader.path(s))} "
                      f"will be set aside as *{DAMAGED})" if writer else ""))
    else:
        raise failed[0][1]
    for bad, _ in failed if writer else ():     # out of the way of the continuing chain
        set_aside(reader.path(bad), DAMAGED)
    return state, s


def restore_state(reader: DeltaCheckpointer, into, max_bytes, writer: bool, step=None,
                  cooperative: bool | None = None):
    """:func:`load_newest`; under a process group where every rank restores (and
    ``cooperative`` is not False), on the one writer alone, its state then sent to the
    other ranks (:func:`lcckpt.training.broadcast.restore`)."""
    if cooperative is not False and in_group() and all_meet(
            "restore", "restore(): not every rank of the process group called it, so each "
            "reads the checkpoint itself; call it on every rank, or pass "
            "cooperative=False on every rank (docs/manager.md)"):
        from .broadcast import restore
        found = restore(lambda: load_newest(reader, into, max_bytes, True, step), writer, into)
        if found is not NotImplemented:
            return found
    return load_newest(reader, into, max_bytes, writer, step)
