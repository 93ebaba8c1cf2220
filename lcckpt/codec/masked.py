"""A delta of a tensor that holds NaN or Inf by design: the same values at the same
places as its reference (an attention mask of -inf, a bias whose masked entries stay
-inf while the rest is trained).

No quantizer can code ``u - ref`` there (``-inf - -inf`` is NaN): stored exactly, such a
tensor would cost its whole size at every save, with a warning meant for a diverged step.
Here the delta is coded with those places set to zero in both ``u`` and the reference:
the decoder adds zero to them (``-inf + 0`` is ``-inf``, a quiet NaN stays that NaN), so
its restored tensor keeps them, and the encoder puts them back into its own reference,
bit for bit what the decoder holds. A tensor whose NaN/Inf moved, appeared or changed is not
handled here: it is stored exactly, as a diverged step is; so is one holding a signalling
NaN, which adding zero would make quiet (another bit pattern).
"""

from __future__ import annotations

import numpy as np

from .parked import same_bits
from .tensor import guarded_encode

__all__ = ["masked_delta"]


def masked_delta(enc, a: np.ndarray, dt, u: np.ndarray, ref: np.ndarray | None, exact):
    """``(pieces, stats)`` of the delta from ``ref`` to ``u`` for the encoder ``enc`` (a
    :class:`~lcckpt.codec.delta.DeltaEncoder`; its reference then advances), or None
    where ``u``'s NaN/Inf are not its reference's, at the same places with the same bits.
    ``a``: the state in its own dtype ``dt``; ``u``, ``ref``: flat, the working dtype."""
    if ref is None or ref.shape != u.shape or ref.dtype != u.dtype:
        return None
    bad = ~np.isfinite(u)
    if not np.array_equal(bad, ~np.isfinite(ref)) or not same_bits(u[bad], ref[bad]):
        return None
    kept = ref[bad]
    with np.errstate(invalid="ignore"):     # a signalling NaN raises the flag as it quiets
        if not same_bits(kept, kept + kept.dtype.type(0)):
            return None
    u0, r0 = np.where(bad, 0, u).astype(u.dtype), np.where(bad, 0, ref).astype(u.dtype)
    cfg = enc._config_for(u0, dt)       # the movement of the finite part
    parts, st, lossy = guarded_encode(u0, r0, dt, a.shape, cfg, exact, cache=enc.cache,
                                      advance=True)
    if lossy:
        r0[bad] = kept                  # r0 advanced to the decoder's restore of u0
        enc._set_ref(r0)
        if enc.movement is not None:
            enc.movement.at_base = False
    else:                               # the exact blob of the state itself
        enc._set_ref(u)
    return parts, st
