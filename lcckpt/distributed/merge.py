"""Merging a distributed chain's newest step: each delta item rewritten as a keyframe of
exactly what it restores, so that no load of it, or of a later step, needs the steps
before it (then retention may delete them), as ``DeltaCheckpointer.merge`` does.

The new keyframes hold each item's reconstruction in the working precision (fp32 for
fp16/bf16/fp32 items, fp64 for fp64): loading the merged step gives the same tensors, and
the next delta, taken against the writer's reference, replays onto the same values. They
are stored with codec ``"delta"`` and an empty chain, the reader told each item's dtype.

One process writes: the merged blobs go to a new file in the step's directory, then a new
``.metadata`` replaces the old by a rename. A crash before the rename leaves the step as
it was, beside an unreferenced file; the old files stay, since the step's other items
still lie in them.
"""

from __future__ import annotations

import dataclasses
import io
import os
import pickle
import uuid

from ..codec.delta import Reconstruction
from .storage import SUFFIX, CompressedReader, dtype_name
from .store import check_size

__all__ = ["merge_step"]


def merge_step(files, path: str, storage_options: dict | None = None) -> dict:
    """Rewrite step ``path``'s delta items as keyframes. Returns ``{old blob: new blob}``
    as ``(absolute file, offset, length)``, for the writers to rebase on."""
    reader = CompressedReader(path, storage_options=storage_options)
    md = reader.read_metadata()
    deltas = sorted(((idx, info) for idx, info in (md.storage_data or {}).items()
                     if info.codec == "delta"),
                    key=lambda kv: (kv[1].relative_path, kv[1].offset))
    if not deltas:
        return {}
    name = f"__0_{uuid.uuid4().hex[:8]}_9{SUFFIX}"       # "_9": never a save's own file
    target = files.join(path, name)
    new, moved, at = {}, {}, 0
    with files.create_stream(target, "wb") as f:
        for idx, info in deltas:
            rec = Reconstruction()
            for rel, off, n in tuple(info.chain) + ((info.relative_path, info.offset,
                                                     info.length),):
                rec.apply(reader._read(rel, off, n), dtype=dtype_name(info))
            n = 0
            for piece in rec.exact_blob():
                f.write(piece)
                n += memoryview(piece).nbytes
            new[idx] = dataclasses.replace(info, relative_path=name, offset=at, length=n,
                                           chain=())
            moved[(files.absolute(files.join(path, info.relative_path)), info.offset,
                   info.length)] = (files.absolute(target), at, n)
            at += n
        _sync(files, f)
    check_size(files, target, at)
    md.storage_data = {**md.storage_data, **new}
    buf = io.BytesIO()
    pickle.dump(md, buf)
    tmp = files.join(path, ".metadata.merge.tmp")
    with files.create_stream(tmp, "wb") as f:
        f.write(buf.getvalue())
        _sync(files, f)
    files.rename(tmp, files.join(path, ".metadata"))
    return moved


def _sync(files, f) -> None:
    f.flush()
    if not files.remote:
        os.fsync(f.fileno())
