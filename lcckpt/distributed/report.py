"""What ``lcckpt inspect`` and ``lcckpt verify`` say of distributed checkpoints: one DCP
checkpoint directory that :mod:`lcckpt.distributed` wrote (its ``.metadata`` and
``__{rank}_*.distcp`` files), or a :class:`~lcckpt.distributed.DistributedCheckpointer`
directory of ``step_NNNNNNNNNN`` checkpoints.

Inspect reads the metadata alone: per item its name, dtype, shape, codec, writing rank,
bytes and chain depth. Verify also reads and decodes every stored item in this process
(a delta along its chain, each blob's checksums checked, a value loaded without pickle),
with no process group.
"""

from __future__ import annotations

import math
import os
import pickle
import re

from .. import limits
from ..errors import InvalidArgumentError, LcckptError
from .api import _STEP
from .metadata import PlainCheckpoint


def _flat(obj) -> list:
    """The leaves of a loaded state (dicts and lists walked)."""
    if isinstance(obj, dict):
        return [x for v in obj.values() for x in _flat(v)]
    if isinstance(obj, list):
        return [x for v in obj for x in _flat(v)]
    return [obj]


def is_checkpoint(path: str) -> bool:
    """A DCP checkpoint directory (it holds ``.metadata``)."""
    return os.path.isfile(os.path.join(path, ".metadata"))


def steps(path: str) -> list[tuple[int, str]]:
    """A DistributedCheckpointer directory's committed steps, oldest first."""
    if not os.path.isdir(path):
        return []
    return sorted((int(m.group(1)), os.path.join(path, name)) for name in os.listdir(path)
                  if (m := _STEP.fullmatch(name)) and is_checkpoint(os.path.join(path, name)))


def _stored(path: str) -> int:
    return sum(os.path.getsize(os.path.join(path, n)) for n in os.listdir(path)
               if n.endswith(".distcp"))


def _metadata(path: str):
    from .storage import CompressedReader
    reader = CompressedReader(path)
    return reader, reader.read_metadata()


def _writer(name: str):
    """The rank in a plain DCP file's name (``__{rank}_{n}.distcp``), else the name."""
    m = re.fullmatch(r"__(\d+)_\d+\.distcp", name)
    return int(m.group(1)) if m else name


def _inspect_plain(path: str) -> dict:
    """A checkpoint plain DCP wrote: each item's bytes as DCP stored them (plain.py)."""
    from .plain import PlainReader
    md = PlainReader(path).read_metadata()
    items = []
    for idx, info in sorted(md.storage_data.items(), key=lambda kv: (kv[0].fqn,
                                                                     tuple(kv[0].offset or ()))):
        smd = md.state_dict_metadata[idx.fqn]
        chunk = next((c for c in getattr(smd, "chunks", ()) if
                      tuple(c.offsets) == tuple(idx.offset or ())), None)
        dtype = getattr(getattr(smd, "properties", None), "dtype", None)
        shape = list(chunk.sizes) if chunk is not None else []
        items.append({"name": idx.fqn, "offset": list(idx.offset or ()),
                      "dtype": str(dtype).replace("torch.", "") if dtype else "value",
                      "shape": shape, "codec": "plain DCP", "rank": _writer(info.relative_path),
                      "depth": 0, "stored_bytes": info.length, "alias": False,
                      "raw_bytes": math.prod(shape) * dtype.itemsize if dtype else info.length})
    raw, stored = sum(r["raw_bytes"] for r in items), _stored(path)
    return {"path": path, "format": "distributed checkpoint (plain DCP)", "file_bytes": stored,
            "raw_bytes": raw, "ratio": raw / stored if stored else None,
            "ranks": len({r["rank"] for r in items}), "items": items, "problems": []}


def inspect_checkpoint(path: str) -> dict:
    """One checkpoint's items: each stored piece, at ``offset`` in its tensor, of ``shape``
    (an alias: another name of a tied tensor, whose blob the first name's item holds)."""
    try:
        _, md = _metadata(path)
    except PlainCheckpoint:
        return _inspect_plain(path)
    items = []
    for idx, info in sorted(md.storage_data.items(), key=lambda kv: (kv[0].fqn,
                                                                     tuple(kv[0].offset or ()))):
        items.append({"name": idx.fqn, "offset": list(idx.offset or ()),   # in the tensor
                      "dtype": info.dtype.replace("torch.", ""), "shape": list(info.shape),
                      "codec": info.codec, "rank": info.rank, "depth": len(info.chain),
                      "raw_bytes": info.raw_nbytes,
                      "stored_bytes": 0 if info.alias else info.length,
                      "alias": bool(info.alias)})
    raw = sum(r["raw_bytes"] for r in items if not r["alias"])
    stored = _stored(path)
    missing = sorted({os.path.normpath(os.path.join(path, rel))
                      for info in md.storage_data.values()
                      for rel, _, _ in tuple(info.chain) + ((info.relative_path, 0, 0),)
                      if not os.path.isfile(os.path.join(path, rel))})
    return {"path": path, "format": "distributed checkpoint", "file_bytes": stored,
            "raw_bytes": raw, "ratio": raw / stored if stored else None,
            "ranks": len({r["rank"] for r in items}), "items": items,
            "problems": [f"{path}: needs {m}, which is missing" for m in missing]}


def _kind(items: list[dict]) -> tuple[str, int]:
    """("delta", its depth) where a piece restores through a chain, else ("keyframe", 0)."""
    depth = max((r.get("depth", 0) for r in items if r.get("codec") == "delta"), default=0)
    return ("delta" if depth else "keyframe"), depth


def step_kind(path: str) -> dict:
    """The step and kind of the checkpoint at ``path`` (a keyframe restores exactly, a
    delta within its chain's targets), for what ``lcckpt convert`` says it wrote."""
    m = _STEP.fullmatch(os.path.basename(os.path.normpath(path)))
    return {"step": int(m.group(1)) if m else None,
            "step_kind": _kind(inspect_checkpoint(path)["items"])[0]}


def inspect(path: str) -> dict:
    """A checkpoint, or a chain's steps (one row each) and its problems."""
    if is_checkpoint(path):
        return inspect_checkpoint(path)
    rows, problems = [], []
    for step, where in steps(path):
        try:
            doc = inspect_checkpoint(where)
        except (LcckptError, OSError) as e:
            rows.append({"step": step, "kind": "damaged", "restorable": False})
            problems.append(f"step {step}: {e}")
            continue
        kind, depth = _kind(doc["items"])
        rows.append({"step": step, "kind": kind, "depth": depth,
                     "restorable": not doc["problems"], "file_bytes": doc["file_bytes"],
                     "raw_bytes": doc["raw_bytes"], "ratio": doc["ratio"],
                     "items": len(doc["items"])})
        problems += doc["problems"]
    return {"path": path, "format": "distributed chain", "steps": rows, "problems": problems}


def verify_checkpoint(path: str) -> list[dict]:
    """Every stored item read and decoded here: one report entry per item that failed, or
    one saying the checkpoint passed."""
    import io
    import torch
    from ..format.serialization import load
    from .exchange import _dtype
    try:
        reader, md = _metadata(path)
    except PlainCheckpoint:                     # plain DCP's: every item read, safely
        try:
            return [{"path": path, "ok": True, "items": len(_flat(read(path)))}]
        except (LcckptError, OSError) as e:
            return [{"path": path, "ok": False, "error": str(e)}]
    failed, done = [], set()
    for idx, info in md.storage_data.items():
        blob = (info.relative_path, info.offset, info.length)
        if blob in done:                        # a tied tensor's other name
            continue
        done.add(blob)
        try:
            if info.codec == "tree":
                load(io.BytesIO(reader._read(*blob)))
            elif info.codec == "bytes":
                torch.load(io.BytesIO(reader._read(*blob)), weights_only=True)
            else:                               # held to the limit of any load
                limits.check(math.prod(info.shape) * _dtype(info.dtype).itemsize,
                             info.length + sum(n for _, _, n in info.chain), limits.DEFAULT,
                             "it")
                reader._decode(info)
        except (LcckptError, OSError, pickle.UnpicklingError, EOFError, RuntimeError,
                ValueError) as e:
            failed.append({"path": path, "item": idx.fqn, "ok": False,
                           "error": f"{idx.fqn}: {e}"})
    return failed or [{"path": path, "ok": True, "items": len(md.storage_data)}]


def text(doc: dict, table) -> str:
    """What :func:`inspect` found, as ``lcckpt inspect`` prints it (``table(rows, cols)``)."""
    if "steps" in doc:
        return f"{doc['path']}: {len(doc['steps'])} distributed checkpoints\n" + table(
            doc["steps"], ["step", "kind", "depth", "restorable", "file_bytes", "raw_bytes",
                           "ratio", "items"])
    ratio = f", {doc['ratio']:.2f}x" if doc["ratio"] else ""
    return (f"{doc['path']}: distributed checkpoint, {doc['file_bytes']:,} bytes "
            f"({doc['raw_bytes']:,} raw{ratio}), {len(doc['items'])} items written by "
            f"{doc['ranks']} rank(s); alias: another name of a tensor stored once\n"
            + table(doc["items"], ["name", "offset", "dtype", "shape", "codec", "rank", "depth",
                                   "raw_bytes", "stored_bytes", "alias"]))


def verify(path: str, progress=lambda items, desc: items) -> list[dict]:
    """:func:`verify_checkpoint` of a checkpoint, or of each step of a chain."""
    if is_checkpoint(path):
        todo = [(None, path)]
    else:
        todo = steps(path)
    report = []
    for step, where in progress(todo, "verify"):
        try:
            got = verify_checkpoint(where)
        except (LcckptError, OSError) as e:
            got = [{"path": where, "ok": False, "error": str(e)}]
        report += [{"step": step, **r} if step is not None else r for r in got]
    return report


def checkpoint_dir(path: str, step: int | None = None) -> str:
    """The checkpoint directory ``path`` names: itself, or a DistributedCheckpointer
    directory's ``step`` (default: its newest committed step)."""
    if is_checkpoint(path):
        if step is not None:
            raise InvalidArgumentError(f"{path} is one checkpoint, not a directory of steps: "
                                       "leave out --step")
        return path
    found = dict(steps(path))
    if not found:
        raise InvalidArgumentError(f"{path} holds no committed distributed checkpoint")
    if step is None:
        return found[max(found)]
    if step not in found:
        raise InvalidArgumentError(f"step {step} is not committed in {path}; committed: "
                                   f"{sorted(found)}")
    return found[step]


def read(path: str) -> dict:
    """One distributed checkpoint read whole into this process (CPU tensors, no process
    group): what ``lcckpt convert`` writes as one file."""
    from .api import load
    state: dict = {}
    load(state, path)
    return state
