"""DeltaCheckpointer: keyframes, delta chains, reopen, merge, retention, broken links, crashes."""

import collections
import contextlib
import copy
import errno
import json
import math
import os
import shutil
import subprocess
import sys
import warnings
from unittest import mock

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st
import torch
from torch import nn

import lcckpt
from lcckpt import BrokenChainError, ChecksumError, DeltaCheckpointer, DeltaDecoder, DeltaEncoder
from lcckpt.chain import restore as restore_mod
from lcckpt.codec import delta as delta_mod
from lcckpt.chain.directory import file_name
from lcckpt.chain.lock import LOCK_NAME
from lcckpt.format.container import read_container
from lcckpt.format import stream

from helpers import assert_same, drifting_state, kill_while_writing, same_bits, train_steps

HERE = os.path.dirname(os.path.abspath(__file__))


# --------------------------------------------------------------------------- helpers


assert_exact = assert_same


class _CNN(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(3, 16, 3)
        self.bn = nn.BatchNorm2d(16)
        self.conv2 = nn.Conv2d(16, 32, 3)
        self.fc = nn.Linear(32 * 8 * 8, 10)

    def forward(self, x):
        x = torch.relu(self.bn(self.conv1(x)))
        x = torch.relu(self.conv2(x))
        return self.fc(torch.flatten(x, 1))


_train = train_steps


OPTIMIZERS = {
    "sgd": lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9),
    "adam": lambda p: torch.optim.Adam(p, lr=1e-3),
}

_state = drifting_state

TRACKED = ("w", "h", "g", "x")


def _files(d):
    return sorted(p for p in os.listdir(d) if not p.startswith("."))


# --------------------------------------------------------------------------- keyframes


@pytest.mark.parametrize("opt_name", OPTIMIZERS)
def test_keyframe_round_trip_model_and_optimizer_is_exact(tmp_path, opt_name):
    torch.manual_seed(0)
    model = _CNN()
    opt = OPTIMIZERS[opt_name](model.parameters())
    _train(model, opt, 3)
    state = {
        "model": model.state_dict(), "optim": opt.state_dict(), "epoch": 3, "loss": 1.25,
        "extra": {"bf16": torch.randn(5000).to(torch.bfloat16),
                  "f16": torch.randn(70, 70).half(), "f64": torch.randn(4100).double(),
                  "mask": torch.rand(100) > 0.5, "ids": torch.arange(5, dtype=torch.int32),
                  "np": np.arange(4.0), "t": (1, "a", None)},
    }
    state = copy.deepcopy(state)     # state_dict() hands out live tensors; keep this snapshot
    ck = DeltaCheckpointer(tmp_path, bits=2, min_delta_elements=1000)
    ck.save(0, state)
    assert ck.info(0)["kind"] == "keyframe"
    tracked = ck.info(0)["tensors"]
    assert 'obj["model"]["fc.weight"]' in tracked and 'obj["extra"]["bf16"]' in tracked
    assert any("exp_avg_sq" in k or "momentum_buffer" in k for k in tracked)
    assert 'obj["model"]["conv1.bias"]' not in tracked          # small: stored exactly
    assert all(v["kind"] == "lossless" for v in tracked.values())
    loaded = DeltaCheckpointer(tmp_path).load()
    np.testing.assert_array_equal(loaded["extra"].pop("np"), state["extra"].pop("np"))
    assert_exact(state, loaded)
    assert type(loaded["model"]) is collections.OrderedDict
    # a keyframe file is also a plain lcckpt file
    plain = lcckpt.load(ck.path(0))
    assert_exact(state["optim"], plain["optim"])

    # a delta on top: the keyframe still loads exactly, untracked values of the delta too
    _train(model, opt, 2, seed=1)
    state2 = {"model": model.state_dict(), "optim": opt.state_dict(), "epoch": 4}
    ck.save(1, state2)
    assert ck.info(1)["kind"] == "delta"
    assert_exact(state["model"], ck.load(0)["model"])
    out = ck.load(1)
    for k, v in state2["model"].items():
        assert out["model"][k].dtype == v.dtype
        if f'obj["model"][{json.dumps(k)}]' not in tracked:
            assert same_bits(out["model"][k], v), k
    assert out["optim"]["param_groups"] == state2["optim"]["param_groups"]
    for pid, st in state2["optim"]["state"].items():
        if "step" in st:
            assert same_bits(out["optim"]["state"][pid]["step"], st["step"])
    assert_exact(lcckpt.load(ck.path(1)), out)      # a delta file by its path: its step
    with pytest.raises(BrokenChainError, match="delta"):
        lcckpt.load(ck.path(1), follow=False)


def test_save_compress_uses_the_lossless_codec_where_it_is_smaller(tmp_path):
    """compress=True codes each tensor losslessly, but stores a tensor whose blob would
    not be smaller than its bytes (a blob's header and checksums outweigh a small one's
    savings) as it is: the file is never larger than without compress (it was twice as
    large for 2,000 tensors of 3 elements)."""
    small = {f"t{i}": torch.randn(3, dtype=torch.float64) for i in range(200)}
    state = {"w": torch.randn(300, 300), "b": torch.randn(10).to(torch.bfloat16), "n": 3,
             "z": torch.zeros(1000), "small": small}
    lcckpt.save(state, tmp_path / "a.lcc", compress=True)
    lcckpt.save(state, tmp_path / "raw.lcc")
    with read_container(tmp_path / "a.lcc") as c:
        codecs = {s["name"]: s["meta"]["codec"] for s in c.sections}
    assert codecs['obj["w"]'] == codecs['obj["z"]'] == "lossless"
    assert codecs['obj["b"]'] == codecs['obj["small"]["t0"]'] == "raw"
    assert os.path.getsize(tmp_path / "a.lcc") < os.path.getsize(tmp_path / "raw.lcc")
    assert_exact(state, lcckpt.load(tmp_path / "a.lcc"))


# --------------------------------------------------------------------------- long chains


def test_hundred_deltas_restore_bit_identical_to_encoder_references(tmp_path):
    ck = DeltaCheckpointer(tmp_path, bits=2, keyframe_every=None)
    encoders = {k: DeltaEncoder(bits=2) for k in TRACKED}
    refs, errs = [], []
    for step in range(101):
        state = _state(step)
        ck.save(step, state)
        for k in TRACKED:
            encoders[k].encode(state["model"][k])
        refs.append({k: encoders[k].reference() for k in TRACKED})
    assert [ck.info(s)["kind"] for s in (0, 1, 100)] == ["keyframe", "delta", "delta"]
    assert ck.info(100)["depth"] == 100
    reader = DeltaCheckpointer(tmp_path)
    replayed = reader.replay()
    for step in range(101):
        got, out = next(replayed)       # every step, each file decoded once
        assert got == step
        if step % 10 == 3 or step == 100:
            assert_exact(out, reader.load(step))         # random access: the same result
        truth = _state(step)
        for k in TRACKED:
            assert same_bits(out["model"][k], refs[step][k]), (step, k)
        assert_exact(truth["model"]["b"], out["model"]["b"])
        assert out["epoch"] == truth["epoch"] and torch.equal(out["step"], truth["step"])
        w, t = out["model"]["w"].double(), truth["model"]["w"].double()
        errs.append(float((w - t).norm() / t.norm()))
    # error feedback: the error stays bounded along the chain instead of accumulating
    assert errs[0] == 0 and max(errs) < 0.03
    assert max(errs[51:]) <= 2 * max(errs[1:51])


def test_a_replay_without_copies_yields_each_step_as_the_copying_one(tmp_path):
    """``replay(copy=False)`` hands out the replay's own references: each state, used
    before the next is taken, is bit for bit the copying replay's (keyframes, deltas and
    a later keyframe), and a delta step's tracked tensor is the previous step's memory,
    advanced in place."""
    ck = DeltaCheckpointer(tmp_path, bits=2, keyframe_every=4)
    for step in range(9):
        ck.save(step, _state(step))
    copied = [(s, copy.deepcopy(o)) for s, o in ck.replay()]
    shared = ck.replay(copy=False)
    previous = None
    for want_step, want in copied:
        step, got = next(shared)
        assert step == want_step
        assert_exact(want, got)
        if previous is not None and step % 4:            # a delta: advanced in place
            assert previous.data_ptr() == got["model"]["w"].data_ptr()
        previous = got["model"]["w"]


def test_keyframe_cadence(tmp_path):
    ck = DeltaCheckpointer(tmp_path, keyframe_every=4)
    for step in range(10):
        ck.save(step * 5, _state(step))
    kinds = [ck.info(s)["kind"][0].upper() for s in ck.steps()]
    assert "".join(kinds) == "KDDDKDDDKD"
    assert ck.steps() == list(range(0, 50, 5))
    assert _files(tmp_path) == [file_name(s) for s in range(0, 50, 5)]
    meta = ck.info(15)
    assert meta["base"]["step"] == 10 and meta["base"]["file"] == file_name(10)
    assert meta["settings"]["bits"] == 2 and meta["settings"]["coder"] == "auto"
    st = meta["tensors"]['obj["model"]["w"]']
    assert st["kind"] == "uniform" and 0 < st["bits_per_element"] < 8    # the default target
    assert st["target"] >= lcckpt.RolePolicy().weight      # or the update share, if more
    assert 0 < st["error_vs_movement"] <= st["target"] * (1 + 1e-3)
    with pytest.raises(lcckpt.InvalidArgumentError):
        ck.save(45, _state(10))                      # steps must increase
    for bad in (True, 50.0, "50", -1):              # a bool is an int, but not a step
        with pytest.raises(lcckpt.InvalidArgumentError, match="step must be"):
            ck.save(bad, _state(10))
    assert ck.steps() == list(range(0, 50, 5))
    every = DeltaCheckpointer(tmp_path / "k1", keyframe_every=1)
    for step in range(3):
        every.save(step, _state(step))
    assert [every.info(s)["kind"] for s in range(3)] == ["keyframe"] * 3



def test_a_keyframe_asked_for_restores_exactly_and_later_deltas_build_on_it(tmp_path):
    ck = DeltaCheckpointer(tmp_path)                 # default: one keyframe per 50 saves
    for step in range(3):
        ck.save(step, _state(step))
    ck.save(3, _state(3), keyframe=True)
    ck.save(4, _state(4))
    assert [ck.info(s)["kind"] for s in range(5)] == \
        ["keyframe", "delta", "delta", "keyframe", "delta"]
    assert ck.info(3)["depth"] == 0 and ck.info(4)["base"]["step"] == 3
    assert ck.info(4)["depth"] == 1
    assert_same(ck.load(3), _state(3))             # exact, where a delta step is not:
    assert not same_bits(ck.load(2)["model"]["w"], _state(2)["model"]["w"])
    w4, got = _state(4)["model"]["w"], ck.load(4)["model"]["w"]
    moved = float((w4 - _state(3)["model"]["w"]).norm())       # since the new keyframe
    policy = lcckpt.RolePolicy()         # its first delta: the update is the movement
    assert 0 < float((got - w4).norm()) <= max(policy.weight, policy.update) * moved * 1.01
    for bad in (1, "yes", None):
        with pytest.raises(lcckpt.InvalidArgumentError, match="keyframe must be"):
            ck.save(5, _state(5), keyframe=bad)
    assert ck.steps() == [0, 1, 2, 3, 4]


# --------------------------------------------------------------------------- reopen


_CHILD_WRITER = """
import sys, numpy as np, torch
sys.path.insert(0, {here!r})
from helpers import drifting_state as _state
from lcckpt import DeltaCheckpointer
ck = DeltaCheckpointer(sys.argv[1], keyframe_every=8)
for step in range(int(sys.argv[2]), int(sys.argv[3])):
    ck.save(step, _state(step))
"""


def test_reopen_continues_the_chain_like_a_continuous_writer(tmp_path):
    cont, reopened, child = tmp_path / "cont", tmp_path / "reopen", tmp_path / "child"
    ck = DeltaCheckpointer(cont, keyframe_every=8)
    for step in range(12):
        ck.save(step, _state(step))
    for lo, hi in ((0, 3), (3, 4), (4, 12)):          # a new writer object each time
        w = DeltaCheckpointer(reopened, keyframe_every=8)
        for step in range(lo, hi):
            w.save(step, _state(step))
    w = DeltaCheckpointer(child, keyframe_every=8)
    for step in range(5):
        w.save(step, _state(step))
    w.close()                                 # one writer at a time: hand it over
    code = _CHILD_WRITER.format(here=HERE)    # another process continues the chain
    subprocess.run([sys.executable, "-c", code, str(child), "5", "9"], check=True)
    w = DeltaCheckpointer(child, keyframe_every=8)
    for step in range(9, 12):
        w.save(step, _state(step))
    a, b, c = (DeltaCheckpointer(d) for d in (cont, reopened, child))
    for d in (a, b, c):
        assert [d.info(s)["kind"][0].upper() for s in d.steps()] == list("KDDDDDDDKDDD")
    for step in range(12):
        x = a.load(step)
        assert_exact(x, b.load(step))
        assert_exact(x, c.load(step))


def _chain_of(d, n, **kw):
    with DeltaCheckpointer(d, keyframe_every=8, **kw) as ck:
        for step in range(n):
            ck.save(step, _state(step))
    return DeltaCheckpointer(d)


@pytest.mark.parametrize("steps", [1, 6])
def test_load_into_decodes_into_the_callers_tensors_and_equals_a_plain_load(tmp_path, steps):
    """load(into=...) gives the same bits as load(); each host target of the stored dtype
    and shape is the very tensor returned, an fp32/fp64 one replayed into with no fresh
    array of its size; a target that does not fit is left alone."""
    ck = _chain_of(tmp_path, steps)
    want = ck.load()
    model = {k: torch.full_like(v, 7) for k, v in want["model"].items()}
    model["b"] = torch.zeros(3)                             # another shape: not used
    targets = dict(model)
    sizes = []
    real = delta_mod._memory.bulk_empty
    def recording(n, dtype):
        sizes.append(int(np.prod(n)))
        return real(n, dtype)
    with mock.patch.object(delta_mod._memory, "bulk_empty", recording), pytest.warns(
            RuntimeWarning, match=r'obj\["model"\]\["b"\] \(the stored tensor is float32\[10\], '
            r'the target float32\[3\]\)\.'):
        got = ck.load(into={"model": model, "step": torch.tensor(0)})
    assert_exact(got, want)
    for k, v in got["model"].items():
        assert (v is targets[k]) == (k != "b"), k
    assert torch.equal(model["b"], torch.zeros(3))
    assert 6000 not in sizes and 4500 not in sizes        # fp32 "w", fp64 "x": no fresh copy
    shared = torch.zeros(6000)                            # one target at two places
    got = ck.load(into={"model": {"w": shared, "b": shared[:10]}})
    assert got["model"]["w"] is shared and torch.equal(got["model"]["w"], want["model"]["w"])
    assert got["model"]["b"] is not shared and torch.equal(got["model"]["b"], want["model"]["b"])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16, torch.bfloat16])
def test_empty_tensors_of_every_float_dtype_save_and_load_in_a_chain(tmp_path, dtype):
    """An empty bf16 tensor made the delta encoder's widening to fp32 raise (a byte view
    of nothing has stride 0, which torch's dtype view refuses)."""
    ck = DeltaCheckpointer(tmp_path)
    for step in range(3):
        ck.save(step, {"e": torch.zeros(0, dtype=dtype), "m": torch.zeros(0, 5, dtype=dtype),
                       "w": torch.full((100,), float(step), dtype=dtype)})
    got = ck.load(2)
    assert got["e"].dtype == got["m"].dtype == dtype and got["m"].shape == (0, 5)
    assert torch.equal(got["w"], torch.full((100,), 2.0, dtype=dtype))


class _Classifier(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3).to(memory_format=torch.channels_last)
        self.fc, self.bn, self.head = nn.Linear(36, 16), nn.BatchNorm1d(16), nn.Linear(16, 2)

    def forward(self, x):
        return self.head(self.bn(self.fc(self.conv(x).flatten(1))))


def test_load_into_fills_every_target_a_stored_tensor_fits(tmp_path):
    """A model loaded ``into=`` its own tensors gets every one of them: a two-class
    head's bias and BatchNorm's step counter (small: one pack section, not tracked), a
    channels_last conv weight (not contiguous: copied in), and a weight the state also
    holds as a transposed view (its section is the shared storage). Before, those kept
    the model's old values while the load returned the stored ones beside them."""
    torch.manual_seed(0)

    def trained(steps):
        net = _Classifier()
        opt = torch.optim.AdamW(net.parameters(), lr=1e-2)
        for step in range(steps):
            net(torch.randn(8, 3, 5, 5)).sum().backward()
            opt.step()
            opt.zero_grad()
            yield step, net, opt
    ck = DeltaCheckpointer(tmp_path / "ck")
    for step, net, opt in trained(3):
        ck.save(step, {"model": net.state_dict(), "optim": opt.state_dict(),
                       "tied": net.fc.weight.t()})
    want = ck.load()
    _, fresh, fresh_opt = next(trained(1))              # its own weights, moments, steps
    model, optim = fresh.state_dict(), fresh_opt.state_dict()
    got = ck.load(into={"model": model, "optim": optim})
    assert_same(got, want)
    for k, v in model.items():
        assert got["model"][k] is v and torch.equal(v, want["model"][k]), k
    for i, st in optim["state"].items():
        for k, v in st.items():
            assert got["optim"]["state"][i][k] is v and torch.equal(v, want["optim"]["state"][i][k])
    assert not model["conv.weight"].is_contiguous()
    assert model["head.bias"].numel() == 2 and model["bn.num_batches_tracked"].item() == 3
    assert torch.equal(fresh.head.bias.detach(), want["model"]["head.bias"])   # the module's own


def _restart_runs(tmp_path, before_save, steps=(6, 9), resume=True, into=False, **kw):
    """A chain of ``steps[0]`` steps continued to ``steps[1]`` by a restarted writer that
    first loads the newest step (``resume``; ``into`` tensors of its own) and changes
    what it got in place, as training does; ``before_save(writer)`` runs between.
    Returns the directory, and how often the writer replayed the chain without building
    an object."""
    d = tmp_path / ("resumed" if resume else "plain") / ("into" if into else "fresh")
    with DeltaCheckpointer(d, keyframe_every=8, **kw) as ck:
        for step in range(steps[0]):
            ck.save(step, _state(step))
    w = DeltaCheckpointer(d, keyframe_every=8, **kw)
    live = {k: torch.zeros_like(v) for k, v in _state(0)["model"].items()}
    got = w.load(resume=resume, into={"model": live} if into else None)
    assert (got["model"]["w"] is live["w"]) == into         # (LC mode stores "b" whole)
    for v in got["model"].values():
        v.add_(1.0)                          # training moves the loaded tensors
    before_save(w)
    calls = []
    real = restore_mod.restore
    def counting(*a, **k):
        calls.append(k.get("build"))
        return real(*a, **k)
    with mock.patch.object(restore_mod, "restore", counting):
        for step in range(w.steps()[-1] + 1, steps[1]):
            w.save(step, _state(step))
    w.close()
    return d, calls.count(False)


def _same_files(a, b):
    names = sorted(os.listdir(a))
    assert names == sorted(os.listdir(b))
    for n in names:
        if n.endswith(".lcc"):
            assert (a / n).read_bytes() == (b / n).read_bytes(), n


@pytest.mark.parametrize("steps", [(6, 9), (1, 4)])       # (1, 4): a keyframe alone
@pytest.mark.parametrize("kw", [{}, {"target": 0.01}, {"bits": 2}],
                         ids=["default", "norm target", "lc"])
def test_load_resume_lets_the_next_save_continue_without_replaying_the_chain(tmp_path, steps,
                                                                             kw):
    """load(resume=True) hands the writer the references it restored: the next saves
    write the very bytes a writer that replays the chain writes, with no second replay;
    the loaded object itself is the caller's (changing it changes nothing)."""
    plain, replays = _restart_runs(tmp_path, lambda w: None, steps, resume=False, **kw)
    assert replays == 1
    for into in (False, True):          # loaded into tensors of its own, or fresh ones
        resumed, replays = _restart_runs(tmp_path, lambda w: None, steps, into=into, **kw)
        assert replays == 0
        _same_files(plain, resumed)


def test_load_resume_replays_again_when_the_chain_moved_on(tmp_path):
    """The kept references are used only for the very file they restored: after a merge
    (its depth and movement start over) or a step another writer added, the chain is
    replayed, and the files are again what a plain restart writes."""
    def merge(w):
        w.merge()
        w.close()

    def another_writer(w):
        with DeltaCheckpointer(w.directory, keyframe_every=8) as other:
            other.save(6, _state(6))
    for change in (merge, another_writer):
        runs = []
        for resume in (False, True):
            sub = tmp_path / change.__name__
            sub.mkdir(exist_ok=True)
            runs.append(_restart_runs(sub, change, resume=resume))
        assert [r[1] for r in runs] == [1, 1]
        _same_files(runs[0][0], runs[1][0])


# --------------------------------------------------------------------------- merge


def test_merge_keeps_values_and_frees_earlier_files(tmp_path):
    ck = DeltaCheckpointer(tmp_path, keyframe_every=None)
    for step in range(10):
        ck.save(step, _state(step))
    before = [ck.load(s) for s in range(10)]
    ck.merge(6)
    assert ck.info(6)["kind"] == "keyframe" and ck.info(6)["merged"]["from_base"]["step"] == 5
    assert ck.info(7)["kind"] == "delta"
    for s in range(10):
        assert_exact(before[s], ck.load(s))
    for s in range(6):
        os.unlink(ck.path(s))                      # no longer needed by 6..9
    reader = DeltaCheckpointer(tmp_path)
    for s in range(6, 10):
        assert_exact(before[s], reader.load(s))
    # the writer continues from its in-memory state, a new one from disk: same results
    ck.save(10, _state(10))
    ck.merge()                                     # newest: cadence restarts there
    assert ck.info(10)["kind"] == "keyframe"
    ck.save(11, _state(11))
    other = tmp_path / "other"
    shutil.copytree(tmp_path, other, ignore=shutil.ignore_patterns("other"))
    ck.save(12, _state(12))
    DeltaCheckpointer(other, keyframe_every=None).save(12, _state(12))
    assert_exact(ck.load(12), DeltaCheckpointer(other).load(12))


def test_merge_with_retention_removes_the_old_chain(tmp_path):
    ck = DeltaCheckpointer(tmp_path, keyframe_every=None, keep_last=2)
    for step in range(6):
        ck.save(step, _state(step))
    assert ck.steps() == list(range(6))              # all needed by steps 4 and 5
    want = ck.load(5)
    ck.merge(4)
    assert ck.steps() == [4, 5]
    assert_exact(want, DeltaCheckpointer(tmp_path).load(5))


# --------------------------------------------------------------------------- retention


def test_retention_never_breaks_a_kept_step(tmp_path):
    ck = DeltaCheckpointer(tmp_path, keyframe_every=5, keep_last=3)
    for step in range(14):
        ck.save(step, _state(step))
        kept = [s for s in range(step + 1)][-3:]
        first = min(s - s % 5 for s in kept)           # the keyframe the oldest kept one needs
        assert ck.steps() == list(range(first, step + 1)), step
        reader = DeltaCheckpointer(tmp_path)
        for s in kept:
            reader.load(s)
    assert ck.steps() == [10, 11, 12, 13]


# --------------------------------------------------------------------------- broken chains


def _chain(d, n=6, seed_offset=0, **kw):
    ck = DeltaCheckpointer(d, keyframe_every=None, **kw)
    for step in range(n):
        ck.save(step, _state(step + seed_offset))
    return ck


def _flip_byte(path, tracked=True):
    """Damage one byte of the first tracked (or untracked) tensor section of a file."""
    with read_container(path) as c:
        s = next(s for s in c.sections if (s["meta"].get("codec") == "delta") == tracked)
        pos = c.data_start + s["offset"] + s["length"] // 2
    raw = bytearray(open(path, "rb").read())
    raw[pos] ^= 0x10
    open(path, "wb").write(raw)


def test_missing_link(tmp_path):
    ck = _chain(tmp_path)
    os.unlink(ck.path(3))
    with pytest.raises(BrokenChainError) as e:
        ck.load(5)
    assert "step 5" in str(e.value) and file_name(3) in str(e.value) and "missing" in str(e.value)
    assert_exact(ck.load(2), DeltaCheckpointer(tmp_path).load(2))   # earlier steps still load
    with pytest.raises(FileNotFoundError):
        ck.load(3)
    nowhere = DeltaCheckpointer(tmp_path / "nowhere")
    assert nowhere.steps() == []
    with pytest.raises(FileNotFoundError):
        nowhere.load()
    assert not (tmp_path / "nowhere").exists()        # readers create nothing


def test_damaged_link_and_damaged_target(tmp_path):
    ck = _chain(tmp_path)
    want = ck.load(4)
    _flip_byte(ck.path(2), tracked=False)   # an exact section: later steps do not need it
    assert_exact(want, ck.load(4))
    with pytest.raises(ChecksumError) as e:              # the file asked for is itself damaged
        ck.load(2)
    assert "step 2" in str(e.value) and file_name(2) in str(e.value)
    _flip_byte(ck.path(2))                  # a delta section: the chain through it is broken
    with pytest.raises(BrokenChainError) as e:
        ck.load(4)
    assert "step 4" in str(e.value) and file_name(2) in str(e.value)
    assert isinstance(e.value.__cause__, ChecksumError)
    p = ck.path(1)
    open(p, "r+b").truncate(os.path.getsize(p) - 100)     # truncated: damaged header/sections
    with pytest.raises(BrokenChainError, match=file_name(1)) as e:
        ck.load(3)
    assert isinstance(e.value.__cause__, lcckpt.CorruptDataError)


def test_link_from_another_run_is_detected(tmp_path):
    a = _chain(tmp_path / "a")
    b = _chain(tmp_path / "b", seed_offset=1)
    shutil.copy(b.path(2), a.path(2))
    with pytest.raises(BrokenChainError) as e:
        a.load(4)
    msg = str(e.value)
    assert "step 4" in msg and file_name(2) in msg and "state" in msg


@pytest.mark.parametrize("streamed", [False, True])
def test_equal_saves_write_equal_files(tmp_path, monkeypatch, streamed):
    """A state's id is a digest of its file's step, base and sections, not a random one
    (which compressed differently in every header and moved sizes by 16 bytes now and then)."""
    if streamed:                        # written as encoded, the header into its room
        monkeypatch.setattr(stream, "STREAM_ABOVE", 0)
    a, b = _chain(tmp_path / "a"), _chain(tmp_path / "b")
    for ck in (a, b):
        ck.merge(3)                     # a merged keyframe keeps the state's id
    for step in range(6):
        assert open(a.path(step), "rb").read() == open(b.path(step), "rb").read(), step
    ids = [a.info(step)["state_id"] for step in range(6)]
    assert len(set(ids)) == 6 and all(len(i) == 16 for i in ids)
    c = _chain(tmp_path / "c", n=3)
    c.save(3, _state(4))                # another state at step 3: another id
    assert c.info(3)["state_id"] != ids[3]
    assert a.info(4)["base"]["state_id"] == ids[3]


@pytest.mark.parametrize("streamed", [False, True])
def test_a_save_releases_its_state_before_the_commit(tmp_path, monkeypatch, streamed):
    """``save(..., released=f)``: ``f`` runs once every byte is written and before the
    file is in place; tensors changed from then on do not reach the file."""
    if streamed:
        monkeypatch.setattr(stream, "STREAM_ABOVE", 0)
    plain = DeltaCheckpointer(tmp_path / "plain")
    live = DeltaCheckpointer(tmp_path / "live")
    for step in range(4):                   # a keyframe, then deltas
        plain.save(step, drifting_state(step))
        state, calls = drifting_state(step), []

        def scramble(state=state, calls=calls, step=step):
            calls.append(os.path.exists(live.path(step)))
            for t in state["model"].values():
                t.mul_(-3.0)                # what an optimizer's step may do now
        live.save(step, state, released=scramble)
        assert calls == [False], step       # once, before the file was committed
        assert open(plain.path(step), "rb").read() == open(live.path(step), "rb").read()


def test_writer_resumes_with_a_keyframe_after_a_broken_chain(tmp_path):
    ck = _chain(tmp_path)
    ck.close()                                # one writer at a time: hand it over
    _flip_byte(ck.path(3))
    w = DeltaCheckpointer(tmp_path, keyframe_every=None)
    with pytest.warns(RuntimeWarning, match="keyframe"):
        w.save(6, _state(6))
    assert w.info(6)["kind"] == "keyframe"
    w.save(7, _state(7))
    assert w.info(7)["kind"] == "delta"
    DeltaCheckpointer(tmp_path).load(7)


_CHILD_KILLED = """
import sys, torch
from lcckpt import DeltaCheckpointer
ck = DeltaCheckpointer(sys.argv[1], keyframe_every=2)
ck.save(0, {"w": torch.arange(5000.0), "step": 0})
ck.save(1, {"w": torch.arange(5000.0) * 1.01, "step": 1})
torch.manual_seed(0)
big = torch.randn(16 * 2**20)    # a keyframe of ~55 MiB: writing it takes a while
print("ready", flush=True)
ck.save(2, {"w": big, "step": 2})
print("done", flush=True)
"""


@pytest.mark.slow
@pytest.mark.skipif(os.name != "posix", reason="needs SIGKILL")
def test_sigkill_during_save_keeps_the_last_good_checkpoint(tmp_path):
    partial = lambda p: os.path.basename(p).startswith(".") \
        and os.path.basename(p) != LOCK_NAME  # noqa: E731
    for _attempt in range(3):
        d = tmp_path / f"run{_attempt}"
        if kill_while_writing(_CHILD_KILLED, [d], d, partial):
            break
    else:
        pytest.fail("could not kill the writer while it was writing")
    ck = DeltaCheckpointer(d, keyframe_every=2)
    assert ck.steps() == [0, 1]
    out = ck.load()
    assert out["step"] == 1 and out["w"].shape == (5000,)
    assert float((out["w"] - torch.arange(5000.0) * 1.01).norm()) < 0.05 * 5000 ** 1.5
    assert [p for p in os.listdir(d) if partial(p)]                # the killed writer's temp
    ck.save(2, {"w": torch.arange(5000.0) * 1.02, "step": 2})    # continues; cleans the temp
    assert not [p for p in os.listdir(d) if partial(p)]
    ck.close()                                                    # deletes the lock file
    assert sorted(os.listdir(d)) == [file_name(s) for s in range(3)]
    assert DeltaCheckpointer(d).load()["step"] == 2


# --------------------------------------------------------------------------- accuracy


def test_restored_model_accuracy_on_a_real_trajectory(tmp_path, capsys):
    from lcckpt.bench.trajectory import train_trajectory

    traj = train_trajectory(model="cnn", optimizer="sgd", steps=200, snapshot_every=10)
    ck = DeltaCheckpointer(tmp_path, bits=2, keyframe_every=20)
    encoders, decoders = {}, {}
    rows = []
    for step, snap in traj.snapshots:
        ck.save(step, {"model": snap["model"]})
        # the reference quantizer alone: one DeltaEncoder/Decoder pair per tracked tensor,
        # with the same tracking rule (>= 4096 elements) and the same keyframes
        keyframe = ck.info(step)["kind"] == "keyframe"
        ref_state = {}
        for k, v in snap["model"].items():
            if v.is_floating_point() and v.numel() >= 4096:
                enc = encoders.setdefault(k, DeltaEncoder(bits=2))
                dec = decoders.setdefault(k, DeltaDecoder())
                ref_state[k] = torch.from_numpy(dec.decode(enc.encode(v, keyframe=keyframe)))
            else:
                ref_state[k] = v
        rows.append((step, keyframe, snap["model"], ref_state))
    reader = DeltaCheckpointer(tmp_path)
    report = []
    for step, keyframe, true_state, ref_state in rows:
        restored = reader.load(step)["model"]
        for k in true_state:
            assert same_bits(restored[k], ref_state[k]), (step, k)   # the same thing here
        acc_true, acc_rest = traj.accuracy(true_state), traj.accuracy(restored)
        acc_ref = traj.accuracy(ref_state)
        report.append((step, "K" if keyframe else "D", acc_true, acc_rest, acc_ref))
    with capsys.disabled():
        print("\nstep kind  true   restored  reference-quantizer")
        for step, kind, t, r, q in report:
            print(f"{step:4d}  {kind}   {t:.4f}  {r:.4f}    {q:.4f}")
    checked = 0
    for step, kind, t, r, q in report:
        if abs(q - t) <= 0.02:
            checked += 1
            assert abs(r - t) <= 0.02, (step, t, r, q)
    assert checked >= len(report) // 2


def test_bits_policy_per_tensor(tmp_path):
    """A key-path policy gives Adam's first moment more bits than the weights."""
    ck = lcckpt.DeltaCheckpointer(tmp_path, bits=lambda key: 4 if "exp_avg" in key else 2,
                                  min_delta_elements=1)
    w = torch.randn(5000)
    m = torch.randn(5000)
    for step in range(3):
        w, m = w + 0.01 * torch.randn(5000), 0.9 * m + 0.1 * torch.randn(5000)
        ck.save(step, {"w": w.clone(), "exp_avg": m.clone()})
    tensors = ck.info(2)["tensors"]
    assert tensors['obj["w"]']["bits"] == 2 and tensors['obj["exp_avg"]']["bits"] == 4
    assert ck.info(2)["settings"]["bits"] == "per tensor"
    ck.close()                                # one writer at a time: hand it over
    again = lcckpt.DeltaCheckpointer(tmp_path, bits=lambda key: 4 if "exp_avg" in key else 2,
                                     min_delta_elements=1)
    again.save(3, {"w": w.clone(), "exp_avg": m.clone()})        # resumed encoders keep it
    assert again.info(3)["tensors"]['obj["exp_avg"]']["bits"] == 4


def test_a_failing_retention_unlink_warns_and_the_next_save_retries(tmp_path, monkeypatch):
    """A step is committed once its file is in place: a retention unlink that fails (an
    immutable file, a directory named like a step) is a warning, never an error of the
    save, and the next save tries again."""
    real_unlink = os.unlink
    broken = {"on": True}

    def unlink(p, *a, **kw):
        if broken["on"] and os.path.basename(str(p)).startswith("step-"):
            raise PermissionError(1, "Operation not permitted", str(p))
        return real_unlink(p, *a, **kw)
    monkeypatch.setattr(os, "unlink", unlink)
    ck = DeltaCheckpointer(tmp_path, keyframe_every=2, keep_last=1)
    for step in range(4):
        with pytest.warns(RuntimeWarning, match="could not remove") if step >= 2 else \
                contextlib.nullcontext():
            ck.save(step, _state(step))
    assert ck.steps() == [0, 1, 2, 3]
    assert_exact(ck.load(3), DeltaCheckpointer(tmp_path).load(3))
    broken["on"] = False
    ck.save(4, _state(4))
    assert ck.steps() == [4]
    ck.load(4)


@pytest.mark.parametrize("fail_at", [0, 1, 2])
def test_a_retention_unlink_failing_midway_leaves_every_kept_step_loadable(
        tmp_path, monkeypatch, fail_at):
    """Retention removes the newest unneeded step first and stops at a failure, so a step
    it leaves behind still has its chain (oldest first, a failure on step 1 left step 1
    on disk without its base, step 0: found by tests/attacks/fuzz_large.py)."""
    ck = DeltaCheckpointer(tmp_path, keyframe_every=4, keep_last=1)
    states = [_state(step) for step in range(6)]
    for step in range(4):
        ck.save(step, states[step])
    truth = {s: ck.load(s) for s in ck.steps()}
    real_unlink, calls = os.unlink, []

    def unlink(p, *a, **kw):
        if os.path.basename(str(p)).startswith("step-"):
            calls.append(os.path.basename(str(p)))
            if len(calls) - 1 == fail_at:
                raise OSError(errno.EIO, "Input/output error", str(p))
        return real_unlink(p, *a, **kw)
    monkeypatch.setattr(os, "unlink", unlink)
    with pytest.warns(RuntimeWarning, match="could not remove"):
        ck.save(4, states[4])                   # a keyframe: steps 0-3 are no longer needed
    assert calls[0] == "step-000000000003.lcc"    # newest first
    reader = DeltaCheckpointer(tmp_path)
    for s in reader.steps():
        if s in truth:
            assert_exact(reader.load(s), truth[s])
    monkeypatch.setattr(os, "unlink", real_unlink)
    ck.save(5, states[5])
    assert ck.steps() == [4, 5]


def test_rollback_sets_the_later_steps_aside_under_the_lock_and_the_chain_goes_on(tmp_path):
    """``rollback(step)``: the later steps renamed ``*.rolledback`` (a name taken gets
    ``.1``), under the writer's lock; the next save is a delta on ``step``, also after a
    ``load(step, resume=True)`` by a new writer, whose references it goes on from."""
    g = torch.Generator().manual_seed(0)
    w = [torch.randn(64, 64, generator=g)]
    for _ in range(7):
        w.append(w[-1] + 0.01 * torch.randn(64, 64, generator=g))
    ck = DeltaCheckpointer(tmp_path, keyframe_every=3)
    for i in range(6):
        ck.save(i, {"w": w[i]})
    with pytest.raises(lcckpt.NotFoundError, match=r"holds steps \[0, 1, 2, 3, 4, 5\]"):
        ck.rollback(9)
    with pytest.raises(lcckpt.ConcurrentWriteError, match="earlier in this process.*close"):
        DeltaCheckpointer(tmp_path).rollback(1)           # ck holds the lock
    lock = tmp_path / ".lcckpt-writer.lock"                 # as another process writes it
    lock.write_text(lock.read_text().replace(str(os.getpid()), "1", 1))
    with pytest.raises(lcckpt.ConcurrentWriteError, match=r"\(pid 1 on \S+, since"):
        DeltaCheckpointer(tmp_path).rollback(1)
    lock.write_text("")                 # as between the holder's lock and its pid's write
    with pytest.raises(lcckpt.ConcurrentWriteError, match="earlier in this process.*close"):
        DeltaCheckpointer(tmp_path).rollback(1)
    assert ck.rollback(1) == [2, 3, 4, 5] and ck.steps() == [0, 1]
    ck.save(2, {"w": w[6]})
    assert ck.info(2)["base"]["step"] == 1
    assert (ck.load(2)["w"] - w[6]).norm() <= 0.05 * (w[6] - w[0]).norm()
    ck.close()
    again = DeltaCheckpointer(tmp_path)
    before = again.load(0, resume=True)["w"]
    with mock.patch.object(restore_mod, "restore", side_effect=AssertionError("replayed")):
        assert again.rollback(0) == [1, 2]
        again.save(1, {"w": w[7]})                        # from the load's references
    assert again.info(1)["base"]["step"] == 0 and torch.equal(again.load(0)["w"], before)
    again.close()
    names = sorted(f for f in os.listdir(tmp_path) if "rolledback" in f)
    assert [n.split(".lcc")[1] for n in names] == [
        ".rolledback", ".rolledback", ".rolledback.1", ".rolledback", ".rolledback", ".rolledback"]


def test_retain_keeps_the_steps_named_and_what_they_need(tmp_path, monkeypatch):
    """``retain(steps)``: the named steps, their bases back to their keyframes and the
    newest step's stay; the rest goes newest first, so a failure leaves every step that
    stays with its base, and the next retain finishes."""
    ck = DeltaCheckpointer(tmp_path, keyframe_every=4)
    for step in range(8):                          # keyframes 0 and 4
        ck.save(step, _state(step))
    truth = {s: ck.load(s) for s in ck.steps()}
    real_unlink = os.unlink

    def unlink(p, *a, **kw):
        if os.path.basename(str(p)) == file_name(2):
            raise PermissionError(1, "Operation not permitted", str(p))
        return real_unlink(p, *a, **kw)
    monkeypatch.setattr(os, "unlink", unlink)
    with pytest.warns(RuntimeWarning, match="could not remove.*next retain"):
        assert ck.retain([1]) == [3]
    assert ck.steps() == [0, 1, 2, 4, 5, 6, 7]
    monkeypatch.setattr(os, "unlink", real_unlink)
    assert ck.retain({1}) == [2]
    assert ck.retain([]) == [0, 1]
    assert ck.steps() == [4, 5, 6, 7]
    reader = DeltaCheckpointer(tmp_path)
    for s in reader.steps():
        assert_exact(reader.load(s), truth[s])
    ck.close()
    with DeltaCheckpointer(tmp_path) as other:
        other.save(8, _state(8))
        with pytest.raises(lcckpt.ConcurrentWriteError):
            DeltaCheckpointer(tmp_path).retain([])



@settings(max_examples=25, deadline=None)
@given(n=st.integers(1, 9), every=st.integers(1, 4), data=st.data())
def test_retain_of_any_steps_leaves_each_kept_step_as_it_was(tmp_path_factory, n, every,
                                                             data):
    """Whatever the chain's keyframes and the steps kept, every kept step and the newest
    load as before retain, the steps removed are exactly those no kept step needs, and
    a save after it continues the chain."""
    d = tmp_path_factory.mktemp("retain")
    ck = DeltaCheckpointer(d, keyframe_every=every)
    for step in range(n):
        ck.save(step, {"w": _state(step)["model"]["w"]})
    keep = data.draw(st.sets(st.integers(0, n - 1)))
    truth = {s: ck.load(s) for s in keep | {n - 1}}
    needed = set()
    for s in keep | {n - 1}:
        while s not in needed:
            needed.add(s)
            if ck.info(s)["kind"] == "keyframe":
                break
            s = ck.info(s)["base"]["step"]
    assert ck.retain(keep) == sorted(set(range(n)) - needed)
    assert ck.steps() == sorted(needed)
    for s, obj in truth.items():
        assert_exact(DeltaCheckpointer(d).load(s), obj)
    ck.save(n, {"w": _state(n)["model"]["w"]})
    assert DeltaCheckpointer(d).load(n)["w"].shape == (6000,)
    ck.close()


def test_a_chain_step_whose_directory_sync_fails_is_saved_with_a_warning(tmp_path, monkeypatch):
    """The file is in place when the directory sync fails: the step is committed, so the
    save warns instead of raising, the step loads, and the next save goes on (and syncs
    the directory again)."""
    from lcckpt.util import durable as _durable
    real, calls = _durable.fsync_dir, []

    def eio_once(directory):
        calls.append(directory)
        if len(calls) == 2:
            raise OSError(errno.EIO, "Input/output error")
        return real(directory)
    monkeypatch.setattr(_durable, "fsync_dir", eio_once)
    ck = DeltaCheckpointer(tmp_path, keep_last=2)
    ck.save(0, _state(0))
    with pytest.warns(RuntimeWarning, match="step 1 is saved, but syncing"):
        ck.save(1, _state(1))
    assert ck.last_save["step"] == 1 and ck.last_save["nbytes"] > 0
    ck.save(2, _state(2))
    assert len(calls) >= 3 and ck.steps() == [0, 1, 2]
    assert_exact(ck.load(2), DeltaCheckpointer(tmp_path).load(2))
    calls.clear()
    calls.append("the next call fails")
    with pytest.warns(RuntimeWarning, match="step 2 is merged, but syncing"):
        ck.merge()
    ck.save(3, _state(3))                       # a delta of the merged keyframe
    assert ck.info(3)["depth"] == 1 and ck.steps() == [2, 3]
    assert_exact(ck.load(3), DeltaCheckpointer(tmp_path).load(3))


def test_a_failing_directory_sync_after_the_rename_is_a_storage_error(tmp_path, monkeypatch):
    from lcckpt.util import durable as _durable

    def eio(directory):
        raise OSError(errno.EIO, "Input/output error")
    monkeypatch.setattr(_durable, "fsync_dir", eio)
    with pytest.raises(lcckpt.StorageError, match="was written, but syncing"):
        lcckpt.save({"w": torch.ones(3)}, tmp_path / "x.lcc")


def test_a_file_stores_no_sizes_its_sections_give_and_info_puts_them_back(tmp_path):
    """The per-tensor stats of every delta file would repeat each tensor's size and bits
    per element, which its section's length and shape give: header bytes in every file of
    a small model. ``info`` puts them back from the sections, for deltas and merges."""
    from lcckpt.format.container import read_container
    ck = DeltaCheckpointer(tmp_path, keyframe_every=None)
    for step in range(3):
        ck.save(step, _state(step))
    ck.merge(1)
    moved = 0
    for step, kind in ((1, "keyframe"), (2, "delta")):
        with read_container(ck.path(step)) as c:
            stored = c.meta["lcckpt_chain"]["tensors"]
            length = {s["meta"]["codec_params"]["key"]: (s["length"], s["meta"]["shape"])
                      for s in c.sections if s["meta"].get("codec") == "delta"}
        info = ck.info(step)
        assert info["kind"] == kind and set(info["tensors"]) == set(stored) == set(length)
        derived = ("nbytes", "bits_per_element", "error_vs_movement")
        for key, st in info["tensors"].items():
            assert not set(derived) & set(stored[key])
            nbytes, shape = length[key]
            assert st["nbytes"] == nbytes > 0
            assert st["bits_per_element"] == pytest.approx(8 * nbytes / math.prod(shape), rel=1e-3)
            if st.get("movement"):         # the error's share of the movement, put back
                assert st["error_vs_movement"] == pytest.approx(
                    st["rel_error"] / st["movement"], rel=1e-3)
                moved += 1
            assert {k: v for k, v in st.items() if k not in derived} == stored[key]
    assert moved


def test_a_checkpointer_or_a_manager_refuses_pickling_and_copying_by_name(tmp_path):
    """Pickled or copied, one would hold its directory's writer lock twice; the error
    said "cannot pickle '_thread.lock' object". It now names the object and what to pass
    instead, and is still a TypeError, as pickle's own refusals are."""
    import copy
    import pickle
    ck = DeltaCheckpointer(tmp_path / "a")
    ck.save(0, {"w": torch.ones(3)})
    mgr = lcckpt.CheckpointManager(tmp_path / "b", torch.nn.Linear(2, 2), every=5)
    for obj, name in ((ck, "DeltaCheckpointer"), (mgr, "CheckpointManager")):
        for attempt in (pickle.dumps, copy.copy, copy.deepcopy):
            with pytest.raises(lcckpt.NotCopiedError, match=f"a {name} cannot be pickled or "
                                                            "copied.*pass the directory"):
                attempt(obj)
    assert issubclass(lcckpt.NotCopiedError, TypeError)
    mgr.close()
    ck.close()


def test_a_first_save_whose_reference_memory_cannot_hold_warns_before_it_allocates(
        tmp_path, monkeypatch):
    """In a cgroup the kernel kills a process that runs out, silently: a chain's first
    save, which copies the state into its references, says beforehand that it may not
    fit (a warning: swap may still hold it). Later saves allocate nothing of that size."""
    from lcckpt import limits
    monkeypatch.setattr(limits, "usable_memory", lambda: (100_000, "the cgroup's memory limit"))
    state = {"w": torch.randn(50_000)}
    d = lcckpt.DeltaCheckpointer(tmp_path)
    with pytest.warns(RuntimeWarning, match="first save copies the state, about 0 MiB, and "
                      "the cgroup's memory limit leaves 0 MiB"):
        d.save(0, state)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        d.save(1, {"w": state["w"] + 0.01})
        monkeypatch.setattr(limits, "usable_memory", lambda: (1 << 30, "available RAM"))
        lcckpt.DeltaCheckpointer(tmp_path / "roomy").save(0, state)
    assert d.steps() == [0, 1]
