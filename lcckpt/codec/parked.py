"""A parked reference: a delta encoder's reference dropped from memory while its tensor
does not change, and fetched back from the chain's files when it does.

A fine-tune that freezes most of a model (LoRA adapters on a frozen encoder, a frozen
backbone under a new head) sends "no change" deltas for the frozen tensors at every
save, yet the writer kept a full working-precision copy of each as its reference: for a
bf16 model, twice the frozen weights' own size in host memory. Once a delta comes out
exactly zero, the reference equals the newest step's reconstruction, which the files
already hold, so the writer keeps only its :func:`fingerprint`. At the next save the
tensor is fingerprinted; the same fingerprint means the same bits, and the delta is
coded against the tensor itself (the same blob, bit for bit, as against the kept
reference). A different one fetches the reference back from the files first.

The fingerprint is the CRC-32 and the CRC-32C of the bytes: two checksums of different
polynomials, so a change goes unseen only if its bit pattern is a multiple of both
(a 64-bit polynomial): about one change in 2⁶⁴ for changes that are not built to.
"""

from __future__ import annotations

from typing import Callable

import numpy as np

from ..util.crc import crc32, crc32c

__all__ = ["PARK_MIN", "Parked", "fingerprint", "same_bits"]

PARK_MIN = 1 << 16      # elements: smaller references are not worth a fetch


def fingerprint(a: np.ndarray) -> tuple:
    """``(dtype, size, CRC-32, CRC-32C)`` of ``a``'s bytes in C order (on the pool)."""
    view = memoryview(np.ascontiguousarray(a)).cast("B")
    return a.dtype.str, a.size, crc32(view), crc32c(view)


def same_bits(u: np.ndarray, ref: np.ndarray) -> bool:
    """Whether ``u`` is ``ref`` bit for bit (NaN payloads and signed zeros included)."""
    bits = f"u{u.dtype.itemsize}"
    return u.shape == ref.shape and u.dtype == ref.dtype \
        and np.array_equal(u.view(bits), ref.view(bits))


class Parked:
    """A reference out of memory: its fingerprint, that of the state its last (zero)
    delta was coded from, and how to fetch the reference back."""

    __slots__ = ("print", "seen", "fetch", "name")

    def __init__(self, ref: np.ndarray, seen: tuple, fetch: Callable[[], np.ndarray],
                 name: str):
        """``seen``: the fingerprint of the state the zero delta came from, in its own
        dtype (the same bits as the reference's widened, but where a zero changed sign).
        ``fetch()``: the reference again (flat, the working dtype); it raises what
        reading the files raises. ``name``: the tensor, for messages."""
        self.print, self.seen, self.fetch, self.name = fingerprint(ref), seen, fetch, name

    def matches(self, a: np.ndarray) -> bool:
        """Whether ``a`` has the bits of the state last coded (so its delta is zero), both
        in the tensor's own dtype: widening to the working one keeps bits apart."""
        return fingerprint(a) == self.seen

    def get(self) -> np.ndarray | None:
        """The fetched reference, or None if it does not have the parked one's bits."""
        ref = self.fetch()
        return ref if ref is not None and fingerprint(ref) == self.print else None
