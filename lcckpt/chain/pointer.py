"""A checkpoint file that holds a chain step's place instead of its tensors: the files of
``LcckptCheckpointIO(chain=...)`` (lcckpt/training/lightning.py) keep a trainer's small
state and ``{"chain": <directory relative to the file>, "step": <step>}`` under
:data:`POINTER`, in the object and in the header's metadata (read without decoding)."""

from __future__ import annotations

import json
import os

from .. import limits
from ..errors import CorruptDataError, NotFoundError

POINTER = "lcckpt_chain_step"
OLD_POINTER_MAX = 1 << 20     # a file without the header's pointer is loaded if this small


def checked(ref, path: str) -> dict:
    """``ref`` if it is a pointer, else :class:`CorruptDataError` naming ``path``."""
    if not isinstance(ref, dict) or type(ref.get("chain")) is not str \
            or type(ref.get("step")) is not int:
        raise CorruptDataError(f"{path}: its chain reference {ref!r:.80} is not one")
    return ref


def metadata(state: dict) -> dict | None:
    """The header metadata of a file holding ``state``: its pointer, if it has one."""
    ref = state.get(POINTER)
    return None if ref is None else {POINTER: json.dumps(ref)}


def in_header(meta: dict, path: str) -> dict | None:
    """The checked pointer that a container's ``meta`` names in its metadata, or None (a
    chain's own step, or a file whose header names none)."""
    from ..format.serialization import METADATA_KEY
    if "lcckpt_chain" in meta:
        return None                               # a chain's own step
    held = meta.get(METADATA_KEY)
    text = held.get(POINTER) if isinstance(held, dict) else None
    if text is None:
        return None
    try:
        return checked(json.loads(text) if isinstance(text, str) else None, path)
    except ValueError:
        raise CorruptDataError(f"{path}: its chain reference {text!r:.80} is not one") \
            from None


def pointer_of(path: str, load_old: bool = False) -> dict | None:
    """The checked pointer of the lcckpt file at ``path``, from its header, or None.
    ``load_old``: a file whose header names none (written before headers did) is loaded
    when it is at most :data:`OLD_POINTER_MAX` bytes and not a chain's own step."""
    from ..format.container import read_container
    from ..format.serialization import load
    with read_container(path) as c:
        ref = in_header(c.meta, path)
        old = ref is None and load_old and c.size <= OLD_POINTER_MAX \
            and "lcckpt_chain" not in c.meta
    if not old:
        return ref
    obj = load(path)
    ref = obj.get(POINTER) if isinstance(obj, dict) else None
    return None if ref is None else checked(ref, path)


def chain_of(path: str, ref: dict) -> str:
    """The chain directory that ``ref``, read from the file at ``path``, names."""
    return os.path.normpath(os.path.join(os.path.dirname(os.path.abspath(path)), ref["chain"]))


def resolve(state, path: str, map_location=None, ck=None, into=None,
            max_bytes=limits.DEFAULT):
    """``state``, read from the file at ``path``, with the parts its chain step holds in
    place of its pointer (``state`` itself if it has none). ``ck``: the chain's writer,
    which keeps the references this load decodes and goes on from them
    (``load(resume=True)``); else a reader opened and closed here. ``into`` and
    ``max_bytes``: :meth:`DeltaCheckpointer.load`'s, for the step."""
    from .checkpointer import DeltaCheckpointer
    ref = state.get(POINTER) if isinstance(state, dict) else None
    if ref is None:
        return state
    directory = chain_of(path, checked(ref, path))
    reader = DeltaCheckpointer(directory) if ck is None else None
    try:
        if ref["step"] not in (ck or reader).steps():
            raise NotFoundError(f"{path} points at step {ref['step']} of the chain in "
                                f"{directory}, which does not hold it (removed by keep_last?)")
        rest = {k: v for k, v in state.items() if k != POINTER}
        return {**rest, **(ck or reader).load(ref["step"], map_location=map_location,
                                              resume=ck is not None, into=into,
                                              max_bytes=max_bytes)}
    finally:
        if reader is not None:
            reader.close()


def pointed_step(path: str, meta: dict, size: int) -> dict:
    """What ``lcckpt inspect`` adds for the file at ``path`` of ``size`` bytes whose
    container holds ``meta``: ``points_at`` (the chain and step), and a problem if the
    chain does not hold the step; {} for other files. A file of at most
    :data:`OLD_POINTER_MAX` bytes whose header names no step (written before headers
    did) is loaded to find one (:func:`pointer_of`); one that does not load is left to
    ``verify``. A larger one is not read again."""
    from ..errors import LcckptError
    from .checkpointer import DeltaCheckpointer
    ref = in_header(meta, path)
    if ref is None and "lcckpt_chain" not in meta and size <= OLD_POINTER_MAX:
        try:
            ref = pointer_of(path, load_old=True)
        except LcckptError:
            return {}
    if ref is None:
        return {}
    where = chain_of(path, ref)
    doc = {"points_at": {"chain": where, "step": ref["step"]}}
    if ref["step"] not in DeltaCheckpointer(where).steps():
        doc["problems"] = [f"{path} points at step {ref['step']} of the chain in {where}, "
                           "which does not hold it"]
    return doc


def verify_pointed(path: str, ref: dict) -> str | None:
    """The error of the chain step that the file at ``path`` points at (every file its
    restore reads checked, every delta decoded); None if it holds."""
    from ..format.verify import verify_file
    from .checkpointer import DeltaCheckpointer
    where, step = chain_of(path, ref), ref["step"]
    ck = DeltaCheckpointer(where)
    if step not in ck.steps():
        return f"points at step {step} of the chain in {where}, which does not hold it"
    s = step
    while True:                          # the files its restore reads, newest first
        r = verify_file(ck.path(s))
        if not r["ok"]:
            return f"the chain step it points at needs {ck.path(s)}: {r['error']}"
        base = ck.info(s).get("base")
        base = base.get("step") if isinstance(base, dict) else None
        if type(base) is not int or not 0 <= base < s:
            break                        # a keyframe; a broken link the replay names
        s = base
    for _ in ck.replay(start=step, stop=step, build=False):
        pass
    return None
