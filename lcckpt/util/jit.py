"""The one decorator of lcckpt's compiled kernels: Numba's ``njit(cache=True, nogil=True)``
with a disk cache that stays consistent when several processes compile at once, and
that never makes a kernel fail.

Numba keeps one index file per function (signature -> data file) beside numbered data
files, and writes the index *before* the data, reading and rewriting it without a lock.
When the source changed (an upgrade) and the ranks of a job start together, two
processes can give two signatures the same data file, or a process can read the fresh
index while the file it names still holds the old source's code for another signature.
The next call then runs code compiled for other types: a ``TypeError``, a crash, or
wrong results (``tests/attacks/numba_cache_race.py`` reproduces it with plain ``njit``).
Here each save holds an exclusive ``flock`` on a lock file in the cache directory while
it reads the index, writes the data and only then the index, so an index never names a
file that does not hold its signature's code. Loads need no lock: both files are
replaced atomically. Where the lock cannot be taken (no ``fcntl``, a read-only lock
file, a filesystem without locks, or a holder that keeps it past :data:`LOCK_WAIT`,
after which this process only tries it) saves keep the safe order without it; a forked
child never keeps it (util/forks.py).

The cache only saves compile time, so it may not cost a kernel call: a save that fails
(a full disk where the package lives, while checkpoints go elsewhere) warns once and the
kernel runs uncached, and a damaged cache file is compiled again, where plain Numba
raises from the call. Nor the import: with no writable cache directory at all the
kernels compile in every process, with one warning.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import pickle
import time

from numba import njit

try:
    from numba.core.caching import FunctionCache, IndexDataCacheFile
except ImportError:         # a Numba that moved them: its own cache, unguarded (_guard)
    FunctionCache = IndexDataCacheFile = object

from . import forks
from .caller import warn_user

__all__ = ["kernel", "CACHE_LOCK", "GuardedCache", "GuardedIndex"]

CACHE_LOCK = ".lcckpt-numba-cache.lock"
LOCK_WAIT = 20.0        # seconds a save waits for the lock (each holds it for milliseconds)

_warned = False
_stuck = False          # a save waited LOCK_WAIT in vain: later ones only try the lock


class GuardedIndex(IndexDataCacheFile):
    """Numba's index and data files, saved under the cache directory's lock, data first;
    a damaged file reads as a miss."""

    def save(self, key, data):
        with _locked(self._cache_path):
            overloads = self._load_index()          # the index as it is now, not as read
            name = overloads.get(key)               # before this process compiled
            if name is None:
                used = set(overloads.values())
                name = next(n for n in map(self._data_name, itertools.count(1))
                            if n not in used)
            self._save_data(name, data)
            overloads[key] = name
            self._save_index(overloads)

    def load(self, key):
        try:
            return super().load(key)
        except (EOFError, pickle.UnpicklingError):  # cut short or overwritten: compile
            return None                             # again (the save replaces it)


class GuardedCache(FunctionCache):
    """A kernel's cache whose failing save warns once instead of failing the call."""

    def save_overload(self, sig, data):
        try:
            super().save_overload(sig, data)
        except OSError as e:
            _warn_once(f"lcckpt could not save a compiled kernel to Numba's cache in "
                       f"{self._cache_path} ({e.strerror or e}); kernels run uncached and "
                       "compile again in every new process. Free space there, or point "
                       "NUMBA_CACHE_DIR at a writable directory")


@contextlib.contextmanager
def _locked(directory: str):
    try:
        import fcntl
    except ImportError:             # no flock here: the order alone
        yield
        return
    flags = os.O_RDWR | os.O_CREAT | getattr(os, "O_NOFOLLOW", 0)
    try:
        fd = forks.hold(os.open(os.path.join(directory, CACHE_LOCK), flags, 0o644))
    except OSError:                 # a cache we may write but not lock in: the order alone
        yield
        return
    global _stuck
    try:
        deadline = time.monotonic() + (0.0 if _stuck else LOCK_WAIT)
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() >= deadline:    # held far longer than a save takes
                    _stuck = True                   # (a stopped process): never hang a
                    break                           # job on it, nor wait again
                time.sleep(0.01)
            except OSError:         # a filesystem without locks (ENOLCK): the order alone
                break
        yield
    finally:
        forks.drop(fd)
        os.close(fd)                # closing the fd drops the flock


def _guard(dispatcher):
    cache = getattr(dispatcher, "_cache", None)
    if type(cache) is FunctionCache and type(cache._cache_file) is IndexDataCacheFile:
        guarded = GuardedCache.__new__(GuardedCache)
        guarded.__dict__.update(cache.__dict__)
        index = GuardedIndex.__new__(GuardedIndex)
        index.__dict__.update(cache._cache_file.__dict__)
        guarded._cache_file = index
        dispatcher._cache = guarded
    return dispatcher


def kernel(fn=None, **options):
    """``@kernel`` or ``@kernel(inline="always", ...)``: ``njit(cache=True, nogil=True,
    **options)`` whose disk cache is saved under a lock (see the module). Where Numba
    finds no writable cache directory (a read-only install, no writable home) the kernel
    compiles in every process instead, with one warning, where plain Numba fails the
    import."""
    def wrap(f):
        try:
            return _guard(njit(cache=True, nogil=True, **options)(f))
        except RuntimeError as e:
            if "cannot cache function" not in str(e):
                raise
            _warn_once(f"lcckpt's compiled kernels cannot be cached ({e}); they compile "
                       "in every new process (a minute or more). Point NUMBA_CACHE_DIR at a "
                       "writable directory")
            return njit(nogil=True, **options)(f)
    return wrap if fn is None else wrap(fn)


def _warn_once(message: str) -> None:
    global _warned
    if not _warned:
        _warned = True
        warn_user(message)
