"""lcckpt's codecs in version-3 zarr arrays, as serializers.

A version-3 array keeps three kinds of codec apart: filters (array to array), one
serializer (array to bytes) and compressors (bytes to bytes). lcckpt's codecs turn a typed
chunk into a self-describing blob, so here each is the array's serializer:

    zarr.create_array(store, shape=..., chunks=..., dtype="float32",
                      serializer=lcckpt.zarr3.LcckptLossy(target=1e-4), compressors=None)

Each is the numcodecs codec of the same name (:mod:`lcckpt.numcodecs`: the same settings,
the same blobs) behind zarr's codec interface. zarr finds the names ``"lcckpt_lossy"``
and ``"lcckpt_lossless"`` in an array's metadata through the ``zarr.codecs`` entry points
of an installed lcckpt, or after :func:`register` (a source tree). Importing this module
needs zarr 3; nothing else in lcckpt imports it.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

import numpy as np
from zarr.abc.codec import ArrayBytesCodec
from zarr.core.common import parse_named_configuration
from zarr.registry import register_codec

from . import numcodecs as _numcodecs
from .errors import InvalidArgumentError

__all__ = ["LcckptLossless", "LcckptLossy", "register"]


@dataclass(frozen=True, init=False)
class _Serializer(ArrayBytesCodec):
    """A numcodecs codec of lcckpt's (``codec``) as a zarr-3 serializer."""

    codec: _numcodecs._LcckptCodec = field(hash=False)   # equal by config, not hashable
    is_fixed_size = False
    numcodec = _numcodecs.LcckptLossless           # the class this serializer wraps

    def __init__(self, **settings) -> None:
        object.__setattr__(self, "codec", self.numcodec.from_config(settings))   # checked

    @classmethod
    def from_dict(cls, data: dict):
        _, settings = parse_named_configuration(data, cls.numcodec.codec_id,
                                                require_configuration=False)
        return cls(**(settings or {}))

    def to_dict(self) -> dict:
        settings = self.codec.get_config()
        settings.pop("id")
        return {"name": self.numcodec.codec_id, "configuration": settings}

    def compute_encoded_size(self, input_byte_length: int, chunk_spec) -> int:
        raise NotImplementedError("a blob's size depends on the chunk's values")

    async def _encode_single(self, chunk_array, chunk_spec):
        a = np.ascontiguousarray(chunk_array.as_numpy_array())
        blob = await asyncio.to_thread(self.codec.encode, a)
        return chunk_spec.prototype.buffer.from_bytes(blob)

    async def _decode_single(self, chunk_bytes, chunk_spec):
        out = np.empty(chunk_spec.shape, dtype=chunk_spec.dtype.to_native_dtype())
        await asyncio.to_thread(self.codec.decode, chunk_bytes.to_bytes(), out)
        return chunk_spec.prototype.nd_buffer.from_numpy_array(out)

    def validate(self, *, shape, dtype, chunk_grid) -> None:
        native = dtype.to_native_dtype()
        if native.kind not in "biufc" or not native.isnative and native.itemsize > 1:
            raise InvalidArgumentError(
                f"{self.numcodec.codec_id} codes bool, integer, float and complex numbers "
                f"in this machine's byte order, not {native}")


@dataclass(frozen=True, init=False)
class LcckptLossless(_Serializer):
    """Bit-exact: :class:`lcckpt.numcodecs.LcckptLossless` (``chunk_size``)."""

    numcodec = _numcodecs.LcckptLossless


@dataclass(frozen=True, init=False)
class LcckptLossy(_Serializer):
    """Error-bounded: :class:`lcckpt.numcodecs.LcckptLossy` (``target``, or LC's ``bits``,
    ``coder``, ``error_bound``, ``midpoint``; ``chunk_size``)."""

    numcodec = _numcodecs.LcckptLossy


def register() -> None:
    """Make zarr find both serializers by name (an installed lcckpt does it by entry point)."""
    for cls in (LcckptLossless, LcckptLossy):
        register_codec(cls.numcodec.codec_id, cls)
