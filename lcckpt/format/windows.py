"""Checked reads of part of a section, for lazy slices of large tensors.

A section's checksum covers it whole, so a slice that reads a few rows of a large tensor
could not check them. A section longer than :data:`WINDOWED_ABOVE` (1 MiB) therefore
carries in its meta, under :data:`WINDOWS_KEY`, the CRC-32C (seed 0) of each 256 KiB
window of its bytes, the last one shorter, as base64 of little-endian u32s: 4 bytes a
window, 0.002% of the data. :func:`read_part` reads the windows that hold the part asked
for and checks each; a section of at most 1 MiB is read whole, its own checksum checked,
and kept for the next part. Only a large section of a file written before the windows is
read unchecked. A section's meta is free-form to readers, and those before the windows
ignore the key, so the format version stays; the writers compute it from the bytes they
write and drop any copied from another file. The section's own checksum follows from
its windows' CRCs (:meth:`Windows.continued`), so they cost the writer no second pass.
"""

from __future__ import annotations

import base64
import binascii

import numpy as np

from ..errors import ChecksumError, CorruptDataError, TruncatedError
from ..util.crc import Windows, crc32c, crc32c_piece

WINDOW_LOG2 = 18                # 256 KiB: a slice reads at most two windows beyond its bytes
WINDOWED_ABOVE = 1 << 20        # a shorter section is read whole by a part read, and checked
WINDOWS_KEY = "crc32c_windows"


def windows() -> Windows:
    """The running window CRCs of a section being written."""
    return Windows(WINDOW_LOG2)


def with_windows(meta: dict, length: int, crcs: Windows | None) -> dict:
    """``meta`` as the writer stores it: with the windows' CRCs of a section of ``length``
    bytes above :data:`WINDOWED_ABOVE` (``crcs`` fed its bytes), without any others."""
    if length <= WINDOWED_ABOVE and WINDOWS_KEY not in meta:
        return meta
    out = {k: v for k, v in meta.items() if k != WINDOWS_KEY}
    if length > WINDOWED_ABOVE:
        out[WINDOWS_KEY] = base64.b64encode(crcs.finish().tobytes()).decode("ascii")
    return out


def checksum(views, seed: int, length: int) -> tuple[int, Windows | None]:
    """The checksum of a section of ``length`` bytes in ``views``, continued from
    ``seed``, and the windows' CRCs of a large one, from which its checksum follows
    (one pass over its bytes, not two)."""
    if length <= WINDOWED_ABOVE:
        for view in views:
            seed = crc32c(view, seed)
        return seed, None
    crcs = windows()
    for view in views:
        crcs.update(view)
    return crcs.continued(seed), crcs


def room(nbytes: int) -> int:
    """Header bytes the windows of ``nbytes`` of sections may take (base64 does not
    compress: 5.33 bytes a window), for a writer that reserves the header's room first."""
    return 6 * (nbytes >> WINDOW_LOG2)


def windows_of(section: dict) -> np.ndarray | None:
    """The windows' CRCs of a header ``section`` entry, checked to be one per window;
    None where it has none."""
    w = section["meta"].get(WINDOWS_KEY)
    if w is None:
        return None
    n = -(-section["length"] >> WINDOW_LOG2)
    try:
        raw = base64.b64decode(w, validate=True) if type(w) is str and len(w) <= 8 * n + 8 \
            else b""
    except (binascii.Error, ValueError):
        raw = b""
    if len(raw) != 4 * n or section["length"] <= WINDOWED_ABOVE:
        raise CorruptDataError(f"section {section['name']!r}: its {WINDOWS_KEY} is not one "
                               f"CRC per {1 << WINDOW_LOG2}-byte window of its bytes")
    return np.frombuffer(raw, "<u4")


def check_all(section: dict, crcs: Windows | None) -> None:
    """Raise :class:`ChecksumError` unless ``crcs``, fed all of ``section``'s bytes, are
    the windows its meta holds (None: it holds none)."""
    if crcs is not None and not np.array_equal(crcs.finish(), windows_of(section)):
        raise ChecksumError(f"section {section['name']!r}: its {WINDOWS_KEY} do not match "
                            "its bytes: the file is damaged or forged")


def read_part(c, i: int, start: int, out) -> None:
    """Copy bytes ``[start, start + len(out))`` of section ``i`` of container ``c`` into
    ``out``, checked as the module docstring says."""
    s = c.sections[i]
    view = memoryview(out).cast("B")
    n = view.nbytes
    if not 0 <= start <= start + n <= s["length"]:
        raise CorruptDataError(f"section {s['name']!r}: bytes {start}..{start + n} asked "
                               f"for, it holds {s['length']}")
    crcs = windows_of(s)
    if not n:
        return
    if crcs is None:
        if s["length"] > WINDOWED_ABOVE:            # written before windows: unchecked
            _read(c, s, start, view)
            return
        if c.part is None or c.part[0] != i:
            c.part = None                           # the old one goes before the next read
            c.part = (i, c.data(i))                 # read whole and checked
        view[:] = c.part[1][start:start + n]
        return
    size = 1 << WINDOW_LOG2
    for k in range(start >> WINDOW_LOG2, (start + n - 1 >> WINDOW_LOG2) + 1):
        lo, hi = k * size, min(s["length"], (k + 1) * size)
        inside = start <= lo and hi <= start + n
        w = view[lo - start:hi - start] if inside else memoryview(np.empty(hi - lo, np.uint8))
        _read(c, s, lo, w)                          # a whole window in place, an edge apart
        if crc32c_piece(w) != int(crcs[k]):
            raise ChecksumError(f"section {s['name']!r}: bytes {lo}..{hi} fail their "
                                "checksum: they are damaged; restore the file from a good copy")
        if not inside:
            a, b = max(lo, start), min(hi, start + n)
            view[a - start:b - start] = w[a - lo:b - lo]


def _read(c, s: dict, start: int, view: memoryview) -> None:
    if c._source.readinto(c.data_start + s["offset"] + start, view) != view.nbytes:
        raise TruncatedError(f"section {s['name']!r} ends before the bytes asked for: "
                             "the file was truncated or changed while being read")
