"""Sections written to the file as they are encoded, the header last.

A container's header comes first and names every section's length and checksum, so
``write_container`` holds every encoded section until the last is done: a keyframe of a
245 MB state held its 206 MB of coded bytes beside the state and the reference. A
:class:`SectionStream` instead starts the sections at a data offset reserved for the
header, writes each one as its encoder returns it (computing its checksum on the way),
and at :meth:`~SectionStream.finish` writes the sections it never saw (arrays, bytes),
then the header, zlib-compressed, into the reserved room: the stream ends in stored
blocks of spaces, which JSON ignores, to fill it exactly (:func:`fit_header`). If the
header outgrew its room the sections are moved up, piece by piece from the end: correct,
only slower (and down, if the spaces would inflate the header past the readers' limit).
The file is the same layout (docs/format.md), read by the same readers.

Spooled sections come first in the file, in the order they were encoded, then the rest
in the order ``pack`` lists them; ``finish`` renumbers the tree's section indices to
match (``renumber``).
"""

from __future__ import annotations

import os
import struct
import zlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, BinaryIO

from ..errors import InvalidArgumentError
from .container import _header_json, _section_views, _write_all, section_seed
from .header import (
    _PREFIX, FLAG_HEADER_ZLIB, FORMAT_VERSION, HEADER_ZLIB_LEVEL, MAGIC, MAX_HEADER_SIZE,
    PREFIX_SIZE, _align, layout_version, section_start,
)
from .header_dict import HEADER_DICT, HEADER_DICT_ID
from .sections import Encoded
from . import windows as _windows

__all__ = ["STREAM_ABOVE", "SectionStream", "Spooled", "first_room", "fit_header"]

MOVE_PIECE = 8 << 20             # bytes moved per read/write when the header outgrew its room
# lcckpt.save to a path, and a chain's keyframe or delta (a save's or a merge's), of at
# least this many bytes of tensors are written as a stream: a keyframe's coded sections
# are ~0.8 of the state, a delta's uniform blobs are coded as the file takes them. A first
# file's header room comes from its count of tensors (first_room), a later one's from the
# last need of its kind.
STREAM_ABOVE = 64 << 20
HEADER_ROOM, HEADER_ROOM_PER_TENSOR = 8192, 160     # compressed: ~34 B per tensor seen


def first_room(tensors: int, nbytes: int = 0) -> int:
    """Header room for a file of ``tensors`` tensors and up to ``nbytes`` of sections,
    with no earlier header to go by."""
    return HEADER_ROOM + HEADER_ROOM_PER_TENSOR * tensors + _windows.room(nbytes)


@dataclass(frozen=True)
class Spooled:
    """Where a section already in the file is: stands in for its payload in ``sections``."""
    index: int                    # its place among the spooled sections (and in the file)
    offset: int                   # from the data start
    length: int
    crc: int                      # its section checksum at ``index``
    windows: Any = None           # its bytes' window CRCs (lcckpt.format.windows)


# RFC 1950 stream header: deflate with a 32K window, default level, FDICT set (then the
# dictionary's Adler-32), its check bits making the first two bytes a multiple of 31
_ZLIB_HEAD = b"\x78\xbb" + struct.pack(">I", HEADER_DICT_ID)


def _deflated(header: bytes) -> bytes:
    c = zlib.compressobj(HEADER_ZLIB_LEVEL, zlib.DEFLATED, -15, zdict=HEADER_DICT)  # raw
    return c.compress(header) + c.flush(zlib.Z_SYNC_FLUSH)          # ends on a byte


def fit_header(header: bytes, size: int, body: bytes | None = None) -> bytes | None:
    """``header`` as a zlib stream of exactly ``size`` bytes, or None if it needs more: the
    deflated JSON (``body``, if the caller has it), then stored blocks of spaces (JSON
    ignores trailing whitespace), the last one final, then the Adler-32 of all of it
    (RFC 1950/1951)."""
    body = _deflated(header) if body is None else body
    pad = size - (len(_ZLIB_HEAD) + len(body) + 4)
    if pad < 5:
        return None
    blocks = -(-pad // 65540)             # 5 bytes of block header, at most 65535 of spaces
    spaces = pad - 5 * blocks
    out = [_ZLIB_HEAD, body]
    for k in range(blocks):
        n = spaces // blocks + (k < spaces % blocks)
        out.append(bytes([k == blocks - 1]) + struct.pack("<HH", n, n ^ 0xFFFF) + b" " * n)
    out.append(struct.pack(">I", zlib.adler32(b" " * spaces, zlib.adler32(header))))
    return b"".join(out)


class SectionStream:
    """Write sections into ``f`` (a new, empty, seekable file) from ``PREFIX_SIZE +
    reserve`` on; see the module docstring."""

    def __init__(self, f: BinaryIO, reserve: int):
        if reserve < 0 or reserve > MAX_HEADER_SIZE:
            raise InvalidArgumentError(f"reserve must be in [0, {MAX_HEADER_SIZE}], got {reserve}")
        self._f = f
        self.data_start = _align(PREFIX_SIZE + reserve)
        self._end = 0                 # end of the last section, from the data start
        self._count = 0
        self._names: set[str] = set()
        self.header_need: int | None = None     # the least room the header fits (finish)
        f.seek(self.data_start)

    def wrap(self, encode: Callable[[str, Any], Encoded]) -> Callable[[str, Any], Encoded]:
        """``encode`` whose payloads go to the file at once (a :class:`Spooled` stands in)."""
        def spooling(path, t, *args, **kw):
            enc = encode(path, t, *args, **kw)
            return Encoded(enc.codec, self.spool(path, enc.payload, {"codec": enc.codec}),
                           enc.params)
        return spooling

    def spool(self, name: str, payload, meta: dict) -> Spooled:
        """Write ``payload`` (bytes-like, a list of pieces, or an iterator of byte views,
        each written before the next is asked for) as the next section ``name``, placed
        as its section ``meta`` (its codec) requires."""
        lazy = isinstance(payload, Iterator)
        views = _section_views(name, [] if lazy else payload)    # the name checked first
        views = payload if lazy else views
        if name in self._names:
            raise InvalidArgumentError(f"duplicate section name {name!r}")
        offset = self._next_offset(meta)
        crcs = _windows.windows()
        for v in views:
            crcs.update(v)
            _write_all(self._f, v)
        length = crcs.nbytes       # its checksum from its windows' CRCs: one pass
        crc = crcs.continued(section_seed(self._count, name))
        self._names.add(name)
        self._end = offset + length
        self._count += 1
        return Spooled(self._count - 1, offset, length, crc, crcs)

    def _next_offset(self, meta: dict) -> int:
        """Pad with zeros to the next section's offset (none before the first)."""
        if self._count == 0:
            return 0
        offset = section_start(self._end, meta, FORMAT_VERSION)
        _write_all(self._f, bytes(offset - self._end))
        return offset

    def finish(self, meta: dict, sections: list, renumber: Callable[[dict, dict], None],
               stamp: Callable[[list[dict], dict], None] | None = None) -> int:
        """Write the sections not spooled yet and the header; returns the file's size.
        ``renumber(meta, old_to_new)`` points the tree at the sections' places in the file;
        ``stamp`` is :func:`~lcckpt.format.container.write_container`'s."""
        spooled = sorted((i for i, s in enumerate(sections) if isinstance(s[2], Spooled)),
                         key=lambda i: sections[i][2].index)
        if [sections[i][2].index for i in spooled] != list(range(self._count)):
            raise InvalidArgumentError("the sections do not list every spooled section once")
        rest = [i for i, s in enumerate(sections) if not isinstance(s[2], Spooled)]
        order = spooled + rest
        renumber(meta, {old: new for new, old in enumerate(order)})
        entries = []
        for i in spooled:
            name, smeta, sp = sections[i]
            if sp.index and section_start(entries[-1]["offset"] + entries[-1]["length"], smeta,
                                          FORMAT_VERSION) != sp.offset:
                raise InvalidArgumentError(f"section {name!r} was spooled with another codec")
            entries.append({"name": name, "offset": sp.offset, "length": sp.length,
                            "crc32c": sp.crc,
                            "meta": _windows.with_windows(smeta, sp.length, sp.windows)})
        for i in rest:
            name, smeta, payload = sections[i]
            sp = self.spool(name, payload, smeta)
            entries.append({"name": name, "offset": sp.offset, "length": sp.length,
                            "crc32c": sp.crc,
                            "meta": _windows.with_windows(smeta, sp.length, sp.windows)})
        if stamp is not None:
            stamp(entries, meta)
        version = layout_version([e["offset"] for e in entries])
        header = _header_json(entries, meta, version)
        body = _deflated(header)
        self.header_need = len(_ZLIB_HEAD) + len(body) + 4 + 5
        spaces = self.data_start - PREFIX_SIZE - self.header_need
        # outgrew its room: move the sections up; or the spaces would inflate the header
        # past the readers' limit: down
        if spaces < 0 or len(header) + spaces > MAX_HEADER_SIZE:
            self._move_data(_align(PREFIX_SIZE + self.header_need))
        stored = fit_header(header, self.data_start - PREFIX_SIZE, body)
        self._f.seek(0)
        _write_all(self._f, _PREFIX.pack(MAGIC, version, len(stored),
                                         zlib.crc32(stored), FLAG_HEADER_ZLIB) + stored)
        return self.data_start + self._end

    def _move_data(self, start: int) -> None:
        """Move the data region to ``start``, piece by piece: from its end when moving up,
        from its start when moving down, so that no piece overwrites one still to move."""
        self._f.flush()
        fd, shift = self._f.fileno(), start - self.data_start
        n_pieces = -(-self._end // MOVE_PIECE)
        for k in (reversed(range(n_pieces)) if shift > 0 else range(n_pieces)):
            at = k * MOVE_PIECE
            n = min(MOVE_PIECE, self._end - at)
            piece = _pread(fd, n, self.data_start + at)
            if len(piece) != n:
                raise OSError(f"short read moving the data region ({len(piece)} of {n} bytes)")
            view, pos = memoryview(piece), start + at
            while view.nbytes:
                written = _pwrite(fd, view, pos)
                view, pos = view[written:], pos + written
        if shift < 0:                  # the file ends at the end of the last section
            os.ftruncate(fd, start + self._end)
        self.data_start = start


def _pread(fd: int, n: int, at: int) -> bytes:
    if hasattr(os, "pread"):
        return os.pread(fd, n, at)
    os.lseek(fd, at, os.SEEK_SET)          # no pread (Windows): the caller seeks again after
    return os.read(fd, n)


def _pwrite(fd: int, data, at: int) -> int:
    if hasattr(os, "pwrite"):
        return os.pwrite(fd, data, at)
    os.lseek(fd, at, os.SEEK_SET)
    return os.write(fd, data)
