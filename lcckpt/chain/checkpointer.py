"""DeltaCheckpointer: a directory of keyframes and deltas of one training run.

Every save writes one container file, ``step-<12-digit step>.lcc``, atomically (temp file,
fsync, rename). Floating tensors with at least ``min_delta_elements`` elements are tracked
by their own :class:`~lcckpt.codec.delta.DeltaEncoder` keyed by their key path; a
*keyframe* stores them exactly, a *delta* as a lossy delta against the reconstruction of
the previous step: by default the uniform quantizer held to a restored-state target per
tensor role (lcckpt/chain/policy.py, lcckpt/codec/movement.py), smaller floating tensors
delta-coded exactly; with ``target=None`` LC-Checkpoint's buckets. Everything else is
stored exactly in every file, so a file's object tree is always complete and only its
tracked tensors depend on earlier files.

Each file's header ``meta["lcckpt_chain"]`` names its base by step, file name and
``state_id`` (a digest of the step, its base's id and its sections' checksums); a delta
whose base carries another id is refused. :meth:`merge` rewrites a delta as a keyframe of
the very same reconstructed state, keeping its state id. Tracked sections use the section
codec ``"delta"``; a save passes its own leaf encoder to :func:`~lcckpt.format.serialization.pack`
(``SaveSession``), a load a leaf decoder that advances each tracked tensor's
:class:`~lcckpt.codec.delta.Reconstruction` (``links.FileReplay``).

One writer per directory (lcckpt/chain/lock.py): the first save, merge, retain or
rollback takes an advisory lock (``fcntl.flock`` on ``.lcckpt-writer.lock``) until
:meth:`close`; a second writer, in this or another process, or a second thread, gets
:class:`ConcurrentWriteError` at once. Readers may load while it writes.
"""

from __future__ import annotations

import functools
import os
import threading
from collections.abc import Callable
from contextlib import contextmanager
from typing import Any

import numpy as np
import torch

from .. import limits
from ..codec.delta import DeltaEncoder, Reconstruction
from ..codec.movement import Movement
from ..errors import ConcurrentWriteError, InvalidArgumentError, LcckptError, NotFoundError
from ..errors import StorageError
from ..format.container import write_container
from ..format.census import census
from ..format.into import Into
from ..format import stream as _stream
from ..util import collector, durable as _durable, owned as _owned, paths as _paths
from . import restore as _restore
from .directory import ChainDirectory, check_step, file_name
from .links import CHAIN_VERSION, stamp_state_id
from .lock import WriterLock
from .moments import first_moments
from .policy import DEFAULT_POLICY, low_precision_target
from .retention import apply_retention, retain as _retain, roll_back, write_merged
from .session import SaveSession, stored_stats, write_streamed
from ..util.caller import warn_user

__all__ = ["DeltaCheckpointer", "file_name"]

DEFAULT_TARGET = DEFAULT_POLICY      # DeltaCheckpointer(directory)'s targets: see docs/chain.md
# Saves per keyframe: later deltas cost less, a keyframe ~0.8 of the state (docs/chain.md)
DEFAULT_KEYFRAME_EVERY = 50
LC_MIN_DELTA_ELEMENTS = 4096         # LC mode: smaller floating tensors are stored whole
TARGET_MIN_DELTA_ELEMENTS = 8        # target mode: smaller ones (scalars: step counts) are delta-coded exactly



class DeltaCheckpointer(_owned.Owned):
    """Keyframes and LC-Checkpoint deltas of one training run, one file per step.

    ``target`` (default :data:`DEFAULT_TARGET`, a :class:`~lcckpt.chain.policy.RolePolicy`):
    every restored tracked tensor ``ũ`` of every step stays within
    ``||u - ũ||₂ <= t·||u - k||₂`` of the tensor ``u`` that was saved, ``k`` being the
    tensor at the chain's keyframe (zeros for one first saved after it) and ``t`` its
    role's share (weights 0.007, first moments 0.8 or 0.3 in bf16/fp16, second moments
    0.1): a share of what training changed, or of the update a delta sends where that
    allows more (0.05 of ``||u - ũ_prev||₂``), never finer than the working precision
    (fp32's), with a warning naming step and tensor when an update goes unkept
    (lcckpt/codec/movement.py). The uniform quantizer picks per tensor and per checkpoint
    the coarsest step that meets it (a weight's error made orthogonal to its optimizer's
    first moment where the state holds one: lcckpt/chain/moments.py); floating tensors
    under ``min_delta_elements`` (default 8: scalars such as step counts) are delta-coded
    exactly (an unchanged one costs a few bytes). ``target`` may also be a number (a share
    of each tensor's *norm*, ``||u - ũ||₂ <= target·||u||₂``) or a ``key_path -> target``
    policy (norm-relative unless it has ``relative_to="movement"``, as a ``RolePolicy``
    does by default).
    ``target=None``, or any LC setting (``bits``, ``error_bound``) without a
    ``target``: LC-Checkpoint's exponent buckets, small tensors stored whole, as the paper.
    ``warn_error``: warn (RuntimeWarning) when a tracked tensor's restored relative error
    passes it, e.g. in LC mode, where nothing bounds it.
    ``bits``/``coder``/``error_bound``: the LC delta quantizer (see :class:`DeltaEncoder`);
    ``bits`` may also be a ``key_path -> bits`` policy, e.g. more bits for Adam's first
    moment, which 2 bits track poorly (see docs/chain.md).
    ``keyframe_every``: every that many saves after a keyframe is a keyframe again (so a
    chain is one keyframe and at most ``keyframe_every - 1`` deltas); None: only the first
    save (``save(..., keyframe=True)`` writes one when asked). ``keep_last``: after each
    save, delete files that none of the newest ``keep_last`` steps needs.
    ``min_delta_elements``: smaller floating tensors are stored exactly. ``track``:
    optional ``(key_path, tensor) -> bool`` policy replacing the size rule for floating
    tensors. ``keyframe_coding``: "lossless" (default, ~1.2x smaller keyframes) or "raw"
    (byte planes stored uncoded; no faster to restore: 0.22 s against 0.21 s, 245 MB).

    One writer per directory: the first save, merge, retain or rollback locks the directory
    until :meth:`close` (or ``with DeltaCheckpointer(d) as ck:``); a second writer, or a
    second thread of this one, gets :class:`ConcurrentWriteError`. ``load`` takes no lock.
    """

    def __init__(self, directory: str | os.PathLike,
                 bits: int | Callable[[str], int] | None = None,
                 keyframe_every: int | None = DEFAULT_KEYFRAME_EVERY,
                 *, coder: str = "auto", error_bound: float | None = None,
                 keep_last: int | None = None, min_delta_elements: int | None = None,
                 track: Callable[[str, torch.Tensor], bool] | None = None,
                 keyframe_coding: str = "lossless",
                 target: float | Callable[[str], float | None] | None | str = "default",
                 warn_error: float | None = None):
        if keyframe_every is not None and (type(keyframe_every) is not int or keyframe_every < 1):
            raise InvalidArgumentError(f"keyframe_every must be a positive int or None, got {keyframe_every!r}")
        if keep_last is not None and (type(keep_last) is not int or keep_last < 1):
            raise InvalidArgumentError(f"keep_last must be a positive int or None, got {keep_last!r}")
        if min_delta_elements is not None and (type(min_delta_elements) is not int
                                               or min_delta_elements < 1):
            raise InvalidArgumentError(f"min_delta_elements must be a positive int, got {min_delta_elements!r}")
        if isinstance(target, (str, dict)):     # a dict of roles: RolePolicy(**it)
            if target != "default":
                raise InvalidArgumentError(
                    f"target must be a number, a key_path -> target policy (lcckpt.RolePolicy"
                    f"(weight=0.01, ...)), None or 'default', got {target!r}")
            target = DEFAULT_TARGET if bits is None and error_bound is None else None
        if bits is None:
            bits = 2
        DeltaEncoder(2 if callable(bits) else bits, coder,      # validates the settings
                     error_bound=error_bound, keyframe_coding=keyframe_coding,
                     target=None if target is None or callable(target) else target)
        self.keyframe_coding = keyframe_coding
        self.directory = _paths.local(directory, "DeltaCheckpointer")    # made by the first save
        self.bits, self.coder, self.error_bound = bits, coder, error_bound
        self.target = target
        if warn_error is not None and (isinstance(warn_error, bool) or not isinstance(
                warn_error, (int, float)) or not warn_error >= 0):
            raise InvalidArgumentError(f"warn_error must be None or a number >= 0, got {warn_error!r}")
        self.warn_error = warn_error
        if min_delta_elements is None:
            min_delta_elements = LC_MIN_DELTA_ELEMENTS if target is None \
                else TARGET_MIN_DELTA_ELEMENTS
        self.keyframe_every, self.keep_last = keyframe_every, keep_last
        self.min_delta_elements = min_delta_elements
        self._track = track              # None: the size rule (no lambda: no cycle keeping
                                         # a dropped writer's lock alive until a GC pass)
        self._encoders: dict[str, DeltaEncoder] | None = None   # None: not in sync with disk
        self._exact_of: dict[str, bool] = {}    # path -> its encoder codes exact deltas
        self._last: dict | None = None      # step, state_id, depth of the newest file
        self._primed: tuple | None = None   # (step, state_id, depth, tracks): load(resume=True)
        self._force_keyframe = False
        self._header_need = {True: None, False: None}   # last streamed keyframe's/delta's
        self._dir = ChainDirectory(self.directory)   # its files, headers cached
        self.last_save: dict | None = None  # what the newest save wrote (step, kind, path, nbytes)
        self._lock: WriterLock | None = None
        self._busy = threading.Lock()

    def _size_rule(self, path: str, t: torch.Tensor) -> bool:
        return t.numel() >= self.min_delta_elements

    # ------------------------------------------------------------------ writer lock

    @contextmanager
    def _writing(self):
        """One save/merge at a time, by the one writer of the directory."""
        if not self._busy.acquire(blocking=False):
            raise ConcurrentWriteError(
                f"DeltaCheckpointer({self.directory!r}) is already saving or merging in "
                "another thread; it is not thread-safe: call save/merge from one thread")
        try:
            if self._lock is None or not self._lock.held():
                self._lock = None
                self._encoders = None        # others may have written: resync from disk
                self._lock = WriterLock(self.directory)
            yield
        finally:
            self._busy.release()

    def close(self) -> None:
        """Release the directory's writer lock (a later save takes it again)."""
        lock, self._lock = self._lock, None
        if lock is not None:
            lock.release()

    def __enter__(self) -> DeltaCheckpointer:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass

    # ------------------------------------------------------------------ listing

    def path(self, step: int) -> str:
        """Where ``step`` is (or would be) stored."""
        return self._dir.path(step)

    def steps(self) -> list[int]:
        """Sorted list of the stored steps: regular files named like steps. A symbolic
        link (or anything else) under a step's name is not a step (:meth:`strays` lists
        them): a link could bring in another run's file, and retention would then delete
        this run's steps below it."""
        return self._dir.steps()

    def strays(self) -> list[str]:
        """Paths named like steps that are not regular files (links, directories)."""
        return self._dir.strays()

    def info(self, step: int) -> dict:
        """The chain metadata of ``step``'s file (kind, base, settings, per-tensor stats)."""
        return dict(self._dir.link(step).meta)

    # ------------------------------------------------------------------ saving

    def save(self, step: int, obj: Any, *, released: Callable[[], None] | None = None,
             keyframe: bool = False) -> str:
        """Store ``obj`` as ``step`` (a keyframe or a delta); returns the file's path.
        ``keyframe=True``: a keyframe whatever ``keyframe_every`` says (restored exactly:
        a step to resume from exactly); later deltas are taken against it.

        ``released``: called once, from this thread, as soon as ``obj``'s tensors are no
        longer read, before the file is synced and committed (not at all if the save fails
        first): a caller saving live tensors from another thread may let training change
        them from then on."""
        step = check_step(step)
        if type(keyframe) is not bool:
            raise InvalidArgumentError(f"keyframe must be True or False, got {keyframe!r}")
        try:
            os.makedirs(self.directory, exist_ok=True)
        except OSError as e:
            raise StorageError(e.errno, f"cannot create the checkpoint directory: {e.strerror}",
                               self.directory) from None
        with self._writing(), collector.paused():
            return self._save(step, obj, released, keyframe)

    def _save(self, step: int, obj: Any, released, force: bool) -> str:
        if self._encoders is None:
            self._resume()
        if self._last is not None and step <= self._last["step"]:
            raise InvalidArgumentError(
                f"step {step} is not after the newest stored step {self._last['step']}; steps "
                "must increase (delete the later files first to rewrite history)")
        keyframe = (force or self._last is None or self._force_keyframe
                    or (self.keyframe_every is not None
                        and self._last["depth"] + 1 >= self.keyframe_every))
        count, state_bytes = census(obj)
        if keyframe and not self._encoders:     # its references are allocated now
            limits.warn_if_short(state_bytes, "a chain's first save copies the state")
        streamed = state_bytes >= _stream.STREAM_ABOVE     # to disk as it is encoded
        session = SaveSession(self._encoders, self._new_encoder,
                               self._track or self._size_rule, keyframe,
                               None if self.target is None else self._small, self._exact_of,
                               self.warn_error, self.min_delta_elements, lazy=streamed,
                               directions=None if keyframe or self.target is None
                               else first_moments(obj))
        path = self.path(step)
        copying: list = []
        kind = "keyframe" if keyframe else "delta"

        def encode(encode_leaf, encode_pack):
            meta, sections = session.pack(obj, encode_leaf, encode_pack)
            for key in set(self._encoders) - set(session.stats):   # no longer present
                del self._encoders[key]
            meta["lcckpt_chain"] = self._chain_meta(step, keyframe, session)
            copying.extend(e for e in self._encoders.values() if isinstance(e, DeltaEncoder))
            return meta, sections

        def start_copies():        # references copied while the file is written, synced
            for e in copying:
                e.start_copy()

        def release():             # every byte written: obj is read no more
            if released is not None:
                for e in copying:
                    e.settle()
                released()
        ids: list[str] = []        # the state id, stamped once the sections' checksums are known
        stamp = lambda entries, meta: ids.append(stamp_state_id(meta["lcckpt_chain"], entries))
        unsynced, written = None, []
        try:
            try:
                if streamed:
                    need = self._header_need[keyframe]
                    if need is None and self._header_need[True] is not None:
                        need = 3 * self._header_need[True] // 2   # a first delta's stats
                    room = need + need // 32 if need else _stream.first_room(count, state_bytes)
                    def write(f):
                        written.append(write_streamed(f, obj, encode, session, start_copies,
                                                      room, stamp))
                        release()
                    _durable.atomic_write(path, write)
                    nbytes, self._header_need[keyframe] = written[0]
                else:
                    meta, sections = encode(session.encode_leaf, session.encode_pack)
                    nbytes = write_container(path, sections, meta, before_write=start_copies,
                                             stamp=stamp, after_write=release)
            except _durable.UnsyncedError as e:    # in place: the step is saved
                unsynced, nbytes = e, _durable.file_size(path)
            finally:
                for e in copying:
                    e.settle()         # before the caller may change its tensors again
        except BaseException:
            self._encoders = None      # references may have advanced: resync from disk
            raise
        if unsynced is not None:
            warn_user(f"step {step} is saved, but syncing {self.directory} failed "
                      f"({unsynced.strerror}): it may not survive a power loss; the next save retries")
        depth = 0 if keyframe else self._last["depth"] + 1
        self._last = {"step": step, "state_id": ids[-1], "depth": depth}
        self._force_keyframe = False
        session.warn(step)
        self._park()
        self.last_save = {"step": step, "kind": kind, "path": path, "nbytes": nbytes}
        apply_retention(self._dir, self.keep_last)
        return path

    def _chain_meta(self, step: int, keyframe: bool, session) -> dict:
        """What a chain file says of itself (docs/chain.md, "Chain metadata")."""
        return {
            "version": CHAIN_VERSION,
            "step": step,
            "kind": "keyframe" if keyframe else "delta",
            "state_id": "",
            "base": None if keyframe else {"step": self._last["step"],
                                           "file": file_name(self._last["step"]),
                                           "state_id": self._last["state_id"]},
            "depth": 0 if keyframe else self._last["depth"] + 1,
            "settings": self._settings(),
            "tensors": stored_stats(session.stats),
        }

    def _settings(self) -> dict:
        out = {"bits": "per tensor" if callable(self.bits) else self.bits, "coder": self.coder,
               "error_bound": self.error_bound, "keyframe_every": self.keyframe_every,
               "min_delta_elements": self.min_delta_elements}
        if self.target is not None:
            t = self.target
            out["target"] = t.describe() if hasattr(t, "describe") else \
                ("per tensor" if callable(t) else t)
            out["small_tensors"] = "exact delta"
        return out

    @staticmethod
    def _small(path: str, t: torch.Tensor) -> bool:
        return True                      # every floating tensor the size rule leaves out

    def _movement_targets(self) -> bool:
        return getattr(self.target, "relative_to", "norm") == "movement"

    def _new_encoder(self, key: str, exact: bool = False) -> DeltaEncoder:
        if exact:
            return DeltaEncoder(coder=self.coder, target=0.0, keyframe_coding=self.keyframe_coding)
        target = self.target(key) if callable(self.target) else self.target
        if target is not None:
            return DeltaEncoder(coder=self.coder, target=target,
                                keyframe_coding=self.keyframe_coding,
                                relative_to="movement" if self._movement_targets() else "norm",
                                update_share=getattr(self.target, "update", 0.0),
                                low_precision_target=low_precision_target(self.target, key))
        bits = self.bits(key) if callable(self.bits) else self.bits
        return DeltaEncoder(bits, self.coder, error_bound=self.error_bound,
                            keyframe_coding=self.keyframe_coding)

    def _resume(self) -> None:
        """Rebuild the encoders' references from disk: what a reader reconstructs."""
        _durable.remove_stale_temps(self.directory)
        self._encoders, self._last, self._force_keyframe = {}, None, False
        primed, self._primed = self._primed, None
        steps = self.steps()
        if not steps:
            return
        latest = steps[-1]
        try:
            tracks, state_id, depth = _restore.resume_from(self._dir, latest, primed,
                                                           self._movement_targets())
        except (LcckptError, OSError) as e:
            warn_user(f"cannot continue the delta chain from step {latest} ({e}); the next "
                      "save is written as a keyframe")
            self._last = {"step": latest, "state_id": "", "depth": 0}
            self._force_keyframe = True
            return
        self._encoders.update(tracks)   # Reconstructions: the first save makes the encoders
        self._last = {"step": latest, "state_id": state_id, "depth": depth}

    def _park(self) -> None:
        """The references of the tensors this save found unchanged leave memory: the
        newest step's files hold them (lcckpt/codec/parked.py)."""
        for key, e in self._encoders.items():
            if isinstance(e, DeltaEncoder):
                e.park(functools.partial(self._fetch, key), key)

    def _fetch(self, key: str) -> np.ndarray | None:
        """A parked reference: tracked tensor ``key`` at the newest step, from the files."""
        return _restore.restore_track(self._dir, self._last["step"], key)

    # ------------------------------------------------------------------ loading

    def _step_or_newest(self, step: int | None) -> int:
        """``step`` checked, or the newest stored step when it is None."""
        if step is None:
            steps = self.steps()
            if not steps:
                raise self._dir.no_checkpoints()
            return steps[-1]
        return check_step(step)

    def load(self, step: int | None = None, map_location=None, *,
             max_bytes=limits.DEFAULT, resume: bool = False, into: Any = None) -> Any:
        """The object stored as ``step`` (default: the newest), rebuilt through its chain.

        ``max_bytes`` as in :func:`lcckpt.load`, for the files of the chain together:
        each must declare at most the limit, "auto" being computed from their total size;
        under "auto" a delta's tensors that the chain already holds at their size do not
        count (they decode in place), so a delta 1000x smaller than its state loads.

        ``resume=True``: this checkpointer goes on writing the chain after a restart. It
        keeps the step's restored references (memory as large as its tracked tensors,
        which the next save would rebuild anyway), so that save does not replay the whole
        chain a second time. They are used if the step is still the newest when it saves
        (with the same contents), and dropped otherwise.

        ``into``: tensors to load into, as in :func:`lcckpt.load`; a contiguous fp32 or
        fp64 target is replayed straight into (no second copy of the model in memory),
        any other that fits filled with a copy (a tensor on a GPU, a small tensor stored
        in a pack, such as a two-class head's bias). If the load fails, the targets may
        hold part of it.
        """
        step = self._step_or_newest(step)
        targets = None if into is None else Into.of(into)
        obj, links, tracks = _restore.restore(
            self._dir, step, build=True, map_location=map_location, keep_tracks=resume,
            max_bytes=max_bytes, movement=resume and self._movement_targets(), into=targets)
        if targets is not None:
            targets.warn_unfilled()
        if resume:
            self._primed = (step, links[-1][1].state_id, links[-1][1].depth, tracks)
        return obj

    def replay(self, start: int | None = None, stop: int | None = None, map_location=None,
               *, max_bytes=limits.DEFAULT, build: bool = True, copy: bool = True):
        """Yield ``(step, obj)`` for every stored step in ``[start, stop]``, oldest first.

        Each file is decoded once: a step continues from the previous one's references
        (what :meth:`load` of each step would give, without walking every chain again).
        ``build=False`` yields ``(step, None)``: every delta is decoded but no object is
        built (a check of the whole chain in the memory of one state). ``copy=False``:
        a yielded state's tracked tensors share memory with the replay's references
        instead of being copies (one state less in memory), so they hold that step only
        until the iterator advances: use each state before taking the next.
        """
        known = None
        for step in self.steps():
            if (start is not None and step < start) or (stop is not None and step > stop):
                continue
            obj, links, tracks = _restore.restore(self._dir, step, build=build,
                                                  map_location=map_location, known=known,
                                                  max_bytes=max_bytes, share=not copy)
            if not build:                   # decoded, step by step, as the docstring says
                _restore.settle_tracks(self._dir, step, tracks)
            known = (step, links[-1][1].state_id, tracks)
            yield step, obj

    # ------------------------------------------------------------------ merge, retention

    def merge(self, upto: int | None = None) -> str:
        """Rewrite ``upto`` (default newest) as a keyframe of exactly its restored state.

        Tracked tensors are stored losslessly in their tracking precision (no
        re-quantization), every other section is copied byte for byte, and the state id is
        kept, so loads of ``upto`` and of every later delta are unchanged and files before
        ``upto`` are no longer needed by them. Returns the file's path.
        """
        upto = self._step_or_newest(upto)
        if not os.path.exists(self.path(upto)):
            raise self._dir.missing_step(upto)
        with self._writing():
            return self._merge(upto)

    def _merge(self, upto: int) -> str:
        _, links, tracks = _restore.restore(self._dir, upto, build=False, max_bytes=None)
        top = links[-1][1]
        if top.kind != "keyframe":
            write_merged(self._dir, upto, tracks, top.state_id)
            if self._last is not None and self._last["step"] == upto:
                self._last["depth"] = 0     # the cadence counts from this new keyframe
                for enc in (self._encoders or {}).values():   # and movement from it
                    if isinstance(enc, DeltaEncoder) and enc.relative_to == "movement" \
                            and enc.ref is not None:
                        enc.movement = Movement(enc.ref)
                    elif isinstance(enc, Reconstruction) and enc.movement is not None:
                        enc.movement = Movement(enc.ref)
        apply_retention(self._dir, self.keep_last)
        return self.path(upto)

    def retain(self, steps) -> list[int]:
        """Delete every file that none of ``steps`` and the newest step needs (a delta
        needs its base, back to its keyframe); the steps removed, oldest first."""
        with self._writing():
            return _retain(self._dir, steps)

    def rollback(self, step: int) -> list[int]:
        """Set every step after ``step`` aside (renamed ``*.rolledback``): the next save goes
        on from it (from ``load(step, resume=True)``'s references if that came first)."""
        if step not in self.steps():
            raise NotFoundError(f"no step {step!r} to roll back to in {self.directory}; it "
                                f"holds steps {self.steps()}")
        with self._writing():
            self._encoders = None            # the next save resyncs, at ``step``
            return roll_back(self._dir, step)

