"""URLs among local paths: lcckpt's own files are local, so a URL is refused by name; and
paths that are streams (a pipe), which a load reads once, in order.

``"memory://x/a.lcc"`` or ``"s3://bucket/run"`` is a valid relative path on POSIX (a
directory named ``memory:``), so a save used to create such a folder, or fail later
with a confusing "directory does not exist". ``lcckpt.distributed`` takes fsspec URLs
itself (lcckpt/distributed/store.py).
"""

from __future__ import annotations

import os
import re
import stat

from ..errors import InvalidArgumentError

_URL = re.compile(r"([A-Za-z][A-Za-z0-9+.\-]*)://")


def is_url(path) -> bool:
    """Whether ``path`` is a str that starts with a URL scheme (``s3://``, ``file://``)."""
    return isinstance(path, str) and _URL.match(path) is not None


def url_scheme(url: str) -> str:
    """The scheme of a URL (``"s3"`` of ``"s3://bucket/run"``)."""
    return _URL.match(url).group(1)


def local(path, what: str) -> str:
    """``os.fspath(path)``, or :class:`InvalidArgumentError` where it is a URL; ``what``
    names the call (``"lcckpt.save"``). A ``file://`` URL gives its path."""
    text = os.fspath(path)
    if not is_url(text):
        return text
    scheme = url_scheme(text)
    if scheme.lower() == "file":
        return text[len("file://"):]
    raise InvalidArgumentError(
        f"{what} reads and writes local files, and {text!r} is a {scheme}:// URL: use a local "
        "path and copy the files up yourself, or lcckpt.distributed (save, load, "
        "DistributedCheckpointer), which writes to fsspec URLs directly")


def distributed_hint(path) -> str | None:
    """How to read the directory ``path`` where it holds what ``lcckpt.distributed`` (or
    plain DCP) writes, for the error of a reader of lcckpt's own files; else None."""
    try:
        names = os.listdir(path)
    except OSError:
        return None
    if ".metadata" in names:
        return ("it holds a distributed checkpoint: lcckpt.distributed.load({}, directory) "
                "reads it whole, `lcckpt convert` writes it as one file")
    if any(re.fullmatch(r"step_\d{10}", n) for n in names):
        return ("it holds a DistributedCheckpointer's steps: lcckpt.distributed."
                "DistributedCheckpointer(directory).load({}) reads the newest whole")
    return None


def is_stream(path: str) -> bool:
    """Whether ``path`` is a pipe, a character device or a socket (``/dev/stdin`` fed by a
    pipe): bytes read once, in order, where a file can be read at any offset."""
    try:
        mode = os.stat(path).st_mode
    except OSError:
        return False
    return stat.S_ISFIFO(mode) or stat.S_ISCHR(mode) or stat.S_ISSOCK(mode)
