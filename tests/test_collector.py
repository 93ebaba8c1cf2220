"""The garbage collector is held off while a save or a load runs in the main thread or in a
writer beside training, and left alone in other threads (lcckpt/util/collector.py)."""

import gc
import os
import threading

import pytest
import torch

import lcckpt
import lcckpt.distributed as ld
import lcckpt.distributed.api as api
from lcckpt.distributed import storage
from lcckpt.chain import restore as chain_restore
from lcckpt.distributed.planner import BalancedSavePlanner, SafeLoadPlanner
from lcckpt.training.background import Writer
from lcckpt.util import collector
from lcckpt.util.collector import paused


@pytest.fixture(autouse=True)
def collector_on():
    assert gc.isenabled(), "a test before this one left the collector off"
    yield
    assert gc.isenabled(), "the collector was left off"


def _in_thread(fn):
    out = []
    t = threading.Thread(target=lambda: out.append(fn()))
    t.start()
    t.join()
    return out[0]


def test_paused_turns_the_collector_off_and_back_on_also_on_an_error():
    with paused():
        assert not gc.isenabled()
        with paused():                       # nested: still off, and off after it
            assert not gc.isenabled()
        assert not gc.isenabled()
    assert gc.isenabled()
    with pytest.raises(KeyError):
        with paused():
            raise KeyError("x")
    assert gc.isenabled()


def test_paused_leaves_an_off_collector_off():
    gc.disable()
    try:
        with paused():
            assert not gc.isenabled()
        assert not gc.isenabled()
    finally:
        gc.enable()


def test_paused_does_nothing_outside_the_main_thread_unless_asked():
    def check(background):
        with paused(background=background):
            return gc.isenabled()
    assert _in_thread(lambda: check(False)) is True
    assert _in_thread(lambda: check(True)) is False
    assert gc.isenabled()


def test_hold_off_false_leaves_the_collector_alone(monkeypatch):
    monkeypatch.setattr(collector, "HOLD_OFF", False)
    with paused():
        assert gc.isenabled()


def test_the_writers_beside_training_save_with_the_collector_off(tmp_path):
    seen = []
    w = Writer("test-writer")
    w.start(lambda: seen.append((gc.isenabled(), threading.current_thread().name)))
    w.wait()
    assert seen == [(False, "test-writer")]
    model = torch.nn.Linear(4, 4)
    mgr = lcckpt.CheckpointManager(tmp_path, model, every=1)
    real = mgr._ck.save
    def save(*args, **kwargs):
        seen.append((gc.isenabled(), threading.current_thread() is threading.main_thread()))
        return real(*args, **kwargs)
    mgr._ck.save = save
    mgr.step()
    mgr.close()
    assert seen[1:] and all(s == (False, False) for s in seen[1:])   # in its thread, off


def _recording_codec(seen):
    def codec(path, tensor):
        seen.append(gc.isenabled())
        return "raw"
    return codec


def test_lcckpt_save_and_load_run_with_the_collector_off(tmp_path, monkeypatch):
    seen = []
    path = tmp_path / "a.lcc"
    lcckpt.save({"w": torch.ones(4)}, path, codec=_recording_codec(seen))
    assert seen == [False]
    from lcckpt.format import serialization
    real = serialization._unpack_limited
    monkeypatch.setattr(serialization, "_unpack_limited",
                        lambda *a, **k: (seen.append(gc.isenabled()), real(*a, **k))[1])
    assert torch.equal(lcckpt.load(path)["w"], torch.ones(4))
    assert seen == [False, False]
    # in another thread the collector is not touched
    _in_thread(lambda: lcckpt.save({"w": torch.ones(4)}, tmp_path / "b.lcc",
                                   codec=_recording_codec(seen)))
    assert seen[-1] is True


def test_a_chain_s_save_and_restore_run_with_the_collector_off(tmp_path, monkeypatch):
    ck = lcckpt.DeltaCheckpointer(tmp_path)
    seen = []
    ck.save(0, {"w": torch.ones(64)}, released=lambda: seen.append(gc.isenabled()))
    ck.save(1, {"w": torch.ones(64) * 2}, released=lambda: seen.append(gc.isenabled()))
    real = chain_restore.check_limits
    monkeypatch.setattr(chain_restore, "check_limits",
                        lambda *a: (seen.append(gc.isenabled()), real(*a))[1])
    assert ck.load(1)["w"].shape == (64,)
    assert seen == [False, False, False]
    # the manager's writer saves in a thread beside training: the collector stays on
    _in_thread(lambda: ck.save(2, {"w": torch.ones(64) * 3},
                               released=lambda: seen.append(gc.isenabled())))
    assert seen[-1] is True


def test_distributed_save_and_load_run_with_the_collector_off(tmp_path, monkeypatch):
    seen = []

    class Saving(BalancedSavePlanner):
        def create_local_plan(self):
            seen.append(gc.isenabled())
            return super().create_local_plan()

    class Loading(SafeLoadPlanner):
        def create_local_plan(self):
            seen.append(gc.isenabled())
            return super().create_local_plan()

    ld.save({"w": torch.arange(8.0)}, tmp_path / "d", planner=Saving())
    out = {"w": torch.zeros(8)}
    monkeypatch.setattr(api, "SafeLoadPlanner", Loading)
    ld.load(out, tmp_path / "d")
    assert torch.equal(out["w"], torch.arange(8.0))
    assert seen == [False, False]


def test_a_distributed_async_save_writes_with_the_collector_off(tmp_path, monkeypatch):
    seen = []
    real = storage.CompressedWriter._write
    def write(self, plan, planner):
        seen.append((gc.isenabled(), threading.current_thread() is threading.main_thread()))
        return real(self, plan, planner)
    monkeypatch.setattr(storage.CompressedWriter, "_write", write)
    ld.async_save({"w": torch.arange(8.0)}, tmp_path / "d").result()
    out = {"w": torch.zeros(8)}
    ld.load(out, tmp_path / "d")
    assert torch.equal(out["w"], torch.arange(8.0))
    assert seen == [(False, False)]          # in DCP's thread, off


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
def test_a_process_forked_during_a_background_pause_has_the_collector_on():
    """A DataLoader worker forked while a writer beside training holds the collector off
    ran its whole life without it: the block that turns it back on runs in the parent."""
    inside, leave = threading.Event(), threading.Event()

    def writer():
        with paused(background=True):
            inside.set()
            leave.wait(10)
    t = threading.Thread(target=writer)
    t.start()
    assert inside.wait(10) and not gc.isenabled()
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:                                    # the child: report and leave at once
        os.write(w, b"1" if gc.isenabled() else b"0")
        os._exit(0)
    os.close(w)
    said = os.read(r, 1)
    os.close(r)
    os.waitpid(pid, 0)
    leave.set()
    t.join()
    assert said == b"1" and gc.isenabled()
