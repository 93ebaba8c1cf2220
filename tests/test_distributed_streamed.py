"""Large lossless items of a distributed checkpoint are decoded as they are read
(lcckpt/distributed/blobs.py): the same values as a whole read, damage still caught."""

import os

import pytest
import torch

import lcckpt.distributed as ld
from lcckpt.codec.streamed import STREAM_MIN, StreamedBlob
from lcckpt.distributed import plain, storage
from lcckpt.errors import CorruptDataError


def _state():
    g = torch.Generator().manual_seed(0)
    return {"w": torch.randn(3_000_000, generator=g),                     # ~10 MB coded
            "h": torch.randn(4_000, 2_000, generator=g).bfloat16(),       # ~10 MB coded
            "small": torch.randn(100, generator=g), "ids": torch.arange(5)}


@pytest.fixture
def spy(monkeypatch):
    """Which blobs came back streamed, and a switch that turns streaming off."""
    seen, state = [], {"off": False}
    real = storage.streamed_blob

    def wrapped(*a, **k):
        got = None if state["off"] else real(*a, **k)
        seen.append(isinstance(got, StreamedBlob))
        return got
    monkeypatch.setattr(storage, "streamed_blob", wrapped)
    return seen, state


def _chain(directory, seed: int, steps: int):
    """A distributed chain of a 3M-element tensor drifting by 1e-3 a step."""
    g = torch.Generator().manual_seed(seed)
    state = {"w": torch.randn(3_000_000, generator=g)}
    ck = ld.DistributedCheckpointer(directory)
    for step in range(steps):
        state["w"] += 1e-3 * torch.randn(3_000_000, generator=g)
        ck.save(step, state)
    return ck


def _zeros(state):
    return {k: torch.zeros_like(v) for k, v in state.items()}


def test_large_exact_items_stream_into_their_targets_bit_for_bit(tmp_path, spy, monkeypatch):
    seen, switch = spy
    state = _state()
    ld.save(state, tmp_path / "c")
    readers = []

    class Counted(storage.CompressedReader):
        def __init__(self, *a, **k):
            super().__init__(*a, **k)
            readers.append(self)
    monkeypatch.setattr(plain, "CompressedReader", Counted)   # the reader load picks
    target = _zeros(state)
    ld.load(target, tmp_path / "c")
    assert seen.count(True) == 2                        # w and h; the rest read whole
    assert all(torch.equal(target[k], state[k]) for k in state)
    switch["off"] = True                                # the same load, read whole
    whole = _zeros(state)
    ld.load(whole, tmp_path / "c")
    assert all(torch.equal(whole[k], state[k]) for k in state)
    assert readers[0].bytes_read == readers[1].bytes_read > 0   # each byte counted once


def test_a_target_of_another_dtype_gets_a_streamed_item_too(tmp_path, spy):
    seen, _ = spy
    state = _state()
    ld.save(state, tmp_path / "c")
    target = {**_zeros(state), "w": torch.zeros(3_000_000, dtype=torch.float64)}
    ld.load(target, tmp_path / "c")
    assert seen.count(True) == 2 and torch.equal(target["w"], state["w"].double())


def test_a_chains_large_keyframe_streams_and_restores_what_a_whole_read_does(tmp_path, spy):
    seen, switch = spy
    ck = _chain(tmp_path, seed=1, steps=3)
    got = {"w": torch.zeros(3_000_000)}
    assert ck.load(got) == 2
    assert True in seen
    seen.clear()
    switch["off"] = True
    whole = {"w": torch.zeros(3_000_000)}
    ck.load(whole)
    assert not any(seen) and torch.equal(got["w"], whole["w"])
    ref = next(iter(ck.references().values()))
    assert torch.equal(got["w"], ref)


def test_damage_in_a_streamed_item_is_caught(tmp_path, spy):
    seen, _ = spy
    state = _state()
    ld.save(state, tmp_path / "c")
    name = next(n for n in os.listdir(tmp_path / "c") if n.endswith(".distcp"))
    path = tmp_path / "c" / name
    size = path.stat().st_size
    assert size > 2 * STREAM_MIN
    with open(path, "r+b") as f:                        # a byte in the middle of the data
        f.seek(size // 3)
        b = f.read(1)
        f.seek(size // 3)
        f.write(bytes([b[0] ^ 0x10]))
    with pytest.raises(CorruptDataError):
        ld.load(_zeros(state), tmp_path / "c")
    assert True in seen


def test_a_streamed_blob_of_another_shape_than_the_metadata_says_is_refused(tmp_path):
    from lcckpt.codec.tensor import encode
    from lcckpt.distributed.blobs import streamed_blob
    from lcckpt.format.sections import decode_streamed
    x = torch.randn(3_000_000, generator=torch.Generator().manual_seed(2))
    blob = encode(x, lossless=True)
    path = tmp_path / "b.bin"
    path.write_bytes(b"\0" * 7 + blob)                  # at an offset, as in a data file
    got = streamed_blob(str(path), 7, len(blob), "F32", "w")
    assert isinstance(got, StreamedBlob)
    with pytest.raises(CorruptDataError, match="shape"):
        decode_streamed(got, torch.empty(1_000_000, 3))
    out = decode_streamed(streamed_blob(str(path), 7, len(blob), "F32", "w"),
                          torch.empty(3_000_000))
    assert torch.equal(out, x)
    assert streamed_blob(str(path), 7, len(blob), "BF16", "w") is None   # stored as F32
    assert streamed_blob(str(tmp_path / "gone"), 7, len(blob), "F32", "w") is None
    zc = torch.randn(1_500_000, dtype=torch.complex64, generator=torch.Generator().manual_seed(3))
    cblob = encode(zc, lossless=True)                   # not decoded in place: read whole
    path.write_bytes(b"\0" * 7 + cblob)
    assert len(cblob) >= 8 << 20 and streamed_blob(str(path), 7, len(cblob), "C64", "w") is None


@pytest.mark.parametrize("by_chunk", [True, False])
def test_a_chains_large_deltas_are_read_when_replayed(tmp_path, monkeypatch, by_chunk):
    """A distributed chain's delta blobs of DEFER_MIN bytes or more in a local file are
    read when their item is replayed (chunk by chunk by its tasks, or whole): the values
    of reading them whole up front; a damaged delta is still caught."""
    from lcckpt.codec import replay as replay_mod, streamed
    from lcckpt.distributed import blobs
    ck = _chain(tmp_path, seed=4, steps=4)
    monkeypatch.setattr(replay_mod, "BY_CHUNK_MIN", 0 if by_chunk else 1 << 62)
    made, finished = [], []
    real, fin = blobs.deferred_blob, streamed.DeltaChunks.finish
    monkeypatch.setattr(storage, "deferred_blob", lambda *a: made.append(1) or real(*a))
    monkeypatch.setattr(streamed.DeltaChunks, "finish",
                        lambda self: finished.append(1) or fin(self))
    got = {"w": torch.zeros(3_000_000)}
    assert ck.load(got) == 3
    assert len(made) == 3 and len(finished) == (3 if by_chunk else 0)
    monkeypatch.setattr(blobs, "DEFER_MIN", 1 << 62)
    whole = {"w": torch.zeros(3_000_000)}
    ck.load(whole)
    assert torch.equal(got["w"], whole["w"])
    assert torch.equal(got["w"], next(iter(ck.references().values())))
    monkeypatch.setattr(blobs, "DEFER_MIN", 1 << 20)
    step2 = tmp_path / "step_0000000002"
    path = step2 / next(n for n in os.listdir(step2) if n.endswith(".distcp"))
    size = path.stat().st_size
    with open(path, "r+b") as f:                        # a byte in the middle of the delta
        f.seek(size // 2)
        b = f.read(1)
        f.seek(size // 2)
        f.write(bytes([b[0] ^ 0x01]))
    made.clear()
    with pytest.raises(CorruptDataError):
        ck.load({"w": torch.zeros(3_000_000)})
    assert made
