"""A distributed checkpoint's ``.metadata``, read safely.

- :class:`MetadataUnpickler` is an allow-list: DCP's metadata dataclasses, torch sizes,
  dtypes and layouts, and lcckpt's per-item record; anything else is refused with
  :class:`~lcckpt.errors.UnsafeObjectError`, so reading a checkpoint never runs code
  from it. Its opcodes are scanned first: the C unpickler grows its memo to twice a
  stored memo index, so one flipped byte of a ``LONG_BINPUT`` would fill gigabytes.
- :func:`check_items` ties each stored tensor item's shape to DCP's chunk of it, which
  lies inside the tensor DCP's planner matches against the caller's own (a load refuses
  another size). A reader allocates an item by its shape, and a delta's blobs must have
  it, so a forged record cannot make a load allocate more than the caller's tensors.
"""

from __future__ import annotations

import io
import pickle
import pickletools

import torch

from torch.distributed.checkpoint.metadata import (BytesStorageMetadata, Metadata,
                                                   TensorStorageMetadata)

from ..errors import CorruptDataError, InvalidArgumentError, LcckptError, UnsafeObjectError
from .exchange import VALUES


class PlainCheckpoint(InvalidArgumentError):
    """A checkpoint whose items plain DCP wrote (``plain.py`` reads it)."""


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
        self.file, self.info_class = file, info_class

    def load(self):
        """Unpickle after :func:`check_opcodes` passes on the whole stream."""
        start = self.file.tell()
        check_opcodes(self.file)
        self.file.seek(start)
        return super().load()

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


def unpickle(raw: bytes, path, info_class: type):
    """``raw``, the ``.metadata`` at ``path``, through :class:`MetadataUnpickler`; a damaged
    pickle is a :class:`CorruptDataError` naming ``path``."""
    try:
        return MetadataUnpickler(io.BytesIO(raw), info_class).load()
    except LcckptError:
        raise
    except Exception as e:     # damaged pickles fail in many ways, none of them ours
        raise CorruptDataError(f"{path}: unreadable checkpoint metadata "
                               f"({type(e).__name__}: {e})") from None


_MEMO_PUTS = frozenset({"PUT", "BINPUT", "LONG_BINPUT"})


def check_opcodes(file) -> None:
    """Raise :class:`CorruptDataError` unless the pickle on ``file`` (seekable) is a
    well-formed opcode stream whose memo indexes are below its opcode count (the pickler
    numbers them in order) and whose frames fit in it. Pure Python, one pass: it reads
    each argument through ``file``, so a forged length is met by the end of the data."""
    start = file.tell()
    size = file.seek(0, io.SEEK_END) - start
    file.seek(start)
    try:
        for n, (op, arg, _) in enumerate(pickletools.genops(file)):
            if op.name in _MEMO_PUTS and not 0 <= int(arg) <= n or \
                    op.name == "FRAME" and arg > size:
                raise CorruptDataError(f"checkpoint metadata: opcode {op.name} {arg} at "
                                       f"{n} is out of range; the pickle is damaged")
    except (ValueError, EOFError, OverflowError) as e:   # genops' words for bad data
        raise CorruptDataError(f"checkpoint metadata is not a whole pickle ({e})") from None


TENSORS = ("exact", "delta")      # the codecs of tensor items (exchange.VALUES: values)


def _dims(x) -> tuple | None:
    """``x`` as a tuple of non-negative ints, or None where it is not one."""
    if not isinstance(x, (tuple, list, torch.Size)) or \
            not all(type(d) is int and d >= 0 for d in x):
        return None
    return tuple(x)


def _dtype_name(name: str) -> bool:
    """Whether ``name`` is a torch dtype's (``"torch.float32"``)."""
    return name.startswith("torch.") and isinstance(getattr(torch, name[6:], None),
                                                      torch.dtype)


def _blob(x) -> bool:
    """Whether ``x`` is a blob's place: (path, offset, length)."""
    return isinstance(x, (tuple, list)) and len(x) == 3 and type(x[0]) is str and \
        _dims(x[1:]) is not None


def _well_typed(info) -> bool:
    """Whether a record's fields have the types the writer gives them (a damaged pickle can
    rebuild the dataclass with any values, or without some fields)."""
    try:
        return _blob((info.relative_path, info.offset, info.length)) and \
            type(info.codec) is str and type(info.dtype) is str and type(info.rank) is int \
            and type(info.raw_nbytes) is int and type(info.zero_base) is bool and \
            type(info.alias) is bool and (info.piece is None or isinstance(info.piece, tuple)) \
            and isinstance(info.chain, (tuple, list)) and all(map(_blob, info.chain))
    except AttributeError:
        return False


def chunks_of(md, where: str) -> dict:
    """``(fqn, offsets) -> sizes`` of every stored chunk, each checked to lie inside its
    tensor."""
    if not isinstance(getattr(md, "state_dict_metadata", None), dict):
        raise CorruptDataError(f"{where}: checkpoint metadata without its tensors' layout")
    chunks = {}
    for fqn, smd in md.state_dict_metadata.items():
        if isinstance(smd, BytesStorageMetadata):
            continue
        size = _dims(getattr(smd, "size", None))
        cs = getattr(smd, "chunks", None)
        if not isinstance(smd, TensorStorageMetadata) or size is None or \
                not isinstance(cs, list):
            raise CorruptDataError(f"{where}: {fqn}: malformed tensor metadata")
        for c in cs:
            off, n = _dims(getattr(c, "offsets", None)), _dims(getattr(c, "sizes", None))
            if off is None or n is None or not len(off) == len(n) == len(size) or \
                    any(o + k > s for o, k, s in zip(off, n, size)):
                raise CorruptDataError(f"{where}: {fqn}: a stored chunk does not fit the "
                                       f"tensor's {list(size)}")
            chunks[(fqn, off)] = n
    return chunks


def check_items(md, where: str, info_class: type) -> None:
    """Raise :class:`CorruptDataError` unless ``md`` is DCP metadata whose every stored
    item agrees with it: a tensor item's shape is that of DCP's chunk at its offset,
    inside the tensor's size; a value item is a value there; another name of a tied
    tensor (``alias``) names a blob that an item stores. O(items + chunks).
    :class:`InvalidArgumentError` where the items are not ``info_class`` (plain DCP's)."""
    items = getattr(md, "storage_data", None)
    if not isinstance(md, Metadata) or not isinstance(items, dict):
        raise CorruptDataError(f"{where}: not DCP checkpoint metadata")
    if not all(isinstance(i, info_class) for i in items.values()):
        raise PlainCheckpoint(f"{where} was written by plain DCP, not lcckpt's "
                              "CompressedWriter: lcckpt.distributed.load reads it (safely), "
                              "and `lcckpt convert` writes it as one file")
    chunks = chunks_of(md, where)
    for idx, info in items.items():
        fqn = getattr(idx, "fqn", None)
        if type(fqn) is not str or not _well_typed(info):
            raise CorruptDataError(f"{where}: a malformed record of a stored item ({fqn!r})")
        smd = md.state_dict_metadata.get(fqn)
        if info.codec in VALUES and isinstance(smd, BytesStorageMetadata):
            continue
        shape = _dims(info.shape)
        if info.codec not in TENSORS or shape is None or not _dtype_name(info.dtype) or \
                info.codec == "exact" and (info.chain or info.zero_base) or \
                chunks.get((fqn, _dims(getattr(idx, "offset", None)))) != shape:
            raise CorruptDataError(
                f"{where}: the stored item {fqn} ({info.codec!r}, shape {info.shape}) "
                "matches no chunk of DCP's metadata; the checkpoint is damaged or forged")
    stored = {(i.relative_path, i.offset) for i in items.values() if not i.alias}
    if any(i.alias and (i.relative_path, i.offset) not in stored for i in items.values()):
        raise CorruptDataError(f"{where}: a tied tensor's record names a blob no item stores")
