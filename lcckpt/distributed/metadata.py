"""The allow-list unpickler of a distributed checkpoint's ``.metadata``: DCP's metadata
dataclasses, torch sizes, dtypes and layouts, and lcckpt's per-item record; anything else
is refused with :class:`~lcckpt.errors.UnsafeObjectError`, so reading a checkpoint never
runs code from it."""

from __future__ import annotations

import pickle

import torch

from ..errors import UnsafeObjectError


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
