"""``lcckpt.load``: the file format's :func:`~lcckpt.format.serialization.load`, which
also follows a file that holds a chain step's place (a pointer file,
``LcckptCheckpointIO(chain=...)``, lcckpt/chain/pointer.py) to the whole checkpoint.
The format layer knows no chains, so the following happens here."""

from __future__ import annotations

import os
import warnings
from typing import Any, BinaryIO

from .. import limits
from ..chain.pointer import POINTER, pointer_of, resolve
from ..errors import LcckptError
from ..format import serialization
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
    path = local(f, "lcckpt.load") if isinstance(f, (str, os.PathLike)) else None
    if not follow:
        return serialization.load(f, map_location, pickle_module, into=into, **kw)
    if path is not None and _points(path):              # the step's tensors go into `into`
        state = serialization.load(path, map_location, pickle_module, **kw)
        return resolve(state, path, map_location, into=into, max_bytes=max_bytes)
    obj = serialization.load(f, map_location, pickle_module, into=into, **kw)
    if not (isinstance(obj, dict) and POINTER in obj):
        return obj
    if path is not None:                                # written before headers named it
        return resolve(obj, path, map_location, into=into, max_bytes=max_bytes)
    warnings.warn("this file holds a chain step's place, not the step's tensors: load it "
                  "by its path to get the whole checkpoint (the chain is found from the "
                  "file's directory)", RuntimeWarning, stacklevel=2)
    return obj


load.__doc__ = serialization.load.__doc__.rstrip() + "\n" + FOLLOW + "    "


def _points(path: str) -> bool:
    """Whether ``path`` is an lcckpt file whose header names a chain step."""
    try:
        return pointer_of(path) is not None
    except (LcckptError, OSError):       # not one, or damaged: serialization.load says
        return False
