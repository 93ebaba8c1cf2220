"""The container format: layout, validation of every header field, atomic writes."""

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

from lcckpt import _crc, _durable
from lcckpt import container as C
from lcckpt.errors import (
    ChecksumError,
    CorruptDataError,
    InvalidArgumentError,
    TruncatedError,
    UnsupportedVersionError,
)

SECTIONS = [("a", {"x": 1}, b"hello"), ("b", {}, bytes(range(100))), ("empty", {}, b""), ("c", {"k": [1.5]}, b"z" * 64)]


def _bytes(sections=SECTIONS, meta=None):
    f = io.BytesIO()
    C.write_container(f, sections, {"m": 1} if meta is None else meta)
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


def _craft(header, data=b"", version=1, reserved=0, raw_header=None):
    """A file with an arbitrary header and a valid header checksum (version 1 headers, which
    every reader still accepts, unless ``version`` says otherwise)."""
    h = raw_header if raw_header is not None else json.dumps(header).encode()
    head = struct.pack("<6sHQII", C.MAGIC, version, len(h), zlib.crc32(h), reserved) + h
    return head + bytes(-len(head) % 64) + data


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


def test_byte_layout():
    raw = _bytes()
    magic, version, hlen, hcrc, reserved = struct.unpack_from("<6sHQII", raw)
    assert (magic, version, reserved) == (b"LCCKPT", 2, 0)
    header = raw[24 : 24 + hlen]
    assert zlib.crc32(header) == hcrc
    start = -(-(24 + hlen) // 64) * 64
    assert raw[24 + hlen : start] == bytes(start - 24 - hlen)
    sections = json.loads(header)["sections"]
    for i, (s, (name, _, data)) in enumerate(zip(sections, SECTIONS)):
        assert s["offset"] % 64 == 0
        assert raw[start + s["offset"] : start + s["offset"] + s["length"]] == data
        assert s["crc32c"] == _section_check(i, name, data)
    last = sections[-1]
    assert len(raw) == start + last["offset"] + last["length"]


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
        C.read_container(raw[:6] + struct.pack("<H", 3) + raw[8:])
    with pytest.raises(CorruptDataError):
        C.read_container(raw[:6] + struct.pack("<H", 0) + raw[8:])
    with pytest.raises(CorruptDataError, match="reserved"):
        C.read_container(raw[:20] + b"\x01" + raw[21:])
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
        b'{"version": 1, "meta": {"x": NaN}, "sections": []}',
        b'{"version": 1, "meta": {"x": "\xff"}, "sections": []}',
        b"[" * 100000 + b"]" * 100000,
    ],
)
def test_header_json_violations(raw_header):
    with pytest.raises(CorruptDataError):
        C.read_container(_craft(None, raw_header=raw_header))


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
    raw = bytearray(_bytes())
    hlen = struct.unpack_from("<Q", raw, 8)[0]
    if (24 + hlen) % 64:  # nonzero padding after the header
        raw[24 + hlen] = 1
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
