"""Delta tracking: error feedback, bit-exact encoder/decoder references, keyframes."""

import warnings

import numpy as np
import pytest
import torch

import lcckpt


def _walk(n, steps, seed, dtype=np.float32):
    """A state that drifts like training: shrinking random steps, some frozen entries."""
    rng = np.random.default_rng(seed)
    u = rng.standard_normal(n).astype(dtype)
    frozen = rng.random(n) < 0.2
    for t in range(steps):
        step = rng.standard_normal(n) * (0.05 / np.sqrt(t + 1))
        step[frozen] = 0
        u = (u + step).astype(dtype)
        yield u.copy()


@pytest.mark.parametrize("coder", ["huffman", "auto"])
def test_thousand_step_chain_stays_bit_identical(coder):
    enc, dec = lcckpt.DeltaEncoder(bits=2, coder=coder, chunk_size=1024), lcckpt.DeltaDecoder()
    errs = []
    for u in _walk(3000, 1000, 0):
        y = dec.decode(enc.encode(u))
        ref = enc.reference()
        assert y.tobytes() == ref.tobytes()           # decoder == encoder's reference
        errs.append(np.linalg.norm(u - y) / np.linalg.norm(u))
    # error feedback: the error stays bounded instead of accumulating over the chain
    assert max(errs[500:]) <= 2 * max(errs[:500]) and errs[-1] < 0.05


def test_error_feedback_carries_dropped_mass():
    enc, dec = lcckpt.DeltaEncoder(bits=1), lcckpt.DeltaDecoder()
    u0 = np.zeros(100, np.float32)
    dec.decode(enc.encode(u0))
    u1 = u0.copy()
    u1[:50] = 1.0
    u1[50:] = 0.001                                    # a small bucket, dropped at 1 bit
    y1 = dec.decode(enc.encode(u1))
    assert np.all(y1[50:] == 0)
    y = y1
    for _ in range(12):                                # the same state again: the residual
        y = dec.decode(enc.encode(u1))                 # becomes the delta and gets coded
    assert np.allclose(y, u1, rtol=1e-6)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float64])
def test_low_and_high_precision_chains(dtype):
    enc, dec = lcckpt.DeltaEncoder(bits=3), lcckpt.DeltaDecoder()
    for u in _walk(2000, 50, 1, np.float64):
        t = torch.from_numpy(u).to(dtype)
        y = dec.decode(enc.encode(t))
        r = enc.reference()
        if isinstance(y, np.ndarray):
            y, r = torch.from_numpy(y), torch.from_numpy(r)
        assert y.dtype == dtype and torch.equal(y, r)


def test_first_blob_is_an_exact_keyframe_and_keyframe_can_be_forced():
    enc, dec = lcckpt.DeltaEncoder(), lcckpt.DeltaDecoder()
    u = np.random.default_rng(0).standard_normal(500).astype(np.float32)
    blob, st = enc.encode(u, report=True)
    assert np.array_equal(dec.decode(blob), u) and st.kind == "lossless"
    blob, st = enc.encode(u * 1.1, report=True)
    dec.decode(blob)
    assert st.kind == "lossy"
    assert np.array_equal(dec.decode(enc.encode(u * 1.2, keyframe=True)), u * np.float32(1.2))


def test_shape_change_writes_keyframe():
    enc, dec = lcckpt.DeltaEncoder(), lcckpt.DeltaDecoder()
    dec.decode(enc.encode(np.ones(10, np.float32)))
    blob, st = enc.encode(np.full(12, 2.0, np.float32), report=True)
    y = dec.decode(blob)
    assert st.kind == "lossless" and np.array_equal(y, np.full(12, 2.0, np.float32))


def test_nonfinite_state_falls_back_to_keyframe_with_warning():
    enc, dec = lcckpt.DeltaEncoder(), lcckpt.DeltaDecoder()
    dec.decode(enc.encode(np.ones(10, np.float32)))
    bad = np.ones(10, np.float32)
    bad[3] = np.nan
    with pytest.warns(RuntimeWarning, match="NaN"):
        blob, st = enc.encode(bad, report=True)
    y = dec.decode(blob)
    assert np.isnan(y[3]) and st.kind == "lossless"


def test_guarded_chain_honours_bound():
    enc, dec = lcckpt.DeltaEncoder(bits=1, error_bound=0.01), lcckpt.DeltaDecoder()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for u in _walk(5000, 30, 2):
            y = dec.decode(enc.encode(u))
            assert np.linalg.norm(u - y) / np.linalg.norm(u) <= 0.01


def test_delta_without_keyframe_is_a_broken_chain():
    enc = lcckpt.DeltaEncoder()
    enc.encode(np.ones(10, np.float32))
    blob = enc.encode(np.full(10, 2.0, np.float32))
    with pytest.raises(lcckpt.BrokenChainError):
        lcckpt.DeltaDecoder().decode(blob)
    dec = lcckpt.DeltaDecoder()
    dec.decode(lcckpt.DeltaEncoder().encode(np.ones(11, np.float32)))
    with pytest.raises(lcckpt.BrokenChainError):
        dec.decode(blob)


def test_rejects_integer_state():
    with pytest.raises(lcckpt.UnsupportedDtypeError):
        lcckpt.DeltaEncoder().encode(np.arange(5))


def test_replay_into_decodes_a_waiting_keyframe_and_its_deltas_into_the_callers_array():
    """``Reconstruction.replay_into``: the same values as a replay into fresh memory, the
    caller's array becoming the reference; nothing done where it does not fit."""
    from lcckpt.codec.delta import Reconstruction
    enc = lcckpt.DeltaEncoder(bits=2, chunk_size=1024)
    blobs = [enc.encode(u) for u in _walk(5000, 4, 1)]

    def rec():
        r = Reconstruction()
        for b in blobs:
            r.apply(b)
        return r
    want = rec().value()
    out = np.full(5000, np.nan, np.float32)
    r = rec()
    for bad in (np.zeros(5000, np.float64), np.zeros(4999, np.float32),
                np.zeros(10000, np.float32)[::2], np.zeros((50, 100), np.float32)):
        assert not r.replay_into(bad)                   # wrong dtype, size, layout or shape
    assert r.replay_into(out)
    assert out.tobytes() == want.tobytes() == enc.reference().tobytes()
    assert r.ref is out and not r.replay_into(np.zeros(5000, np.float32))  # none waits now


def test_settle_replays_tiny_tensors_on_the_calling_thread(monkeypatch):
    """``settle``: tensors of at most ``TINY`` elements replay on the caller, one after
    another (on the pool two threads of mostly Python wait on each other for the GIL);
    larger ones go to the pool's threads. Every reference comes out as its encoder left
    it."""
    import threading
    from lcckpt.codec import replay
    from lcckpt.codec.delta import Reconstruction
    sizes = [300, replay.TINY, replay.TINY + 1, 3 * replay.TINY]
    recs, want = [], []
    for k, n in enumerate(sizes):
        enc = lcckpt.DeltaEncoder(chunk_size=1 << 14)
        r = Reconstruction()
        for u in _walk(n, 3, 10 + k):
            r.apply(enc.encode(u))
        recs.append(r)
        want.append(enc.reference().tobytes())
    where, real = {}, Reconstruction.ref

    def ref(self):
        where.setdefault(id(self), threading.get_ident())
        return real.fget(self)
    monkeypatch.setattr(Reconstruction, "ref", property(ref))
    monkeypatch.setenv("LCCKPT_THREADS", "2")      # a pool even on a one-CPU machine
    replay.settle(recs)
    here = threading.get_ident()
    assert [where[id(r)] == here for r in recs] == [True, True, False, False]
    assert [r.ref.tobytes() for r in recs] == want
