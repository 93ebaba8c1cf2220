"""Keeping a chain short: :func:`write_merged` rewrites a delta as a keyframe of the
very same restored state, :func:`apply_retention` deletes what no kept step needs, and
:func:`roll_back` sets the steps after one aside."""

from __future__ import annotations

import os

from ..codec import blob as _blob
from ..errors import BrokenChainError, LcckptError, StorageError
from ..format import stream as _stream
from ..format.container import read_container, write_container
from ..format.sections import DELTA, Loadable, section_key
from ..limits import declared_bytes
from ..util import durable as _durable
from .directory import ChainDirectory
from .links import Link
from ..util.caller import warn_user


def write_merged(d: ChainDirectory, upto: int, tracks: dict, state_id: str) -> None:
    """Rewrite delta ``upto`` as a keyframe: its tracked tensors from ``tracks`` (its
    restored references) stored losslessly in the tracking precision, every other section
    copied byte for byte, the state id kept (``state_id``: what the restore walked to).
    A large state's sections go to the file one at a time (lcckpt/format/stream.py)."""
    path = d.path(upto)
    streamed = sum(t.ref.nbytes for t in tracks.values() if t.ref is not None) \
        >= _stream.STREAM_ABOVE
    try:
        _durable.atomic_write(path, lambda f: _merge_into(f, d, upto, tracks, state_id,
                                                          streamed))
    except _durable.UnsyncedError as e:     # in place: the merge is done
        warn_user(f"step {upto} is merged, but syncing {d.directory} failed "
                  f"({e.strerror}): the next save syncs the directory again")
    d.forget(path)


def _merge_into(f, d: ChainDirectory, upto: int, tracks: dict, state_id: str,
                streamed: bool) -> None:
    path = d.path(upto)
    with read_container(path) as c:
        link = Link(c.meta.get("lcckpt_chain"), upto, path)
        if link.state_id != state_id:
            raise BrokenChainError(f"{path} changed while being merged")
        room = _stream.first_room(len(c), sum(s["length"] for s in c.sections))
        stream = _stream.SectionStream(f, c.header_bytes + room) if streamed else None
        sections = []
        stats = {}
        loadable = Loadable()           # a large constant's keyframe: raw planes
        for i, s in enumerate(c.sections):
            meta = s["meta"]
            if meta.get("codec") == DELTA:
                key = section_key(meta)
                data = tracks[key].exact_blob()
                if not loadable.admit(declared_bytes([s]), _blob.nbytes(data)):
                    data = tracks[key].exact_blob(raw=True)
                # its size and bits per element come from its section (links.with_sizes)
                stats[key] = {"kind": "lossless", "bits": None, "rel_error": 0.0}
            else:
                data = c.data(i)
                loadable.admit(declared_bytes([s]), s["length"])
            sections.append((s["name"], meta, data if stream is None
                             else stream.spool(s["name"], data, meta)))
        meta = dict(c.meta)
        info = dict(meta["lcckpt_chain"])
        info.update(kind="keyframe", base=None, depth=0, tensors=stats,
                    merged={"from_base": info["base"], "from_depth": info["depth"]})
        meta["lcckpt_chain"] = info
        if stream is None:
            write_container(f, sections, meta)
        else:                      # every section in its place: the tree's indices hold
            stream.finish(meta, sections, lambda meta, order: None)


def apply_retention(d: ChainDirectory, keep_last: int | None) -> None:
    """Delete the files that none of the newest ``keep_last`` steps needs, newest first.
    The step just saved is committed: a failure here warns and the next save retries."""
    if keep_last is None:
        return
    try:
        steps = d.steps()
    except StorageError as e:       # the step is committed: retried at the next save
        warn_user(f"retention (keep_last={keep_last}) skipped: {e}")
        return
    if len(steps) > keep_last:
        remove_unneeded(d, steps, steps[-keep_last:], f"keep_last={keep_last}")


def retain(d: ChainDirectory, keep) -> list[int]:
    """Delete the files that none of the steps ``keep`` and the newest step needs, newest
    first; the steps removed (a failure warns, as :func:`apply_retention`'s)."""
    steps, keep = d.steps(), set(keep)
    roots = [s for s in steps if s in keep] + steps[-1:]
    return remove_unneeded(d, steps, roots, "retain")


def _needed(d: ChainDirectory, steps: list[int], roots) -> set[int]:
    """``roots`` and every step they walk back through to their keyframes."""
    needed: set[int] = set()
    for s in roots:
        while s not in needed:
            needed.add(s)
            try:
                link = d.link(s)
            except (LcckptError, OSError):
                needed.update(x for x in steps if x <= s)   # unknown base: keep all older
                break
            if link.kind == "keyframe":
                break
            s = link.base_step
    return needed


def remove_unneeded(d: ChainDirectory, steps: list[int], roots, what: str) -> list[int]:
    """Delete every step of ``steps`` that no step of ``roots`` needs; the steps removed."""
    needed = _needed(d, steps, roots)
    removed, failed = [], []
    # newest first, stopping at the first failure: a step left behind (by a failure or
    # a crash) still has every older file its chain walks back through
    for s in reversed(steps):
        if s not in needed:
            try:
                os.unlink(d.path(s))
                removed.append(s)
            except FileNotFoundError:
                pass
            except OSError as e:     # the step is committed: retried at the next save
                failed.append(f"{d.path(s)} ({e.strerror})")
                break
            d.forget(d.path(s))
    try:
        if removed:
            _durable.fsync_dir(d.directory)
    except OSError as e:
        failed.append(f"{d.directory} (directory sync: {e.strerror})")
    if failed:
        again = "the next retain" if what == "retain" else \
            "the new step is saved, and the next save"
        warn_user(f"retention ({what}) could not remove "
                  f"{', '.join(failed[:3])}{' ...' if len(failed) > 3 else ''}; "
                  f"{again} tries again")
    return removed[::-1]


ROLLED_BACK, DAMAGED = ".rolledback", ".damaged"    # the suffixes of a step set aside


def roll_back(d: ChainDirectory, step: int) -> list[int]:
    """Rename every step after ``step`` to ``*.rolledback``, newest first (a crash
    midway leaves each step still there with its chain); the steps set aside."""
    later = [s for s in d.steps() if s > step]
    for s in reversed(later):
        set_aside(d.path(s), ROLLED_BACK)
        d.forget(d.path(s))
    if later:
        _durable.fsync_dir(d.directory)
    return later


def set_aside(path: str, suffix: str) -> None:
    """Rename ``path`` to ``path + suffix``, or ``.1``, ``.2``, ... after it where that
    is taken (a second rollback past a step, or a step damaged twice, keeps the first
    file)."""
    target, n = path + suffix, 0
    while os.path.lexists(target):
        n += 1
        target = f"{path}{suffix}.{n}"
    os.replace(path, target)
