"""save/load: exact, pickle-free round trips of nested training state.

The object tree is walked by tree.py, each tensor leaf is coded by a section codec
(sections.py) and the result is written by container.py. ``save``/``load`` use the
default leaf encoder and decoder; :func:`pack` and :func:`unpack` take others, which is
how a checkpoint chain plugs in its delta coding. ``load`` also reads plain
``torch.save`` files through ``torch.load(weights_only=True)``, refusing anything that
would need arbitrary code.

Deliberately not done here: compression (codec modules) and delta chains (chain.py).
"""

from __future__ import annotations

import io
import os
import pickle
from collections.abc import Callable
from typing import Any, BinaryIO

import torch

from . import limits
from . import sections as _sections
from . import tree as _tree
from .container import MAGIC, Container, at_path, open_file, read_container, write_container
from .errors import (
    CorruptDataError,
    InvalidArgumentError,
    LcckptError,
    UnsafeObjectError,
    UnsupportedVersionError,
)
from .sections import register_codec

__all__ = ["load", "pack", "register_codec", "save", "unpack"]

TREE_VERSION = 1


def save(obj: Any, f: str | os.PathLike | BinaryIO, *, codec: str | Callable = "raw",
         compress: bool = False) -> None:
    """Save ``obj`` to a path (atomically) or a writable binary file, without pickle.

    ``codec``: a section codec for every tensor it handles ("raw", "lossless", or one
    registered with :func:`register_codec`), or a function ``(key_path, tensor) -> codec
    name`` choosing per tensor. ``compress=True`` is shorthand for ``codec="lossless"``
    (bit-exact byte-plane coding of every tensor).
    """
    if compress and codec == "raw":
        codec = "lossless"
    meta, sections = pack(obj, encode_leaf=_sections.leaf_encoder(codec))
    write_container(f, sections, meta)


def pack(obj: Any, *, encode_leaf: _tree.LeafEncoder | None = None
         ) -> tuple[dict, list[tuple[str, dict, Any]]]:
    """``obj`` as ``(meta, sections)`` for :func:`write_container` (what ``save`` writes).

    ``encode_leaf(key_path, tensor) -> sections.Encoded`` codes each tensor (default:
    raw). Callers may add their own keys to ``meta`` before writing; ``load`` ignores them.
    """
    tree, sections = _tree.flatten(obj, encode_leaf or _sections.leaf_encoder("raw"))
    return {"lcckpt_tree": TREE_VERSION, "tree": tree}, sections


def load(f: str | os.PathLike | BinaryIO, map_location=None, *,
         max_bytes=limits.DEFAULT) -> Any:
    """Load what :func:`save` wrote, or a plain ``torch.save`` file (weights only).

    ``map_location`` as in ``torch.load``: None (the device each tensor was saved from),
    a device string or ``torch.device`` (everything there), a dict mapping saved device
    strings to targets, or a function ``(storage, location) -> storage or None``.
    Numpy arrays always load on the host.

    ``max_bytes``: the most bytes of tensors, arrays and bytes the file may decode to,
    checked before anything is decoded (:class:`ResourceLimitError`): an int, None (no
    limit: input you trust) or "auto"; the default is :func:`lcckpt.limits.set_max_bytes`'s
    setting, "auto" (192 MiB + 32 x the file size; see lcckpt/limits.py).
    """
    if isinstance(f, (str, os.PathLike)):
        path = os.fspath(f)
        if os.path.isdir(path):
            raise InvalidArgumentError(
                f"{path!r} is a directory; a chain of checkpoints loads with "
                "lcckpt.DeltaCheckpointer(directory).load(step)")
        with open_file(path) as fh:
            head = fh.read(8)
        if _sniff(head) == "torch":
            return _torch_load(f, map_location)
        with read_container(path) as c:
            try:
                return _unpack_limited(c, map_location, max_bytes, path)
            except LcckptError as e:
                raise at_path(e, path) from None
    if not hasattr(f, "read"):
        raise InvalidArgumentError(f"load needs a path or a binary file object, got {type(f).__name__}")
    if not f.seekable():
        f = io.BytesIO(f.read())
    pos = f.tell()
    head = f.read(8)
    f.seek(pos)
    if _sniff(head) == "torch":
        return _torch_load(f, map_location)
    with read_container(f) as c:
        return _unpack_limited(c, map_location, max_bytes, "the file")


def _unpack_limited(c: Container, map_location, max_bytes, what: str):
    limits.check(limits.declared_bytes(c.sections), c.size, max_bytes, what)
    return unpack(c, map_location)


def _sniff(head: bytes) -> str:
    if head[: len(MAGIC)] == MAGIC:
        return "lcckpt"
    if head[:4] == b"PK\x03\x04":  # torch.save's zip format
        return "torch"
    if head[:1] == b"\x80" and head[1:2] in (b"\x02", b"\x03", b"\x04", b"\x05"):  # legacy pickle
        return "torch"
    return "lcckpt"  # let the container reader name the problem (empty, truncated, bad magic)


def _torch_load(f, map_location):
    try:
        return torch.load(f, map_location=map_location, weights_only=True)
    except pickle.UnpicklingError as e:
        if "weights only" in str(e).lower():
            raise UnsafeObjectError(
                "refused to load a torch.save file that needs arbitrary code to unpickle "
                f"({str(e).splitlines()[0][:200]}). Load it with torch.load(weights_only=False) "
                "only if you trust its source, then re-save it with lcckpt.save."
            ) from e
        raise CorruptDataError(f"damaged torch.save file: {e}") from e
    except LcckptError:
        raise
    except Exception as e:  # torch reports damage with many exception types
        raise CorruptDataError(f"damaged or unreadable torch.save file: {type(e).__name__}: {e}") from e


def unpack(container: Container, map_location=None,
           decode_leaf: _tree.LeafDecoder | None = None) -> Any:
    """Rebuild the object that :func:`pack` stored in ``container``.

    ``decode_leaf(key_path, container, index, meta)`` decodes each tensor section
    (default: :func:`lcckpt.sections.decode_leaf`).
    """
    meta = container.meta
    version = meta.get("lcckpt_tree")
    if version is None or "tree" not in meta:
        raise CorruptDataError("this lcckpt file holds no saved object (no 'lcckpt_tree' in its meta)")
    if type(version) is not int or version < 1:
        raise CorruptDataError(f"invalid tree version {version!r}")
    if version > TREE_VERSION:
        raise UnsupportedVersionError(
            f"object tree version {version}, this build reads up to {TREE_VERSION}: upgrade lcckpt"
        )
    return _tree.unflatten(meta["tree"], container, decode_leaf or _sections.decode_leaf,
                           map_location)
