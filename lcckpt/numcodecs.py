"""lcckpt's stateless codecs as numcodecs codecs, for zarr and anything else that speaks them.

``LcckptLossy`` (id ``"lcckpt_lossy"``) is LC-Checkpoint's exponent-bucket quantizer with
its entropy coders, for floating arrays; ``LcckptLossless`` (id ``"lcckpt_lossless"``) is
the exact byte-plane coder, for any supported dtype. Each is a
:class:`lcckpt.config.CodecConfig` plus ``lcckpt.encode(x, config=cfg)`` /
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
from .codec import decode as _raw_decode
from .codec import encode as _encode
from .config import CodecConfig
from .errors import InvalidArgumentError

def _decode(data, out=None):
    """``lcckpt.decode`` under the process's ``max_bytes`` (zarr feeds codecs bytes from
    anywhere; ``lcckpt.limits.set_max_bytes`` changes it)."""
    return _raw_decode(data, out=out, max_bytes=None if out is not None else limits.DEFAULT)


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
    """The array numcodecs hands over: an ndarray (any layout) or a typed buffer."""
    if isinstance(buf, np.ndarray):
        return np.ascontiguousarray(buf)
    try:
        a = np.asarray(memoryview(buf))
    except TypeError:
        raise InvalidArgumentError(
            f"cannot encode a {type(buf).__name__}: pass a numpy array or a typed buffer") from None
    return np.ascontiguousarray(a)


class _LcckptCodec(_Base):
    _lossless = False

    def __init__(self, **settings):
        self._config = CodecConfig(lossless=self._lossless, **settings)   # validates
        for k, v in settings.items():
            setattr(self, k, v)

    def encode(self, buf) -> bytes:
        """One self-describing blob of ``buf`` (its dtype and shape included)."""
        return _encode(_as_array(buf), config=self._config)

    def decode(self, buf, out=None):
        """The array ``buf`` holds (its saved shape), or ``out`` filled with it. ``out``
        may be any writeable array of the blob's dtype and size; a C-contiguous one is
        decoded into directly."""
        data = buf if isinstance(buf, (bytes, bytearray, memoryview)) else \
            memoryview(np.ascontiguousarray(_as_array(buf)).view(np.uint8).reshape(-1))
        if out is None:
            return _decode(data)
        target = out if isinstance(out, np.ndarray) else np.asarray(memoryview(out))
        if target.flags.c_contiguous and target.flags.writeable:
            try:
                _decode(data, out=target.reshape(-1))
                return out
            except InvalidArgumentError:
                if target.dtype == np.uint8:      # a byte buffer: fill it with the raw values
                    dec = np.ascontiguousarray(_decode(data))
                    raw = dec.reshape(-1).view(np.uint8)
                    if raw.size != target.size:
                        raise
                    target.reshape(-1)[:] = raw
                    return out
                raise
        dec = _decode(data)
        if dec.size != target.size or dec.dtype != target.dtype:
            raise InvalidArgumentError(
                f"out holds {target.size} {target.dtype} values; the blob holds {dec.size} {dec.dtype}")
        target[...] = dec.reshape(target.shape)
        return out

    def get_config(self) -> dict:
        """``{"id": ..., setting: value}``: the settings given, as JSON."""
        return {"id": self.codec_id, **{k: getattr(self, k) for k in self._keys if hasattr(self, k)}}

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


class LcckptLossy(_LcckptCodec):
    """LC-Checkpoint's lossy coding of a floating array (``bits``, ``coder``,
    ``error_bound``, ``midpoint``, ``chunk_size`` as in :class:`~lcckpt.config.CodecConfig`).
    Meant for deltas and other mostly-small values: every element becomes a bucket mean."""
    codec_id = "lcckpt_lossy"
    _keys = ("bits", "coder", "error_bound", "midpoint", "chunk_size")

    def __init__(self, bits: int = 2, coder: str = "auto", error_bound: float | None = None,
                 midpoint: bool = False, chunk_size: int | None = None):
        super().__init__(bits=bits, coder=coder, error_bound=error_bound, midpoint=midpoint,
                         chunk_size=chunk_size)


class LcckptLossless(_LcckptCodec):
    """Bit-exact byte-plane coding of an array of any supported dtype."""
    codec_id = "lcckpt_lossless"
    _keys = ("chunk_size",)
    _lossless = True

    def __init__(self, chunk_size: int | None = None):
        super().__init__(chunk_size=chunk_size)


def register() -> None:
    """Register both codecs with numcodecs' registry by hand (the entry point does it
    for an installed package)."""
    from numcodecs.registry import register_codec
    register_codec(LcckptLossy)
    register_codec(LcckptLossless)
