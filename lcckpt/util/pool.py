"""One shared thread pool for the nogil kernels.

Numba's ``parallel=True`` threading layers abort on concurrent calls and break forked
DataLoader workers, so chunks fan out over plain Python threads instead; the kernels
release the GIL. The pool is created on first use and dropped in a forked child, whose
copy of the parent's threads does not exist.
"""

import itertools
import os
import threading
from concurrent.futures import Future, ThreadPoolExecutor, wait

import numpy as np

from ..errors import InvalidArgumentError
from . import cgroups

_lock = threading.Lock()
_pool = None
_local = threading.local()       # .worker is True on the pool's own threads
_cpus = None                     # usable CPUs, once asked


def threads() -> int:
    """Worker count: ``LCCKPT_THREADS`` if set, else :func:`cpus`."""
    env = os.environ.get("LCCKPT_THREADS", "").strip()
    if not env:
        return cpus()
    try:
        n = int(env)
    except ValueError:
        n = 0
    if n < 1:
        raise InvalidArgumentError(f"LCCKPT_THREADS must be a whole number of threads, 1 or more, "
                                   f"got {env!r}: set it so, or unset it to use every CPU")
    return n


def cpus() -> int:
    """The CPUs this process may run on: its affinity, and at most what a CPU quota of
    its cgroups allows (a container given 2 CPUs of a 64-core host: 64 threads would spend
    the quota in a fraction of each period, and the kernel would then stop every thread of
    the process, training's too, until the next). Asked once per process: a save of
    hundreds of small tensors asked thousands of times."""
    global _cpus
    if _cpus is None:
        try:
            n = max(1, len(os.sched_getaffinity(0)))
        except AttributeError:                   # pragma: no cover - non-Linux
            n = max(1, os.cpu_count() or 1)
        _cpus = min(n, cgroups.cpu_quota() or n)
    return _cpus


def _get_pool():
    global _pool
    with _lock:
        if _pool is None:
            _pool = ThreadPoolExecutor(max_workers=threads(), thread_name_prefix="lcckpt",
                                       initializer=_mark_worker)
        return _pool


def _mark_worker():
    _local.worker = True


def on_pool_thread() -> bool:
    """Whether the caller runs on one of the pool's threads (where waiting for work queued
    on the pool could deadlock it: run such work inline)."""
    return getattr(_local, "worker", False)


def submit(fn, *args) -> Future:
    """Start ``fn(*args)`` on the pool and return its future; on a pool thread (where
    waiting for a queued task could deadlock the pool) it runs inline instead, as it
    does once the interpreter is exiting (the pool then takes no more work, and a
    background save still running must finish on its own thread)."""
    return _done(fn, *args) if getattr(_local, "worker", False) else _queue(fn, *args)


def _queue(fn, *args) -> Future:
    """``fn(*args)`` queued on the pool, or run here where the pool is shut down."""
    try:
        return _get_pool().submit(fn, *args)
    except RuntimeError as e:
        if "shutdown" not in str(e):         # "cannot schedule new futures after shutdown"
            raise
        return _done(fn, *args)


def _done(fn, *args) -> Future:
    """The future of ``fn(*args)``, run here and now."""
    fut = Future()
    try:
        fut.set_result(fn(*args))
    except BaseException as e:
        fut.set_exception(e)
    return fut


def _forget_pool():
    global _pool, _lock, _cpus
    _pool = None
    _lock = threading.Lock()
    _cpus = None


os.register_at_fork(after_in_child=_forget_pool)


def run_tasks(fn, n: int):
    """Call ``fn(t)`` for ``t in range(n)`` on the pool; return the results in order.

    Work is split into at most ``threads()`` contiguous task ranges so per-task overhead
    stays small. The caller runs the first range itself, and any other that no worker
    has started by then: a caller on a pool thread never waits for work queued behind
    itself (every worker doing so would wait forever). If a task fails, or the caller is
    interrupted, the other ranges stop at their next task, and this raises once none runs.
    """
    if n <= 0:
        return []
    workers = min(threads(), n)
    if workers == 1:
        return [fn(t) for t in range(n)]
    stop = []

    def run_range(r):
        lo, hi = r * n // workers, (r + 1) * n // workers
        return [fn(t) for t in range(lo, hi) if not stop]

    futs = [_queue(run_range, r) for r in range(1, workers)]
    try:
        out = run_range(0)
        for r, f in enumerate(futs, 1):
            out.extend(run_range(r) if f.cancel() else f.result())
        return out
    except BaseException:
        stop.append(True)
        _stop(futs)
        raise


def run_balanced(fn, n: int) -> None:
    """Call ``fn(t)`` for ``t in range(n)`` on the pool, each worker taking the next ``t``
    as it finishes one (results are dropped).

    For tasks of uneven cost (chunks coded in different modes), where the contiguous
    ranges of :func:`run_tasks` can leave one worker idle while the other still has
    the expensive half; taking a task costs one atomic counter step. A failure stops
    every worker at its next task, as in :func:`run_tasks`.
    """
    workers = min(threads(), n)
    if workers <= 1 or getattr(_local, "worker", False):     # inline on a pool thread
        for t in range(n):
            fn(t)
        return
    ticket, stop = itertools.count(), []

    def work(_):
        for t in iter(ticket.__next__, None):
            if t >= n or stop:
                return
            try:
                fn(t)
            except BaseException:
                stop.append(True)
                raise
    futs = [_queue(work, r) for r in range(workers)]
    try:
        for f in futs:
            f.result()
    except BaseException:
        stop.append(True)
        _stop(futs)
        raise


def gather(futures) -> list:
    """The results of ``futures`` (of :func:`submit`), in order. If one fails, or the
    caller is interrupted while it waits (Ctrl-C), this raises only once none of them
    runs: a task still running would write into buffers its caller frees as the error
    unwinds (a Ctrl-C during ``lcckpt.save`` crashed the interpreter so)."""
    try:
        return [f.result() for f in futures]
    except BaseException:
        _stop(futures)
        raise


def _stop(futures) -> None:
    """Cancel the futures not started and wait for those that have (each ends within a
    chunk); an interrupt meanwhile is raised once they have."""
    running = [f for f in futures if not f.cancel()]
    finish(lambda: wait(running), lambda: all(f.done() for f in running))


def finish(wait_once, done) -> None:
    """Wait (``wait_once()``) until ``done()``, for threads that use the caller's buffers:
    an interrupt meanwhile (Ctrl-C, or an exception a signal handler raises) is raised
    once they have stopped."""
    interrupted = None
    while not done():
        try:
            wait_once()
        except BaseException as e:
            interrupted = interrupted or e
    if interrupted is not None:
        raise interrupted


COPY_CHUNK = 1 << 22             # elements per task of :func:`copy`


def copy(dst, src) -> None:
    """``dst[:] = src`` for flat arrays of one shape, in chunks on the pool: one thread
    copies well below what memory allows, and the copy of a large state into its
    reference is a visible part of a save."""
    per = COPY_CHUNK
    run_tasks(lambda c: np.copyto(dst[c * per:(c + 1) * per], src[c * per:(c + 1) * per]),
              -(-src.size // per))
