"""Move checkpoints between torch.save, safetensors and lcckpt files, either way.

``detect_format`` names a file's format from its first bytes (never its extension);
``read_checkpoint`` loads any of them (or one step of a DeltaCheckpointer directory)
without running code from the file; ``write_checkpoint`` writes any of them;
``convert`` does both, so nobody is locked into lcckpt. Every tensor is kept bit for bit.
safetensors' string metadata survives a trip through an lcckpt file (it is kept in the
container header). Two things cannot be kept and are refused with a clear message
instead of being silently dropped: values that are not tensors, or nested state, going
to safetensors (a flat ``{name: tensor}`` format); and values that
``torch.load(weights_only=True)`` would refuse (numpy arrays, ...) going to torch.save.

Deliberately not done here: lossy conversion (a chain of deltas is made by
:class:`~lcckpt.DeltaCheckpointer` from a run, not from one file), and unpickling of
arbitrary objects (a torch file that needs it is refused, never executed).
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from typing import Any, Callable

import torch

from .. import limits
from ..format import serialization, sharded
from ..format.container import open_file
from ..format.torchzip import is_zip, open_zip, read_members
from ..errors import CorruptDataError, InvalidArgumentError, UnsafeObjectError
from ..util.durable import atomic_write
from ..util.paths import distributed_hint, local
from ..format.safetensors_io import read_safetensors, save_safetensors
from . import trainerdir

__all__ = ["FORMATS", "convert", "detect_format", "flat_tensors", "format_for_path",
           "load_torch", "read_checkpoint", "write_checkpoint"]

FORMATS = ("lcckpt", "torch", "safetensors")
_EXTENSIONS = {".lcc": "lcckpt", ".lcckpt": "lcckpt", ".pt": "torch", ".pth": "torch",
               ".bin": "torch", ".ckpt": "torch", ".tar": "torch", ".safetensors": "safetensors"}


def detect_format(path: str | os.PathLike) -> str:
    """"lcckpt", "torch", "safetensors", "chain" (a DeltaCheckpointer directory),
    "sharded" (a shard index, ``model.safetensors.index.json``) or "trainer" (a Hugging
    Face Trainer's ``checkpoint-N`` directory: :mod:`.trainerdir`).

    Raises :class:`CorruptDataError` for an empty file or one in no known format,
    :class:`FileNotFoundError` for a missing path.
    """
    path = os.fspath(path)
    if os.path.isdir(path):
        return "trainer" if trainerdir.is_trainer_dir(path) else "chain"
    with open(path, "rb") as f:
        head = f.read(16)
    if not head:
        raise CorruptDataError(f"{path} is empty (0 bytes): not a checkpoint")
    if sharded.is_index(path, head):
        return "sharded"
    fmt = serialization.known_format(head)
    if fmt is None:
        raise CorruptDataError(f"{path} is {serialization.unknown_format(head)}")
    return fmt


def format_for_path(path: str | os.PathLike) -> str | None:
    """The format an output path's extension asks for (None if the extension says nothing)."""
    return _EXTENSIONS.get(os.path.splitext(os.fspath(path))[1].lower())


def is_checkpoint_file(path: str) -> bool:
    """A file in a format lcckpt reads, or named like a checkpoint (a damaged one); not a
    Trainer's ``training_args.bin`` (a pickle of its arguments)."""
    if not os.path.isfile(path) or os.path.basename(path) == trainerdir.ARGS:
        return False
    try:
        detect_format(path)
    except (CorruptDataError, OSError):
        return format_for_path(path) is not None
    return True


def load_torch(path: str | os.PathLike, map_location="cpu", mmap: bool = False):
    """A torch.save file through lcckpt's weights-only loader, with a refusal that names
    the object that would have needed code to unpickle. ``mmap``: its tensors mapped, not
    read, where it is a zip (for what needs their shapes, not their values)."""
    try:
        return serialization.load(path, map_location=map_location,
                                  mmap=mmap and is_zip(os.fspath(path)))
    except UnsafeObjectError as e:       # the path and the object named: torch's cause not
        raise UnsafeObjectError(str(e)) from None   # needed (its message is a long banner)


def check_torch_crcs(path: str | os.PathLike) -> None:
    """Check the CRC-32 of every member of a torch.save zip (``torch.load`` does not, so a
    flipped bit in tensor data loads silently). Files written with
    ``torch.serialization.set_crc32_options(False)`` carry no CRCs and are not checked;
    a legacy (non-zip) file has none. Raises :class:`ChecksumError` naming the member."""
    with open_file(os.fspath(path)) as fh:
        z = open_zip(fh, os.fspath(path))
        if z is None:
            return                        # the legacy format: nothing to check
        with z:
            infos = z.infolist()
            if infos and all(i.CRC == 0 for i in infos if i.file_size):
                return                    # written without CRCs
            limit = limits.resolve(limits.DEFAULT, os.fstat(fh.fileno()).st_size)
            # a member past the limit is left to the load, which refuses it with its message
            read_members(z, [i for i in infos if limit is None or i.file_size <= limit],
                         os.fspath(path))


def read_checkpoint(path: str | os.PathLike, *, step: int | None = None,
                    map_location="cpu") -> tuple[Any, dict[str, str] | None, str]:
    """``(object, safetensors metadata or None, format)`` of any checkpoint lcckpt reads.

    ``step`` picks a step of a DeltaCheckpointer directory (default: the newest). A
    chain's delta file gives its step, replayed by the chain's directory around it.
    """
    fmt = detect_format(path)
    if step is not None and fmt != "chain":
        what = {"sharded": "shard index", "trainer": "Trainer checkpoint directory (one "
                "step)"}.get(fmt, f"{fmt} file")
        raise InvalidArgumentError(f"--step picks a step of a DeltaCheckpointer directory; "
                                   f"{path} is a {what}")
    if fmt == "chain":
        from ..chain.checkpointer import DeltaCheckpointer
        ck = DeltaCheckpointer(path)
        if not ck.steps():
            hint = distributed_hint(path)
            files = [n for n in sorted(os.listdir(path))
                     if is_checkpoint_file(os.path.join(path, n))]
            hint = hint or (files and f"it holds checkpoint files ({', '.join(files[:4])}"
                            f"{', ...' if len(files) > 4 else ''}): give one of them")
            raise CorruptDataError(f"{path} holds no checkpoints (no step-NNNNNNNNNNNN.lcc files)"
                                   + (f"; {hint}" if hint else ""))
        return ck.load(step, map_location=map_location), None, fmt
    if fmt == "safetensors":
        tensors, meta = read_safetensors(path, map_location)
        return tensors, meta, fmt
    if fmt == "sharded":                   # the shards' metadata where they all agree
        metas = []

        def shard(where):
            obj, meta, _ = read_checkpoint(where, map_location=map_location)
            metas.append(meta)
            return obj
        obj = sharded.load_index(path, shard)
        return obj, metas[0] if all(m == metas[0] for m in metas) else None, fmt
    if fmt == "torch":
        return load_torch(path, map_location), None, fmt
    if fmt == "trainer":                  # its files, each read as a checkpoint of its own
        obj = {part: read_checkpoint(f, map_location=map_location)[0]
               for part, f in trainerdir.files(path).items()}
        ranks = {i: read_checkpoint(f, map_location=map_location)[0]
                 for i, f in trainerdir.rank_rng_files(path).items()}
        if ranks:
            obj["rng_ranks"] = ranks
        return {**obj, "trainer_state": trainerdir.state_text(path)}, None, fmt
    from ..chain.pointer import POINTER
    from .follow import load
    obj = load(path, map_location=map_location)    # a file of a chain step's place, or a
    meta = serialization.read_metadata(path)        # chain's delta: the whole step
    if meta and POINTER in meta:
        meta = {k: v for k, v in meta.items() if k != POINTER} or None
    return obj, meta, fmt


def _a(name: str) -> str:
    """``name`` with its indefinite article: "an int", "a Tensor"."""
    return f"{'an' if name[:1].lower() in 'aeiou' else 'a'} {name}"


def _flat_tensors(obj, path: str) -> dict[str, torch.Tensor]:
    if not isinstance(obj, Mapping):
        raise InvalidArgumentError(
            f"safetensors stores a flat {{name: tensor}} mapping, but {path} holds a "
            f"{type(obj).__name__}; convert to .lcc or .pt instead")
    for k, v in obj.items():
        if isinstance(k, str) and isinstance(v, torch.Tensor) and v.is_meta:
            raise InvalidArgumentError(f"safetensors stores data, but {path}[{k!r}] is a meta "
                                       "tensor (no data); convert to .lcc or .pt instead")
        if not isinstance(k, str) or not isinstance(v, torch.Tensor):
            what = _a(type(v).__name__) if isinstance(k, str) else f"a key of type {type(k).__name__}"
            key = "model" if isinstance(obj.get("model"), Mapping) else "KEY"
            raise InvalidArgumentError(
                f"safetensors stores only named tensors, but {path}[{k!r}] holds {what}; "
                "convert to .lcc or .pt to keep everything, or convert a state_dict alone: "
                f"key={key!r} (lcckpt convert --key {key})")
    return dict(obj)


def _save_torch(obj, path: str) -> None:
    """torch.save to a temp file, prove that a weights-only load reads it back, then
    rename it into place (a link at ``path`` followed, as for lcckpt.save)."""
    def check(tmp: str) -> None:
        try:
            torch.load(tmp, weights_only=True, mmap=True)
        except Exception as e:
            part = "model" if isinstance(obj, Mapping) and "model" in obj else "KEY"
            raise UnsafeObjectError(
                "the torch.save file would need weights_only=False to load: it holds "
                f"objects torch's safe loader refuses ({_refused(obj, e)}); keep it as .lcc, "
                f"or convert a part without them (--key {part})") from None
    atomic_write(path, lambda f: torch.save(obj, f), through_links=True, check=check)


_SAFE_LEAVES = (torch.Tensor, int, float, complex, str, bytes, bool, type(None), torch.Size,
                torch.dtype, torch.device)


def _refused(obj, e: Exception) -> str:
    """What torch's safe loader refused in ``obj``: the global its message names, and
    where ``obj`` holds values of types other than tensors, numbers, strings and plain
    containers (the first three)."""
    m = re.search(r"Unsupported global: GLOBAL (\S+)", str(e))
    what = m.group(1) if m else str(e).splitlines()[0][:160]
    found: list[str] = []
    stack = [("", obj)]
    while stack and len(found) < 3:
        at, v = stack.pop()
        if isinstance(v, Mapping):
            stack.extend((f"{at}[{k!r}]", x) for k, x in reversed(list(v.items())))
        elif type(v) in (list, tuple):
            stack.extend((f"{at}[{i}]", x) for i, x in reversed(list(enumerate(v))))
        elif not isinstance(v, _SAFE_LEAVES):
            found.append(f"{at or 'the object'} is {_a(type(v).__module__ + '.' + type(v).__qualname__)}")
    return f"{what}: {', '.join(found)}" if found else what


def write_checkpoint(obj, path: str | os.PathLike, fmt: str, *, compress: bool = False,
                     metadata: Mapping[str, str] | None = None, source: str = "the input",
                     progress: Callable[[int], None] | None = None) -> None:
    """Write ``obj`` as ``fmt`` ("lcckpt", "torch" or "safetensors") to ``path``.

    ``compress``: lcckpt's lossless codec (lcckpt only). ``metadata``: safetensors string
    metadata, written to a safetensors file or kept in an lcckpt file's header.
    ``progress``: called with each tensor's bytes as an lcckpt file codes it (the other
    formats copy bytes as they are, at the disk's speed).
    """
    path = os.fspath(path)
    if fmt not in FORMATS:
        raise InvalidArgumentError(f"unknown format {fmt!r}; choose one of {', '.join(FORMATS)}")
    if compress and fmt != "lcckpt":
        raise InvalidArgumentError(f"--compress applies to lcckpt output, not {fmt}")
    if fmt == "torch":
        metadata = None         # torch.save has no place for it; convert() reports the loss
    if fmt == "safetensors":
        save_safetensors(_flat_tensors(obj, source), path, metadata=metadata)
    elif fmt == "torch":
        _save_torch(obj, path)
    else:
        serialization.save(obj, path, compress=compress, metadata=metadata, progress=progress)


def convert(src: str | os.PathLike, dst: str | os.PathLike, *, to: str | None = None,
            compress: bool = False, step: int | None = None, key: str | None = None,
            read: Callable[[str], Any] | None = None,
            progress: Callable[[int, int], None] | None = None) -> dict:
    """Convert ``src`` (any readable checkpoint) to ``dst``; returns what was done.

    ``to``: the output format; by default it follows ``dst``'s extension (.lcc/.lcckpt,
    .pt/.pth/.bin/.ckpt, .safetensors). ``key``: write only the value at this key path,
    its levels joined by dots (``"model"``: a training checkpoint's state_dict, as a
    safetensors file holds it). ``read``: reads ``src`` instead, a directory in a format
    of a higher layer (a distributed checkpoint, for the CLI). ``progress(nbytes, total)``:
    called as an lcckpt output codes each tensor, ``total`` the bytes of all of them.
    """
    src, dst = local(src, "lcckpt.convert"), local(dst, "lcckpt.convert")
    fmt = to or format_for_path(dst)
    if fmt is None:
        raise InvalidArgumentError(
            f"cannot tell the output format from {dst!r}: name it .lcc, .pt or .safetensors, "
            "or pass --to lcckpt|torch|safetensors")
    if os.path.exists(dst) and os.path.exists(src) and os.path.samefile(src, dst):
        raise InvalidArgumentError(f"{dst} is the input file; write to another path")
    if os.path.isdir(dst):
        raise InvalidArgumentError(f"{dst} is a directory; give an output file name")
    obj, meta, src_fmt = (read(src), None, "distributed") if read else \
        read_checkpoint(src, step=step)
    source = src if key is None else f"{src}[{key!r}]"
    if key is not None:
        obj = select(obj, key, src)
    tensors = flat_tensors(obj)
    total = stored_bytes(tensors.values()) if progress is not None else 0
    write_checkpoint(obj, dst, fmt, compress=compress, metadata=meta, source=source,
                     progress=progress and (lambda n: progress(n, total)))
    dropped = len(meta) if meta and fmt == "torch" else 0
    return {"dropped_metadata": dropped, "input": src, "input_format": src_fmt, "output": dst, "output_format": fmt,
            "input_bytes": _size(src, src_fmt), "output_bytes": os.path.getsize(dst),
            "tensors": len(tensors),
            **(_chain_step(src, step) if src_fmt == "chain" else {})}


def _chain_step(directory: str, step: int | None) -> dict:
    """Which step of a chain was written, and whether it restores exactly (a keyframe)
    or within the chain's targets (a delta)."""
    from ..chain.checkpointer import DeltaCheckpointer
    ck = DeltaCheckpointer(directory)
    step = ck.steps()[-1] if step is None else step
    return {"step": step, "step_kind": ck.info(step).get("kind")}


def select(obj, key: str, source: str):
    """The value of ``obj`` at the dotted key path ``key``: at each level the longest run
    of parts that names a key (``"model.fc.weight"`` finds a state_dict's ``"fc.weight"``;
    a dict key as ``str`` writes it, a list's index)."""
    if not isinstance(key, str) or not key:
        raise InvalidArgumentError(f"key must be a non-empty key path such as 'model', got {key!r}")
    parts, at = key.split("."), []
    while parts:
        names = {str(k): k for k in obj} if isinstance(obj, Mapping) else \
            {str(i): i for i in range(len(obj))} if isinstance(obj, (list, tuple)) else {}
        n = next((n for n in range(len(parts), 0, -1) if ".".join(parts[:n]) in names), 0)
        if not n:
            held = ", ".join(repr(k) for k in list(names)[:20]) if names else \
                f"{_a(type(obj).__name__)}, no keys"
            raise InvalidArgumentError(f"{source} has no key {key!r}: at "
                                       f"{'.'.join(at) or 'the top'} it holds {held}")
        name = ".".join(parts[:n])
        obj, parts = obj[names[name]], parts[n:]
        at.append(name)
    return obj


def _size(path: str, fmt: str) -> int:
    if fmt in ("chain", "distributed"):
        return sum(e.stat().st_size for e in os.scandir(path) if e.is_file())
    if fmt == "trainer":                         # the files read, trainer_state.json too
        return os.path.getsize(os.path.join(path, trainerdir.STATE)) + \
            sum(_size(f, detect_format(f)) for f in trainerdir.files(path).values())
    if fmt == "sharded":                         # the index and every shard it names
        base = os.path.dirname(os.path.abspath(path))
        return os.path.getsize(path) + sum(os.path.getsize(os.path.join(base, f)) for f in
                                           {shard for _, shard in sharded.read_index(path)})
    return os.path.getsize(path)


def flat_tensors(obj, prefix: str = "") -> dict[str, torch.Tensor]:
    """Key path -> tensor for every tensor of a loaded object tree (dicts, lists, tuples)
    that holds data (not a meta tensor)."""
    out: dict[str, torch.Tensor] = {}
    if isinstance(obj, torch.Tensor):
        if not obj.is_meta:
            out[prefix or "obj"] = obj
    elif isinstance(obj, Mapping):
        for k, v in obj.items():
            out.update(flat_tensors(v, f"{prefix}.{k}" if prefix else str(k)))
    elif isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            out.update(flat_tensors(v, f"{prefix}.{i}" if prefix else str(i)))
    return out


def stored_bytes(tensors) -> int:
    """The bytes a torch.save file holds for ``tensors``: each storage once (tied weights,
    views of one tensor); a sparse or nested tensor, which has no one storage, by its
    elements; a meta tensor none."""
    storages = {}
    for t in tensors:
        if t.is_meta:
            continue
        try:
            st = t.untyped_storage()
            storages[(t.device, st.data_ptr())] = st.nbytes()
        except (NotImplementedError, RuntimeError):
            storages[id(t)] = t.numel() * t.element_size()
    return sum(storages.values())
