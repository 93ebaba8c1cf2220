"""lcckpt's thread pool: a deferred blob read inside a pool task (a small tensor's replay in
``settle``) reads inline instead of waiting on a pool that is busy with the caller."""

import threading

import numpy as np

import lcckpt
from lcckpt.codec import streamed
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
