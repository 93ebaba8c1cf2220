"""``background="overlap"``: a checkpoint written from the live state while the next
forward and backward passes run, the optimizer's next step waiting for the write.

The default background mode copies the whole state into host buffers first, so a process
holds the state, that copy and the writer's reference: twice the state beside it. Here the
tensors only an optimizer changes (the model's parameters and the optimizers' state) go
to the writer as they are, and every other value (buffers, which a forward pass may
change, and the other objects) is copied as in the default mode. A step pre-hook on each
optimizer the manager knows waits until the writer has read the state (its last byte is
written; the file's sync and commit come after) before the optimizer changes anything.

Anything else that changes such a tensor in place while it is written (a mask applied
before the optimizer's step, say) bumps the tensor's version counter; the manager then
removes the step it wrote and raises :class:`~lcckpt.errors.StateChangedError`, so a torn
checkpoint is not left to restore (unless retention has removed every step before it,
``keep_last=1``: then it is kept, and the error says so).
"""

from __future__ import annotations

import os
import threading
from typing import Any, Callable

import torch

from ..chain.checkpointer import DeltaCheckpointer
from ..errors import StateChangedError, StorageError
from ..util.durable import fsync_dir
from ..util.versions import VersionWatch
from .hostcopy import HostBuffers


def _key(t: torch.Tensor) -> tuple:
    return (t.device, t.data_ptr(), t.dtype, tuple(t.shape), tuple(t.stride()))


class LiveState:
    """The optimizers' hooks, and the tensors of the checkpoint being written with their
    version counters as the snapshot found them."""

    def __init__(self, model: torch.nn.Module, objects: list, before_step: Callable):
        """``objects``: the manager's optimizer and objects, of which the optimizers count."""
        self.model = model
        self.optimizers = [o for o in objects if isinstance(o, torch.optim.Optimizer)]
        self._watch: VersionWatch | None = None     # the write's live tensors
        self.writing = False            # from take() until the write's finish()
        self._hooks = [opt.register_step_pre_hook(lambda *_: before_step())
                       for opt in self.optimizers]

    def _live_keys(self) -> set:
        tensors = list(self.model.parameters())
        for opt in self.optimizers:
            for group in opt.param_groups:
                tensors += group["params"]
            tensors += [v for st in opt.state.values() for v in st.values()
                        if isinstance(v, torch.Tensor)]
        return {_key(t) for t in tensors if t.numel()}

    def take(self, tree: Any, buffers: HostBuffers) -> Any:
        """``tree`` as the writer gets it: the optimizers' tensors as they are, the rest
        copied into ``buffers``."""
        keys, kept = self._live_keys(), []
        snap = buffers.snapshot(tree, live=lambda t: t.numel() > 0 and _key(t) in keys,
                                kept=kept)
        self._watch = VersionWatch(kept)
        self.writing = True
        return snap

    def release(self) -> None:
        """The writer reads the live tensors no more (``DeltaCheckpointer.save``'s
        ``released``): note those changed in place since :meth:`take`, and let the
        optimizers step."""
        self._watch.release()

    def wait_released(self, job: threading.Thread) -> None:
        """Until the write releases the state, or its thread ``job`` is gone."""
        watch = self._watch             # finish() may let it go meanwhile
        if watch is not None:
            watch.wait(busy=job)

    def finish(self) -> list[str]:
        """The write is over (or failed): the tree paths of the written tensors that
        changed in place before it released them."""
        changed = self._watch.release()
        self._watch, self.writing = None, False
        return changed

    def remove_hooks(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks = []


def remove_newest(ck: DeltaCheckpointer, step: int, options: dict, before) -> tuple:
    """Remove ``step``, the newest step of ``ck``'s directory, unless retention has removed
    the durable step ``before`` it (``keep_last=1``): then nothing would be left. Returns a
    writer for the directory, which continues the chain from the step before it (as
    after a restart), and whether ``step`` was removed."""
    if before is not None and ck.steps() == [step]:
        return ck, False
    path = ck.path(step)
    ck.close()
    try:
        os.remove(path)
        fsync_dir(ck.directory)
    except FileNotFoundError:
        pass
    except OSError as e:
        raise StorageError(e.errno, f"cannot remove the torn checkpoint: {e.strerror}",
                           path) from None
    return DeltaCheckpointer(ck.directory, **options), True


def torn(changed: list[str], step: int, removed: bool) -> StateChangedError:
    more = f" (and {len(changed) - 1} more)" if len(changed) > 1 else ""
    what = ("so the checkpoint was removed" if removed else "and the checkpoint, the only "
            "one left, was kept: it may hold values from before and after the change")
    return StateChangedError(
        f"{changed[0]}{more} changed in place while checkpoint {step} was written from the "
        f"live state (background='overlap'), {what}. Only an optimizer's step may change "
        "the parameters and the optimizer state between manager.step() and that optimizer "
        "step; otherwise use background=True")
