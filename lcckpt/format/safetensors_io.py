"""Read and write .safetensors files without the safetensors package.

The format (one page, https://github.com/huggingface/safetensors): an 8-byte little-endian
header length N, N bytes of UTF-8 JSON ``{name: {"dtype", "shape", "data_offsets"},
"__metadata__": {str: str}}``, then the tensor bytes, little-endian and row-major.
``data_offsets`` are ``[begin, end)`` relative to the start of the byte buffer.

Reading validates the whole header before a byte of data is touched: a bounded header
size, JSON without duplicate keys, known dtypes, non-negative integer shapes, every
tensor's size equal to dtype x shape, and offsets that tile the buffer exactly (start at
0, no gap, no overlap, end at the end of the file) - the rules the reference
implementation enforces. Writing follows the reference implementation's layout (tensors
ordered by dtype then name, header padded with spaces to 8 bytes), so files written here
match those written by ``safetensors.torch.save_file`` byte for byte.

Deliberately not done here: nested objects, non-tensor values, shared storage (each
tensor is written on its own, so tied weights are stored twice), lazy/mmap reading.
"""

from __future__ import annotations

import io
import json
import math
import os
import struct
import sys
from typing import Any, BinaryIO, Mapping

import torch

from .. import limits
from ..codec import dtypes
from ..errors import CorruptDataError, InvalidArgumentError, TruncatedError, UnsupportedDtypeError
from ..util.durable import atomic_write
from ..util.paths import local

__all__ = [
    "MAX_HEADER_SIZE",
    "is_safetensors",
    "load_safetensors",
    "map_safetensors",
    "place",
    "read_header",
    "read_safetensors",
    "save_safetensors",
    "verify_safetensors",
]

MAX_HEADER_SIZE = 100_000_000          # the reference implementation's bound
METADATA_KEY = "__metadata__"

# The reference implementation's dtype order (its Dtype enum); files sort tensors by it,
# largest first. Only names this torch build has are usable.
_ORDER = ["BOOL", "U8", "I8", "F8_E5M2", "F8_E4M3", "F8_E8M0", "I16", "U16", "F16", "BF16",
          "I32", "U32", "F32", "C64", "F64", "I64", "U64"]
_RANK = {name: i for i, name in enumerate(_ORDER)}
TORCH_DTYPE = {name: dtypes.NAME_TORCH[name] for name in _ORDER if name in dtypes.NAME_TORCH}
DTYPE_NAME = {t: name for name, t in TORCH_DTYPE.items()}


def is_safetensors(head: bytes) -> bool:
    """Whether a file starting with ``head`` (at least its first 9 bytes) looks like
    safetensors: a plausible header length followed by a JSON object's ``{``."""
    if len(head) < 9:
        return False
    n = struct.unpack("<Q", head[:8])[0]
    return 2 <= n <= MAX_HEADER_SIZE and head[8:9] == b"{"


# --------------------------------------------------------------------------- reading


def _no_duplicates(pairs):
    d = {}
    for k, v in pairs:
        if k in d:
            raise CorruptDataError(f"safetensors header names {k!r} twice")
        d[k] = v
    return d


MAX_DIMS = 64
MAX_DIM = 1 << 48


def _is_uint(v) -> bool:
    return type(v) is int and v >= 0


def _parse_header(raw: bytes, buffer_len: int
                  ) -> tuple[list[tuple[str, str, list, int, int]], dict | None]:
    """Validated ``([(name, dtype, shape, begin, end)] in header order, metadata or None)``."""
    try:
        header = json.loads(raw.decode("utf-8"), object_pairs_hook=_no_duplicates)
    except (UnicodeDecodeError, ValueError, RecursionError) as e:
        if isinstance(e, CorruptDataError):
            raise
        raise CorruptDataError(f"safetensors header is not valid UTF-8 JSON: {e}") from None
    if not isinstance(header, dict):
        raise CorruptDataError("safetensors header must be a JSON object")
    meta = header.pop(METADATA_KEY, None)
    if meta is not None and not (isinstance(meta, dict)
                                 and all(isinstance(v, str) for v in meta.values())):
        raise CorruptDataError(f"safetensors {METADATA_KEY} must map strings to strings")
    entries = []
    for name, info in header.items():
        where = f"safetensors tensor {name!r}"
        if not isinstance(info, dict) or set(info) != {"dtype", "shape", "data_offsets"}:
            raise CorruptDataError(f"{where}: needs exactly dtype, shape and data_offsets")
        dt, shape, offs = info["dtype"], info["shape"], info["data_offsets"]
        if not isinstance(dt, str):
            raise CorruptDataError(f"{where}: dtype must be a string, got {dt!r}")
        if dt not in TORCH_DTYPE:
            raise UnsupportedDtypeError(
                f"{where}: dtype {dt!r} is not supported; supported: {', '.join(TORCH_DTYPE)}")
        if not isinstance(shape, list) or not all(map(_is_uint, shape)):
            raise CorruptDataError(f"{where}: shape must be a list of non-negative ints, got {shape!r:.200}")
        if len(shape) > MAX_DIMS or any(d > MAX_DIM for d in shape):
            # checked before any size arithmetic: no real tensor comes near, and a
            # dimension past torch's int64 (or one hidden behind a zero) is a forgery
            raise CorruptDataError(f"{where}: implausible shape {shape!r:.200} (at most "
                                   f"{MAX_DIMS} dimensions of at most 2**48 each)")
        if (not isinstance(offs, list) or len(offs) != 2 or not all(map(_is_uint, offs))
                or offs[0] > offs[1]):
            raise CorruptDataError(f"{where}: data_offsets must be [begin, end] with "
                                   f"0 <= begin <= end, got {offs!r}")
        if offs[1] > buffer_len:
            raise TruncatedError(f"{where}: data ends at byte {offs[1]} of the data buffer, "
                                 f"but the file holds only {buffer_len} bytes of data")
        want = math.prod(shape) * TORCH_DTYPE[dt].itemsize
        if offs[1] - offs[0] != want:
            raise CorruptDataError(f"{where}: {offs[1] - offs[0]} bytes of data, but dtype "
                                   f"{dt} x shape {shape} needs {want}")
        entries.append((name, dt, shape, offs[0], offs[1]))
    end = 0
    for name, _, _, begin, stop in sorted(entries, key=lambda e: (e[3], e[4])):
        if begin != end:
            raise CorruptDataError(
                f"safetensors tensor {name!r} starts at byte {begin} of the data buffer, "
                f"expected {end}: offsets must tile the buffer without gaps or overlaps")
        end = stop
    if end != buffer_len:
        raise CorruptDataError(f"safetensors data buffer holds {buffer_len} bytes, but the "
                               f"tensors cover {end}: trailing or missing data")
    return entries, meta


def place(t: torch.Tensor, map_location) -> torch.Tensor:
    """``t`` where ``map_location`` (None, a device or ``{"cpu": device}``) puts it."""
    if map_location is None:
        return t
    if isinstance(map_location, dict):
        map_location = map_location.get("cpu", "cpu")
    if isinstance(map_location, (str, torch.device)):
        return t.to(map_location)
    raise InvalidArgumentError(
        "map_location for a safetensors file (or one lcckpt.open maps) must be None, a "
        "device or a dict "
        f"{{'cpu': device}}; got {type(map_location).__name__}")


def _open(f):
    """``(file, entries, metadata, data start)`` after validating the header of ``f``."""
    if not hasattr(f, "read"):
        raise InvalidArgumentError(f"need a path or a binary file object, got {type(f).__name__}")
    if sys.byteorder != "little":
        raise UnsupportedDtypeError("reading safetensors needs a little-endian host")
    if not f.seekable():
        f = io.BytesIO(limits.read_stream(f, limits.DEFAULT, "the safetensors file"))
    start = f.tell()
    f.seek(0, os.SEEK_END)
    size = f.tell() - start
    f.seek(start)
    head = f.read(8)
    if len(head) < 8:
        raise TruncatedError(f"not a safetensors file: {size} bytes, shorter than the 8-byte "
                             "header length")
    n = struct.unpack("<Q", head)[0]
    if n > MAX_HEADER_SIZE:
        raise CorruptDataError(f"safetensors header length {n} exceeds the limit of "
                               f"{MAX_HEADER_SIZE} bytes: not a safetensors file, or damaged")
    if 8 + n > size:
        raise TruncatedError(f"safetensors header of {n} bytes, but only {size - 8} bytes "
                             "follow the length: the file is truncated or not safetensors")
    entries, meta = _parse_header(f.read(n), size - 8 - n)
    return f, entries, meta, start + 8 + n


def read_header(f: str | os.PathLike | BinaryIO) -> tuple[list[dict], dict[str, str] | None]:
    """``([{name, dtype, shape, nbytes}], metadata)`` from a validated header, data unread
    (metadata None when the header has no ``__metadata__``)."""
    if isinstance(f, (str, os.PathLike)):
        with open(f, "rb") as fh:
            return read_header(fh)
    _, entries, meta, _ = _open(f)
    return [{"name": name, "dtype": dt, "shape": shape, "nbytes": end - begin}
            for name, dt, shape, begin, end in entries], meta


def verify_safetensors(path: str | os.PathLike) -> None:
    """Raise where the safetensors file ``path`` is damaged as far as can be seen without
    checksums (it has none): its header against the file's size, then every byte read,
    a piece at a time and kept nowhere (a disk error surfaces)."""
    read_header(path)
    with open(path, "rb") as f:
        while f.read(1 << 24):
            pass


def read_safetensors(f: str | os.PathLike | BinaryIO, map_location=None
                     ) -> tuple[dict[str, torch.Tensor], dict[str, str] | None]:
    """``(tensors, metadata)`` of a safetensors file (a path or a binary file object);
    metadata is None when the header has none (``{}`` when it has an empty one).

    Tensors come in header order, each in its own memory (no tensor shares storage with
    another). Raises :class:`CorruptDataError` (or :class:`TruncatedError`) naming the
    first problem found, before any data is read.
    """
    if isinstance(f, (str, os.PathLike)):
        with open(f, "rb") as fh:
            return read_safetensors(fh, map_location)
    f, entries, meta, base = _open(f)
    out = {}
    for name, dt, shape, begin, end in entries:
        out[name] = place(read_range(f, base + begin, TORCH_DTYPE[dt], shape, name), map_location)
    return out, meta


def read_range(f: BinaryIO, at: int, dtype: torch.dtype, shape: list, name: str) -> torch.Tensor:
    """The tensor ``name`` of ``dtype`` and ``shape`` whose bytes start at byte ``at``
    of the file ``f``, read into memory of its own."""
    t = torch.empty(shape, dtype=dtype)
    if t.numel():
        f.seek(at)
        buf = t.reshape(-1).view(torch.uint8).numpy()
        got = f.readinto(memoryview(buf))
        if got != buf.size:
            raise TruncatedError(f"safetensors tensor {name!r}: file ended after {got} of "
                                 f"{buf.size} bytes")
    return t


def map_safetensors(path: str) -> tuple[dict[str, torch.Tensor], dict | None]:
    """``(tensors, metadata)`` of the safetensors file ``path``, each tensor a view of the
    file mapped copy-on-write (``load(mmap=True)``, ``lcckpt.open``: pages are read when
    touched; one whose offset its dtype does not divide is read into memory)."""
    with open(path, "rb") as fh:
        fh, entries, meta, base = _open(fh)
        size = os.fstat(fh.fileno()).st_size
        storage = torch.UntypedStorage.from_file(path, shared=False, nbytes=size) if size else None
        out = {}
        for name, dt, shape, begin, end in entries:
            dtype = TORCH_DTYPE[dt]
            if end == begin or (base + begin) % dtype.itemsize:
                out[name] = read_range(fh, base + begin, dtype, shape, name)
                continue
            raw = torch.empty(0, dtype=torch.uint8).set_(storage, base + begin, (end - begin,), (1,))
            out[name] = raw.view(dtype).reshape(shape)
    return out, meta


def load_safetensors(path_or_file: str | os.PathLike | BinaryIO,
                     map_location=None) -> dict[str, torch.Tensor]:
    """The tensors of a safetensors file, as ``{name: tensor}`` (see :func:`read_safetensors`)."""
    return read_safetensors(path_or_file, map_location)[0]


# --------------------------------------------------------------------------- writing


def _check_tensors(tensors) -> dict[str, torch.Tensor]:
    if not isinstance(tensors, Mapping):
        raise InvalidArgumentError(
            f"safetensors stores a flat mapping of names to tensors, got {type(tensors).__name__}")
    for name, t in tensors.items():
        if not isinstance(name, str):
            raise InvalidArgumentError(f"safetensors tensor names must be strings, got {name!r}")
        if name == METADATA_KEY:
            raise InvalidArgumentError(f"{METADATA_KEY!r} is reserved by safetensors for metadata")
        if not isinstance(t, torch.Tensor):
            raise InvalidArgumentError(
                f"safetensors stores only tensors, but {name!r} is a {type(t).__name__}; "
                "save nested or non-tensor state with lcckpt.save instead")
        if t.dtype not in DTYPE_NAME:
            raise UnsupportedDtypeError(
                f"tensor {name!r} has dtype {t.dtype}, which safetensors cannot store")
        if t.is_sparse or t.layout != torch.strided:
            raise UnsupportedDtypeError(f"tensor {name!r} is not dense ({t.layout})")
    return dict(tensors)


def _serialize(tensors: Mapping[str, torch.Tensor], metadata: Mapping[str, str] | None):
    """``(header bytes, [(name, tensor)] in file order)``."""
    tensors = _check_tensors(tensors)
    if metadata is not None and (not isinstance(metadata, Mapping) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in metadata.items())):
        raise InvalidArgumentError("safetensors metadata must map strings to strings")
    order = sorted(tensors.items(), key=lambda kv: (-_RANK[DTYPE_NAME[kv[1].dtype]], kv[0]))
    header: dict[str, Any] = {}
    if metadata is not None:
        header[METADATA_KEY] = dict(sorted(metadata.items()))
    pos = 0
    for name, t in order:
        nbytes = t.numel() * t.element_size()
        header[name] = {"dtype": DTYPE_NAME[t.dtype], "shape": list(t.shape),
                        "data_offsets": [pos, pos + nbytes]}
        pos += nbytes
    raw = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode("utf-8")
    raw += b" " * (-len(raw) % 8)
    if len(raw) > MAX_HEADER_SIZE:
        raise InvalidArgumentError(f"safetensors header would be {len(raw)} bytes, over the "
                                   f"limit of {MAX_HEADER_SIZE}: too many tensors")
    return struct.pack("<Q", len(raw)) + raw, order


def _write(fh: BinaryIO, head: bytes, order) -> None:
    fh.write(head)
    for _, t in order:
        if t.numel():
            c = t.detach().to("cpu").contiguous()
            fh.write(memoryview(c.reshape(-1).view(torch.uint8).numpy()))


def save_safetensors(tensors: Mapping[str, torch.Tensor], f: str | os.PathLike | BinaryIO,
                     metadata: Mapping[str, str] | None = None) -> None:
    """Write ``{name: tensor}`` (and optional string ``metadata``) as a safetensors file.

    A path is written atomically (a temp file beside it, fsynced, then renamed); a
    symbolic link there is followed, and the replaced file's permission bits kept.
    """
    if sys.byteorder != "little":
        raise UnsupportedDtypeError("writing safetensors needs a little-endian host")
    head, order = _serialize(tensors, metadata)
    if not isinstance(f, (str, os.PathLike)):
        _write(f, head, order)
        return
    path = local(f, "lcckpt.save_safetensors")
    atomic_write(path, lambda fh: _write(fh, head, order), through_links=True)

