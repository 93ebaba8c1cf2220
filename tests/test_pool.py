"""lcckpt's thread pool: a deferred blob read inside a pool task (a small tensor's replay in
``settle``) reads inline instead of waiting on a pool that is busy with the caller; its
size from ``LCCKPT_THREADS``; work given once it is shut down (interpreter exit) runs on
the caller's thread; an error or an interrupt is raised once no task runs."""

import re
import signal
import subprocess
import sys
import threading
import time

import numpy as np
import pytest
import torch

import lcckpt
from lcckpt.codec import streamed
from lcckpt.errors import InvalidArgumentError
from lcckpt.util import pool


class _Part:
    """A PartReader over memory: ``length`` bytes of ``data``."""

    def __init__(self, data):
        self.data, self.length = data, data.size

    def read(self, offset, out):
        out[:] = self.data[offset:offset + len(out)]

    def close(self):
        pass


def test_a_deferred_blob_read_on_every_busy_pool_thread_completes(monkeypatch):
    """Every pool thread loads a blob of several read pieces: pieces queued on the pool
    would wait for a free thread forever; read inline, they finish, with the same bytes."""
    data = np.frombuffer(lcckpt.encode(np.arange(50_000, dtype=np.float32), lossless=True),
                         np.uint8)
    monkeypatch.setattr(streamed, "READ_PIECE", 4096)  # many pieces per blob
    n = pool.threads()
    barrier = threading.Barrier(max(1, n), timeout=20)
    got = []

    def outer(k):
        if n > 1:
            barrier.wait()                   # every pool thread is now inside a task
        part = _Part(data)
        p = streamed.read_header(part.read, part.length)
        buf, _ = streamed.DeferredBlob(p, part, lambda b: None, "blob").load()
        got.append(bytes(buf) == data.tobytes())

    done = threading.Event()

    def run():
        pool.run_balanced(outer, n)
        done.set()
    threading.Thread(target=run, daemon=True).start()
    assert done.wait(30), "a deferred blob's read inside pool tasks deadlocked"
    assert got == [True] * n


def test_run_tasks_on_every_busy_pool_thread_completes():
    """``run_tasks`` inside a task on every pool thread at once (a tensor replayed whole
    on a pool thread whose blobs decode over the pool): the ranges no worker started run
    on the caller, and every call returns its results in order."""
    n = pool._get_pool()._max_workers
    if n < 2:
        pytest.skip("one pool thread: nothing is queued behind another")
    barrier = threading.Barrier(n, timeout=20)
    results = []

    def outer(k):
        barrier.wait()                       # every pool thread is now inside a task
        results.append(pool.run_tasks(lambda t: t * t + k, 9))

    done = threading.Event()

    def run():
        futs = [pool._get_pool().submit(outer, k) for k in range(n)]
        for f in futs:
            f.result()
        done.set()
    threading.Thread(target=run, daemon=True).start()
    assert done.wait(30), "run_tasks inside busy pool threads deadlocked"
    assert sorted(results) == [[t * t + k for t in range(9)] for k in range(n)]


def test_run_tasks_raises_after_every_range_stopped():
    """A failing range raises in the caller, and no range runs on after it returned."""
    if pool.threads() < 2:
        return
    running, seen = threading.Lock(), []

    def task(t):
        with running:
            seen.append(t)
        if t == 0:
            raise ValueError("task 0")
        return t
    try:
        pool.run_tasks(task, 64)
    except ValueError as e:
        assert str(e) == "task 0"
    else:
        raise AssertionError("no error raised")
    after = len(seen)
    threading.Event().wait(0.05)
    assert len(seen) == after


@pytest.mark.parametrize("value", ["abc", "0", "-2", "1.5"])
def test_a_bad_thread_count_is_refused_by_name(monkeypatch, value):
    monkeypatch.setenv("LCCKPT_THREADS", value)
    with pytest.raises(InvalidArgumentError, match="LCCKPT_THREADS.*" + re.escape(repr(value))):
        pool.threads()


def test_a_thread_count_is_read_from_the_environment(monkeypatch):
    monkeypatch.setenv("LCCKPT_THREADS", " 3 ")
    assert pool.threads() == 3
    monkeypatch.setenv("LCCKPT_THREADS", "")
    assert pool.threads() == pool.cpus()


def test_work_given_a_pool_shut_down_runs_on_the_caller_s_thread(monkeypatch):
    """At interpreter exit the pool takes no more work ("cannot schedule new futures
    after shutdown"); a background save still running then runs its chunks itself."""
    monkeypatch.setenv("LCCKPT_THREADS", "2")
    monkeypatch.setattr(pool, "_pool", None)
    pool._get_pool().shutdown()
    me = threading.get_ident()
    assert pool.run_tasks(lambda t: (t, threading.get_ident()), 4) == [(t, me) for t in range(4)]
    seen = []
    pool.run_balanced(lambda t: seen.append(t), 5)
    assert sorted(seen) == list(range(5))
    assert pool.submit(lambda: threading.get_ident()).result() == me
    with pytest.raises(ValueError, match="x"):
        pool.submit(lambda: (_ for _ in ()).throw(ValueError("x"))).result()


@pytest.mark.slow
def test_a_save_in_an_atexit_handler_is_written(tmp_path):
    """``atexit`` handlers run after the pool has shut down: ``lcckpt.save`` there (a
    save-on-exit hook) raised "cannot schedule new futures after shutdown"."""
    script = ("import atexit, sys, torch, lcckpt\n"
              "w = torch.arange(3_000_000, dtype=torch.float32)\n"
              "atexit.register(lambda: lcckpt.save({'w': w}, sys.argv[1], compress=True))\n")
    path = tmp_path / "exit.lcc"
    subprocess.run([sys.executable, "-c", script, str(path)], check=True, timeout=120)
    assert torch.equal(lcckpt.load(path)["w"], torch.arange(3_000_000, dtype=torch.float32))


@pytest.mark.parametrize("how", ["run_tasks", "run_balanced", "gather"])
def test_an_interrupt_while_tasks_run_is_raised_once_none_runs(monkeypatch, how):
    """Ctrl-C while a caller waited for the pool left its tasks running on buffers that
    the unwinding caller freed: a save interrupted so crashed the interpreter (a
    segmentation fault in a lossless kernel). The interrupt now waits for them."""
    monkeypatch.setenv("LCCKPT_THREADS", "2")
    running, lock = [], threading.Lock()

    def task(t):
        with lock:
            running.append(t)
        try:
            time.sleep(0.3)
        finally:
            with lock:
                running.remove(t)
    main = threading.main_thread().ident
    timer = threading.Timer(0.1, lambda: signal.pthread_kill(main, signal.SIGINT))
    timer.start()
    try:
        with pytest.raises(KeyboardInterrupt):
            if how == "run_tasks":
                pool.run_tasks(task, 6)
            elif how == "run_balanced":
                pool.run_balanced(task, 6)
            else:
                pool.gather([pool.submit(task, t) for t in range(6)])
        assert running == []
    finally:
        timer.join()
