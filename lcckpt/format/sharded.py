"""Sharded checkpoints as Hugging Face writes them: an index (``model.safetensors.index.json``,
``pytorch_model.bin.index.json``) whose ``weight_map`` names, for every tensor, the file
beside it that holds it. Read only: each shard loads as any file does, and the index's
tensors come back as one dict in its order.

A shard is a plain file name in the index's own directory (``../x``, ``/etc/x`` and
another index are refused), every tensor the index names must be in its shard, and the index is bounded in
size before it is parsed.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Mapping

from ..errors import CorruptDataError, NotFoundError, ResourceLimitError
from .. import limits

MAX_INDEX_BYTES = limits.MAX_HEADER_BYTES      # the JSON of 1M tensors takes ~100 MB less


def is_index(path: str, head: bytes) -> bool:
    """Whether ``path`` looks like a shard index: a ``.json`` file holding an object."""
    return path.endswith(".json") and head.lstrip()[:1] == b"{"


def read_index(path: str) -> list[tuple[str, str]]:
    """``(tensor name, shard file name)`` for every tensor, in the index's order."""
    size = os.path.getsize(path)
    if size > MAX_INDEX_BYTES:
        raise ResourceLimitError(f"{path}: a shard index of {size:,} bytes, over the "
                                 f"{MAX_INDEX_BYTES:,} read")
    try:
        with open(path, "rb") as f:
            doc = json.loads(f.read(), object_pairs_hook=_no_duplicates)
    except (ValueError, UnicodeDecodeError, RecursionError) as e:
        raise CorruptDataError(f"{path} is not a shard index: {e}") from None
    wmap = doc.get("weight_map") if isinstance(doc, dict) else None
    if not isinstance(wmap, dict) or not wmap:
        raise CorruptDataError(f"{path} is not a shard index: no 'weight_map' object naming "
                               "each tensor's file")
    for name, shard in wmap.items():
        if not isinstance(shard, str) or not shard or shard in (".", "..") or \
                os.path.basename(shard) != shard or "/" in shard or "\\" in shard or \
                shard.endswith(".json"):
            raise CorruptDataError(f"{path}: tensor {name!r} is in {shard!r}, not a file name "
                                   "beside the index")
    return list(wmap.items())


def _no_duplicates(pairs):
    keys = [k for k, _ in pairs]
    if len(set(keys)) != len(keys):
        raise ValueError("a key appears twice")
    return dict(pairs)


def load_index(path: str, load_shard: Callable[[str], object]) -> dict:
    """Every tensor the index at ``path`` names, from its shards loaded by
    ``load_shard(shard_path)``, as one dict in the index's order."""
    entries = read_index(path)
    shards: dict[str, list[str]] = {}
    for name, shard in entries:
        shards.setdefault(shard, []).append(name)
    base = os.path.dirname(os.path.abspath(path))
    found = {}
    for shard, names in shards.items():
        where = os.path.join(base, shard)
        if not os.path.isfile(where):
            raise NotFoundError(2, f"a shard the index {path} names is missing", where)
        obj = load_shard(where)
        if not isinstance(obj, Mapping):
            raise CorruptDataError(f"shard {where} holds a {type(obj).__name__}, not named tensors")
        for name in names:
            if name not in obj:
                raise CorruptDataError(f"shard {where} has no tensor {name!r}, which the index "
                                       f"{path} puts there")
            found[name] = obj[name]
    return {name: found[name] for name, _ in entries}
