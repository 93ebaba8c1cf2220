"""How the ranks of a process group meet where a manager needs them all: whether every
rank takes part (a meeting in the group's store, which a missing rank cannot hang), and
the device the group's collectives take tensors on."""

from __future__ import annotations

import collections
import itertools
import time

import torch

from ..util.caller import warn_user

REGISTER_WAIT = 60.0          # seconds a rank waits for the others to come to a meeting
_POISON = 1 << 40             # a meeting that timed out: later arrivals count negative
_rounds: dict = collections.defaultdict(itertools.count)   # a topic's n-th meets the n-th


def in_group() -> bool:
    """Whether this process is one of several ranks of an initialized process group."""
    import torch.distributed as dist
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def all_meet(topic: str, warning: str, wait: float | None = None) -> bool:
    """Whether every rank of the default process group comes to this meeting (this
    process's n-th of ``topic`` meeting the others' n-th in the group's store), waiting
    at most ``wait`` seconds (:data:`REGISTER_WAIT`). A rank that gives up marks the
    count, so that every rank decides the same, and warns with ``warning``."""
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
    warn_user(warning)
    return False


def backends() -> str:
    """The default group's backends, lower case: "gloo", "nccl", or by device, as
    ``init_process_group()`` without a backend makes them ("cpu:gloo,cuda:nccl"; its
    ``get_backend()`` then says "undefined")."""
    import torch.distributed as dist
    try:
        return str(dist.get_backend_config()).lower()
    except (AttributeError, RuntimeError, ValueError):     # pragma: no cover - older torch
        return str(dist.get_backend()).lower()


def comm_device() -> torch.device:
    """Where the default group's collectives take tensors: the host where a backend of
    the group takes host tensors (gloo), else (NCCL alone) the rank's GPU."""
    b = backends()
    if "nccl" in b and "gloo" not in b:
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")
