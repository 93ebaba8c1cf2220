"""DeltaCheckpointer: a directory of keyframes and deltas of one training run.

Every save writes one container file, ``step-<12-digit step>.lcc``, atomically (temp file,
fsync, rename). Floating tensors with at least ``min_delta_elements`` elements are tracked
by their own :class:`~lcckpt.delta.DeltaEncoder` keyed by their key path (the same path
names their section); a *keyframe* stores them exactly, a *delta* stores each as a lossy
delta against the reconstruction of the previous step: by default the uniform quantizer
held to a restored-state target per tensor role, a share of the tensor's movement since
the keyframe (lcckpt/policy.py, lcckpt/movement.py), with smaller floating
tensors delta-coded exactly; with ``target=None`` LC-Checkpoint's buckets, smaller
floating tensors stored whole. Everything else (integer tensors, step counters, Python
values) is stored exactly in every file, so a file's object tree is always complete and
only its tracked tensors depend on earlier files.

Each file's header ``meta["lcckpt_chain"]`` names its base (the previous step) by step,
file name and ``state_id``, a random id given to each reconstructed state when it is
first written; a delta whose base file carries another id is refused. :meth:`merge`
rewrites a delta as a keyframe of the very same reconstructed state (stored losslessly,
in the tracking precision), so it keeps the state id and later deltas still apply.

Tracked sections use the section codec ``"delta"``: its blob is a lossless tensor blob
(keyframes, and tensors new in a delta) or a lossy delta blob. A save passes its own
leaf encoder to :func:`~lcckpt.serialization.pack` (``_SaveSession.encode_leaf`` ->
``DeltaEncoder.encode_parts``); a load passes a leaf decoder that advances the
:class:`~lcckpt.delta.Reconstruction` of each tracked tensor (``links.FileReplay``).
``lcckpt.load`` reads keyframe files directly; a delta file needs its chain and is
refused with :class:`BrokenChainError`.

One writer per directory (lcckpt/writer_lock.py): the first save (or merge) takes an
advisory lock on the file ``.lcckpt-writer.lock`` in the directory (``fcntl.flock``) and
holds it until :meth:`DeltaCheckpointer.close` (or the object is garbage collected); a
second writer, in this or another process, is refused at once with
:class:`ConcurrentWriteError`. The kernel drops the lock of a process that dies, so a
crashed writer never blocks the next one. Two threads calling one checkpointer's
save/merge at the same time are refused too. Any number of readers may load while it
writes, since files only ever appear complete.
"""

from __future__ import annotations

import errno
import operator
import os
import re
import secrets
import threading
import warnings
from collections.abc import Callable
from contextlib import ExitStack, contextmanager
from typing import Any

import numpy as np
import torch

from . import _durable, limits
from . import blob as _blob
from . import sections as _sections
from .container import read_container, write_container
from .delta import DeltaEncoder, Reconstruction
from .movement import Movement
from .errors import (
    BrokenChainError,
    ConcurrentWriteError,
    CorruptDataError,
    InvalidArgumentError,
    LcckptError,
    NotFoundError,
    StorageError,
)
from .links import CHAIN_VERSION, FileReplay, Link, delta_key, elements
from .policy import DEFAULT_POLICY
from .sections import DELTA, TRACKABLE, Encoded, section_key
from .serialization import pack, unpack
from .writer_lock import LOCK_NAME, WriterLock

__all__ = ["DeltaCheckpointer", "file_name"]

DEFAULT_TARGET = DEFAULT_POLICY      # DeltaCheckpointer(directory)'s targets: see docs/chain.md
# Saves per keyframe. Movement targets make later deltas of a chain cheaper and a new
# keyframe costs ~0.8 of the state: 50 keeps a 41-checkpoint run above 20x whole
# (docs/chain.md, "Keyframes"); merge() bounds a restore's chain where that matters.
DEFAULT_KEYFRAME_EVERY = 50
LC_MIN_DELTA_ELEMENTS = 4096         # LC mode: smaller floating tensors are stored whole
TARGET_MIN_DELTA_ELEMENTS = 8        # target mode: smaller ones (scalars: step counts) are delta-coded exactly
MISSED = 0.5            # a restored error past this share of a step's movement is warned of
_NAME_RE = re.compile(r"step-(\d{12,})\.lcc")


def file_name(step: int) -> str:
    """The file name of ``step`` in a checkpoint directory."""
    return f"step-{step:012d}.lcc"


# --------------------------------------------------------------------------- coding


class _SaveSession:
    """One save: decides per tensor whether it is tracked and codes it (the leaf encoder
    this save passes to :func:`lcckpt.serialization.pack`).

    ``make(path, exact)`` builds a tensor's encoder: lossy for tracked tensors, an exact
    delta coder (``exact=True``) for the small floating tensors ``small(path, t)`` picks
    (None: those are stored as plain exact sections, LC-Checkpoint's way)."""

    def __init__(self, encoders: dict, make: Callable, track: Callable, keyframe: bool,
                 small: Callable | None = None, exact_of: dict | None = None,
                 warn_error: float | None = None, pack_below: int = 0):
        self.encoders, self.make, self.track, self.keyframe = encoders, make, track, keyframe
        self.pack_below = pack_below
        self.small, self.warn_error = small, warn_error
        self.drifted: list[tuple[str, float]] = []     # (path, restored error) past warn_error
        self.missed: list[tuple[str, float, float]] = []   # (path, error/movement, target)
        self.exact_of = {} if exact_of is None else exact_of   # path -> its encoder is exact
        self.stats: dict[str, dict] = {}

    def packs(self, path: str, t: torch.Tensor) -> bool:
        """Whether ``t`` joins its dtype's pack: a small tensor no rule tracks (one
        section and one codec call per scalar made 100,000-tensor saves take minutes)."""
        return t.numel() < self.pack_below and not (t.dtype in TRACKABLE and self.track(path, t))

    def encode_pack(self, path: str, t: torch.Tensor) -> Encoded:
        """A pack of small tensors: coded as one small tensor (never lossy)."""
        return self.encode_leaf(path, t, small=True)

    def encode_leaf(self, path: str, t: torch.Tensor, small: bool = False) -> Encoded:
        if t.dtype not in TRACKABLE:
            return _sections.encode_with(_sections.LOSSLESS, path, t)
        if small:
            if self.small is None:
                return _sections.encode_with(_sections.LOSSLESS, path, t)
            exact = True
        elif self.track(path, t):
            exact = False
        elif self.small is not None and self.small(path, t):
            exact = True
        else:
            return _sections.encode_with(_sections.LOSSLESS, path, t)
        enc = self.encoders.get(path)
        if isinstance(enc, Reconstruction):          # reopened chain: continue from disk
            rec, enc = enc, self.make(path, exact)
            enc.resume(rec)
            self.encoders[path] = enc
        elif enc is None or self.exact_of.get(path) != exact:
            enc = self.encoders[path] = self.make(path, exact)
        self.exact_of[path] = exact
        # a tensor new since the keyframe: lossy against zeros where a target bounds it
        from_zero = enc.ref is None and not self.keyframe and not exact \
            and enc.config.target is not None
        # the copy of a keyframe into the reference waits: it runs while the file is written
        parts, st = enc.encode_parts(t, keyframe=self.keyframe, from_zero=from_zero,
                                     defer_copy=True)
        nbytes = _blob.nbytes(parts)
        self.stats[path] = rec = {
            "kind": st.kind,
            "bits": st.bits,
            "bits_per_element": _finite(8 * nbytes / st.n if st.n else 0.0),
            "rel_error": _finite(st.rel_error),
            "nbytes": nbytes,
        }
        if enc.config.target is not None:
            rec["target"] = enc.config.target
        if enc.last_movement is not None and st.kind == "uniform":
            self._note_movement(path, rec, enc, st)
        if st.kind == "uniform":
            rec["step"] = float(f"{st.step:.4g}")
            if st.escapes:
                rec["escapes"] = st.escapes
        if st.fallback and not exact:          # exact deltas are stored exactly by intent
            rec["fallback"] = st.fallback
        if self.warn_error is not None and st.rel_error > self.warn_error:
            self.drifted.append((path, float(st.rel_error)))
        params = {"key": path}
        if from_zero and st.kind != "lossless":
            params["base"] = "zero"
        return Encoded(DELTA, parts, params)

    def _note_movement(self, path: str, rec: dict, enc: DeltaEncoder, st) -> None:
        """Report a movement target's terms, relative to ``||u||``. The dtype's precision
        floor may let the error pass ``target x movement``; past :data:`MISSED` of the
        movement too, the update is reported as missed."""
        moved, norm = enc.last_movement
        rec["movement"] = _finite(moved / norm if norm else 0.0)
        err = st.rel_error * norm
        if moved > 0:
            rec["error_vs_movement"] = _finite(err / moved)
        if err > max(enc.config.target, MISSED) * moved * (1 + 1e-6) and err > 0:
            self.missed.append((path, err / moved if moved else float("inf"),
                                enc.config.target))


def _file_bytes(path: str) -> int | None:
    try:
        return os.stat(path).st_size
    except OSError:
        return None


def _finite(x):
    """A stat for the header: 4 significant digits (every digit is header bytes in
    every delta file), None for NaN/Inf."""
    x = float(x)
    return float(f"{x:.4g}") if np.isfinite(x) else None


# --------------------------------------------------------------------------- checkpointer


class DeltaCheckpointer:
    """Keyframes and LC-Checkpoint deltas of one training run, one file per step.

    ``target`` (default :data:`DEFAULT_TARGET`, a :class:`~lcckpt.policy.RolePolicy`):
    every restored tracked tensor ``ũ`` of every step stays within
    ``||u - ũ||₂ <= t·||u - k||₂`` of the tensor ``u`` that was saved, ``k`` being the
    tensor at the chain's keyframe (zeros for one first saved after it) and ``t`` its
    role's share (weights 0.005, first moments 0.8, second moments 0.1): a share of what
    training changed, never finer than the dtype's precision, with a warning naming step
    and tensor when an update goes unkept (lcckpt/movement.py). The uniform quantizer
    picks per tensor and per checkpoint the coarsest step that meets it; floating tensors
    under ``min_delta_elements`` (default 8: scalars such as step counts) are
    delta-coded exactly (an unchanged one costs a few bytes). ``target`` may also be a
    number (a share of each tensor's *norm*, ``||u - ũ||₂ <= target·||u||₂``) or a
    ``key_path -> target`` policy (norm-relative unless it has
    ``relative_to="movement"``, as a ``RolePolicy`` does by default).
    ``target=None``, or any LC setting (``bits``, ``error_bound``) without a
    ``target``: LC-Checkpoint's exponent buckets, small tensors stored whole, as the paper.
    ``warn_error``: warn (RuntimeWarning) when a tracked tensor's restored relative error
    passes it, e.g. in LC mode, where nothing bounds it.
    ``bits``/``coder``/``error_bound``: the LC delta quantizer (see :class:`DeltaEncoder`);
    ``bits`` may also be a ``key_path -> bits`` policy, e.g. more bits for Adam's first
    moment, which 2 bits track poorly (see docs/chain.md).
    ``keyframe_every``: every that many saves after a keyframe is a keyframe again (so a
    chain is one keyframe and at most ``keyframe_every - 1`` deltas); None: only the first
    save. ``keep_last``: after each save, delete files that none of the newest
    ``keep_last`` steps needs. ``min_delta_elements``: smaller floating tensors are stored
    exactly. ``track``: optional ``(key_path, tensor) -> bool`` policy replacing the size
    rule for floating tensors. ``keyframe_coding``: "lossless" (default, ~1.2x smaller
    keyframes) or "raw" (byte planes stored uncoded; with today's decoder no faster to
    restore: 0.22 s against 0.21 s for a 245 MB keyframe).

    One writer per directory: the first save or merge locks the directory until
    :meth:`close` (or ``with DeltaCheckpointer(d) as ck:``); a second writer gets
    :class:`ConcurrentWriteError` at once. The object is not thread-safe: save/merge from
    two threads at the same time is refused the same way. ``load`` takes no lock.
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
        if isinstance(target, str):
            if target != "default":
                raise InvalidArgumentError(
                    f"target must be a number, a key_path -> target policy, None or 'default',"
                    f" got {target!r}")
            target = DEFAULT_TARGET if bits is None and error_bound is None else None
        if bits is None:
            bits = 2
        DeltaEncoder(2 if callable(bits) else bits, coder,      # validates the settings
                     error_bound=error_bound, keyframe_coding=keyframe_coding,
                     target=None if target is None or callable(target) else target)
        self.keyframe_coding = keyframe_coding
        self.directory = os.fspath(directory)     # created by the first save
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
        self._force_keyframe = False
        self._headers: dict[str, tuple] = {}    # file name -> (stat key, Link)
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
        return os.path.join(self.directory, file_name(step))

    def steps(self) -> list[int]:
        """Sorted list of the stored steps: regular files named like steps. A symbolic
        link (or anything else) under a step's name is not a step (:meth:`strays` lists
        them): a link could bring in another run's file, and retention would then delete
        this run's steps below it."""
        return sorted(s for s, regular in self._entries() if regular)

    def strays(self) -> list[str]:
        """Paths named like steps that are not regular files (links, directories)."""
        return [self.path(s) for s, regular in self._entries() if not regular]

    def _entries(self) -> list[tuple[int, bool]]:
        """``(step, is a regular file)`` of every name in the directory that names a step."""
        try:
            entries = list(os.scandir(self.directory))
        except FileNotFoundError:
            return []
        except OSError as e:
            raise StorageError(e.errno, f"cannot list the checkpoint directory: {e.strerror}",
                               self.directory) from None
        out = []
        for e in entries:
            m = _NAME_RE.fullmatch(e.name)
            if m and e.name == file_name(int(m.group(1))):
                try:
                    regular = e.is_file(follow_symlinks=False)
                except OSError:
                    regular = False
                out.append((int(m.group(1)), regular))
        return out

    def info(self, step: int) -> dict:
        """The chain metadata of ``step``'s file (kind, base, settings, per-tensor stats)."""
        return dict(self._link(step).meta)

    # ------------------------------------------------------------------ saving

    def save(self, step: int, obj: Any) -> str:
        """Store ``obj`` as ``step`` (a keyframe or a delta); returns the file's path."""
        step = self._check_step(step)
        try:
            os.makedirs(self.directory, exist_ok=True)
        except OSError as e:
            raise StorageError(e.errno, f"cannot create the checkpoint directory: {e.strerror}",
                               self.directory) from None
        with self._writing():
            return self._save(step, obj)

    def _save(self, step: int, obj: Any) -> str:
        if self._encoders is None:
            self._resume()
        if self._last is not None and step <= self._last["step"]:
            raise InvalidArgumentError(
                f"step {step} is not after the newest stored step {self._last['step']}; steps "
                "must increase (delete the later files first to rewrite history)")
        keyframe = (self._last is None or self._force_keyframe
                    or (self.keyframe_every is not None
                        and self._last["depth"] + 1 >= self.keyframe_every))
        session = _SaveSession(self._encoders, self._new_encoder,
                               self._track or self._size_rule, keyframe,
                               None if self.target is None else self._small, self._exact_of,
                               self.warn_error, self.min_delta_elements)
        path = self.path(step)
        try:
            meta, sections = pack(obj, encode_leaf=session.encode_leaf, pack_small=session.packs,
                                  encode_pack=session.encode_pack)
            for key in set(self._encoders) - set(session.stats):   # no longer present
                del self._encoders[key]
            state_id = secrets.token_hex(8)
            depth = 0 if keyframe else self._last["depth"] + 1
            meta["lcckpt_chain"] = {
                "version": CHAIN_VERSION,
                "step": step,
                "kind": "keyframe" if keyframe else "delta",
                "state_id": state_id,
                "base": None if keyframe else {"step": self._last["step"],
                                               "file": file_name(self._last["step"]),
                                               "state_id": self._last["state_id"]},
                "depth": depth,
                "settings": self._settings(),
                "tensors": session.stats,
            }
            copying = [e for e in self._encoders.values() if isinstance(e, DeltaEncoder)]

            def start_copies():        # references copied while the file is written, synced
                for e in copying:
                    e.start_copy()
            unsynced = None
            try:
                nbytes = write_container(path, sections, meta, before_write=start_copies)
            except _durable.UnsyncedError as e:    # in place: the step is saved
                unsynced, nbytes = e, _file_bytes(path)
            finally:
                for e in copying:
                    e.settle()         # before the caller may change its tensors again
        except BaseException:
            self._encoders = None      # references may have advanced: resync from disk
            raise
        if unsynced is not None:
            warnings.warn(f"step {step} is saved, but syncing {self.directory} failed "
                          f"({unsynced.strerror}): the step may not survive a power loss; the "
                          "next save syncs the directory again (as every save does)", RuntimeWarning, stacklevel=2)
        self._last = {"step": step, "state_id": state_id, "depth": depth}
        self._force_keyframe = False
        for key, ratio, t in session.missed:
            warnings.warn(f"step {step}: {key} restores with an error of {ratio:.3g}x its "
                          f"movement since the keyframe (target {t:g}): most of the update is "
                          "under the dtype's precision and was not kept; merge() this step "
                          "into a keyframe if it matters", RuntimeWarning, stacklevel=2)
        for key, err in session.drifted:
            warnings.warn(f"step {step}: {key} restores with relative error {err:.3g}, past "
                          f"warn_error={self.warn_error:g}; raise its bits or set a target",
                          RuntimeWarning, stacklevel=2)
        self.last_save = {"step": step, "kind": meta["lcckpt_chain"]["kind"], "path": path,
                          "nbytes": nbytes}
        self._apply_retention()
        return path

    def _settings(self) -> dict:
        out = {"bits": "per tensor" if callable(self.bits) else self.bits, "coder": self.coder,
               "error_bound": self.error_bound,
               "keyframe_every": self.keyframe_every,
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
                                relative_to="movement" if self._movement_targets() else "norm")
        bits = self.bits(key) if callable(self.bits) else self.bits
        return DeltaEncoder(bits, self.coder, error_bound=self.error_bound,
                            keyframe_coding=self.keyframe_coding)

    @staticmethod
    def _check_step(step) -> int:
        try:
            step = operator.index(step)
        except TypeError:
            raise InvalidArgumentError(f"step must be an int, got {type(step).__name__}") from None
        if step < 0:
            raise InvalidArgumentError(f"step must be >= 0, got {step}")
        return step

    def _resume(self) -> None:
        """Rebuild the encoders' references from disk: what a reader reconstructs."""
        self._clean_temps()
        self._encoders, self._last, self._force_keyframe = {}, None, False
        steps = self.steps()
        if not steps:
            return
        latest = steps[-1]
        try:
            _, links, tracks = self._restore(latest, build=False, max_bytes=None,
                                             movement=self._movement_targets())
        except (LcckptError, OSError) as e:
            warnings.warn(f"cannot continue the delta chain from step {latest} ({e}); the next "
                          "save is written as a keyframe", RuntimeWarning, stacklevel=3)
            self._last = {"step": latest, "state_id": "", "depth": 0}
            self._force_keyframe = True
            return
        self._encoders.update(tracks)   # Reconstructions: the first save makes the encoders
        top = links[-1][1]
        self._last = {"step": latest, "state_id": top.state_id, "depth": top.depth}

    def _clean_temps(self) -> None:
        _durable.remove_stale_temps(self.directory)

    # ------------------------------------------------------------------ loading

    def load(self, step: int | None = None, map_location=None, *,
             max_bytes=limits.DEFAULT) -> Any:
        """The object stored as ``step`` (default: the newest), rebuilt through its chain.

        ``max_bytes`` as in :func:`lcckpt.load`, for the files of the chain together:
        each must declare at most the limit, "auto" being computed from their total size;
        under "auto" a delta's tensors that the chain already holds at their size do not
        count (they decode in place), so a delta 1000x smaller than its state loads.
        """
        if step is None:
            steps = self.steps()
            if not steps:
                raise self._no_checkpoints()
            step = steps[-1]
        step = self._check_step(step)
        return self._restore(step, build=True, map_location=map_location, keep_tracks=False,
                             max_bytes=max_bytes)[0]

    def _no_checkpoints(self) -> NotFoundError:
        d = self.directory
        if not os.path.isdir(d):
            why = "the directory does not exist"
        else:
            others = [n for n in os.listdir(d) if n != LOCK_NAME]
            why = ("the directory is empty" if not others else
                   f"it holds {len(others)} other entries but no step-<step>.lcc file: "
                   "is it the right directory?")
        return NotFoundError(errno.ENOENT, f"no checkpoints to load: {why}", d)

    def _missing_step(self, step: int) -> NotFoundError:
        if not self.steps():
            return self._no_checkpoints()
        return NotFoundError(errno.ENOENT, f"no checkpoint for step {step}; stored: "
                             f"{_brief(self.steps())}", self.path(step))

    def replay(self, start: int | None = None, stop: int | None = None, map_location=None,
               *, max_bytes=limits.DEFAULT, build: bool = True):
        """Yield ``(step, obj)`` for every stored step in ``[start, stop]``, oldest first.

        Each file is decoded once: a step continues from the previous one's references
        (what :meth:`load` of each step would give, without walking every chain again).
        ``build=False`` yields ``(step, None)``: every delta is decoded but no object is
        built (a check of the whole chain in the memory of one state).
        """
        known = None
        for step in self.steps():
            if (start is not None and step < start) or (stop is not None and step > stop):
                continue
            obj, links, tracks = self._restore(step, build=build, map_location=map_location,
                                               known=known, max_bytes=max_bytes)
            known = (step, links[-1][1].state_id, tracks)
            yield step, obj

    def _walk(self, step: int, stack: ExitStack, known=None, max_bytes=limits.DEFAULT):
        """The files ``step`` is restored from, keyframe first, as ``[(container, link,
        path)]`` opened in ``stack``, each checked to be the state the next was made
        against, and all of them checked against ``max_bytes`` before anything is decoded
        (what :meth:`load` and the lazy reader both read). ``known``: ``(step, state_id,
        tracks)`` of a restored step to stop at; returns ``(links, its tracks or {})``."""
        if not os.path.exists(self.path(step)):
            raise self._missing_step(step)
        links = []                           # newest first: (container, link, path)
        s, expect, tracks = step, None, {}
        while True:
            if known is not None and s == known[0] and expect == known[1]:
                tracks = known[2]
                break
            path = self.path(s)
            try:
                c = stack.enter_context(read_container(path))
                link = Link(c.meta.get("lcckpt_chain"), s, path)
            except FileNotFoundError as e:
                raise self._fault(step, s, path, BrokenChainError("the file is missing")) from e
            except (LcckptError, OSError) as e:
                raise self._fault(step, s, path, e) from e
            if expect is not None and link.state_id != expect:
                raise self._fault(step, s, path, BrokenChainError(
                    f"it holds state {link.state_id}, but step {links[-1][1].step} was made "
                    f"against state {expect}: a file of another run or a rewritten file"))
            links.append((c, link, path))
            if link.kind == "keyframe":
                break
            s, expect = link.base_step, link.base_state_id
        links.reverse()
        self._check_limits(links, tracks, max_bytes)
        return links, tracks

    def _restore(self, step: int, *, build: bool, map_location=None, known=None,
                 keep_tracks: bool = True, max_bytes=limits.DEFAULT, movement: bool = False):
        """Walk back to the keyframe (or to ``known``), then apply each file in order.

        ``known``: ``(step, state_id, tracks)`` of an already restored step to start from.
        ``keep_tracks=False``: the caller discards the returned tracks, so the restored
        tensors may take over the references instead of copying them.
        ``max_bytes``: checked for every file before anything is decoded; deltas decode
        into references of the keyframe's shapes, so the files' total size is the base.
        ``movement``: the tracks also keep their keyframes' :class:`Movement` (a writer
        resuming with "movement" targets).
        Returns ``(obj or None, [(container, link)], tracks of step)``.
        """
        with ExitStack() as stack:
            links, tracks = self._walk(step, stack, known, max_bytes)
            obj = None
            for i, (c, link, path) in enumerate(links):
                try:
                    if build and i == len(links) - 1:
                        replay = FileReplay(tracks, copy=keep_tracks)
                        obj = unpack(c, map_location, decode_leaf=replay.decode_leaf)
                        tracks = replay.after
                    else:
                        tracks = FileReplay(tracks, movement=movement).advance_all(c)
                except (LcckptError, OSError) as e:
                    raise self._fault(step, link.step, path, e) from e
            return obj, [(c, link) for c, link, _ in links], tracks

    @staticmethod
    def _check_limits(links: list, tracks: dict, max_bytes) -> None:
        """Every file of a chain against ``max_bytes``, before anything is decoded.

        Under the default ("auto") a delta's tracked tensor that the chain already holds
        at the same size (its keyframe, an earlier delta, or ``tracks`` from a step
        restored before) is not counted: it decodes into that reference, whose size the
        file that brought it was checked for. So a 1000x delta of a large state loads,
        while everything a file brings anew counts against its chain's stored size.
        """
        stored = sum(c.size for c, _, _ in links)
        vouch = limits.is_auto(max_bytes)
        held = {k: int(np.prod(r.shape)) for k, r in tracks.items()
                if isinstance(r, Reconstruction) and r.shape is not None}
        for c, link, path in links:
            declared, new = 0, {}
            for sec in c.sections:
                meta = sec["meta"]
                key = delta_key(meta)
                if key is not None:
                    n = elements(meta)
                    if vouch and link.kind == "delta" and held.get(key) == n:
                        continue
                    new[key] = n
                declared += limits.declared_bytes([sec])
            try:
                limits.check(declared, stored, max_bytes,
                             f"step {link.step} with its chain ({len(links)} files)")
            except LcckptError as e:
                raise type(e)(f"{path}: {e}") from None
            held.update(new)

    @staticmethod
    def _fault(step: int, at: int, path: str, e: Exception) -> LcckptError:
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

    def _link(self, step: int) -> Link:
        """The validated chain header of ``step`` (cached by file identity)."""
        path = self.path(step)
        try:
            st = os.stat(path)
        except FileNotFoundError:
            raise self._missing_step(step) from None
        key = (st.st_ino, st.st_mtime_ns, st.st_size)
        hit = self._headers.get(path)
        if hit is not None and hit[0] == key:
            return hit[1]
        with read_container(path) as c:
            link = Link(c.meta.get("lcckpt_chain"), step, path)
        self._headers[path] = (key, link)
        return link

    # ------------------------------------------------------------------ merge, retention

    def merge(self, upto: int | None = None) -> str:
        """Rewrite ``upto`` (default newest) as a keyframe of exactly its restored state.

        Tracked tensors are stored losslessly in their tracking precision (no
        re-quantization), every other section is copied byte for byte, and the state id is
        kept, so loads of ``upto`` and of every later delta are unchanged and files before
        ``upto`` are no longer needed by them. Returns the file's path.
        """
        if upto is None:
            steps = self.steps()
            if not steps:
                raise self._no_checkpoints()
            upto = steps[-1]
        upto = self._check_step(upto)
        if not os.path.exists(self.path(upto)):
            raise self._missing_step(upto)
        with self._writing():
            return self._merge(upto)

    def _merge(self, upto: int) -> str:
        path = self.path(upto)
        _, links, tracks = self._restore(upto, build=False, max_bytes=None)
        top = links[-1][1]
        if top.kind != "keyframe":
            with read_container(path) as c:
                link = Link(c.meta.get("lcckpt_chain"), upto, path)
                if link.state_id != top.state_id:
                    raise BrokenChainError(f"{path} changed while being merged")
                sections = []
                stats = {}
                for i, s in enumerate(c.sections):
                    meta = s["meta"]
                    if meta.get("codec") == DELTA:
                        key = section_key(meta)
                        blob = tracks[key].exact_blob()
                        n = _blob.nbytes(blob)
                        stats[key] = {"kind": "lossless", "bits": None,
                                      "bits_per_element": _finite(8 * n / max(1, tracks[key].ref.size)),
                                      "rel_error": 0.0, "nbytes": n}
                        sections.append((s["name"], meta, blob))
                    else:
                        sections.append((s["name"], meta, c.data(i)))
                meta = dict(c.meta)
            info = dict(meta["lcckpt_chain"])
            info.update(kind="keyframe", base=None, depth=0, tensors=stats,
                        merged={"from_base": info["base"], "from_depth": info["depth"]})
            meta["lcckpt_chain"] = info
            try:
                write_container(path, sections, meta)
            except _durable.UnsyncedError as e:     # in place: the merge is done
                warnings.warn(f"step {upto} is merged, but syncing {self.directory} failed "
                              f"({e.strerror}): the next save syncs the directory again",
                              RuntimeWarning, stacklevel=3)
            if self._last is not None and self._last["step"] == upto:
                self._last["depth"] = 0     # the cadence counts from this new keyframe
                for enc in (self._encoders or {}).values():   # and movement from it
                    if isinstance(enc, DeltaEncoder) and enc.relative_to == "movement" \
                            and enc.ref is not None:
                        enc.movement = Movement(enc.ref)
                    elif isinstance(enc, Reconstruction) and enc.movement is not None:
                        enc.movement = Movement(enc.ref)
        self._apply_retention()
        return path

    def _apply_retention(self) -> None:
        if self.keep_last is None:
            return
        try:
            steps = self.steps()
        except StorageError as e:       # the step is committed: retried at the next save
            warnings.warn(f"retention (keep_last={self.keep_last}) skipped: {e}",
                          RuntimeWarning, stacklevel=3)
            return
        if len(steps) <= self.keep_last:
            return
        needed: set[int] = set()
        for s in steps[-self.keep_last:]:
            while s not in needed:
                needed.add(s)
                try:
                    link = self._link(s)
                except (LcckptError, OSError):
                    needed.update(x for x in steps if x <= s)   # unknown base: keep all older
                    break
                if link.kind == "keyframe":
                    break
                s = link.base_step
        removed, failed = False, []
        # newest first, stopping at the first failure: a step left behind (by a failure or
        # a crash) still has every older file its chain walks back through
        for s in reversed(steps):
            if s not in needed:
                try:
                    os.unlink(self.path(s))
                    removed = True
                except FileNotFoundError:
                    pass
                except OSError as e:     # the step is committed: retried at the next save
                    failed.append(f"{self.path(s)} ({e.strerror})")
                    break
                self._headers.pop(self.path(s), None)
        try:
            if removed:
                _durable.fsync_dir(self.directory)
        except OSError as e:
            failed.append(f"{self.directory} (directory sync: {e.strerror})")
        if failed:
            warnings.warn(f"retention (keep_last={self.keep_last}) could not remove "
                          f"{', '.join(failed[:3])}{' ...' if len(failed) > 3 else ''}; the "
                          "new step is saved, and the next save tries again",
                          RuntimeWarning, stacklevel=3)


def _brief(steps: list[int]) -> str:
    if not steps:
        return "none"
    if len(steps) <= 6:
        return ", ".join(map(str, steps))
    return f"{steps[0]}, {steps[1]}, ..., {steps[-2]}, {steps[-1]} ({len(steps)} steps)"
