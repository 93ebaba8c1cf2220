"""Section codecs backed by the tensor codec, registered with :mod:`lcckpt.serialization`.

``"lossless"``: :func:`lcckpt.codec.encode` with ``lossless=True`` (exponent/byte-plane
coding, bit-exact) for every dtype the tensor codec knows; tensors of other dtypes are
stored raw. It is what ``lcckpt.save(obj, f, compress=True)`` uses. ``lcckpt/__init__.py``
imports this module, so the codec is available wherever lcckpt is.
"""

from . import codec as _codec
from . import dtypes as _dtypes
from .serialization import register_codec

__all__ = ["LOSSLESS"]

LOSSLESS = "lossless"


def _lossless_encode(t):
    a, dt = _dtypes.to_numpy(t)       # pieces: the container writes them without a join
    return _codec.encode_exact(a, dt, _codec._chunk_log2(None))


def _lossless_decode(data, meta):
    return _codec.decode(data, check_payload=False)    # the section's CRC covered it


register_codec(LOSSLESS, _lossless_encode, _lossless_decode, dtypes=set(_dtypes.BY_TORCH),
               replace=True)
