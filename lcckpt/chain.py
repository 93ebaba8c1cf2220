"""DeltaCheckpointer: a directory of keyframes and deltas of one training run.

Every save writes one container file, ``step-<12-digit step>.lcc``, atomically (temp file,
fsync, rename). Floating tensors with at least ``min_delta_elements`` elements are tracked
by their own :class:`~lcckpt.delta.DeltaEncoder` keyed by their key path (the same path
names their section); a *keyframe* stores them exactly, a *delta* stores each as a lossy
delta against the reconstruction of the previous step. Everything else (small or integer
tensors, step counters, Python values) is stored exactly in every file, so a file's object
tree is always complete and only its tracked tensors depend on earlier files.

Each file's header ``meta["lcckpt_chain"]`` names its base (the previous step) by step,
file name and ``state_id``, a random id given to each reconstructed state when it is
first written; a delta whose base file carries another id is refused. :meth:`merge`
rewrites a delta as a keyframe of the very same reconstructed state (stored losslessly,
in the tracking precision), so it keeps the state id and later deltas still apply.

Tracked sections use the section codec ``"delta"`` registered here: its blob is a
lossless tensor blob (keyframes, and tensors new in a delta) or a lossy delta blob.
``lcckpt.load`` reads keyframe files directly; a delta file needs its chain and is
refused with :class:`BrokenChainError`.

One writer per directory is assumed (no locking); any number of readers may load while
it writes, since files only ever appear complete.
"""

from __future__ import annotations

import contextvars
import operator
import os
import re
import secrets
import warnings
from collections.abc import Callable
from contextlib import ExitStack
from typing import Any

import numpy as np
import torch

from . import codec as _codec
from . import container as _container
from . import dtypes
from .codec import LOSSLESS, apply_deltas, blob_nbytes, decode_exact, parse
from .delta import DeltaEncoder
from .errors import (
    BrokenChainError,
    CorruptDataError,
    InvalidArgumentError,
    LcckptError,
    UnsupportedVersionError,
)
from .serialization import pack, register_codec, unpack

__all__ = ["DELTA_CODEC", "DeltaCheckpointer"]

CHAIN_VERSION = 1
DELTA_CODEC = "delta"
_NAME_RE = re.compile(r"step-(\d{12,})\.lcc")
_TEMP_RE = re.compile(r"\.(step-\d{12,}\.lcc)\..*\.lcckpt-tmp")
_TRACKABLE = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
_WORK_DTYPES = {"F16": "F32", "BF16": "F32"}   # tracked in fp32, cast back on restore

_ENCODING: contextvars.ContextVar = contextvars.ContextVar("lcckpt_chain_encoding", default=None)
_DECODING: contextvars.ContextVar = contextvars.ContextVar("lcckpt_chain_decoding", default=None)


def file_name(step: int) -> str:
    """The file name of ``step`` in a checkpoint directory."""
    return f"step-{step:012d}.lcc"


# --------------------------------------------------------------------------- the codec


class _Track:
    """The reconstruction of one tracked tensor: flat working floats, user dtype, shape.

    Deltas are validated as they arrive but applied lazily, all pending ones together
    (:func:`lcckpt.codec.apply_deltas`, chunk by chunk across the deltas), the first time
    the reference is needed: replaying a chain then streams the model through memory
    once instead of once per delta. A keyframe stored in the working precision waits
    too, and is decoded chunk by chunk in that same pass.
    """

    __slots__ = ("_ref", "_key", "pending", "dt", "shape")

    def __init__(self):
        self._ref: np.ndarray | None = None
        self._key = None                  # (buf, parsed) of a keyframe not yet decoded
        self.pending: list = []
        self.dt: dtypes.DType | None = None
        self.shape: tuple | None = None

    @property
    def ref(self) -> np.ndarray | None:
        if self._key is not None:
            p = self._key[1]
            ref = np.empty(p.n, p.dt.numpy)
            apply_deltas(self.pending, ref, base=self._key)
            self._ref, self._key, self.pending = ref, None, []
        elif self.pending:
            apply_deltas(self.pending, self._ref)
            self.pending = []
        return self._ref

    def apply(self, blob, meta: dict, key: str) -> None:
        """Advance by one section's blob exactly as the encoder advanced its reference.

        The blob comes from a container section whose CRC was just verified, so its own
        payload checksum is not computed a second time.
        """
        buf, p = parse(blob, check_payload=False)
        name, shape = meta.get("dtype"), tuple(meta.get("shape", ()))
        if p.shape != shape:
            raise CorruptDataError(f"{key}: blob shape {list(p.shape)} != section shape {list(shape)}")
        if p.kind == LOSSLESS:
            if p.dt.name != name and _WORK_DTYPES.get(name) != p.dt.name:
                raise CorruptDataError(f"{key}: blob dtype {p.dt.name} for a {name} section")
            if p.dt.kind != "float" or p.dt.name.startswith("F8"):
                raise CorruptDataError(f"{key}: {p.dt.name} is not a tracked dtype")
            if p.dt.name in _WORK_DTYPES:         # fp16/bf16: widened to fp32 right away
                ref = dtypes.to_float_work(decode_exact(buf, p), p.dt).reshape(-1)
                if not ref.flags.writeable or not ref.flags.c_contiguous:
                    ref = ref.copy()
                self._ref, self._key = ref, None
            else:
                self._ref, self._key = None, (buf, p)
            self.pending = []
            self.dt, self.shape = dtypes.BY_NAME[name], shape
            return
        if p.dt.name != name:
            raise CorruptDataError(f"{key}: blob dtype {p.dt.name} for a {name} section")
        if self._ref is None and self._key is None:
            raise BrokenChainError(f"{key}: a delta without a reference (its keyframe is missing)")
        if p.dt != self.dt or p.shape != self.shape:
            raise BrokenChainError(
                f"{key}: delta for {p.dt.name}{list(p.shape)} does not fit the reference "
                f"{self.dt.name}{list(self.shape)}")
        self.pending.append((buf, p))

    def value(self, copy: bool = True):
        """The restored tensor in the user's dtype; ``copy=False`` hands over the reference
        itself (for a final step whose tracks are discarded)."""
        ref = self.ref.reshape(self.shape)
        return dtypes.from_float_work(ref.copy() if copy else ref, self.dt)

    def exact_blob(self) -> bytes:
        """The reference itself, losslessly (fp32 for fp16/bf16 tensors): a merge keyframe."""
        return _codec.encode(self.ref.reshape(self.shape), lossless=True)


def _codec_encode(t: torch.Tensor):
    session = _ENCODING.get()
    if session is None:
        raise InvalidArgumentError(
            f"the {DELTA_CODEC!r} section codec is written by lcckpt.DeltaCheckpointer only; "
            "use codec='lossless' with lcckpt.save")
    return session.encode(t)


def _codec_decode(data, meta: dict):
    key = _section_key(meta)
    ctx = _DECODING.get()
    if ctx is None:                       # plain lcckpt.load: keyframes only
        buf, p = parse(data)
        if p.kind != LOSSLESS:
            raise BrokenChainError(
                f"{key} is a delta against an earlier checkpoint; restore it with "
                "lcckpt.DeltaCheckpointer(directory).load(step)")
        t = _Track()
        t.apply(data, meta, key)
        return t.value()
    old, new, copy = ctx
    track = old.get(key) or _Track()
    track.apply(data, meta, key)
    new[key] = track
    return track.value(copy)


def _section_key(meta: dict) -> str:
    params = meta.get("codec_params")
    key = params.get("key") if type(params) is dict else None
    if type(key) is not str:
        raise CorruptDataError("a delta section has no tracking key in its codec_params")
    return key


register_codec(DELTA_CODEC, _codec_encode, _codec_decode, dtypes=_TRACKABLE, replace=True)


class _Session:
    """One save: decides per tensor whether it is tracked, and encodes tracked ones."""

    def __init__(self, encoders: dict, make: Callable, track: Callable, keyframe: bool):
        self.encoders, self.make, self.track, self.keyframe = encoders, make, track, keyframe
        self.pending: str | None = None
        self.stats: dict[str, dict] = {}

    def choose(self, path: str, t: torch.Tensor) -> str:
        if t.dtype in _TRACKABLE and self.track(path, t):
            self.pending = path
            return DELTA_CODEC
        return "lossless"

    def encode(self, t: torch.Tensor):
        key, self.pending = self.pending, None
        if key is None:
            raise InvalidArgumentError("delta codec called without a tracked tensor")
        enc = self.encoders.get(key)
        if enc is None:
            enc = self.encoders[key] = self.make(key)
        blob = enc.encode_parts(t, keyframe=self.keyframe)
        st, nbytes = enc.last_stats, blob_nbytes(blob)
        self.stats[key] = {
            "kind": st.kind,
            "bits": st.bits,
            "bits_per_element": _finite(8 * nbytes / st.n if st.n else 0.0),
            "rel_error": _finite(st.rel_error),
            "nbytes": nbytes,
        }
        if st.fallback:
            self.stats[key]["fallback"] = st.fallback
        return blob, {"key": key}


def _finite(x):
    x = float(x)
    return round(x, 6) if np.isfinite(x) else None


# --------------------------------------------------------------------------- chain info


class _Link:
    """What one file's header says about its place in the chain."""

    __slots__ = ("step", "kind", "state_id", "base_step", "base_state_id", "depth", "meta")

    def __init__(self, info: dict, step: int, name: str):
        def bad(msg):
            raise CorruptDataError(f"{name}: invalid chain metadata: {msg}")

        if type(info) is not dict:
            bad("no 'lcckpt_chain' entry; not written by DeltaCheckpointer")
        v = info.get("version")
        if type(v) is not int or v < 1:
            bad(f"version {v!r}")
        if v > CHAIN_VERSION:
            raise UnsupportedVersionError(
                f"{name}: chain format version {v}, this build reads up to {CHAIN_VERSION}: "
                "upgrade lcckpt")
        self.meta = info
        self.step, self.kind = info.get("step"), info.get("kind")
        self.state_id, self.depth = info.get("state_id"), info.get("depth")
        if self.step != step or type(self.step) is not int:
            bad(f"it says step {self.step!r}, its name says {step}")
        if self.kind not in ("keyframe", "delta"):
            bad(f"kind {self.kind!r}")
        if type(self.state_id) is not str or not self.state_id:
            bad("no state_id")
        if type(self.depth) is not int or self.depth < 0:
            bad(f"depth {self.depth!r}")
        base = info.get("base")
        if self.kind == "keyframe":
            if base is not None or self.depth != 0:
                bad("a keyframe with a base")
            self.base_step = self.base_state_id = None
        else:
            if type(base) is not dict or type(base.get("step")) is not int \
                    or type(base.get("state_id")) is not str:
                bad("a delta without a valid base")
            if not 0 <= base["step"] < step or self.depth < 1:
                bad(f"base step {base['step']} / depth {self.depth} out of order")
            self.base_step, self.base_state_id = base["step"], base["state_id"]


# --------------------------------------------------------------------------- checkpointer


class DeltaCheckpointer:
    """Keyframes and LC-Checkpoint deltas of one training run, one file per step.

    ``bits``/``coder``/``error_bound``: the delta quantizer (see :class:`DeltaEncoder`);
    ``bits`` may also be a ``key_path -> bits`` policy, e.g. more bits for Adam's first
    moment, which 2 bits track poorly (see docs/chain.md).
    ``keyframe_every``: every that many saves after a keyframe is a keyframe again (so a
    chain is one keyframe and at most ``keyframe_every - 1`` deltas); None: only the first
    save. ``keep_last``: after each save, delete files that none of the newest
    ``keep_last`` steps needs. ``min_delta_elements``: smaller floating tensors are stored
    exactly. ``track``: optional ``(key_path, tensor) -> bool`` policy replacing the size
    rule for floating tensors. ``keyframe_coding``: "lossless" (default, ~1.2x smaller
    keyframes) or "raw" (keyframes restore about as fast as ``torch.load``).

    One writer per directory is assumed; the object is not thread-safe.
    """

    def __init__(self, directory: str | os.PathLike, bits: int | Callable[[str], int] = 2,
                 keyframe_every: int | None = 20,
                 *, coder: str = "auto", error_bound: float | None = None,
                 keep_last: int | None = None, min_delta_elements: int = 4096,
                 track: Callable[[str, torch.Tensor], bool] | None = None,
                 keyframe_coding: str = "lossless"):
        if keyframe_every is not None and (type(keyframe_every) is not int or keyframe_every < 1):
            raise InvalidArgumentError(f"keyframe_every must be a positive int or None, got {keyframe_every!r}")
        if keep_last is not None and (type(keep_last) is not int or keep_last < 1):
            raise InvalidArgumentError(f"keep_last must be a positive int or None, got {keep_last!r}")
        if type(min_delta_elements) is not int or min_delta_elements < 1:
            raise InvalidArgumentError(f"min_delta_elements must be a positive int, got {min_delta_elements!r}")
        DeltaEncoder(2 if callable(bits) else bits, coder,      # validates the settings
                     error_bound=error_bound, keyframe_coding=keyframe_coding)
        self.keyframe_coding = keyframe_coding
        self.directory = os.fspath(directory)     # created by the first save
        self.bits, self.coder, self.error_bound = bits, coder, error_bound
        self.keyframe_every, self.keep_last = keyframe_every, keep_last
        self.min_delta_elements = min_delta_elements
        self._track = track or (lambda path, t: t.numel() >= self.min_delta_elements)
        self._encoders: dict[str, DeltaEncoder] | None = None   # None: not in sync with disk
        self._last: dict | None = None      # step, state_id, depth of the newest file
        self._force_keyframe = False
        self._headers: dict[str, tuple] = {}    # file name -> (stat key, _Link)
        self.last_save: dict | None = None  # what the newest save wrote (step, kind, path, nbytes)

    # ------------------------------------------------------------------ listing

    def path(self, step: int) -> str:
        """Where ``step`` is (or would be) stored."""
        return os.path.join(self.directory, file_name(step))

    def steps(self) -> list[int]:
        """Sorted list of the stored steps."""
        out = []
        try:
            names = os.listdir(self.directory)
        except FileNotFoundError:
            return []
        for name in names:
            m = _NAME_RE.fullmatch(name)
            if m and name == file_name(int(m.group(1))):
                out.append(int(m.group(1)))
        return sorted(out)

    def info(self, step: int) -> dict:
        """The chain metadata of ``step``'s file (kind, base, settings, per-tensor stats)."""
        return dict(self._link(step).meta)

    # ------------------------------------------------------------------ saving

    def save(self, step: int, obj: Any) -> str:
        """Store ``obj`` as ``step`` (a keyframe or a delta); returns the file's path."""
        step = self._check_step(step)
        if self._encoders is None:
            os.makedirs(self.directory, exist_ok=True)
            self._resume()
        if self._last is not None and step <= self._last["step"]:
            raise InvalidArgumentError(
                f"step {step} is not after the newest stored step {self._last['step']}; steps "
                "must increase (delete the later files first to rewrite history)")
        keyframe = (self._last is None or self._force_keyframe
                    or (self.keyframe_every is not None
                        and self._last["depth"] + 1 >= self.keyframe_every))
        session = _Session(self._encoders, self._new_encoder, self._track, keyframe)
        path = self.path(step)
        try:
            token = _ENCODING.set(session)
            try:
                meta, sections = pack(obj, codec=session.choose)
            finally:
                _ENCODING.reset(token)
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
            nbytes = _container.write_container(path, sections, meta)
        except BaseException:
            self._encoders = None      # references may have advanced: resync from disk
            raise
        self._last = {"step": step, "state_id": state_id, "depth": depth}
        self._force_keyframe = False
        self.last_save = {"step": step, "kind": meta["lcckpt_chain"]["kind"], "path": path,
                          "nbytes": nbytes}
        self._apply_retention()
        return path

    def _settings(self) -> dict:
        return {"bits": "per tensor" if callable(self.bits) else self.bits, "coder": self.coder,
                "error_bound": self.error_bound,
                "keyframe_every": self.keyframe_every,
                "min_delta_elements": self.min_delta_elements}

    def _new_encoder(self, key: str) -> DeltaEncoder:
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
            _, links, tracks = self._restore(latest, build=False)
        except (LcckptError, OSError) as e:
            warnings.warn(f"cannot continue the delta chain from step {latest} ({e}); the next "
                          "save is written as a keyframe", RuntimeWarning, stacklevel=3)
            self._last = {"step": latest, "state_id": "", "depth": 0}
            self._force_keyframe = True
            return
        for key, t in tracks.items():
            enc = self._new_encoder(key)
            enc.ref, enc.dtype, enc.shape = t.ref, t.dt, t.shape
            self._encoders[key] = enc
        top = links[-1][1]
        self._last = {"step": latest, "state_id": top.state_id, "depth": top.depth}

    def _clean_temps(self) -> None:
        bases = {m.group(1) for m in map(_TEMP_RE.fullmatch, os.listdir(self.directory)) if m}
        for base in bases:
            _container._remove_stale_temps(self.directory, base)

    # ------------------------------------------------------------------ loading

    def load(self, step: int | None = None, map_location=None) -> Any:
        """The object stored as ``step`` (default: the newest), rebuilt through its chain."""
        if step is None:
            steps = self.steps()
            if not steps:
                raise FileNotFoundError(f"no checkpoints in {self.directory}")
            step = steps[-1]
        step = self._check_step(step)
        return self._restore(step, build=True, map_location=map_location, keep_tracks=False)[0]

    def replay(self, start: int | None = None, stop: int | None = None, map_location=None):
        """Yield ``(step, obj)`` for every stored step in ``[start, stop]``, oldest first.

        Each file is decoded once: a step continues from the previous one's references
        (what :meth:`load` of each step would give, without walking every chain again).
        """
        known = None
        for step in self.steps():
            if (start is not None and step < start) or (stop is not None and step > stop):
                continue
            obj, links, tracks = self._restore(step, build=True, map_location=map_location,
                                               known=known)
            known = (step, links[-1][1].state_id, tracks)
            yield step, obj

    def _restore(self, step: int, *, build: bool, map_location=None, known=None,
                 keep_tracks: bool = True):
        """Walk back to the keyframe (or to ``known``), then apply each file in order.

        ``known``: ``(step, state_id, tracks)`` of an already restored step to start from.
        ``keep_tracks=False``: the caller discards the returned tracks, so the restored
        tensors may take over the references instead of copying them.
        Returns ``(obj or None, [(container, link)], tracks of step)``.
        """
        if not os.path.exists(self.path(step)):
            raise FileNotFoundError(
                f"no checkpoint for step {step} in {self.directory}; stored: {_brief(self.steps())}")
        with ExitStack() as stack:
            links = []                       # newest first: (container, link, path)
            s, expect, tracks = step, None, {}
            while True:
                if known is not None and s == known[0] and expect == known[1]:
                    tracks = known[2]
                    break
                path = self.path(s)
                try:
                    c = stack.enter_context(_container.read_container(path))
                    link = _Link(c.meta.get("lcckpt_chain"), s, path)
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
            obj = None
            for i, (c, link, path) in enumerate(links):
                try:
                    if build and i == len(links) - 1:
                        new: dict[str, _Track] = {}
                        token = _DECODING.set((tracks, new, keep_tracks))
                        try:
                            obj = unpack(c, map_location)
                        finally:
                            _DECODING.reset(token)
                        tracks = new
                    else:
                        tracks = _apply_file(c, tracks)
                except (LcckptError, OSError) as e:
                    raise self._fault(step, link.step, path, e) from e
            return obj, [(c, link) for c, link, _ in links], tracks

    @staticmethod
    def _fault(step: int, at: int, path: str, e: Exception) -> LcckptError:
        if at == step and not isinstance(e, BrokenChainError):
            cls = type(e) if isinstance(e, LcckptError) else CorruptDataError
            try:
                return cls(f"step {step}: {path}: {e}")
            except TypeError:
                return CorruptDataError(f"step {step}: {path}: {e}")
        return BrokenChainError(
            f"cannot restore step {step}: its chain link {path} (step {at}) is unusable: {e}. "
            "Load an earlier step, or restore that file from a copy")

    def _link(self, step: int) -> _Link:
        """The validated chain header of ``step`` (cached by file identity)."""
        path = self.path(step)
        st = os.stat(path)
        key = (st.st_ino, st.st_mtime_ns, st.st_size)
        hit = self._headers.get(path)
        if hit is not None and hit[0] == key:
            return hit[1]
        with _container.read_container(path) as c:
            link = _Link(c.meta.get("lcckpt_chain"), step, path)
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
                raise FileNotFoundError(f"no checkpoints in {self.directory}")
            upto = steps[-1]
        upto = self._check_step(upto)
        path = self.path(upto)
        _, links, tracks = self._restore(upto, build=False)
        top = links[-1][1]
        if top.kind != "keyframe":
            with _container.read_container(path) as c:
                link = _Link(c.meta.get("lcckpt_chain"), upto, path)
                if link.state_id != top.state_id:
                    raise BrokenChainError(f"{path} changed while being merged")
                sections = []
                stats = {}
                for i, s in enumerate(c.sections):
                    meta = s["meta"]
                    if meta.get("codec") == DELTA_CODEC:
                        key = _section_key(meta)
                        blob = tracks[key].exact_blob()
                        stats[key] = {"kind": "lossless", "bits": None,
                                      "bits_per_element": _finite(8 * len(blob) / max(1, tracks[key].ref.size)),
                                      "rel_error": 0.0, "nbytes": len(blob)}
                        sections.append((s["name"], meta, blob))
                    else:
                        sections.append((s["name"], meta, c.data(i)))
                meta = dict(c.meta)
            info = dict(meta["lcckpt_chain"])
            info.update(kind="keyframe", base=None, depth=0, tensors=stats,
                        merged={"from_base": info["base"], "from_depth": info["depth"]})
            meta["lcckpt_chain"] = info
            _container.write_container(path, sections, meta)
            if self._last is not None and self._last["step"] == upto:
                self._last["depth"] = 0     # the cadence counts from this new keyframe
        self._apply_retention()
        return path

    def _apply_retention(self) -> None:
        if self.keep_last is None:
            return
        steps = self.steps()
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
        removed = False
        for s in steps:
            if s not in needed:
                try:
                    os.unlink(self.path(s))
                    removed = True
                except FileNotFoundError:
                    pass
                self._headers.pop(self.path(s), None)
        if removed:
            _container._fsync_dir(self.directory)


def _apply_file(c, tracks: dict) -> dict:
    """Advance every tracked reference by one file; returns the tracks of that step."""
    new = {}
    for i, s in enumerate(c.sections):
        meta = s["meta"]
        if meta.get("kind") != "tensor" or meta.get("codec") != DELTA_CODEC:
            continue
        key = _section_key(meta)
        track = tracks.get(key) or _Track()
        track.apply(c.data(i), meta, key)
        new[key] = track
    return new


def _brief(steps: list[int]) -> str:
    if not steps:
        return "none"
    if len(steps) <= 6:
        return ", ".join(map(str, steps))
    return f"{steps[0]}, {steps[1]}, ..., {steps[-2]}, {steps[-1]} ({len(steps)} steps)"
