"""The one decorator of lcckpt's compiled kernels: Numba's ``njit(cache=True, nogil=True)``
with a disk cache that stays consistent when several processes compile at once.

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
file, a filesystem without locks) saves keep the safe order without it.
"""

from __future__ import annotations

import contextlib
import itertools
import os

from numba import njit
from numba.core.caching import IndexDataCacheFile

__all__ = ["kernel", "CACHE_LOCK", "GuardedIndex"]

CACHE_LOCK = ".lcckpt-numba-cache.lock"


class GuardedIndex(IndexDataCacheFile):
    """Numba's index and data files, saved under the cache directory's lock, data first."""

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


@contextlib.contextmanager
def _locked(directory: str):
    try:
        import fcntl
    except ImportError:             # no flock here: the order alone
        yield
        return
    flags = os.O_RDWR | os.O_CREAT | getattr(os, "O_NOFOLLOW", 0)
    try:
        fd = os.open(os.path.join(directory, CACHE_LOCK), flags, 0o644)
    except OSError:                 # a cache we may write but not lock in: the order alone
        yield
        return
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
        except OSError:             # a filesystem without locks (ENOLCK): the order alone
            pass
        yield
    finally:
        os.close(fd)                # closing the fd drops the flock


def _guard(dispatcher):
    cache = getattr(dispatcher, "_cache", None)
    old = getattr(cache, "_cache_file", None)
    if isinstance(old, IndexDataCacheFile) and not isinstance(old, GuardedIndex):
        new = GuardedIndex.__new__(GuardedIndex)
        new.__dict__.update(old.__dict__)
        cache._cache_file = new
    return dispatcher


def kernel(fn=None, **options):
    """``@kernel`` or ``@kernel(inline="always", ...)``: ``njit(cache=True, nogil=True,
    **options)`` whose disk cache is saved under a lock (see the module)."""
    def wrap(f):
        return _guard(njit(cache=True, nogil=True, **options)(f))
    return wrap if fn is None else wrap(fn)
