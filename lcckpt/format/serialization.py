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
import re
from collections.abc import Callable
from typing import Any, BinaryIO

import torch

from ..codec import dtypes
from .. import limits
from . import sections as _sections
from . import sharded as _sharded
from . import stream as _stream
from . import tree as _tree
from . import torchglobals as _torchglobals
from .container import MAGIC, Container, at_path, open_file, read_container, write_container
from .census import census, tensor_paths
from .flatten import renumber_sections
from .into import Into
from ..util import durable as _durable
from ..util.paths import distributed_hint, local
from ..errors import (
    BrokenChainError, CorruptDataError, InvalidArgumentError, LcckptError, TruncatedError,
    UnsafeObjectError, UnsupportedVersionError,
)
from .safetensors_io import place as _place_st
from .safetensors_io import is_safetensors, load_safetensors, map_safetensors
from .torchzip import check_before_load
from .sections import register_codec, register_section_codec
from ..util.caller import warn_user
from ..util.collector import pausing

__all__ = ["load", "pack", "read_metadata", "register_codec", "register_section_codec", "save",
           "tree_of", "unpack"]

TREE_VERSION = 7  # the newest tree version read; files are written with the lowest that fits


@pausing
def save(obj: Any, f: str | os.PathLike | BinaryIO, pickle_module=None, pickle_protocol=None, *,
         codec: str | Callable = "raw", compress: bool = False,
         metadata: dict[str, str] | None = None, progress: Callable[[int], None] | None = None,
         **torch_save_args) -> None:
    """Save ``obj`` to a path (atomically) or a writable binary file, without pickle.
    A symbolic link at the path is followed, as ``torch.save``'s ``open`` follows it.

    ``torch.save``'s other arguments are taken, so that its calls run unchanged, and
    change nothing, as nothing is pickled: ``pickle_module`` (None or ``pickle``: another
    module, such as dill, would be asked to store what lcckpt refuses),
    ``pickle_protocol``, ``_use_new_zipfile_serialization``, ``_disable_byteorder_record``.

    ``codec``: a section codec for every tensor it handles ("raw", "lossless", or one
    registered with :func:`register_section_codec`), or a function ``(key_path, tensor) -> codec
    name`` choosing per tensor. ``compress=True`` is shorthand for ``codec="lossless"``
    (bit-exact byte-plane coding of every tensor, and of every numeric numpy array; one
    whose blob would not be smaller than its bytes, such as a small tensor, is stored
    raw, as is a large constant past what a load's default limit allows: docs/format.md,
    "Limits"). ``metadata``: string pairs stored in
    the header, readable with :func:`read_metadata` without decoding anything (as
    safetensors' ``__metadata__``). ``progress``: called with each tensor's (or coded
    array's) bytes once it is coded, for a progress bar. Saved to a path, an object of
    64 MiB of tensors or more goes to the file one tensor at a time, as each is coded or
    copied off its device, the header last (docs/format.md, "Headers written last"): what
    is held beside the object is one tensor's section, not all of them.
    """
    _check_save_args(pickle_module, pickle_protocol, torch_save_args)
    if compress and codec == "raw":
        codec = "lossless"
    if not isinstance(f, (str, os.PathLike)) and (not hasattr(f, "write")
                                                  or isinstance(f, io.TextIOBase)):
        raise InvalidArgumentError(f"save needs a path or a binary file object, got "
                                   f"{_kind_of(f)}: open the file with 'wb'")
    extra = {} if metadata is None else {METADATA_KEY: _check_metadata(metadata, "metadata")}
    encode_leaf = _sections.leaf_encoder(codec)
    if progress is not None:
        encode_leaf = _counted(encode_leaf, progress)
    arrays = codec == "lossless"           # numeric numpy arrays coded too (compress=True)
    to_path = isinstance(f, (str, os.PathLike))
    f = local(f, "lcckpt.save") if to_path else f
    if to_path and f.lower().endswith(".safetensors"):
        warn_user(f"{f}: lcckpt.save writes lcckpt's format, which safetensors cannot "
                  "read; name it .lcc, or write safetensors with lcckpt.save_safetensors")
    count, nbytes = census(obj) if to_path else (0, 0)
    if to_path and nbytes >= _stream.STREAM_ABOVE:    # written as it is coded
        def write(out) -> None:    # each tensor's section to the file once coded (or copied
            stream = _stream.SectionStream(out, _stream.first_room(count, nbytes))  # off a device)
            coder = stream.wrap(encode_leaf)
            meta, sections = pack(obj, encode_leaf=coder, encode_array=coder if arrays else None)
            stream.finish({**meta, **extra}, sections, renumber_sections)
        _durable.atomic_write(f, write, through_links=True)
        return
    meta, sections = pack(obj, encode_leaf=encode_leaf,
                          encode_array=encode_leaf if arrays else None)
    if to_path:             # a link at the name is followed, as torch.save's open follows it
        _durable.atomic_write(f, lambda out: write_container(out, sections, {**meta, **extra}),
                              through_links=True)
    else:
        write_container(f, sections, {**meta, **extra})


def _counted(encode_leaf, progress: Callable[[int], None]):
    """``encode_leaf`` reporting each leaf's bytes (a tensor's or an array's) to ``progress``."""
    def encode(path, t):
        out = encode_leaf(path, t)
        progress(int(t.nbytes))
        return out
    return encode


METADATA_KEY = "metadata"


def read_metadata(f: str | os.PathLike | BinaryIO) -> dict[str, str] | None:
    """The ``metadata`` given to :func:`save` (None if none), reading only the header."""
    with read_container(f) as c:
        return metadata_of(c.meta)


def metadata_of(header: dict) -> dict[str, str] | None:
    """The ``metadata`` given to :func:`save`, from a container's header (None if none)."""
    value = header.get(METADATA_KEY)
    if value is None:
        return None
    try:
        return _check_metadata(value, "metadata")
    except InvalidArgumentError as e:
        raise CorruptDataError(f"the file's header holds invalid {e}") from None


def _check_metadata(value, what: str) -> dict[str, str]:
    if not isinstance(value, dict) or not all(
            type(k) is str and type(v) is str for k, v in value.items()):
        raise InvalidArgumentError(f"{what} must be a dict of str to str")
    return dict(value)


def pack(obj: Any, *, encode_leaf: _tree.LeafEncoder | None = None,
         pack_small: _tree.PackRule | None = None,
         encode_pack: _tree.LeafEncoder | None = None,
         ahead: _tree.Lookahead | None = None, encode_array: _tree.LeafEncoder | None = None
         ) -> tuple[dict, list[tuple[str, dict, Any]]]:
    """``obj`` as ``(meta, sections)`` for :func:`write_container` (what ``save`` writes).

    ``encode_leaf(key_path, tensor) -> sections.Encoded`` codes each tensor (default:
    raw). ``pack_small(key_path, tensor)``: tensors stored together, one section per
    dtype and device, coded by ``encode_pack``; ``ahead``: told the tensors
    ``encode_leaf`` will be asked for; ``encode_array``: codes numeric numpy arrays (see
    :func:`lcckpt.format.tree.flatten`).
    Callers may add their own keys to ``meta`` before writing; ``load`` ignores them.
    """
    tree, sections, version = _tree.flatten(obj, encode_leaf or _sections.leaf_encoder("raw"),
                                            pack_small, encode_pack, ahead, encode_array)
    return {"lcckpt_tree": version, "tree": tree}, sections


@pausing
def load(f: str | os.PathLike | BinaryIO, map_location=None, pickle_module=None, *,
         weights_only: bool | None = None, mmap: bool | None = None,
         max_bytes=limits.DEFAULT, into: Any = None, **pickle_load_args) -> Any:
    """Load what :func:`save` wrote, a plain ``torch.save`` file (weights only), a
    ``.safetensors`` file (a dict of tensors), or a shard index as Hugging Face writes it
    (``model.safetensors.index.json``: one dict of every shard's tensors).

    Takes ``torch.load``'s arguments, with the same meaning:

    - ``map_location``: None (the device each tensor was saved from), a device string or
      ``torch.device`` (everything there), a dict mapping saved device strings to
      targets, or a function ``(storage, location) -> storage or None``. Numpy arrays
      always load on the host.
    - ``weights_only``: an lcckpt file holds no code, so every value loads whatever it
      is. For a ``torch.save`` file, None or True unpickle with torch's weights-only
      unpickler; False is refused (lcckpt never runs code from a file): call
      ``torch.load(f, weights_only=False)`` yourself if you trust the file. A
      ``.safetensors`` file holds no code either.
    - ``mmap=True`` (``f`` must be a path): uncompressed (``"raw"``) tensors are views of
      a private, copy-on-write memory map of the file instead of copies in memory; their
      checksums are still verified (which reads them once). Coded tensors are decoded.
      Passed on for a ``torch.save`` file; refused for a ``.safetensors`` file.
    - ``pickle_module`` must be None (nothing is unpickled with a module of yours);
      ``pickle_load_args`` (such as ``encoding``) go to torch's unpickler for a
      ``torch.save`` file and mean nothing for an lcckpt file.

    ``max_bytes``: the most bytes of tensors, arrays and bytes an lcckpt file may decode
    to, checked before anything is decoded (:class:`ResourceLimitError`): an int, None
    (no limit: input you trust) or "auto"; the default is
    :func:`lcckpt.limits.set_max_bytes`'s setting, "auto" (192 MiB + 32 x the file size, at most
    what the process can still allocate; see lcckpt/limits.py).

    ``into``: tensors to load into, in an object shaped like the stored one, e.g.
    ``{"model": model.state_dict()}``: each tensor there of the stored tensor's dtype
    and shape receives its values. From an lcckpt file a contiguous host one is read or
    decoded into in place (no second copy of the model), any other (on a GPU,
    ``channels_last``, a view of memory other stored tensors share) filled with a copy,
    and the result holds the targets (unless ``map_location`` puts the tensor on another
    device); a torch.save or safetensors file fills them with a copy. Targets that
    receive nothing (another dtype or shape, an ``into`` not shaped like the stored
    object) are named in a ``RuntimeWarning``; a module or an optimizer inside ``into``
    (give its ``state_dict()``) is refused. If the load fails, the targets may hold
    part of the file. Not with ``mmap``.
    """
    _check_load_args(pickle_module, pickle_load_args, weights_only, mmap, into)
    targets = None if into is None else Into.of(into)
    if isinstance(f, (str, os.PathLike)):
        return _load_path(local(f, "lcckpt.load"), map_location, weights_only, mmap,
                          pickle_load_args, max_bytes, targets)
    if not hasattr(f, "read") or isinstance(f, io.TextIOBase):
        raise InvalidArgumentError(f"load needs a path or a binary file object, got "
                                   f"{_kind_of(f)}: open the file with 'rb'")
    if mmap:
        raise InvalidArgumentError("mmap=True needs a path: a file object cannot be memory-mapped "
                                   "(torch.load refuses it too)")
    if not f.seekable():
        f = io.BytesIO(limits.read_stream(f, max_bytes, "the file"))
    pos = f.tell()
    head = f.read(16)
    f.seek(pos)
    if not head and pos > 0:    # written, and not rewound: torch.load says only EOFError
        raise InvalidArgumentError(f"nothing to read: the file object is at its end (byte "
                                   f"{pos:,}); rewind it with f.seek(0) after writing")
    fmt = _sniff(head)
    if fmt != "lcckpt":
        return _load_foreign(fmt, f, map_location, weights_only, mmap, pickle_load_args,
                             max_bytes, targets)
    with read_container(f) as c:
        return _unpack_limited(c, map_location, max_bytes, "the file", into=targets)


def _kind_of(f) -> str:
    return "a text-mode file" if isinstance(f, io.TextIOBase) else \
        f"an object of type {type(f).__name__}"


_TORCH_SAVE_ONLY = ("_use_new_zipfile_serialization", "_disable_byteorder_record")


def _check_save_args(pickle_module, pickle_protocol, torch_save_args: dict) -> None:
    if pickle_module is not None and pickle_module is not pickle:
        raise InvalidArgumentError(
            f"pickle_module={getattr(pickle_module, '__name__', pickle_module)!r}: lcckpt.save "
            "pickles nothing, so a module that pickles more cannot help; it stores tensors, "
            "containers and plain values (docs/interop.md), and names what it refuses")
    if pickle_protocol is not None and type(pickle_protocol) is not int:
        raise InvalidArgumentError(f"pickle_protocol must be an int, got {pickle_protocol!r:.40}")
    unknown = sorted(set(torch_save_args) - set(_TORCH_SAVE_ONLY))
    if unknown:
        raise InvalidArgumentError(
            f"unknown arguments {unknown}; lcckpt.save takes codec, compress, metadata, "
            "progress and torch.save's own arguments")


def _check_load_args(pickle_module, pickle_load_args: dict, weights_only, mmap, into) -> None:
    if pickle_module is not None:
        raise InvalidArgumentError(
            "lcckpt.load takes no pickle_module: lcckpt files hold no pickle, and torch.save "
            "files are read with torch's weights-only unpickler")
    if set(pickle_load_args) - {"encoding"}:
        raise InvalidArgumentError(
            f"unknown arguments {sorted(set(pickle_load_args) - {'encoding'})}; lcckpt.load "
            "takes map_location, weights_only, mmap, max_bytes, into and the unpickler's "
            "encoding")
    for name, v in (("weights_only", weights_only), ("mmap", mmap)):
        if v is not None and type(v) is not bool:
            raise InvalidArgumentError(f"{name} must be None, True or False, got {v!r:.40}")
    if into is not None and mmap:
        raise InvalidArgumentError("into= and mmap=True exclude each other: one fills your "
                                   "tensors, the other maps the file into new ones")


def _load_foreign(fmt: str, f, map_location, weights_only, mmap, pickle_load_args,
                  max_bytes=limits.DEFAULT, into: Into | None = None):
    """A torch.save or safetensors file, by what :func:`_sniff` found; ``into``'s
    targets filled with a copy of what loaded at their places."""
    if fmt == "torch":
        check_before_load(f, max_bytes)
        obj = _torch_load(f, map_location, weights_only, mmap, pickle_load_args)
    else:
        obj = _safetensors_load(f, map_location, mmap)
    if into is not None:
        for path, t in tensor_paths(obj).items():
            into.fill(path, t)
        into.warn_unfilled()
    return obj


def _unpack_limited(c: Container, map_location, max_bytes, what: str, decode_leaf=None,
                    into: Into | None = None):
    info = c.meta.get("lcckpt_chain")
    if isinstance(info, dict) and info.get("kind") == "delta":     # before the limit: a
        raise BrokenChainError(                                    # delta is tiny by design
            f"{what} is step {info.get('step')!r} of a DeltaCheckpointer chain, stored as a "
            "delta against the step before it; load it by its path in its chain's "
            "directory, or open the directory: lcckpt.DeltaCheckpointer(directory).load(step)")
    limits.check(limits.declared_bytes(c.sections), c.size, max_bytes, what,
                 in_place=into.in_place(c.sections) if into is not None else 0)
    if into is None:
        return unpack(c, map_location, decode_leaf=decode_leaf)
    obj = unpack(c, map_location, decode_leaf=_sections.decode_into(into), fill=into.fill)
    into.warn_unfilled()
    return obj


def _safetensors_load(f, map_location, mmap):
    if mmap:                     # a path (load refuses mmap for a file object before this)
        return {k: _place_st(t, map_location) for k, t in map_safetensors(f)[0].items()}
    return load_safetensors(f, map_location)


def _mapped_decoder(path, c: Container) -> _tree.LeafDecoder:
    """A leaf decoder that maps raw sections from the file (``load(mmap=True)``)."""
    size = os.path.getsize(path)
    storage = torch.UntypedStorage.from_file(os.fspath(path), shared=False, nbytes=size) \
        if size else None

    def decode(key_path: str, c: Container, i: int, meta: dict):
        s = c.sections[i]
        if meta.get("codec") != _sections.RAW or not s["length"] or s["length"] != meta["nbytes"]:
            return _sections.decode_leaf(key_path, c, i, meta)
        start = c.data_start + s["offset"]
        if start + s["length"] > size:
            raise TruncatedError(f"{key_path}: the file changed while being mapped")
        raw = torch.empty(0, dtype=torch.uint8).set_(storage, start, (s["length"],), (1,))
        c.check(i, raw.numpy())
        return raw.view(dtypes.NAME_TORCH[meta["dtype"]]).reshape(meta["shape"])

    return decode


def _directory_hint(path: str) -> str:
    """How to read the directory ``path``, by what it holds."""
    return distributed_hint(path) or \
        "a chain of checkpoints loads with lcckpt.DeltaCheckpointer(directory).load(step)"


def _load_path(path: str, map_location, weights_only, mmap, pickle_load_args, max_bytes,
               targets: Into | None):
    if os.path.isdir(path):
        raise InvalidArgumentError(f"{path!r} is a directory; {_directory_hint(path)}")
    head = _head(path)
    if _sharded.is_index(path, head):           # shards, as Hugging Face writes them
        return _load_index(path, map_location, weights_only, mmap, max_bytes, targets)
    try:
        fmt = _sniff(head)
    except LcckptError as e:
        raise at_path(e, path) from None
    if fmt != "lcckpt":
        try:
            return _load_foreign(fmt, path, map_location, weights_only, mmap,
                                 pickle_load_args, max_bytes, targets)
        except LcckptError as e:         # the cause kept: it names what torch refused
            raise at_path(e, path) from e.__cause__
    with read_container(path) as c:
        try:
            if mmap:
                return _unpack_limited(c, map_location, max_bytes, path, _mapped_decoder(path, c))
            return _unpack_limited(c, map_location, max_bytes, path, into=targets)
        except LcckptError as e:
            raise at_path(e, path) from None


def _head(path: str) -> bytes:
    with open_file(path) as fh:
        return fh.read(16)


def _load_index(path: str, map_location, weights_only, mmap, max_bytes, into: Into | None):
    """The tensors of a shard index, each shard loaded as :func:`load` loads a file."""
    obj = _sharded.load_index(path, lambda shard: load(
        shard, map_location, weights_only=weights_only, mmap=mmap, max_bytes=max_bytes))
    if into is not None:
        for key, t in tensor_paths(obj).items():
            into.fill(key, t)
        into.warn_unfilled()
    return obj


def known_format(head: bytes) -> str | None:
    """"lcckpt", "torch" or "safetensors" from a file's first 16 bytes, else None."""
    if head[: len(MAGIC)] == MAGIC:
        return "lcckpt"
    if head[:4] == b"PK\x03\x04":  # torch.save's zip format
        return "torch"
    if head[:1] == b"\x80" and head[1:2] in (b"\x02", b"\x03", b"\x04", b"\x05"):  # legacy pickle
        return "torch"
    if is_safetensors(head):
        return "safetensors"
    return None


def unknown_format(head: bytes) -> str:
    return ("not a checkpoint lcckpt knows: expected an lcckpt, torch.save or safetensors "
            f"file, found bytes {head[:8]!r}")


def _sniff(head: bytes) -> str:
    fmt = known_format(head)
    if fmt is not None:
        return fmt
    if len(head) >= len(MAGIC):
        raise CorruptDataError(unknown_format(head))
    return "lcckpt"  # let the container reader name the problem (empty, truncated)


def _torch_load(f, map_location, weights_only, mmap, pickle_load_args):
    if weights_only is False:
        raise UnsafeObjectError(
            "lcckpt.load reads torch.save files with the weights-only unpickler and never runs "
            "code from a file; weights_only=False is refused. If you trust the file, call "
            "torch.load(f, weights_only=False) yourself, then re-save it with lcckpt.save.")
    try:
        with _torchglobals.allowed():               # numpy values, dates, paths
            return torch.load(f, map_location=map_location, weights_only=True, mmap=mmap,
                              **pickle_load_args)
    except pickle.UnpicklingError as e:
        if "weights only" in str(e).lower():
            raise UnsafeObjectError(_refusal(str(e))) from e
        raise CorruptDataError(f"damaged torch.save file: {e}") from e
    except LcckptError:
        raise
    except Exception as e:  # torch reports damage with many exception types
        raise CorruptDataError(f"damaged or unreadable torch.save file: {type(e).__name__}: {e}") from e


def _refusal(torch_message: str) -> str:
    """What to say of a file that torch's weights-only unpickler refused: the object
    that needs code, named from torch's message (its first line is only a banner)."""
    m = re.search(r"Unsupported global: GLOBAL ([\w.]+)", torch_message) or \
        re.search(r"Unsupported operand \d+|Unsupported class [\w.]+", torch_message)
    what = (m.group(1) if m.groups() else m.group(0)) if m else None
    module = what is not None and what.startswith("torch.nn.modules.")
    return ("unpickling this torch.save file would run arbitrary code"
            + (f" (it needs {what})" if what else "") + "; lcckpt never does that. "
            + ("It holds a whole module (torch.save(model)): if you trust its source, load "
               "it with torch.load(f, weights_only=False) and save model.state_dict() with "
               "lcckpt.save" if module else "If you trust its source, load it with "
               "torch.load(f, weights_only=False) and re-save it with lcckpt.save"))


def unpack(container: Container, map_location=None,
           decode_leaf: _tree.LeafDecoder | None = None, fill=None) -> Any:
    """Rebuild the object that :func:`pack` stored in ``container``.

    ``decode_leaf(key_path, container, index, meta)`` decodes each tensor section
    (default: :func:`lcckpt.format.sections.decode_leaf`); ``fill`` as in
    :func:`lcckpt.format.tree.unflatten`.
    """
    return _tree.unflatten(tree_of(container.meta), container, decode_leaf or _sections.decode_leaf,
                           map_location, fill)


def tree_of(meta: dict) -> Any:
    """The object tree in a container's ``meta``, after checking its version."""
    version = meta.get("lcckpt_tree")
    if version is None or "tree" not in meta:
        raise CorruptDataError("this lcckpt file holds no saved object (no 'lcckpt_tree' in its meta)")
    if type(version) is not int or version < 1:
        raise CorruptDataError(f"invalid tree version {version!r}")
    if version > TREE_VERSION:
        raise UnsupportedVersionError(
            f"object tree version {version}, this build reads up to {TREE_VERSION}: upgrade lcckpt"
        )
    return meta["tree"]
