"""Walks of a state before it is saved or loaded into: how many tensors it holds and
their bytes (what a writer sizes its header room and choices by), and where each tensor
sits (the key paths a load into existing tensors decodes into)."""

from __future__ import annotations

from argparse import Namespace
from collections import Counter, OrderedDict, defaultdict, deque
from typing import Any

import torch

from . import composite
from .flatten import MAX_DEPTH, key_repr


def census(obj: Any, limit: int = MAX_DEPTH) -> tuple[int, int]:
    """The number of tensors in ``obj``'s dicts, lists, tuples, deques and namespaces and
    their bytes (a tensor met twice counts twice): what a writer sizes its header room and
    choice by."""
    count = nbytes = 0
    stack = [(obj, 0)]
    while stack:
        v, depth = stack.pop()
        if isinstance(v, torch.Tensor) and composite.is_composite(v):
            stack.extend((t, depth) for t in composite.plain_parts(v))
        elif isinstance(v, torch.Tensor):
            count, nbytes = count + 1, nbytes + v.numel() * v.element_size()
        elif depth < limit and isinstance(v, (dict, list, tuple, deque, Namespace)):
            xs = v.values() if isinstance(v, dict) else \
                vars(v).values() if isinstance(v, Namespace) else v
            if not set(map(type, xs)) <= _LEAVES:    # a million losses: one C loop
                stack.extend((x, depth + 1) for x in xs if type(x) not in _LEAVES)
    return count, nbytes


_LEAVES = {int, float, str, bool, type(None), bytes, complex}     # what census() skips


def tensor_paths(obj: Any, path: str = "obj", depth: int = 0) -> dict[str, torch.Tensor]:
    """Key path -> tensor for the tensors in ``obj``'s dicts, lists, tuples and deques,
    named as :func:`~lcckpt.format.flatten.flatten` names their sections (a load that
    decodes into them)."""
    if isinstance(obj, torch.Tensor):
        return {path: obj}
    out: dict[str, torch.Tensor] = {}
    for at, x in (children(obj, path) or ()) if depth < MAX_DEPTH else ():
        out.update(tensor_paths(x, at, depth + 1))
    return out


def children(obj: Any, path: str) -> list[tuple[str, Any]] | None:
    """``(key path, item)`` of each item of ``obj`` where it is a dict, list, tuple or
    deque (a container a load's ``into`` is walked through), else None."""
    found = keyed_children(obj, path)
    return None if found is None else [(at, x) for _, at, x in found]


def keyed_children(obj: Any, path: str) -> list[tuple[Any, str, Any]] | None:
    """:func:`children` with each item's key (its index in a list) in front."""
    if type(obj) in (list, tuple, deque):
        return [(i, f"{path}[{i}]", x) for i, x in enumerate(obj)]
    if type(obj) in (dict, OrderedDict, Counter, defaultdict, Namespace):
        return [(k, f"{path}[{key_repr(k)}]", x)
                for k, x in (vars(obj) if type(obj) is Namespace else obj).items()]
    return None
