"""A container's fixed prefix and JSON header: their layout (docs/format.md), and the
parser that checks every field of them before anything else is read."""

import json
import struct
import zlib

from .. import limits
from .header_dict import HEADER_DICT
from ..errors import (
    ChecksumError, CorruptDataError, ResourceLimitError, TruncatedError, UnsupportedVersionError,
)

MAGIC = b"LCCKPT"
FORMAT_VERSION = 5              # the newest written; every version from 1 up to it is read
CHECK_KEY = {1: "crc32", 2: "crc32c", 3: "crc32c", 4: "crc32c", 5: "crc32c"}  # checksum field
ALIGNMENTS = {1: 64, 2: 64, 3: 16, 4: 16, 5: 16}  # section and data-start alignment, per version
ALIGNMENT = ALIGNMENTS[FORMAT_VERSION]  # what the writer uses: every dtype's item size divides it
FLAG_HEADER_ZLIB = 1                   # prefix flag (v3 on): the header is a zlib stream
KNOWN_FLAGS = {1: 0, 2: 0, 3: FLAG_HEADER_ZLIB, 4: FLAG_HEADER_ZLIB, 5: FLAG_HEADER_ZLIB}
DICT_VERSION = 4                       # from it on, a zlib header may use HEADER_DICT
PACKED_VERSION = 5      # from it on, only raw sections are aligned: a coded one (its bytes
                        # are decoded, never viewed in place) follows the one before at once
RAW_CODEC = "raw"
DELTA_CODEC = "delta"                  # v4: a delta section's tracking key defaults to its name
HEADER_ZLIB_LEVEL = 6                  # ~35 ms for the 8 MB header of 20,000 tensors
MAX_HEADER_SIZE = limits.MAX_HEADER_BYTES   # bytes of the header, stored and inflated
MAX_JSON_DEPTH = 512  # writers refuse deeper metadata; JSON parsers recurse
# magic, format version, stored header length, CRC-32 of the stored header, flags
_PREFIX = struct.Struct("<6sHQII")
PREFIX_SIZE = _PREFIX.size  # 24


def _align(n: int, alignment: int = ALIGNMENT) -> int:
    return -(-n // alignment) * alignment


def section_start(end: int, meta, version: int) -> int:
    """Where a section with ``meta`` starts when the one before ends at ``end``: at the
    next aligned offset, or, from :data:`PACKED_VERSION` on, right at ``end`` unless it
    is raw (a section with no codec is raw)."""
    if version >= PACKED_VERSION and type(meta) is dict and meta.get("codec", RAW_CODEC) != RAW_CODEC:
        return end
    return _align(end, ALIGNMENTS[version])


def layout_version(offsets) -> int:
    """The lowest version that reads sections at ``offsets`` (laid out by
    :func:`section_start` for :data:`FORMAT_VERSION`): where every one is aligned, the
    layout is version 4's too, which older readers read."""
    return FORMAT_VERSION if any(o % ALIGNMENT for o in offsets) else PACKED_VERSION - 1


def parse(src) -> tuple:
    """``(version, flags, stored header length, JSON length, meta, sections)`` of the
    container in ``src``, every prefix and header field checked."""
    prefix = bytes(src.read(0, PREFIX_SIZE))
    if len(prefix) < PREFIX_SIZE:
        if prefix[: len(MAGIC)] == MAGIC[: len(prefix)] and prefix:
            raise TruncatedError(f"file ends after {len(prefix)} bytes, inside the fixed prefix")
        raise CorruptDataError(_not_ours(prefix))
    magic, version, header_len, header_crc, flags = _PREFIX.unpack(prefix)
    if magic != MAGIC:
        raise CorruptDataError(_not_ours(prefix))
    if version > FORMAT_VERSION:
        raise UnsupportedVersionError(
            f"file format version {version}, this build reads up to {FORMAT_VERSION}: "
            "upgrade lcckpt (if no such version exists, the file is damaged)"
        )
    if version == 0:
        raise CorruptDataError("format version 0 does not exist: the file is damaged")
    unknown = flags & ~KNOWN_FLAGS[version]
    if unknown and version < 3:
        raise CorruptDataError(f"reserved prefix field is {flags:#x}, not 0: the file is damaged")
    if unknown:
        raise CorruptDataError(
            f"prefix flags {flags:#x} hold bits {unknown:#x} that format version {version} does "
            "not define (a newer format would have a newer version number): the file is damaged")
    if header_len == 0 or header_len > MAX_HEADER_SIZE:
        raise CorruptDataError(
            f"header length {header_len} is outside 1..{MAX_HEADER_SIZE}: the file is damaged"
        )
    if PREFIX_SIZE + header_len > src.size:
        raise TruncatedError(
            f"file has {src.size} bytes but its header ends at byte {PREFIX_SIZE + header_len}"
        )
    raw = src.read(PREFIX_SIZE, header_len)
    if zlib.crc32(raw) != header_crc:
        raise ChecksumError("header checksum mismatch: the file is damaged; restore a good copy")
    raw = _inflate_header(raw, version) if flags & FLAG_HEADER_ZLIB else bytes(raw)
    _check_header_size(raw)
    header = _parse_json(raw)
    meta, sections = _validate_header(header, version)
    return version, flags, header_len, len(raw), meta, sections


def _not_ours(prefix: bytes) -> str:
    if not prefix:
        return "the file is empty"
    return f"not an lcckpt file: it starts with {prefix[:8]!r}, expected {MAGIC!r}"


def pack(header: bytes, compress: bool) -> tuple[bytes, int]:
    """The header as stored, and the prefix flags saying how: deflated from the preset
    dictionary if that is smaller."""
    if compress:
        c = zlib.compressobj(HEADER_ZLIB_LEVEL, zlib.DEFLATED, 15, zdict=HEADER_DICT)
        packed = c.compress(header) + c.flush()
        if len(packed) < len(header):
            return packed, FLAG_HEADER_ZLIB
    return header, 0


def _inflate_header(stored, version: int) -> bytes:
    """The JSON of a compressed header (whose CRC-32 has been checked), inflating at most
    ``MAX_HEADER_SIZE`` bytes: a small stored header cannot make the reader allocate more.
    The stream must end (adler32 checked) exactly at the end of the stored bytes. From
    version 4 on it may start from the preset dictionary (header_dict.py)."""
    # RFC 1950: zlib wrapper and adler32; a stream naming another dictionary fails here
    d = zlib.decompressobj(zdict=HEADER_DICT) if version >= DICT_VERSION else zlib.decompressobj()
    try:
        out = d.decompress(stored, MAX_HEADER_SIZE + 1)
    except zlib.error as e:
        raise CorruptDataError(f"the compressed header does not inflate ({e}): the file is "
                               "damaged; restore a good copy") from None
    if len(out) > MAX_HEADER_SIZE:
        raise ResourceLimitError(
            f"the compressed header of {len(stored):,} bytes inflates past the "
            f"{MAX_HEADER_SIZE:,}-byte header limit: the file is damaged or hostile")
    if not d.eof:
        raise CorruptDataError(
            f"the compressed header ends inside its zlib stream (after {len(stored):,} bytes, "
            f"{len(out):,} inflated): the file is damaged")
    if d.unused_data:
        raise CorruptDataError(
            f"{len(d.unused_data):,} bytes follow the end of the compressed header's zlib "
            "stream inside its declared length: the file is damaged")
    return out


def _check_header_size(raw: bytes) -> None:
    """Bound the work and memory of parsing: count containers and values first (bytes
    inside strings count too, so this is an upper bound), in C, before building objects."""
    containers = raw.count(b"[") + raw.count(b"{")
    values = raw.count(b",") + raw.count(b":")
    if containers > limits.MAX_HEADER_CONTAINERS or values > limits.MAX_HEADER_VALUES:
        raise ResourceLimitError(
            f"the header holds up to {containers:,} arrays/objects and {values:,} values, over "
            f"the limits of {limits.MAX_HEADER_CONTAINERS:,} and {limits.MAX_HEADER_VALUES:,}: "
            "parsing it could take gigabytes; the file is damaged or hostile")


def _parse_json(raw: bytes):
    def no_duplicates(pairs):
        obj = dict(pairs)           # in C; a key twice leaves it shorter than the pairs
        if len(obj) != len(pairs):
            seen = set()
            for k, _ in pairs:
                if k in seen:
                    raise CorruptDataError(f"header has the key {k!r} twice")
                seen.add(k)
        return obj

    def no_constants(name):
        raise CorruptDataError(f"header holds {name}, which JSON does not allow")

    try:
        text = raw.decode("utf-8")
        return json.loads(text, object_pairs_hook=no_duplicates, parse_constant=no_constants)
    except CorruptDataError:
        raise
    except (UnicodeDecodeError, ValueError, RecursionError) as e:
        raise CorruptDataError(f"header is not valid JSON: {e}") from None


def _is_uint(v) -> bool:
    return type(v) is int and v >= 0


def _validate_header(header, version: int) -> tuple[dict, list[dict]]:
    """Check the header against the schema in docs/format.md and the layout rules."""

    def bad(msg):
        raise CorruptDataError(f"invalid header: {msg}")

    if type(header) is not dict:
        bad("not a JSON object")
    if set(header) != {"version", "meta", "sections"}:
        bad(f"keys are {sorted(header)}, expected ['meta', 'sections', 'version']")
    if header["version"] != version or type(header["version"]) is not int:
        bad(f"version {header['version']!r} does not match the prefix version {version}")
    if type(header["meta"]) is not dict:
        bad("'meta' is not an object")
    sections = header["sections"]
    if type(sections) is not list:
        bad("'sections' is not an array")
    names, end = set(), 0
    for i, s in enumerate(sections):
        if type(s) is not dict:
            bad(f"section {i} is not an object")
        ck = CHECK_KEY[version]
        keys, required = set(s), {"name", "length", ck, "meta"}
        implied = version >= DICT_VERSION and keys == required   # v4: the layout fixes it
        if keys != required | {"offset"} and not implied:
            bad(f"section {i} keys are {sorted(s)}, expected {ck}, length, meta, name"
                + (" (and offset, if any)" if version >= DICT_VERSION else ", offset"))
        expected = 0 if i == 0 else section_start(end, s["meta"], version)
        if implied:
            s["offset"] = expected
        name = s["name"]
        if type(name) is not str or not name:
            bad(f"section {i} name is not a non-empty string")
        if name in names:
            bad(f"section name {name!r} appears twice")
        names.add(name)
        for key in ("offset", "length", ck):
            if not _is_uint(s[key]):
                bad(f"section {name!r} {key} is not a non-negative integer")
        if s[ck] > 0xFFFFFFFF:
            bad(f"section {name!r} {ck} does not fit 32 bits")
        if type(s["meta"]) is not dict:
            bad(f"section {name!r} meta is not an object")
        if s["offset"] != expected:
            bad(
                f"section {name!r} starts at {s['offset']}, expected {expected}: sections must be "
                f"stored in order, each at the next {ALIGNMENTS[version]}-byte boundary"
                + (" (a coded one right after the one before)" if version >= PACKED_VERSION else "")
            )
        end = s["offset"] + s["length"]
        if version >= DICT_VERSION and s["meta"].get("codec") == DELTA_CODEC:
            _implied_key(s)
    return header["meta"], sections


def stored_entry(entry: dict) -> dict:
    """``entry`` as a version 4 header stores it: without its offset, which the layout
    fixes (each section at the next aligned boundary after the one before), and without a
    delta section's tracking key where it is the section's name (the reader puts both
    back: _validate_header, _implied_key)."""
    entry = {k: v for k, v in entry.items() if k != "offset"}
    meta = entry["meta"]
    params = meta.get("codec_params")
    if meta.get("codec") != DELTA_CODEC or type(params) is not dict \
            or params.get("key") != entry["name"]:
        return entry
    params = {k: v for k, v in params.items() if k != "key"}
    meta = {k: v for k, v in meta.items() if k != "codec_params"}
    return {**entry, "meta": {**meta, "codec_params": params} if params else meta}


def _implied_key(s: dict) -> None:
    """A version 4 writer leaves out a delta section's tracking key where it is the
    section's name (most of them: the key path of the tensor); put it back."""
    params = s["meta"].get("codec_params", {})
    if type(params) is dict and "key" not in params:
        s["meta"]["codec_params"] = {**params, "key": s["name"]}
