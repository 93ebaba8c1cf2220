"""A distributed checkpoint's ``.metadata``, read safely.

- :class:`MetadataUnpickler` is an allow-list: DCP's metadata dataclasses, torch sizes,
  dtypes and layouts, and lcckpt's per-item record; anything else is refused with
  :class:`~lcckpt.errors.UnsafeObjectError`, so reading a checkpoint never runs code
  from it.
- :func:`check_items` ties each stored tensor item's shape to DCP's chunk of it, which
  lies inside the tensor DCP's planner matches against the caller's own (a load refuses
  another size). A reader allocates an item by its shape, and a delta's blobs must have
  it, so a forged record cannot make a load allocate more than the caller's tensors.
"""

from __future__ import annotations

import pickle

import torch

from torch.distributed.checkpoint.metadata import (BytesStorageMetadata, Metadata,
                                                   TensorStorageMetadata)

from ..errors import CorruptDataError, InvalidArgumentError, UnsafeObjectError
from .exchange import VALUES


def _layout_by_name(name: str) -> torch.layout:
    obj = getattr(torch, str(name).replace("torch.", ""), None)
    if not isinstance(obj, torch.layout):
        raise UnsafeObjectError(f"checkpoint metadata names an unknown layout {name!r}")
    return obj


class MetadataUnpickler(pickle.Unpickler):
    """Unpickles DCP metadata only: its dataclasses, torch sizes/dtypes and ours
    (``info_class``: the storage module's per-item record, which imports this module)."""

    def __init__(self, file, info_class: type):
        super().__init__(file)
        self.info_class = info_class

    def find_class(self, module, name):
        if module == "torch.distributed.checkpoint.metadata":
            return getattr(__import__(module, fromlist=[name]), name)
        if module == "torch.distributed.checkpoint.filesystem" and name == "_StorageInfo":
            # plain DCP's per-item record: read so that we can say what wrote the checkpoint
            return getattr(__import__(module, fromlist=[name]), name)
        if module == "lcckpt.distributed.storage" and name == "LcckptStorageInfo":
            return self.info_class
        if module == "torch":
            obj = getattr(torch, name, None)
            if name == "Size" or isinstance(obj, (torch.dtype, torch.layout,
                                                  torch.memory_format)):
                return obj
        if module == "torch.serialization" and name == "_get_layout":
            return _layout_by_name
        if module == "pathlib" and name in ("PosixPath", "PurePosixPath", "WindowsPath",
                                            "PureWindowsPath"):    # a checkpoint_id
            import pathlib  # noqa: PLC0415
            return getattr(pathlib, name)
        if module == "collections" and name == "OrderedDict":
            import collections  # noqa: PLC0415
            return collections.OrderedDict
        raise UnsafeObjectError(f"checkpoint metadata refers to {module}.{name}, which is not "
                                "part of DCP metadata; refusing to load it")


TENSORS = ("exact", "delta")      # the codecs of tensor items (exchange.VALUES: values)


def _dims(x) -> tuple | None:
    """``x`` as a tuple of non-negative ints, or None where it is not one."""
    if not isinstance(x, (tuple, list, torch.Size)) or \
            not all(type(d) is int and d >= 0 for d in x):
        return None
    return tuple(x)


def check_items(md, where: str, info_class: type) -> None:
    """Raise :class:`CorruptDataError` unless ``md`` is DCP metadata whose every stored
    item agrees with it: a tensor item's shape is that of DCP's chunk at its offset,
    inside the tensor's size; a value item is a value there. O(items + chunks).
    :class:`InvalidArgumentError` where the items are not ``info_class`` (plain DCP's)."""
    if not isinstance(md, Metadata):
        raise CorruptDataError(f"{where}: not DCP checkpoint metadata")
    if not all(isinstance(i, info_class) for i in (md.storage_data or {}).values()):
        raise InvalidArgumentError(f"{where} was not written by lcckpt's CompressedWriter; "
                                   "read it with torch.distributed.checkpoint.FileSystemReader")
    chunks = {}
    for fqn, smd in md.state_dict_metadata.items():
        if isinstance(smd, TensorStorageMetadata):
            size = _dims(smd.size)
            for c in smd.chunks:
                off, n = _dims(c.offsets), _dims(c.sizes)
                if size is None or off is None or n is None or not \
                        len(off) == len(n) == len(size) or \
                        any(o + k > s for o, k, s in zip(off, n, size)):
                    raise CorruptDataError(f"{where}: {fqn}: a stored chunk at {c.offsets} "
                                           f"of {c.sizes} does not fit the tensor's {smd.size}")
                chunks[(fqn, off)] = n
    for idx, info in (md.storage_data or {}).items():
        smd = md.state_dict_metadata.get(idx.fqn)
        if info.codec in VALUES and isinstance(smd, BytesStorageMetadata):
            continue
        shape = _dims(info.shape)
        if info.codec not in TENSORS or shape is None or \
                chunks.get((idx.fqn, _dims(idx.offset))) != shape:
            raise CorruptDataError(
                f"{where}: the stored item {idx.fqn} ({info.codec!r}, shape {info.shape}) "
                "matches no chunk of DCP's metadata; the checkpoint is damaged or forged")
