"""A restore under DDP read and decoded once: the writer loads the checkpoint and sends
its state to the other ranks over the process group.

Without it every rank reads and decodes the whole chain: N ranks of a host spend N times
the CPU on one state, and N ranks across hosts read it N times from shared storage, at
the moment a restarted job waits for it. The writer picks the step (passing over damaged
files, rolling back), so every rank restores the same one; a load that fails on the
writer raises on every rank.

The tree's values travel as one pickled message among the job's own ranks (the writer
loaded them from the file safely); its tensors travel as raw bytes over a gloo group
(:func:`host_group`: the decoded state is on the host), a tensor of :data:`PACK` bytes or
more straight from and into its memory in pieces of at most :data:`PIECE` bytes, smaller
ones packed together through a staging buffer.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import torch

from ..errors import PeerRestoreError
from .ranks import backends, comm_device

PIECE = 64 << 20        # bytes per broadcast at most
PACK = 4 << 20          # tensors under this size are packed together into one broadcast
                        # through a staging buffer this large


@dataclass(frozen=True)
class _Slot:
    """Where a tensor of the tree was: its index in the tensors sent, shape and dtype."""
    index: int
    shape: tuple
    dtype: torch.dtype


def host_group():
    """A group over every rank whose collectives take host tensors: None (the default
    group) where one of its backends is gloo, else a new gloo group, which the caller
    destroys. The decoded state is on the host, and under NCCL alone its bytes would go
    through the GPUs and back."""
    import torch.distributed as dist
    if "gloo" in backends():
        return None
    return dist.new_group(backend="gloo")


def source_rank(writer: bool, group=None) -> int | None:
    """The global rank of the one writer (an all-reduce over ``group``, the default one
    if None), or None where no rank writes or several do (each then restores alone)."""
    import torch.distributed as dist
    t = torch.tensor([dist.get_rank() + 1 if writer else 0, int(writer)],
                     device=comm_device() if group is None else "cpu")
    dist.all_reduce(t, group=group)
    return int(t[0]) - 1 if int(t[1]) == 1 else None


_MAPS = (dict, OrderedDict)      # rebuilt with their tensors taken out (a state dict is an
                                 # OrderedDict); anything else travels pickled whole


def _strip(obj, tensors):
    """``obj`` with every dense CPU tensor replaced by a :class:`_Slot` (appended to
    ``tensors``)."""
    if isinstance(obj, torch.Tensor) and obj.layout == torch.strided and obj.device.type == "cpu":
        tensors.append(obj.contiguous())
        return _Slot(len(tensors) - 1, tuple(obj.shape), obj.dtype)
    if type(obj) in _MAPS:
        return type(obj)((k, _strip(v, tensors)) for k, v in obj.items())
    if type(obj) in (list, tuple):
        return type(obj)(_strip(v, tensors) for v in obj)
    return obj


def _fill(obj, tensors):
    if isinstance(obj, _Slot):
        return tensors[obj.index]
    if type(obj) in _MAPS:
        return type(obj)((k, _fill(v, tensors)) for k, v in obj.items())
    if type(obj) in (list, tuple):
        return type(obj)(_fill(v, tensors) for v in obj)
    return obj


def _slots(obj, path=()):
    """(path, slot) of every :class:`_Slot` in ``obj``, in index order."""
    if isinstance(obj, _Slot):
        return [(path, obj)]
    items = (obj.items() if type(obj) in _MAPS else
             enumerate(obj) if type(obj) in (list, tuple) else ())
    return sorted((ps for k, v in items for ps in _slots(v, path + (k,))),
                  key=lambda ps: ps[1].index)


def _raw(t: torch.Tensor) -> torch.Tensor:
    """The bytes of a contiguous tensor, as a flat uint8 view of its memory."""
    return t.reshape(-1).view(torch.uint8) if t.numel() else torch.empty(0, dtype=torch.uint8)


def _destinations(skeleton, targets: dict) -> list[torch.Tensor]:
    """A receiving rank's tensor for each slot: the target at its path where one of its
    shape and dtype is there (the model's own host tensors), else a new one."""
    out = []
    for path, s in _slots(skeleton):
        t = targets
        for k in path:
            t = t.get(k) if isinstance(t, dict) else None
        if not (isinstance(t, torch.Tensor) and t.device.type == "cpu" and t.is_contiguous()
                and tuple(t.shape) == s.shape and t.dtype == s.dtype):
            t = torch.empty(s.shape, dtype=s.dtype)
        out.append(t)
    return out


def _pieces(sizes: list[int], piece: int, pack: int):
    """The byte ranges of each broadcast, lists of (tensor, lo, hi): a tensor of ``pack``
    bytes or more alone, in parts of at most ``piece`` bytes; smaller ones packed
    together, at most ``pack`` bytes a broadcast."""
    cur, room = [], pack
    for i, n in enumerate(sizes):
        if n >= pack:
            yield from ([(i, lo, min(n, lo + piece))] for lo in range(0, n, piece))
            continue
        if n > room:
            yield cur
            cur, room = [], pack
        cur.append((i, 0, n))
        room -= n
    if cur:
        yield cur


def _send_tensors(tensors: list[torch.Tensor], src: int, sending: bool, group, piece: int,
                  pack: int) -> None:
    """Broadcast the bytes of ``tensors`` from ``src`` (the writer's, or the receiver's
    destinations), piece by piece."""
    import torch.distributed as dist
    raws = [_raw(t) for t in tensors]
    staging = None
    for parts in _pieces([r.numel() for r in raws], piece, pack):
        if len(parts) == 1 and parts[0][2] - parts[0][1] >= pack:   # in place: no copy
            i, lo, hi = parts[0]
            dist.broadcast(raws[i][lo:hi], src=src, group=group)
            continue
        n = sum(hi - lo for _, lo, hi in parts)
        if staging is None:
            staging = torch.empty(pack, dtype=torch.uint8)
        buf, at = staging[:n], 0
        if sending:
            for i, lo, hi in parts:
                buf[at:at + hi - lo].copy_(raws[i][lo:hi])
                at += hi - lo
        dist.broadcast(buf, src=src, group=group)
        if not sending:
            for i, lo, hi in parts:
                raws[i][lo:hi].copy_(buf[at:at + hi - lo])
                at += hi - lo


def share(load, src: int, targets: dict, group=None, piece: int = PIECE, pack: int = PACK):
    """What ``load()`` returns on rank ``src``, on every rank of ``group`` (the default
    group if None): ``(state, step)`` or None. Only ``src`` calls ``load``; the others
    receive its state, its tensors in ``targets``' where they fit. An exception of
    ``load`` is raised on ``src`` and a :class:`PeerRestoreError` with its message on the
    others."""
    import torch.distributed as dist
    sending = dist.get_rank() == src
    msg = [None]
    if sending:
        try:
            found = load()
            tensors: list = []
            msg = [("none",) if found is None else
                   ("ok", _strip(found[0], tensors), found[1])]
        except Exception as e:
            dist.broadcast_object_list([("error", f"{type(e).__name__}: {e}")], src=src,
                                       group=group)
            raise
    dist.broadcast_object_list(msg, src=src, group=group)
    head = msg[0]
    if head[0] == "error":
        raise PeerRestoreError(f"the writer (rank {src}) could not restore: {head[1]}")
    if head[0] == "none":
        return None
    if not sending:
        tensors = _destinations(head[1], targets)
    _send_tensors(tensors, src, sending, group, piece, pack)
    return (found[0] if sending else _fill(head[1], tensors)), head[2]


def restore(load, writer: bool, targets: dict):
    """``share(load, ...)`` from the one writer over a host group (:func:`host_group`);
    ``NotImplemented`` where no rank or several write (each rank then loads alone)."""
    import torch.distributed as dist
    group = host_group()
    try:
        src = source_rank(writer, group)
        return NotImplemented if src is None else share(load, src, targets, group)
    finally:
        if group is not None:
            dist.destroy_process_group(group)


def gather_generators(writer: bool) -> dict | None:
    """Every rank's random generators (:func:`lcckpt.training.rng.capture`), by global
    rank as a string, on the writer (None on the others, and where no one rank writes).
    Every rank calls it at the same iteration (a SIGTERM's, which the ranks agree on)."""
    import torch.distributed as dist
    from . import rng
    src = source_rank(writer)
    if src is None:
        return None
    got = [None] * dist.get_world_size() if dist.get_rank() == src else None
    dist.gather_object(rng.capture(), got, dst=src)
    return None if got is None else {str(r): g for r, g in enumerate(got)}
