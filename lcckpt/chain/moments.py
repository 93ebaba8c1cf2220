"""Which optimizer first moment belongs to which weight of a saved state.

A restored weight's error moves the model's loss, to first order, by its component along
the gradient; a weight's first moment (SGD's ``momentum_buffer``, Adam's ``exp_avg``: an
average of recent gradients) points that way. The uniform quantizer can make its error
orthogonal to one direction at no cost to the decoder (the restore step of its levels:
``lcckpt.codec.errmodel.ErrorModel.recon_step``), so each tracked weight is given its
first moment, found here in the state being saved.

A ``torch.optim`` state dict names its tensors by index (``state[i]``, in the order of
its ``param_groups``' ``params``), not by the weights' names, so the moments are matched
with the state's other floating tensors by order and shape: each moment with the next
tensor of its shape (buffers and frozen weights in between are skipped). Where any moment
finds no partner, or the state holds more than one optimizer, nothing is matched. A wrong
match costs nothing but the gain: every restored error is still measured against its
target.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from ..format.flatten import MAX_DEPTH, key_repr
from .policy import role_of

__all__ = ["first_moments"]


def _is_optimizer(v) -> bool:
    """A ``torch.optim.Optimizer.state_dict()``: ``state`` by index, ``param_groups``."""
    if not isinstance(v, Mapping) or not isinstance(v.get("state"), Mapping):
        return False
    groups = v.get("param_groups")
    return isinstance(groups, (list, tuple)) and all(
        isinstance(g, Mapping) and isinstance(g.get("params"), (list, tuple)) for g in groups)


def _walk(v, parts: tuple, depth: int, weights: list, optimizers: list) -> None:
    """The floating weights outside optimizers, as ``(path's keys, tensor)`` in the order
    a save visits them, and the optimizers' state dicts."""
    if depth > MAX_DEPTH:
        return
    if isinstance(v, torch.Tensor):
        if v.is_floating_point() and role_of(_key_path(parts)) == "weight":
            weights.append((parts, v))
    elif _is_optimizer(v):
        optimizers.append(v)
    elif isinstance(v, Mapping):
        for k, x in v.items():
            _walk(x, parts + (k,), depth + 1, weights, optimizers)
    elif isinstance(v, (list, tuple)):
        for i, x in enumerate(v):
            _walk(x, parts + (i,), depth + 1, weights, optimizers)


def _key_path(parts: tuple) -> str:
    return "obj" + "".join(f"[{key_repr(k)}]" for k in parts)


def _first_moment(entry) -> torch.Tensor | None:
    if not isinstance(entry, Mapping):
        return None
    for k, m in entry.items():
        if isinstance(k, str) and isinstance(m, torch.Tensor) and m.is_floating_point() \
                and role_of(f'["{k}"]') == "first_moment":
            return m
    return None


def first_moments(obj, *, dotted: bool = False) -> dict[str, torch.Tensor]:
    """``{weight's key path: its first moment}`` for the state ``obj`` (see above);
    empty unless exactly one optimizer's every parameter has a first moment that a
    weight of its shape takes, in order. ``dotted``: keyed by the path's keys joined by
    dots instead (``torch.distributed.checkpoint``'s names of a flattened state)."""
    weights, optimizers = [], []
    _walk(obj, (), 0, weights, optimizers)
    if len(optimizers) != 1:
        return {}
    opt = optimizers[0]
    out, j = {}, 0
    for group in opt["param_groups"]:
        for p in group["params"]:
            if isinstance(p, bool) or not isinstance(p, (int, str)):   # not an index
                return {}
            entry = opt["state"].get(p)
            if entry is None and isinstance(p, int):    # keys made strings (DCP's flattening)
                entry = opt["state"].get(str(p))
            m = _first_moment(entry)
            if m is None:
                return {}
            while j < len(weights) and weights[j][1].shape != m.shape:
                j += 1
            if j == len(weights):
                return {}
            parts = weights[j][0]
            out[".".join(map(str, parts)) if dotted else _key_path(parts)] = m
            j += 1
    return out
