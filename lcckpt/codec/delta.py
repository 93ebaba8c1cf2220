"""Delta tracking with error feedback for a stream of states of one tensor (ALGORITHM §1).

The encoder keeps the reference ``ref`` = what the decoder will have reconstructed,
and codes ``u_t - ref`` each step, so whatever one step drops is carried into the next
delta and error does not accumulate along a chain. The encoder advances its reference
while it codes the symbols, with the same fp32 add ``ref[i] + centroid[s]`` the decoder
makes while it decodes them (skipping symbol 0 on both sides); tests hold the two
references bit-identical over 1,000-step chains. fp16/bf16 states are tracked in fp32,
fp64 in fp64.

:class:`Reconstruction` is the one decoder-side tracker: :class:`DeltaDecoder` and the
checkpoint chain both use it. It applies deltas lazily, all pending ones in one pass
(:func:`replay`). Files, keys and chains are chain.py's business, not this module's.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np

from . import blob as _blob, dtypes
from ..util import memory as _memory, pool as _pool
from ..util.pool import gather, run_tasks, submit
from .blob import LOSSLESS, Parsed, parse
from .tensor import (
    EncodeStats, decode_exact, encode_exact, guarded_encode, warmup as _tensor_warmup,
)
from .config import CodecConfig
from .entropy import CodeCache
from .replay import replay, settle
from .streamed import DeferredBlob, StreamedBlob
from ..errors import (
    BrokenChainError, CorruptDataError, InvalidArgumentError, LcckptError, NonFiniteError,
    UnsupportedDtypeError,
)
from .movement import BUCKETS, LOG2, Movement, copy_sketched
from .masked import masked_delta
from .parked import PARK_MIN, Parked, fingerprint
from .survey import survey
from ..util.caller import warn_user

__all__ = ["DeltaDecoder", "DeltaEncoder", "Reconstruction", "replay", "settle"]

KEYFRAME_CODINGS = ("lossless", "raw")
RELATIVE_TO = ("norm", "movement")
# below this share of ||u|| a restored error is under the rounding of the arithmetic the
# reference is kept in (fp32 for fp16/bf16/fp32 tensors, fp64 for fp64; a quarter of its
# last mantissa bit's weight in L2): no movement target goes finer. Not the tensor's own
# dtype's: a bf16 state moves by whole bf16 ulps, which a floor of a quarter of a bf16 ulp
# in L2 let the quantizer drop (docs/chain.md, "The working precision is a floor")
PRECISION = {"F16": 2.0 ** -26, "BF16": 2.0 ** -26, "F32": 2.0 ** -26, "F64": 2.0 ** -55}
MAX_TARGET = 0.99       # a movement target is capped below the quantizer's limit of 1


NONFINITE_STATE = "the tensor holds NaN/Inf values (a diverged step?)"
NONFINITE_REFERENCE = "the step before, as restored, held NaN/Inf values"
NONFINITE = (NONFINITE_STATE, NONFINITE_REFERENCE)     # the fallbacks a caller reports
NONFINITE_DONE = "stored exactly instead, and its next delta is taken against these values"


def _tracked(dt: dtypes.DType) -> bool:
    return dt.kind == "float" and not dt.name.startswith("F8")


class DeltaEncoder:
    """Encode successive states of one floating tensor: a keyframe first, then deltas."""

    def __init__(self, bits: int = 2, coder: str = "auto", *, error_bound: float | None = None,
                 midpoint: bool = False, chunk_size: int | None = None,
                 keyframe_coding: str = "lossless", config: CodecConfig | None = None,
                 target: float | None = None, relative_to: str = "norm",
                 update_share: float = 0.0, low_precision_target: float | None = None):
        """``config`` replaces the coding keywords. ``target``: the uniform quantizer,
        bounding each restored state (see :class:`~lcckpt.codec.config.CodecConfig`).
        ``relative_to``: "norm" bounds ``||u - ũ||₂`` by ``target·||u||₂``; "movement"
        by ``target·||u - k||₂``, ``k`` the last keyframe (zeros for a tensor coded
        from zero), never finer than the working precision, :data:`PRECISION` (see
        :mod:`lcckpt.codec.movement`); with "movement", ``update_share`` lets the error
        reach that share of ``||u - ref||₂`` too, the update this delta sends, whatever the
        movement (:class:`~lcckpt.chain.policy.RolePolicy`'s ``update``);
        ``low_precision_target``: the movement share for fp16/bf16 states, where it is
        less than ``target`` (:data:`lcckpt.chain.policy.LOW_PRECISION_FIRST_MOMENT`).
        ``keyframe_coding``: "lossless" (coded byte planes,
        ~1.2x smaller) or "raw" (the planes uncoded) for the exact blobs: the first one
        and every keyframe."""
        if keyframe_coding not in KEYFRAME_CODINGS:
            raise InvalidArgumentError(
                f"keyframe_coding must be 'lossless' or 'raw', got {keyframe_coding!r}")
        if relative_to not in RELATIVE_TO:
            raise InvalidArgumentError(
                f"relative_to must be 'norm' or 'movement', got {relative_to!r}")
        self.config = config if config is not None else CodecConfig(
            bits, coder, error_bound, midpoint, chunk_size, target=target)
        if not isinstance(self.config, CodecConfig) or self.config.lossless:
            raise InvalidArgumentError("config must be a lossy CodecConfig")
        if relative_to == "movement" and self.config.target is None:
            raise InvalidArgumentError("relative_to='movement' needs a target")
        if isinstance(update_share, bool) or not isinstance(update_share, (int, float)) \
                or not 0 <= update_share < 1:
            raise InvalidArgumentError(f"update_share must be in [0, 1), got {update_share!r}")
        self.relative_to = relative_to
        self.update_share = float(update_share) if relative_to == "movement" else 0.0
        self.low_precision_target = low_precision_target
        self.movement: Movement | None = None   # the keyframe, for "movement" targets
        self.last_movement: tuple | None = None  # (movement, ||u||, error allowed but
        #                                         for the precision floor) of the last delta
        self.raw_keyframes = keyframe_coding == "raw"
        self.cache = CodeCache()
        self._ref: np.ndarray | None = None    # flat working-precision reconstruction
        self._copy = None                      # a deferred copy into it: (ref, u, futures)
        self._parked: Parked | None = None     # the reference out of memory (:meth:`park`)
        self._lost = False                     # a parked one that could not be fetched back
        self._zero_blob = None                 # (movement, blob, stats) of the last delta
        #                                        coded against a parked reference's bits
        self._zero_from = None                 # the fingerprint of the state the last delta
        #                                        was coded from, if it left the reference as it was
        self.dtype: dtypes.DType | None = None
        self.shape: tuple | None = None

    @property
    def ref(self) -> np.ndarray | None:
        """The reference (a deferred copy into it is finished first, a parked one fetched
        back)."""
        if self._copy is not None:
            self.settle()
        if self._parked is not None:
            self._unpark()
        return self._ref

    @ref.setter
    def ref(self, value: np.ndarray | None) -> None:
        if self._copy is not None:
            self.settle()
        self._ref, self._parked, self._lost = value, None, False

    @property
    def has_ref(self) -> bool:
        """Whether there is a reference, in memory or parked (nothing is fetched), or
        one that was lost (then the next encode is exact, not a delta from zeros)."""
        return self._ref is not None or self._parked is not None or self._copy is not None \
            or self._lost

    @property
    def parked(self) -> bool:
        """Whether the reference is out of memory (:meth:`park`)."""
        return self._parked is not None

    def park(self, fetch, name: str) -> bool:
        """Drop the reference from memory if the last delta left it as it was (the
        tensor did not change), keeping its fingerprint (:mod:`lcckpt.codec.parked`).
        ``fetch()`` must give it back, flat in the working dtype, for as long as it stays
        parked: the chain's newest reconstruction of tensor ``name``, while no delta has
        changed it. Returns whether it was parked now."""
        if self._zero_from is None or self._copy is not None or self._ref is None:
            return False
        self._parked, self._ref = Parked(self._ref, self._zero_from, fetch, name), None
        return True

    def _unpark(self) -> None:
        parked, self._parked = self._parked, None
        try:
            ref = parked.get()
            why = None if ref is not None else "the files hold other values"
        except (LcckptError, OSError) as e:
            ref, why = None, str(e)
        if ref is None:
            warn_user(f"cannot read the reference of {parked.name} back from the chain "
                      f"({why}): it is stored exactly in this save")
        self._ref, self._lost = ref, ref is None

    def reset(self):
        """Forget the reference: the next :meth:`encode` writes a keyframe."""
        self.ref = None

    def resume(self, rec: Reconstruction) -> None:
        """Continue from what a decoder reconstructed (a chain reopened from disk).

        The encoder takes over ``rec``'s reference array; ``rec`` must not be used after.
        """
        if rec.ref is None:
            raise InvalidArgumentError("cannot resume from an empty reconstruction")
        self.ref, self.dtype, self.shape = rec.ref, rec.dt, rec.shape
        self.movement = rec.movement

    def encode(self, x, *, keyframe: bool = False, report: bool = False):
        """Blob for state ``x``: exact when ``keyframe`` or no compatible reference exists.

        With ``report=True`` returns ``(blob, EncodeStats)``.
        """
        parts, st = self.encode_parts(x, keyframe=keyframe)
        blob = b"".join(parts)
        return (blob, st) if report else blob

    def encode_parts(self, x, *, keyframe: bool = False, from_zero: bool = False,
                     defer_copy: bool = False, lazy: bool = False,
                     direction=None, warn: bool = True) -> tuple[list, EncodeStats]:
        """:meth:`encode` as ``(pieces, stats)``: a container writes the pieces one after
        another, so an exact blob of a large tensor is never joined into one copy.

        ``from_zero``: when there is no reference yet, code ``x`` as a delta against zeros
        instead of storing it exactly (a tensor that first appears between keyframes; the
        decoder must then start it from zeros too: ``Reconstruction.apply(zero_base=True)``).
        ``defer_copy``: an exact blob's copy of ``x`` into the reference waits for
        :meth:`start_copy` (a save starts it before writing the file, so the copy runs
        while the file is written and synced); ``x`` must not change until
        :meth:`settle` returns, which the caller must call before giving ``x`` back.
        ``lazy``: a uniform delta comes as a :class:`~lcckpt.codec.blob.LazyBlob`, coded
        while it is read; the reference has advanced, and ``x`` may change, only once it
        has been read to the end (a file written as it is encoded reads it at once).
        ``direction``: a tensor of ``x``'s shape (a weight's first moment) that a uniform
        delta's restored error is made orthogonal to (:meth:`ErrorModel.recon_step`);
        ignored where it does not fit. ``warn=False``: a delta that falls back to an exact
        blob because the state or the reference holds NaN/Inf does not warn (the caller
        reports it from the stats' ``fallback``, where it can name the tensor).
        """
        a, dt = dtypes.to_numpy(x)
        if not _tracked(dt):
            raise UnsupportedDtypeError(f"delta tracking needs fp16/bf16/fp32/fp64, got {dt.name}")
        fits = dt == self.dtype and a.shape == self.shape
        # a parked reference with x's very bits (those of the state last coded, in x's own
        # dtype): code against x itself, nothing fetched; the blob of last time if any
        same = self._parked is not None and fits and not keyframe and self._parked.matches(a)
        if self._parked is not None and (keyframe or not fits):
            self._parked = None             # the keyframe below copies x
        if same and direction is None and self._zero_blob is not None \
                and self._zero_blob[0] is self.movement:
            return [self._zero_blob[1]], dataclasses.replace(self._zero_blob[2])
        self._zero_blob = None
        u = dtypes.to_float_work(a, dt).reshape(-1)
        ref = u if same else self.ref
        if from_zero and not keyframe and ref is None:
            self.ref = ref = _memory.bulk_zeros(u.shape, u.dtype)
            self.dtype, self.shape = dt, a.shape
            self.movement = Movement(None, u.size)
        if keyframe or ref is None or dt != self.dtype or a.shape != self.shape:
            return self._keyframe(a, dt, u, None, defer_copy, new_base=keyframe)
        exact = lambda: encode_exact(a, dt, self.config.log2, self.raw_keyframes)  # noqa: E731
        sv = None
        if self.config.target is not None:      # one read of u and ref for all that follows
            big = self.relative_to == "movement" and self.movement is not None \
                and self.movement.sketched and self.movement.n == u.size
            sv = survey(u, ref, LOG2 if big else 0, dtypes.work_flat(direction, a.shape))
        cfg = self._config_for(u, dt, sv)
        try:        # against u itself nothing advances: the delta is zero
            parts, st, lossy = guarded_encode(u, ref, dt, a.shape, cfg, exact,
                                              cache=self.cache, advance=not same, surveyed=sv,
                                              lazy=lazy)
        except NonFiniteError:
            if (got := masked_delta(self, a, dt, u, ref, exact)) is not None:
                return got      # NaN/Inf where the reference has them (a -inf mask)
            why = NONFINITE_STATE if not np.isfinite(u).all() else NONFINITE_REFERENCE
            if warn:
                warn_user(f"{why}: {NONFINITE_DONE}")
            return self._keyframe(a, dt, u, why, defer_copy, new_base=False)
        if self.movement is not None:
            self.movement.at_base = False           # the reference has moved on
        self._zero_from = None
        if lossy and sv is not None and sv.model.total_sq() == 0.0 and u.size >= PARK_MIN:
            self._zero_from = self._parked.seen if same else fingerprint(a)
        if same and lossy and direction is None:    # the same bits again give this blob
            blob = b"".join(bytes(p) for p in parts)
            self._zero_blob, parts = (self.movement, blob, dataclasses.replace(st)), [blob]
        if not lossy:
            self._set_ref(u, defer_copy)
        return parts, st

    def _config_for(self, u: np.ndarray, dt: dtypes.DType, sv=None) -> CodecConfig:
        """The config of this delta: a "movement" target becomes the equivalent share of
        ``||u||`` (noted in :attr:`last_movement`). ``sv``: the delta's survey, whose
        sketch and norm the movement reuses."""
        self.last_movement = None
        if self.relative_to != "movement":
            return self.config
        if self.movement is None or self.movement.n != u.size:
            self.movement = Movement(None, u.size)       # no keyframe known: from zero
        update_sq = None if sv is None else sv.model.total_sq()     # ||u - ref||²
        moved, norm = self.movement.measure(
            u, None if sv is None or (sv.sketch is None and self.movement.sketched)
            else (sv.sketch, sv.norm_sq), update_sq)
        if not math.isfinite(norm):     # u holds NaN/Inf: the encode stores it exactly
            return self.config
        t = self.config.target
        if self.low_precision_target is not None and dt.name in ("F16", "BF16"):
            t = min(t, self.low_precision_target)
        kept = t * moved                                 # what the update must keep
        if self.update_share and update_sq is not None:  # or a share of what it sends
            kept = max(kept, self.update_share * float(np.sqrt(update_sq)))
        allowed = max(kept, PRECISION[dt.name] * norm)
        self.last_movement = (moved, norm, kept)
        share = min(allowed / norm, MAX_TARGET) if norm > 0 else 0.0
        return dataclasses.replace(self.config, target=share)

    def _keyframe(self, a, dt, u, why, defer_copy=False, new_base=True):
        """An exact blob; ``new_base``: movement counts from it (a keyframe, not an exact
        fallback inside a chain, unless the tensor has no base of its size)."""
        parts = encode_exact(a, dt, self.config.log2, self.raw_keyframes)
        pending = None
        if self.relative_to == "movement" and (new_base or self.movement is None
                                               or self.movement.n != u.size):
            # a large base's sketch is added by the reference copy, in the same read
            pending = Movement.pending(u.size) if u.size > BUCKETS else None
            self.movement = pending or Movement(u)
        elif self.movement is not None:
            self.movement.at_base = False           # an exact fallback inside the chain
        self._set_ref(u, defer_copy, pending)
        self.dtype, self.shape, self._zero_from = dt, a.shape, None
        return parts, EncodeStats(u.size, dt.name, "lossless", nbytes=_blob.nbytes(parts),
                                  fallback=why)

    def _set_ref(self, u: np.ndarray, defer: bool = False, base: Movement | None = None) -> None:
        """The reference becomes a copy of ``u``: into the old reference's memory when it
        fits (a keyframe of a tracked tensor: no fresh pages to fault in), in chunks on
        the thread pool, since the copy of a large state is a visible part of a keyframe.
        ``defer``: only noted here; :meth:`start_copy` or :meth:`settle` makes it.
        ``base``: a :meth:`Movement.pending` whose sketch of ``u`` the copy adds."""
        ref = None if self._parked is not None else self.ref    # not fetched to be overwritten
        if ref is None or ref.shape != u.shape or ref.dtype != u.dtype or ref is u:
            ref = _memory.bulk_empty(u.shape, u.dtype)
        self._ref, self._parked, self._lost, self._copy = None, None, False, (ref, u, None, base)
        if not defer:
            self.settle()

    def start_copy(self) -> None:
        """Start a deferred reference copy on the thread pool (nothing if none waits)."""
        if self._copy is None or self._copy[2] is not None:
            return
        ref, u, _, base = self._copy
        if base is not None:
            tasks = [submit(copy_sketched, ref, u, base.parts, c)
                     for c in range(base.parts.shape[0])]
        else:
            per = _pool.COPY_CHUNK
            tasks = [submit(np.copyto, ref[c * per:(c + 1) * per], u[c * per:(c + 1) * per])
                     for c in range(-(-u.size // per))]
        self._copy = (ref, u, tasks, base)

    def settle(self) -> None:
        """Finish a deferred reference copy: wait for it, or make it now if not started."""
        if self._copy is None:
            return
        ref, u, futures, base = self._copy
        if futures is not None:
            gather(futures)
        elif base is not None:
            run_tasks(lambda c: copy_sketched(ref, u, base.parts, c), base.parts.shape[0])
        else:
            _pool.copy(ref, u)
        if base is not None:
            base.finish()
        self._copy, self._ref = None, ref

    def reference(self):
        """The decoder's reconstruction of the last state, in the state's dtype."""
        if self.ref is None:
            return None
        return dtypes.from_float_work(self.ref.reshape(self.shape).copy(), self.dtype)


class Reconstruction:
    """What a decoder holds of one tracked tensor: flat working floats, dtype, shape.

    Deltas are validated as they arrive but applied lazily, all pending ones together
    (:func:`replay`, chunk by chunk across the deltas), the first time the reference is
    needed: replaying a chain then streams the tensor through memory once instead of
    once per delta. A keyframe stored in the working precision waits too, and is decoded
    chunk by chunk in that same pass.
    """

    __slots__ = ("_ref", "_key", "pending", "dt", "shape", "movement")

    def __init__(self):
        self._ref: np.ndarray | None = None
        self._key = None                  # (buf, parsed) of a keyframe not yet decoded
        self.pending: list = []
        self.dt: dtypes.DType | None = None
        self.shape: tuple | None = None
        self.movement: Movement | None = None   # the keyframe's, if asked (a writer resuming)

    @property
    def ref(self) -> np.ndarray | None:
        """The flat reference with every pending blob applied (None before a keyframe)."""
        if self._key is not None:
            p = self._key[1]
            ref = _memory.bulk_empty(p.n, p.dt.numpy)
            replay(self.pending, ref, base=self._key)
            self._ref, self._key, self.pending = ref, None, []
        elif self.pending:
            replay(self.pending, self._ref)
            self.pending = []
        return self._ref

    def apply(self, blob, *, dtype: str | None = None, shape: tuple | None = None,
              check_payload: bool = True, what: str = "blob", zero_base: bool = False,
              movement: bool = False) -> None:
        """Advance by one blob exactly as the encoder advanced its reference.

        ``dtype``/``shape``: what the stored tensor is (a chain section's metadata); a
        keyframe may then hold it widened to the working precision (a merged keyframe).
        ``check_payload=False`` when a container checksum has just covered the bytes.
        ``zero_base``: the blob is a delta against zeros, not against what came before
        (``DeltaEncoder.encode_parts(from_zero=True)``). ``movement``: also keep what a
        writer's "movement" target measures from (:attr:`movement`): a keyframe is then
        decoded at once instead of in the pass of its deltas.
        """
        if isinstance(blob, (StreamedBlob, DeferredBlob)):   # read as it is decoded
            buf, p = blob, blob.parsed
        else:
            buf, p = parse(blob, check_payload=check_payload)
        name = p.dt.name if dtype is None else dtype
        if shape is not None and p.shape != tuple(shape):
            raise CorruptDataError(f"{what}: blob shape {list(p.shape)} != section shape {list(shape)}")
        if p.kind == LOSSLESS:
            self._keyframe(buf, p, name, what)
            if movement:
                self.movement = Movement(self.ref)
            return
        if p.dt.name != name:
            raise CorruptDataError(f"{what}: blob dtype {p.dt.name} for a {name} tensor")
        if zero_base:
            if not _tracked(p.dt):
                raise CorruptDataError(f"{what}: a {p.dt.name} delta against zeros")
            self._ref = _memory.bulk_zeros(p.n, np.float64 if p.dt.name == "F64" else np.float32)
            self._key, self.pending = None, []
            self.dt, self.shape = p.dt, p.shape
            self.movement = Movement(None, p.n)
        if self._ref is None and self._key is None:
            raise BrokenChainError(f"{what}: a delta without a reference (its keyframe is "
                                   "missing); decode the chain from its keyframe")
        if p.dt != self.dt or p.shape != self.shape:
            raise BrokenChainError(
                f"{what}: delta for {p.dt.name}{list(p.shape)} does not fit the reference "
                f"{self.dt.name}{list(self.shape)}")
        if self.movement is not None:
            self.movement.at_base = False
        self.pending.append((buf, p))

    def _keyframe(self, buf, p: Parsed, name: str, what: str) -> None:
        work = dtypes.work_name(name)
        if p.dt.name != name and p.dt.name != work:
            raise CorruptDataError(f"{what}: blob dtype {p.dt.name} for a {name} tensor")
        if not _tracked(p.dt) or name not in dtypes.BY_NAME or not _tracked(dtypes.BY_NAME[name]):
            raise UnsupportedDtypeError(f"{what}: {p.dt.name} is not a delta-tracked dtype")
        if p.dt.name == work:                 # decoded lazily, in the pass of its deltas
            self._ref, self._key = None, (buf, p)
        else:                                 # fp16/bf16: widened to fp32 right away
            if isinstance(buf, DeferredBlob):
                buf, p = buf.load()
            ref = dtypes.to_float_work(decode_exact(buf, p), p.dt).reshape(-1)
            if not ref.flags.writeable or not ref.flags.c_contiguous:
                ref = ref.copy()
            self._ref, self._key = ref, None
        self.pending = []
        self.dt, self.shape = dtypes.BY_NAME[name], p.shape

    def replay_into(self, out: np.ndarray) -> bool:
        """Decode the waiting keyframe and the pending deltas straight into ``out`` (flat,
        writable, C-contiguous, the keyframe's working dtype and size), which becomes the
        reference: a restore into a model's own tensors then makes no copy and touches no
        fresh memory. False (nothing done) where no keyframe waits or ``out`` does not fit."""
        if self._key is None:
            return False
        p = self._key[1]
        if out.dtype != p.dt.numpy or out.ndim != 1 or out.size != p.n \
                or not out.flags.c_contiguous or not out.flags.writeable:
            return False
        replay(self.pending, out, base=self._key)
        self._ref, self._key, self.pending = out, None, []
        return True

    def value(self, copy: bool = True):
        """The restored tensor in its own dtype; ``copy=False`` hands over the reference
        itself (for a final step whose reconstruction is discarded)."""
        ref = self.ref
        if ref is None:
            return None
        ref = ref.reshape(self.shape)
        if copy and self.dt.native and ref.dtype == self.dt.numpy:   # else the cast copies
            out = _memory.bulk_empty(ref.size, ref.dtype)      # small pages: steady faults
            _pool.copy(out, ref.reshape(-1))
            ref = out.reshape(self.shape)
        return dtypes.from_float_work(ref, self.dt)

    def exact_blob(self, raw: bool = False) -> list:
        """The reference itself, losslessly, in the working precision (a merge keyframe);
        ``raw``: its planes stored uncoded."""
        a = self.ref.reshape(self.shape)
        return encode_exact(a, dtypes.BY_NUMPY[a.dtype], CodecConfig().log2, raw)


class DeltaDecoder:
    """Rebuild the states written by a :class:`DeltaEncoder`, blob by blob, in order."""

    def __init__(self):
        self.rec = Reconstruction()

    def decode(self, blob):
        """The state after ``blob`` (a copy the caller owns)."""
        self.rec.apply(blob)
        return self.rec.value()

    def reference(self):
        return self.rec.value()


def warmup():
    """Load (or compile, on the very first run) every kernel, so later calls are fast.

    Numba caches compiled kernels on disk; the first call in a process still pays for
    loading them. Call this at start-up to move that cost out of the first checkpoint.
    (The codec's kernels, :func:`lcckpt.codec.tensor.warmup`, then a delta encoder's
    keyframe: its reference copy with the movement sketch.)
    """
    _tensor_warmup()
    rng = np.random.default_rng(0)
    for dt in (np.float32, np.float64):
        DeltaEncoder(target=0.01, relative_to="movement").encode(
            rng.standard_normal(2 * BUCKETS).astype(dt), keyframe=True)
