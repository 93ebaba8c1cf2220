"""A large keyframe is read as it is decoded (lcckpt/codec/streamed.py): the same
restores as reading it whole, damage reported as on that path, and a keyframe whose
chain's files were closed still decodes."""

import gc
import os

import numpy as np
import pytest
import torch

import lcckpt
from lcckpt.format import sections
from lcckpt.codec import streamed
from lcckpt.errors import BrokenChainError, ChecksumError, TruncatedError
from lcckpt.format.container import read_container

N = 3_000_000        # ~11 MB of fp32 keyframe: above STREAM_MIN
KEY = 'obj["w"]'


def _chain(d, deltas=2):
    g = torch.Generator().manual_seed(0)
    w = torch.randn(N, generator=g) * 0.02
    ck = lcckpt.DeltaCheckpointer(d)
    states = []
    for step in range(deltas + 1):
        if step:
            w = w + torch.randn(N, generator=g) * 1e-4
        state = {"w": w, "b": torch.randn(300, generator=g)}
        ck.save(step, state)
        states.append(state)
    return ck, states


def _loads(ck, step, monkeypatch, stream: bool):
    monkeypatch.setattr(sections, "STREAM_MIN", streamed.STREAM_MIN if stream else 1 << 62)
    seen = []
    real = streamed.StreamedBlob.verify
    monkeypatch.setattr(streamed.StreamedBlob, "verify",
                        lambda self: seen.append(self.what) or real(self))
    out = ck.load(step)
    assert seen == ([KEY] if stream else [])
    return out


@pytest.mark.parametrize("step", [0, 2])
def test_a_streamed_keyframe_restores_what_a_whole_read_does(tmp_path, monkeypatch, step):
    ck, states = _chain(tmp_path)
    with read_container(ck.path(0)) as c:
        assert c.sections[c.index(KEY)]["length"] >= streamed.STREAM_MIN
    a = _loads(ck, step, monkeypatch, stream=True)
    b = _loads(ck, step, monkeypatch, stream=False)
    assert torch.equal(a["w"], b["w"]) and torch.equal(a["b"], b["b"])
    if step == 0:
        assert torch.equal(a["w"], states[0]["w"])


def _damage(path, where: int, byte: int = 0x5A):
    with open(path, "r+b") as f:
        f.seek(where)
        old = f.read(1)[0]
        f.seek(where)
        f.write(bytes([old ^ byte]))


def _payload_at(path) -> int:
    """A file offset inside the keyframe section's payload (past its blob header)."""
    with read_container(path) as c:
        i = c.index(KEY)
        start = c.data_start + c.sections[i]["offset"]
        part = c.part_reader(i)
        p = streamed.read_header(part.read, part.length)
        part.close()
    return start + p.payload_base + (c.sections[i]["length"] - p.payload_base) // 2


def test_damage_in_a_streamed_keyframe_is_a_checksum_error(tmp_path, monkeypatch):
    ck, _ = _chain(tmp_path)
    _damage(ck.path(0), _payload_at(ck.path(0)))
    with pytest.raises(ChecksumError, match="payload checksum"):
        _loads(ck, 0, monkeypatch, stream=True)
    with pytest.raises(BrokenChainError) as e:
        ck.load(2)
    assert isinstance(e.value.__cause__, ChecksumError)


def test_damage_that_stops_the_decode_is_a_checksum_error(tmp_path):
    """Every byte of a chunk's exponent stream garbled: the decode itself fails, and the
    whole payload's CRC names the damage."""
    ck, _ = _chain(tmp_path)
    path = ck.path(0)
    with read_container(path) as c:
        i = c.index(KEY)
        part = c.part_reader(i)
        p = streamed.read_header(part.read, part.length)
        part.close()
        start = c.data_start + c.sections[i]["offset"]
    (off, n), = streamed.chunk_spans(p, 0, 1)[-1:]      # the top (coded) plane of chunk 0
    with open(path, "r+b") as f:
        f.seek(start + off)
        f.write(bytes(n))
    with pytest.raises(ChecksumError):
        ck.load(0)


def test_a_truncated_streamed_keyframe(tmp_path):
    ck, _ = _chain(tmp_path, deltas=0)
    size = os.path.getsize(ck.path(0))
    with open(ck.path(0), "r+b") as f:
        f.truncate(size - 4096)
    with pytest.raises((TruncatedError, ChecksumError)):
        ck.load(0)


def test_a_keyframe_decoded_after_its_files_were_closed(tmp_path):
    """A writer reopening a chain restores its references without building the state:
    the keyframe waits, undecoded, until the next delta needs it, after the restore
    closed the chain's files. Its own descriptor still reads it."""
    ck, states = _chain(tmp_path)
    ck.close()
    again = lcckpt.DeltaCheckpointer(tmp_path)
    w = states[-1]["w"] + 1e-4
    again.save(3, {"w": w, "b": states[-1]["b"]})
    got = again.load(3)
    assert np.abs(got["w"].numpy() - w.numpy()).max() < 1e-3
    fresh = lcckpt.DeltaCheckpointer(tmp_path).load(3)
    assert torch.equal(fresh["w"], got["w"])


def test_no_descriptor_is_left_open_and_none_left_to_take_is_no_error(tmp_path, monkeypatch):
    """Each file's spans share one duplicate descriptor, closed once they are done; where
    none can be taken (EMFILE), the keyframe is read whole, as before."""
    ck, _ = _chain(tmp_path)

    def fds():          # this chain's files held open once garbage is collected (a
        gc.collect()    # load's descriptors otherwise close when the collector gets to
        held = []       # them, and the process's others when an earlier test's do)
        for fd in os.listdir("/proc/self/fd"):
            try:
                held.append(os.readlink(f"/proc/self/fd/{fd}"))
            except OSError:                 # closed since it was listed
                pass
        return sorted(h for h in held if h.startswith(str(tmp_path)))
    ck.load(2)
    before = fds()
    a = _loads(ck, 2, monkeypatch, stream=True)
    assert fds() == before
    import errno
    from lcckpt.format import sources

    def no_more(fd):
        raise OSError(errno.EMFILE, "Too many open files")
    monkeypatch.setattr(sources.os, "dup", no_more)
    made = []
    real = streamed.StreamedBlob.__init__
    monkeypatch.setattr(streamed.StreamedBlob, "__init__",
                        lambda self, *args: made.append(1) or real(self, *args))
    b = ck.load(2)                                     # STREAM_MIN as shipped
    assert made == [] and torch.equal(a["w"], b["w"])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.int64])
def test_lcckpt_load_streams_a_large_lossless_section(tmp_path, monkeypatch, dtype):
    """``lcckpt.load`` of a compressed file decodes a large lossless section as it reads
    it, straight into the tensor: the same values as a whole read; damage raises."""
    g = torch.Generator().manual_seed(3)
    n = 8_000_000 if dtype in (torch.bfloat16, torch.float16) else N
    x = (torch.randn(n, generator=g) * 3).to(dtype) if dtype.is_floating_point \
        else torch.randint(-2**40, 2**40, (n,), generator=g)
    path = tmp_path / "x.lc"
    lcckpt.save({"x": x, "small": torch.ones(3)}, path, compress=True)
    with read_container(path) as c:
        assert c.sections[c.index('obj["x"]')]["length"] >= streamed.STREAM_MIN
    made = []
    real = streamed.StreamedBlob.verify
    monkeypatch.setattr(streamed.StreamedBlob, "verify",
                        lambda self: made.append(self.what) or real(self))
    got = lcckpt.load(path)
    assert made == ['obj["x"]'] and got["x"].dtype == dtype and torch.equal(got["x"], x)
    monkeypatch.setattr(sections, "STREAM_MIN", 1 << 62)
    assert torch.equal(lcckpt.load(path)["x"], x)
    monkeypatch.setattr(sections, "STREAM_MIN", streamed.STREAM_MIN)
    with read_container(path) as c:
        i = c.index('obj["x"]')
        at = c.data_start + c.sections[i]["offset"] + c.sections[i]["length"] // 2
    _damage(path, at)
    with pytest.raises(ChecksumError):
        lcckpt.load(path)


# ------------------------------------------------------------- deltas read when replayed


def _counting_deferred(monkeypatch, defer_min=sections.DEFER_MIN):
    monkeypatch.setattr(sections, "DEFER_MIN", defer_min)
    loads = []
    real = streamed.DeferredBlob.load
    monkeypatch.setattr(streamed.DeferredBlob, "load",
                        lambda self: loads.append(self.origin[0]) or real(self))
    return loads


@pytest.mark.parametrize("step", [1, 2])
def test_a_large_delta_is_read_when_replayed_and_restores_what_a_whole_read_does(
        tmp_path, monkeypatch, step):
    """A delta section of DEFER_MIN bytes or more is not read when its file is walked but
    when its tensor is replayed (every delta of that tensor then); the values are those
    of reading every section whole, bit for bit."""
    ck, states = _chain(tmp_path)
    with read_container(ck.path(1)) as c:
        assert c.sections[c.index(KEY)]["length"] >= sections.DEFER_MIN
    loads = _counting_deferred(monkeypatch)
    a = ck.load(step)
    assert sorted(loads) == list(range(1, step + 1))     # the large "w"'s deltas, once each
    _counting_deferred(monkeypatch, 1 << 62)
    b = ck.load(step)
    assert torch.equal(a["w"], b["w"]) and torch.equal(a["b"], b["b"])
    assert np.abs(a["w"].numpy() - states[step]["w"].numpy()).max() < 1e-3


def test_a_writer_reopening_its_chain_reads_its_deferred_deltas_after_the_files_closed(
        tmp_path, monkeypatch):
    """A reopened writer's references wait, deltas unread, until its next save needs
    them, after the restore closed the chain's files; what it writes is what a writer
    that read every section whole writes."""
    outs, shipped = [], sections.DEFER_MIN
    for defer_min in (shipped, 1 << 62):
        d = tmp_path / str(defer_min)
        ck, states = _chain(d)
        ck.close()
        loads = _counting_deferred(monkeypatch, defer_min)
        again = lcckpt.DeltaCheckpointer(d)
        again.save(3, {"w": states[-1]["w"] + 1e-4, "b": states[-1]["b"]})
        again.close()
        assert sorted(loads) == ([1, 2] if defer_min == shipped else [])
        outs.append(open(again.path(3), "rb").read())
    assert outs[0] == outs[1]


def test_damage_in_a_deferred_delta_names_its_file(tmp_path):
    ck, _ = _chain(tmp_path)
    with read_container(ck.path(1)) as c:
        i = c.index(KEY)
        where = c.data_start + c.sections[i]["offset"] + c.sections[i]["length"] // 2
    _damage(ck.path(1), where)
    with pytest.raises(ChecksumError, match="checksum"):
        ck.load(1)
    with pytest.raises(BrokenChainError, match="step-000000000001") as e:
        ck.load(2)
    assert isinstance(e.value.__cause__, ChecksumError)


@pytest.mark.parametrize("where", ["header", "tail"])
def test_a_damaged_or_cut_deferred_delta_is_an_error_not_a_crash(tmp_path, where):
    """Its header is read and checked when its file is walked; a file cut short after
    that fails when its bytes are read, naming the file."""
    ck, _ = _chain(tmp_path)
    with read_container(ck.path(2)) as c:
        i = c.index(KEY)
        start = c.data_start + c.sections[i]["offset"]
        length = c.sections[i]["length"]
    assert length >= sections.DEFER_MIN
    if where == "header":
        _damage(ck.path(2), start + 12)
        with pytest.raises((ChecksumError, lcckpt.errors.CorruptDataError)):
            ck.load(2)
    else:                       # walked (as a reopened writer does), then cut short
        from lcckpt.chain import restore as restore_mod
        _, _, tracks = restore_mod.restore(ck._dir, 2, build=False, max_bytes=None)
        assert any(isinstance(b, streamed.DeferredBlob) for b, _ in tracks[KEY].pending)
        with open(ck.path(2), "r+b") as f:
            f.truncate(start + length // 2)
        with pytest.raises(TruncatedError) as e:
            tracks[KEY].ref
        assert e.value.origin[0] == 2                      # it names the file it came from
    assert torch.isfinite(ck.load(1)["w"]).all()          # the step before still loads


def test_a_reopened_writer_that_finds_damage_in_a_late_read_blob_starts_a_keyframe(tmp_path):
    """Damage in a deferred delta (or a streamed keyframe) of the chain a reopened writer
    continues is found when the writer rebuilds its references, before its save: it warns
    and writes a keyframe, as for any damaged chain, instead of failing every save."""
    for damaged in (1, 0):                     # a deferred delta; the streamed keyframe
        d = tmp_path / str(damaged)
        ck, states = _chain(d)
        ck.close()
        path = ck.path(damaged)
        with read_container(path) as c:
            i = c.index(KEY)
            where = c.data_start + c.sections[i]["offset"] + c.sections[i]["length"] // 2
        _damage(path, where)
        w = lcckpt.DeltaCheckpointer(d)
        with pytest.warns(RuntimeWarning, match="cannot continue the delta chain"):
            w.save(3, states[-1])
        assert w.info(3)["kind"] == "keyframe"
        assert torch.equal(w.load(3)["w"], states[-1]["w"])
        w.close()


def test_a_replay_that_builds_nothing_still_decodes_every_delta(tmp_path, monkeypatch):
    """``replay(build=False)`` (what ``lcckpt verify`` walks a chain with) decodes each
    step's deltas as it goes, reading each deferred one once, not only their headers."""
    ck, _ = _chain(tmp_path)
    loads = _counting_deferred(monkeypatch)
    assert [s for s, obj in ck.replay(build=False)] == [0, 1, 2]
    assert loads == [1, 2]


# ------------------------------------------------------------- deltas read chunk by chunk


def _jumpy_chain(d, deltas: int, bits=None):
    """A chain whose deltas of "w" are deferred; with the default quantizer a few
    elements jump far enough each step to be escapes."""
    g = torch.Generator().manual_seed(1)
    w = torch.randn(N, generator=g) * 0.02
    ck = lcckpt.DeltaCheckpointer(d, bits=bits)
    states = []
    for step in range(deltas + 1):
        if step:
            w = w + torch.randn(N, generator=g) * 1e-4
            if bits is None:
                w[step * 7::100_003] += 0.01
        state = {"w": w.clone(), "b": torch.randn(300, generator=g)}
        ck.save(step, state)
        states.append(state)
    return ck, states


def _chunked(monkeypatch, on: bool):
    """Deferred deltas read chunk by chunk (``on``) or whole; the files whose delta was
    read chunk by chunk, as each is vouched for."""
    from lcckpt.codec import replay as replay_mod
    monkeypatch.setattr(replay_mod, "BY_CHUNK_MIN", 0 if on else 1 << 62)
    done = []
    real = streamed.DeltaChunks.finish
    monkeypatch.setattr(streamed.DeltaChunks, "finish",
                        lambda self: done.append(self.blob.origin[0]) or real(self))
    return done


@pytest.mark.parametrize("deltas,bits", [(2, None), (5, None), (3, 2)])
def test_deltas_read_chunk_by_chunk_restore_what_whole_reads_do(tmp_path, monkeypatch,
                                                                 deltas, bits):
    """Each replay task reads its own chunks of every deferred delta (two deltas: four
    chunks a task; five: one chunk, the deltas side by side; LC mode's blobs too), none
    read whole; the values are those of reading each section whole, bit for bit, the
    escapes included."""
    ck, states = _jumpy_chain(tmp_path, deltas, bits)
    if bits is None:
        with read_container(ck.path(1)) as c:
            from lcckpt.codec.blob import parse
            assert parse(c.data(c.index(KEY)))[1].esc_idx.size > 0
    done = _chunked(monkeypatch, True)
    loads = _counting_deferred(monkeypatch, 1 << 12)       # LC mode's are smaller
    a = ck.load(deltas)
    assert sorted(done) == list(range(1, deltas + 1)) and loads == []
    _chunked(monkeypatch, False)
    b = ck.load(deltas)
    assert torch.equal(a["w"], b["w"]) and torch.equal(a["b"], b["b"])
    assert np.abs(a["w"].numpy() - states[deltas]["w"].numpy()).max() < 2e-2
    into = {"w": torch.zeros(N), "b": torch.zeros(300)}
    _chunked(monkeypatch, True)
    assert torch.equal(ck.load(deltas, into=into)["w"], a["w"]) and torch.equal(into["w"], a["w"])


def _delta_section(path):
    """(file offset of the section, its blob's parsed header, the section's length)."""
    with read_container(path) as c:
        i = c.index(KEY)
        part = c.part_reader(i)
        p = streamed.read_header(part.read, part.length)
        part.close()
        return c.data_start + c.sections[i]["offset"], p, c.sections[i]["length"]


@pytest.mark.parametrize("where", ["payload", "escape value", "zeroed chunk"])
def test_damage_in_a_delta_read_chunk_by_chunk_is_a_checksum_error(tmp_path, monkeypatch,
                                                                    where):
    """The blob's payload CRC, combined from every chunk read and the escapes, vouches
    for the bytes: one flipped bit of an escape's value decodes without complaint and
    is still caught; a chunk that no longer decodes is reported as damage too."""
    ck, _ = _jumpy_chain(tmp_path, 2)
    start, p, length = _delta_section(ck.path(1))
    payload = int(p.layouts[0].offsets[-1])
    with open(ck.path(1), "r+b") as f:
        if where == "zeroed chunk":
            lo, hi = (int(x) for x in p.layouts[0].offsets[1:3])
            f.seek(start + p.payload_base + lo)
            f.write(bytes(hi - lo))
    if where == "payload":
        _damage(ck.path(1), start + p.payload_base + payload // 2, 0x01)
    elif where == "escape value":
        assert p.esc_idx.size > 0
        _damage(ck.path(1), start + length - 4 - 2, 0x01)   # low mantissa bits of the last
    _chunked(monkeypatch, True)
    with pytest.raises(ChecksumError, match="step-000000000001.*payload checksum"):
        ck.load(1)
    with pytest.raises(BrokenChainError, match="step-000000000001"):
        ck.load(2)
    assert torch.isfinite(ck.load(0)["w"]).all()
