"""CheckpointManager(background="overlap"): checkpoints written from the live state, the
optimizers' next step waiting until the write has read it, and a torn checkpoint removed."""

import os
import threading

import pytest
import torch

import lcckpt
from lcckpt.chain.directory import file_name
from lcckpt.errors import InvalidArgumentError, StateChangedError
from lcckpt.training.manager import CheckpointManager

EXACT = {"keyframe_every": 1, "checkpointer_options": {"keyframe_coding": "raw"}}


def _setup(seed=0):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.BatchNorm1d(16),
                                torch.nn.Linear(16, 3))
    return model, torch.optim.Adam(model.parameters(), lr=1e-2)


def _train(model, opt, gen):
    x = torch.randn(4, 8, generator=gen)
    loss = model(x).pow(2).mean()
    opt.zero_grad()
    loss.backward()
    opt.step()
    return loss


def _state(model):
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _after_first_checkpoint(tmp_path):
    """A manager writing from the live state every 2 steps, its step 2 written."""
    model, opt = _setup()
    gen = torch.Generator().manual_seed(1)
    mgr = CheckpointManager(tmp_path, model, opt, every=2, background="overlap")
    for _ in range(2):
        mgr.step(_train(model, opt, gen))
    mgr.wait()
    return model, opt, gen, mgr


def _a_delta_within_targets(directory, step, state):
    """``step`` of the chain is a delta against step 2, within the targets: a share of
    the movement since step 2."""
    ck = lcckpt.DeltaCheckpointer(directory)
    assert ck.steps() == [2, step] and ck.info(step)["kind"] == "delta"
    key, back = ck.load(2)["model"], ck.load(step)["model"]
    for k, v in state.items():
        moved = (v.double() - key[k].double()).norm()
        assert (back[k].double() - v.double()).norm() <= 0.05 * moved + 1e-12, k


class _Gate:
    """Holds DeltaCheckpointer.save until released."""

    def __init__(self, monkeypatch):
        self.release, self.entered = threading.Event(), threading.Event()
        original = lcckpt.DeltaCheckpointer.save

        def save(ck, step, obj, **kw):
            self.entered.set()
            assert self.release.wait(10)
            return original(ck, step, obj, **kw)
        monkeypatch.setattr(lcckpt.DeltaCheckpointer, "save", save)


def test_overlap_writes_what_a_copy_writes_and_copies_no_parameter(tmp_path):
    states = {}
    for background in (True, "overlap"):
        model, opt = _setup()
        gen = torch.Generator().manual_seed(1)
        d = tmp_path / str(background)
        with CheckpointManager(d, model, opt, every=2, background=background,
                               backpressure="wait") as mgr:
            for _ in range(7):
                mgr.step(_train(model, opt, gen))
                copied = set(mgr._buffers._buffers)
        ck = lcckpt.DeltaCheckpointer(d)
        states[background] = [(s, ck.load(s)) for s in ck.steps()]
        if background == "overlap":        # the parameters and moments went as they are
            assert copied and not any('["model"]' in k and "weight" in k for k in copied)
            assert not any('["optimizer"]' in k for k in copied)
            assert any("running_mean" in k for k in copied)     # a forward pass changes it
            with CheckpointManager(tmp_path / "explicit", model, opt, every=100,
                                   background=background) as mgr:
                mgr.step(_train(model, opt, gen))
                mgr.checkpoint()            # taken now, in the manager's own mode
                assert not any('["optimizer"]' in k for k in mgr._buffers._buffers)
    assert [s for s, _ in states[True]] == [s for s, _ in states["overlap"]] == [2, 4, 6]
    for (_, a), (_, b) in zip(states[True], states["overlap"]):
        assert a["model"].keys() == b["model"].keys()
        assert all(torch.equal(a["model"][k], b["model"][k]) for k in a["model"])
        for i, st in a["optimizer"]["state"].items():
            assert all(torch.equal(v, b["optimizer"]["state"][i][k]) for k, v in st.items())


def test_the_optimizer_step_waits_for_the_write_of_the_live_state(tmp_path, monkeypatch):
    gate = _Gate(monkeypatch)
    model, opt = _setup()
    gen = torch.Generator().manual_seed(1)
    mgr = CheckpointManager(tmp_path, model, opt, every=2, background="overlap", **EXACT)
    seen = []
    opt.register_step_pre_hook(lambda *_: seen.append(gate.release.is_set()))  # after the manager's
    mgr.step(_train(model, opt, gen))
    mgr.step(_train(model, opt, gen))
    saved = _state(model)
    assert gate.entered.wait(5)
    threading.Timer(0.2, gate.release.set).start()
    _train(model, opt, gen)             # its forward and backward run; its step waits
    assert seen[-1] is True             # the write had started before the optimizer moved
    mgr.close()
    back = lcckpt.DeltaCheckpointer(tmp_path).load(2)["model"]
    assert all(torch.equal(back[k], v) for k, v in saved.items())
    assert mgr.stats["stall_s"] > 0


def test_the_optimizer_steps_once_the_state_is_read_before_the_file_is_synced(tmp_path,
                                                                              monkeypatch):
    model, opt = _setup()
    gen = torch.Generator().manual_seed(1)
    mgr = CheckpointManager(tmp_path, model, opt, every=2, background="overlap")
    stepped, seen, fsync = threading.Event(), [], os.fsync

    def held_fsync(fd):                 # a write's syncs wait for the optimizer's step
        stepped.wait(10)
        return fsync(fd)
    newest = lambda: mgr.last_checkpoint and (tmp_path / file_name(mgr.last_checkpoint)).exists()  # noqa: E731,E501
    opt.register_step_post_hook(lambda *_: (seen.append(newest()), stepped.set()))
    mgr.step(_train(model, opt, gen))
    stepped.set()                       # the first iteration's step, before any checkpoint
    mgr.step(_train(model, opt, gen))   # a keyframe at step 2, from the live state
    saved = _state(model)
    stepped.clear()
    monkeypatch.setattr(os, "fsync", held_fsync)
    _train(model, opt, gen)             # its step runs before the file is synced
    mgr.wait()
    monkeypatch.undo()
    assert seen[-1] is False            # step 2 was not committed yet when the optimizer moved
    assert mgr.durable_step == 2
    back = lcckpt.DeltaCheckpointer(tmp_path).load(2)["model"]
    assert all(torch.equal(back[k], v) for k, v in saved.items())
    for _ in range(2):                  # a delta at step 4, the same way
        mgr.step(_train(model, opt, gen))
    saved = _state(model)
    stepped.clear()
    monkeypatch.setattr(os, "fsync", held_fsync)
    _train(model, opt, gen)
    mgr.close()
    monkeypatch.undo()
    assert seen[-1] is False
    _a_delta_within_targets(tmp_path, 4, saved)


def test_a_write_that_fails_after_it_released_the_state_loses_only_its_step(tmp_path,
                                                                           monkeypatch):
    """The optimizer may step before the file is synced; if the sync then fails, the
    error reaches the loop, the step is not stored, and the chain goes on."""
    model, opt, gen, mgr = _after_first_checkpoint(tmp_path)
    fsync = os.fsync

    def failing(fd):
        raise OSError(5, "Input/output error (injected)")
    monkeypatch.setattr(os, "fsync", failing)
    for _ in range(2):
        mgr.step(_train(model, opt, gen))
    _train(model, opt, gen)                 # its step goes on once the state was read
    with pytest.raises(lcckpt.StorageError, match="injected"):
        mgr.wait()
    monkeypatch.setattr(os, "fsync", fsync)
    assert lcckpt.DeltaCheckpointer(tmp_path).steps() == [2] and mgr.durable_step == 2
    for _ in range(2):
        mgr.step(_train(model, opt, gen))
    mgr.close()
    _a_delta_within_targets(tmp_path, 6, _state(model))


def test_a_tensor_changed_in_place_during_the_write_removes_the_checkpoint(tmp_path,
                                                                          monkeypatch):
    model, opt, gen, mgr = _after_first_checkpoint(tmp_path)
    gate = _Gate(monkeypatch)
    for _ in range(2):
        mgr.step(_train(model, opt, gen))
    assert gate.entered.wait(5)
    with torch.no_grad():
        model[0].weight.mul_(1.0)           # not the optimizer: counted, whatever it does
    gate.release.set()
    with pytest.raises(StateChangedError, match=r'obj\["model"\]\["0.weight"\] changed .* 4'):
        mgr.wait()
    assert lcckpt.DeltaCheckpointer(tmp_path).steps() == [2] and mgr.durable_step == 2
    monkeypatch.undo()
    for _ in range(2):                      # the chain goes on from step 2
        mgr.step(_train(model, opt, gen))
    mgr.close()
    _a_delta_within_targets(tmp_path, 6, _state(model))


def test_a_torn_step_is_kept_when_retention_left_no_other(tmp_path, monkeypatch):
    model, opt = _setup()
    gen = torch.Generator().manual_seed(1)
    mgr = CheckpointManager(tmp_path, model, opt, every=1, background="overlap", keep_last=1,
                            **EXACT)              # every step a keyframe: none needs another
    mgr.step(_train(model, opt, gen))
    mgr.wait()
    gate = _Gate(monkeypatch)
    mgr.step(_train(model, opt, gen))
    assert gate.entered.wait(5)
    with torch.no_grad():
        model[2].bias.add_(0.0)
    gate.release.set()
    with pytest.raises(StateChangedError, match="only one left, was kept"):
        mgr.wait()
    assert lcckpt.DeltaCheckpointer(tmp_path).steps() == [2] and mgr.durable_step == 2
    mgr.close()


def test_an_optimizer_among_the_objects_waits_too(tmp_path, monkeypatch):
    model, opt = _setup()
    head = torch.nn.Linear(3, 2)
    other = torch.optim.SGD(head.parameters(), lr=0.1)
    gate = _Gate(monkeypatch)
    mgr = CheckpointManager(tmp_path, model, opt, every=1, background="overlap",
                            objects={"head_opt": other}, **EXACT)
    seen = []
    other.register_step_pre_hook(lambda *_: seen.append(gate.release.is_set()))
    mgr.step(1.0)
    assert gate.entered.wait(5)
    threading.Timer(0.2, gate.release.set).start()
    head(torch.randn(2, 3)).sum().backward()
    other.step()
    assert seen == [True]               # it waited for the write to start, and to read
    mgr.close()


def test_overlap_needs_the_optimizer(tmp_path):
    model, _ = _setup()
    with pytest.raises(InvalidArgumentError, match="overlap"):
        CheckpointManager(tmp_path, model, None, every=2, background="overlap")
    with pytest.raises(InvalidArgumentError, match="background"):
        CheckpointManager(tmp_path, model, None, every=2, background="Overlap")
