"""Tensors coded by two threads during a save (lcckpt/util/ahead.py, SaveSession.ahead):
the same files as one thread, errors raised where one thread raises them, and nothing
read after the save returns."""

import threading
import time

import numpy as np
import pytest
import torch

import lcckpt.chain.session as session_mod
from lcckpt import DeltaCheckpointer
from lcckpt.format import stream
from lcckpt.util import ahead as ahead_mod
from lcckpt.util.ahead import Ahead

# ------------------------------------------------------------------------------ Ahead


def _recording_jobs(n, log, delay=0.0):
    def job(i):
        log.append(("start", i, threading.current_thread().name))
        time.sleep(delay)
        log.append(("end", i))
        return i * i
    return [lambda i=i: job(i) for i in range(n)]


def test_results_come_in_order_and_both_threads_code():
    log = []
    a = Ahead(_recording_jobs(12, log, delay=0.01))
    try:
        assert [a.take(i) for i in range(12)] == [i * i for i in range(12)]
    finally:
        a.close()
    starts = [e for e in log if e[0] == "start"]
    helper = {e[2].startswith("lcckpt-ahead") for e in starts}
    assert helper == {True, False}          # the helper and the caller each coded some
    assert sorted(e[1] for e in starts) == list(range(12))


def test_no_job_starts_more_than_the_window_beyond_the_caller():
    log, taken = [], []
    jobs = _recording_jobs(10, log, delay=0.005)
    a = Ahead([lambda j=j: (log.append(("pos", taken[-1] if taken else -1)), j())[1]
               for j in jobs])
    try:
        for i in range(10):
            a.take(i)
            taken.append(i)
            time.sleep(0.01)                # the caller writing job i: the helper runs on
    finally:
        a.close()
    starts = [e for e in log if e[0] in ("pos", "start")]
    for k in range(0, len(starts), 2):      # each job logs the caller's position, then starts
        pos, (_, i, _) = starts[k][1], starts[k + 1]
        assert i <= pos + 1 + ahead_mod.WINDOW, (i, pos)


def test_a_failing_job_raises_at_its_own_take_only():
    def job(i):
        if i == 3:
            raise ValueError("job 3")
        return i
    a = Ahead([lambda i=i: job(i) for i in range(6)])
    try:
        assert [a.take(i) for i in range(3)] == [0, 1, 2]
        with pytest.raises(ValueError, match="job 3"):
            a.take(3)
        assert a.take(4) == 4
    finally:
        a.close()


def test_an_interrupt_in_the_callers_job_goes_up_at_once():
    """While the helper codes job 1, the caller codes job 2 instead of waiting; an
    interrupt there is raised by take(1), not kept for take(2)."""
    started = threading.Event()

    def job(i):
        if i == 1:
            started.set()
            time.sleep(0.3)
        if i == 2:
            raise KeyboardInterrupt
        return i
    a = Ahead([lambda i=i: job(i) for i in range(4)])
    try:
        assert a.take(0) == 0
        assert started.wait(5)              # job 1 is the helper's
        with pytest.raises(KeyboardInterrupt):
            a.take(1)
    finally:
        a.close()


def test_close_waits_for_the_helpers_job():
    started, release, done = threading.Event(), threading.Event(), []

    def slow():
        started.set()
        release.wait(5)
        done.append(True)
        return 1
    a = Ahead([lambda: 0, slow, lambda: 2])
    assert a.take(0) == 0                   # the caller codes job 0, the helper job 1
    assert started.wait(5)
    closer = threading.Thread(target=a.close)
    closer.start()
    time.sleep(0.05)
    assert closer.is_alive()                # close() waits while a job reads its inputs
    release.set()
    closer.join(5)
    assert not closer.is_alive() and done == [True]


def test_without_a_helper_thread_the_caller_codes_every_job(monkeypatch):
    def refuse(self):
        raise RuntimeError("can't create new thread at interpreter shutdown")
    monkeypatch.setattr(threading.Thread, "start", refuse)
    log = []
    a = Ahead(_recording_jobs(5, log))
    try:
        assert [a.take(i) for i in range(5)] == [0, 1, 4, 9, 16]
    finally:
        a.close()
    assert {e[2] for e in log if e[0] == "start"} == {threading.current_thread().name}


# ------------------------------------------------------------------------ the chain


def _medium_state(step: int) -> dict:
    """Tensors large enough to be coded ahead, in each float dtype, and a small one."""
    rng = np.random.default_rng(step)
    base = np.random.default_rng(0).standard_normal(40_000)
    w = base + 0.01 * step * np.random.default_rng(1).standard_normal(40_000) \
        + 0.001 * rng.standard_normal(40_000)
    n = session_mod.AHEAD_MIN
    return {"model": {f"w{k}": torch.from_numpy((w[:n + 1000 * k] * (1 + k)).astype(np.float32))
                      for k in range(5)}
            | {"h": torch.from_numpy(w[:n + 7]).to(torch.bfloat16),
               "x": torch.from_numpy(w[:n + 3].copy()),
               "small": torch.from_numpy(w[:100].astype(np.float32))},
            "step": step}


def _coders(monkeypatch) -> list:
    """The threads that code each tensor, as ``(path, thread name)``."""
    seen, real = [], session_mod.SaveSession._code

    def code(self, path, t, job):
        seen.append((path, threading.current_thread().name))
        return real(self, path, t, job)
    monkeypatch.setattr(session_mod.SaveSession, "_code", code)
    return seen


@pytest.mark.parametrize("streamed", [False, True])
def test_two_threads_write_the_files_one_thread_writes(tmp_path, monkeypatch, streamed):
    monkeypatch.setenv("LCCKPT_THREADS", "2")
    if streamed:
        monkeypatch.setattr(stream, "STREAM_ABOVE", 0)
    coders = _coders(monkeypatch)
    two = DeltaCheckpointer(tmp_path / "two", keyframe_every=3)
    for step in range(5):                   # keyframes and deltas
        two.save(step, _medium_state(step))
    helper = {p for p, name in coders if name.startswith("lcckpt-ahead")}
    assert helper and all(p.startswith('obj["model"]["w') or p.endswith('["h"]')
                          or p.endswith('["x"]') for p in helper)
    monkeypatch.setenv("LCCKPT_THREADS", "1")      # no helper
    coders.clear()
    one = DeltaCheckpointer(tmp_path / "one", keyframe_every=3)
    for step in range(5):
        one.save(step, _medium_state(step))
    assert not any(name.startswith("lcckpt-ahead") for _, name in coders)
    for step in range(5):
        assert open(one.path(step), "rb").read() == open(two.path(step), "rb").read(), step
    restored = DeltaCheckpointer(tmp_path / "two").load(4)
    assert restored["step"] == 4 and set(restored["model"]) == set(_medium_state(4)["model"])


@pytest.mark.parametrize("streamed", [False, True])
def test_no_tensor_is_read_after_the_state_is_released(tmp_path, monkeypatch, streamed):
    monkeypatch.setenv("LCCKPT_THREADS", "2")
    if streamed:
        monkeypatch.setattr(stream, "STREAM_ABOVE", 0)
    plain = DeltaCheckpointer(tmp_path / "plain")
    live = DeltaCheckpointer(tmp_path / "live")
    for step in range(3):
        plain.save(step, _medium_state(step))
        state = _medium_state(step)

        def scramble(state=state):
            for t in state["model"].values():
                t.mul_(-3.0)
        live.save(step, state, released=scramble)
        assert open(plain.path(step), "rb").read() == open(live.path(step), "rb").read()


def test_a_failed_save_returns_only_once_the_helper_is_done(tmp_path, monkeypatch):
    """The caller's tensors fail while the helper codes one: the save raises the
    caller's error once nothing codes any more."""
    monkeypatch.setenv("LCCKPT_THREADS", "2")
    ck = DeltaCheckpointer(tmp_path)
    ck.save(0, _medium_state(0))
    running, busy, real = [0], threading.Event(), session_mod.SaveSession._code

    def code(self, path, t, job):
        running[0] += 1
        try:
            if not threading.current_thread().name.startswith("lcckpt-ahead"):
                assert busy.wait(5)
                raise OSError(f"failed on {path}")
            busy.set()                      # the helper is coding: the caller fails now
            time.sleep(0.5)
            return real(self, path, t, job)
        finally:
            running[0] -= 1
    monkeypatch.setattr(session_mod.SaveSession, "_code", code)
    with pytest.raises(OSError, match="failed on"):
        ck.save(1, _medium_state(1))
    assert running == [0]                   # nothing codes after the save has raised
    assert ck.steps() == [0]
    monkeypatch.setattr(session_mod.SaveSession, "_code", real)
    ck.save(1, _medium_state(1))            # the writer resyncs and goes on
    assert ck.steps() == [0, 1] and ck.info(1)["kind"] == "delta"
