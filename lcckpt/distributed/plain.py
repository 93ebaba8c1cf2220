"""Checkpoints plain DCP wrote (``dcp.save`` to a directory), read without running code.

DCP's own ``FileSystemReader`` unpickles ``.metadata`` with ``pickle.load`` and its
default load planner unpickles values with ``weights_only=False``: a checkpoint from
elsewhere can run code on load (``dcp_to_torch_save`` too). :class:`PlainReader` reads
the metadata through :class:`~.metadata.MetadataUnpickler` (DCP's classes only), checks
that every item lies in a file of the checkpoint's own directory, and each item's CRC-32s
as it reads it; DCP then reads the tensors with ``torch.load(weights_only=True)``, and
:class:`~.planner.SafeLoadPlanner` the values. :func:`reader_for` picks it where
:class:`~.storage.CompressedReader` finds a plain checkpoint, so
``lcckpt.distributed.load`` and ``lcckpt convert`` read both.
"""

from __future__ import annotations

import io
import os

from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta

from ..errors import CorruptDataError
from ..format.torchzip import open_zip, read_members
from .metadata import PlainCheckpoint, chunks_of, unpickle
from .storage import CompressedReader, LcckptStorageInfo
from .store import files_for

__all__ = ["PlainReader", "reader_for"]


class PlainReader(FileSystemReader):
    """DCP's reader of a local checkpoint directory, its metadata read safely and each
    item's CRC-32s checked (``torch.load`` does not: a flipped bit loaded silently)."""

    def _slice_file(self, file, sinfo):
        check_crcs(_Slice(file, sinfo.offset, sinfo.length),
                   f"{self.path}: {sinfo.relative_path} at {sinfo.offset}")
        return super()._slice_file(file, sinfo)

    def read_metadata(self, *args, **kwargs) -> Metadata:
        path = self._get_metadata_path(kwargs.get("rank"))
        with self.fs.create_stream(path, "rb") as f:
            raw = f.read()
        md = unpickle(raw, path, LcckptStorageInfo)
        check_plain(md, os.fspath(self.path))
        if md.storage_meta is None:
            md.storage_meta = StorageMeta()
        md.storage_meta.load_id = self.load_id
        return md


class _Slice(io.RawIOBase):
    """``length`` bytes of ``file`` from ``offset``, as a seekable file of their own (DCP's
    view seeks from its end wrongly, so zipfile would find no directory in it)."""

    def __init__(self, file, offset: int, length: int):
        super().__init__()
        self.file, self.offset, self.length, self.pos = file, offset, length, 0

    def seekable(self) -> bool:
        return True

    def readable(self) -> bool:
        return True

    def seek(self, pos: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self.pos, io.SEEK_END: self.length}[whence]
        self.pos = min(max(base + pos, 0), self.length)
        return self.pos

    def tell(self) -> int:
        return self.pos

    def readinto(self, b) -> int:
        n = min(len(b), self.length - self.pos)
        self.file.seek(self.offset + self.pos)
        got = self.file.readinto(memoryview(b)[:n]) if n > 0 else 0
        self.pos += got
        return got


def check_crcs(data, where: str) -> None:
    """Read every member of the ``torch.save`` zip in ``data`` (seekable) to its end,
    which checks its CRC-32 (:class:`ChecksumError` naming ``where`` otherwise)."""
    z = open_zip(data, where)
    if z is not None:
        with z:
            read_members(z, z.infolist(), where)


def check_plain(md, where: str) -> None:
    """Raise :class:`CorruptDataError` unless every stored item of ``md`` lies inside a
    file of the directory ``where`` (a name, no path) and every chunk inside its tensor."""
    items = getattr(md, "storage_data", None)
    if not isinstance(md, Metadata) or not isinstance(items, dict):
        raise CorruptDataError(f"{where}: not DCP checkpoint metadata")
    chunks_of(md, where)
    sizes: dict[str, int] = {}
    for idx, info in items.items():
        name = getattr(info, "relative_path", None)
        off, n = getattr(info, "offset", None), getattr(info, "length", None)
        if type(name) is not str or os.path.basename(name) != name or name in ("", ".", ".."):
            raise CorruptDataError(f"{where}: an item names {name!r}, not a file of the "
                                   "checkpoint's directory; the checkpoint is damaged or forged")
        if name not in sizes:
            full = os.path.join(where, name)
            sizes[name] = os.path.getsize(full) if os.path.isfile(full) else -1
        descriptors = getattr(info, "transform_descriptors", None) or ()
        if type(off) is not int or type(n) is not int or off < 0 or n < 0 or \
                off + n > sizes[name] or not isinstance(descriptors, (list, tuple)) or \
                not all(type(d) is str for d in descriptors):
            raise CorruptDataError(f"{where}: the item {getattr(idx, 'fqn', idx)!r} does not "
                                   f"lie inside {name} ({off}, {n}); the checkpoint is "
                                   "damaged, truncated or forged")


def reader_for(directory, *, storage_options=None, process_group=None,
               cooperative: bool = True):
    """The reader of ``directory``, its metadata read: lcckpt's, or a local checkpoint's
    that plain DCP wrote."""
    reader = CompressedReader(directory, storage_options=storage_options,
                              process_group=process_group, cooperative=cooperative)
    try:
        reader.read_metadata()     # its errors unwrapped by DCP's; DCP reuses the parsed copy
    except PlainCheckpoint:
        if files_for(directory, storage_options).remote:
            raise
        reader = PlainReader(directory)
        reader.read_metadata()
    return reader
