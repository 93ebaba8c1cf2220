"""How the ranks of a process group meet where a manager needs them all: whether every
rank takes part (a meeting in the group's store, which a missing rank cannot hang), and
the device the group's collectives take tensors on."""

from __future__ import annotations

import collections
import itertools
import time
import warnings

import torch

REGISTER_WAIT = 60.0          # seconds a rank waits for the others to come to a meeting
_POISON = 1 << 40             # a meeting that timed out: later arrivals count negative
_rounds: dict = collections.defaultdict(itertools.count)   # a topic's n-th meets the n-th


def in_group() -> bool:
    """Whether this process is one of several ranks of an initialized process group."""
    import torch.distributed as dist
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def all_meet(topic: str, warning: str, wait: float | None = None, stacklevel: int = 3) -> bool:
    """Whether every rank of the default process group comes to this meeting (this
    process's n-th of ``topic`` meeting the others' n-th in the group's store), waiting
    at most ``wait`` seconds (:data:`REGISTER_WAIT`). A rank that gives up marks the
    count, so that every rank decides the same, and warns with ``warning`` (``stacklevel``
    as the caller's own ``warnings.warn`` would take it)."""
    import torch.distributed as dist
    from torch.distributed import distributed_c10d
    try:
        store = distributed_c10d._get_default_store()
    except (AttributeError, RuntimeError, ValueError):
        return False                               # no store to meet in: act alone
    key, world = f"lcckpt/{topic}/{next(_rounds[topic])}", dist.get_world_size()
    deadline = time.monotonic() + (REGISTER_WAIT if wait is None else wait)
    n = store.add(key, 1)
    while 0 < n < world and time.monotonic() < deadline:
        time.sleep(0.005)
        n = store.add(key, 0)
    if 0 < n < world:                              # gave up: unless all came just now,
        n = store.add(key, -_POISON) + _POISON     # every later rank counts negative
    if n >= world:
        return True
    warnings.warn(warning, RuntimeWarning, stacklevel=stacklevel + 1)
    return False


def comm_device() -> torch.device:
    """Where the default group's collectives take tensors: the rank's GPU under NCCL."""
    import torch.distributed as dist
    if "nccl" in str(dist.get_backend()).lower():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")
