"""The container format: layout, validation of every header field, atomic writes.

Version 3 files (what the writer writes) are checked against ``_reference``, a writer
built from docs/format.md alone; versions 1 and 2 are crafted the same way, since they
must still load.
"""

import io
import json
import os
import struct
import subprocess
import sys
import zlib

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from helpers import NonSeekableStream

from lcckpt.util import crc as _crc, durable as _durable
from lcckpt.format import container as C
from lcckpt.format import header as H
from lcckpt.format.header_dict import HEADER_DICT
from lcckpt.format.verify import verify_file
from lcckpt.errors import (
    ChecksumError, CorruptDataError, InvalidArgumentError, LcckptError, ResourceLimitError,
    TruncatedError, UnsupportedVersionError,
)

SECTIONS = [("a", {"x": 1}, b"hello"), ("b", {}, bytes(range(100))), ("empty", {}, b""), ("c", {"k": [1.5]}, b"z" * 64)]


def _bytes(sections=SECTIONS, meta=None, compress_header=True):
    f = io.BytesIO()
    C.write_container(f, sections, {"m": 1} if meta is None else meta,
                      compress_header=compress_header)
    return f.getvalue()


def _crc32c(data: bytes, crc: int = 0) -> int:
    """CRC-32C bit by bit: the reference the fast kernels are checked against."""
    crc ^= 0xFFFFFFFF
    for byte in data:
        crc ^= byte
        for _ in range(8):
            crc = (crc >> 1) ^ 0x82F63B78 if crc & 1 else crc >> 1
    return crc ^ 0xFFFFFFFF


def _section_check(index: int, name: str, data: bytes) -> int:
    """A version 2 section checksum, from docs/format.md."""
    ident = struct.pack("<II", index, len(name.encode())) + name.encode()
    return _crc32c(ident + data)


def _craft(header, data=b"", version=1, flags=0, raw_header=None):
    """A file with an arbitrary header and a valid header checksum (version 1 headers, which
    every reader still accepts, unless ``version`` says otherwise), stored as given."""
    h = raw_header if raw_header is not None else json.dumps(header).encode()
    head = struct.pack("<6sHQII", C.MAGIC, version, len(h), zlib.crc32(h), flags) + h
    return head + bytes(-len(head) % (16 if version >= 3 else 64)) + data


def _deflate(header: bytes, version: int) -> bytes:
    """zlib level 6; from version 4 on starting from the preset dictionary."""
    if version < 4:
        return zlib.compress(header, 6)
    c = zlib.compressobj(6, zlib.DEFLATED, 15, zdict=HEADER_DICT)
    return c.compress(header) + c.flush()


def _reference(sections, meta, version=5, compress=True):
    """A container of ``version`` built from docs/format.md alone: 64-byte alignment in
    versions 1 and 2, 16 from version 3 on, whose header is zlib level 6 when that is
    smaller (from version 4 on, deflated from the preset dictionary, the offsets and the
    keys that equal their section's name left out; from version 5 on, only sections with
    no codec or "raw" aligned, the others right after the one before, and version 4
    written where that lays every section out the same)."""
    align = 16 if version >= 3 else 64
    key = "crc32" if version == 1 else "crc32c"
    entries, data, offsets = [], b"", []
    for i, (name, m, payload) in enumerate(sections):
        if i and (version < 5 or m.get("codec", "raw") == "raw"):
            data += bytes(-len(data) % align)
        check = zlib.crc32(payload) if version == 1 else _section_check(i, name, payload)
        params = m.get("codec_params")
        if version >= 4 and m.get("codec") == "delta" and type(params) is dict \
                and params.get("key") == name:       # implied by the name
            params = {k: v for k, v in params.items() if k != "key"}
            m = {k: v for k, v in m.items() if k != "codec_params"}
            m = {**m, "codec_params": params} if params else m
        entry = {"name": name, "offset": len(data), "length": len(payload), key: check,
                 "meta": m}
        offsets.append(len(data))
        if version >= 4:                             # implied by the layout
            del entry["offset"]
        entries.append(entry)
        data += payload
    if version == 5 and not any(o % align for o in offsets):
        version = 4                                  # the same layout: readable by more
    header = json.dumps({"version": version, "meta": meta, "sections": entries},
                        separators=(",", ":")).encode()
    flags = 0
    if version >= 3 and compress and len(_deflate(header, version)) < len(header):
        header, flags = _deflate(header, version), 1
    head = struct.pack("<6sHQII", b"LCCKPT", version, len(header), zlib.crc32(header), flags)
    head += header
    return head + bytes(-len(head) % align) + data


def _section(name="a", offset=0, length=0, crc=0, meta=None):
    return {"name": name, "offset": offset, "length": length, "crc32": crc, "meta": meta or {}}


def test_round_trip_from_every_source(tmp_path):
    path = tmp_path / "f.lc"
    n = C.write_container(path, SECTIONS, {"m": 1})
    raw = path.read_bytes()
    assert n == len(raw)

    for source in (path, str(path), raw, bytearray(raw), memoryview(raw), io.BytesIO(raw),
                   NonSeekableStream(raw)):
        with C.read_container(source) as c:
            assert c.meta == {"m": 1}
            assert [s["name"] for s in c.sections] == ["a", "b", "empty", "c"]
            assert [s["meta"] for s in c.sections] == [m for _, m, _ in SECTIONS]
            for i, (_, _, data) in enumerate(SECTIONS):
                assert bytes(c.data(i)) == data
                out = bytearray(len(data))
                c.read_into(i, out)
                assert out == data
            assert c.index("b") == 1
            c.verify()


@pytest.mark.parametrize("compress", [True, False])
def test_byte_layout(compress):
    meta = {"m": 1, "pad": "abc" * 40}              # a header that compresses
    raw = _bytes(meta=meta, compress_header=compress)
    assert raw == _reference(SECTIONS, meta, compress=compress)
    magic, version, hlen, hcrc, flags = struct.unpack_from("<6sHQII", raw)
    assert (magic, version, flags) == (b"LCCKPT", 4, int(compress))
    stored = raw[24 : 24 + hlen]
    assert zlib.crc32(stored) == hcrc
    header = zlib.decompressobj(zdict=HEADER_DICT).decompress(stored) if compress else stored
    assert len(stored) < len(header) if compress else stored == header
    start = -(-(24 + hlen) // 16) * 16
    assert raw[24 + hlen : start] == bytes(start - 24 - hlen)
    sections = json.loads(header)["sections"]
    assert not any("offset" in s for s in sections)                # the layout fixes them
    with C.read_container(raw) as c:
        sections = c.sections
    assert [s["offset"] for s in sections] == [0, 16, 128, 128]     # 5 -> 16, 16 + 100 -> 128
    for i, (s, (name, _, data)) in enumerate(zip(sections, SECTIONS)):
        assert raw[start + s["offset"] : start + s["offset"] + s["length"]] == data
        assert s["crc32c"] == _section_check(i, name, data)
    last = sections[-1]
    assert len(raw) == start + last["offset"] + last["length"]
    with C.read_container(raw) as c:
        assert (c.version, c.header_compressed, c.header_bytes) == (4, compress, hlen)
        assert (c.header_json_bytes, c.data_start) == (len(header), start)


def test_header_is_compressed_only_when_smaller():
    with C.read_container(_bytes([], {})) as c:     # 36 bytes: the dictionary has them
        assert c.header_compressed and c.header_bytes < c.header_json_bytes
    assert H.pack(b"{}", True) == (b"{}", 0)         # zlib's own bytes are longer
    many = [(f"obj[\"model\"][\"layer{i}.weight\"]", {"kind": "tensor", "dtype": "F32"}, b"x")
            for i in range(3000)]                   # a header of many deflate blocks
    raw = _bytes(many, {"m": 1})
    with C.read_container(raw) as c:
        assert c.header_compressed and c.header_bytes * 10 < c.header_json_bytes
        assert [bytes(c.data(i)) for i in range(len(c))] == [b"x"] * 3000
        assert c.sections[1]["offset"] == 16
        c.verify()
    assert raw == _reference(many, {"m": 1})


def test_the_header_dictionary_never_changes():
    """Version 4 readers need exactly these bytes: a new dictionary is a new version."""
    assert (len(HEADER_DICT), zlib.adler32(HEADER_DICT)) == (2583, 0x219F730B)


def test_a_header_from_the_dictionary_is_smaller():
    sections = [(f'obj["model"]["layer{i}.weight"]', {"kind": "tensor", "dtype": "F32",
                 "shape": [64, 64], "codec": "raw", "device": "cpu"}, b"x") for i in range(8)]
    raw = _bytes(sections, {"m": 1})
    plain = _reference(sections, {"m": 1}, version=3)
    assert raw == _reference(sections, {"m": 1})
    with C.read_container(raw) as c, C.read_container(plain) as p:
        assert c.meta == p.meta and c.sections == p.sections
        assert c.header_bytes < 0.8 * p.header_bytes


def _delta(name, params):
    return (name, {"kind": "tensor", "codec": "delta", "codec_params": params}, b"x")


def test_a_delta_sections_key_is_left_out_where_it_is_the_name():
    sections = [_delta("a", {"key": "a"}), _delta("b", {"key": "other"}),
                _delta("c", {"key": "c", "base": "zero"}), ("d", {"codec": "raw"}, b"x")]
    raw = _bytes(sections, {})
    assert raw == _reference(sections, {})
    stored = json.loads(zlib.decompressobj(zdict=HEADER_DICT).decompress(
        raw[24:24 + struct.unpack_from("<Q", raw, 8)[0]]))["sections"]
    assert [s["meta"].get("codec_params") for s in stored] == [
        None, {"key": "other"}, {"base": "zero"}, None]
    with C.read_container(raw) as c:                # read back as written
        assert [s["meta"] for s in c.sections] == [m for _, m, _ in sections]
    old = _reference([_delta("a", {})], {}, version=3)
    with C.read_container(old) as c:                # version 3 implied nothing
        assert c.sections[0]["meta"]["codec_params"] == {}


@pytest.mark.parametrize("version", [1, 2, 3, 4, 5])
@pytest.mark.parametrize("compress", [True, False])
def test_every_version_reads(version, compress):
    """Files as each version's writer wrote them (64-byte aligned before version 3)."""
    sections = CODED if version == 5 else SECTIONS
    raw = _reference(sections, {"m": [1] * 50}, version, compress)
    with C.read_container(raw) as c:
        assert c.version == version and c.meta == {"m": [1] * 50}
        assert c.header_compressed == (compress and version >= 3)
        assert [bytes(c.data(i)) for i in range(len(c))] == [d for _, _, d in sections]
        assert c.sections[1]["offset"] == (5 if version == 5 else 16 if version >= 3 else 64)
        c.verify()


CODED = [("a", {"codec": "delta"}, b"hello"), ("b", {"codec": "lossless"}, bytes(range(37))),
         ("r", {"codec": "raw"}, b"\x01" * 24), ("z", {"codec": "zeros"}, b""),
         ("c", {}, b"c" * 3), ("d", {"codec": "delta"}, b"d" * 9)]


def test_coded_sections_follow_each_other_unpadded():
    """Version 5: only raw sections (viewed in place by a memory map) are aligned; a coded
    one, decoded from its bytes, starts where the one before ends. A file whose sections
    all fall on aligned offsets anyway is written as version 4, which older readers read."""
    raw = _bytes(CODED, {})
    assert raw == _reference(CODED, {})
    with C.read_container(raw) as c:
        assert c.version == 5
        assert [s["offset"] for s in c.sections] == [0, 5, 48, 72, 80, 83]
        assert [bytes(c.data(i)) for i in range(len(c))] == [d for _, _, d in CODED]
        c.verify()
        gap = c.data_start + 42                      # the zeros between "b" and "r"
    assert _bytes(SECTIONS, {})[6] == 4 and _bytes(CODED[3:4] + CODED[:1], {})[6] == 4
    for i in range(gap, gap + 6):
        with pytest.raises(CorruptDataError, match="padding after section 'b'"):
            with C.read_container(raw[:i] + b"\x01" + raw[i + 1:]) as c:
                c.verify()
    as_v4 = _reference(CODED, {}, version=4, compress=False)   # aligned coded sections,
    header = as_v4[24:24 + struct.unpack_from("<Q", as_v4, 8)[0]]   # labelled version 5:
    # its sections are read where version 5 puts them, and 29 padding bytes are left over
    header = header.replace(b'"version":4', b'"version":5')
    labelled = struct.pack("<6sHQII", b"LCCKPT", 5, len(header), zlib.crc32(header), 0)
    with pytest.raises(CorruptDataError, match="29 unexpected bytes after the last section"):
        C.read_container(labelled + header + as_v4[24 + len(header):])


def test_no_sections_and_buffer_objects():
    import numpy as np

    arr = np.arange(10, dtype=np.float64)
    with C.read_container(_bytes([("arr", {}, arr)], {})) as c:
        assert np.array_equal(np.frombuffer(c.data(0), np.float64), arr)
    with C.read_container(_bytes([], {})) as c:
        assert c.sections == [] and c.meta == {}
        c.verify()


def test_container_inside_a_larger_file(tmp_path):
    f = io.BytesIO(b"prefix!")
    f.seek(0, io.SEEK_END)
    C.write_container(f, SECTIONS, {})
    f.seek(7)
    with C.read_container(f) as c:
        assert bytes(c.data(1)) == SECTIONS[1][2]


@pytest.mark.parametrize(
    "meta",
    [{1: "int key"}, {"t": (1, 2)}, {"f": float("nan")}, {"o": object()}, {"b": b"x"}, [1]],
)
def test_write_refuses_non_json_meta(meta):
    with pytest.raises(InvalidArgumentError):
        C.write_container(io.BytesIO(), [], meta)
    with pytest.raises(InvalidArgumentError):
        C.write_container(io.BytesIO(), [("a", meta, b"")], {})


@pytest.mark.parametrize(
    "sections",
    [[("a", {}, b""), ("a", {}, b"")], [("", {}, b"")], [(1, {}, b"")], [("a", {}, "text")], [("a", {})]],
)
def test_write_refuses_bad_sections(sections):
    with pytest.raises(InvalidArgumentError):
        C.write_container(io.BytesIO(), sections, {})


def test_write_refuses_non_contiguous_buffer():
    import numpy as np

    with pytest.raises(InvalidArgumentError):
        C.write_container(io.BytesIO(), [("a", {}, np.arange(10)[::2])], {})


# ---- validation of hostile or damaged files (each abuse and how it fails)


def test_prefix_checks():
    raw = _bytes()
    with pytest.raises(CorruptDataError, match="empty"):
        C.read_container(b"")
    with pytest.raises(CorruptDataError, match="not an lcckpt file"):
        C.read_container(b"GARBAGE!" * 10)
    with pytest.raises(TruncatedError):
        C.read_container(raw[:10])
    with pytest.raises(UnsupportedVersionError, match="upgrade"):
        C.read_container(raw[:6] + struct.pack("<H", C.FORMAT_VERSION + 1) + raw[8:])
    with pytest.raises(CorruptDataError):
        C.read_container(raw[:6] + struct.pack("<H", 0) + raw[8:])
    for version in (1, 2):                          # the field is reserved: 0, not flags
        old = _reference(SECTIONS, {"m": 1}, version)
        with pytest.raises(CorruptDataError, match="reserved"):
            C.read_container(old[:20] + b"\x01" + old[21:])
    for bit in range(1, 32):                        # versions 3 and 4 define bit 0 only
        flags = struct.unpack_from("<I", raw, 20)[0] | 1 << bit
        with pytest.raises(CorruptDataError, match="flags"):
            C.read_container(raw[:20] + struct.pack("<I", flags) + raw[24:])
    with pytest.raises(CorruptDataError, match="header length"):
        C.read_container(raw[:8] + struct.pack("<Q", C.MAX_HEADER_SIZE + 1) + raw[16:])
    with pytest.raises(CorruptDataError, match="header length"):
        C.read_container(raw[:8] + struct.pack("<Q", 0) + raw[16:])
    with pytest.raises(TruncatedError):
        C.read_container(raw[:8] + struct.pack("<Q", len(raw)) + raw[16:])
    with pytest.raises(ChecksumError, match="header"):
        C.read_container(raw[:16] + b"\0\0\0\0" + raw[20:])


@pytest.mark.parametrize(
    "header",
    [
        [],
        {"version": 1, "meta": {}},
        {"version": 1, "meta": {}, "sections": [], "extra": 1},
        {"version": 2, "meta": {}, "sections": []},
        {"version": True, "meta": {}, "sections": []},
        {"version": 1, "meta": [], "sections": []},
        {"version": 1, "meta": {}, "sections": {}},
        {"version": 1, "meta": {}, "sections": [1]},
        {"version": 1, "meta": {}, "sections": [{"name": "a"}]},
        {"version": 1, "meta": {}, "sections": [{**_section(), "more": 1}]},
        {"version": 1, "meta": {}, "sections": [_section(name="")]},
        {"version": 1, "meta": {}, "sections": [_section(name=3)]},
        {"version": 1, "meta": {}, "sections": [_section(), _section(offset=0)]},
        {"version": 1, "meta": {}, "sections": [_section(offset=-64)]},
        {"version": 1, "meta": {}, "sections": [_section(offset=1)]},
        {"version": 1, "meta": {}, "sections": [_section(offset=64)]},
        {"version": 1, "meta": {}, "sections": [_section(length=-1)]},
        {"version": 1, "meta": {}, "sections": [_section(length=1.0)]},
        {"version": 1, "meta": {}, "sections": [_section(length=True)]},
        {"version": 1, "meta": {}, "sections": [_section(length="4")]},
        {"version": 1, "meta": {}, "sections": [_section(crc=2**32)]},
        {"version": 1, "meta": {}, "sections": [_section(meta=[1])]},
        # overlapping: second section starts inside the first
        {"version": 1, "meta": {}, "sections": [_section(length=100), _section("b", offset=64)]},
        # out of order
        {"version": 1, "meta": {}, "sections": [_section(length=10), _section("b", 0)]},
    ],
)
def test_header_schema_violations(header):
    with pytest.raises(CorruptDataError):
        C.read_container(_craft(header, bytes(200)))


@pytest.mark.parametrize(
    "raw_header",
    [
        b"not json",
        b'{"version": 1, "version": 1, "meta": {}, "sections": []}',
        b'{"version": 1, "meta": {"a": 1, "b": {"c": 2}, "a": 1}, "sections": []}',
        b'{"version": 1, "meta": {"x": NaN}, "sections": []}',
        b'{"version": 1, "meta": {"x": "\xff"}, "sections": []}',
        b"[" * 100000 + b"]" * 100000,
    ],
)
def test_header_json_violations(raw_header):
    with pytest.raises(CorruptDataError):
        C.read_container(_craft(None, raw_header=raw_header))


@pytest.mark.parametrize("raw_header, key", [
    (b'{"version": 1, "version": 1, "meta": {}, "sections": []}', "version"),
    (b'{"version": 1, "meta": {"a": 1, "b": {"c": 2}, "a": 1}, "sections": []}', "a"),
    (b'{"version": 1, "meta": {"b": {"c": 2, "d": [{"e": 1, "f": 0, "e": 1}]}}, '
     b'"sections": []}', "e"),
])
def test_a_header_key_given_twice_is_named(raw_header, key):
    with pytest.raises(CorruptDataError, match=f"header has the key '{key}' twice"):
        C.read_container(_craft(None, raw_header=raw_header))


@pytest.mark.parametrize("version", [1, 2, 3])
def test_verify_file_reports_the_version_and_the_header(tmp_path, version):
    path = tmp_path / "f.lc"
    path.write_bytes(_reference(SECTIONS, {"m": "abc" * 40}, version))
    r = verify_file(path)
    assert r["ok"] and r["version"] == version and r["file_bytes"] == path.stat().st_size
    assert r["header_compressed"] == (version == 3)
    assert (r["header_bytes"] < r["header_json_bytes"]) == (version == 3)
    assert any("format version 1" in w for w in r["warnings"]) == (version == 1)


@pytest.mark.parametrize("version, offset", [(4, 64), (4, 8), (3, 64), (3, 8), (2, 16), (1, 16)])
def test_sections_must_be_at_their_versions_alignment(version, offset):
    key = "crc32" if version == 1 else "crc32c"
    a, b = _section(length=10), _section("b", offset=offset, length=0)
    if version > 1:
        del a["crc32"], b["crc32"]
        a["crc32c"], b["crc32c"] = _section_check(0, "a", bytes(10)), _section_check(1, "b", b"")
    else:
        a[key] = zlib.crc32(bytes(10))
    header = {"version": version, "meta": {}, "sections": [a, b]}
    with pytest.raises(CorruptDataError, match=f"next {16 if version >= 3 else 64}-byte boundary"):
        C.read_container(_craft(header, bytes(offset), version))
    b["offset"] = 16 if version >= 3 else 64
    with C.read_container(_craft(header, bytes(b["offset"]), version)) as c:
        c.verify()


# ---- the compressed header (version 3): every way its zlib stream can be wrong


def _with_stored_header(stored: bytes, flags=C.FLAG_HEADER_ZLIB, data=b"") -> bytes:
    """A version 3 file whose stored header is ``stored``, under a valid prefix CRC."""
    return _craft(None, data, version=3, flags=flags, raw_header=stored)


_SMALL = json.dumps({"version": 3, "meta": {"m": "abc" * 30}, "sections": []},
                    separators=(",", ":")).encode()


def test_a_crafted_compressed_header_reads():
    with C.read_container(_with_stored_header(zlib.compress(_SMALL, 9))) as c:
        assert c.meta == {"m": "abc" * 30} and c.header_compressed
    with C.read_container(_with_stored_header(_SMALL, flags=0)) as c:
        assert not c.header_compressed


def test_every_bit_flip_of_a_compressed_header():
    """Under the prefix CRC a flip is a ChecksumError. With the CRC forged to match, the
    zlib stream (its header check, its codes, its adler32) refuses every flip but those of
    the unused bits after the final end-of-block code, which inflate to the same header."""
    stored = zlib.compress(_SMALL)
    raw, same = _with_stored_header(stored), []
    for bit in range(len(stored) * 8):
        bad = bytearray(stored)
        bad[bit // 8] ^= 1 << (bit % 8)
        flipped = raw[:24 + bit // 8] + bad[bit // 8:bit // 8 + 1] + raw[25 + bit // 8:]
        with pytest.raises(ChecksumError):
            C.read_container(flipped)
        try:
            with C.read_container(_with_stored_header(bytes(bad))) as c:
                assert c.meta == {"m": "abc" * 30}
                same.append(bit)
        except CorruptDataError as e:
            assert "compressed header" in str(e) or "not valid JSON" in str(e)
    assert len(same) < 8 and all(b // 8 == len(stored) - 5 for b in same), same


def test_truncated_and_padded_zlib_streams():
    stored = zlib.compress(_SMALL)
    for n in range(1, len(stored)):                 # every truncation, CRC and length fixed
        with pytest.raises(CorruptDataError, match="compressed header"):
            C.read_container(_with_stored_header(stored[:n]))
    for tail in (b"\0", b"x", stored):             # bytes after the stream's end
        with pytest.raises(CorruptDataError, match="follow the end"):
            C.read_container(_with_stored_header(stored + tail))


@pytest.mark.parametrize("stored, flags, match", [
    (zlib.compress(b""), 1, "not valid JSON"),                      # inflates to nothing
    (zlib.compress(_SMALL)[2:-4], 1, "does not inflate"),           # raw deflate, no wrapper
    (zlib.compress(_SMALL, wbits=31), 1, "does not inflate"),       # gzip wrapper
    (_SMALL, 1, "does not inflate"),                                # flag set, plain header
    (zlib.compress(_SMALL), 0, "not valid JSON"),                   # flag clear, zlib header
])
def test_header_stored_the_wrong_way(stored, flags, match):
    with pytest.raises(CorruptDataError, match=match):
        C.read_container(_with_stored_header(stored, flags))


def test_a_stream_needing_a_preset_dictionary():
    z = zlib.compressobj(zdict=b'{"version":3,"meta":')
    with pytest.raises(CorruptDataError, match="does not inflate"):
        C.read_container(_with_stored_header(z.compress(_SMALL) + z.flush()))


def test_zlib_bombs_are_refused_inflating_at_most_the_limit():
    """65 KiB that inflate one byte past 64 MiB stop at the limit (a header of exactly
    the limit loads); a bomb within the limit is refused by the JSON bounds before parsing."""
    at_limit = _SMALL + b" " * (C.MAX_HEADER_SIZE - len(_SMALL))      # JSON allows the spaces
    with C.read_container(_with_stored_header(zlib.compress(at_limit, 9))) as c:
        assert c.meta == {"m": "abc" * 30} and c.header_json_bytes == C.MAX_HEADER_SIZE
    bomb = zlib.compress(at_limit + b" ", 9)
    assert len(bomb) < C.MAX_HEADER_SIZE // 500
    with pytest.raises(ResourceLimitError, match="inflates past"):
        C.read_container(_with_stored_header(bomb))
    nested = zlib.compress(b"[" * 3_000_000, 9)
    with pytest.raises(ResourceLimitError, match="arrays/objects"):
        C.read_container(_with_stored_header(nested))


# ---- properties of the format: any content round trips, equals the spec, detects damage

_meta_json = st.recursive(
    st.one_of(st.none(), st.booleans(), st.integers(-(2**63), 2**63 - 1),
              st.floats(allow_nan=False, allow_infinity=False), st.text(max_size=8)),
    lambda kids: st.one_of(st.lists(kids, max_size=3),
                           st.dictionaries(st.text(max_size=5), kids, max_size=3)),
    max_leaves=8,
)
_sections_st = st.lists(
    st.tuples(st.text(min_size=1, max_size=6), st.dictionaries(st.text(max_size=4), _meta_json,
                                                               max_size=2),
              st.binary(max_size=40)),
    max_size=5, unique_by=lambda t: t[0],
)


@settings(max_examples=60, deadline=None)
@given(_sections_st, st.dictionaries(st.text(max_size=5), _meta_json, max_size=3),
       st.booleans(), st.data())
def test_any_content_round_trips_as_the_spec_says(sections, meta, compress, data):
    raw = _bytes(sections, meta, compress_header=compress)
    assert raw == _reference(sections, meta, compress=compress)
    with C.read_container(raw) as c:
        assert c.meta == meta and c.version == 4
        assert [(s["name"], s["meta"]) for s in c.sections] == [(n, m) for n, m, _ in sections]
        assert [bytes(c.data(i)) for i in range(len(c))] == [d for _, _, d in sections]
        assert all(s["offset"] % 16 == 0 for s in c.sections)
    bit = data.draw(st.integers(0, len(raw) * 8 - 1), label="bit")
    bad = bytearray(raw)
    bad[bit // 8] ^= 1 << (bit % 8)
    with pytest.raises(LcckptError):                # every byte is covered: found on read
        with C.read_container(bytes(bad)) as c:
            c.verify()
    cut = data.draw(st.integers(0, len(raw) - 1), label="cut")
    with pytest.raises(CorruptDataError):           # truncated anywhere
        with C.read_container(raw[:cut]) as c:
            c.verify()


def test_section_bounds_and_padding():
    data = b"x" * 10
    header = {"version": 1, "meta": {}, "sections": [_section(length=10, crc=zlib.crc32(data))]}
    with C.read_container(_craft(header, data)) as c:
        assert bytes(c.data(0)) == data
    with pytest.raises(TruncatedError):
        C.read_container(_craft(header, data[:9]))
    with pytest.raises(CorruptDataError, match="unexpected bytes"):
        C.read_container(_craft(header, data + b"\0"))
    huge = {"version": 1, "meta": {}, "sections": [_section(length=2**62)]}
    with pytest.raises(TruncatedError):
        C.read_container(_craft(huge, data))
    for version, n in ((3, 40), (3, 41), (2, 40), (1, 40)):    # padding after the header
        raw = bytearray(_reference(SECTIONS, {"m": "x" * n}, version, compress=False))
        hlen = struct.unpack_from("<Q", raw, 8)[0]
        with C.read_container(bytes(raw)) as c:
            assert c.data_start > 24 + hlen
        raw[c.data_start - 1] = 1
        with pytest.raises(CorruptDataError, match="padding"):
            C.read_container(bytes(raw))


def test_damaged_section_is_reported_lazily():
    raw = bytearray(_bytes())
    with C.read_container(bytes(raw)) as c:
        b = c.sections[1]
        pos = c.data_start + b["offset"] + 3
        gap = c.data_start + b["offset"] + b["length"]  # padding after section b
    raw[pos] ^= 0x10
    for source in (bytes(raw), io.BytesIO(bytes(raw))):
        with C.read_container(source) as c:
            assert bytes(c.data(0)) == b"hello"
            with pytest.raises(ChecksumError, match="'b'"):
                c.data(1)
            with pytest.raises(ChecksumError):
                c.read_into(1, bytearray(100))
            with pytest.raises(ChecksumError):
                c.verify()
    raw[pos] ^= 0x10
    raw[gap] = 7
    with C.read_container(io.BytesIO(bytes(raw))) as c:
        with pytest.raises(CorruptDataError, match="padding"):
            c.data(1)
    with pytest.raises(InvalidArgumentError):
        C.read_container(_bytes()).read_into(0, bytearray(3))


def test_file_shrinking_while_open(tmp_path):
    path = tmp_path / "f.lc"
    C.write_container(path, SECTIONS, {})
    with C.read_container(path) as c:
        with open(path, "r+b") as f:
            f.truncate(c.data_start + 2)
        with pytest.raises(TruncatedError):
            c.data(0)


def test_section_from_pieces_is_the_joined_section(tmp_path, monkeypatch):
    monkeypatch.setattr(_crc, "PIECE", 1000)        # pieces large enough to be split too
    rng = np.random.default_rng(5)
    pieces = [rng.integers(0, 256, n, dtype=np.uint8) for n in (7, 0, 4000, 1)]
    joined = b"".join(p.tobytes() for p in pieces)
    a, b = tmp_path / "a.lc", tmp_path / "b.lc"
    na = C.write_container(a, [("x", {}, pieces), ("e", {}, []), ("y", {}, b"z")], {"m": 1})
    nb = C.write_container(b, [("x", {}, joined), ("e", {}, b""), ("y", {}, b"z")], {"m": 1})
    assert na == nb == a.stat().st_size and a.read_bytes() == b.read_bytes()
    with C.read_container(a) as c:
        assert bytes(c.data(0)) == joined
        assert c.sections[0]["crc32c"] == _section_check(0, "x", joined)
    with pytest.raises(InvalidArgumentError, match="list of them"):
        C.write_container(tmp_path / "c.lc", [("x", {}, [b"ok", 3])], {})


# ---- checksums of large sections: pieces on the pool, combined


@settings(max_examples=200, deadline=None)
@given(st.binary(max_size=300), st.binary(max_size=300), st.integers(0, 2**32 - 1))
def test_crc32_combine(a, b, seed):
    assert _crc.crc32_combine(zlib.crc32(a), zlib.crc32(b), len(b)) == zlib.crc32(a + b)
    zeros = bytes(seed % 5000)                      # long zero runs: every operator power
    assert _crc.crc32_combine(zlib.crc32(a), zlib.crc32(zeros), len(zeros)) == zlib.crc32(a + zeros)


def test_pieced_section_reads(tmp_path, monkeypatch):
    monkeypatch.setattr(_crc, "PIECE", 1000)        # many pieces, a short last one
    rng = np.random.default_rng(3)
    big = rng.integers(0, 256, 10_001, dtype=np.uint8).tobytes()
    assert _crc.crc32(big) == zlib.crc32(big)
    assert _crc.crc32(big, 12345) == zlib.crc32(big, 12345)      # continues a running CRC
    path = tmp_path / "f.lc"
    C.write_container(path, [("a", {}, b"x"), ("big", {}, big), ("z", {}, b"y")], {})
    with C.read_container(path) as c:
        assert c.sections[1]["crc32c"] == _section_check(1, "big", big)
        assert bytes(c.data(1)) == big
        pos = c.data_start + c.sections[1]["offset"]
    raw = bytearray(path.read_bytes())
    raw[pos + 4321] ^= 1                            # damage in the fifth piece
    path.write_bytes(raw)
    with C.read_container(path) as c:
        with pytest.raises(ChecksumError, match="'big'"):
            c.data(1)
        with pytest.raises(ChecksumError, match="'big'"):
            c.verify()
        with open(path, "r+b") as f:                # shrinks while open: mid-piece
            f.truncate(pos + 2500)
        with pytest.raises(TruncatedError):
            c.data(1)


# ---- atomic writes


def _listing(d):
    return sorted(p.name for p in d.iterdir())


def test_atomic_write_leaves_only_the_file(tmp_path):
    path = tmp_path / "ck.lc"
    C.write_container(path, SECTIONS, {"v": 1})
    C.write_container(path, SECTIONS[:1], {"v": 2})
    assert _listing(tmp_path) == ["ck.lc"]
    with C.read_container(path) as c:
        assert c.meta == {"v": 2}


def test_failed_write_keeps_old_file_and_removes_temp(tmp_path, monkeypatch):
    path = tmp_path / "ck.lc"
    C.write_container(path, SECTIONS, {"v": 1})

    def broken_fsync(fd):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(C.os, "fsync", broken_fsync)
    with pytest.raises(OSError):
        C.write_container(path, SECTIONS, {"v": 2})
    monkeypatch.undo()
    assert _listing(tmp_path) == ["ck.lc"]
    with C.read_container(path) as c:
        assert c.meta == {"v": 1}


def test_overwrite_keeps_permissions(tmp_path):
    path = tmp_path / "ck.lc"
    C.write_container(path, [], {})
    os.chmod(path, 0o640)
    C.write_container(path, [], {})
    assert os.stat(path).st_mode & 0o777 == 0o640


@pytest.mark.skipif(os.name != "posix", reason="stale temp cleanup is POSIX only")
def test_stale_temps_of_dead_writers_are_removed(tmp_path):
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    dead_pid = int(dead.stdout)
    host = _durable._host_tag()
    stale = tmp_path / f".ck.lc.{host}-{dead_pid}-0123abcd.lcckpt-tmp"
    live = tmp_path / f".ck.lc.{host}-{os.getppid()}-0123abcd.lcckpt-tmp"
    other_host = tmp_path / f".ck.lc.zzzzzzzz-{dead_pid}-0123abcd.lcckpt-tmp"
    other_file = tmp_path / f".other.lc.{host}-{dead_pid}-0123abcd.lcckpt-tmp"
    for p in (stale, live, other_host, other_file):
        p.write_bytes(b"partial")
    C.write_container(tmp_path / "ck.lc", [], {})
    assert not stale.exists() and not other_file.exists()    # dead writers', of any name
    assert live.exists() and other_host.exists()


@pytest.mark.skipif(not os.path.exists("/proc/self/ns/pid"), reason="needs Linux namespaces")
def test_a_temp_of_another_pid_namespace_under_the_same_hostname_is_kept(tmp_path, monkeypatch):
    """Containers that share a hostname (host networking) and a directory each number
    their processes apart: a pid dead here may be a live writer there, whose temp file
    must stay; the tag tells the namespaces apart."""
    dead = int(subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                              capture_output=True, text=True).stdout)
    real = os.readlink
    with monkeypatch.context() as m:            # the tag a writer in another namespace gives
        m.setattr(os, "readlink", lambda p: "pid:[1]" if p == "/proc/self/ns/pid" else real(p))
        there = _durable._host_tag()
    assert there != _durable._host_tag()
    theirs = tmp_path / f".ck.lc.{there}-{dead}-0123abcd.lcckpt-tmp"
    ours = tmp_path / f".ck.lc.{_durable._host_tag()}-{dead}-0123abcd.lcckpt-tmp"
    theirs.write_bytes(b"partial")
    ours.write_bytes(b"partial")
    C.write_container(tmp_path / "ck.lc", [], {})
    assert theirs.exists() and not ours.exists()


def test_a_version_4_entry_may_leave_out_its_offset_and_nothing_else():
    raw = _bytes([("a", {}, b"abc"), ("b", {}, b"")], {})
    with C.read_container(raw) as c:
        assert [s["offset"] for s in c.sections] == [0, 16]
    entry = {"name": "a", "length": 0, "crc32c": _section_check(0, "a", b""), "meta": {}}
    for extra in ({"x": 1}, {"offset": 16}):                # unknown key; a wrong offset
        header = {"version": 4, "meta": {}, "sections": [{**entry, **extra}]}
        with pytest.raises(CorruptDataError) as e:
            C.read_container(_craft(header, version=4))
        msg = str(e.value)                                  # the file's keys, as they are
        assert "'x']," in msg and "'offset'" not in msg if "x" in extra else "boundary" in msg
    header = {"version": 4, "meta": {}, "sections": [entry]}
    with C.read_container(_craft(header, version=4)) as c:
        assert c.sections[0]["offset"] == 0 and c.sections[0]["length"] == 0


def test_a_missing_directory_and_a_directory_that_makes_no_files_are_told_apart(
        tmp_path, monkeypatch):
    """ENOENT from creating the temp file means "create the directory" only where the
    directory is missing; in one that exists (a filesystem such as /proc) it is the OS's
    own error, not advice to create what is there."""
    import lcckpt
    from lcckpt.errors import NotFoundError, StorageError
    with pytest.raises(NotFoundError, match="does not exist .create it first."):
        lcckpt.save({"w": np.ones(3)}, tmp_path / "missing" / "x.lcc")

    def no_files(directory, base):
        raise FileNotFoundError(2, "No such file or directory")
    monkeypatch.setattr(_durable, "_create_temp", no_files)
    with pytest.raises(StorageError) as err:
        lcckpt.save({"w": np.ones(3)}, tmp_path / "x.lcc")
    assert not isinstance(err.value, NotFoundError) and "create it first" not in str(err.value)


def test_a_directory_or_an_empty_path_is_refused_before_anything_is_coded(tmp_path, monkeypatch):
    """Saved onto a directory, the rename failed after the whole object was coded, as
    "Device or resource busy" for "."; now the path is refused first, by what it is."""
    import lcckpt
    from lcckpt.errors import StorageError
    coded = []
    real = _durable._create_temp
    monkeypatch.setattr(_durable, "_create_temp", lambda *a: coded.append(a) or real(*a))
    for path, match in ((tmp_path, "that is a directory; give a file name in it"),
                        (str(tmp_path) + "/", "that is a directory"), ("", "the path is empty")):
        with pytest.raises(StorageError, match=match):
            lcckpt.save({"w": np.ones(3)}, path)
    assert coded == [] and os.listdir(tmp_path) == []
