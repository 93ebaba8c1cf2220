"""Merging a step of a distributed chain: each delta item rewritten as a keyframe of
exactly what it restores, so that no load of it, or of a later step, needs the steps
before it (then retention may delete them), as ``DeltaCheckpointer.merge`` does.

The new keyframes hold each item's reconstruction in the working precision (fp32 for
fp16/bf16/fp32 items, fp64 for fp64): loading the merged step gives the same tensors, and
the next delta, taken against the writer's reference, replays onto the same values. They
are stored with codec ``"delta"`` and an empty chain, the reader told each item's dtype.

One process writes: the merged blobs go to a new file in the step's directory, then a new
``.metadata`` replaces the old by a rename. A crash before the rename leaves the step as
it was, beside an unreferenced file; the old files stay, since the step's other items
still lie in them. A step older than the newest is merged the same way, then every later
step's chains that pass through its old blobs are made to start at the new keyframes
(:func:`rebase_step`), each step's ``.metadata`` replaced by a rename of its own: a crash
in between leaves later steps on their old chains, whose blobs are all still on disk.
"""

from __future__ import annotations

import dataclasses
import io
import os
import pickle
import uuid

from .storage import SUFFIX, CompressedReader
from .store import check_size

__all__ = ["merge_step", "rebase_step"]


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
            old = (files.absolute(files.join(path, info.relative_path)), info.offset,
                   info.length)
            if old in moved:                    # another name of a tensor merged already
                _, off, n = moved[old]
                new[idx] = dataclasses.replace(info, relative_path=name, offset=off,
                                               length=n, chain=(), zero_base=False)
                continue
            rec = info.replay(reader._read)
            n = 0
            for piece in rec.exact_blob():
                f.write(piece)
                n += memoryview(piece).nbytes
            new[idx] = dataclasses.replace(info, relative_path=name, offset=at, length=n,
                                           chain=(), zero_base=False)
            moved[old] = (files.absolute(target), at, n)
            at += n
        _sync(files, f)
    check_size(files, target, at)
    md.storage_data = {**md.storage_data, **new}
    _replace_metadata(files, path, md)
    return moved


def rebase_step(files, path: str, moved: dict, storage_options: dict | None = None) -> int:
    """Make the chains of step ``path`` that pass through a merged blob (``moved``, as
    :func:`merge_step` returns it) start at its keyframe; returns how many changed."""
    md = CompressedReader(path, storage_options=storage_options).read_metadata()
    new = {}
    for idx, info in (md.storage_data or {}).items():
        chain = tuple(getattr(info, "chain", ()) or ())
        at = [(files.absolute(files.join(path, rel)), off, n) for rel, off, n in chain]
        hit = [i for i, blob in enumerate(at) if blob in moved]
        if hit:
            i = hit[-1]
            head, off, n = moved[at[i]]
            new[idx] = dataclasses.replace(      # now from the merged keyframe
                info, chain=((files.relative(head, path), off, n),) + chain[i + 1:],
                zero_base=False)
    if new:
        md.storage_data = {**md.storage_data, **new}
        _replace_metadata(files, path, md)
    return len(new)


def _replace_metadata(files, path: str, md) -> None:
    buf = io.BytesIO()
    pickle.dump(md, buf)
    tmp = files.join(path, ".metadata.merge.tmp")
    with files.create_stream(tmp, "wb") as f:
        f.write(buf.getvalue())
        _sync(files, f)
    files.rename(tmp, files.join(path, ".metadata"))


def _sync(files, f) -> None:
    f.flush()
    if not files.remote:
        os.fsync(f.fileno())
