"""Copy a state tree into host buffers that are reused from one checkpoint to the next.

This is the only part of a checkpoint that stalls the training loop: every tensor of the
tree is copied into a preallocated CPU tensor (pinned when the source is on a CUDA device,
so the copies run as asynchronous DMA and one synchronization waits for all of them), and
every other value is deep-copied. Buffers are keyed by their position in the tree and
reallocated only when a tensor's shape or dtype changes, so steady-state checkpoints
allocate nothing large.

It does not serialize, compress or write anything, and it does not own the buffers'
lifetime: the caller must not snapshot again while a previous snapshot is still being read
(the manager keeps at most one save in flight for that reason).
"""

from __future__ import annotations

import copy
from collections import Counter, OrderedDict
from typing import Any, Callable

import torch

from .. import limits
from ..format.flatten import key_repr
from ..util.caller import warn_user


class HostBuffers:
    """Reusable host copies of the tensors of a state tree, keyed by tree path (as a
    file names it: ``obj["model"]["fc.weight"]``)."""

    def __init__(self) -> None:
        self._buffers: dict[str, torch.Tensor] = {}
        self.nbytes = 0           # bytes held in buffers

    def snapshot(self, tree: Any, live: Callable[[torch.Tensor], bool] | None = None,
                 kept: list | None = None) -> Any:
        """A copy of ``tree`` whose tensors live in this object's host buffers.

        Containers (dict, OrderedDict, Counter, list, tuple) are rebuilt (a state dict's
        ``_metadata`` kept), tensors are copied into the buffer of their path (a sparse
        one into a fresh copy), anything else is ``copy.deepcopy``-ed. Tensors that are
        one tensor under two paths (tied weights: the same storage, offset, shape and
        strides) get one buffer, so the save stores them once, as it does the live state;
        views of one storage that differ are copied apart. Returns after
        every device copy has finished, so the caller may let training continue.
        A tensor for which ``live(t)`` is true is not copied: it stays in the copy as it
        is (detached), and ``(path, tensor)`` is appended to ``kept``.
        """
        seen: set[str] = set()
        devices: set[torch.device] = set()
        copies: dict[tuple, torch.Tensor] = {}       # one copy per aliased tensor
        objects: dict[tuple, dict[int, torch.Tensor]] = {}    # its tensor objects

        def walk(v: Any, path: str) -> Any:
            if isinstance(v, torch.Tensor) and v.layout != torch.strided:
                return v.detach().to("cpu", copy=True)     # sparse: no buffer to reuse
            if isinstance(v, torch.Tensor):
                if live is not None and live(v):
                    kept.append((path, v.detach()))
                    return kept[-1][1]
                key = _alias(v)
                if key is None:
                    return self._tensor(v, path, seen, devices)
                if key not in copies:
                    copies[key] = self._tensor(v, path, seen, devices)
                    objects[key] = {id(v): copies[key]}
                # the same object stays one object; another tensor on the same data
                # becomes another tensor on the copy, as the live tree has them
                return objects[key].setdefault(id(v), copies[key].view(copies[key].shape))
            if isinstance(v, dict):
                out = type(v)() if type(v) in (OrderedDict, Counter) else {}
                for k, x in v.items():
                    out[k] = walk(x, f"{path}[{key_repr(k)}]")
                if type(v) is OrderedDict and hasattr(v, "_metadata"):   # module versions
                    out._metadata = copy.deepcopy(v._metadata)
                return out
            if type(v) in (list, tuple):
                items = [walk(x, f"{path}[{i}]") for i, x in enumerate(v)]
                return items if type(v) is list else tuple(items)
            return copy.deepcopy(v)
        out = walk(tree, "obj")
        for dev in devices:
            torch.cuda.synchronize(dev)
        for path in set(self._buffers) - seen:       # tensors that disappeared
            self.nbytes -= _size(self._buffers.pop(path))
        return out

    def fits(self, tree: Any, first_save: bool, stats: dict) -> bool:
        """Whether a snapshot of ``tree`` fits in the memory left beside its save
        (:func:`copy_fits`)."""
        return copy_fits(self, tree, first_save, stats)

    def _tensor(self, t: torch.Tensor, path: str, seen: set, devices: set) -> torch.Tensor:
        seen.add(path)
        t = t.detach()
        buf = self._buffers.get(path)
        if buf is None or buf.shape != t.shape or buf.dtype != t.dtype:
            if buf is not None:
                self.nbytes -= _size(buf)
            pin = t.is_cuda and torch.cuda.is_available()
            buf = torch.empty(t.shape, dtype=t.dtype, device="cpu", pin_memory=pin)
            self._buffers[path] = buf
            self.nbytes += _size(buf)
        if t.is_cuda:
            buf.copy_(t, non_blocking=buf.is_pinned())
            devices.add(t.device)
        else:
            buf.copy_(t)
        return buf


def _alias(t: torch.Tensor) -> tuple | None:
    """What makes two tensors the same data (None for one without any)."""
    if t.numel() == 0 or t.is_meta:
        return None
    return (t.device, t.untyped_storage().data_ptr(), t.storage_offset(), t.dtype,
            tuple(t.shape), t.stride())


def _size(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


ROOM_MARGIN = 64 << 20        # bytes kept free beyond the estimate


def copy_fits(buffers: HostBuffers, tree: Any, first_save: bool, stats: dict) -> bool:
    """Whether a background snapshot fits (:func:`no_room_for_copy`); if not, the first
    time, a warning says why, and ``stats["foreground"]`` counts the saves so taken
    (:meth:`HostBuffers.fits`)."""
    why = no_room_for_copy(buffers, tree, first_save)
    if why is None:
        return True
    if not stats["foreground"]:
        warn_user(why)
    stats["foreground"] += 1
    return False


def no_room_for_copy(buffers: HostBuffers, tree: Any, first_save: bool) -> str | None:
    """Why a background snapshot of ``tree`` into ``buffers`` would not fit in the memory
    this process has left (:func:`lcckpt.limits.usable_memory`), or None. The snapshot
    allocates what the buffers lack; the save beside it needs up to the state's size (a
    keyframe's coded sections), and its first one a reference of that size too. In a
    container or a batch job's cgroup, running out is not an error but the kernel's kill."""
    state = state_bytes(tree)
    lacking = max(0, state - buffers.nbytes)
    if lacking == 0:
        return None
    mem = limits.usable_memory()
    need = lacking + (2 if first_save else 1) * state + ROOM_MARGIN
    if mem is None or need <= mem[0]:
        return None
    return (f"a background checkpoint needs a host copy of the state ({lacking / 2**20:,.0f} "
            f"MiB) beside the save's own memory, about {need / 2**20:,.0f} MiB in all, and "
            f"{mem[1]} leaves {mem[0] / 2**20:,.0f} MiB: saved in the foreground instead (the "
            "loop waits for each write); free memory, or pass background=False to choose it")


def state_bytes(tree: Any) -> int:
    """Bytes of the tensors in ``tree``, each piece of shared data counted once."""
    seen: set = set()
    total = 0
    stack = [tree]
    while stack:
        v = stack.pop()
        if isinstance(v, torch.Tensor) and v.layout == torch.strided:   # sparse: a copy
            key = _alias(v)
            if key is None or key not in seen:
                seen.add(key)
                total += _size(v)
        elif isinstance(v, dict):
            stack.extend(v.values())
        elif type(v) in (list, tuple):
            stack.extend(v)
    return total
