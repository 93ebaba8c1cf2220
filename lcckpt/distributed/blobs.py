"""Blobs of local checkpoint files: a large lossless one decoded as it is read, the rest
read through one open file per path for a whole load.

An exact item (and a distributed chain's keyframe) used to be read whole into fresh
memory, then decoded: a transient copy of the item's coded bytes, and page faults that
cost more than the decode on a small machine (docs/chain.md, lcckpt/codec/streamed.py).
Here a lossless blob of :data:`~lcckpt.codec.streamed.STREAM_MIN` bytes or more in a
local file is read chunk by chunk into per-thread buffers and decoded straight into its
target, its own header and payload CRCs checked as it goes; a large delta is read when
its item is replayed, as a chain file's is. Remote files (fsspec) are read whole, as
before.

A chain's item is a blob in each of several files (its keyframe's and every delta's):
a load of 200 items read 1,200 blobs, and opening the file (and asking whether it exists)
for each cost about 23 us a blob, as much as reading it. :class:`LocalFiles` keeps each
file open for the load instead.
"""

from __future__ import annotations

import numpy as np
import torch

from ..codec import dtypes
from ..codec.blob import LOSSLESS, parse
from ..codec.tensor import decode
from ..codec.streamed import STREAM_MIN, DeferredBlob, StreamedBlob, read_later, streamed
from ..errors import BrokenChainError, CorruptDataError, InvalidArgumentError, TruncatedError
from ..format.sections import DEFER_MIN
from ..format.sources import FileSource, PartReader


def streamed_blob(path: str, offset: int, length: int, work: str | None,
                  what: str) -> StreamedBlob | None:
    """The blob at ``offset`` of the local file ``path`` as a :class:`StreamedBlob`, if it
    is large, lossless and stored as ``work`` (a codec dtype name, not complex: those are
    not decoded in place); else None, nothing held open, and the caller reads it whole."""
    if work is None or length < STREAM_MIN or dtypes.BY_NAME[work].kind == "complex":
        return None
    part = PartReader.of_path(path, offset, length)
    return None if part is None else streamed(part, work, what)


def deferred_blob(path: str, offset: int, length: int, what: str) -> DeferredBlob | None:
    """The delta blob at ``offset`` of the local file ``path``, read when its item is
    replayed (chunk by chunk where the item's deltas are large: lcckpt/codec/replay.py),
    if it is :data:`~lcckpt.format.sections.DEFER_MIN` bytes or more; else None, and the
    caller reads it whole."""
    if length < DEFER_MIN:
        return None
    part = PartReader.of_path(path, offset, length)
    return None if part is None else read_later(part, "", parse, what, stream=False,
                                                defer=True)


def decode_exact(blob, out: torch.Tensor, what: str) -> torch.Tensor:
    """An exact item's blob decoded into ``out`` (of the item's shape, as the checkpoint's
    metadata gives it): a delta's blob, or one of another size, is refused before anything
    is decoded."""
    if parse(blob, False)[1].kind != LOSSLESS:
        raise CorruptDataError(f"{what}: the blob of an exact item is a delta's")
    try:
        return as_tensor(decode(blob, out=out))
    except InvalidArgumentError as e:
        raise CorruptDataError(f"{what}: {e}") from None


def as_tensor(x) -> torch.Tensor:
    """A decoded item as a tensor (a read-only array is copied: a tensor may be written)."""
    if isinstance(x, torch.Tensor):
        return x
    a = np.asarray(x)
    return torch.from_numpy(a if a.flags.writeable else a.copy())


def missing(path: str) -> BrokenChainError:
    """The error of a load whose file ``path`` is gone."""
    return BrokenChainError(f"{path} is missing: a checkpoint this one depends on was "
                            "deleted or moved")


def exactly(data, path: str, offset: int, length: int):
    """``data``, read from ``path`` at ``offset``, if it is all ``length`` bytes asked for;
    TruncatedError where the file ended first."""
    if len(data) != length:
        raise TruncatedError(f"{path}: {length} bytes expected at offset {offset}, "
                             f"got {len(data)}")
    return data


class LocalFiles:
    """Positional reads of local checkpoint files, each opened once; :meth:`close` when
    the load is over (also after an error)."""

    def __init__(self):
        self._open: dict[str, FileSource] = {}

    def read(self, path: str, offset: int, length: int) -> memoryview:
        """``length`` bytes of ``path`` at ``offset``: BrokenChainError where the file is
        missing (a checkpoint this one depends on was deleted), TruncatedError where it
        ends first."""
        src = self._open.get(path)
        if src is None:
            try:
                f = open(path, "rb")
            except FileNotFoundError as e:
                raise missing(path) from e
            src = self._open[path] = FileSource(f, 0, owned=True)
        if offset + length > src.size:          # before a buffer of the record's length
            return exactly(b"", path, offset, length)
        return exactly(src.read(offset, length), path, offset, length)

    def close(self) -> None:
        for src in self._open.values():
            src.f.close()
        self._open.clear()
