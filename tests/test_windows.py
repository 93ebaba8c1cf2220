"""Checked part reads (lcckpt/format/windows.py): a section longer than 1 MiB carries the
CRC-32C of each 256 KiB window of its bytes, so a lazy slice checks what it reads."""

import base64
import json

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import lcckpt
from lcckpt.format import stream as _stream, windows as W
from lcckpt.format.container import read_container, write_container
from lcckpt.interop.reader import open as lc_open
from lcckpt.util.crc import Windows, crc32c, crc32c_piece


@settings(max_examples=60, deadline=None)
@given(st.binary(max_size=3000), st.lists(st.integers(1, 700), max_size=12),
       st.integers(2, 9))
def test_windows_fed_in_any_pieces_are_those_of_the_whole(data, cuts, log2):
    w, pos = Windows(log2), 0
    for k in cuts + [len(data)]:
        w.update(data[pos:pos + k])
        pos += k
    want = [crc32c_piece(data[a:a + (1 << log2)]) for a in range(0, len(data), 1 << log2)]
    assert w.finish().tolist() == want


@settings(max_examples=60, deadline=None)
@given(st.binary(max_size=3000), st.binary(min_size=1, max_size=40),
       st.lists(st.integers(1, 700), max_size=12), st.integers(2, 9))
def test_a_checksum_continued_from_the_windows_is_the_checksum_of_the_bytes(
        data, prefix, cuts, log2):
    """What lets a writer take a large section's checksum from its windows' CRCs."""
    w, pos = Windows(log2), 0
    for k in cuts + [len(data)]:
        w.update(data[pos:pos + k])
        pos += k
    seed = crc32c_piece(prefix)
    assert w.continued(seed) == crc32c(data, seed) == \
        crc32c_piece(prefix + data)


@pytest.mark.parametrize("n", [0, 1000, W.WINDOWED_ABOVE, W.WINDOWED_ABOVE + 1, 3 << 20])
def test_a_section_checksum_with_or_without_windows_is_the_same(n):
    data = np.random.default_rng(n).integers(0, 256, n, np.uint8)
    views = [memoryview(data[:n // 3]), memoryview(data[n // 3:])]
    crc, crcs = W.checksum(views, 77, n)
    assert crc == crc32c(data, 77) and (crcs is None) == (n <= W.WINDOWED_ABOVE)


def _big(tmp_path, **kw):
    x = torch.randn(3000, 256, generator=torch.Generator().manual_seed(0))    # 3 MB
    path = tmp_path / "a.lc"
    lcckpt.save({"x": x, "b": torch.ones(10)}, path, **kw)
    return x, path


@pytest.mark.parametrize("kw", [{}, {"compress": True}])
def test_large_sections_carry_their_windows_and_small_ones_none(tmp_path, kw):
    x, path = _big(tmp_path, **kw)
    with read_container(path) as c:
        big, small = (c.sections[c.index(n)] for n in ('obj["x"]', 'obj["b"]'))
        assert W.WINDOWS_KEY not in small["meta"]
        crcs = W.windows_of(big)
        data = bytes(c.data(c.index('obj["x"]')))
    assert crcs.tolist() == [crc32c_piece(data[a:a + (1 << 18)])
                             for a in range(0, len(data), 1 << 18)]
    assert torch.equal(lcckpt.load(path)["x"], x)


def test_a_streamed_save_writes_windows_and_its_slices_are_checked(tmp_path, monkeypatch):
    monkeypatch.setattr(_stream, "STREAM_ABOVE", 1)           # written as it is coded
    x, path = _big(tmp_path)
    with read_container(path) as c:
        s = c.sections[c.index('obj["x"]')]
        assert W.windows_of(s) is not None
        at = c.data_start + s["offset"] + 2_000_000
    raw = bytearray(path.read_bytes())
    raw[at] ^= 4
    path.write_bytes(raw)
    with lc_open(path) as f:
        assert torch.equal(f.get_slice("x")[:16], x[:16])
        with pytest.raises(lcckpt.ChecksumError, match="damaged"):
            f.get_slice("x")[2000:2010]


def _rewrite(path, change, monkeypatch):
    """``path`` written again with its sections' metas changed by ``change(metas)`` and
    kept as they are (the writer adds or drops no windows)."""
    with read_container(path) as c:
        sections = [(s["name"], dict(s["meta"]), bytes(c.data(i)))
                    for i, s in enumerate(c.sections)]
        meta = c.meta
    change({name: m for name, m, _ in sections})
    with monkeypatch.context() as m:
        m.setattr(W, "with_windows", lambda meta, length, crcs: meta)
        write_container(path, sections, meta)


@pytest.mark.parametrize("forged", ["not base64!", "AAAA", 7, ""])
def test_forged_windows_are_refused_by_a_slice_and_ignored_by_a_load(tmp_path, forged,
                                                                     monkeypatch):
    x, path = _big(tmp_path)
    _rewrite(path, lambda metas: metas['obj["x"]'].__setitem__(W.WINDOWS_KEY, forged),
             monkeypatch)
    with lc_open(path) as f, pytest.raises(lcckpt.CorruptDataError, match="window"):
        f.get_slice("x")[:4]
    assert torch.equal(lcckpt.load(path)["x"], x)


def test_a_file_written_before_windows_reads_large_slices_unchecked(tmp_path, monkeypatch):
    """An older writer's large section has no windows: a slice reads its rows as before
    (damage elsewhere unseen); a small section is still read whole and checked."""
    x, path = _big(tmp_path)
    _rewrite(path, lambda metas: [m.pop(W.WINDOWS_KEY, None) for m in metas.values()],
             monkeypatch)
    with read_container(path) as c:
        assert all(W.WINDOWS_KEY not in s["meta"] for s in c.sections)
        at = c.data_start + c.sections[c.index('obj["x"]')]["offset"] + 2_000_000
    raw = bytearray(path.read_bytes())
    raw[at] ^= 4
    path.write_bytes(raw)
    with lc_open(path) as f:
        assert torch.equal(f.get_slice("x")[:16], x[:16])
        assert not torch.equal(f.get_slice("x")[1950:2000], x[1950:2000])   # unchecked
        with pytest.raises(lcckpt.ChecksumError):
            f.get_tensor("x")


def test_copied_windows_are_recomputed_by_the_writer(tmp_path):
    """A section meta copied from another file (stale windows) is written with the
    windows of the bytes written, and a small section with none."""
    x, path = _big(tmp_path)
    with read_container(path) as c:
        i = c.index('obj["x"]')
        meta = dict(c.sections[i]["meta"])
    other = tmp_path / "b.lc"
    data = np.random.default_rng(1).integers(0, 256, 3 << 20, np.uint8).tobytes()
    write_container(other, [("big", meta, data), ("small", meta, data[:100])], {})
    with read_container(other) as c:
        assert W.windows_of(c.sections[0]).tolist() == \
            [crc32c_piece(data[a:a + (1 << 18)]) for a in range(0, len(data), 1 << 18)]
        assert W.WINDOWS_KEY not in c.sections[1]["meta"]


def test_verify_checks_the_windows_too(tmp_path, monkeypatch):
    """Windows that do not match the bytes (the section's own checksum right) fail a
    file's verify, which a load does not read them for."""
    from lcckpt.format.verify import verify_file
    x, path = _big(tmp_path)
    assert verify_file(path)["ok"]

    def shifted(metas):
        raw = bytearray(base64.b64decode(metas['obj["x"]'][W.WINDOWS_KEY]))
        raw[0] ^= 1
        metas['obj["x"]'][W.WINDOWS_KEY] = base64.b64encode(bytes(raw)).decode()
    _rewrite(path, shifted, monkeypatch)
    assert torch.equal(lcckpt.load(path)["x"], x)
    report = verify_file(path)
    assert not report["ok"] and "do not match" in json.dumps(report)
    with read_container(path) as c, pytest.raises(lcckpt.ChecksumError, match="do not match"):
        c.verify()
