"""Lazy, partial reads of a saved file or of one step of a chain, like ``safe_open``
(a torch.save or safetensors file, or a shard index: foreign.py, the same methods).

``with lcckpt.open(path) as f:`` reads and validates only the header; ``f.get_tensor(key)``
then reads and decodes the one section that tensor needs (for a chain step, that key's
sections along its chain), and ``f.get_slice(key)[rows]`` reads only the bytes of those
rows when the section is stored raw. Loading one tensor costs time proportional to that
tensor, not to the file.

Keys are the flat names of the tensor and array leaves: the dict keys and list/tuple
indices on the way, joined by ``"."`` (``obj["model"]["fc.weight"]`` is
``"model.fc.weight"``, ``obj["optim"]["state"][0]["exp_avg"]`` is
``"optim.state.0.exp_avg"``; a non-str dict key is written as ``str(key)``). Where two
leaves would get the same flat name (``{"a.b": x}`` next to ``{"a": {"b": y}}``, or keys
``0`` and ``"0"``), neither gets it: both are listed under their exact key path, the
``obj[...]`` form that names sections. ``get_tensor`` takes either form.

A slice of a ``"lossless"`` section reads the blob's header and the bytes of the chunks
holding the rows, and decodes those chunks only. A chain's ``"delta"`` section, the first
time a slice reads it, replays only the chunks holding the rows from the keyframe and
every delta after it (chainrows.py); a later slice of it rebuilds it whole, then slices
(the reader keeps the newest rebuilt tensor, so a loop of row reads rebuilds it once).
A slice read checks the windows of the section that hold its bytes
(lcckpt/format/windows.py; unchecked only in a large section of a file written before
them); ``get_tensor`` checks the whole section. Deliberately not done here: building
whole objects (``lcckpt.load``).
"""

from __future__ import annotations

import math
import os
import sys
from contextlib import ExitStack

import numpy as np
import torch

from ..codec import blob as _blob
from ..codec import dtypes
from .. import limits
from ..util.paths import is_stream, local
from ..format import sections as _sections
from ..format import tree as _tree
from ..chain import restore as _restore
from ..chain.directory import ChainDirectory, delta_step
from ..codec.streamed import read_header
from ..codec.tensor import chunk_spans, decode_exact_chunks
from ..format.container import Container, read_container
from ..codec.delta import Reconstruction
from .chainrows import chain_span
from .foreign import ForeignReader, ShardedReader
from .naming import Keyed, Sliced, apply_index, basic_index, flat_names, position
from ..errors import (
    CorruptDataError, InvalidArgumentError, UnsupportedVersionError,
)
from ..format.serialization import metadata_of, tree_of

__all__ = ["Reader", "Slice", "open"]


def open(path: str | os.PathLike, framework: str = "pt", device=None, *,
         step: int | None = None, map_location=None, max_bytes=limits.DEFAULT
         ) -> Reader | ForeignReader | ShardedReader:
    """A lazy reader of the file at ``path`` (a chain's delta file: its step, read with
    the chain directory around it; a torch.save or safetensors file: the same methods
    over its tensors mapped into memory; a shard index: each tensor from its shard;
    foreign.py), or of ``step`` (default: the newest) of the chain directory ``path``. ``map_location`` and ``max_bytes`` as in ``lcckpt.load``
    (each read checks what it decodes: a tensor of a file, or a chain step's files as
    ``DeltaCheckpointer.load`` checks them). Use as a context manager (or call
    ``close``). ``framework`` and ``device`` are ``safe_open``'s, so that code written
    for it runs: torch tensors only, and ``device`` is a ``map_location``."""
    if not isinstance(path, (str, os.PathLike)):
        raise InvalidArgumentError(f"lcckpt.open needs a path, got {type(path).__name__}")
    map_location = _device(framework, device, map_location)
    path = local(path, "lcckpt.open")
    if is_stream(path):
        raise InvalidArgumentError(f"{path} is a pipe or a device: lazy reads need a file "
                                   "they can read at any offset; lcckpt.load reads it whole")
    if os.path.isdir(path):
        ck = ChainDirectory(path)
        steps = ck.steps()
        if step is None:
            if not steps:
                raise ck.no_checkpoints()
            step = steps[-1]
        if type(step) is bool or not isinstance(step, int) or step < 0:
            raise InvalidArgumentError(f"step must be a non-negative int, got {step!r}")
        if step not in steps:
            raise ck.missing_step(step)
        return Reader(ck.path(step), map_location, chain=(ck, step), max_bytes=max_bytes)
    if step is not None:
        raise InvalidArgumentError(f"step={step!r} is only for a chain directory; {path!r} is a file")
    try:
        return Reader(path, map_location, max_bytes=max_bytes)
    except CorruptDataError:
        fmt = _foreign(path)
        if fmt is None:
            raise
    if fmt == "sharded":
        return ShardedReader(path, lambda shard: open(shard, map_location=map_location,
                                                      max_bytes=max_bytes))
    return ForeignReader(path, fmt, map_location, max_bytes)


def _device(framework, device, map_location):
    """``map_location`` from ``safe_open``'s arguments, which name the same thing."""
    if framework not in ("pt", "torch", "pytorch"):
        raise InvalidArgumentError(
            f"framework={framework!r}: lcckpt.open gives torch tensors ('pt'); call .numpy() "
            "on what it returns for numpy arrays")
    if device is None:
        return map_location
    if map_location is not None:
        raise InvalidArgumentError("give device= or map_location=, not both: they name the "
                                   "same thing")
    if type(device) is int:                  # safe_open's device=0 is the first GPU
        device = f"cuda:{device}"
    try:
        return torch.device(device)
    except (RuntimeError, TypeError) as e:
        raise InvalidArgumentError(f"device={device!r} is not a device: {e}") from None


def _foreign(path: str) -> str | None:
    """"torch", "safetensors" or "sharded" (a shard index) for a file of those that the
    container reader refused; None where its error stands."""
    from .convert import detect_format
    try:
        fmt = detect_format(path)
    except (CorruptDataError, OSError):
        return None
    return fmt if fmt in ("torch", "safetensors", "sharded") else None


class Reader(Keyed):
    """An open file: :meth:`keys`, :meth:`metadata`, :meth:`get_tensor`, :meth:`get_slice`."""

    def __init__(self, path: str, map_location=None, chain=None, max_bytes=limits.DEFAULT):
        self.path = path
        self.map_location = map_location
        self.max_bytes = max_bytes
        self._chain = chain
        self._links: list | None = None            # older chain files, keyframe first
        self._stack: ExitStack | None = None       # ... held open by it
        self._last: tuple | None = None            # (key path, tensor) of the newest _whole
        self._spanned: set = set()                 # chain tensors a slice read in part
        self._c = read_container(path)
        try:
            step = None if chain is not None else delta_step(self._c.meta, path)
            if step is not None:            # a chain's delta file: its step, by its directory
                self._chain = (ChainDirectory(os.path.dirname(os.path.abspath(path))), step)
            try:
                tree = tree_of(self._c.meta)
            except (CorruptDataError, UnsupportedVersionError) as e:
                raise type(e)(f"{path}: {e}") from None
            self._index = flat_names(_tree.leaves(tree))
        except BaseException:
            self._c.close()
            raise

    # -- listing

    def metadata(self) -> dict[str, str]:
        """The ``metadata`` given to ``lcckpt.save`` ({} if none), as ``safe_open`` gives a
        safetensors file's: the same call reads either."""
        return dict(metadata_of(self._c.meta) or {})

    def header(self) -> dict:
        """The file's header entries other than the object tree (its tree version; a chain
        step's ``lcckpt_chain`` entry with its kind, base and per-tensor stats)."""
        return {k: v for k, v in self._c.meta.items() if k != "tree"}

    # -- reading

    def get_tensor(self, key: str):
        """The tensor (or numpy array) ``key`` as ``lcckpt.load`` would give it: a Parameter
        stays one, a view keeps its strides (over the stored span of its storage)."""
        path, node = self._find(key)
        s, meta = self._section(node, path)
        if self._chain is not None and meta.get("codec") == _sections.DELTA:
            self._chain_links()            # its chain's files, checked as a load checks them
        else:
            limits.check(limits.declared_bytes([self._c.sections[s]]), self._c.size,
                         self.max_bytes, f"{self.path}: {path}")
        return _tree.load_leaf(node, path, self._c, self._decode_leaf, self.map_location)

    def _whole(self, path: str):
        """The tensor at key path ``path``, decoded once: slice reads of a section that
        must be decoded whole (a chain's delta) keep the newest such tensor."""
        if self._last is None or self._last[0] != path:
            self._last = None                  # the previous one goes before the next decode
            self._last = (path, self.get_tensor(path))
        return self._last[1]

    def get_slice(self, key: str) -> Slice:
        """A handle whose ``[rows]`` reads only what those rows need, checked
        (see :class:`Slice`)."""
        path, node = self._find(key)
        if node.get("$") != "tensor":
            raise InvalidArgumentError(f"{key!r} is a numpy array; read it with get_tensor")
        return Slice(self, path, node)

    def close(self) -> None:
        self._last, self._closed = None, True
        self._c.close()
        if self._stack is not None:
            self._stack.close()
        self._stack = self._links = None

    # -- internals

    def _missing_hint(self) -> str:
        """Where the tensors of a file that holds a chain step's place are read from."""
        from ..chain.pointer import chain_of, in_header
        try:
            ref = in_header(self._c.meta, self.path)
        except CorruptDataError:
            return ""
        return "" if ref is None else (
            f"; the file stands for step {ref['step']} of a chain, whose tensors read with "
            f"lcckpt.open({chain_of(self.path, ref)!r}, step={ref['step']})")

    def _section(self, node: dict, path: str) -> tuple[int, dict]:
        s = node.get("s")
        if type(s) is not int or not 0 <= s < len(self._c.sections):
            raise CorruptDataError(f"invalid object tree at {path}: section index {s!r} out of range")
        return s, self._c.sections[s]["meta"]

    def _decode_leaf(self, path: str, c: Container, i: int, meta: dict):
        if meta.get("codec") != _sections.DELTA or self._chain is None:
            return _sections.decode_leaf(path, c, i, meta)
        return self._delta(c, i, meta).value(copy=False)

    def _span(self, path: str, c: Container, i: int, meta: dict, first: int, last: int):
        """Elements ``first..last`` of section ``i``'s tensor along its chain, only the
        chunks that hold them read and replayed (:func:`.chainrows.chain_span`), the
        first time a slice reads that tensor; None after (a loop of row reads decodes it
        whole once, :meth:`_whole`) and where only a whole replay gives them."""
        if path in self._spanned or (self._last is not None and self._last[0] == path):
            return None
        self._spanned.add(path)
        key = _sections.section_key(meta)
        chain = []                      # the tensor's sections along the chain, oldest first
        for older, by_key in self._chain_links():
            j = by_key.get(key)
            chain = [] if j is None else chain + [(older, j)]
        return chain_span(chain + [(c, i)], meta, first, last, self.max_bytes,
                          f"{self.path}: {path}")

    def _delta(self, c: Container, i: int, meta: dict) -> Reconstruction:
        """Section ``i``'s tensor along its chain, its blobs applied (replayed when asked)."""
        key = _sections.section_key(meta)
        rec = Reconstruction()
        for older, by_key in self._chain_links():
            j = by_key.get(key)
            if j is None:                     # not tracked in that file: no reference
                rec = Reconstruction()
                continue
            m = older.sections[j]["meta"]
            rec.apply(older.data(j), dtype=m.get("dtype"), shape=tuple(m.get("shape", ())),
                      check_payload=False, what=key, zero_base=_sections.section_zero_base(m))
        rec.apply(c.data(i), dtype=meta.get("dtype"), shape=tuple(meta.get("shape", ())),
                  check_payload=False, what=key, zero_base=_sections.section_zero_base(meta))
        return rec

    def _chain_links(self) -> list:
        """The chain's files before this step, keyframe first, as ``(container, {tracking
        key: section})``: the chain's own walk (every link validated, every file checked
        against ``max_bytes``), opened once."""
        if self._links is not None:
            return self._links
        ck, step = self._chain
        stack = ExitStack()
        try:
            links, _ = _restore.walk(ck, step, stack, max_bytes=self.max_bytes)
        except BaseException:
            stack.close()
            raise
        self._stack = stack
        self._links = [(c, _delta_sections(c)) for c, _, _ in links[:-1]]
        return self._links


class Slice(Sliced):
    """``reader.get_slice(key)``: ``shape``, ``dtype``, and ``[index]`` reading only what
    the first dimension's rows need. The index is numpy's basic indexing: ints, slices of
    any step (a negative one gives a copy, as torch has no negative strides), ``None`` and
    ``...``."""

    def __init__(self, reader: Reader, path: str, node: dict):
        self._r, self._path, self._node = reader, path, node
        self._s, self._meta = reader._section(node, path)
        meta = self._meta
        dtype = dtypes.NAME_TORCH.get(meta.get("dtype")) if type(meta.get("dtype")) is str else None
        shape = meta.get("shape")
        if meta.get("kind") != "tensor" or dtype is None or type(shape) is not list \
                or len(shape) > 64 or not all(type(n) is int and n >= 0 for n in shape):
            raise CorruptDataError(f"invalid object tree at {path}: section {self._s} is not a "
                                   "tensor with a known dtype and a valid shape")
        try:
            self._view = _tree.view_of(node, self._meta)
        except (TypeError, ValueError, RuntimeError) as e:
            raise CorruptDataError(f"invalid object tree at {path}: {e}") from None
        self.dtype = dtype
        self.shape = torch.Size(self._view[1])

    def __getitem__(self, index):
        self._r._check_open()
        items = basic_index(index, len(self.shape), self._path)
        if not self.shape:                      # one element: nothing to save by slicing
            return apply_index(self._r._whole(self._path).detach().clone(), items)
        at = next(k for k, x in enumerate(items) if x is not None)     # the first dimension's
        first = items[at]
        rows = range(*first.indices(self.shape[0])) if isinstance(first, slice) else \
            position(first, self.shape[0], self._path)
        if isinstance(rows, int):
            lo, hi, items[at] = rows, rows + 1, 0
        elif not rows:
            lo = hi = 0
        else:
            lo, hi = min(rows[0], rows[-1]), max(rows[0], rows[-1]) + 1
            items[at] = range(rows.start - lo, rows.stop - lo, rows.step)
        return apply_index(self._rows(lo, hi), items)

    def _rows(self, lo: int, hi: int) -> torch.Tensor:
        """Rows ``[lo, hi)`` of the tensor, reading only their bytes (their chunks'),
        checked by ``Container.read_part``."""
        offset, shape, stride = self._view
        sub_shape = [hi - lo] + list(shape[1:])
        codec = self._meta.get("codec")
        partial = (_sections.RAW, _sections.LOSSLESS) + \
            ((_sections.DELTA,) if self._r._chain is not None else ())
        if codec not in partial or self._node.get("param") or self._node.get("grad") or \
                self._r.map_location is not None or sys.byteorder != "little":
            return self._whole_rows(lo, hi)
        c, s, meta = self._r._c, self._s, self._meta
        item = self.dtype.itemsize
        size = math.prod(meta.get("shape", ())) if type(meta.get("shape")) is list else -1
        if meta.get("nbytes") != size * item or \
                (codec == _sections.RAW and c.sections[s]["length"] != size * item):
            raise CorruptDataError(f"invalid object tree at {self._path}: {codec} section size "
                                   "does not match its dtype and shape")
        if hi <= lo or 0 in sub_shape:
            return torch.empty(sub_shape, dtype=self.dtype)
        first = offset + lo * stride[0]
        last = first + sum((k - 1) * st for k, st in zip(sub_shape, stride))
        if first < 0 or last >= size:
            raise CorruptDataError(f"invalid object tree at {self._path}: view reaches past "
                                   f"the {size} stored elements")
        if codec == _sections.LOSSLESS:
            return self._coded_rows(first, last, meta).as_strided(sub_shape, stride, 0)
        if codec == _sections.DELTA:
            part = self._r._span(self._path, c, s, meta, first, last)
            if part is None:
                return self._whole_rows(lo, hi)
            return torch.from_numpy(part).as_strided(sub_shape, stride, 0)
        buf = torch.empty(last - first + 1, dtype=self.dtype)
        c.read_part(s, first * item, buf.view(torch.uint8).numpy())
        return buf.as_strided(sub_shape, stride, 0)

    def _whole_rows(self, lo: int, hi: int) -> torch.Tensor:
        t = self._r._whole(self._path)          # decoded once per reader, then sliced
        return t.detach()[lo:hi].clone()

    def _coded_rows(self, first: int, last: int, meta: dict) -> torch.Tensor:
        """Elements ``[first, last]`` of a lossless section: reads the blob's header and
        the bytes of the chunks that hold them, checked like a raw slice's (and the
        header by its own checksum), and decodes those chunks only."""
        c, s = self._r._c, self._s
        p = self._blob_header(c, s)
        if p.kind != _blob.LOSSLESS or p.dt.name != meta.get("dtype") or \
                list(p.shape) != meta.get("shape"):
            raise CorruptDataError(f"{self._path}: the lossless blob does not hold the "
                                   f"{meta.get('dtype')} {meta.get('shape')} tensor its section says")
        per = 2 if p.dt.kind == "complex" else 1        # words per element
        cs = 1 << p.log2
        k0, k1 = first * per // cs, (last * per + per - 1) // cs + 1
        spans = chunk_spans(p, k0, k1)
        stored = sum(n for _, n in spans)
        decoded = (k1 - k0) * cs * (p.dt.itemsize // per)      # bytes of those chunks
        limits.check(decoded + stored, c.size, self._r.max_bytes, f"{self._r.path}: {self._path}")
        data, pos = np.empty(stored, np.uint8), 0
        for off, n in spans:
            c.read_part(s, off, data[pos:pos + n])
            pos += n
        a = decode_exact_chunks(p, k0, k1, data)
        lo = k0 * cs // per
        part = dtypes.from_carrier(a[first - lo:last + 1 - lo].copy(), p.dt)
        return part if isinstance(part, torch.Tensor) else torch.from_numpy(part)

    @staticmethod
    def _blob_header(c: Container, s: int):
        """The parsed header of section ``s``'s blob."""
        return read_header(lambda off, out: c.read_part(s, off, out), c.sections[s]["length"])


def _delta_sections(c: Container) -> dict:
    out = {}
    for i, s in enumerate(c.sections):
        m = s["meta"]
        if m.get("kind") == "tensor" and m.get("codec") == _sections.DELTA:
            out[_sections.section_key(m)] = i
    return out
