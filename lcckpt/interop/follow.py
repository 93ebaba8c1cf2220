"""``lcckpt.load``: the file format's :func:`~lcckpt.format.serialization.load`, which
also follows a file that holds a chain step's place (a pointer file,
``LcckptCheckpointIO(chain=...)``, lcckpt/chain/pointer.py) to the whole checkpoint,
and reads a chain's delta file as its step. The format layer knows no chains, so the
following happens here."""

from __future__ import annotations

import os
from typing import Any, BinaryIO

from .. import limits
from ..chain.directory import delta_step
from ..chain.pointer import POINTER, in_header, resolve
from ..format.container import open_file, read_container
from ..errors import LcckptError
from ..format import serialization
from ..util.paths import is_stream, local
from ..util.caller import warn_user

FOLLOW = """
    ``follow``: a file that holds a chain step's place (a pointer file, written by
    ``LcckptCheckpointIO(chain=...)``) loads as the whole checkpoint: its own small state
    with the parts the step holds, restored from the chain it points at (a directory
    relative to the file; ``max_bytes`` and ``into`` apply there too). False gives the
    file's own dict, as does a file object (with a warning: it has no directory to find
    the chain from). A chain's delta file loads as its step, replayed by the chain
    directory it sits in (a copy moved out of it is a ``BrokenChainError``).
"""


def load(f: str | os.PathLike | BinaryIO, map_location=None, pickle_module=None, *,
         weights_only: bool | None = None, mmap: bool | None = None,
         max_bytes=limits.DEFAULT, into: Any = None, follow: bool = True,
         **pickle_load_args) -> Any:
    kw = dict(weights_only=weights_only, mmap=mmap, max_bytes=max_bytes, **pickle_load_args)
    path = local(f, "lcckpt.load") if isinstance(f, (str, os.PathLike)) else None
    if path is not None and is_stream(path):    # a pipe: read once, as a file object is
        with open_file(path) as fh:
            return serialization.load(fh, map_location, pickle_module, into=into, **kw)
    if not follow:
        return serialization.load(f, map_location, pickle_module, into=into, **kw)
    place = _place(path) if path is not None else None
    if place == "pointer":                              # the step's tensors go into `into`
        state = serialization.load(path, map_location, pickle_module, **kw)
        return resolve(state, path, map_location, into=into, max_bytes=max_bytes)
    if isinstance(place, int) and not mmap:             # a chain's delta: its step
        from ..chain.checkpointer import DeltaCheckpointer
        return DeltaCheckpointer(os.path.dirname(os.path.abspath(path))).load(
            place, map_location=map_location, into=into, max_bytes=max_bytes)
    obj = serialization.load(f, map_location, pickle_module, into=into, **kw)
    if not (isinstance(obj, dict) and POINTER in obj):
        return obj
    if path is not None:                                # written before headers named it
        return resolve(obj, path, map_location, into=into, max_bytes=max_bytes)
    warn_user("this file holds a chain step's place, not the step's tensors: load it "
              "by its path to get the whole checkpoint (the chain is found from the "
              "file's directory)")
    return obj


load.__doc__ = serialization.load.__doc__.rstrip() + "\n" + FOLLOW + "    "


def _place(path: str) -> str | int | None:
    """``"pointer"`` where ``path`` is an lcckpt file whose header names a chain step, the
    step where it is a chain's delta file in its directory, else None."""
    try:
        with read_container(path) as c:
            meta = c.meta
        ref = in_header(meta, path)
    except (LcckptError, OSError):       # not one, or damaged: serialization.load says
        return None
    return "pointer" if ref is not None else delta_step(meta, path)
