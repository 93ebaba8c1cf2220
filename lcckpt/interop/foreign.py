"""``lcckpt.open`` of a torch.save or safetensors file: the reader's methods over the
file's tensors mapped into memory, so that a key or a slice reads only its own pages; and
of a shard index (Hugging Face's ``model.safetensors.index.json``): each tensor from its
shard, opened when first asked for.

A safetensors file is mapped whole (copy-on-write) once its header is validated
(``format/safetensors_io.py``: every tensor inside the data buffer, no gaps, no overlaps);
each tensor is a view at its offset. A torch.save zip goes through ``lcckpt.load(path,
mmap=True)``: the zip checked first, then torch's weights-only unpickler, whose tensors
are views of the mapped file. A legacy (non-zip) torch.save file cannot be mapped and is
loaded whole. Sparse and quantized tensors are not listed (``lcckpt.load`` reads
them). What a read returns is a copy, the caller's to keep and change; neither
format has checksums to check on the way (``lcckpt verify`` checks a torch.save zip's
CRC-32s).
"""

from __future__ import annotations

import os

import torch

from ..errors import CorruptDataError, LcckptError, NotFoundError
from ..format import safetensors_io as _st
from ..format.sharded import read_index
from ..format.container import at_path
from ..format.census import keyed_children
from ..format.flatten import MAX_DEPTH
from ..format.serialization import load
from ..format.torchzip import is_zip
from .naming import Keyed, Sliced, apply_index, basic_index, flat_names

__all__ = ["ForeignReader", "ShardedReader"]


class ForeignReader(Keyed):
    """:class:`~lcckpt.interop.reader.Reader`'s methods for a torch.save or safetensors
    file (``fmt``: "torch" or "safetensors")."""

    def __init__(self, path: str, fmt: str, map_location=None, max_bytes=None):
        self.path, self.format = path, fmt
        self.map_location, self.max_bytes = map_location, max_bytes
        if fmt == "safetensors":
            try:
                tensors, self._meta = _st.map_safetensors(path)
            except LcckptError as e:
                raise at_path(e, path) from None
            found = [((name,), name, t) for name, t in tensors.items()]
        else:
            obj = load(path, mmap=is_zip(path), max_bytes=max_bytes)   # legacy: read whole
            self._meta = {}
            found = list(_leaves(obj))
        self._index = flat_names(found)

    def keys(self) -> list[str]:
        """The names in the order they were saved; a safetensors file's sorted, as
        safe_open's ``keys()`` lists them (``offset_keys()``: the file's order)."""
        names = list(self._index)
        return sorted(names) if self.format == "safetensors" else names

    def metadata(self) -> dict:
        """A safetensors file's ``__metadata__`` ({} for a torch.save file)."""
        return dict(self._meta or {})

    def get_tensor(self, key: str) -> torch.Tensor:
        """A copy of the tensor ``key``, at ``map_location`` where one was given."""
        return self._place(self._find(key)[1])

    def get_slice(self, key: str) -> MappedSlice:
        path, t = self._find(key)
        return MappedSlice(self, path, t)

    def close(self) -> None:
        self._closed, self._index = True, {}   # the mapped file goes with its last view

    def _place(self, t: torch.Tensor) -> torch.Tensor:
        out = t.detach().clone(memory_format=torch.contiguous_format)
        if isinstance(t, torch.nn.Parameter):
            out = torch.nn.Parameter(out, requires_grad=t.requires_grad)
        return _st.place(out, self.map_location)   # the file's tensors are on the host


class ShardedReader(Keyed):
    """The reader's methods over a shard index: its ``weight_map``'s tensors, in its order,
    each read from its shard's own reader (``open_shard(path)``), opened on first use."""

    def __init__(self, path: str, open_shard):
        self.path = path
        self._index = {name: (name, shard) for name, shard in read_index(path)}
        self._base = os.path.dirname(os.path.abspath(path))
        self._open_shard = open_shard
        self._shards: dict = {}

    def metadata(self) -> dict:
        """Which shard holds each tensor (the index's ``weight_map``)."""
        return {"weight_map": {name: shard for name, (_, shard) in self._index.items()}}

    def get_tensor(self, key: str) -> torch.Tensor:
        name, reader = self._locate(key)
        return reader.get_tensor(name)

    def get_slice(self, key: str):
        name, reader = self._locate(key)
        return reader.get_slice(name)

    def close(self) -> None:
        shards, self._shards, self._closed = self._shards, {}, True
        for reader in shards.values():
            reader.close()

    def _locate(self, key: str) -> tuple:
        name, shard = self._find(key)
        reader = self._shards.get(shard)
        if reader is None:
            where = os.path.join(self._base, shard)
            if not os.path.isfile(where):
                raise NotFoundError(2, f"a shard the index {self.path} names is missing", where)
            reader = self._shards[shard] = self._open_shard(where)
        if name not in reader:
            raise CorruptDataError(f"shard {reader.path} has no tensor {name!r}, which the "
                                   f"index {self.path} puts there")
        return name, reader


class MappedSlice(Sliced):
    """``get_slice(key)`` of a mapped tensor: ``shape``, ``dtype``, ``get_shape()``,
    ``get_dtype()`` and ``[index]`` (numpy's basic indexing), which copies only what the
    index selects, and so reads only its pages."""

    def __init__(self, reader: ForeignReader, path: str, t: torch.Tensor):
        self._r, self._path, self._t = reader, path, t
        self.dtype, self.shape = t.dtype, t.shape

    def __getitem__(self, index) -> torch.Tensor:
        part = apply_index(self._t.detach(), basic_index(index, len(self.shape), self._path))
        return self._r._place(part)


def _leaves(obj, parts: tuple = (), path: str = "obj", depth: int = 0):
    """``(keys on the way, key path, tensor)`` for each dense tensor in ``obj``'s
    containers, named as a load names its sections (sparse and quantized tensors, which
    have no rows to slice, are left to ``lcckpt.load``)."""
    if isinstance(obj, torch.Tensor):
        if obj.layout == torch.strided and not obj.is_quantized:
            yield parts, path, obj
        return
    for k, at, x in (keyed_children(obj, path) or ()) if depth < MAX_DEPTH else ():
        yield from _leaves(x, parts + (k,), at, depth + 1)
