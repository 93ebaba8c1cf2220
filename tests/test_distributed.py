"""lcckpt.distributed on DCP: round trips in one process, and two real 2-process gloo runs."""

import argparse
import datetime
import gc
import math
import os
import pickle
import threading
import warnings
import sys
from concurrent.futures import Future

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner

import lcckpt.distributed as ld
from lcckpt.distributed.planner import chunk_nbytes
from lcckpt.distributed.storage import CompressedReader
from lcckpt.distributed.targets import MIN_ELEMENTS
from lcckpt.errors import (
    ChecksumError, CorruptDataError, DistributedCheckpointError, InvalidArgumentError,
    LcckptError, StateChangedError, UnsafeObjectError,
)

sys.path.insert(0, os.path.dirname(__file__))
import _dist_worker as W  # noqa: E402
from helpers import assert_equal_state  # noqa: E402


def zeros_like_state(state):
    out = {}
    for k, v in state.items():
        if isinstance(v, dict):
            out[k] = zeros_like_state(v)
        elif isinstance(v, torch.Tensor):
            out[k] = torch.zeros_like(v)
        else:
            out[k] = None
    return out


def various_state():
    g = torch.Generator().manual_seed(3)
    return {
        "f32": torch.randn(300, 7, generator=g),
        "bf16": torch.randn(50, 3, generator=g).to(torch.bfloat16),
        "f16": torch.randn(9, generator=g).half(),
        "f64": torch.randn(4, 4, generator=g).double(),
        "i64": torch.arange(-5, 20),
        "flags": torch.tensor([True, False, True]),
        "scalar": torch.tensor(2.5),
        "empty": torch.zeros(0, 3),
        "nested": {"w": torch.randn(8, 8, generator=g), "step": 7, "name": "adam",
                   "betas": [0.9, 0.999]},
    }


def test_exact_round_trip_one_process(tmp_path):
    state = various_state()
    ld.save(state, tmp_path / "c")
    target = zeros_like_state(state)
    ld.load(target, tmp_path / "c")
    assert_equal_state(target, state)
    # saving again into the same directory replaces it atomically and leaves no stale files
    state["f32"] += 1
    ld.save(state, tmp_path / "c")
    names = sorted(n for n in os.listdir(tmp_path / "c") if n.endswith(".distcp"))
    assert len(names) == 1
    ld.load(target, tmp_path / "c")
    assert_equal_state(target, state)


def _count_copies(monkeypatch) -> list:
    """The element counts of every ``Tensor.copy_`` from now on (the list fills up)."""
    copies = []
    real = torch.Tensor.copy_

    def counted(self, src, *a, **k):
        copies.append(self.numel())
        return real(self, src, *a, **k)
    monkeypatch.setattr(torch.Tensor, "copy_", counted)
    return copies


def test_an_exact_item_taken_whole_decodes_straight_into_its_target(tmp_path, monkeypatch):
    """No second copy: a tensor that one request takes whole is decoded into the target
    itself, and a target of another dtype (a copy is then needed) still loads."""
    g = torch.Generator().manual_seed(0)
    state = {"w": torch.randn(300, 200, generator=g), "b": torch.randn(7, generator=g)}
    ld.save(state, tmp_path / "c")
    copies = _count_copies(monkeypatch)
    target = {"w": torch.zeros(300, 200), "b": torch.zeros(7)}
    ld.load(target, tmp_path / "c")
    assert torch.equal(target["w"], state["w"]) and torch.equal(target["b"], state["b"])
    assert 300 * 200 not in copies, copies
    copies.clear()
    wide = {"w": torch.zeros(300, 200, dtype=torch.float64), "b": torch.zeros(7)}
    ld.load(wide, tmp_path / "c")
    assert torch.equal(wide["w"], state["w"].double()) and 300 * 200 in copies


def test_a_chain_item_taken_whole_replays_straight_into_its_target(tmp_path, monkeypatch):
    """A chain's fp32 item that one request takes whole is replayed (keyframe and deltas)
    in the target itself: no copy, and no buffer of its size; a bf16 item, whose working
    dtype is fp32, and an fp64 target are copied, and all equal the writer's references."""
    g = torch.Generator().manual_seed(0)
    state = {"w": torch.randn(300, 200, generator=g),
             "b": torch.randn(4096, generator=g).bfloat16()}
    ck = ld.DistributedCheckpointer(tmp_path, bits=2, keyframe_every=10)
    for step in range(3):
        state["w"] += torch.randn(300, 200, generator=g) * 1e-3
        state["b"] += (torch.randn(4096, generator=g) * 1e-2).bfloat16()
        ck.save(step, state)
    refs = {piece.key: ref for piece, ref in ck.references().items()}
    copies = _count_copies(monkeypatch)
    target = zeros_like_state(state)
    assert ck.load(target) == 2
    assert torch.equal(target["w"], refs["w"]) and torch.equal(target["b"], refs["b"])
    assert 300 * 200 not in copies and 4096 in copies, copies
    copies.clear()
    wide = {"w": torch.zeros(300, 200, dtype=torch.float64), "b": torch.zeros(4096).bfloat16()}
    assert ck.load(wide) == 2
    assert torch.equal(wide["w"], refs["w"].double()) and 300 * 200 in copies


def test_a_chain_whose_earlier_file_is_gone_or_cut_short_says_so(tmp_path):
    """Each local file is opened once per load: a missing one is still a BrokenChainError
    naming it, one cut short a TruncatedError, and the load's files are closed after."""
    from lcckpt.errors import BrokenChainError, TruncatedError
    g = torch.Generator().manual_seed(0)
    state = {"w": torch.randn(300, 200, generator=g)}
    ck = ld.DistributedCheckpointer(tmp_path, bits=2, keyframe_every=10)
    for step in range(3):
        state["w"] += torch.randn(300, 200, generator=g) * 1e-3
        ck.save(step, state)
    files = {s: [os.path.join(ck.path(s), n) for n in os.listdir(ck.path(s))
                 if n.endswith(".distcp")] for s in range(3)}
    target = zeros_like_state(state)
    assert ck.load(target) == 2
    fds = len(os.listdir("/proc/self/fd")) if os.path.isdir("/proc/self/fd") else None
    with open(files[1][0], "r+b") as f:
        f.truncate(f.seek(0, os.SEEK_END) // 2)
    with warnings.catch_warnings(record=True) as unclosed:   # a file left to the collector
        warnings.simplefilter("always", ResourceWarning)
        with pytest.raises(TruncatedError, match="bytes expected"):
            ck.load(zeros_like_state(state))
        os.remove(files[0][0])
        with pytest.raises(BrokenChainError, match="is missing") as e:
            ck.load(zeros_like_state(state))
        gc.collect()
    assert not [w for w in unclosed if issubclass(w.category, ResourceWarning)], unclosed
    assert os.path.basename(files[0][0]) in str(e.value)
    if fds is not None:     # none left open (another thread may have closed one since)
        assert len(os.listdir("/proc/self/fd")) <= fds


def test_chain_deltas_reload_bit_identical_to_references(tmp_path):
    g = torch.Generator().manual_seed(0)
    state = {"w": torch.randn(2000, 16, generator=g), "b": torch.randn(64, generator=g).bfloat16(),
             "n": torch.arange(10)}
    ck = ld.DistributedCheckpointer(tmp_path, bits=2, keyframe_every=3)
    sizes, kinds = [], []
    for step in range(5):
        state["w"] += torch.randn(2000, 16, generator=g) * 1e-3
        state["b"] += (torch.randn(64, generator=g) * 1e-2).bfloat16()
        md = ck.save(step, state)
        info = next(i for k, i in md.storage_data.items() if k.fqn == "w")
        kinds.append(info.codec)
        sizes.append(info.length)
        target = zeros_like_state(state)
        assert ck.load(target) == step
        for piece, ref in ck.references().items():
            assert torch.equal(target[piece.key], ref), (step, piece)
        assert torch.equal(target["n"], state["n"])
        assert (target["w"] - state["w"]).abs().max() < 0.05
    assert kinds == ["exact", "delta", "delta", "exact", "delta"]
    assert max(sizes[1], sizes[2]) * 10 < sizes[0]
    assert ck.steps() == [0, 1, 2, 3, 4]
    # an earlier step is still readable, through its own chain
    target = zeros_like_state(state)
    assert ck.load(target, step=2) == 2
    with pytest.raises(InvalidArgumentError, match="already committed"):
        ck.save(2, state)
    for bad in (True, 5.0, -1):                     # a bool is an int, but not a step
        with pytest.raises(InvalidArgumentError, match="non-negative int"):
            ck.save(bad, state)


def test_keep_last_deletes_only_what_no_kept_step_needs(tmp_path):
    """Retention of a distributed chain: the newest ``keep_last`` steps stay loadable with
    every directory their delta chains name; the rest go; a crash between a step's
    uncommit and its removal leaves a directory the next pass removes."""
    g = torch.Generator().manual_seed(1)
    state = {"w": torch.randn(4000, 8, generator=g), "n": torch.arange(5)}
    ck = ld.DistributedCheckpointer(tmp_path, bits=2, keyframe_every=3, keep_last=2)
    truth = {}
    for step in range(7):                       # keyframes at 0, 3, 6
        state["w"] += torch.randn(4000, 8, generator=g) * 1e-3
        ck.save(step, state)
        truth[step] = {k: v.clone() for k, v in ck.references().items()}
        kept = ck.steps()
        # the newest two, and every step back to the keyframe of the older one
        newest = kept[-2:]
        assert newest == [step - 1, step][-len(newest):]
        first_kf = (min(newest) // 3) * 3
        assert kept == list(range(first_kf, step + 1)), (step, kept)
        for s in newest:                        # every kept step loads as it was saved
            target = zeros_like_state(state)
            assert ck.load(target, step=s) == s
            if s == step:
                for piece, ref in truth[s].items():
                    assert torch.equal(target[piece.key], ref)
    assert sorted(os.listdir(tmp_path)) == [f"step_{s:010d}" for s in (3, 4, 5, 6)]
    # a half-deleted step (uncommitted: no .metadata) older than every kept step is removed
    stale = tmp_path / "step_0000000001"
    stale.mkdir()
    (stale / "__0_x_.distcp").write_bytes(b"partial")
    ck.save(7, state)
    assert not stale.exists() and ck.steps() == [6, 7]
    for step in (8, 9, 10):                     # in the background: retained before done
        state["w"] += torch.randn(4000, 8, generator=g) * 1e-3
        ck.async_save(step, state).result()
    assert ck.steps() == [9, 10]                # 9 is a keyframe: 6, 7 and 8 went
    with pytest.raises(InvalidArgumentError, match="keep_last"):
        ld.DistributedCheckpointer(tmp_path, keep_last=0)


def _drifting_states(seed: int, steps: int):
    """``(step, state)`` of :func:`various_state` whose float tensors drift a little each
    step (a fresh tree each time, sharing the tensors that did not change)."""
    g = torch.Generator().manual_seed(seed)
    s = various_state()
    for step in range(steps):
        for k in ("f32", "bf16", "f16", "f64"):
            s[k] = s[k] + (torch.randn(s[k].shape, generator=g) * 1e-2).to(s[k].dtype)
        yield step, {k: (dict(v) if isinstance(v, dict) else v) for k, v in s.items()}


def _resume_states(n=5):
    g = torch.Generator().manual_seed(4)
    w, m = torch.randn(300_000, generator=g), torch.zeros(300_000)
    out = []
    for s in range(n):
        w = w + 1e-3 * torch.randn(300_000, generator=g)
        m = 0.9 * m + 1e-3 * torch.randn(300_000, generator=g)
        out.append({"w": w.clone(), "m": m.clone(), "n": torch.tensor(s)})
    return out


def _stored(ck, step):
    """{fqn: (codec, the item's bytes)} of a committed step."""
    path = ck.path(step)
    out = {}
    for idx, info in CompressedReader(path).read_metadata().storage_data.items():
        with open(os.path.join(path, info.relative_path), "rb") as f:
            f.seek(info.offset)
            out[idx.fqn] = (info.codec, f.read(info.length))
    return out


def test_a_new_writer_goes_on_from_the_chain_on_disk(tmp_path):
    """A writer new to a directory whose chain is under way (a restarted job) takes its
    references from the files and writes deltas: the same bytes, item by item, as the
    writer that never stopped; one whose newest step cannot be read warns and writes
    keyframes, and so does a forced keyframe."""
    states = _resume_states()
    on = ld.DistributedCheckpointer(tmp_path / "on")
    for s in range(5):
        on.save(s, states[s])
    first = ld.DistributedCheckpointer(tmp_path / "again")
    for s in range(3):
        first.save(s, states[s])
    again = ld.DistributedCheckpointer(tmp_path / "again")
    for s in (3, 4):
        again.save(s, states[s])
        want, got = _stored(on, s), _stored(again, s)
        assert got == want and want["w"][0] == want["m"][0] == "delta"
    back = {k: torch.zeros_like(v) for k, v in states[4].items()}
    again.load(back)
    assert torch.equal(back["w"], next(v for p, v in again.references().items() if p.key == "w"))

    forced = ld.DistributedCheckpointer(tmp_path / "on")
    forced.save(5, states[4], keyframe=True)
    assert {c for c, _ in _stored(forced, 5).values()} == {"exact"}

    md = tmp_path / "again" / "step_0000000004" / ".metadata"
    md.write_bytes(b"not metadata")
    with pytest.warns(RuntimeWarning, match="cannot go on from the chain"):
        ld.DistributedCheckpointer(tmp_path / "again").save(5, states[4])
    assert {c for c, _ in _stored(again, 5).values()} == {"exact"}


def test_a_new_writer_keyframes_a_piece_whose_chain_is_damaged(tmp_path):
    states = _resume_states(4)
    first = ld.DistributedCheckpointer(tmp_path)
    for s in range(3):
        first.save(s, states[s])
    step1 = tmp_path / "step_0000000001"
    data = next(p for p in step1.iterdir() if p.suffix == ".distcp")
    info = next(i for i in CompressedReader(str(step1)).read_metadata().storage_data.values()
                if i.piece[0] == "w")
    raw = bytearray(data.read_bytes())
    raw[info.offset + info.length // 2] ^= 0x40
    data.write_bytes(bytes(raw))
    again = ld.DistributedCheckpointer(tmp_path)
    with pytest.warns(RuntimeWarning, match=r"piece w\[0:300000\]: its chain .* keyframe"):
        again.save(3, states[3])
    got = _stored(again, 3)
    assert got["w"][0] == "exact" and got["m"][0] == "delta"


def test_a_writer_id_a_merge_replaced_frees_its_background_references(tmp_path):
    """A merge that drops references gives the writer a new id (its background process
    starts over); the next copy that arrives there drops what the old id held."""
    from lcckpt.distributed import refs, storage
    w = storage.CompressedWriter(str(tmp_path), chain=True)
    old = w.writer_id
    pickle.loads(pickle.dumps(w))                  # a background process's copy
    assert old in refs.BACKGROUND
    w.rebase({}, 1)                                # this rank had a merged blob it lacked
    assert w.writer_id != old
    pickle.loads(pickle.dumps(w))
    assert old not in refs.BACKGROUND and w.writer_id in refs.BACKGROUND
    refs.BACKGROUND.pop(w.writer_id)


def test_merge_makes_the_newest_step_a_keyframe_that_restores_the_same(tmp_path):
    """merge() rewrites the newest step's deltas as keyframes of what they restore
    (widened: bf16 items keep their fp32 references), so retention may drop the steps
    before it, and later deltas load exactly as on a chain that was never merged."""
    plain = ld.DistributedCheckpointer(tmp_path / "plain", bits=2, keyframe_every=10)
    merged = ld.DistributedCheckpointer(tmp_path / "merged", bits=2, keyframe_every=10,
                                        keep_last=1)
    for step, state in _drifting_states(seed=5, steps=6):
        plain.save(step, state)
        merged.save(step, state)
        if step == 3:
            kept_before = merged.steps()
            assert merged.merge() == 3
            md = CompressedReader(merged.path(3)).read_metadata()
            floats = [i for i in md.storage_data.values() if i.dtype in dict.fromkeys(
                ("torch.float32", "torch.bfloat16", "torch.float16", "torch.float64"))
                and math.prod(i.shape) >= MIN_ELEMENTS]     # smaller: stored exactly
            assert floats and all(i.codec == "delta" and i.chain == () for i in floats)
            assert kept_before == [0, 1, 2, 3] and merged.steps() == [3]
        want, got = zeros_like_state(state), zeros_like_state(state)
        plain.load(want, step=step)
        merged.load(got, step=step)
        assert_equal_state(got, want)
        if step >= 3:            # later chains start at the merged keyframe: nothing older
            assert merged.steps() == list(range(3, step + 1)), (step, merged.steps())
        for piece, ref in merged.references().items():
            assert torch.equal(ref, plain.references()[piece]), (step, piece)


def _distcp_bytes(d) -> int:
    return sum(os.path.getsize(os.path.join(d, n)) for n in os.listdir(d)
               if n.endswith(".distcp"))


def test_a_tied_tensor_is_stored_once_through_deltas_a_merge_and_a_restart(tmp_path):
    g = torch.Generator().manual_seed(0)
    emb = torch.randn(2000, 64, generator=g)
    ld.save({"emb": emb, "out": emb}, tmp_path / "a")
    ld.save({"emb": emb}, tmp_path / "b")
    assert _distcp_bytes(tmp_path / "a") == _distcp_bytes(tmp_path / "b")
    got = {"emb": torch.zeros_like(emb), "out": torch.zeros_like(emb)}
    reader = CompressedReader(tmp_path / "a")
    dcp.load(got, storage_reader=reader, planner=ld.SafeLoadPlanner())
    assert torch.equal(got["emb"], emb) and torch.equal(got["out"], emb)
    assert reader.bytes_read < 1.01 * _distcp_bytes(tmp_path / "a")     # read once

    ck, one = (ld.DistributedCheckpointer(tmp_path / n) for n in ("c", "d"))
    for step in range(3):
        emb.add_(torch.randn(emb.shape, generator=g) * 1e-3)
        ck.save(step, {"emb": emb, "out": emb})
        one.save(step, {"emb": emb})
        assert _distcp_bytes(ck.path(step)) == _distcp_bytes(one.path(step))
    md = CompressedReader(ck.path(2)).read_metadata()
    infos = {idx.fqn: info for idx, info in md.storage_data.items()}
    assert infos["out"].codec == "delta" and infos["out"].alias and not infos["emb"].alias
    assert (infos["out"].offset, infos["out"].chain) == (infos["emb"].offset,
                                                         infos["emb"].chain)
    before = _distcp_bytes(ck.path(2))
    ck.merge(2)                                    # one keyframe for both names
    merged = CompressedReader(ck.path(2)).read_metadata().storage_data
    assert len({(i.relative_path, i.offset) for i in merged.values()}) == 1
    assert _distcp_bytes(ck.path(2)) - before < 1.01 * emb.numel() * 4
    want = {"emb": torch.zeros_like(emb)}
    one.load(want)
    for loader in (ck, ld.DistributedCheckpointer(tmp_path / "c")):
        got = {"emb": torch.zeros_like(emb), "out": torch.zeros_like(emb)}
        loader.load(got)
        assert torch.equal(got["emb"], want["emb"]) and torch.equal(got["out"], want["emb"])
    again = ld.DistributedCheckpointer(tmp_path / "c")         # a restarted writer goes on
    emb.add_(torch.randn(emb.shape, generator=g) * 1e-3)
    again.save(3, {"emb": emb, "out": emb})
    assert CompressedReader(again.path(3)).read_metadata().storage_data[
        next(i for i in merged if i.fqn == "emb")].codec == "delta"
    assert _distcp_bytes(again.path(3)) < emb.numel()


def test_merge_of_an_older_step_rebases_the_later_ones(tmp_path):
    """merge(step) of a step before the newest: it becomes a keyframe of what it
    restores, every later step's chains start there instead of at the old keyframe (so
    retention drops the steps before it), and every step, later saves included, loads
    as on a chain never merged."""
    plain = ld.DistributedCheckpointer(tmp_path / "plain", bits=2, keyframe_every=10)
    merged = ld.DistributedCheckpointer(tmp_path / "merged", bits=2, keyframe_every=10,
                                        keep_last=2)
    for step, state in _drifting_states(seed=6, steps=7):
        plain.save(step, state)
        merged.save(step, state)
        if step == 1:
            assert merged.steps() == [0, 1]
        if step == 4:
            assert merged.steps() == [0, 1, 2, 3, 4]     # every chain reaches step 0
            with pytest.raises(InvalidArgumentError, match="not committed"):
                merged.merge(7)
            assert merged.merge(2) == 2
            assert merged.steps() == [2, 3, 4]           # 0 and 1: nothing needs them
            for later in (3, 4):
                md = CompressedReader(merged.path(later)).read_metadata()
                chains = [i.chain for i in md.storage_data.values() if i.codec == "delta"]
                assert chains and all(c[0][0].startswith(os.path.join("..", "step_0000000002"))
                                      for c in chains), chains
        for s in merged.steps():
            want, got = zeros_like_state(state), zeros_like_state(state)
            plain.load(want, step=s)
            merged.load(got, step=s)
            assert_equal_state(got, want)
        for piece, ref in merged.references().items():
            assert torch.equal(ref, plain.references()[piece]), (step, piece)
    assert merged.steps() == [2, 3, 4, 5, 6]             # later deltas still need step 2


class _BrokenWriter(ld.CompressedWriter):
    """Writes part of its file, then fails: a disk filling up half-way."""

    def write_data(self, plan, planner):
        path = self.fs.concat_path(self.path, f"{plan.storage_data.prefix}0.distcp")
        self._written.append(path)
        with open(path, "wb") as f:
            f.write(b"half a file")
        raise OSError("no space left on device (injected)")


def test_failed_save_keeps_committed_checkpoint_and_references(tmp_path):
    state = {"w": torch.randn(500, 8)}
    ck = ld.DistributedCheckpointer(tmp_path, bits=2)
    ck.save(0, state)
    before = {p: t.clone() for p, t in ck.references().items()}
    good = ck.writer
    bad = _BrokenWriter(tmp_path, bits=2)
    bad._refs = good._refs
    ck.writer = bad
    state["w"] += 0.01
    with pytest.raises(DistributedCheckpointError, match="no space left"):
        ck.save(1, state)
    ck.writer = good
    assert ck.steps() == [0]
    assert os.listdir(ck.path(1)) == []                  # the partial file is gone
    assert all(torch.equal(ck.references()[p], t) for p, t in before.items())
    # a failed save into an existing checkpoint's directory leaves that checkpoint intact
    keep = {"w": torch.randn(500, 8)}
    ld.save(keep, tmp_path / "one")
    with pytest.raises(DistributedCheckpointError):
        _run_broken_save({"w": keep["w"] + 1}, tmp_path / "one")
    target = {"w": torch.zeros(500, 8)}
    ld.load(target, tmp_path / "one")
    assert torch.equal(target["w"], keep["w"])
    # the next save continues the chain from the committed references
    state["w"] += 0.01
    md = ck.save(1, state)
    assert {i.codec for i in md.storage_data.values()} == {"delta"}
    target = {"w": torch.zeros(500, 8)}
    ck.load(target)
    assert torch.equal(target["w"], next(iter(ck.references().values())))


def _run_broken_save(state, directory):
    from lcckpt.distributed.api import _save
    _save(state, _BrokenWriter(directory), ld.BalancedSavePlanner(), None)


def test_async_save(tmp_path):
    state = various_state()
    fut = ld.async_save(state, tmp_path / "a")
    fut.result(timeout=60)
    target = zeros_like_state(state)
    ld.load(target, tmp_path / "a")
    assert_equal_state(target, state)
    ck = ld.DistributedCheckpointer(tmp_path / "chain", bits=2)
    staged = []
    stager = ck._stager(False)
    real_stage = stager.stage
    stager.stage = lambda sd, **kw: staged.append(real_stage(sd, **kw)) or staged[-1]
    w = state["f32"].clone()
    ck.async_save(0, {"w": w}).result(timeout=60)
    w += 0.01                                            # in place, as an optimizer step
    ck.async_save(1, {"w": w})
    target = {"w": torch.zeros(300, 7)}
    assert ck.load(target) == 1                          # waits for the save in flight
    assert torch.equal(target["w"], next(iter(ck.references().values())))
    assert (target["w"] - w).abs().max() < 0.01 < (target["w"] - state["f32"]).abs().max()
    # the second save copied into the first one's staging buffer, not into a new one
    assert len(staged) == 2 and staged[0]["w"].data_ptr() == staged[1]["w"].data_ptr()
    ck.close()
    assert ck._stagers == {}


def test_a_stager_closed_by_torch_after_a_save_is_replaced(tmp_path):
    """Some torch releases close the inner stager after each non-blocking (CUDA) stage,
    which empties its copy table: the next save then failed with KeyError <class 'type'>."""
    state = {"model": {"w": torch.randn(50, 7)}, "step": 0}
    ck = ld.DistributedCheckpointer(tmp_path / "chain")
    for step in range(3):
        state["model"]["w"] += 0.01
        state["step"] = step
        ck.async_save(step, state).result(timeout=60)
        ck._stager(False)._state_dict_stager.close()       # what those releases do
    target = {"model": {"w": torch.zeros(50, 7)}, "step": -1}
    assert ck.load(target) == 2 and target["step"] == 2
    assert torch.equal(target["model"]["w"], next(iter(ck.references().values())))
    ck.close()


def test_a_pickled_writer_takes_up_references_only_after_the_commit(tmp_path):
    """What DCP's process-mode async_save does: each save unpickles a fresh copy of the
    writer in its background process. The references a copy writes there become the next
    copy's only once this process committed that save."""
    from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
    ck = ld.DistributedCheckpointer(tmp_path, bits=2)
    ck.save(0, {"w": torch.randn(100, 4)})
    assert ck.references() and ck.planner.history is not None
    assert pickle.loads(pickle.dumps(ck.planner)).history == ck.planner.history
    state = {"w": torch.randn(100, 4)}

    def background_save(step, commit):
        ck._prepare(step, False)
        copy = pickle.loads(pickle.dumps(ck.writer))      # as the background process gets it
        assert copy.references() == {}          # nothing of this writer committed there
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            dcp.save(state, storage_writer=copy, planner=DefaultSavePlanner(), no_dist=True)
        if commit:
            ck.writer.commit()                  # what _finish_async does on success
        return copy

    first = background_save(1, commit=False)    # not committed: its references are dropped
    assert pickle.loads(pickle.dumps(ck.writer)).references() == {}
    first = background_save(2, commit=True)
    assert first.references() == {}             # a save's own references wait for its commit
    nxt = pickle.loads(pickle.dumps(ck.writer))
    got = nxt.references()
    assert list(got) and all(torch.equal(t, torch.as_tensor(first._bg.refs[p].encoder.reference()))
                             for p, t in got.items())
    target = {"w": torch.zeros(100, 4)}
    ld.load(target, ck.path(2))
    assert torch.equal(target["w"], next(iter(got.values())))


def test_planner_balances_where_dcp_default_does_not():
    """The coordinator's view of two ranks holding the same state: one dominant tensor."""
    state = {"emb": torch.zeros(20000, 64)}                          # 5 MiB
    state.update({f"w{i}": torch.zeros(64, 64) for i in range(30)})  # 30 x 16 KiB

    def per_rank_bytes(planner):
        planner.set_up_planner(state, is_coordinator=True)
        local = planner.create_local_plan()
        plans, md = planner.create_global_plan([local, local])
        return [sum(chunk_nbytes(wi) for wi in p.items) for p in plans], md

    ours, md = per_rank_bytes(ld.BalancedSavePlanner(min_split_bytes=256 << 10))
    theirs, _ = per_rank_bytes(DefaultSavePlanner())
    assert sum(ours) == sum(theirs) == sum(t.numel() * 4 for t in state.values())
    assert max(ours) / (sum(ours) / 2) <= 1.15
    assert max(theirs) / (sum(theirs) / 2) > 1.5
    chunks = md.state_dict_metadata["emb"].chunks
    assert len(chunks) >= 4 and sum(c.sizes[0] for c in chunks) == 20000


def test_unsafe_values_and_foreign_checkpoints_are_refused(tmp_path):
    ld.save({"obj": _Custom()}, tmp_path / "u")
    with pytest.raises(UnsafeObjectError, match="weights_only|unrestricted"):
        ld.load({"obj": None}, tmp_path / "u")
    dcp.save({"w": torch.ones(3)}, checkpoint_id=tmp_path / "plain", no_dist=True)
    target = {"w": torch.zeros(3)}
    ld.load(target, tmp_path / "plain")              # plain DCP's, read safely (plain.py)
    assert torch.equal(target["w"], torch.ones(3))
    with pytest.raises(InvalidArgumentError, match="written by plain DCP"):
        CompressedReader(tmp_path / "plain").read_metadata()
    with open(tmp_path / "plain" / ".metadata", "wb") as f:
        pickle.dump(os.getcwd, f)                       # a global no metadata has
    with pytest.raises(UnsafeObjectError, match="refusing"):
        CompressedReader(tmp_path / "plain").read_metadata()
    with pytest.raises(InvalidArgumentError, match="no committed checkpoint"):
        CompressedReader(tmp_path / "nothing").read_metadata()


class _Custom:
    pass


class _Registered:
    def __init__(self, v=0):
        self.v = v

    def __eq__(self, other):
        return type(other) is _Registered and other.v == self.v


def _values():
    return {"labels": np.array(["cat", "dog"]), "mean": np.arange(3.0), "best": np.str_("dog"),
            "when": np.datetime64("2021-03-04"), "seen": {1, 2}, "pair": (0.9, 0.999),
            "z": 1 + 2j, "raw": b"\x00\x01", "dtype": torch.bfloat16,
            "size": torch.Size([2, 3]), "lr": 1e-3, "name": "adamw", "n": 7, "none": None,
            "args": argparse.Namespace(lr=0.1), "at": datetime.date(2026, 12, 1)}


def _assert_values(got, want):
    for k, v in want.items():
        if isinstance(v, np.ndarray):
            assert got[k].dtype == v.dtype and np.array_equal(got[k], v), k
        else:
            assert type(got[k]) is type(v) and got[k] == v, k


def test_values_are_stored_without_pickle(tmp_path):
    """Non-tensor values are lcckpt files ("tree" items): numpy arrays and scalars, sets, a
    Namespace and a date, which torch's safe unpickler refuses, load back; and DCP's own
    load planner reads them too. A value only pickle stores goes in DCP's torch.save bytes ("bytes"),
    which load as before: refused, unless its class is registered as safe."""
    state = {"w": torch.randn(5), "values": _values()}
    ld.save(state, tmp_path / "c")
    codecs = {i.fqn: info.codec for i, info in CompressedReader(tmp_path / "c")
              .read_metadata().storage_data.items()}
    assert codecs.pop("w") == "exact" and set(codecs.values()) == {"tree"}, codecs
    target = {"w": torch.zeros(5), "values": {k: None for k in _values()}}
    ld.load(target, tmp_path / "c")
    _assert_values(target["values"], _values())
    theirs = {"w": torch.zeros(5), "values": {k: None for k in _values()}}
    dcp.load(theirs, storage_reader=CompressedReader(tmp_path / "c"),
             planner=DefaultLoadPlanner(), no_dist=True)
    _assert_values(theirs["values"], _values())
    assert torch.equal(theirs["w"], state["w"])

    ld.save({"obj": _Registered(3), "n": 1}, tmp_path / "r")
    codecs = {i.fqn: info.codec for i, info in CompressedReader(tmp_path / "r")
              .read_metadata().storage_data.items()}
    assert codecs == {"obj": "bytes", "n": "tree"}
    with pytest.raises(UnsafeObjectError, match="unrestricted"):
        ld.load({"obj": None, "n": None}, tmp_path / "r")
    with torch.serialization.safe_globals([_Registered]):
        out = {"obj": None, "n": None}
        ld.load(out, tmp_path / "r")
    assert out == {"obj": _Registered(3), "n": 1}


def test_a_damaged_value_is_reported_by_its_name(tmp_path):
    ld.save({"w": torch.randn(10), "v": {"labels": np.array(["a", "b"]), "lr": 0.1}},
            tmp_path / "c")
    info = next(i for x, i in CompressedReader(tmp_path / "c").read_metadata()
                .storage_data.items() if x.fqn == "v.labels")
    path = tmp_path / "c" / info.relative_path
    data = bytearray(path.read_bytes())
    data[info.offset + info.length - 3] ^= 0x40          # in the array's bytes
    path.write_bytes(bytes(data))
    with pytest.raises(ChecksumError, match="value 'v.labels'"):
        ld.load({"w": torch.zeros(10), "v": {"labels": None, "lr": None}}, tmp_path / "c")


def test_values_written_as_torch_save_bytes_still_load(tmp_path):
    """Checkpoints whose values are DCP's torch.save bytes (codec "bytes", as every value was
    stored before values became lcckpt files) load as before."""
    dcp.save({"w": torch.ones(3), "v": {"lr": 0.1, "betas": (0.9, 0.99), "name": "sgd"}},
             storage_writer=ld.CompressedWriter(str(tmp_path / "c")),
             planner=DefaultSavePlanner(), no_dist=True)
    infos = CompressedReader(tmp_path / "c").read_metadata().storage_data
    assert {info.codec for info in infos.values()} == {"exact", "bytes"}
    out = {"w": torch.zeros(3), "v": {"lr": None, "betas": None, "name": None}}
    ld.load(out, tmp_path / "c")
    assert out["v"] == {"lr": 0.1, "betas": (0.9, 0.99), "name": "sgd"}
    assert torch.equal(out["w"], torch.ones(3))


def test_damaged_blob_is_reported(tmp_path):
    ld.save({"w": torch.randn(1000)}, tmp_path / "d")
    name = next(n for n in os.listdir(tmp_path / "d") if n.endswith(".distcp"))
    with open(tmp_path / "d" / name, "r+b") as f:
        f.seek(200)
        b = f.read(1)
        f.seek(200)
        f.write(bytes([b[0] ^ 0xFF]))
    with pytest.raises(CorruptDataError):
        ld.load({"w": torch.zeros(1000)}, tmp_path / "d")


# -- real 2-process runs (gloo) --------------------------------------------------------------

@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    """Run every 2-process check in one spawn: a 1-process checkpoint to load resharded, then
    the workers' chain (save, failed save, delta, load), reshard and cooperative-restore steps."""
    tmp = tmp_path_factory.mktemp("two_ranks")
    torch.manual_seed(1)
    model = nn.Sequential(nn.Linear(16, 12), nn.Linear(12, 4))
    state = {"model": model.state_dict(), "emb": torch.randn(4096, 64)}
    src = str(tmp / "one")
    ld.save(state, src)
    torch.save({**{f"model.{k}": v for k, v in state["model"].items()}, "emb": state["emb"]},
               f"{src}.expected.pt")
    root = str(tmp / "chain")
    os.makedirs(root)
    W.spawn(W.two_rank_worker, (2, W.rendezvous(root), root, src), 2, root)     # no retry
    return root, src


@pytest.mark.slow
def test_a_checkpoint_manager_under_ddp_writes_on_rank_0_and_restores_on_every_rank(tmp_path):
    """Two DDP ranks, a manager each over one directory (lcckpt.training.newest): rank 0
    writes, a restart restores the same parameters on both, and the chain goes on."""
    W.spawn(W.ddp_manager_worker, (2, W.rendezvous(tmp_path), str(tmp_path)), 2,
            str(tmp_path))


@pytest.mark.slow
def test_a_hugging_face_trainer_under_ddp_keeps_every_process_s_generators(tmp_path):
    """lcckpt.training.hf.ChainCallback in a two-process DDP Trainer (see the worker)."""
    pytest.importorskip("accelerate", reason="the Trainer needs accelerate")
    pytest.importorskip("transformers")
    W.spawn(W.hf_ddp_worker, (2, W.rendezvous(tmp_path), str(tmp_path)), 2, str(tmp_path))


def test_a_lightning_resume_under_ddp_replays_the_chain_on_rank_0_alone(tmp_path):
    """LcckptCheckpointIO.load_checkpoint in two gloo ranks (see the worker)."""
    pytest.importorskip("lightning")
    W.spawn(W.lightning_io_worker, (2, W.rendezvous(tmp_path), str(tmp_path)), 2,
            str(tmp_path))


def test_thread_async_saves_beside_the_loop_s_collectives_do_not_hang(tmp_path):
    """ck.async_save(step, state) in a DDP loop (see the worker)."""
    W.spawn(W.async_beside_collectives_worker, (2, W.rendezvous(tmp_path), str(tmp_path)), 2,
            str(tmp_path))


def test_a_state_shared_by_the_writer_arrives_whole_on_every_rank(tmp_path):
    """lcckpt.training.broadcast.share over two gloo ranks (see the worker)."""
    W.spawn(W.share_worker, (2, W.rendezvous(tmp_path), str(tmp_path)), 2, str(tmp_path))


@pytest.mark.slow
def test_a_rank_killed_by_a_signal_fails_with_its_native_and_python_stacks(tmp_path):
    """The spawn the multi-process tests use quotes a dead rank's stderr: the native stack of
    every thread (to name a C++ thread destroyed while joinable) and the Python ones."""
    with pytest.raises(AssertionError) as e:
        W.spawn(W.aborting_worker, (1, W.rendezvous(tmp_path), str(tmp_path)), 1, str(tmp_path))
    msg = str(e.value)
    assert "SIGABRT" in msg and "FatalSignalHandler" in msg, msg[-2000:]   # C++ frames
    assert "in aborting_worker" in msg, msg[-2000:]                         # faulthandler's


_DESTROY_AFTER_LATE_IMPORT = """
import json, os, sys, datetime
import torch, torch.distributed as dist
def gloo_threads():
    n = 0
    for t in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{t}/comm") as f:
                n += f.read().startswith("pt_gloo")
        except OSError:
            pass
    return n
dist.init_process_group("gloo", init_method=%r, rank=0, world_size=1,
                        timeout=datetime.timedelta(seconds=60))
import torch.distributed.checkpoint             # as a worker does, after init_process_group
captured = isinstance(sys.modules["torch.distributed.nn.functional"].broadcast
                      .__defaults__[-1], dist.ProcessGroup)
import lcckpt.distributed
t = torch.ones(4)
dist.all_reduce(t)
alive = gloo_threads()
dist.destroy_process_group()
import time
deadline = time.monotonic() + 5     # a thread that is exiting is listed until it is gone;
while gloo_threads() and time.monotonic() < deadline:   # a captured group's live on
    time.sleep(0.05)
print(json.dumps({"captured": captured, "alive": alive, "after": gloo_threads()}))
"""


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="needs Linux's /proc")
def test_destroy_process_group_joins_gloo_threads_after_a_late_import(tmp_path):
    """The SIGABRT of a rank at exit: DCP imported after ``init_process_group`` captures the
    default group in ``torch.distributed.nn.functional``'s default arguments, so
    ``destroy_process_group`` cannot destroy it and its gloo threads live into the
    interpreter's exit. Importing ``lcckpt.distributed`` lets it go: none is left."""
    import json
    import subprocess
    out = subprocess.run([sys.executable, "-c", _DESTROY_AFTER_LATE_IMPORT % W.rendezvous(tmp_path)],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    if got["alive"] == 0:
        pytest.skip("this torch does not name its gloo threads pt_gloo*")
    assert got["after"] == 0, got


_UNGUARDED_PROCESS_MODE = """
import sys, torch, torch.distributed as dist, lcckpt.distributed as ld
dist.init_process_group("gloo", init_method=sys.argv[1], rank=0, world_size=1)
ck = ld.DistributedCheckpointer(sys.argv[2])
ck.async_save(0, {"w": torch.ones(8)}, process=True)
ck.close()
"""


@pytest.mark.slow
def test_a_process_mode_save_from_an_unguarded_script_says_why_it_died(tmp_path):
    """DCP's background process is started by spawn, which runs the main script again: a
    script that trains at its top level kills it. The error says so, not only that the
    process is dead."""
    import subprocess
    script = tmp_path / "train.py"
    script.write_text(_UNGUARDED_PROCESS_MODE)
    out = subprocess.run([sys.executable, str(script), W.rendezvous(tmp_path),
                          str(tmp_path / "ck")], capture_output=True, text=True, timeout=300)
    assert out.returncode != 0
    assert "background process is dead" in out.stderr, out.stderr[-3000:]
    assert 'outside `if __name__ == "__main__":`' in out.stderr, out.stderr[-3000:]


@pytest.mark.slow
def test_two_ranks_save_fail_delta_load_and_reshard_to_one(two_ranks):
    root, _ = two_ranks
    asg = torch.load(f"{root}/asg0.pt")
    assert asg["imbalance"] <= 1.15, asg
    # one process reads what two wrote: every piece equals the reference of the rank that wrote it
    state = W.replicated_state()
    torch.manual_seed(1)
    model = nn.Sequential(nn.Linear(16, 12), nn.Linear(12, 4))
    target = {"state": zeros_like_state(state), "model": zeros_like_state(model.state_dict())}
    target["state"]["meta"] = {"epoch": 0, "tag": "", "lr": [0.0, 0.0]}
    ck = ld.DistributedCheckpointer(root)
    assert ck.steps() == [0, 1, 3, 4, 5, 6, 7, 8]   # 4, 5 merged; 8 by a restarted writer
    ck.load(target, step=3)
    flat = W.flatten(target)
    n = 0
    for rank in range(2):
        for name, ref in torch.load(f"{root}/refs_{rank}.pt").items():
            key, start, stop = name.rsplit("|", 2)
            assert torch.equal(W.piece_slice(flat, key, int(start), int(stop)), ref), name
            n += 1
    assert n >= 4 + 8 + 1 + 4
    assert torch.equal(target["state"]["ids"], torch.arange(100))


def test_two_ranks_store_a_tied_tensor_once_and_one_rank_loads_it(two_ranks):
    root, _ = two_ranks     # the workers checked that both names loaded as one
    ranks = set()
    for step in range(3):
        tied, untied, live = (os.path.join(root, n, f"step_{step:010d}")
                              for n in ("tied", "untied", "tied_live"))
        assert _distcp_bytes(tied) == _distcp_bytes(untied)
        assert _distcp_bytes(live) < 1.01 * _distcp_bytes(untied)
        md = CompressedReader(tied).read_metadata()
        ranks |= {i.rank for i in md.storage_data.values()}
        assert {(i.rank, i.offset) for idx, i in md.storage_data.items() if idx.fqn == "out"} \
            == {(i.rank, i.offset) for idx, i in md.storage_data.items() if idx.fqn == "emb"}
    assert ranks == {0, 1}                         # the rows were split between the ranks
    for name in ("tied", "untied", "tied_live"):   # both ranks loaded: each blob read once
        chain = sum(_distcp_bytes(os.path.join(root, name, f"step_{s:010d}")) for s in range(3))
        assert int(open(os.path.join(root, f"{name}.read")).read()) <= chain
    want = torch.load(os.path.join(root, "tied.pt"))
    got = {"emb": torch.zeros_like(want), "out": torch.zeros_like(want)}
    ld.DistributedCheckpointer(os.path.join(root, "tied")).load(got)
    assert torch.equal(got["emb"], got["out"])
    assert (got["emb"] - want).norm() <= 0.01 * want.norm()


@pytest.mark.slow
def test_one_process_checkpoint_loads_resharded_on_two_ranks(two_ranks):
    _, src = two_ranks      # the workers compared their shards with the saved values
    assert all(os.path.exists(f"{src}.loaded_on_{r}") for r in range(2))


@pytest.mark.slow
def test_two_ranks_restore_cooperatively_reading_each_byte_once(two_ranks):
    root, _ = two_ranks     # the workers checked the values and that a damaged item raised
    d = os.path.join(root, "coop")
    stored = sum(os.path.getsize(os.path.join(d, n)) for n in os.listdir(d)
                 if n.endswith(".distcp"))
    read = [int(open(f"{d}.read{r}").read()) for r in range(2)]
    assert sum(read) <= 1.05 * stored, (read, stored)
    assert max(read) <= 0.75 * stored, (read, stored)


@pytest.mark.slow
def test_process_mode_async_saves_write_deltas_and_survive_a_killed_saver(two_ranks):
    root, _ = two_ranks     # the workers compared the restores (_dist_worker.process_mode)
    for rank in range(2):
        with open(os.path.join(root, f"killed{rank}")) as f:
            assert f.read() == "raised", rank       # the kill came before the commit


@pytest.mark.slow
def test_a_live_save_changed_on_one_rank_fails_on_every_rank(two_ranks):
    root, _ = two_ranks     # the workers checked it (_dist_worker.live_staging)
    assert all(os.path.exists(os.path.join(root, f"live{r}")) for r in range(2))


@pytest.mark.slow
def test_a_live_save_in_a_process_reads_the_state_through_a_bounded_pool(two_ranks):
    root, _ = two_ranks     # the workers checked it (_dist_worker.process_live)
    assert all(os.path.exists(os.path.join(root, f"plive{r}")) for r in range(2))


@pytest.fixture(scope="module")
def three_ranks(two_ranks, tmp_path_factory):
    """Three ranks load what two wrote (2 -> 3), save their own, and two of them load that
    back (3 -> 2); see ``_dist_worker.three_rank_worker``."""
    root2, _ = two_ranks
    out = str(tmp_path_factory.mktemp("three_ranks"))
    W.spawn(W.three_rank_worker, (3, W.rendezvous(out), root2, out), 3, out)
    return out


@pytest.mark.slow
def test_any_n_to_m_exact_and_chains_ddp_fsdp2_and_mixed(three_ranks):
    """2 -> 3 and 3 -> 2 were checked bit for bit by the workers; 3 -> 1 here."""
    out = three_ranks
    assert all(os.path.exists(f"{out}/ok{r}") for r in range(2))
    for kind in ("exact3", "chain3"):
        want = torch.load(f"{out}/{kind}.expected.pt")
        torch.manual_seed(1)
        model = nn.Sequential(nn.Linear(16, 12), nn.Linear(12, 4))
        target = {"state": zeros_like_state(W.replicated_state()),
                  "model": zeros_like_state(model.state_dict())}
        target["state"]["meta"] = {"epoch": 0, "tag": "", "lr": [0.0, 0.0]}
        if kind == "exact3":
            ld.load(target, f"{out}/exact3")
        else:
            assert ld.DistributedCheckpointer(f"{out}/chain3").load(target) == 2
        got = {k: v for k, v in W.flatten(target).items() if isinstance(v, torch.Tensor)}
        assert set(got) == set(want)
        for k in want:
            assert torch.equal(got[k], want[k]), (kind, k)


def test_errors_are_lcckpt_errors():
    assert issubclass(DistributedCheckpointError, LcckptError)
    assert issubclass(DistributedCheckpointError, Exception)


def test_a_process_group_failure_is_a_distributed_checkpoint_error(tmp_path, monkeypatch):
    """A peer that dies surfaces on a surviving rank as the process group's own
    RuntimeError (gloo's "Connection closed by peer"), not as DCP's CheckpointException:
    it is reported as a DistributedCheckpointError too, and nothing is committed."""
    keep = {"w": torch.randn(50, 8)}
    ld.save(keep, tmp_path / "one")

    def dead_peer(*a, **kw):
        raise RuntimeError("[gloo] Connection closed by peer [127.0.0.1]:29500")
    monkeypatch.setattr(dcp, "save", dead_peer)
    with pytest.raises(DistributedCheckpointError, match="Connection closed by peer"):
        ld.save({"w": keep["w"] + 1}, tmp_path / "one")
    monkeypatch.undo()
    target = {"w": torch.zeros(50, 8)}
    ld.load(target, tmp_path / "one")
    assert torch.equal(target["w"], keep["w"])


def test_shared_memory_too_small_for_a_process_mode_save_says_what_to_do(tmp_path, monkeypatch):
    """Docker gives /dev/shm 64 MiB unless told otherwise, and a process-mode save stages
    through it: torch's "unable to allocate shared memory" from DCP's stager reaches the
    caller as a DistributedCheckpointError that says where the room is short and how to
    give more, as does the same failure in a live save's reads."""
    shm = RuntimeError("unable to allocate shared memory(shm) for file </torch_1_2_0>: "
                       "No space left on device (28)")

    def full(*a, **kw):
        raise shm
    monkeypatch.setattr(dcp, "async_save", full)
    ck = ld.DistributedCheckpointer(tmp_path / "ck")
    with pytest.raises(DistributedCheckpointError, match="/dev/shm has .* MiB free: give it "
                       "more, as `docker run --shm-size=...`") as e:
        ck.async_save(0, {"w": torch.ones(4)})
    assert e.value.__cause__ is shm and "nothing was committed" in str(e.value)
    from lcckpt.distributed.futures import shm_hint
    assert shm_hint("gloo: connection closed") == ""
    ck.close()


def test_the_pool_feeds_each_piece_through_a_few_slots_and_checks_the_versions():
    """The two ends of a live process-mode save (lcckpt/distributed/pool.py), here in one
    process: pieces come back in order with their values while the slots are reused; the
    pool is at most SLOTS times the largest piece and at most the bytes fed; the feeder's
    errors and an in-place change reach the writer's side as errors; the placeholders
    carry no data."""
    from types import SimpleNamespace
    from lcckpt.distributed import pool
    from lcckpt.distributed.live import Versions

    def run(state, items, change=None):
        feeder = pool.Feeder(pool.Pool(), Versions(state, 7))
        feeder.state = state
        client, got = feeder.client, []
        try:
            client.start(items)
            for _ in items:
                data, direction = client.next()
                got.append(data.clone())
                assert direction is None
                if change is not None:
                    change(feeder)
            client.finish("step 7")
        finally:
            feeder.attach(SimpleNamespace(feed=client), None)
        assert not feeder.thread.is_alive()
        return got, feeder.pool
    a = torch.randn(100, 8)
    state = {"a": a, "b": {"c": torch.arange(50)}, "s": torch.tensor(3.0)}
    items = [("a", (10, 0), (20, 8), ("a", 10, 30), False),
             ("b.c", (0,), (50,), ("b.c", 0, 50), False), ("s", (), (), ("s", 0, 0), False),
             ("a", (0, 0), (10, 8), ("a", 0, 10), False)]
    got, p = run(state, items)
    for g, want in zip(got, [a[10:30], state["b"]["c"], state["s"], a[:10]]):
        assert g.dtype == want.dtype and torch.equal(g, want)
    assert p.buffer.numel() == 2 * 640        # slots of the largest piece, 20 x 8 fp32;
    rows = [("a", (r, 0), (20, 8), ("a", r, r + 20), False) for r in range(0, 100, 20)]
    assert run(state, rows)[1].buffer.numel() == pool.SLOTS * 640   # at most SLOTS of them,
    assert run(state, items[:1])[1].buffer.numel() == 640    # and no more than they feed
    odd = {"h": torch.randn(5, 3).bfloat16(), "m": torch.rand(7) > 0.5,
           "e": torch.zeros(0, 4), "f8": torch.randn(9).to(torch.float8_e4m3fn),
           "t": torch.randn(6, 4).t()}                 # not contiguous
    got, _ = run(odd, [(k, (0,) * v.dim(), tuple(v.shape), (k, 0, len(v)), False)
                       for k, v in odd.items()])
    for g, want in zip(got, odd.values()):
        assert g.dtype == want.dtype and g.shape == want.shape
        assert torch.equal(g.view(torch.uint8), want.contiguous().view(torch.uint8))
    with pytest.raises(DistributedCheckpointError, match="KeyError"):
        run(state, [("nope", (0,), (1,), ("nope", 0, 1), False)])
    with pytest.raises(StateChangedError, match=r"state\['a'\]"):
        run(state, items, change=lambda f: a.add_(1.0))  # before the feeder read piece 4
    assert run(state, items[:1],                               # after it read everything
               change=lambda f: (f.versions.read.wait(30), a.add_(1.0)))
    ph = pool.placeholders({"x": [a, 3], "y": "s"})
    assert ph["x"][0].device.type == "meta" and ph["x"][0].shape == a.shape
    assert ph["x"][1] == 3 and ph["y"] == "s"


@settings(max_examples=25, deadline=None)
@given(st.lists(st.tuples(st.sampled_from([torch.float32, torch.bfloat16, torch.int64,
                                           torch.bool, torch.float64]),
                          st.integers(0, 40), st.integers(1, 5), st.integers(0, 40)),
                min_size=1, max_size=7))
def test_the_pool_gives_back_every_piece_bit_for_bit(pieces):
    """Any run of row ranges of tensors of any dtype, fed through the pool in order (slots
    reused as the writer moves on), arrives with the live tensors' exact bytes."""
    from types import SimpleNamespace
    from lcckpt.distributed import pool
    from lcckpt.distributed.live import Versions
    g = torch.Generator().manual_seed(len(pieces))
    state, items, want = {}, [], []
    for i, (dtype, rows, cols, start) in enumerate(pieces):
        t = (torch.randn(rows + start, cols, generator=g, dtype=torch.float64) * 50).to(dtype)
        state[f"t{i}"] = t
        items.append((f"t{i}", (start, 0), (rows, cols), (f"t{i}", start, start + rows), False))
        want.append(t[start:start + rows])
    feeder = pool.Feeder(pool.Pool(), Versions(state, 0))
    feeder.state = state
    try:
        feeder.client.start(items)
        for w in want:
            got, direction = feeder.client.next()
            assert direction is None and got.dtype == w.dtype and got.shape == w.shape
            if w.numel():
                assert torch.equal(got.view(torch.uint8), w.contiguous().view(torch.uint8))
        feeder.client.finish("step 0")
    finally:
        feeder.attach(SimpleNamespace(feed=feeder.client), None)


def test_a_live_async_save_reads_the_state_itself(tmp_path):
    """staging="live": no host copy; the chain loads as the references say; a wrong
    staging, and a save in a process with no process group, are refused (nothing left
    behind). (A live save in a process: _dist_worker.process_live.)"""
    ck = ld.DistributedCheckpointer(tmp_path, bits=2)
    w = torch.randn(300, 7)
    for step in range(3):
        w += 0.01                                        # in place, as an optimizer step
        ck.async_save(step, {"w": w}, staging="live").result(timeout=60)
    assert ck._stagers == {} and ck.writer.live is None
    target = {"w": torch.zeros(300, 7)}
    assert ck.load(target) == 2
    assert torch.equal(target["w"], next(iter(ck.references().values())))
    assert 0 < (target["w"] - w).abs().max() < 0.01
    with pytest.raises(InvalidArgumentError, match="'copy' or 'live'"):
        ck.async_save(3, {"w": w}, staging="none")
    assert not torch.distributed.is_initialized()  # DCP's background process needs a group:
    for staging in ("copy", "live"):
        with pytest.raises(InvalidArgumentError, match="init_process_group"):
            ck.async_save(3, {"w": w}, staging=staging, process=True)
        assert ck.writer.live is None and ck.writer.feed is None
        assert "lcckpt-feeder" not in {t.name for t in threading.enumerate()}
    ld.async_save({"w": w}, tmp_path / "one", staging="live").result(timeout=60)
    target = {"w": torch.zeros(300, 7)}
    ld.load(target, tmp_path / "one")
    assert torch.equal(target["w"], w)
    # a live save that fails to start leaves no version check behind for the next save
    from lcckpt.distributed import api

    def no_start(*args, **kwargs):
        raise RuntimeError("cannot start (injected)")
    real, api._async = api._async, no_start
    try:
        with pytest.raises(RuntimeError, match="injected"):
            ck.async_save(3, {"w": w}, staging="live")
    finally:
        api._async = real
    assert ck.writer.live is None
    w += 0.01
    ck.save(3, {"w": w})
    assert ck.steps() == [0, 1, 2, 3]


def _loads_as_referenced(ck, step):
    """The newest step of ``ck``'s {"a", "b"} chain is ``step`` and loads as the writer's
    references say."""
    target = {"a": torch.zeros(400, 8), "b": torch.zeros(400, 8)}
    assert ck.load(target) == step
    refs = {p.key: t for p, t in ck.references().items()}
    assert torch.equal(target["a"], refs["a"]) and torch.equal(target["b"], refs["b"])


def test_a_live_save_whose_state_changed_commits_nothing(tmp_path, monkeypatch):
    """A tensor changed in place while a live save writes it: StateChangedError, the step
    is not committed, and the references the failed save advanced are read back from the
    committed files, so the chain goes on with deltas."""
    from lcckpt.distributed import storage
    ck = ld.DistributedCheckpointer(tmp_path, bits=2)
    state = {"a": torch.randn(400, 8), "b": torch.randn(400, 8)}
    ck.save(0, state)
    before = {p.key: t.clone() for p, t in ck.references().items()}
    real = storage.CompressedWriter._encode_into

    def racing(self, f, wi, piece, data, *args):
        out = real(self, f, wi, piece, data, *args)
        if piece.key == "a":                 # b is written after a, and is then left alone
            state["b"].add_(1e-3)
        return out
    monkeypatch.setattr(storage.CompressedWriter, "_encode_into", racing)
    state["a"] += 0.01
    with pytest.raises(StateChangedError, match=r"state\['b'\] changed in place while step 1"):
        ck.async_save(1, state, staging="live").result(timeout=60)
    monkeypatch.setattr(storage.CompressedWriter, "_encode_into", real)
    assert ck.steps() == [0] and os.listdir(ck.path(1)) == []
    refs = {p.key: t for p, t in ck.references().items()}       # both were advanced
    assert all(torch.equal(refs[k], before[k]) for k in "ab")
    md = ck.async_save(1, state, staging="live").result(timeout=60)
    assert {i.codec for i in md.storage_data.values()} == {"delta"}
    state["a"] += 0.01
    md = ck.save(2, state)
    assert {i.codec for i in md.storage_data.values()} == {"delta"}
    _loads_as_referenced(ck, 2)


def test_a_key_missing_under_a_wrapper_s_prefix_names_the_stored_one(tmp_path):
    """A DDP-wrapped model's state dict ('module.' keys) against a checkpoint of the bare
    model, and the other way: DCP says only which key is missing; the note says which the
    checkpoint holds instead. A key missing outright gets no note."""
    model = nn.Sequential(nn.Linear(4, 4))
    ld.save({"model": model.state_dict()}, tmp_path / "bare")
    wrapped = {"model": {f"module.{k}": torch.zeros_like(v) for k, v in model.state_dict().items()}}
    with pytest.raises(DistributedCheckpointError) as e:
        ld.load(wrapped, tmp_path / "bare")
    assert "the checkpoint holds 'model.0.weight' where this state has 'model.module.0." \
        in "".join(e.value.__notes__)
    ck = ld.DistributedCheckpointer(tmp_path / "ck")
    ck.save(0, {"model": {f"_orig_mod.{k}": v for k, v in model.state_dict().items()}})
    with pytest.raises(DistributedCheckpointError) as e:
        ck.load({"model": model.state_dict()})
    assert "holds 'model._orig_mod.0." in "".join(e.value.__notes__)
    with pytest.raises(DistributedCheckpointError, match="Missing key") as e:
        ld.load({"model": {"other": torch.zeros(1)}}, tmp_path / "bare")
    assert not getattr(e.value, "__notes__", None)


def test_a_failed_async_save_whose_future_was_dropped_is_raised_by_the_next_call(tmp_path):
    """ck.async_save(step, state) with the future dropped: its failure used to be lost
    (the step simply missing). The next save, load, wait or close raises it, once; a
    caller that asked the future is not told twice."""
    ck = ld.DistributedCheckpointer(tmp_path, bits=2)
    state = {"a": torch.randn(400, 8)}
    ck.save(0, state)
    real = ck.writer._encode_into

    def failing(*args):
        raise OSError("no space left on device (injected)")
    for then in ("save", "load", "close", "asked"):
        ck.writer._encode_into = failing
        fut = ck.async_save(1, state)
        if then == "asked":
            assert isinstance(fut.exception(timeout=60), DistributedCheckpointError)
        else:
            Future.exception(fut, timeout=60)          # done, not asked
        ck.writer._encode_into = real
        state["a"] += 0.01
        if then == "asked":
            ck.save(1, state)                          # nothing raised twice
            continue
        with pytest.raises(DistributedCheckpointError, match="no space left") as e:
            (ck.save(1, state) if then == "save" else ck.load({"a": torch.zeros(400, 8)})
             if then == "load" else ck.close())
        assert "async_save of step 1" in "".join(getattr(e.value, "__notes__", []))
        ck.close()                                     # raised once: then it is done
        assert ck.steps() == [0]
    assert ck.steps() == [0, 1]


def test_a_failed_save_reads_back_the_references_it_advanced(tmp_path):
    """A save that fails after it encoded some pieces (here: the second piece's encode
    raises) sets the reference it advanced back to the committed one, from the files;
    one whose files are gone is dropped (a warning), and its next blob is a keyframe."""
    ck = ld.DistributedCheckpointer(tmp_path, bits=2)
    state = {"a": torch.randn(400, 8), "b": torch.randn(400, 8)}
    ck.save(0, state)
    before = {p.key: t.clone() for p, t in ck.references().items()}
    real = ck.writer._encode_into
    calls = []

    def failing(f, wi, piece, data, *args):
        calls.append(piece.key)
        if len(calls) == 2:
            raise OSError("no space left on device (injected)")
        return real(f, wi, piece, data, *args)
    ck.writer._encode_into = failing
    state["a"] += 0.01
    state["b"] += 0.01
    with pytest.raises(DistributedCheckpointError, match="no space left"):
        ck.save(1, state)
    del ck.writer._encode_into
    first, second = calls
    refs = {p.key: t for p, t in ck.references().items()}
    assert all(torch.equal(refs[k], before[k]) for k in "ab")
    md = ck.save(1, state)
    assert {i.codec for i in md.storage_data.values()} == {"delta"}
    _loads_as_referenced(ck, 1)
    # the same failure with the committed blobs gone: that piece starts over
    ck.writer._encode_into = failing
    calls.clear()
    for name in os.listdir(ck.path(1)):
        if name.endswith(".distcp"):
            os.remove(os.path.join(ck.path(1), name))
    state["a"] += 0.01
    with pytest.warns(RuntimeWarning, match=f"piece {first}.*cannot be read back"), \
            pytest.raises(DistributedCheckpointError):
        ck.save(2, state)
    del ck.writer._encode_into
    assert [p.key for p in ck.references()] == [second]
    md = ck.save(2, state)
    codecs = {i.piece[0]: i.codec for i in md.storage_data.values()}
    assert codecs == {first: "exact", second: "delta"}


def test_wait_before_makes_an_optimizer_step_wait_for_the_save(tmp_path, monkeypatch):
    from lcckpt.distributed import storage
    model = nn.Linear(64, 32)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ck = ld.DistributedCheckpointer(tmp_path, bits=2)
    handle = ck.wait_before(opt)
    gate = threading.Event()
    real = storage.CompressedWriter.write_data

    def slow(self, plan, planner):
        gate.wait(timeout=30)                # the write holds until the test lets it go
        return real(self, plan, planner)
    monkeypatch.setattr(storage.CompressedWriter, "write_data", slow)
    saved = {k: v.clone() for k, v in model.state_dict().items()}
    fut = ck.async_save(0, {"model": model.state_dict()}, staging="live")
    model(torch.randn(4, 64)).sum().backward()
    assert not fut.done()
    threading.Timer(0.2, gate.set).start()
    opt.step()                               # waits until the save has read the state
    assert fut.result(timeout=60) is not None and ck.steps() == [0]
    back = {"model": {k: torch.zeros_like(v) for k, v in saved.items()}}
    ck.load(back, 0)
    assert all(torch.equal(back["model"][k], v) for k, v in saved.items())
    handle.remove()


def test_wait_before_lets_the_step_go_before_the_save_commits(tmp_path, monkeypatch):
    """A live save reads the state no more once this rank's share is written: the
    optimizer's step need not wait for the sync and the commit."""
    from lcckpt.distributed import storage
    model = nn.Linear(64, 32)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ck = ld.DistributedCheckpointer(tmp_path, bits=2)
    ck.wait_before(opt)
    stepped, seen = threading.Event(), []
    real = storage.CompressedWriter.finish

    def held(self, *args, **kw):             # the commit waits for the optimizer's step
        stepped.wait(timeout=30)
        return real(self, *args, **kw)
    monkeypatch.setattr(storage.CompressedWriter, "finish", held)
    opt.register_step_post_hook(lambda *_: (seen.append(ck.steps()), stepped.set()))
    saved = {k: v.clone() for k, v in model.state_dict().items()}
    fut = ck.async_save(0, {"model": model.state_dict()}, staging="live")
    model(torch.randn(4, 64)).sum().backward()
    opt.step()
    fut.result(timeout=60)
    assert seen == [[]] and ck.steps() == [0]    # it stepped before step 0 was committed
    back = {"model": {k: torch.zeros_like(v) for k, v in saved.items()}}
    ck.load(back, 0)
    assert all(torch.equal(back["model"][k], v) for k, v in saved.items())
