"""What a load adds to the state it loads into: the stored entries under an empty container.

DCP loads what the given state holds, in place. An optimizer that has not stepped yet, as
at every restart, gives ``opt.state_dict()["state"] == {}``: DCP then loads its
``param_groups`` and not one moment or step count, and says nothing. Where the given state
holds a container empty, the stored entries under it are added to it (tensors new on the
CPU, values as stored), so that ``opt.load_state_dict(state["optim"])`` gets them; an empty
state (``{}``) loads the whole checkpoint. A container that holds anything keeps DCP's
rule: only what it holds is loaded (a model's state dict with another head loads its own
keys, no others).
"""

from __future__ import annotations

import math
import re
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata

from .. import limits
from ..errors import InvalidArgumentError, ResourceLimitError

__all__ = ["fill_empty", "settle"]

_MISSING = object()


def _child(container: Any, key: Any) -> Any:
    if isinstance(container, dict):
        return container.get(key, _MISSING)
    if isinstance(container, list) and isinstance(key, int) and 0 <= key < len(container):
        return container[key]
    return _MISSING


def _empty_container(state: dict, path: tuple) -> Any:
    """The deepest container along ``path`` that ``state`` holds (``state`` itself at
    the top: ``{}`` loads everything), if it is empty; else None."""
    cur = state
    for key in path[:-1]:
        nxt = _child(cur, key)
        if nxt is _MISSING:
            break
        cur = nxt
    else:
        if _child(cur, path[-1]) is not _MISSING:
            return None                       # the entry itself is there: DCP loads it
    return cur if isinstance(cur, (dict, list)) and not cur else None


def _param_ids(parent: Any, container: Any) -> set:
    """The parameter indices of an optimizer's state dict, where ``container`` is its
    ``state``: DCP's paths spell them as strings, ``load_state_dict`` matches ints."""
    if not (isinstance(parent, dict) and parent.get("state") is container
            and isinstance(parent.get("param_groups"), list)):
        return set()
    return {p for g in parent["param_groups"] if isinstance(g, dict)
            and isinstance(g.get("params"), list) for p in g["params"] if isinstance(p, int)}


def _set(root: dict, path: tuple, value: Any, ids: dict) -> None:
    """``root[path[0]][path[1]]... = value``, creating on the way a list where the next
    key is an int (DCP's paths give a list's index as an int, a dict's key as a str) and a
    dict otherwise; an optimizer's state gets its parameter indices back as ints (``ids``:
    each container's, found once)."""
    parent, cur = None, root
    for i, key in enumerate(path):
        if isinstance(cur, list):
            cur.extend([None] * (key + 1 - len(cur)))
        elif isinstance(key, str) and key.isdigit():
            if id(cur) not in ids:
                ids[id(cur)] = _param_ids(parent, cur)
            key = int(key) if int(key) in ids[id(cur)] else key
        if i == len(path) - 1:
            cur[key] = value
        else:
            if isinstance(cur, list) and cur[key] is None or \
                    isinstance(cur, dict) and key not in cur:
                cur[key] = [] if isinstance(path[i + 1], int) else {}
            parent, cur = cur, cur[key]


def _has_dtensor(obj: Any) -> bool:
    from torch.distributed.tensor import DTensor  # noqa: PLC0415 - as pool.py does
    if isinstance(obj, dict):
        return any(_has_dtensor(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return any(_has_dtensor(v) for v in obj)
    return isinstance(obj, DTensor)


def _stored_bytes(metadata: Metadata) -> int:
    """The bytes a whole load of ``metadata`` reads: each blob once, a delta's chain too."""
    blobs = set()
    for info in (metadata.storage_data or {}).values():
        for blob in ((getattr(info, "relative_path", None), getattr(info, "offset", None),
                      getattr(info, "length", None)), *(getattr(info, "chain", None) or ())):
            blobs.add(tuple(blob))
    return sum(b[2] for b in blobs if len(b) == 3 and type(b[2]) is int and b[2] > 0)


def _check_added(added: int, metadata: Metadata, max_bytes, what: str) -> None:
    """New memory sized by the file's metadata, held to ``max_bytes``. Under "auto", to
    what this process has left: the stored size cannot bound it, since a valid
    checkpoint stores a constant tensor of any size in a few bytes (lcckpt.distributed's
    codecs do), and the limit never refuses a valid file that fits."""
    if not limits.is_auto(max_bytes):
        limits.check(added, _stored_bytes(metadata), max_bytes, what)
        return
    mem = limits.usable_memory()
    if mem is not None and added > mem[0]:
        raise ResourceLimitError(
            f"{what} declares {added:,} bytes of data, over the {mem[0]:,} bytes {mem[1]} "
            "leaves this process: free memory, load into a state that holds the tensors "
            "(only what it holds is loaded), or pass max_bytes=None if you trust the file")


def fill_empty(state: dict, metadata: Metadata, max_bytes=limits.DEFAULT) -> list[str]:
    """Add to ``state`` each stored entry whose deepest container in ``state`` is empty;
    returns their fqns. Their tensors are new and sized by the file's metadata, so their
    bytes are held to ``max_bytes`` (:func:`_check_added`). Refused where ``state`` holds
    DTensors: a sharded optimizer's moments must be sharded like its parameters, which a
    new full tensor is not."""
    paths = metadata.planner_data or {}
    found = []
    for fqn, md in metadata.state_dict_metadata.items():
        path = paths.get(fqn, (fqn,))          # a checkpoint saved unflattened: its fqn
        if isinstance(path, (tuple, list)) and path and \
                _empty_container(state, tuple(path)) is not None:
            found.append((fqn, tuple(path), md))
    if found and _has_dtensor(state):
        where = ".".join(map(str, found[0][1][:-1]))
        raise InvalidArgumentError(
            f"the checkpoint holds {len(found)} entries (e.g. {found[0][0]!r}) under "
            f"{where!r}, which the state to load into holds empty, and a new full tensor "
            "would not be sharded like the model's DTensors: create the optimizer's state "
            "first (one step with zero gradients at lr 0, as torch.distributed.checkpoint."
            "state_dict.get_state_dict does), then take its state_dict() and load")
    added = sum(math.prod(md.size) * md.properties.dtype.itemsize for _, _, md in found
                if isinstance(md, TensorStorageMetadata))
    _check_added(added, metadata, max_bytes, f"the {len(found)} entries a load adds to its state")
    ids: dict = {}
    for fqn, path, md in found:     # zeros: no memory's old bytes where a forged file has gaps
        value = torch.zeros(md.size, dtype=md.properties.dtype) \
            if isinstance(md, TensorStorageMetadata) else None
        _set(state, path, value, ids)
    return [fqn for fqn, _, _ in found]


def settle(state: dict, planner) -> None:
    """After a load whose ``planner`` added entries: the top-level keys that ``dcp.load``
    leaves out (it hands back only those it was given) taken from the state the planner
    loaded into, then :func:`_settle_keys`."""
    if not planner.filled:
        return
    for key, value in planner.original_state_dict.items():
        state.setdefault(key, value)
    _settle_keys(state)


def _settle_keys(obj: Any) -> None:
    """Give each optimizer state dict under ``obj`` its parameter indices back as ints,
    once its ``param_groups`` have loaded (a state loaded whole: they were placeholders
    when its entries were added)."""
    if isinstance(obj, dict):
        state = obj.get("state")
        ids = _param_ids(obj, state) if isinstance(state, dict) else set()
        for key in [k for k in state if isinstance(k, str) and k.isdigit()] if ids else ():
            if int(key) in ids and int(key) not in state:
                state[int(key)] = state.pop(key)
        for v in obj.values():
            _settle_keys(v)
    elif isinstance(obj, list):
        for v in obj:
            _settle_keys(v)


_WRAPPERS = ("module.", "_orig_mod.")     # DistributedDataParallel's, torch.compile's


def missing_key_hint(err: BaseException, reader) -> BaseException:
    """``err`` with a note where DCP found a key of the state missing from the checkpoint
    and the checkpoint holds it under a wrapper's prefix, or without one (a state dict of a
    DDP-wrapped or compiled model against one of the bare model, either way)."""
    m = re.search(r"Missing key in checkpoint state_dict: (\S+?)\.?$", str(err), re.M)
    if m is None:
        return err
    try:
        stored = list(reader.read_metadata().state_dict_metadata)
    except Exception:                          # the error says enough as it is
        return err

    def bare(key: str) -> str:
        for w in _WRAPPERS:
            key = key.replace(w, "")
        return key
    want = m.group(1)
    near = [k for k in stored if bare(k) == bare(want)]
    if near:
        err.add_note(f"the checkpoint holds {near[0]!r} where this state has {want!r}: a "
                     "DistributedDataParallel's state_dict() adds 'module.' to every key and "
                     "torch.compile's '_orig_mod.'; load into a state dict made as the saved "
                     "one was (model.module.state_dict() of a DDP model, say)")
    return err
