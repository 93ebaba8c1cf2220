"""Delta tracking with error feedback for a stream of states of one tensor (ALGORITHM §1).

The encoder keeps the reference ``ref`` = what the decoder will have reconstructed,
and codes ``u_t - ref`` each step, so whatever one step drops is carried into the next
delta and error does not accumulate along a chain. The encoder advances its reference
while it codes the symbols, with the same fp32 add ``ref[i] + centroid[s]`` the decoder
makes while it decodes them (skipping symbol 0 on both sides); tests hold the two
references bit-identical over 1,000-step chains. fp16/bf16 states are tracked in fp32,
fp64 in fp64.
"""

import warnings

import numpy as np

from . import dtypes
from .codec import (LOSSLESS, EncodeStats, _chunk_log2, _check_bits, blob_nbytes, decode_exact,
                    decode_symbols_into, encode_exact, guarded_encode, parse)
from .entropy import CodeCache, modes_for
from .errors import (BrokenChainError, InvalidArgumentError, NonFiniteError,
                     UnsupportedDtypeError)


class DeltaEncoder:
    """Encode successive states of one floating tensor: a keyframe first, then deltas."""

    def __init__(self, bits: int = 2, coder: str = "auto", *, error_bound: float | None = None,
                 midpoint: bool = False, chunk_size: int | None = None,
                 keyframe_coding: str = "lossless"):
        """``keyframe_coding``: "lossless" (byte planes, ~1.2x smaller) or "raw" (exact bytes,
        fastest to restore) for the exact blobs: the first one and every keyframe."""
        if keyframe_coding not in ("lossless", "raw"):
            raise InvalidArgumentError(
                f"keyframe_coding must be 'lossless' or 'raw', got {keyframe_coding!r}")
        self.raw_keyframes = keyframe_coding == "raw"
        _check_bits(bits)
        modes_for(coder, bits)
        self.bits, self.coder = bits, coder
        self.error_bound, self.midpoint = error_bound, midpoint
        self.log2 = _chunk_log2(chunk_size)
        self.cache = CodeCache()
        self.ref: np.ndarray | None = None     # flat working-precision reconstruction
        self.dtype: dtypes.DType | None = None
        self.shape: tuple | None = None
        self.last_stats: EncodeStats | None = None

    def reset(self):
        """Forget the reference: the next :meth:`encode` writes a keyframe."""
        self.ref = None

    def encode(self, x, *, keyframe: bool = False) -> bytes:
        """Blob for state ``x``: exact when ``keyframe`` or no compatible reference exists."""
        return b"".join(self.encode_parts(x, keyframe=keyframe))

    def encode_parts(self, x, *, keyframe: bool = False) -> list:
        """:meth:`encode`, the blob as a list of byte pieces that a container writes one
        after another: an exact blob of a large tensor is never joined into one copy."""
        a, dt = dtypes.to_numpy(x)
        if dt.kind != "float" or dt.name.startswith("F8"):
            raise UnsupportedDtypeError(f"delta tracking needs fp16/bf16/fp32/fp64, got {dt.name}")
        u = dtypes.to_float_work(a, dt).reshape(-1)
        if keyframe or self.ref is None or dt != self.dtype or a.shape != self.shape:
            return self._keyframe(a, dt, u, None)
        try:
            blob, st, lossy = guarded_encode(u, self.ref, dt, a.shape, self.bits, self.coder,
                                             self.log2, self.midpoint, self.error_bound,
                                             exact=lambda: encode_exact(a, dt, self.log2,
                                                                        self.raw_keyframes),
                                             cache=self.cache, advance=True)
        except NonFiniteError as e:
            warnings.warn(f"{e}; writing an exact keyframe instead", RuntimeWarning, stacklevel=3)
            return self._keyframe(a, dt, u, "non-finite delta")
        if not lossy:
            self.ref = u.copy()
        self.last_stats = st
        return [blob] if lossy else blob

    def _keyframe(self, a, dt, u, why):
        blob = encode_exact(a, dt, self.log2, self.raw_keyframes)
        self.ref = np.array(u, copy=True)
        self.dtype, self.shape = dt, a.shape
        self.last_stats = EncodeStats(u.size, dt.name, "lossless", nbytes=blob_nbytes(blob),
                                      fallback=why)
        return blob

    def reference(self):
        """The decoder's reconstruction of the last state, in the state's dtype."""
        if self.ref is None:
            return None
        return dtypes.from_float_work(self.ref.reshape(self.shape).copy(), self.dtype)


class DeltaDecoder:
    """Rebuild the states written by a :class:`DeltaEncoder`, blob by blob, in order."""

    def __init__(self):
        self.ref: np.ndarray | None = None
        self.dtype: dtypes.DType | None = None
        self.shape: tuple | None = None

    def decode(self, blob):
        buf, p = parse(blob)
        if p.kind == LOSSLESS:
            a = decode_exact(buf, p)
            if p.dt.kind != "float" or p.dt.name.startswith("F8"):
                raise UnsupportedDtypeError(f"not a delta-tracked dtype: {p.dt.name}")
            self.ref = np.array(dtypes.to_float_work(a, p.dt).reshape(-1), copy=True)
            self.dtype, self.shape = p.dt, p.shape
        else:
            if self.ref is None:
                raise BrokenChainError("a delta blob arrived before any keyframe; "
                                       "decode the chain from its keyframe")
            if p.dt != self.dtype or p.shape != self.shape:
                raise BrokenChainError(
                    f"delta for {p.dt.name}{list(p.shape)} does not fit the reference "
                    f"{self.dtype.name}{list(self.shape)}")
            decode_symbols_into(buf, p, self.ref)
        return self.reference()

    def reference(self):
        if self.ref is None:
            return None
        return dtypes.from_float_work(self.ref.reshape(self.shape).copy(), self.dtype)
