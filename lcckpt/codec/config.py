"""Codec settings: one frozen, self-validating object instead of loose arguments.

``CodecConfig`` is what ``lcckpt.encode`` and ``DeltaEncoder`` are configured with; it
validates once, at construction, and round-trips through plain JSON
(:meth:`to_dict`/:meth:`from_dict`) so it can be stored in file metadata or serve as a
numcodecs codec config. It says nothing of files or chains.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, fields

import numpy as np

from . import entropy
from ..errors import InvalidArgumentError

DEFAULT_CHUNK_LOG2 = 18          # 256 Ki elements: L2-sized symbol chunks, many per thread
MIN_CHUNK_LOG2, MAX_CHUNK_LOG2 = 10, 24
CODERS = ("auto", "huffman", "grouped", "runs")


@dataclass(frozen=True)
class CodecConfig:
    """How one array is coded.

    ``bits`` (1-4): LC-Checkpoint's ``2**bits - 1`` exponent buckets. ``coder``:
    "huffman" (the paper's per-element code), "grouped", "runs" or "auto" (fewest bytes
    per chunk). ``error_bound``: the relative L2 error allowed; more bits are tried (up
    to 4), then an exact blob. ``midpoint``: bucket midpoints instead of means.
    ``chunk_size``: elements per independently coded chunk (a power of two in
    [2**10, 2**24]; None: 2**18). ``lossless``: code exactly (any dtype); the lossy
    settings are then unused.

    ``target``: instead of the exponent buckets, the error-bounded uniform quantizer,
    holding the *restored* tensor to ``||u - ũ||₂ <= target·||u||₂`` (per tensor, L2,
    relative to the tensor's own norm; ``0`` stores every change exactly); None
    (default): LC-Checkpoint. :attr:`scheme` says which of the three codecs a config
    selects; a setting that codec does not use (``bits``, ``error_bound``, ``midpoint``
    beside ``target`` or ``lossless``) raises :class:`InvalidArgumentError`.
    """

    bits: int = 2
    coder: str = "auto"
    error_bound: float | None = None
    midpoint: bool = False
    chunk_size: int | None = None
    lossless: bool = False
    target: float | None = None

    def __post_init__(self):
        check_bits(self.bits)
        if not isinstance(self.coder, str) or self.coder not in CODERS:
            raise InvalidArgumentError(
                f"unknown coder {self.coder!r}; choose one of {', '.join(map(repr, CODERS))}")
        entropy.modes_for(self.coder, self.bits)
        eb = self.error_bound
        if eb is not None and (isinstance(eb, bool) or not isinstance(eb, (int, float))
                               or not math.isfinite(eb) or eb < 0):
            raise InvalidArgumentError(
                f"error_bound must be None or a finite number >= 0, got {eb!r}")
        t = self.target
        if t is not None and (isinstance(t, bool) or not isinstance(t, (int, float))
                              or not math.isfinite(t) or not 0 <= t < 1):
            raise InvalidArgumentError(
                f"target must be None or a relative error in [0, 1), got {t!r}")
        if not isinstance(self.midpoint, (bool, np.bool_)):
            raise InvalidArgumentError(f"midpoint must be a bool, got {self.midpoint!r}")
        if not isinstance(self.lossless, (bool, np.bool_)):
            raise InvalidArgumentError(f"lossless must be a bool, got {self.lossless!r}")
        chunk_log2(self.chunk_size)
        self._refuse_unused()

    def _refuse_unused(self) -> None:
        """One config, three codecs (:attr:`scheme`): a setting the chosen codec does not
        use is refused, not silently dropped."""
        scheme = self.scheme
        unused = []
        if scheme != "lc":
            unused += [f"bits={self.bits}"] if self.bits != 2 else []
            unused += [f"error_bound={self.error_bound}"] if self.error_bound is not None else []
            unused += ["midpoint=True"] if self.midpoint else []
        if scheme == "lossless" and self.target is not None:
            unused.append(f"target={self.target}")
        if unused:
            raise InvalidArgumentError(
                f"{', '.join(unused)} {'does' if len(unused) == 1 else 'do'} not apply to the "
                f"{scheme} codec ({'lossless=True' if scheme == 'lossless' else 'target='} "
                "selects it); drop "
                f"{'it' if len(unused) == 1 else 'them'}, or drop "
                f"{'lossless' if scheme == 'lossless' else 'target'} for LC-Checkpoint's buckets")

    @property
    def scheme(self) -> str:
        """Which codec the config selects: "lossless", "uniform" (``target``) or "lc"
        (LC-Checkpoint's exponent buckets)."""
        if self.lossless:
            return "lossless"
        return "uniform" if self.target is not None else "lc"

    @property
    def log2(self) -> int:
        """log2 of the chunk size."""
        return chunk_log2(self.chunk_size)

    def to_dict(self) -> dict:
        """Plain JSON: every field, by name (``target`` only when set, so the dicts of
        LC-Checkpoint configs read as before)."""
        d = asdict(self)
        if d["target"] is None:
            del d["target"]
        return d

    @classmethod
    def from_dict(cls, d: dict) -> CodecConfig:
        """The config :meth:`to_dict` gave; unknown keys are refused, missing ones default."""
        if not isinstance(d, dict):
            raise InvalidArgumentError(f"a codec config must be a dict, got {type(d).__name__}")
        known = {f.name for f in fields(cls)}
        extra = set(d) - known
        if extra:
            raise InvalidArgumentError(
                f"unknown codec settings {sorted(extra)}; known: {sorted(known)}")
        return cls(**d)


def check_bits(bits) -> None:
    if isinstance(bits, bool) or not isinstance(bits, (int, np.integer)) or not 1 <= bits <= 4:
        raise InvalidArgumentError(f"bits must be an integer from 1 to 4, got {bits!r}")


def chunk_log2(chunk_size: int | None) -> int:
    """log2 of a valid chunk size (None: the default)."""
    if chunk_size is None:
        return DEFAULT_CHUNK_LOG2
    c = chunk_size
    if isinstance(c, bool) or not isinstance(c, (int, np.integer)) or c <= 0 or c & (c - 1) \
            or not (1 << MIN_CHUNK_LOG2) <= c <= (1 << MAX_CHUNK_LOG2):
        raise InvalidArgumentError(
            f"chunk_size must be a power of two in [2**{MIN_CHUNK_LOG2}, 2**{MAX_CHUNK_LOG2}],"
            f" got {chunk_size}")
    return int(c).bit_length() - 1
