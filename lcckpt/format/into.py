"""A load's ``into=`` tensors: which stored tensor fills which of them, and how.

A target is decoded into in place where its section fits it (the section's dtype and
shape, on the host, contiguous: :meth:`Into.take`). Every other stored tensor whose key
path names a target of its dtype and shape is copied into that target once it is
built (:meth:`Into.fill`): a target on a GPU, a small tensor of a pack, a view of a
storage that other stored tensors share, a tensor met again at another key path that
has a target of its own, a chain's tensor that was not replayed in place, a
non-contiguous target (a ``channels_last`` weight). Without that copy such a target kept its old values while
the load returned the stored ones beside it, and a model loaded ``into=`` its own
tensors silently lost, say, a two-class head's bias.
"""

from __future__ import annotations


import torch
from torch.nn.parameter import is_lazy

from ..codec import dtypes
from ..errors import InvalidArgumentError
from ..limits import declared_bytes
from ..util.caller import warn_user
from .census import children, tensor_paths
from .flatten import MAX_DEPTH
from .sections import fits

__all__ = ["Into"]


class Into:
    """Key path -> target tensor (``lcckpt.format.census.tensor_paths`` of ``into``);
    each target receives one stored tensor, the first whose key path names it."""

    @classmethod
    def of(cls, into, warn: bool = True) -> "Into":
        """The targets of a load's ``into``, which must reach its tensors: a module or an
        optimizer inside it (whose tensors a load would pass by in silence) is refused.
        ``into`` an ``Into`` already: itself. ``warn=False``: for a caller that checks the
        fit itself (``load_state_dict`` names every mismatch) and would only repeat it."""
        if isinstance(into, Into):
            return into
        _reachable(into, "into", 0)
        return cls(tensor_paths(into), warn)

    def __init__(self, paths: dict, warn: bool = True):
        # a lazy module's parameter before its first forward has no shape to fill: the
        # load returns the stored tensor there, and load_state_dict materializes it
        self.paths = {p: t for p, t in paths.items() if not is_lazy(t)}
        self.warn = warn
        self._owner: dict[int, str] = {}     # a target's memory -> the key path it receives
        self._taken: set[str] = set()        # key paths decoded straight into their target
        self._seen: dict[str, tuple] = {}    # key path -> (dtype, shape) stored there

    def take(self, path: str, dtype: torch.dtype | None, shape) -> torch.Tensor | None:
        """The target at ``path`` to decode a section of ``dtype`` and ``shape`` into, in
        place, or None (it does not fit, or another key path has it)."""
        t = self.paths.get(path)
        if not fits(t, dtype, shape) or not self._claim(t, path):
            return None
        self._taken.add(path)
        return t

    def fill(self, path: str, t: torch.Tensor) -> torch.Tensor:
        """The tensor the loaded object holds at ``path``: its target, filled with the
        values of ``t`` (as built from the file), where one fits; else ``t``. A target
        on another device than the one ``map_location`` put ``t`` on is filled, and ``t``
        is returned."""
        target = self.paths.get(path)
        self._seen.setdefault(path, (t.dtype, tuple(t.shape)))
        if path in self._taken:              # decoded into it: ``t`` may be a view of it
            same = isinstance(target, torch.Tensor) and t.dtype == target.dtype \
                and t.shape == target.shape and t.stride() == target.stride() \
                and t.data_ptr() == target.data_ptr()
            return target if same else t
        if not _receives(target, t) or not self._claim(target, path):
            return t
        with torch.no_grad():
            target.copy_(t)
        return target if target.device == t.device else t

    def in_place(self, sections, working: tuple | None = None) -> int:
        """Bytes of a container's ``sections`` that decode straight into a target, taking
        no memory: a tensor section whose key path names a target it fits (and, where
        ``working`` is given, whose target has one of those dtypes: a chain replays its
        tracked tensors into fp32 and fp64 targets only)."""
        total, seen = 0, set()
        for s in sections:
            meta = s["meta"]
            t = self.paths.get(s["name"]) if meta.get("kind") == "tensor" else None
            if t is None or id(t) in seen or (working and t.dtype not in working) or \
                    not fits(t, dtypes.NAME_TORCH.get(meta.get("dtype")), meta.get("shape", ())):
                continue
            seen.add(id(t))
            total += min(t.numel() * t.element_size(), declared_bytes([s]))
        return total

    def unfilled(self) -> list[tuple[str, str]]:
        """``(key path, why)`` of each target that received nothing."""
        out = []
        for path, t in self.paths.items():
            if not isinstance(t, torch.Tensor) or t.device.type == "meta" or not t.numel() \
                    or t.data_ptr() in self._owner:
                continue
            seen = self._seen.get(path)
            out.append((path, "no dense tensor is stored at this place" if seen is None else
                        "the target's elements share memory (expand()-ed): clone() it"
                        if _overlaps(t) else f"the stored tensor is {_describe(*seen)}, "
                        f"the target {_describe(t.dtype, tuple(t.shape))}"))
        return out

    def warn_unfilled(self) -> None:
        """Warn of the targets that received nothing: a target of another shape, or an
        ``into`` not shaped like the stored object (``model.state_dict()`` where the
        file holds ``{"model": ...}``) would otherwise keep its old values silently."""
        missed = self.unfilled() if self.warn else ()
        if not missed:
            return
        shown = "; ".join(f"{p} ({why})" for p, why in missed[:4])
        more = f"; and {len(missed) - 4} more" if len(missed) > 4 else ""
        what = "1 target tensor was left as it was" if len(missed) == 1 else \
            f"{len(missed)} target tensors were left as they were"
        warn_user(f"into=: {what}, and the loaded object holds the stored values there: "
                  f"{shown}{more}. `into` must be shaped like the stored object, e.g. "
                  "{'model': model.state_dict()} for a file saved from "
                  "{'model': ..., 'optim': ...}")

    def _claim(self, t: torch.Tensor, path: str) -> bool:
        return t.numel() == 0 or self._owner.setdefault(t.data_ptr(), path) == path


def _reachable(v, at: str, depth: int) -> None:
    """Refuse ``v`` (``into`` at key path ``at``) where it holds objects with a
    ``state_dict`` (modules, optimizers, schedulers) or, at its top, is no tensor and no
    container: a load fills tensors only."""
    if isinstance(v, torch.Tensor) or depth >= MAX_DEPTH:
        return
    if callable(getattr(v, "state_dict", None)):
        raise InvalidArgumentError(
            f"{at} is a {type(v).__module__}.{type(v).__qualname__} object: a load fills "
            f"tensors, not the objects that hold them; give its state_dict() there, e.g. "
            "into={'model': model.state_dict()} for a file saved from {'model': ..., ...}")
    items = children(v, at)
    for where, x in items or ():
        _reachable(x, where, depth + 1)
    if items is None and depth == 0:
        raise InvalidArgumentError(
            f"into= takes the tensors to fill, in dicts, lists and tuples shaped like the "
            f"stored object, got {type(v).__module__}.{type(v).__qualname__}")


def _describe(dtype: torch.dtype, shape: tuple) -> str:
    return f"{str(dtype).removeprefix('torch.')}{list(shape)}"


def _receives(target, t: torch.Tensor) -> bool:
    """Whether ``target`` (an ``into`` entry) can take the values of ``t``: a tensor of its
    dtype and shape on any real device, strided, without a lazy conjugate or negative
    bit, and no two of its elements in one place (an ``expand``-ed tensor: the copy
    would raise)."""
    return (isinstance(target, torch.Tensor) and target is not t
            and target.device.type != "meta" and target.layout == torch.strided
            and t.layout == torch.strided and target.dtype == t.dtype
            and target.shape == t.shape and not (target.is_conj() or target.is_neg())
            and not _overlaps(target))


def _overlaps(t: torch.Tensor) -> bool:
    """Whether two elements of ``t`` share a place in memory (a stride of 0)."""
    return any(st == 0 and n > 1 for st, n in zip(t.stride(), t.shape))
