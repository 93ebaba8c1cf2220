"""A keyframe save overlaps its work with the file's write: the reference copy runs
while the file is written, and writeback starts before the closing fsync. These tests
pin what must still hold: the references are complete before ``save`` returns, the bytes
on disk are the bytes asked for, and a platform without the writeback call still works."""

import os

import numpy as np
import torch

import lcckpt
from lcckpt.util import durable as _durable, memory as _memory
from lcckpt.format.container import read_container, write_container
from lcckpt.codec.delta import DeltaEncoder


def test_deferred_reference_copy_is_made_on_first_use_or_settle():
    x = np.arange(10_000, dtype=np.float32)
    enc = DeltaEncoder(bits=2)
    enc.encode_parts(x, defer_copy=True)
    assert enc._copy is not None and enc._copy[2] is None        # noted, not made
    assert np.array_equal(enc.ref, x) and enc._copy is None      # made on first use
    y = x + 1
    enc.encode_parts(y, keyframe=True, defer_copy=True)
    enc.start_copy()
    enc.settle()
    assert enc._copy is None and np.array_equal(enc.ref, y) and enc.ref is not y


def test_chain_save_returns_with_every_reference_copied(tmp_path):
    w = torch.randn(300_000)
    ck = lcckpt.DeltaCheckpointer(tmp_path, keyframe_every=2)
    ck.save(1, {"w": w})
    assert all(e._copy is None for e in ck._encoders.values())
    saved = w.clone()
    w.add_(1.0)                                   # the caller changes its tensor in place
    assert torch.equal(torch.from_numpy(ck._encoders['obj["w"]'].ref), saved)
    ck.save(2, {"w": w})
    assert torch.equal(lcckpt.DeltaCheckpointer(tmp_path).load(1)["w"], saved)
    back = lcckpt.DeltaCheckpointer(tmp_path).load(2)["w"]
    assert float((back - w).norm() / w.norm()) < 0.05


def test_writeback_requests_cover_the_file_in_order(tmp_path, monkeypatch):
    calls = []
    monkeypatch.setattr(_durable, "_sync_range", lambda fd, off, n, flags: calls.append((off, n)) or 0)
    monkeypatch.setattr(_durable, "WRITEBACK_EVERY", 1000)
    rng = np.random.default_rng(0)
    parts = [rng.integers(0, 255, n, dtype=np.uint8) for n in (2500, 1, 999, 4000)]
    path = tmp_path / "f.lcc"
    size = write_container(path, [(f"s{i}", {}, p) for i, p in enumerate(parts)], {"k": 1})
    assert os.path.getsize(path) == size
    with read_container(str(path)) as c:
        for i, p in enumerate(parts):
            assert bytes(c.data(i)) == p.tobytes()
    assert calls and calls[0][0] == 0
    for (o1, n1), (o2, _) in zip(calls, calls[1:]):
        assert o2 == o1 + n1                      # contiguous, in order, no gaps
    assert calls[-1][0] + calls[-1][1] <= size


def test_a_failing_writeback_call_is_dropped_and_the_write_completes(tmp_path, monkeypatch):
    calls = []
    monkeypatch.setattr(_durable, "_sync_range", lambda *a: calls.append(a) or -1)
    monkeypatch.setattr(_durable, "WRITEBACK_EVERY", 100)
    data = np.arange(5000, dtype=np.uint8)
    path = tmp_path / "g.lcc"
    write_container(path, [("a", {}, data)], {})
    assert len(calls) == 1 and _durable._sync_range is None      # asked once, then not
    with read_container(str(path)) as c:
        assert bytes(c.data(0)) == data.tobytes()


def test_large_fresh_arrays_are_zeroed_writable_and_shaped():
    z = _memory.zeros(3 << 20, np.float32)        # past the threshold: faulted in ahead
    assert z.shape == (3 << 20,) and z.dtype == np.float32 and not z.any()
    e = _memory.empty((1 << 20, 3), np.float64)
    assert e.shape == (1 << 20, 3) and e.flags.c_contiguous and e.flags.writeable
    e[:] = 7.0
    assert float(e.sum()) == 7.0 * e.size
    t = torch.from_numpy(e)                       # torch shares the memory
    t[0, 0] = 1.0
    assert e[0, 0] == 1.0
    for make in (_memory.bulk_zeros, _memory.bulk_empty):   # 4 KiB pages when large
        b = make((1 << 19, 3), np.float32)
        assert b.shape == (1 << 19, 3) and b.flags.writeable and not b.any()
        b[-1, -1] = 2.0
        assert torch.from_numpy(b)[-1, -1] == 2.0
    assert _memory.bulk_zeros(5, np.int64).tolist() == [0] * 5
    small = _memory.zeros((7, 2), np.int16)
    assert small.dtype == np.int16 and small.shape == (7, 2) and not small.any()
    assert _memory.empty(0, np.uint8).size == 0
