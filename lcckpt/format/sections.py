"""Section codecs: how one tensor leaf becomes the bytes of a container section, and back.

Built in: ``"raw"`` (exact little-endian bytes), ``"lossless"`` (the tensor codec's
bit-exact byte-plane coding), ``"zeros"`` (no payload: a tensor of zero bytes, chosen by
the writers in place of ``"lossless"``, see :func:`all_zeros`) and ``"delta"`` (the
chain's tracked tensors: a keyframe reads anywhere, a lossy delta only through its
chain). Users may add codecs of their own with :func:`register_section_codec`, an
explicit call; importing lcckpt registers nothing.
(Not numcodecs' ``register_codec``: lcckpt's numcodecs codecs are in lcckpt/numcodecs.py.)

The tree walk (tree.py) calls a *leaf encoder* ``(key_path, tensor) -> Encoded`` for every
tensor it saves and a *leaf decoder* ``(key_path, container, index, meta) -> array`` for
every tensor section it loads. :func:`leaf_encoder` and :func:`decode_leaf` are the
defaults; the chain passes its own bound methods, which handle ``"delta"`` sections and
hand everything else back to these.
"""

from __future__ import annotations

import re
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from ..codec import blob as _blob, dtypes
from ..codec.tensor import decode as _decode_blob
from ..codec.tensor import encode_exact
from ..codec.config import CodecConfig
from ..codec.delta import Reconstruction
from ..codec.replay import replay
from ..codec.streamed import STREAM_MIN, read_later, streamed
from ..errors import (
    BrokenChainError, CorruptDataError, InvalidArgumentError, ResourceLimitError,
    UnsupportedDtypeError, UnsupportedVersionError,
)
from .. import limits
from ..util import memory as _memory

__all__ = ["DELTA", "LOSSLESS", "RAW", "Encoded", "SectionCodec", "decode_leaf",
           "leaf_encoder", "register_codec", "register_section_codec"]

RAW, LOSSLESS, DELTA, ZEROS = "raw", "lossless", "delta", "zeros"
# A tensor of zero bytes this large is stored as its dtype and shape alone (``"zeros"``)
# and loads as untouched pages: its lossless blob is thousands of times smaller than the
# tensor, so a file holding one (a preallocated cache buffer, say) failed the default
# load limit's 32x bound, which a decompression bomb must not pass (lcckpt/limits.py).
ZEROS_MIN = 1 << 16
TRACKABLE = frozenset((torch.float16, torch.bfloat16, torch.float32, torch.float64))


@dataclass(frozen=True)
class Encoded:
    """What a leaf encoder returns: the codec's name, the payload (bytes-like or a list of
    pieces written one after another) and optional JSON params for the section meta."""
    codec: str
    payload: Any
    params: dict | None = None


@dataclass(frozen=True)
class SectionCodec:
    """A named section codec.

    ``encode(tensor)`` gets a detached, contiguous CPU tensor and returns a payload, or
    ``(payload, params)``. ``decode(data, meta)`` gets the checked payload (a memoryview)
    and the section metadata (``dtype``, ``shape``, ``nbytes``, ``codec``,
    ``codec_params``) and returns a numpy array or CPU tensor of exactly that dtype and
    shape. ``dtypes``: the torch dtypes it handles (None: all); others are stored raw.
    """

    name: str
    encode: Callable[[torch.Tensor], Any]
    decode: Callable[[memoryview, dict], Any]
    dtypes: frozenset | None = None


def _raw_encode(t: torch.Tensor) -> memoryview:
    if sys.byteorder != "little":
        raise UnsupportedDtypeError("the raw codec needs a little-endian host")
    if t.numel() == 0:
        return memoryview(b"")
    return memoryview(t.reshape(-1).view(torch.uint8).numpy())


def _lossless_encode(t: torch.Tensor) -> list:
    a, dt = dtypes.to_numpy(t)       # pieces: the container writes them without a join
    return encode_exact(a, dt, CodecConfig().log2)


def _lossless_decode(data, meta: dict):
    # into a tensor of the declared shape: a blob of any other size is refused before
    # decoding (the declared sizes are what the load's max_bytes was checked against)
    out = torch.empty(meta["shape"], dtype=dtypes.NAME_TORCH[meta["dtype"]])
    try:
        return _decode_blob(data, out=out, check_payload=False)   # the section CRC covered it
    except InvalidArgumentError as e:
        raise CorruptDataError(f"the section's blob does not hold what its header says: {e}") from None


def _keyframe_decode(data, meta: dict):
    """A ``"delta"`` section outside its chain: only a keyframe can be read."""
    rec = Reconstruction()
    try:
        rec.apply(data, dtype=meta.get("dtype"), shape=tuple(meta.get("shape", ())),
                  check_payload=False, what=section_key(meta),
                  zero_base=section_zero_base(meta))
    except BrokenChainError:
        raise BrokenChainError(
            f"{section_key(meta)} is a delta against an earlier checkpoint; restore it with "
            "lcckpt.DeltaCheckpointer(directory).load(step)") from None
    return rec.value(copy=False)


def all_zeros(t: torch.Tensor) -> bool:
    """Whether ``t``, dense on the host and of :data:`ZEROS_MIN` bytes or more, holds only
    zero bytes (-0.0 is not zero here: loads are bit-exact). Read in blocks growing from
    4 KiB to 16 MiB, so a tensor of real values costs a small read, and one that only
    starts with zeros (an embedding's padding row, its moments) stops at its first
    non-zero block."""
    if t.numel() * t.element_size() < ZEROS_MIN or t.device.type != "cpu" \
            or t.layout != torch.strided or not t.is_contiguous() \
            or t.is_conj() or t.is_neg():
        return False
    b = t.detach().reshape(-1).view(torch.uint8)
    lo, step = 0, 4096
    while lo < b.numel():
        if bool(b[lo:lo + step].any()):
            return False
        lo, step = lo + step, min(4 * step, 1 << 24)
    return True


def zeros_encoded() -> Encoded:
    """The section of a tensor :func:`all_zeros` found: its metadata alone."""
    return Encoded(ZEROS, memoryview(b""))


def _zeros_decode(data, meta: dict) -> torch.Tensor:
    """Zeros of the section's dtype and shape (its ``nbytes`` checked against them by the
    tree walk) on pages that take memory only when written."""
    if data.nbytes:
        raise CorruptDataError(f"a zeros section holds {data.nbytes} bytes, none expected")
    dt, nbytes = dtypes.NAME_TORCH[meta["dtype"]], meta["nbytes"]
    if not nbytes:
        return torch.zeros(meta["shape"], dtype=dt)
    try:
        buf = _memory.bulk_zeros(nbytes, np.uint8)
    except (MemoryError, OSError, ValueError, OverflowError) as e:
        raise ResourceLimitError(f"a tensor of {nbytes:,} bytes of zeros cannot be mapped "
                                 f"in this process: {e}") from None
    return torch.from_numpy(buf).view(dt).reshape(meta["shape"])


def _raw_decode(data, meta: dict) -> torch.Tensor:
    t = torch.empty(meta["shape"], dtype=dtypes.NAME_TORCH[meta["dtype"]])
    if data.nbytes:
        t.reshape(-1).view(torch.uint8).numpy()[:] = np.frombuffer(data, np.uint8)
    return t


_BUILTIN = {
    RAW: SectionCodec(RAW, _raw_encode, _raw_decode),
    LOSSLESS: SectionCodec(LOSSLESS, _lossless_encode, _lossless_decode,
                           frozenset(dtypes.BY_TORCH)),
    DELTA: SectionCodec(DELTA, None, _keyframe_decode, TRACKABLE),
    ZEROS: SectionCodec(ZEROS, None, _zeros_decode),
}
_registered: dict[str, SectionCodec] = {}


def register_section_codec(name: str, encode: Callable[[torch.Tensor], Any],
                   decode: Callable[[memoryview, dict], Any], *, dtypes=None,
                   replace: bool = False) -> None:
    """Make a codec of your own usable by ``save(..., codec=name)`` and by ``load``."""
    if not isinstance(name, str) or not re.fullmatch(r"[A-Za-z0-9_.\-]{1,64}", name):
        raise InvalidArgumentError(f"codec name {name!r} must be 1-64 letters, digits, '_', '.', '-'")
    if name in _BUILTIN:
        raise InvalidArgumentError(f"the {name!r} codec is built in and cannot be replaced")
    if name in _registered and not replace:
        raise InvalidArgumentError(f"codec {name!r} is already registered; pass replace=True")
    _registered[name] = SectionCodec(name, encode, decode,
                                     None if dtypes is None else frozenset(dtypes))


register_codec = register_section_codec      # the earlier name (numcodecs has its own)


def get(name) -> SectionCodec | None:
    """The codec called ``name`` (built in or registered), or None."""
    if type(name) is not str:
        return None
    return _BUILTIN.get(name) or _registered.get(name)


def leaf_encoder(codec: str | Callable) -> Callable[[str, torch.Tensor], Encoded]:
    """The leaf encoder of ``save(codec=...)``: one codec name for every tensor, or a
    function ``(key_path, tensor) -> codec name`` choosing per tensor. What one encoder
    writes stays loadable under the default limit (:class:`Loadable`)."""
    held = Loadable()
    if isinstance(codec, str):
        if get(codec) is None or codec in (DELTA, ZEROS):
            raise InvalidArgumentError(f"unknown codec {codec!r}; available: "
                                       f"{sorted(n for n in _names() if n not in (DELTA, ZEROS))}")
        return lambda path, t: held(encode_with(codec, path, t), t)
    if callable(codec):
        return lambda path, t: held(encode_with(codec(path, t), path, t), t)
    raise InvalidArgumentError("codec must be a codec name or a function (key_path, tensor) -> name")


class Loadable:
    """A load under ``"auto"`` refuses a file that declares more than 192 MiB + 32x its
    size (lcckpt/limits.py: a few bytes of a constant chunk can describe gigabytes). A
    file this library writes must load, so lossless sections that expand more than 32x
    (a large buffer of one value other than zero) may together exceed 32x their size by
    192 MiB at most; past that, such a tensor is stored raw. One per file written."""

    def __init__(self):
        self.excess = 0

    def admit(self, declared: int, stored: int) -> bool:
        """Whether a section of ``stored`` bytes that declares ``declared`` may be kept."""
        over = declared - limits.AUTO_EXPANSION * stored
        if over <= 0 or self.excess + over <= limits.AUTO_FLOOR:
            self.excess += max(over, 0)
            return True
        return False

    def __call__(self, enc: Encoded, t: torch.Tensor) -> Encoded:
        if enc.codec != LOSSLESS or self.admit(t.numel() * t.element_size(),
                                               _blob.nbytes(enc.payload)):
            return enc
        return Encoded(RAW, _raw_encode(t))


def encode_with(name: str, path: str, t: torch.Tensor) -> Encoded:
    """Encode ``t`` with codec ``name``; dtypes it does not handle are stored raw."""
    codec = get(name)
    if codec is None or codec.encode is None:
        hint = {DELTA: "; the 'delta' codec is written by lcckpt.DeltaCheckpointer only",
                ZEROS: "; 'lossless' stores a tensor of zeros as 'zeros' itself"}.get(name, "")
        raise InvalidArgumentError(f"codec {name!r} chosen for {path} is not registered{hint}")
    if codec.dtypes is not None and t.dtype not in codec.dtypes:
        codec = _BUILTIN[RAW]
    if codec.name == LOSSLESS and all_zeros(t):
        return zeros_encoded()
    out = codec.encode(t)
    payload, params = out if isinstance(out, tuple) else (out, None)
    if codec.name == LOSSLESS and _blob.nbytes(payload) >= t.numel() * t.element_size():
        # a blob's header and checksums outweigh what coding saves (small tensors,
        # random bytes): the plain bytes, which the section's checksum covers as well
        return Encoded(RAW, _raw_encode(t))
    return Encoded(codec.name, payload, params)


def _names():
    return list(_BUILTIN) + list(_registered)


def decode_leaf(path: str, c, index: int, meta: dict):
    """The default leaf decoder: read section ``index`` of container ``c`` as ``meta``
    describes it (dtype, shape and nbytes already validated by the tree walk)."""
    name = meta.get("codec")
    if name == RAW:                      # straight from the file into the tensor
        nbytes = meta["nbytes"]
        if c.sections[index]["length"] != nbytes:
            raise CorruptDataError(
                f"invalid object tree at {path}: raw section holds "
                f"{c.sections[index]['length']} bytes, expected {nbytes}")
        t = torch.empty(meta["shape"], dtype=dtypes.NAME_TORCH[meta["dtype"]])
        c.read_into(index, t.reshape(-1).view(torch.uint8).numpy() if nbytes else bytearray())
        return t
    if name == LOSSLESS:
        t = _streamed_lossless(path, c, index, meta)
        if t is not None:
            return t
    codec = get(name)
    if codec is None:
        raise UnsupportedVersionError(
            f"{path} was written with codec {name!r:.40}, which this build does not have; "
            "upgrade lcckpt or register that codec with lcckpt.register_section_codec")
    return codec.decode(c.data(index), meta)


def fits(t, dtype: torch.dtype | None, shape) -> bool:
    """Whether ``t`` can receive a stored tensor of ``dtype`` and ``shape`` in place: a
    host tensor of those, contiguous, with no lazy conjugate or negative bit."""
    return (isinstance(t, torch.Tensor) and t.device.type == "cpu" and t.dtype == dtype
            and list(t.shape) == list(shape) and t.is_contiguous()
            and not (t.is_conj() or t.is_neg()))


def replay_into_tensor(rec: Reconstruction, t: torch.Tensor) -> bool:
    """:meth:`Reconstruction.replay_into` the memory of ``t`` (an fp32/fp64 host tensor,
    contiguous); False, nothing done, where ``t`` or ``rec`` does not allow it."""
    return t.device.type == "cpu" and t.dtype in (torch.float32, torch.float64) \
        and t.is_contiguous() and rec.replay_into(t.detach().view(-1).numpy())


def decode_into(targets, base: Callable = decode_leaf) -> Callable:
    """A leaf decoder that decodes each section into the target that
    ``targets.take`` (an :class:`~lcckpt.format.into.Into`) gives for its key path and
    returns that very tensor: a raw section is read into it and a large lossless one
    decoded into it as it is read; any other is decoded by ``base`` and copied in."""

    def decode(path: str, c, index: int, meta: dict):
        t = targets.take(path, dtypes.NAME_TORCH.get(meta.get("dtype")), meta.get("shape"))
        if t is None:
            return base(path, c, index, meta)
        flat = t.detach().view(-1)
        if meta.get("codec") == ZEROS and c.sections[index]["length"] == 0:
            flat.zero_()
            return t
        if meta.get("codec") == RAW and c.sections[index]["length"] == meta["nbytes"]:
            c.read_into(index, flat.view(torch.uint8).numpy() if flat.numel() else bytearray())
            return t
        if meta.get("codec") == LOSSLESS:
            blob = streamed_section(c, index, meta["dtype"], path)
            if blob is not None and decode_streamed(blob, t.detach()) is not None:
                return t
        out = base(path, c, index, meta)
        flat.copy_(torch.as_tensor(out).reshape(-1))
        return t
    return decode


def streamed_section(c, index: int, work: str, what: str, origin=None):
    """Section ``index`` of container ``c`` as a :class:`~lcckpt.codec.streamed.StreamedBlob`
    where it is decoded as it is read (:mod:`lcckpt.codec.streamed`: a lossless blob of
    :data:`STREAM_MIN` bytes or more, of dtype ``work``, in a file lcckpt opened); else
    None, and the caller reads it whole."""
    if c.sections[index]["length"] < STREAM_MIN:
        return None
    part = c.part_reader(index)
    return None if part is None else streamed(part, work, what, origin)


DEFER_MIN = 1 << 20     # a chain's section this large is read when it is decoded


def chain_section(c, index: int, work: str, what: str, origin=None):
    """Section ``index`` of a chain file ``c`` as a blob read when it is decoded, in a
    file lcckpt opened: streamed (:func:`streamed_section`'s) or, any other of
    :data:`DEFER_MIN` bytes or more, a :class:`~lcckpt.codec.streamed.DeferredBlob`; else
    None, and the caller reads it whole."""
    n = c.sections[index]["length"]
    if n < min(STREAM_MIN, DEFER_MIN):
        return None
    part = c.part_reader(index)
    return None if part is None else read_later(
        part, work, lambda buf: c.check(index, buf), what, origin,
        stream=n >= STREAM_MIN, defer=n >= DEFER_MIN)


def _streamed_lossless(path: str, c, index: int, meta: dict):
    """A large lossless section decoded as it is read, straight into the tensor; None
    where it is read whole instead (:func:`streamed_section`, or a dtype whose tensor is
    not its blob's carrier array, a complex one)."""
    blob = streamed_section(c, index, meta["dtype"], path)
    if blob is None:
        return None
    return decode_streamed(blob, torch.empty(meta["shape"], dtype=dtypes.NAME_TORCH[meta["dtype"]]))


def decode_streamed(blob, out: torch.Tensor) -> torch.Tensor | None:
    """Decode a streamed lossless blob into ``out`` (a contiguous CPU tensor of the shape
    and dtype its metadata says) and return it; None, with nothing read, where ``out``'s
    memory is not the blob's carrier array (a complex dtype): the caller reads the blob
    whole. A blob of another shape is damage."""
    p = blob.parsed
    if tuple(p.shape) != tuple(out.shape):
        blob.part.close()
        raise CorruptDataError(f"{blob.what}: the blob holds shape {list(p.shape)}, its "
                               f"metadata says {list(out.shape)}")
    flat = out.view(-1)
    carrier = flat.view(torch.int16).numpy().view(np.uint16) if out.dtype == torch.bfloat16 \
        else flat.numpy() if p.dt.kind != "complex" else None
    if carrier is None or carrier.dtype != p.dt.numpy or carrier.size != p.n:
        blob.part.close()
        return None
    replay([], carrier, base=(blob, p))
    return out


def section_zero_base(meta: dict) -> bool:
    """Whether a ``"delta"`` section codes its tensor against zeros (a tensor that first
    appeared in this file) rather than against the chain's previous step."""
    params = meta.get("codec_params")
    base = params.get("base") if type(params) is dict else None
    if base is None:
        return False
    if base != "zero":
        raise CorruptDataError(f"a delta section has an unknown base {base!r}; upgrade lcckpt")
    return True


def section_key(meta: dict) -> str:
    """The tracking key of a ``"delta"`` section (its key path when it was saved)."""
    params = meta.get("codec_params")
    key = params.get("key") if type(params) is dict else None
    if type(key) is not str:
        raise CorruptDataError("a delta section has no tracking key in its codec_params")
    return key

