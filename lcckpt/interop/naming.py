"""Names and indices shared by the lazy readers (reader.py for lcckpt files and chain
steps, foreign.py for torch.save and safetensors files): a leaf's flat name, and numpy's
basic indexing applied to a torch tensor."""

from __future__ import annotations

import operator
from typing import Any

import torch

from ..codec import dtypes
from ..errors import InvalidArgumentError


def basic_index(index, ndim: int, path: str) -> list:
    """``index`` as numpy's basic indexing reads it: a list with one int or slice per
    dimension and ``None`` for each new axis, the ``...`` expanded (a missing one is
    at the end)."""
    items = list(index) if isinstance(index, tuple) else [index]
    for x in items:
        if not (x is None or x is Ellipsis or isinstance(x, slice) or is_int(x)):
            raise InvalidArgumentError(
                f"a slice read of {path} takes ints, slices, None and ..., got "
                f"{type(x).__name__}; read the tensor with get_tensor for other indexing")
    if sum(x is Ellipsis for x in items) > 1:
        raise IndexError("an index can only have a single ellipsis ('...')")
    used = sum(x is not None and x is not Ellipsis for x in items)
    if used > ndim:
        raise IndexError(f"too many indices for {path}: {ndim}-d, but {used} were indexed")
    at = items.index(Ellipsis) if Ellipsis in items else len(items)
    return items[:at] + [slice(None)] * (ndim - used) + items[at + 1:]


def is_int(x) -> bool:
    if isinstance(x, bool):
        return False
    try:
        operator.index(x)
    except TypeError:
        return False
    return True


def position(i, n: int, path: str) -> int:
    i = operator.index(i)
    if not -n <= i < n:
        raise IndexError(f"index {i} is out of range for a dimension of size {n} of {path}")
    return i % n


def apply_index(t: torch.Tensor, items: list) -> torch.Tensor:
    """``t[items]`` with numpy's meaning, negative steps included (torch has none): an
    item is ``None`` (new axis), an int, a slice or a ``range`` of valid positions."""
    d = 0
    for x in items:
        if x is None:
            t = t.unsqueeze(d)
            d += 1
            continue
        if not isinstance(x, (slice, range)):
            t = t.select(d, position(x, t.shape[d], "the tensor"))
            continue
        r = range(*x.indices(t.shape[d])) if isinstance(x, slice) else x
        if not r:
            t = t.narrow(d, 0, 0)
        else:
            lo = min(r[0], r[-1])
            t = t.narrow(d, lo, max(r[0], r[-1]) + 1 - lo)
            t = t[(slice(None),) * d + (slice(None, None, abs(r.step)),)]
            t = t.flip(d) if r.step < 0 else t
        d += 1
    return t


def flat_name(parts: tuple) -> str:
    """The keys on a leaf's way joined by ".": ``("model", "fc.weight")`` is
    ``"model.fc.weight"``."""
    return ".".join(p if type(p) is str else str(p) for p in parts)


def flat_names(found: list) -> dict[str, tuple[str, Any]]:
    """Flat name -> (key path, leaf) of ``found``'s ``(keys, key path, leaf)``; colliding
    flat names fall back to key paths."""
    seen: dict[str, list] = {}
    for parts, path, node in found:
        seen.setdefault(flat_name(parts), []).append((path, node))
    out = {}
    for parts, path, node in found:
        name = flat_name(parts)
        out[name if len(seen[name]) == 1 else path] = (path, node)
    return out


def brief(keys: list) -> str:
    """The first keys of ``keys``, for a message."""
    return ", ".join(map(repr, keys[:8])) + (f", ... ({len(keys)} in all)" if len(keys) > 8 else "")


class Keyed:
    """What the readers answer from their ``_index`` (flat name -> (key path, leaf)),
    ``path`` and ``close``."""

    _index: dict
    path: str
    _closed = False             # set by close(): a read then says so

    def _check_open(self) -> None:
        if self._closed:
            raise InvalidArgumentError(f"{self.path} is closed: read its tensors inside the "
                                       "`with lcckpt.open(...)` block, or before close()")

    def _find(self, key, missing: bool = True):
        """``(key path, leaf)`` of ``key``, a flat name or a key path; a ``KeyError``
        listing the keys where it is neither (None with ``missing=False``)."""
        self._check_open()
        hit = self._index.get(key) if isinstance(key, str) else None
        if hit is None and isinstance(key, str):
            hit = next(((p, n) for p, n in self._index.values() if p == key), None)
        if hit is not None or not missing:
            return hit
        raise KeyError(f"no tensor {key!r} in {self.path}; keys: {brief(list(self._index))}"
                       + self._missing_hint())

    def _missing_hint(self) -> str:
        return ""

    def keys(self) -> list[str]:
        """The leaves' names, in the order they were saved."""
        return list(self._index)

    def offset_keys(self) -> list[str]:
        """The leaves' names in the file's order (safe_open's ``offset_keys``)."""
        return list(self._index)

    def __contains__(self, key) -> bool:
        return self._find(key, missing=False) is not None

    def __iter__(self):
        return iter(self._index)

    def __len__(self) -> int:
        return len(self._index)

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class Sliced:
    """``get_shape()`` and ``get_dtype()`` of the readers' slices, as safetensors' slices
    answer them, from their ``shape`` and ``dtype``."""

    shape: torch.Size
    dtype: torch.dtype

    def get_shape(self) -> list[int]:
        return list(self.shape)

    def get_dtype(self) -> str:
        """The dtype as safetensors names it (``"F32"``, ``"BF16"``, ...)."""
        return dtypes.TORCH_NAME[self.dtype]
