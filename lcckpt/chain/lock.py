"""The writer lock of a checkpoint directory: one writer at a time, never through a link.

An exclusive ``flock`` on ``.lcckpt-writer.lock`` in the directory, held while its fd is
open; the kernel drops it when the holder dies, so a crashed writer never blocks the
next one. The file is opened with ``O_NOFOLLOW`` and must be a regular file. On a
filesystem without file locks (``flock`` fails with ENOLCK, ENOSYS or EOPNOTSUPP) the
writer warns and goes on unlocked, as on a platform without ``fcntl``: refusing every
save there would leave no way to checkpoint at all.
"""

from __future__ import annotations

import errno
import os
import socket
import stat
import time

from ..errors import ConcurrentWriteError, StorageError
from ..util import forks
from ..util.caller import warn_user

__all__ = ["LOCK_NAME", "WriterLock", "check_free"]

LOCK_NAME = ".lcckpt-writer.lock"
# what flock says on a filesystem that has no locks (NFS without lockd, Lustre mounted
# without flock, FUSE): the writer goes on unlocked, as where fcntl is missing
NO_LOCKS = {errno.ENOLCK, errno.ENOSYS, errno.EOPNOTSUPP, getattr(errno, "ENOTSUP", -1)}


# lock files this process holds -> since when: a second writer made here learns it is
# its own (a notebook cell run twice) even before the holder has written its pid
_MINE: dict[str, int] = {}
os.register_at_fork(after_in_child=_MINE.clear)     # a forked child holds none of them


class _NoLocks(Exception):
    pass


class WriterLock:
    """An exclusive ``flock`` on the directory's lock file, held while the fd is open.

    The file holds ``pid host time`` of the holder, for the message a refused writer
    gets, and is deleted on release; one left behind is a writer's that died (the kernel
    released its lock, and the next writer takes it over: ``stale`` says whose it was).
    """

    def __init__(self, directory: str):
        self.path = os.path.join(directory, LOCK_NAME)
        self._key = os.path.realpath(self.path)
        self.pid = os.getpid()
        self.fd = None
        self.stale = None
        try:
            import fcntl
        except ImportError:          # no flock on this platform: one writer is assumed
            return
        for _ in range(100):         # until the locked file is the one at the path
            try:
                fd = self._lock_once(fcntl, directory)
            except _NoLocks as e:
                warn_user(f"{directory}: this filesystem does not support file locks ({e}); the "
                          "writer lock is off, so make sure one writer at a time saves into this "
                          "directory")
                return
            try:
                same = os.path.samestat(os.fstat(fd), os.stat(self.path))
            except FileNotFoundError:          # its holder released and deleted it
                same = False
            if same:
                break
            _MINE.pop(self._key, None)
            _close(fd)
        else:
            raise ConcurrentWriteError(f"{directory}: the writer lock keeps changing hands")
        self.stale = _read_small(fd) or None     # a writer that died holding it, if any
        since = _MINE[self._key]
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{_holder(since)}\n".encode(), 0)
        self.fd = fd

    def _lock_once(self, fcntl, directory: str) -> int:
        # never through a link: a symlink planted in a shared directory would make the
        # writer truncate and overwrite its target
        flags = os.O_RDWR | os.O_CREAT | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0)
        try:
            fd = forks.hold(os.open(self.path, flags, 0o644))   # closed in a forked child
        except OSError as e:
            if e.errno == errno.ELOOP or os.path.islink(self.path):
                raise StorageError(e.errno, "the writer lock is a symbolic link; remove it "
                                   "(lcckpt never creates one)", self.path) from None
            raise StorageError(e.errno, f"cannot create the writer lock: {e.strerror}",
                               self.path) from None
        try:
            regular = stat.S_ISREG(os.fstat(fd).st_mode)
        except OSError:
            regular = False
        if not regular:
            _close(fd)
            raise StorageError(errno.EINVAL, "the writer lock is not a regular file; remove "
                               "it", self.path)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            holder = _read_small(fd)
            _close(fd)
            if e.errno in NO_LOCKS:
                raise _NoLocks(e.strerror) from None
            if e.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                raise StorageError(e.errno, f"cannot lock the checkpoint directory: "
                                   f"{e.strerror}", self.path) from None
            if not holder and self._key in _MINE:       # ours, its pid not yet written
                holder = _holder(_MINE[self._key])
            raise ConcurrentWriteError(
                f"{directory} is being written by another DeltaCheckpointer "
                f"({_describe(holder)}); one writer per directory: stop or close() the other "
                "writer first (readers need no lock: DeltaCheckpointer(d).load() works while "
                "it writes)") from None
        _MINE[self._key] = int(time.time())
        return fd

    def held(self) -> bool:
        return self.pid == os.getpid()      # a forked child must take its own

    def release(self) -> None:
        if self.fd is not None and self.pid == os.getpid():
            try:
                os.unlink(self.path)        # while locked: a waiter re-checks the path
            except OSError:
                pass
            _MINE.pop(self._key, None)
            _close(self.fd)                 # closing the fd drops the flock
        self.fd = None


def check_free(directory: str) -> None:
    """Raise :class:`ConcurrentWriteError` now where another writer holds ``directory``'s
    lock, as its first save would (a second job started on the same run directory): the
    lock is taken and released at once."""
    if os.path.isdir(directory):
        WriterLock(directory).release()


def _close(fd: int) -> None:
    forks.drop(fd)
    os.close(fd)


def _read_small(fd: int) -> str:
    try:
        return os.pread(fd, 200, 0).decode("utf-8", "replace").strip()
    except OSError:
        return ""


def _holder(since: int) -> str:
    return f"{os.getpid()} {socket.gethostname()} {since}"


def _describe(holder: str) -> str:
    parts = holder.split()
    if len(parts) == 3 and parts[0].isdigit() and parts[2].isdigit():
        since = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(int(parts[2])))
        if int(parts[0]) == os.getpid() and parts[1] == socket.gethostname():   # a cell run twice
            return (f"one made earlier in this process, since {since}, still open: close() it "
                    "or go on with it")
        return f"pid {parts[0]} on {parts[1]}, since {since}"
    return "holder unknown"
