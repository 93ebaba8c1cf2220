"""lcckpt's stateless codecs as numcodecs codecs, for zarr and anything else that speaks them.

``LcckptLossy`` (id ``"lcckpt_lossy"``) is LC-Checkpoint's exponent-bucket quantizer with
its entropy coders, for floating arrays; ``LcckptLossless`` (id ``"lcckpt_lossless"``) is
the exact byte-plane coder, for any supported dtype. Each is a
:class:`lcckpt.codec.config.CodecConfig` plus ``lcckpt.encode(x, config=cfg)`` /
``lcckpt.decode(buf, out=out)``; the config is ``cfg.to_dict()`` without the settings that
do not apply, plus ``id``. The blob is self-describing (dtype, shape, settings), so any
``decode`` reads what any ``encode`` wrote.

Registered with numcodecs through the ``numcodecs.codecs`` entry point of the optional
``lcckpt[numcodecs]`` extra; ``numcodecs.get_codec({"id": "lcckpt_lossy", ...})`` finds
them. Without numcodecs installed the classes still work (same methods) on a small base.

Deliberately not here: delta coding against a previous state (it needs a reference, and a
numcodecs codec is stateless); use ``lcckpt.DeltaEncoder`` for that.
"""

from __future__ import annotations

import numpy as np

from . import limits
from .codec.tensor import decode as _raw_decode
from .codec.tensor import encode as _encode
from .codec.config import CodecConfig
from .codec.rounding import rounded
from .errors import InvalidArgumentError, NonFiniteError

def _decode(data, out=None, max_bytes=limits.DEFAULT):
    """``lcckpt.decode`` under the process's ``max_bytes`` (zarr feeds codecs bytes from
    anywhere; ``lcckpt.limits.set_max_bytes`` changes it)."""
    return _raw_decode(data, out=out, max_bytes=None if out is not None else max_bytes)


try:                                    # the optional extra
    from numcodecs.abc import Codec as _Base
except ImportError:                     # pragma: no cover - exercised without numcodecs
    class _Base:
        """The part of ``numcodecs.abc.Codec`` these codecs use."""
        codec_id = None

        def __eq__(self, other):
            try:
                return self.get_config() == other.get_config()
            except AttributeError:
                return False

        def __repr__(self):
            r = ", ".join(f"{k}={v!r}" for k, v in self.get_config().items() if k != "id")
            return f"{type(self).__name__}({r})"

__all__ = ["LcckptLossless", "LcckptLossy", "register"]


def _as_array(buf) -> np.ndarray:
    """The values numcodecs hands over, in their memory order: a C-ordered array keeps
    its shape; any other contiguous one (Fortran order) is flattened in memory order, as
    numcodecs' own codecs read buffers; a typed buffer as it is."""
    if isinstance(buf, np.ndarray):
        a = buf
    else:
        try:
            a = np.asarray(memoryview(buf))
        except TypeError:
            raise InvalidArgumentError(
                f"cannot encode a {type(buf).__name__}: pass a numpy array or a typed "
                "buffer") from None
    if a.dtype.hasobject:
        raise TypeError("cannot encode an object array: lcckpt codecs take numbers")
    if a.flags.c_contiguous:
        return a
    if a.flags.f_contiguous:
        return a.reshape(-1, order="A")
    return np.ascontiguousarray(a)


def _out_bytes(out) -> np.ndarray:
    """A writeable flat byte view of ``out``'s memory (any contiguous buffer)."""
    target = out if isinstance(out, np.ndarray) else np.asarray(memoryview(out))
    if target.dtype.hasobject:
        raise TypeError("cannot decode into an object array")
    if not target.flags.writeable:
        raise InvalidArgumentError("out is read-only")
    return target.reshape(-1, order="A").view(np.uint8)


def _room(nbytes: int) -> int:
    """What decoding for an ``out`` of ``nbytes`` may allocate: the values and a working
    copy up to three times their size (fp16 through fp32), never more than ``out`` could
    take."""
    return 3 * nbytes + 4096


class _LcckptCodec(_Base):
    _lossless = False

    def encode(self, buf) -> bytes:
        """One self-describing blob of ``buf`` (its dtype and shape included)."""
        a = _as_array(buf)
        return _encode(a, config=self._config_for(a))

    def _config_for(self, a: np.ndarray) -> CodecConfig:
        return self._config

    def decode(self, buf, out=None):
        """The array ``buf`` holds (its saved shape), or ``out`` filled with it: any
        writeable contiguous buffer of the same number of bytes (numcodecs' contract:
        zarr passes byte buffers, and Fortran-ordered arrays get their values in memory
        order). Without ``out`` the blob's declared size is held to the process's
        ``max_bytes`` first (see docs/interop.md)."""
        data = buf if isinstance(buf, (bytes, bytearray, memoryview)) else \
            memoryview(np.ascontiguousarray(_as_array(buf)).view(np.uint8).reshape(-1))
        if out is None:
            return _decode(data)
        if isinstance(out, np.ndarray) and not (out.flags.c_contiguous or out.flags.f_contiguous):
            dec = _decode(data, out=None, max_bytes=_room(out.nbytes))   # a strided view
            if dec.size != out.size or dec.dtype != out.dtype:
                raise InvalidArgumentError(
                    f"out holds {out.size} {out.dtype} values in strided memory; the blob "
                    f"decodes to {dec.size} {dec.dtype}")
            out[...] = dec.reshape(out.shape)
            return out
        raw = _out_bytes(out)
        if isinstance(out, np.ndarray) and out.flags.c_contiguous:
            try:                       # the blob's own dtype and size: straight into it
                _decode(data, out=out.reshape(-1))
                return out
            except InvalidArgumentError:
                pass
        dec = np.ascontiguousarray(_decode(data, out=None, max_bytes=_room(raw.nbytes)))
        got = dec.reshape(-1).view(np.uint8)
        if got.size != raw.size:
            raise InvalidArgumentError(
                f"out holds {raw.size} bytes; the blob decodes to {got.size} "
                f"({dec.size} {dec.dtype})")
        raw[:] = got
        return out

    def get_config(self) -> dict:
        """``{"id": ..., setting: value}``: the settings that apply, as JSON."""
        return {"id": self.codec_id, **{k: getattr(self, k) for k in self._config_keys()}}

    def _config_keys(self) -> tuple:
        return self._keys

    @classmethod
    def from_config(cls, config: dict):
        """The codec of a config from :meth:`get_config` (``id`` optional, checked)."""
        config = dict(config)
        cid = config.pop("id", cls.codec_id)
        if cid != cls.codec_id:
            raise InvalidArgumentError(f"config for codec {cid!r} given to {cls.codec_id!r}")
        unknown = set(config) - set(cls._keys)
        if unknown:
            raise InvalidArgumentError(
                f"unknown {cls.codec_id} settings {sorted(unknown)}; known: {sorted(cls._keys)}")
        return cls(**config)


DEFAULT_TARGET = 1e-4     # LcckptLossy(): ||x - x̃||₂ <= 1e-4·||x||₂, for ordinary arrays
_LC_KEYS = ("bits", "coder", "error_bound", "midpoint", "chunk_size")


class LcckptLossy(_LcckptCodec):
    """Lossy coding of a floating array, error-bounded by default.

    ``LcckptLossy()`` holds each chunk to ``||x - x̃||₂ <= target·||x||₂`` (``target``,
    default :data:`DEFAULT_TARGET`; the uniform quantizer, or the chunk rounded to fewer
    mantissa bits and stored exactly where that is smaller), which suits ordinary arrays. Any
    LC-Checkpoint setting (``bits``, ``error_bound``, ``midpoint``) without a ``target``
    selects LC-Checkpoint's exponent buckets instead, meant for deltas and other
    mostly-small values (every element becomes a bucket mean). Arrays that are not
    floating (a byte buffer, integers) are stored exactly; chunks that hold NaN or Inf
    (zarr's NaN fill value for missing data), which no quantizer can bound, are rounded
    (with a ``target``) or stored exactly.
    """
    codec_id = "lcckpt_lossy"
    _keys = ("target",) + _LC_KEYS

    def __init__(self, target: float | None | str = "default", bits: int | None = None,
                 coder: str = "auto", error_bound: float | None = None,
                 midpoint: bool = False, chunk_size: int | None = None):
        lc = bits is not None or error_bound is not None or midpoint
        if target == "default":
            target = None if lc else DEFAULT_TARGET
        elif target is not None and lc:
            raise InvalidArgumentError(
                "target bounds the uniform quantizer; bits, error_bound and midpoint set "
                "LC-Checkpoint's buckets: give one or the other")
        if target is None and not lc:
            bits = 2                          # LC-Checkpoint's own default
        self._config = CodecConfig(2 if bits is None else bits, coder, error_bound, midpoint,
                                   chunk_size, target=target)            # validates
        self._exact = CodecConfig(chunk_size=chunk_size, lossless=True)
        self.target, self.coder, self.chunk_size = target, coder, chunk_size
        self.bits, self.error_bound, self.midpoint = bits, error_bound, midpoint

    def _config_keys(self) -> tuple:
        return ("target", "coder", "chunk_size") if self.target is not None else _LC_KEYS

    def _config_for(self, a: np.ndarray) -> CodecConfig:
        return self._config if a.dtype.kind == "f" and a.size else self._exact

    def encode(self, buf) -> bytes:
        """One self-describing blob of ``buf``. With a ``target``, the smaller of the
        uniform quantizer's blob and an exact one of ``buf`` rounded to the fewest
        mantissa bits within the target (:mod:`lcckpt.codec.rounding`: an ordinary array
        at a fine target spans more levels than the quantizer's symbols). Where it holds
        NaN/Inf, which no quantizer can bound, the rounded or the exact blob."""
        a = _as_array(buf)
        cfg = self._config_for(a)
        try:
            blob = _encode(a, config=cfg)
        except NonFiniteError:
            blob = None
        if cfg is self._config and self.target is not None:
            r = rounded(a, self.target)
            if r is not None:
                alt = _encode(r, config=self._exact)
                blob = alt if blob is None or len(alt) < len(blob) else blob
        return blob if blob is not None else _encode(a, config=self._exact)


class LcckptLossless(_LcckptCodec):
    """Bit-exact byte-plane coding of an array of any supported dtype."""
    codec_id = "lcckpt_lossless"
    _keys = ("chunk_size",)
    _lossless = True

    def __init__(self, chunk_size: int | None = None):
        self._config = CodecConfig(chunk_size=chunk_size, lossless=True)   # validates
        self.chunk_size = chunk_size


def register() -> None:
    """Register both codecs with numcodecs' registry by hand (the entry point does it
    for an installed package)."""
    from numcodecs.registry import register_codec
    register_codec(LcckptLossy)
    register_codec(LcckptLossless)
