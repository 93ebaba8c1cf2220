"""Restoring a step: the walk back through its chain's links to a keyframe, the limits
checked over all of its files before anything is decoded, and the replay of each file
in order. The one copy of this walk: ``DeltaCheckpointer`` and the lazy reader
(``lcckpt.open``) both call it."""

from __future__ import annotations

import os
from contextlib import ExitStack

import numpy as np
import torch

from .. import limits
from ..codec.delta import Reconstruction, settle
from ..errors import BrokenChainError, CorruptDataError, LcckptError, StorageError
from ..format.container import read_container
from ..format.serialization import unpack
from ..util.collector import pausing
from .directory import ChainDirectory
from .links import FileReplay, Link, delta_key, elements


def walk(d: ChainDirectory, step: int, stack: ExitStack, known=None, max_bytes=limits.DEFAULT,
         into=None):
    """The files ``step`` is restored from, keyframe first, as ``[(container, link,
    path)]`` opened in ``stack``, each checked to be the state the next was made
    against, and all of them checked against ``max_bytes`` before anything is decoded
    (what ``DeltaCheckpointer.load`` and the lazy reader both read). ``known``:
    ``(step, state_id, tracks)`` of a restored step to stop at; returns ``(links, its
    tracks or {})``."""
    if not os.path.exists(d.path(step)):
        raise d.missing_step(step)
    links = []                           # newest first: (container, link, path)
    s, expect, tracks = step, None, {}
    while True:
        if known is not None and s == known[0] and expect == known[1]:
            tracks = known[2]
            break
        path = d.path(s)
        try:
            c = stack.enter_context(read_container(path))
            link = Link(c.meta.get("lcckpt_chain"), s, path)
        except FileNotFoundError as e:
            raise fault(step, s, path, BrokenChainError("the file is missing")) from e
        except (LcckptError, OSError) as e:
            raise fault(step, s, path, e) from e
        if expect is not None and link.state_id != expect:
            raise fault(step, s, path, BrokenChainError(
                f"it holds state {link.state_id}, but step {links[-1][1].step} was made "
                f"against state {expect}: a file of another run or a rewritten file"))
        links.append((c, link, path))
        if link.kind == "keyframe":
            break
        s, expect = link.base_step, link.base_state_id
    links.reverse()
    check_limits(links, tracks, max_bytes, into)
    return links, tracks


@pausing
def restore(d: ChainDirectory, step: int, *, build: bool, map_location=None, known=None,
            keep_tracks: bool = True, max_bytes=limits.DEFAULT, movement: bool = False,
            share: bool = False, into: dict | None = None):
    """Walk back to the keyframe (or to ``known``), then apply each file in order.

    ``known``: ``(step, state_id, tracks)`` of an already restored step to start from.
    ``keep_tracks=False``: the caller discards the returned tracks, so the restored
    tensors may take over the references instead of copying them.
    ``max_bytes``: checked for every file before anything is decoded; deltas decode
    into references of the keyframe's shapes, so the files' total size is the base.
    ``movement``: the tracks also keep their keyframes' :class:`Movement` (a writer
    resuming with "movement" targets). ``share``: the restored tensors share memory
    with the returned tracks (which a later restore from them advances in place).
    ``into``: key path -> host tensor to decode that tracked tensor into
    (:class:`~lcckpt.chain.links.FileReplay`).
    Returns ``(obj or None, [(container, link)], tracks of step)``.
    """
    with ExitStack() as stack:
        links, tracks = walk(d, step, stack, known, max_bytes, into)
        obj = None
        for i, (c, link, path) in enumerate(links):
            try:
                origin = (link.step, path)
                if build and i == len(links) - 1:
                    replay = FileReplay(tracks, copy=keep_tracks and not share,
                                        movement=movement, origin=origin, into=into)
                    replay.advance_all(c, settle=True)
                    obj = unpack(c, map_location, decode_leaf=replay.decode_leaf,
                                 fill=replay.into.fill if into else None)
                    tracks = replay.after
                else:
                    tracks = FileReplay(tracks, movement=movement, origin=origin).advance_all(c)
            except (LcckptError, OSError) as e:
                # a keyframe read as it is decoded fails when a later file needs it
                at, where = getattr(e, "origin", None) or (link.step, path)
                raise fault(step, at, where, e) from e
        return obj, [(c, link) for c, link, _ in links], tracks


def resume_from(d: ChainDirectory, step: int, primed=None, movement: bool = False):
    """``(tracks, state_id, depth)`` that a writer continues the chain from at ``step``:
    ``primed``, ``(step, state_id, depth, tracks)`` kept by a load, where it is that very
    file (a merge since then, which starts the movement over, changes its depth), else
    the chain replayed again (``movement`` as in :func:`restore`)."""
    if primed is not None and primed[0] == step:
        link = d.link(step)
        if (link.state_id, link.depth) == primed[1:3]:
            return primed[3], primed[1], primed[2]
    _, links, tracks = restore(d, step, build=False, max_bytes=None, movement=movement)
    settle_tracks(d, step, tracks)      # damage in a blob read late is found here, where
    return tracks, links[-1][1].state_id, links[-1][1].depth    # the writer can still warn


def settle_tracks(d: ChainDirectory, step: int, tracks: dict) -> None:
    """Replay what ``step``'s tracks still wait for (blobs read when replayed, a keyframe
    decoded in the pass of its deltas) now, an error naming the file at fault."""
    try:
        settle(tracks.values())
    except (LcckptError, OSError) as e:
        at, where = getattr(e, "origin", None) or (step, d.path(step))
        raise fault(step, at, where, e) from e


def restore_track(d: ChainDirectory, step: int, key: str) -> np.ndarray | None:
    """Tracked tensor ``key`` at ``step``, flat in its working dtype, from its sections
    alone (a writer fetching a parked reference back: lcckpt/codec/parked.py); None if
    the step's chain does not track it."""
    with ExitStack() as stack:
        links, tracks = walk(d, step, stack, max_bytes=None)
        for c, link, path in links:
            replay = FileReplay(tracks, origin=(link.step, path))
            for i, sec in enumerate(c.sections):
                if delta_key(sec["meta"]) == key:
                    replay.advance(c, i, sec["meta"])
            tracks = replay.after
        rec = tracks.get(key)
        return None if rec is None else rec.ref      # decoded while the files are open


def check_limits(links: list, tracks: dict, max_bytes, into=None) -> None:
    """Every file of a chain against ``max_bytes``, before anything is decoded.

    Under the default ("auto") a delta's tracked tensor that the chain already holds
    at the same size (its keyframe, an earlier delta, or ``tracks`` from a step
    restored before) is not counted: it decodes into that reference, whose size the
    file that brought it was checked for. So a 1000x delta of a large state loads,
    while everything a file brings anew counts against its chain's stored size. A
    tracked tensor replayed straight into an ``into`` target takes no memory: the
    memory left need not hold it.
    """
    stored = sum(c.size for c, _, _ in links)
    vouch = limits.is_auto(max_bytes)
    held = {k: int(np.prod(r.shape)) for k, r in tracks.items()
            if isinstance(r, Reconstruction) and r.shape is not None}
    for c, link, path in links:
        declared, new, counted = 0, {}, []
        for sec in c.sections:
            meta = sec["meta"]
            key = delta_key(meta)
            if key is not None:
                n = elements(meta)
                if vouch and link.kind == "delta" and held.get(key) == n:
                    continue
                new[key] = n
            declared += limits.declared_bytes([sec])
            counted.append(sec)
        in_place = into.in_place(counted, (torch.float32, torch.float64)) if into else 0
        try:
            limits.check(declared, stored, max_bytes,
                         f"step {link.step} with its chain ({len(links)} files)", in_place)
        except LcckptError as e:
            raise type(e)(f"{path}: {e}") from None
        held.update(new)


def fault(step: int, at: int, path: str, e: Exception) -> LcckptError:
    if isinstance(e, OSError) and not isinstance(e, (LcckptError, FileNotFoundError)):
        # unreadable is not damaged: the file may be intact
        what = "" if at == step else f" (a chain link of step {step})"
        return StorageError(e.errno, f"cannot read step {at}{what}: {e.strerror}", path)
    if at == step and not isinstance(e, BrokenChainError):
        cls = type(e) if isinstance(e, LcckptError) else CorruptDataError
        msg = str(e) if path in str(e) else f"{path}: {e}"
        try:
            return cls(f"step {step}: {msg}")
        except TypeError:
            return CorruptDataError(f"step {step}: {path}: {e}")
    return BrokenChainError(
        f"cannot restore step {step}: its chain link {path} (step {at}) is unusable: {e}. "
        "Load an earlier step, or restore that file from a copy")
