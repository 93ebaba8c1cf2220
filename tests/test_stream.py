"""Containers written section by section as they are encoded (lcckpt/format/stream.py), and
the chain's keyframes written that way."""

from __future__ import annotations

import io
import json
import os

import numpy as np
import pytest
import torch
from hypothesis import given, settings, strategies as st

import lcckpt
from lcckpt.chain import checkpointer as C
from lcckpt.format import stream as S
from lcckpt.format.container import read_container
from lcckpt.format.census import census
from lcckpt.format.header import FORMAT_VERSION, _inflate_header
from lcckpt.format.verify import verify_file

from helpers import same_bits


@settings(max_examples=60, deadline=None)
@given(st.recursive(st.none() | st.booleans() | st.integers() | st.text(max_size=20),
                    lambda c: st.lists(c, max_size=5) | st.dictionaries(st.text(max_size=8), c,
                                                                        max_size=5),
                    max_leaves=40),
       st.integers(0, 200_000))
def test_a_fitted_header_is_exactly_its_room_and_inflates_to_the_json(obj, extra):
    header = json.dumps({"v": obj}).encode()
    low = 6 + len(S._deflated(header)) + 4 + 5          # the least room it fits
    assert S.fit_header(header, low - 1) is None
    stored = S.fit_header(header, low + extra)
    assert len(stored) == low + extra
    text = _inflate_header(stored, FORMAT_VERSION)      # the reader's own inflate
    assert text[:len(header)] == header and not text[len(header):].strip()
    assert json.loads(text) == {"v": obj}


def _sections(rng, n):
    return [(f"s{i}", {"i": i, "codec": "lossless"} if i % 2 else {"i": i}, rng.integers(0, 256, int(rng.integers(0, 5000)),
                                            dtype=np.uint8).tobytes()) for i in range(n)]


@pytest.mark.parametrize("reserve", [0, 40, 1 << 16])
def test_spooled_and_held_sections_read_back_in_their_new_places(tmp_path, monkeypatch, reserve):
    monkeypatch.setattr(S, "MOVE_PIECE", 777)     # a header that outgrows its room moves many pieces
    rng = np.random.default_rng(reserve)
    secs = _sections(rng, 9)
    spool_first = [4, 0, 7, 2, 8]                # spooled in this order; the rest held
    path = tmp_path / "f.lcc"
    with open(path, "w+b") as f:
        stream = S.SectionStream(f, reserve)
        listed = list(secs)
        for i in spool_first:
            name, meta, data = secs[i]
            listed[i] = (name, meta, stream.spool(name, [data[:10], data[10:]], meta))
        seen = {}
        size = stream.finish({"tree": None}, listed, lambda meta, m: seen.update(m))
    assert size == os.path.getsize(path)
    order = spool_first + [i for i in range(9) if i not in spool_first]
    assert seen == {old: new for new, old in enumerate(order)}
    c = read_container(str(path))
    c.verify()
    for new, old in enumerate(order):
        assert c.sections[new]["name"] == secs[old][0] and c.sections[new]["meta"] == secs[old][1]
        assert bytes(c.data(new)) == secs[old][2]
    assert verify_file(path)["ok"]


def test_finish_refuses_a_list_that_misses_a_spooled_section(tmp_path):
    with open(tmp_path / "f", "w+b") as f:
        stream = S.SectionStream(f, 100)
        a = stream.spool("a", b"x", {})
        stream.spool("b", b"y", {})
        with pytest.raises(lcckpt.InvalidArgumentError, match="spooled"):
            stream.finish({}, [("a", {}, a)], lambda *_: None)


def _state():
    torch.manual_seed(0)
    w = torch.randn(300, 200)
    return {"model": {"w": w, "wt": w.t(), "b": torch.randn(200), "empty": torch.empty(0),
                      "ints": torch.arange(10), "h": torch.randn(64, 64).half()},
            "arr": np.arange(50, dtype=np.float32), "raw": b"hello", "step": 3,
            "tiny": [torch.randn(3) for _ in range(5)]}


def _step(state, k):
    m = dict(state["model"], w=state["model"]["w"] + 0.01 * k, b=state["model"]["b"] * 1.01)
    m["wt"] = m["w"].t()
    return dict(state, model=m, step=state["step"] + k)


def _check(a, b):
    if isinstance(a, dict):
        assert a.keys() == b.keys()
        for k in a:
            _check(a[k], b[k])
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b)
        for x, y in zip(a, b):
            _check(x, y)
    elif isinstance(a, torch.Tensor) and a.numel() == 0 == b.numel():
        assert a.dtype == b.dtype and a.shape == b.shape      # no bytes to compare
    elif isinstance(a, (torch.Tensor, np.ndarray)):
        assert same_bits(a, b)
    else:
        assert a == b


@pytest.mark.parametrize("room", [(8192, 160), (0, 0)])      # (0, 0): the header moves the data
def test_a_streamed_keyframe_restores_every_step_as_a_held_one(tmp_path, monkeypatch, room):
    states = [_state()]
    states += [_step(states[0], k) for k in (1, 2)]
    held = C.DeltaCheckpointer(tmp_path / "held")
    for k, s in enumerate(states):
        held.save(k, s)
    monkeypatch.setattr(S, "STREAM_ABOVE", 0)
    monkeypatch.setattr(S, "HEADER_ROOM", room[0])
    monkeypatch.setattr(S, "HEADER_ROOM_PER_TENSOR", room[1])
    streamed = C.DeltaCheckpointer(tmp_path / "streamed")
    for k, s in enumerate(states):
        streamed.save(k, s)
    assert [streamed.info(k)["kind"] for k in range(3)] == ["keyframe", "delta", "delta"]
    key = verify_file(streamed.path(0))
    assert key["ok"] and key["header_compressed"], key["error"]
    for k in range(3):       # the same references: the same deltas, the same restores
        _check(streamed.load(k), held.load(k))
    _check(lcckpt.load(streamed.path(0)), states[0])


def test_a_keyframe_that_fails_midway_leaves_nothing_and_the_next_save_works(tmp_path, monkeypatch):
    monkeypatch.setattr(S, "STREAM_ABOVE", 0)
    calls = []
    real = S.SectionStream.spool

    def failing(self, name, *args):
        calls.append(name)
        if len(calls) == 3:
            raise OSError(28, "No space left on device")
        return real(self, name, *args)
    monkeypatch.setattr(S.SectionStream, "spool", failing)
    ck = C.DeltaCheckpointer(tmp_path)
    with pytest.raises(lcckpt.StorageError, match="No space left"):
        ck.save(0, _state())
    assert os.listdir(tmp_path) == [".lcckpt-writer.lock"] or not os.listdir(tmp_path)
    monkeypatch.setattr(S.SectionStream, "spool", real)
    ck.save(0, _state())
    _check(ck.load(0), _state())


def test_only_large_states_stream_and_later_rooms_follow_the_last_need(tmp_path, monkeypatch):
    rooms = []
    real = S.SectionStream.__init__
    monkeypatch.setattr(S.SectionStream, "__init__",
                        lambda self, *a: (rooms.append(a[1]), real(self, *a))[1])
    s = _state()
    n, nbytes = census(s)
    assert n == 11 and nbytes == 4 * (2 * 300 * 200 + 200 + 15) + 8 * 10 + 2 * 64 * 64
    monkeypatch.setattr(S, "STREAM_ABOVE", nbytes + 1)
    held = C.DeltaCheckpointer(tmp_path / "held", keyframe_every=2)
    for k in range(6):
        held.save(k, _step(s, k))
    assert rooms == []
    monkeypatch.setattr(S, "STREAM_ABOVE", nbytes)
    ck = C.DeltaCheckpointer(tmp_path / "streamed", keyframe_every=2)
    needs = []
    for k in range(6):                     # keyframes 0, 2, 4, deltas 1, 3, 5
        ck.save(k, _step(s, k))
        needs.append(ck._header_need[k % 2 == 0])
    first = S.HEADER_ROOM + S.HEADER_ROOM_PER_TENSOR * n + 6 * (nbytes >> 18)   # windows
    kf = needs[0] * 3 // 2                 # the first delta's room: from the keyframe's need
    assert rooms == [first, kf + kf // 32] + [needs[k - 2] + needs[k - 2] // 32
                                              for k in range(2, 6)]
    for k in range(6):
        a, b = os.path.getsize(ck.path(k)), os.path.getsize(held.path(k))
        if k > 1:        # sized from the last one's header of its kind: a few bytes apart
            assert abs(a - b) <= needs[k - 2] // 32 + 32, (a, b)
        _check(ck.load(k), held.load(k))


def test_a_room_whose_spaces_would_pass_the_header_limit_shrinks(tmp_path, monkeypatch):
    monkeypatch.setattr(S, "MAX_HEADER_SIZE", 30_000)     # as if the room were near the limit
    monkeypatch.setattr(S, "MOVE_PIECE", 1000)
    secs = _sections(np.random.default_rng(1), 6)
    with open(tmp_path / "f", "w+b") as f:
        stream = S.SectionStream(f, 29_000)
        listed = [(n, m, stream.spool(n, d, m)) for n, m, d in secs]
        stream.finish({"pad": "x" * 2000}, listed, lambda *_: None)
    c = read_container(str(tmp_path / "f"))
    c.verify()
    assert c.header_bytes < 1000 and [bytes(c.data(i)) for i in range(6)] == [d for *_, d in secs]
    assert os.path.getsize(tmp_path / "f") == c.data_start + c.sections[-1]["offset"] + len(secs[-1][2])


@pytest.mark.parametrize("room", [(8192, 160), (0, 0)])
def test_a_streamed_merge_restores_what_the_chain_restored(tmp_path, monkeypatch, room):
    states = [_state()]
    states += [_step(states[0], k) for k in (1, 2, 3)]
    plain = C.DeltaCheckpointer(tmp_path / "plain")          # merged in memory
    for k, s in enumerate(states[:3]):
        plain.save(k, s)
    plain.merge(2)
    plain.save(3, states[3])
    ck = C.DeltaCheckpointer(tmp_path / "merged")
    for k, s in enumerate(states[:3]):
        ck.save(k, s)
    monkeypatch.setattr(S, "STREAM_ABOVE", 0)
    monkeypatch.setattr(S, "HEADER_ROOM", room[0])
    monkeypatch.setattr(S, "HEADER_ROOM_PER_TENSOR", room[1])
    spooled = []
    real = S.SectionStream.spool
    monkeypatch.setattr(S.SectionStream, "spool",
                        lambda self, name, *a: (spooled.append(name), real(self, name, *a))[1])
    ck.merge(2)
    assert ck.info(2)["kind"] == "keyframe" and len(spooled) == len(read_container(ck.path(2)))
    assert verify_file(ck.path(2))["ok"]
    _check(ck.load(2), plain.load(2))
    _check(C.DeltaCheckpointer(tmp_path / "merged").load(2), plain.load(2))   # from disk
    ck.save(3, states[3])       # a delta on the merged step (its movement counted from it)
    _check(ck.load(3), plain.load(3))


@pytest.mark.parametrize("compress", [False, True])
def test_a_large_save_streams_and_loads_the_same(tmp_path, monkeypatch, compress):
    s = _state()
    s["model"]["strided"] = s["model"]["w"][::2, 1:]        # a view: its storage span
    held = tmp_path / "held.lcc"
    lcckpt.save(s, held, compress=compress, metadata={"run": "a"})
    monkeypatch.setattr(S, "STREAM_ABOVE", 0)
    spooled = []
    real = S.SectionStream.spool
    monkeypatch.setattr(S.SectionStream, "spool",
                        lambda self, name, *a: (spooled.append(name), real(self, name, *a))[1])
    path = tmp_path / "streamed.lcc"
    lcckpt.save(s, path, compress=compress, metadata={"run": "a"})
    c = read_container(str(path))
    assert len(spooled) == len(c) and c.sections[-1]["name"] in ('obj["raw"]', 'obj["arr"]')
    _check(lcckpt.load(path), lcckpt.load(held))
    _check(lcckpt.load(path), s)
    assert lcckpt.read_metadata(path) == {"run": "a"}
    if not compress:                 # raw sections still map in place
        _check(lcckpt.load(path, mmap=True), s)
    spooled.clear()
    buf = io.BytesIO()               # a file object: written whole, as before
    lcckpt.save(s, buf, compress=compress)
    assert spooled == []


def test_a_write_that_fails_midway_fails_the_save_and_leaves_nothing(tmp_path, monkeypatch):
    monkeypatch.setattr(S, "STREAM_ABOVE", 0)
    calls = []
    real = S._write_all

    def failing(f, data):
        calls.append(1)
        if len(calls) == 4:
            raise OSError(5, "Input/output error")
        return real(f, data)
    monkeypatch.setattr(S, "_write_all", failing)
    with pytest.raises(lcckpt.StorageError, match="Input/output error"):
        lcckpt.save(_state(), tmp_path / "x.lcc")
    assert not os.listdir(tmp_path)
    ck = C.DeltaCheckpointer(tmp_path / "chain")
    calls.clear()
    with pytest.raises(lcckpt.StorageError, match="Input/output error"):
        ck.save(0, _state())
    assert os.listdir(tmp_path / "chain") in ([], [".lcckpt-writer.lock"])
    monkeypatch.setattr(S, "_write_all", real)
    ck.save(0, _state())
    _check(ck.load(0), _state())


def test_moving_the_sections_works_without_pread(tmp_path, monkeypatch):
    monkeypatch.delattr(os, "pread")
    monkeypatch.delattr(os, "pwrite")
    monkeypatch.setattr(S, "MOVE_PIECE", 500)
    secs = _sections(np.random.default_rng(3), 5)
    with open(tmp_path / "f", "w+b") as f:
        stream = S.SectionStream(f, 0)               # the header outgrows it: moved up
        stream.finish({}, [(n, m, stream.spool(n, d, m)) for n, m, d in secs], lambda *_: None)
    c = read_container(str(tmp_path / "f"))
    c.verify()
    assert [bytes(c.data(i)) for i in range(5)] == [d for *_, d in secs]


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_a_lazy_uniform_blob_is_the_eager_one_and_advances_the_same_reference(monkeypatch, dtype):
    """Coded a batch at a time and its escapes listed a range at a time (both made tiny
    here, so there are many), as a streamed file takes it: the same bytes, the same
    reference, once read to the end, and not before."""
    from lcckpt.codec import blob as B, dtypes, entropy
    from lcckpt.codec.config import CodecConfig
    from lcckpt.codec.tensor import encode_uniform
    from lcckpt.codec.uniform import uniform_quantize
    monkeypatch.setattr(entropy, "LAZY_BATCH", 700)
    monkeypatch.setattr(B, "ESCAPE_RANGE", 64)
    rng = np.random.default_rng(3)
    n = 50_000
    ref = rng.standard_normal(n).astype(dtype)
    u = ref + (1e-3 * rng.standard_normal(n)).astype(dtype)
    u[rng.choice(n, 300, replace=False)] += 10.0       # past the widest symbol: escapes
    cfg = CodecConfig(target=3e-5, chunk_size=1024)
    dt = dtypes.of(u)
    outs = []
    for lazy, count in ((False, None), (True, None), (True, entropy.uniform_modes("auto", 4))):
        uq = uniform_quantize(u, ref, cfg.target, cfg.chunk_size, count=count)
        assert uq.escapes >= 300 and (uq.sym is None) == (count is not None)
        r = ref.copy()
        parts, st = encode_uniform(uq, dt, u.shape, cfg, None, r, lazy=lazy)
        if lazy:
            assert isinstance(parts, B.LazyBlob) and np.array_equal(r, ref)   # nothing yet
            pieces = [bytes(p) for p in parts]
            assert len(pieces) > 20 and list(parts) == []         # read once
        else:
            pieces = [bytes(memoryview(p).cast("B")) for p in parts]
        blob = b"".join(pieces)
        assert len(blob) == B.nbytes(parts) == st.nbytes
        outs.append((blob, r))
    for blob, r in outs[1:]:
        assert blob == outs[0][0] and np.array_equal(r, outs[0][1])
    assert not np.array_equal(outs[1][1], ref)


@pytest.mark.parametrize("kind", ["dense", "sparse", "nonneg", "no-ref", "fp16"])
@pytest.mark.parametrize("share", [0.02, 0.3, 0.9])
def test_a_delta_that_holds_no_symbols_codes_the_held_ones_bytes(kind, share):
    """Quantized without holding its symbols (each chunk's quantized again as it is
    coded, the coder's counts taken by the quantizing pass): the same blob, bit for bit,
    and the same reference, across symbol widths, the grouped, runs and const modes,
    escapes, the floor of a tensor without negative values and fp16's limit."""
    from lcckpt.codec import blob as B, dtypes, entropy
    from lcckpt.codec.config import CodecConfig
    from lcckpt.codec.tensor import encode_uniform
    from lcckpt.codec.uniform import uniform_quantize
    rng = np.random.default_rng(int(share * 100) + len(kind))
    n = 3 * 4096 + 777                                  # a ragged last chunk
    ref = rng.standard_normal(n).astype(np.float32)
    d = (0.01 * rng.laplace(size=n)).astype(np.float32)
    if kind == "sparse":
        d[rng.random(n) < 0.95] = 0
    d[::500] *= 300                                     # escapes at fine steps
    u = ref + d
    limit, dt = None, dtypes.of(u)
    if kind == "nonneg":
        u, ref = np.abs(u), np.abs(ref)
    elif kind == "fp16":
        u, ref = u * 3e4, ref * 3e4                     # near fp16's largest value
        limit, dt = 65504.0, dtypes.BY_NAME["F16"]
    if kind == "no-ref":
        ref, target = None, share
    else:
        target = float(share * np.linalg.norm(u - ref) / np.linalg.norm(u))
    cfg = CodecConfig(target=target, chunk_size=4096)
    outs = []
    for count in (None, entropy.uniform_modes("auto", 4)):
        uq = uniform_quantize(u, ref, target, 4096, limit, count=count)
        r = None if ref is None else ref.copy()
        parts, st = encode_uniform(uq, dt, u.shape, cfg, None, r, lazy=True)
        outs.append((b"".join(bytes(p) for p in parts), r, st.chunk_modes))
    assert outs[0][0] == outs[1][0]
    assert ref is None or np.array_equal(outs[0][1], outs[1][1])
    with pytest.raises(ValueError, match="lazily"):       # nothing to code it from at once
        encode_uniform(uniform_quantize(u, ref, target, 4096, limit,
                                        count=entropy.uniform_modes("auto", 4)),
                       dt, u.shape, cfg, None, None if ref is None else ref.copy())
    assert B.nbytes(parts) == len(outs[1][0])


def test_a_streamed_delta_holds_no_coded_tensor_and_loads_as_a_held_one(tmp_path, monkeypatch):
    """A large state's delta is coded while the file takes it: each uniform blob a
    LazyBlob read to its end by the file, its large tensors' symbols never held, and the
    chain loads bit for bit as one written whole."""
    from lcckpt.codec import blob as B, entropy, tensor as T
    monkeypatch.setattr(entropy, "LAZY_BATCH", 4096)
    monkeypatch.setattr(T, "HELD_SYMBOLS", 2000)
    s = _state()
    _, nbytes = census(s)
    made, free = [], []
    real = B.LazyBlob.__init__
    monkeypatch.setattr(B.LazyBlob, "__init__",
                        lambda self, *a: (made.append(self), real(self, *a))[1])
    quantize = T.uniform_quantize
    monkeypatch.setattr(T, "uniform_quantize", lambda *a, **k: (
        free.append(k["count"] is not None), quantize(*a, **k))[1])
    held = C.DeltaCheckpointer(tmp_path / "held")
    monkeypatch.setattr(S, "STREAM_ABOVE", nbytes)
    ck = C.DeltaCheckpointer(tmp_path / "streamed")
    for k in range(4):
        ck.save(k, _step(s, k))
        seen = len(made)
        monkeypatch.setattr(S, "STREAM_ABOVE", nbytes + 1)
        held.save(k, _step(s, k))                        # written whole: nothing lazy
        assert len(made) == seen
        monkeypatch.setattr(S, "STREAM_ABOVE", nbytes)
    assert len(made) >= 3 and len(made) % 3 == 0         # each delta's uniform blobs
    assert all(b._it is not None and next(b._it, None) is None for b in made)   # read out
    assert any(free) and not all(free)          # the largest streamed tensors held none
    for k in range(4):
        _check(ck.load(k), held.load(k))


def test_a_streamed_delta_that_fails_midway_leaves_the_chain_whole(tmp_path, monkeypatch):
    """A disk that fills while a lazy delta is being coded into the file: its reference
    had advanced over part of the tensor, so the writer resyncs from disk; the step is
    absent, and the next save continues a chain that restores as one never interrupted."""
    from lcckpt.codec import entropy
    monkeypatch.setattr(S, "STREAM_ABOVE", 0)
    monkeypatch.setattr(entropy, "LAZY_BATCH", 2048)       # many batches per tensor
    s = _state()
    writes = []
    real_write = S._write_all

    def failing(f, data):
        writes.append(memoryview(data).nbytes)
        if armed and len(writes) == 6:
            raise OSError(28, "No space left on device")
        return real_write(f, data)
    monkeypatch.setattr(S, "_write_all", failing)
    armed = False
    ck, held = C.DeltaCheckpointer(tmp_path / "ck"), C.DeltaCheckpointer(tmp_path / "held")
    for k in range(2):
        ck.save(k, _step(s, k))
        held.save(k, _step(s, k))
    armed, writes[:] = True, []
    with pytest.raises(lcckpt.StorageError, match="No space left"):
        ck.save(2, _step(s, 2))
    assert ck.steps() == [0, 1] and len(writes) == 6
    armed = False
    for k in (2, 3):
        ck.save(k, _step(s, k))
        held.save(k, _step(s, k))
    for k in range(4):
        _check(ck.load(k), held.load(k))
