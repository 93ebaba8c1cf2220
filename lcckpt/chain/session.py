"""One save's coding: which tensors a chain tracks, and each tracked tensor's delta
with the stats its file's header reports (docs/chain.md, "What each file reports")."""

from __future__ import annotations

import functools
from collections.abc import Callable

import numpy as np
import torch

from ..codec import blob as _blob
from ..codec.delta import NONFINITE, NONFINITE_DONE, DeltaEncoder, Reconstruction
from ..codec.dtypes import to_numpy
from ..codec.tensor import encode_exact
from ..format import sections as _sections
from ..format import serialization as _serialization
from ..format import stream as _stream
from ..format.flatten import renumber_sections
from ..format.sections import DELTA, TRACKABLE, Encoded
from ..util.ahead import Ahead
from ..util.pool import threads
from .policy import role_of
from ..util.caller import warn_user

MISSED = 0.5            # a restored error past this share of a step's movement is warned of
# a stored stat has 4 significant digits (:func:`finite`): a ratio of two of them, set
# against a third, is off by up to ~1.5e-3 of its value, so a reader of the stats counts
# an error as past its target only beyond this (the writer judges the exact values)
STATS_ROUNDING = 2e-3
AHEAD_MIN = 1 << 14     # elements of a tensor coded ahead: smaller ones are mostly Python,
AHEAD_MAX = 1 << 20     # which a second thread does not speed up; a tensor coded ahead
                        # holds its symbols (or exact blob) until written: few stay small
AHEAD_SHARE = 0.25      # ... and only where such tensors hold this share of the elements


class SaveSession:
    """One save: decides per tensor whether it is tracked and codes it (the leaf encoder
    this save passes to :func:`lcckpt.format.serialization.pack`).
    ``lazy``: uniform deltas come as :class:`~lcckpt.codec.blob.LazyBlob` pieces, which
    only a file written as it is encoded may take (it reads each at once).

    ``make(path, exact)`` builds a tensor's encoder: lossy for tracked tensors, an exact
    delta coder (``exact=True``) for the small floating tensors ``small(path, t)`` picks
    (None: those are stored as plain exact sections, LC-Checkpoint's way)."""

    def __init__(self, encoders: dict, make: Callable, track: Callable, keyframe: bool,
                 small: Callable | None = None, exact_of: dict | None = None,
                 warn_error: float | None = None, pack_below: int = 0, lazy: bool = False,
                 directions: dict | None = None):
        self.encoders, self.make, self.track, self.keyframe = encoders, make, track, keyframe
        self.directions = directions or {}      # weight path -> its first moment (moments.py)
        self.lazy = lazy          # deltas coded while the file takes them (streamed saves)
        self.pack_below = pack_below
        self.small, self.warn_error = small, warn_error
        self.drifted: list[tuple[str, float]] = []     # (path, restored error) past warn_error
        self.missed: list[tuple[str, float, float]] = []   # (path, error/movement, target)
        self.nonfinite: list[tuple[str, str]] = []     # (path, why) stored exactly for NaN/Inf
        self.exact_of = {} if exact_of is None else exact_of   # path -> its encoder is exact
        self.stats: dict[str, dict] = {}
        self._planned: dict[str, tuple] = {}     # path -> (job index, job): ahead()
        self._ahead: Ahead | None = None
        self.loadable = _sections.Loadable()     # the file loads under the default limit

    def warn(self, step: int) -> None:
        """The saved step's warnings: NaN/Inf stored exactly, updates under the
        precision, restores past ``warn_error``."""
        for key, why in self.nonfinite:
            warn_user(f"step {step}: {key}: {why}; {NONFINITE_DONE}")
        for key, ratio, t in self.missed:
            how = "" if ratio is None else f" of {ratio:.3g}x its movement since the keyframe"
            warn_user(f"step {step}: {key} restores with an error{how} (target {t:g}): "
                      "most of the update is "
                      "under the working precision (fp32's; fp64's for fp64) and was "
                      "not kept; merge() this step into a keyframe if it matters")
        for key, err in self.drifted:
            warn_user(f"step {step}: {key} restores with relative error {err:.3g}, past "
                      f"warn_error={self.warn_error:g}; raise its bits or set a target")

    def packs(self, path: str, t: torch.Tensor) -> bool:
        """Whether ``t`` joins its dtype's pack: a small tensor no rule tracks (one
        section and one codec call per scalar made 100,000-tensor saves take minutes)."""
        return t.numel() < self.pack_below and not (t.dtype in TRACKABLE and self.track(path, t))

    def encode_pack(self, path: str, t: torch.Tensor) -> Encoded:
        """A pack of small tensors: coded as one small tensor (never lossy)."""
        return self.encode_leaf(path, t, small=True)

    def encode_leaf(self, path: str, t: torch.Tensor, small: bool = False) -> Encoded:
        planned = self._planned.pop(path, None)
        if planned is not None:         # coded ahead (t: a new view of the same tensor)
            i, job = planned
            return self._encoded(path, t, job, *self._ahead.take(i))
        if not small and _sections.all_zeros(t):
            # stored as its shape, and not tracked (no stats: its encoder goes): the
            # next non-zero value starts afresh, as a tensor new to the chain does
            return _sections.zeros_encoded()
        job = self._job(path, t, small)
        if job is None:
            return self.loadable(_sections.encode_with(_sections.LOSSLESS, path, t), t)
        return self._encoded(path, t, job, *self._code(path, t, job))

    def pack(self, obj, encode_leaf: Callable, encode_pack: Callable) -> tuple:
        """``obj`` as ``(meta, sections)``, coded by ``encode_leaf`` and ``encode_pack``
        (this session's, maybe wrapped: :func:`write_streamed`)."""
        try:
            return _serialization.pack(obj, encode_leaf=encode_leaf, pack_small=self.packs,
                                       encode_pack=encode_pack, ahead=self.ahead)
        finally:
            self.close()                # no tensor is coded ahead any more

    def ahead(self, leaves: list[tuple[str, torch.Tensor]]) -> None:
        """The tensors ``encode_leaf`` will be asked for, in that order (dense, on the
        host: the very data it gets): the tracked ones of :data:`AHEAD_MIN` to
        :data:`AHEAD_MAX` elements are coded by two threads (lcckpt/util/ahead.py), where
        they hold :data:`AHEAD_SHARE` of the elements. :meth:`close` must follow."""
        jobs, planned = [], 0
        for path, t in (leaves if threads() > 1 else ()):    # LCCKPT_THREADS=1: one thread
            if not AHEAD_MIN <= t.numel() <= AHEAD_MAX or _sections.all_zeros(t):
                continue
            job = self._job(path, t, False)
            if job is not None:
                self._planned[path] = (len(jobs), job)
                jobs.append(functools.partial(self._code, path, t, job))
                planned += t.numel()
        # worth a second thread (its own buffers and heap) where such tensors are a good
        # part of the state: a transformer's, not a wide MLP's few biases
        if len(jobs) > 1 and planned >= AHEAD_SHARE * sum(t.numel() for _, t in leaves):
            self._ahead = Ahead(jobs)
        else:
            self._planned.clear()

    def close(self) -> None:
        """Wait until no tensor is coded ahead any more (after an error too)."""
        if self._ahead is not None:
            self._ahead.close()
            self._ahead = None
        self._planned.clear()

    def _job(self, path: str, t: torch.Tensor, small: bool):
        """``(encoder, exact, from_zero)`` of a tracked or small float tensor; None: the
        tensor is stored exactly, as a plain section."""
        if t.dtype not in TRACKABLE:
            return None
        if small:
            if self.small is None:
                return None
            exact = True
        elif self.track(path, t):
            exact = False
        elif self.small is not None and self.small(path, t):
            exact = True
        else:
            return None
        enc = self.encoders.get(path)
        if isinstance(enc, Reconstruction):          # reopened chain: continue from disk
            rec, enc = enc, self.make(path, exact)
            enc.resume(rec)
            self.encoders[path] = enc
        elif enc is None or self.exact_of.get(path) != exact:
            enc = self.encoders[path] = self.make(path, exact)
        self.exact_of[path] = exact
        # an optimizer moment new since the keyframe (its first step): lossy against
        # zeros where a target bounds it, its movement being its value; a weight new to
        # the chain is written exactly, as the distributed writer does (targets.py)
        from_zero = not enc.has_ref and not self.keyframe and not exact \
            and enc.config.target is not None and role_of(path) != "weight"
        return enc, exact, from_zero

    def _code(self, path: str, t: torch.Tensor, job) -> tuple:
        """The coding itself (on either thread of :meth:`ahead`): ``(pieces, stats)``.
        The copy of a keyframe into the reference waits: it runs while the file is
        written."""
        enc, exact, from_zero = job
        return enc.encode_parts(t, keyframe=self.keyframe, from_zero=from_zero,
                                defer_copy=True, lazy=self.lazy, warn=False,
                                direction=None if exact else self.directions.get(path))

    def _encoded(self, path: str, t: torch.Tensor, job, parts: list, st) -> Encoded:
        """The section of a coded tensor, its stats noted. An exact blob that would keep
        the file from loading under the default limit is stored with raw planes (a large
        constant: :class:`~lcckpt.format.sections.Loadable`; a chain decodes a 16-bit
        tensor through fp32, and the limit counts it three times)."""
        enc, exact, from_zero = job
        nbytes = _blob.nbytes(parts)
        if st.kind == "lossless" and not self.loadable.admit(
                t.numel() * t.element_size() * (1 if t.element_size() > 2 else 3), nbytes):
            parts = encode_exact(*to_numpy(t), enc.config.log2, raw=True)
            nbytes = _blob.nbytes(parts)
        self.stats[path] = rec = {
            "kind": st.kind,
            "bits": st.bits,
            "bits_per_element": finite(8 * nbytes / st.n if st.n else 0.0),
            "rel_error": finite(st.rel_error),
            "nbytes": nbytes,
        }
        if enc.config.target is not None:
            rec["target"] = enc.config.target
        if enc.last_movement is not None and st.kind == "uniform":
            self._note_movement(path, rec, enc, st)
        if st.kind == "uniform" and st.escapes:     # (its step is in the blob's header)
            rec["escapes"] = st.escapes
        if st.fallback and not exact:          # exact deltas are stored exactly by intent
            rec["fallback"] = st.fallback
            if st.fallback in NONFINITE:
                self.nonfinite.append((path, st.fallback))
        if self.warn_error is not None and st.rel_error > self.warn_error:
            self.drifted.append((path, float(st.rel_error)))
        params = {"key": path}
        if from_zero and st.kind != "lossless":
            params["base"] = "zero"
        return Encoded(DELTA, parts, params)

    def _note_movement(self, path: str, rec: dict, enc: DeltaEncoder, st) -> None:
        """Report a movement target's terms: ``movement`` relative to ``||u||``, the
        ``target`` as the error allowed relative to the movement (the role's share, or
        the update share where that allows more). The working precision's floor may let
        the error pass it; past :data:`MISSED` of the movement too, the update is
        reported as missed."""
        moved, norm, kept = enc.last_movement
        rec["movement"] = finite(moved / norm if norm else 0.0)
        err = st.rel_error * norm
        target = kept / moved if moved > 0 else enc.config.target
        rec["target"] = finite(target)
        if moved > 0:
            rec["error_vs_movement"] = finite(err / moved)
        # past what the target kept (kept: a tensor back at its keyframe's values has no
        # movement, and only its update share to hold) and past MISSED of the movement
        if err > max(kept, MISSED * moved) * (1 + 1e-6) and err > 0:
            self.missed.append((path, err / moved if moved else None, target))


# what a file says already: its sections' sizes, and rel_error / movement
DERIVED_STATS = ("nbytes", "bits_per_element", "error_vs_movement")


def stored_stats(stats: dict) -> dict:
    """The per-tensor stats as a file stores them: without what the reader derives
    (links.with_sizes; every delta file of a small model carries them, header bytes each
    time)."""
    return {k: {f: v for f, v in st.items() if f not in DERIVED_STATS}
            for k, st in stats.items()}


def finite(x):
    """A stat for the header: 4 significant digits (every digit is header bytes in
    every delta file), None for NaN/Inf."""
    x = float(x)
    return float(f"{x:.4g}") if np.isfinite(x) else None


def write_streamed(f, obj, encode, session: SaveSession, start_copies, room: int,
                   stamp) -> tuple:
    """A file written as it is encoded; each tensor's reference copy (a keyframe's) starts
    as soon as its section is in the file. Returns the file's size and its header's need."""
    stream = _stream.SectionStream(f, room)

    def spooling(encode_fn):
        spool = stream.wrap(encode_fn)

        def leaf(path, t, *args, **kw):
            out = spool(path, t, *args, **kw)
            enc = session.encoders.get(path)
            if isinstance(enc, DeltaEncoder):
                enc.start_copy()
            return out
        return leaf
    meta, sections = encode(spooling(session.encode_leaf), spooling(session.encode_pack))
    start_copies()                 # those not started yet
    return stream.finish(meta, sections, renumber_sections, stamp), stream.header_need
