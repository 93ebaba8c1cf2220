"""A large lossless blob of a local checkpoint file, decoded as it is read.

An exact item (and a distributed chain's keyframe) used to be read whole into fresh
memory, then decoded: a transient copy of the item's coded bytes, and page faults that
cost more than the decode on a small machine (docs/chain.md, lcckpt/codec/streamed.py).
Here a lossless blob of :data:`~lcckpt.codec.streamed.STREAM_MIN` bytes or more in a
local file is read chunk by chunk into per-thread buffers and decoded straight into its
target, its own header and payload CRCs checked as it goes. Remote files (fsspec) are
read whole, as before.
"""

from __future__ import annotations

import numpy as np
import torch

from ..codec import dtypes
from ..codec.streamed import STREAM_MIN, StreamedBlob, streamed
from ..format.sources import PartReader


def streamed_blob(path: str, offset: int, length: int, work: str | None,
                  what: str) -> StreamedBlob | None:
    """The blob at ``offset`` of the local file ``path`` as a :class:`StreamedBlob`, if it
    is large, lossless and stored as ``work`` (a codec dtype name, not complex: those are
    not decoded in place); else None, nothing held open, and the caller reads it whole."""
    if work is None or length < STREAM_MIN or dtypes.BY_NAME[work].kind == "complex":
        return None
    part = PartReader.of_path(path, offset, length)
    return None if part is None else streamed(part, work, what)


def as_tensor(x) -> torch.Tensor:
    """A decoded item as a tensor (a read-only array is copied: a tensor may be written)."""
    if isinstance(x, torch.Tensor):
        return x
    a = np.asarray(x)
    return torch.from_numpy(a if a.flags.writeable else a.copy())
