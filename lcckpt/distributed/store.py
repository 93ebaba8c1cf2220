"""Where a distributed checkpoint's files live: a local directory, or an fsspec filesystem
named by a URL (``s3://bucket/run``, ``gs://...``, ``memory://...``).

:func:`files_for` gives one object with DCP's file interface (``FileSystemBase``: streams,
rename, exists, ...) plus the few calls a chain and its retention need (list, size,
remove a directory, join with ``..`` resolved). The writer, the reader, the chain and its
retention use only it, so one commit protocol holds on every store:

- a rank's data file is complete when its stream closes: locally it is fsynced, remotely
  the upload finishes on close, and the writer then compares the stored size with what it
  wrote, so an upload that dropped data fails the save instead of committing it;
- ``.metadata`` is written last, to ``.metadata.tmp``, and renamed into place (DCP's rule;
  on object stores a server-side copy, which appears whole or not at all): a save that dies
  earlier leaves no new checkpoint visible and the previous one loadable.

Local paths keep DCP's own ``FileSystem`` (``pathlib`` calls), so nothing changes there.
"""

from __future__ import annotations

import os
import posixpath
import shutil
import threading
from contextlib import contextmanager

from torch.distributed.checkpoint.filesystem import FileSystem, FileSystemBase

from ..errors import InvalidArgumentError, StorageError
from ..util.paths import is_url, url_scheme

def files_for(path, storage_options: dict | None = None):
    """The store ``path`` names: :class:`LocalFiles` for a path, :class:`RemoteFiles` for a
    URL (fsspec and the filesystem's own package, e.g. s3fs, must be installed)."""
    text = os.fspath(path)
    if not is_url(text):
        if storage_options:
            raise InvalidArgumentError("storage_options apply to URLs (s3://...), not to the "
                                       f"local path {text!r}")
        return LocalFiles()
    return RemoteFiles(text, storage_options or {})


class LocalFiles(FileSystem):
    """DCP's local ``FileSystem`` plus the chain's calls."""

    remote = False

    def join(self, base, *names) -> str:
        return os.path.normpath(os.path.join(os.fspath(base), *names))

    def absolute(self, path) -> str:
        return os.path.abspath(os.fspath(path))

    def relative(self, path, base) -> str:
        return os.path.relpath(os.fspath(path), os.fspath(base))

    def dirname(self, path) -> str:
        return os.path.dirname(os.path.normpath(os.fspath(path)))

    def basename(self, path) -> str:
        return os.path.basename(os.fspath(path))

    def isdir(self, path) -> bool:
        return os.path.isdir(path)

    def listdir(self, path) -> list[str]:
        return os.listdir(path)

    def size(self, path) -> int:
        return os.path.getsize(path)

    def rmtree(self, path) -> None:
        meta = os.path.join(path, ".metadata")
        if os.path.lexists(meta):
            os.unlink(meta)
        shutil.rmtree(path)


class RemoteFiles(FileSystemBase):
    """DCP's file interface over an fsspec filesystem. Paths stay full URLs (fsspec takes
    them), with ``..`` resolved here: an object store would keep it as part of the key."""

    remote = True

    def __init__(self, url: str, storage_options: dict):
        try:
            from fsspec.core import url_to_fs  # noqa: PLC0415
        except ImportError:
            raise InvalidArgumentError(
                f"{url!r} is a URL: install fsspec (and its filesystem's package, e.g. s3fs "
                "for s3://) to save to object storage, or pass a local directory") from None
        try:
            self.fs, _ = url_to_fs(url, **storage_options)
        except (ImportError, ValueError) as e:
            raise InvalidArgumentError(f"cannot open {url!r} with fsspec: {e}") from None
        self.protocol = url_scheme(url)
        self.url, self.storage_options = url, storage_options

    def __getstate__(self):                 # process-mode async saves pickle the writer
        return {"url": self.url, "storage_options": self.storage_options}

    def __setstate__(self, state):
        self.__init__(state["url"], state["storage_options"])

    # -- DCP's interface
    @contextmanager
    def create_stream(self, path, mode: str):
        path = str(path)
        with self.fs.open(path, mode) as stream:
            try:
                yield stream
            except BaseException:
                if "r" not in mode:            # never leave a partial object behind
                    try:
                        self.fs.rm_file(path)
                    except (OSError, ValueError):
                        pass
                raise

    def concat_path(self, path, suffix: str) -> str:
        return self.join(path, suffix)

    def init_path(self, path) -> str:
        return self.join(str(path))

    def rename(self, path, new_path) -> None:
        self.fs.mv(str(path), str(new_path))

    def mkdir(self, path) -> None:
        self.fs.makedirs(str(path), exist_ok=True)

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id) -> bool:
        return is_url(checkpoint_id)

    def exists(self, path) -> bool:
        self.fs.invalidate_cache(str(path))   # another rank or process may have written it
        return self.fs.exists(str(path))

    def rm_file(self, path) -> None:
        self.fs.rm_file(str(path))

    # -- the chain's calls
    def join(self, base, *names) -> str:
        prefix = f"{self.protocol}://"
        rest = str(base)[len(prefix):] if str(base).startswith(prefix) else str(base)
        return prefix + posixpath.normpath(posixpath.join(rest, *names)).lstrip("/")

    absolute = join

    def relative(self, path, base) -> str:
        n = len(self.protocol) + 3
        return posixpath.relpath("/" + self.join(path)[n:], "/" + self.join(base)[n:])

    def dirname(self, path) -> str:
        return self.join(path, "..")

    def basename(self, path) -> str:
        return posixpath.basename(str(path))

    def isdir(self, path) -> bool:
        self.fs.invalidate_cache(str(path))
        return self.fs.isdir(str(path))

    def listdir(self, path) -> list[str]:
        self.fs.invalidate_cache(str(path))
        try:
            names = self.fs.ls(str(path), detail=False)
        except FileNotFoundError:
            return []
        return [posixpath.basename(n.rstrip("/")) for n in names]

    def size(self, path) -> int:
        self.fs.invalidate_cache(str(path))
        return int(self.fs.info(str(path))["size"])

    def rmtree(self, path) -> None:
        meta = self.join(path, ".metadata")
        if self.exists(meta):
            self.fs.rm_file(meta)
        self.fs.rm(str(path), recursive=True)


def remove_stale(files, path: str, ours, keep: set) -> None:
    """Remove the files in ``path`` whose names match ``ours`` (a compiled pattern) and are
    not in ``keep``; best effort."""
    try:
        names = files.listdir(path)
    except OSError:
        return
    for name in names:
        if ours.fullmatch(name) and name not in keep:
            try:
                files.rm_file(files.join(path, name))
            except OSError:
                pass


def check_size(files, path, written: int) -> None:
    """An upload is only as good as what arrived: raise if the stored object is not the
    ``written`` bytes the writer sent (a remote store that dropped unflushed data)."""
    if not files.remote:
        return
    try:
        got = files.size(path)
    except (OSError, KeyError) as e:
        raise StorageError(f"{path}: written {written} bytes, but the store cannot say what "
                           f"arrived ({e}); the save is not committed") from None
    if got != written:
        raise StorageError(f"{path}: written {written} bytes, the store holds {got}; the "
                           "save is not committed")


class Flusher:
    """Moves written bytes to the disk while the next items are encoded.

    Once ``FLUSH_BYTES`` more bytes are written, the file's data is flushed by
    ``os.fdatasync`` on a thread of its own (it releases the GIL), so the disk works
    while the CPU encodes instead of after it; :meth:`finish` waits for it and makes the
    file durable with ``os.fsync``.
    """

    FLUSH_BYTES = 16 << 20

    def __init__(self):
        self.pending_bytes = 0
        self.thread = None

    def written(self, f, n: int) -> None:
        self.pending_bytes += n
        if self.pending_bytes < self.FLUSH_BYTES or (self.thread and self.thread.is_alive()):
            return
        self.pending_bytes = 0
        f.flush()
        self.thread = threading.Thread(target=os.fdatasync, args=(f.fileno(),), daemon=True)
        self.thread.start()

    def finish(self, f) -> None:
        if self.thread is not None:
            self.thread.join()
        os.fsync(f.fileno())
