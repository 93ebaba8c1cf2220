"""Let ``destroy_process_group`` really destroy the default group.

``torch.distributed.nn.functional`` (which DCP imports, through its sharded-tensor support)
writes ``group=group.WORLD`` as a default argument of each of its collectives. Imported
before ``init_process_group`` that default is ``None``; imported after it, it is the default
process group itself, held by the functions for as long as the interpreter lives. Then
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

import torch.distributed as dist


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
