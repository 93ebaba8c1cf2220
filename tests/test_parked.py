"""Parked references: a tensor that does not change leaves the writer's memory, and the
files are the same bit for bit as a writer that keeps every reference writes."""

import filecmp
import warnings

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import lcckpt.codec.delta as delta_mod
from lcckpt import DeltaCheckpointer, StorageError
from lcckpt.codec.parked import PARK_MIN, fingerprint
from lcckpt.format import stream as _stream

F = 'obj["f"]'          # the tracking key of state["f"]


def _states(steps=8, dtype=torch.float32, change=None):
    """A frozen tensor ``f`` beside one that trains; ``change(step, f)`` may edit ``f``."""
    g = torch.Generator().manual_seed(0)
    f = torch.randn(300, 400, generator=g).to(dtype)
    w = torch.randn(200, 500, generator=g)
    assert f.numel() >= PARK_MIN
    for s in range(steps):
        w = w + 0.01 * torch.randn(200, 500, generator=g)
        if change is not None:
            change(s, f)
        yield s, {"f": f.clone(), "w": w.clone(), "b": torch.zeros(10)}


def _write(d, states, park=True, monkeypatch=None, **kw):
    """Save ``states`` into ``d``; returns the checkpointer, whether ``f`` was parked
    after each save, and how often its reference was fetched back."""
    if not park:
        monkeypatch.setattr(delta_mod, "PARK_MIN", 1 << 62)
    ck = DeltaCheckpointer(d, **kw)
    fetched = []
    fetch = ck._fetch
    ck._fetch = lambda key: fetched.append(key) or fetch(key)
    parked = []
    for s, state in states:
        ck.save(s, state)
        parked.append(ck._encoders[F].parked)
    if not park:
        monkeypatch.setattr(delta_mod, "PARK_MIN", PARK_MIN)
    return ck, parked, fetched


def _same_files(a, b):
    assert a.steps() == b.steps()
    for s in a.steps():
        assert filecmp.cmp(a.path(s), b.path(s), shallow=False), s


def test_an_unchanged_tensor_is_parked_and_the_files_do_not_change(tmp_path, monkeypatch):
    def change(s, f):
        if s == 5:
            f[3] += 0.5                         # changed once, then frozen again
    ck, parked, fetched = _write(tmp_path / "a", _states(change=change))
    kept, never, _ = _write(tmp_path / "b", _states(change=change), park=False,
                            monkeypatch=monkeypatch)
    # parked once a delta finds it unchanged; back in memory for the step that changes it
    assert parked == [False, True, True, True, True, False, True, True]
    assert not any(never)
    assert fetched == [F]                       # only for the change
    assert ck._encoders[F]._ref is None         # out of memory
    assert not ck._encoders['obj["w"]'].parked  # training tensors stay
    _same_files(ck, kept)
    want = list(_states(change=change))[-1][1]
    assert torch.equal(ck.load()["f"], want["f"])
    # asked for, the reference comes back from the files: the kept one, bit for bit
    assert np.array_equal(ck._encoders[F].ref, kept._encoders[F].ref)
    assert not ck._encoders[F].parked


def test_a_zero_whose_sign_flips_is_fetched_and_coded_as_before(tmp_path, monkeypatch):
    """-0.0 has other bits than +0.0 but no other value: the fingerprints differ, the
    reference is fetched, and the delta is the one a kept reference gives."""
    def change(s, f):
        if s == 0:
            f[0, :7] = 0.0
        if s == 4:
            f[0, :7] = -0.0
    ck, parked, fetched = _write(tmp_path / "a", _states(change=change))
    kept, _, _ = _write(tmp_path / "b", _states(change=change), park=False,
                        monkeypatch=monkeypatch)
    assert fetched == [F] and parked[4]         # fetched, and parked again (a zero delta)
    _same_files(ck, kept)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float64])
def test_other_dtypes_park_too(tmp_path, monkeypatch, dtype):
    def change(s, f):
        if s == 3:
            f[:, 0] *= 2
    ck, parked, fetched = _write(tmp_path / "a", _states(6, dtype, change))
    kept, _, _ = _write(tmp_path / "b", _states(6, dtype, change), park=False,
                        monkeypatch=monkeypatch)
    # after the change, deltas carry its quantization residual until one comes out zero
    assert parked[:4] == [False, True, True, False] and fetched == [F]
    _same_files(ck, kept)


def test_streamed_saves_park_and_write_the_same_files(tmp_path, monkeypatch):
    """A state written as it is encoded (lazy deltas) codes against the tensor itself."""
    monkeypatch.setattr(_stream, "STREAM_ABOVE", 1 << 16)
    def change(s, f):
        if s == 4:
            f[10:20] = 1.0
    ck, parked, fetched = _write(tmp_path / "a", _states(change=change))
    kept, _, _ = _write(tmp_path / "b", _states(change=change), park=False,
                        monkeypatch=monkeypatch)
    assert parked[1] and not parked[4] and fetched == [F]
    _same_files(ck, kept)


def test_merge_retention_and_keyframes_with_a_parked_reference(tmp_path, monkeypatch):
    def run(d, park):
        if not park:
            monkeypatch.setattr(delta_mod, "PARK_MIN", 1 << 62)
        ck = DeltaCheckpointer(d, keyframe_every=4, keep_last=3)
        for s, state in _states(9):         # keyframes at 0, 4 and (merged) 5
            ck.save(s, state)
            if s == 5:
                assert ck._encoders[F].parked == park
                ck.merge()                  # the newest step becomes a keyframe
        monkeypatch.setattr(delta_mod, "PARK_MIN", PARK_MIN)
        return ck
    a, b = run(tmp_path / "a", True), run(tmp_path / "b", False)
    assert a._encoders[F].parked
    _same_files(a, b)
    assert torch.equal(a.load()["f"], list(_states(1))[0][1]["f"])


def _failing_fetch(ck, fail):
    """``ck``'s parked references fetched through ``fail(key, fetch)`` from now on."""
    fetch = ck._fetch
    ck._fetch = lambda key: fail(key, fetch)


def test_a_reference_that_cannot_be_fetched_is_stored_exactly(tmp_path):
    def change(s, f):
        if s == 3:
            f[5] -= 1.0
    states = list(_states(5, change=change))
    ck = DeltaCheckpointer(tmp_path)
    broken = []

    def fail(key, fetch):
        if broken:
            raise StorageError(5, "Input/output error", ck.path(2))
        return fetch(key)
    _failing_fetch(ck, fail)
    for s, state in states[:3]:
        ck.save(s, state)
    assert ck._encoders[F].parked
    broken.append(True)
    with pytest.warns(RuntimeWarning, match=r'reference of obj\["f"\].*stored exactly'):
        ck.save(3, states[3][1])
    assert ck.info(3)["tensors"][F]["kind"] == "lossless"
    assert torch.equal(ck.load(3)["f"], states[3][1]["f"])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ck.save(4, states[4][1])              # a delta from the exact values again
    assert torch.equal(ck.load(4)["f"], states[4][1]["f"])


def test_files_holding_other_values_are_not_taken_for_the_reference(tmp_path):
    """A fetched reference must have the parked one's fingerprint: one of other bits
    (files rewritten behind the writer) is not coded against."""
    states = list(_states(4))
    ck = DeltaCheckpointer(tmp_path)
    _failing_fetch(ck, lambda key, fetch: fetch(key) + 1.0)
    for s, state in states[:2]:
        ck.save(s, state)
    enc = ck._encoders[F]
    assert enc.parked
    with pytest.warns(RuntimeWarning, match="the files hold other values"):
        assert enc.ref is None
    ck.save(2, states[2][1])
    assert ck.info(2)["tensors"][F]["kind"] == "lossless"
    assert torch.equal(ck.load(2)["f"], states[2][1]["f"])


@settings(max_examples=40, deadline=None)
@given(st.integers(1, 5000), st.integers(0, 2**32 - 1), st.data())
def test_any_one_flipped_bit_changes_the_fingerprint(n, seed, data):
    a = np.random.default_rng(seed).standard_normal(n).astype(np.float32)
    b = a.copy()
    bit = data.draw(st.integers(0, 32 * n - 1))
    b.view(np.uint32)[bit // 32] ^= np.uint32(1 << (bit % 32))
    assert fingerprint(a) == fingerprint(a.copy())
    assert fingerprint(a) != fingerprint(b)


def test_a_distributed_chain_parks_unchanged_pieces_and_restores_the_same(tmp_path, monkeypatch):
    """The distributed writer (one process, no process group) parks too, once a save has
    committed, fetches a piece back by replaying its blobs when it changes, and follows
    a merge: every step restores as a writer that keeps every reference wrote it."""
    import lcckpt.distributed as ld

    def run(d, park):
        if not park:
            monkeypatch.setattr(delta_mod, "PARK_MIN", 1 << 62)
        ck = ld.DistributedCheckpointer(d, keyframe_every=10)
        parked, loads = [], []
        def change(s, f):
            if s == 4:
                f[7] += 0.25
        for s, state in _states(9, change=change):
            with warnings.catch_warnings():     # DCP: no process group, one process
                warnings.simplefilter("ignore", UserWarning)
                ck.save(s, state)
                if s == 5:
                    ck.merge()                  # the newest step made a keyframe
                back = {k: torch.zeros_like(v) for k, v in state.items()}
                ck.load(back)
            loads.append(back)
            refs = ck.writer._refs
            parked.append(any(r.encoder.parked for p, r in refs.items() if p.key == "f"))
        monkeypatch.setattr(delta_mod, "PARK_MIN", PARK_MIN)
        return parked, loads
    (p1, l1), (p2, l2) = run(tmp_path / "a", True), run(tmp_path / "b", False)
    assert p1[:5] == [False, True, True, True, False] and not any(p2)
    for a, b in zip(l1, l2):
        for k in a:
            assert torch.equal(a[k], b[k]), k
    assert abs((l1[4]["f"][7] - l1[3]["f"][7]).mean().item() - 0.25) < 0.01  # kept


_OPS = ("same", "row", "zero sign", "merge")


@settings(max_examples=12, deadline=None)
@given(st.lists(st.sampled_from(_OPS), min_size=2, max_size=7), st.integers(0, 2**16))
def test_any_run_of_changes_writes_the_files_a_kept_reference_writes(ops, seed):
    """Unchanged, changed, a zero's sign flipped, a merge: in any order, a writer that
    parks writes the files one that keeps every reference writes, and loads them back."""
    import tempfile

    def states():
        g = torch.Generator().manual_seed(seed)
        f = torch.randn(256, 256, generator=g)
        f[0, :4] = 0.0
        for s, op in enumerate(["same"] + ops):
            if op == "row":
                f[s % 256] += torch.randn(256, generator=g)
            elif op == "zero sign":
                f[0, :4] = -f[0, :4]
            yield s, op, {"f": f.clone(), "b": torch.arange(3.0) * s}

    def run(d, park_min):
        delta_mod.PARK_MIN = park_min
        try:
            ck = DeltaCheckpointer(d)
            for s, op, state in states():
                ck.save(s, state)
                if op == "merge":
                    ck.merge()
            return ck
        finally:
            delta_mod.PARK_MIN = PARK_MIN
    with tempfile.TemporaryDirectory() as a, tempfile.TemporaryDirectory() as b:
        parked, kept = run(a, PARK_MIN), run(b, 1 << 62)
        _same_files(parked, kept)
        last = list(states())[-1][2]["f"]
        assert (parked.load()["f"] - last).norm() <= 0.01 * (last.norm() + 1)
