"""``lcckpt.load``: the file format's :func:`~lcckpt.format.serialization.load`, which
also follows a file that holds a chain step's place (a pointer file,
``LcckptCheckpointIO(chain=...)``, lcckpt/chain/pointer.py) to the whole checkpoint.
The format layer knows no chains, so the following happens here."""

from __future__ import annotations

import os
import warnings
from typing import Any, BinaryIO

from .. import limits
from ..chain.pointer import POINTER, in_header, resolve
from ..errors import LcckptError
from ..format import serialization
from ..format.container import MAGIC, read_container
from ..util.paths import local

FOLLOW = """
    ``follow``: a file that holds a chain step's place (a pointer file, written by
    ``LcckptCheckpointIO(chain=...)``) loads as the whole checkpoint: its own small state
    with the parts the step holds, restored from the chain it points at (a directory
    relative to the file; ``max_bytes`` and ``into`` apply there too). False gives the
    file's own dict, as does a file object (with a warning: it has no directory to find
    the chain from).
"""


def load(f: str | os.PathLike | BinaryIO, map_location=None, pickle_module=None, *,
         weights_only: bool | None = None, mmap: bool | None = None,
         max_bytes=limits.DEFAULT, into: Any = None, follow: bool = True,
         **pickle_load_args) -> Any:
    kw = dict(weights_only=weights_only, mmap=mmap, max_bytes=max_bytes, **pickle_load_args)
    if not follow:
        return serialization.load(f, map_location, pickle_module, into=into, **kw)
    if isinstance(f, (str, os.PathLike)) and _points(local(f, "lcckpt.load")):
        path = local(f, "lcckpt.load")                  # the step's tensors go into `into`
        state = serialization.load(path, map_location, pickle_module, **kw)
        return resolve(state, path, map_location, into=into, max_bytes=max_bytes)
    obj = serialization.load(f, map_location, pickle_module, into=into, **kw)
    if not (isinstance(obj, dict) and POINTER in obj):
        return obj
    if isinstance(f, (str, os.PathLike)):               # written before headers named it
        return resolve(obj, local(f, "lcckpt.load"), map_location, into=into,
                       max_bytes=max_bytes)
    warnings.warn("this file holds a chain step's place, not the step's tensors: load it "
                  "by its path to get the whole checkpoint (the chain is found from the "
                  "file's directory)", RuntimeWarning, stacklevel=2)
    return obj


load.__doc__ = serialization.load.__doc__.rstrip() + "\n" + FOLLOW + "    "


def _points(path: str) -> bool:
    """Whether the lcckpt file at ``path`` names a chain step in its header."""
    try:
        with open(path, "rb") as fh:
            if fh.read(len(MAGIC)) != MAGIC:
                return False
    except OSError:
        return False                     # serialization.load names what is wrong
    try:
        with read_container(path) as c:
            return in_header(c.meta, path) is not None
    except LcckptError:
        return False                     # the same: a damaged header, a bad pointer
