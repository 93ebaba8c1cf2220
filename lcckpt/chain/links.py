"""One file of a chain as its reader sees it: its place in the chain and its replay.

:class:`Link` validates what a file's header says about its place in the chain (step,
kind, state id, base, depth). :class:`FileReplay` advances the reconstructions of the
step before it by the file's ``"delta"`` sections, as a leaf decoder of
:func:`~lcckpt.format.serialization.unpack` or for every section at once.
"""

from __future__ import annotations

import hashlib
import struct

import torch

from ..codec import dtypes
from ..codec.delta import Reconstruction, settle as _settle
from ..errors import CorruptDataError, UnsupportedVersionError
from ..format.sections import DELTA, section_key, section_zero_base
from ..format import sections as _sections
from ..format.into import Into
from .session import finite

__all__ = ["CHAIN_VERSION", "FileReplay", "Link", "delta_key", "elements", "is_keyframe"]

CHAIN_VERSION = 1


class Link:
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


class FileReplay:
    """Loading one file of a chain: ``"delta"`` sections advance the reconstructions of
    the previous step (``before``) into ``after``; other sections decode as anywhere."""

    def __init__(self, before: dict, copy: bool = True, movement: bool = False,
                 origin: tuple | None = None, into: Into | dict | None = None):
        """``origin``: ``(step, path)`` of the file, which errors of its keyframes decoded
        later, while another file is replayed, carry (``.origin``). ``into``: key path ->
        a host tensor that the tracked tensor of that path is decoded into where it fits
        (its dtype and shape, contiguous); with ``copy=False`` an fp32/fp64 one is
        replayed straight into it, which then serves as the reference. Any other stored
        tensor is copied into its target once built (``self.into.fill``, the ``fill`` of
        :func:`~lcckpt.format.serialization.unpack`)."""
        self.before, self.after, self.copy, self.movement = before, {}, copy, movement
        self.origin = origin
        self.into = into if isinstance(into, Into) else Into(into or {})
        self.settled = False

    def advance(self, c, i: int, meta: dict) -> Reconstruction:
        key = section_key(meta)
        rec = self.before.get(key) or Reconstruction()
        # movement counts from the keyframe, or from where the tensor (re)started: an
        # exact fallback inside a chain does not move the base, as for the writer
        base = self.movement and (rec.movement is None or is_keyframe(c)
                                  or rec.movement.n != elements(meta))
        rec.apply(_blob_of(c, i, meta, key, self.origin), dtype=meta.get("dtype"),
                  shape=tuple(meta.get("shape", ())),
                  check_payload=False, what=key, zero_base=section_zero_base(meta),
                  movement=base)
        self.after[key] = rec
        return rec

    def decode_leaf(self, path: str, c, i: int, meta: dict):
        if meta.get("codec") != DELTA:
            return _sections.decode_leaf(path, c, i, meta)
        key = section_key(meta)
        rec = self.after.get(key) if self.settled else None
        if rec is None:
            rec = self.advance(c, i, meta)
        target = self._target(key, rec)
        if target is None:
            return rec.value(self.copy)
        if target.data_ptr() != rec.ref.ctypes.data:     # not replayed into it
            with torch.no_grad():
                target.copy_(torch.as_tensor(rec.value(copy=False)).view(target.shape))
        return target

    def _target(self, key: str, rec: Reconstruction):
        return None if rec.dt is None else self.into.take(key, rec.dt.torch, rec.shape)

    def advance_all(self, c, settle: bool = False) -> dict:
        """Advance every tracked tensor of file ``c`` without building its object;
        ``settle``: also replay what they wait for, many at once (then
        :meth:`decode_leaf` hands them out without applying their blobs again)."""
        for i, s in enumerate(c.sections):
            if s["meta"].get("kind") == "tensor" and s["meta"].get("codec") == DELTA:
                self.advance(c, i, s["meta"])
        if settle:
            targets = {}
            for key, rec in self.after.items() if not self.copy else ():
                t = self._target(key, rec)
                if t is not None:
                    targets[id(rec)] = t
            # False: not waiting, not fp32/64 (copied in when its leaf is built)
            _settle(self.after.values(), lambda rec: id(rec) in targets
                    and _sections.replay_into_tensor(rec, targets[id(rec)]))
            self.settled = True
        return self.after


def _blob_of(c, i: int, meta: dict, key: str, origin):
    """Section ``i``'s blob: a large keyframe in the tracking precision to be read as it is
    decoded, any other of 1 MB or more to be read whole when it is decoded
    (:func:`~lcckpt.format.sections.chain_section`), else read and checked whole now."""
    work = dtypes.work_name(meta.get("dtype"))
    return _sections.chain_section(c, i, work, key, origin) or c.data(i)


def stamp_state_id(chain: dict, entries: list[dict]) -> str:
    """Set and return the id of the state a chain file reconstructs (16 hex digits): a
    digest of its step, its base's id and its sections' names, lengths and checksums, so
    that equal saves write equal files. (A random id compressed a byte or two differently
    in every process's headers, and moved a file's size by its 16-byte alignment now and
    then.)"""
    base = chain["base"]
    h = hashlib.blake2b(f"{chain['step']}/{base['state_id'] if base else ''}".encode(),
                        digest_size=8)
    for e in entries:
        name = e["name"].encode()
        h.update(struct.pack("<IQI", len(name), e["length"], e["crc32c"]) + name)
    chain["state_id"] = h.hexdigest()
    return chain["state_id"]


def is_keyframe(c) -> bool:
    info = c.meta.get("lcckpt_chain")
    return isinstance(info, dict) and info.get("kind") == "keyframe"


def with_sizes(info, sections: list):
    """A file's chain metadata with each tensor's ``nbytes`` and ``bits_per_element`` in
    its stats, from its section's length and shape, and its ``error_vs_movement`` (the
    error's share of the movement: ``rel_error / movement``), where the file leaves them
    out (see ``session.stored_stats``); anything else as it is."""
    tensors = info.get("tensors") if isinstance(info, dict) else None
    if not isinstance(tensors, dict):
        return info
    sizes = {}
    for s in sections:
        m = s["meta"]
        params = m.get("codec_params")
        if m.get("codec") == DELTA and type(params) is dict and type(params.get("key")) is str:
            sizes[params["key"]] = (s["length"], elements(m))
    out = {}
    for k, st in tensors.items():
        if isinstance(st, dict) and k in sizes and "nbytes" not in st:
            nbytes, n = sizes[k]
            st = {**st, "nbytes": nbytes, "bits_per_element": finite(8 * nbytes / n if n else 0.0)}
        if isinstance(st, dict) and "error_vs_movement" not in st:
            err, moved = st.get("rel_error"), st.get("movement")
            if type(err) is float and type(moved) is float and moved > 0:
                st = {**st, "error_vs_movement": finite(err / moved)}
        out[k] = st
    return {**info, "tensors": out}


def elements(meta: dict) -> int:
    n = 1
    shape = meta.get("shape", ())
    for d in shape if isinstance(shape, (list, tuple)) else ():
        n *= int(d) if type(d) is int else 0
    return n


def delta_key(meta: dict) -> str | None:
    """The tracking key of a tracked tensor section (None for any other section)."""
    if meta.get("kind") != "tensor" or meta.get("codec") != DELTA:
        return None
    try:
        return section_key(meta)
    except CorruptDataError:             # refused with its reason when it is decoded
        return None
