"""The lcckpt file format: a checksummed JSON header, then data sections (raw ones aligned).

This module moves bytes and per-section metadata; it knows nothing of torch or of what a
section holds (serialization.py and the chain decide that). header.py holds the prefix
and header layout and their parser, sources.py where the bytes come from, verify.py the
check of a whole file, inside its tensor blobs too. Every field of the header, every
offset, length, padding byte and checksum is validated before a byte is handed out, so a damaged or hostile file fails with a :class:`CorruptDataError`
subclass instead of feeding garbage to a decoder. ``docs/format.md`` is the spec.

Section checksums (since format version 2) are CRC-32C of the section's index and name
followed by its bytes: they bind each section's content and identity, so no swap or
substitution of equal-length sections passes (a tensor blob ends with the CRC-32 of its
own payload, which makes a plain CRC-32 of it content-blind; version 1 files still load,
with that weakness). Format version 3 stores the header zlib-compressed when that is smaller,
and aligns sections to 16 bytes instead of 64: a small model's delta file was mostly
header and padding. Version 4 deflates it from a preset dictionary (header_dict.py) and
leaves out what the layout implies: each section's offset, and a delta section's
tracking key where it is the name. Version 5 pads only before raw sections (what a memory
map views in place); a coded one follows the section before at once. A file whose
sections all fall on aligned offsets anyway is written as version 4. The header's stored
size, inflated size and shape are bounded before it is parsed; earlier versions load.

Writes to a path are atomic: a temp file in the same directory is written, fsynced and
renamed over the target, then the directory is fsynced. A crash leaves either the old
file or the new one, never a mix; temp files of crashed writers on this host are removed
by the next successful write into the same directory.

Reading is lazy: the header is read and validated up front, each section's bytes and
checksum when it is asked for (:meth:`Container.data`, :meth:`Container.read_into`), or
all of them at once with :meth:`Container.verify`.
"""

from __future__ import annotations

import errno
import io
import json
import math
import os
import struct
import zlib
from collections.abc import Callable, Iterable, Iterator
from typing import Any, BinaryIO

import numpy as np

from .. import limits
from ..util import crc as _crc, durable as _durable, memory as _memory
from ..util.pool import gather, submit
from ..errors import (
    ChecksumError, CorruptDataError, InvalidArgumentError, LcckptError, NotFoundError,
    StorageError, TruncatedError,
)
from . import header as _header, windows as _windows
from .header import (    # the prefix and header layout
    _PREFIX, ALIGNMENT, ALIGNMENTS, CHECK_KEY, FLAG_HEADER_ZLIB, FORMAT_VERSION,
    MAGIC, MAX_HEADER_SIZE, MAX_JSON_DEPTH, PREFIX_SIZE, _align,
)
from .sources import BufferSource, FileSource, PartReader

__all__ = [
    "ALIGNMENT", "ALIGNMENTS", "FLAG_HEADER_ZLIB", "FORMAT_VERSION", "MAGIC", "MAX_HEADER_SIZE",
    "Container", "at_path", "open_file", "read_container", "section_seed", "write_container",
]


# --------------------------------------------------------------------------- writing


def write_container(dest: str | os.PathLike | BinaryIO, sections: Iterable[tuple[str, dict, Any]],
                    meta: dict, *, compress_header: bool = True,
                    before_write: Callable[[], None] | None = None,
                    stamp: Callable[[list[dict], dict], None] | None = None,
                    after_write: Callable[[], None] | None = None) -> int:
    """Write ``sections`` (``(name, section_meta, data)`` triples) and ``meta``.

    ``data`` is a bytes-like object, or a list of them written one after another (a
    section assembled from pieces is never joined into one copy).

    ``dest`` is a path (written atomically) or a writable binary file object (written
    from its current position, not closed). Metadata must be plain JSON: dicts with str
    keys, lists, str, int, finite float, bool, None. The header is stored zlib-compressed
    when that is smaller, unless ``compress_header=False`` (a header readable as plain
    text in the file). ``before_write`` is called once the header and checksums are
    computed, just before the first byte goes out: work started there runs while the file
    is written and synced. ``stamp(entries, meta)``, called with the sections' header
    entries (name, length, checksum) before the header is built, may put into ``meta``
    what depends on the bytes (a chain file's state id). ``after_write`` is called once
    the last byte is written, before the file is synced (a path) or returned: the data
    the sections point into is no longer read. Returns the number of bytes written.
    """
    header, payloads, offsets = _build_header(sections, meta, stamp)
    header, flags = _header.pack(header, compress_header)
    if before_write is not None:
        before_write()

    def write(f) -> None:
        _write_all_parts(f, header, flags, payloads, offsets)
        if after_write is not None:
            after_write()
    if isinstance(dest, (str, os.PathLike)):
        _durable.atomic_write(os.fspath(dest), write)
    else:
        write(dest)
    end = offsets[-1] + sum(v.nbytes for v in payloads[-1]) if payloads else 0
    return _align(PREFIX_SIZE + len(header)) + end


def _build_header(sections, meta, stamp=None) -> tuple[bytes, list[list[memoryview]], list[int]]:
    """The header JSON, each section's byte views, and its offset: each at
    :func:`~lcckpt.format.header.section_start` of the one before."""
    entries, payloads, names = [], [], set()
    end = 0
    for item in sections:
        try:
            name, section_meta, data = item
        except (TypeError, ValueError):
            raise InvalidArgumentError(
                f"each section must be a (name, meta, bytes_like) triple, got {item!r:.80}"
            ) from None
        views = _section_views(name, data)      # the name checked first
        if name in names:
            raise InvalidArgumentError(f"duplicate section name {name!r}")
        names.add(name)
        length = sum(v.nbytes for v in views)
        crc, crcs = _windows.checksum(views, section_seed(len(entries), name), length)
        section_meta = _windows.with_windows(section_meta, length, crcs)
        offset = _header.section_start(end, section_meta, FORMAT_VERSION) if entries else 0
        entries.append({"name": name, "offset": offset, "length": length, "crc32c": crc,
                        "meta": section_meta})
        payloads.append(views)
        end = offset + length
    if stamp is not None:
        stamp(entries, meta)
    offsets = [e["offset"] for e in entries]
    return _header_json(entries, meta, _header.layout_version(offsets)), payloads, offsets


def _section_views(name, data) -> list[memoryview]:
    """A section's payload (bytes-like, a list of pieces, or an iterator of them, which is
    read here: a file whose header comes first needs every length) as byte views."""
    if not isinstance(name, str) or not name:
        raise InvalidArgumentError(f"section name must be a non-empty str, got {name!r:.80}")
    parts = data if isinstance(data, list) else list(data) if isinstance(data, Iterator) \
        else [data]
    try:
        return [memoryview(p).cast("B") for p in parts]
    except TypeError as e:
        raise InvalidArgumentError(
            f"data of section {name!r} must be a C-contiguous bytes-like object (or a "
            f"list of them): {e}"
        ) from None


def _header_json(entries: list[dict], meta, version: int) -> bytes:
    """The header JSON of ``entries`` and ``meta``, checked to survive a round trip."""
    if not isinstance(meta, dict):
        raise InvalidArgumentError(f"meta must be a dict, got {type(meta).__name__}")
    for entry in entries:
        if not isinstance(entry["meta"], dict):
            raise InvalidArgumentError(f"meta of section {entry['name']!r} must be a dict")
    header_obj = {"version": version, "meta": meta,
                  "sections": [_header.stored_entry(e) for e in entries]}
    try:       # what JSON would change (int keys, tuples, NaN) fails the round trip, in C
        header = json.dumps(header_obj, ensure_ascii=True, allow_nan=False, separators=(",", ":"))
        same = json.loads(header) == header_obj
    except (TypeError, ValueError, RecursionError):
        same = False
    if not same:                         # find and name what does not survive
        _check_json(meta, "meta")
        for entry in entries:
            _check_json(entry["meta"], f"meta of section {entry['name']!r}")
        raise InvalidArgumentError("the header's metadata does not survive a JSON round trip")
    header = header.encode("ascii")
    if len(header) > MAX_HEADER_SIZE:
        raise InvalidArgumentError(
            f"header would be {len(header)} bytes, over the {MAX_HEADER_SIZE}-byte limit "
            "readers enforce; store large collections of numbers as tensors or arrays"
        )
    return header


def _check_json(value, where: str) -> None:
    """Refuse anything json.dumps would silently change (int keys, tuples, NaN)."""
    stack = [(value, 0, (where,))]
    while stack:
        v, depth, at = stack.pop()
        t = type(v)
        if v is None or t in (bool, int, str):
            continue
        if depth > MAX_JSON_DEPTH:
            raise InvalidArgumentError(f"{_where(at)} is nested too deeply (or is cyclic)")
        if t is float:
            if not math.isfinite(v):
                raise InvalidArgumentError(f"{_where(at)} is a non-finite float; JSON cannot store it")
        elif t is list:
            stack.extend((x, depth + 1, (at, i)) for i, x in enumerate(v))
        elif t is dict:
            for k, x in v.items():
                if type(k) is not str:
                    raise InvalidArgumentError(
                        f"{_where(at)} has a non-str key {k!r:.80}; JSON keys are str"
                    )
                stack.append((x, depth + 1, (at, k)))
        else:
            raise InvalidArgumentError(
                f"{_where(at)} holds a {t.__name__}; container metadata must be plain JSON "
                "(dict with str keys, list, str, int, finite float, bool, None)"
            )


def section_seed(index: int, name: str) -> int:
    """CRC-32C of a section's identity: u32 index, u32 byte length of the name, the name
    (UTF-8). A version 2 section checksum is the CRC-32C continued from it over the bytes."""
    raw = name.encode("utf-8", "surrogatepass")
    return _crc.crc32c_piece(struct.pack("<II", index, len(raw)) + raw)


def _where(at: tuple) -> str:
    parts = []
    while len(at) == 2:
        at, key = at
        parts.append(f"[{key!r}]")
    return at[0] + "".join(reversed(parts))


def _write_all_parts(f: BinaryIO, header: bytes, flags: int,
                     payloads: list[list[memoryview]], offsets: list[int]) -> None:
    version = _header.layout_version(offsets)
    prefix = _PREFIX.pack(MAGIC, version, len(header), zlib.crc32(header), flags)
    head_end = PREFIX_SIZE + len(header)
    _write_all(f, prefix + header + bytes(_align(head_end) - head_end))
    end = 0
    for views, offset in zip(payloads, offsets):
        _write_all(f, bytes(offset - end))
        for view in views:
            _write_all(f, view)
        end = offset + sum(v.nbytes for v in views)


def _write_all(f: BinaryIO, data) -> None:
    view = memoryview(data).cast("B")
    while view.nbytes:
        n = f.write(view)
        if n is None:  # raw non-blocking stream with nothing written
            raise OSError(errno.EAGAIN, "non-blocking stream refused the write")
        view = view[n:]


# --------------------------------------------------------------------------- reading


class Container:
    """A validated container: ``meta``, ``sections`` and checked access to their bytes.

    ``sections`` is a list of dicts with ``name``, ``offset`` (from the data start),
    ``length``, the checksum (``crc32c``; ``crc32`` in version 1) and ``meta``. The header
    has been fully validated; section bytes are checked (checksum and trailing padding)
    each time they are read. ``header_bytes`` is the header's size in the file,
    ``header_json_bytes`` its inflated size (equal unless ``header_compressed``). Use as a
    context manager, or call :meth:`close`, when the container was opened from a path.
    """

    def __init__(self, source, version: int, meta: dict, sections: list[dict], data_start: int,
                 header_bytes: int = 0, header_json_bytes: int = 0, flags: int = 0):
        self._source = source
        self.version = version
        self.size = source.size                 # bytes of the whole container
        self.meta = meta
        self.sections = sections
        self.data_start = data_start
        self.header_bytes = header_bytes
        self.header_json_bytes = header_json_bytes
        self.header_compressed = bool(flags & FLAG_HEADER_ZLIB)
        self._names = {s["name"]: i for i, s in enumerate(sections)}
        self._checked: set[int] = set()
        self.part: tuple | None = None     # (section, bytes): the last small one a part read

    def __len__(self) -> int:
        return len(self.sections)

    def __enter__(self) -> Container:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        self._source.close()

    def part_reader(self, i: int) -> PartReader | None:
        """Unchecked reads of section ``i`` (:meth:`PartReader.of`; its CRC is the caller's)."""
        s = self.sections[i]
        return PartReader.of(self._source, self.data_start + s["offset"], s["length"])

    def index(self, name: str) -> int:
        """Position of the section called ``name`` (KeyError if absent)."""
        return self._names[name]

    def data(self, i: int) -> memoryview:
        """The checked bytes of section ``i`` (a view into memory, or a fresh copy from disk)."""
        s = self.sections[i]
        if isinstance(self._source, BufferSource):
            view = self._source.read(self.data_start + s["offset"], s["length"])
            if i not in self._checked:
                self._check(i, view)
                self._check_gap(i)
                self._checked.add(i)
            return view
        pad = self._pad(i)
        if s["length"] >= 2 * _crc.PIECE or not pad:
            buf = _memory.bulk_empty(s["length"], np.uint8)  # pool threads read pieces into it
            self.read_into(i, buf)
            return memoryview(buf)
        buf = _memory.bulk_empty(s["length"] + pad, np.uint8)   # and its padding: one read
        got = self._source.readinto(self.data_start + s["offset"], memoryview(buf))
        self._read_checked(i, memoryview(buf)[:s["length"]], got, None)
        self._check_gap(i, buf[s["length"]:got])
        return memoryview(buf)[:s["length"]]

    def read_into(self, i: int, out) -> None:
        """Copy section ``i`` into the writable buffer ``out`` (exactly its length), checked."""
        s = self.sections[i]
        view = memoryview(out).cast("B")
        if view.nbytes != s["length"]:
            raise InvalidArgumentError(
                f"buffer of {view.nbytes} bytes for section {s['name']!r} of {s['length']} bytes"
            )
        start = self.data_start + s["offset"]
        if view.nbytes < 2 * _crc.PIECE or isinstance(self._source, BufferSource):
            got, crc = self._source.readinto(start, view), None
        else:                         # pieces read and checksummed on the pool, in parallel
            one = zlib.crc32 if self.version == 1 else _crc.crc32c_piece

            def piece(off):
                part = view[off:off + _crc.PIECE]
                n = self._source.readinto(start + off, part)
                return n, one(part[:n])
            offsets = range(0, view.nbytes, _crc.PIECE)
            done = gather([submit(piece, off) for off in offsets])
            got, crc = 0, self._seed(i)
            poly = _crc._POLY if self.version == 1 else _crc._POLY_C
            for off, (n, c) in zip(offsets, done):
                if got == off:                # else an earlier piece came up short
                    crc = _crc.crc32_combine(crc, c, n, poly)
                    got += n
        self._read_checked(i, view, got, crc)
        self._check_gap(i)

    def _read_checked(self, i: int, view, got: int, crc: int | None) -> None:
        """Section ``i``'s bytes in ``view`` (``got`` of them read; ``crc``: their
        checksum, if computed on the way) are whole and match its checksum."""
        s = self.sections[i]
        if got < s["length"]:
            raise TruncatedError(
                f"section {s['name']!r} ends after {got} of its {s['length']} bytes: the file "
                "was truncated or changed while being read"
            )
        self._compare_crc(i, self._checksum(view, self._seed(i)) if crc is None else crc)

    def read_part(self, i: int, start: int, out) -> None:
        """Copy bytes ``[start, start + len(out))`` of section ``i`` into ``out``, checked
        by the windows that hold them (:mod:`lcckpt.format.windows`): for part reads such
        as a lazy slice. Raises if the span leaves the section or the file."""
        _windows.read_part(self, i, start, out)

    def verify(self) -> None:
        """Check every section's checksum, windows and padding; raises on the first bad one."""
        for i, s in enumerate(self.sections):
            crcs = _windows.windows() if self.version > 1 and \
                _windows.windows_of(s) is not None else None
            if isinstance(self._source, BufferSource):
                data = self.data(i)
                if crcs is not None:
                    crcs.update(data)
                _windows.check_all(s, crcs)
                continue
            buf = np.empty(min(s["length"], 16 << 20), np.uint8)
            crc, pos, end = self._seed(i), 0, s["length"]
            while pos < end:
                view = memoryview(buf)[: min(buf.size, end - pos)]
                got = self._source.readinto(self.data_start + s["offset"] + pos, view)
                if got != view.nbytes:
                    raise TruncatedError(f"section {s['name']!r} is truncated")
                if crcs is None:
                    crc = self._checksum(view, crc)
                else:                        # its checksum follows from the windows
                    crcs.update(view)
                pos += got
            self._compare_crc(i, crc if crcs is None else crcs.continued(crc))
            _windows.check_all(s, crcs)
            self._check_gap(i)

    def _seed(self, i: int) -> int:
        return 0 if self.version == 1 else section_seed(i, self.sections[i]["name"])

    def _checksum(self, view, value: int) -> int:
        return _crc.crc32(view, value) if self.version == 1 else _crc.crc32c(view, value)

    def check(self, i: int, view) -> None:
        """Raise :class:`ChecksumError` unless ``view`` holds section ``i``'s bytes (for
        callers that got them another way, such as a memory map)."""
        self._compare_crc(i, self._checksum(memoryview(view).cast("B"), self._seed(i)))

    def _check(self, i: int, view: memoryview) -> None:
        self._compare_crc(i, self._checksum(view, self._seed(i)))

    def _compare_crc(self, i: int, crc: int) -> None:
        s = self.sections[i]
        key = CHECK_KEY[self.version]
        if crc != s[key]:
            why = ("its bytes are damaged, or are another section's"
                   if self.version > 1 else "its bytes are damaged")
            raise ChecksumError(
                f"section {s['name']!r} fails its checksum ({key} {crc:#010x}, header says "
                f"{s[key]:#010x}): {why}; restore the file from a good copy"
            )

    def _pad(self, i: int) -> int:
        """Bytes of padding after section ``i``."""
        s = self.sections[i]
        return 0 if i == len(self.sections) - 1 else \
            self.sections[i + 1]["offset"] - s["offset"] - s["length"]

    def _check_gap(self, i: int, gap=None) -> None:
        """The padding after section ``i`` is zero (``gap``: its bytes, if read already)."""
        s = self.sections[i]
        if gap is None:
            gap = self._source.read(self.data_start + s["offset"] + s["length"], self._pad(i))
        if any(gap):
            raise CorruptDataError(
                f"padding after section {s['name']!r} is not zero: the file is damaged"
            )


def read_container(source) -> Container:
    """Open and validate a container from a path, a bytes-like object or a binary file.

    A path is opened and read lazily (close the container when done). A seekable file
    object is read lazily from its current position, which must stay valid until the
    container is no longer used; a non-seekable one is read to its end. The container
    must extend exactly to the end of the file or buffer.
    """
    if isinstance(source, (str, os.PathLike)):
        path = os.fspath(source)
        src = FileSource(open_file(path), 0, owned=True)
        try:
            return _open(src)
        except LcckptError as e:
            src.close()
            raise at_path(e, path) from None
        except BaseException:
            src.close()
            raise
    elif isinstance(source, (bytes, bytearray, memoryview)):
        src = BufferSource(memoryview(source).cast("B"))
    else:
        if isinstance(source, io.TextIOBase):
            raise InvalidArgumentError("cannot read from a text-mode file: open it with 'rb'")
        try:
            seekable = source.seekable()
        except AttributeError:
            raise InvalidArgumentError(
                f"cannot read from {type(source).__name__}: pass a path, bytes or a binary file"
            ) from None
        if seekable:
            src = FileSource(source, source.tell(), owned=False)
        else:
            if isinstance(source.read(0), str):
                raise InvalidArgumentError("the file object must be opened in binary mode")
            src = BufferSource(memoryview(limits.read_stream(source, limits.DEFAULT, "the file")))
    try:
        return _open(src)
    except BaseException:
        src.close()
        raise


def open_file(path: str):
    """``open(path, "rb")`` whose failures are LcckptErrors naming ``path``."""
    try:
        return open(path, "rb", buffering=0)
    except FileNotFoundError:
        parent = os.path.dirname(os.path.abspath(path))
        why = "no such file" if os.path.isdir(parent) else f"its directory {parent} does not exist"
        raise NotFoundError(errno.ENOENT, f"cannot read the checkpoint: {why}", path) from None
    except IsADirectoryError:
        raise InvalidArgumentError(
            f"{path} is a directory, not a checkpoint file; a chain of checkpoints loads with "
            "lcckpt.DeltaCheckpointer(directory).load(step)") from None
    except OSError as e:
        raise StorageError(e.errno, f"cannot read the checkpoint: {e.strerror}", path) from None


def at_path(e: LcckptError, path: str) -> LcckptError:
    """``e`` with the user's path in front of its message (unless it names it already)."""
    msg = str(e)
    if path in msg or isinstance(e, OSError):
        return e
    try:
        return type(e)(f"{path}: {msg}")
    except TypeError:
        return CorruptDataError(f"{path}: {msg}")


def _open(src) -> Container:
    version, flags, header_len, raw_len, meta, sections = _header.parse(src)
    data_start = _align(PREFIX_SIZE + header_len, ALIGNMENTS[version])
    end = data_start + (sections[-1]["offset"] + sections[-1]["length"] if sections else 0)
    if end > src.size:
        raise TruncatedError(f"file has {src.size} bytes, its header promises {end}: truncated")
    if end < src.size:
        raise CorruptDataError(
            f"{src.size - end} unexpected bytes after the last section: the file is damaged "
            "or another file was appended to it"
        )
    if any(src.read(PREFIX_SIZE + header_len, data_start - PREFIX_SIZE - header_len)):
        raise CorruptDataError("padding after the header is not zero: the file is damaged")
    return Container(src, version, meta, sections, data_start, header_len, raw_len, flags)
