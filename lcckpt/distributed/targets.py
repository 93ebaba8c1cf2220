"""Which delta encoder a distributed chain gives each piece, and which direction it steers.

A distributed chain codes its floating pieces as :class:`lcckpt.DeltaCheckpointer` does:
by default each restored piece is held to a share of its movement by role
(:class:`lcckpt.RolePolicy`: weights 0.007, first moments 0.8, second moments 0.1, or 0.05
of the update sent), and a weight's error is steered orthogonal to its optimizer's first
moment. ``bits=1..4`` keeps LC-Checkpoint's coding instead, whose restores lose accuracy
(docs/chain.md). Pieces are named by ``torch.distributed.checkpoint``'s dotted names of the
flattened state (``model.fc.weight``, ``optim.state.0.exp_avg``); a role is read from the
last name, as a key path's.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import torch
from torch.distributed.checkpoint._nested_dict import unflatten_state_dict

from ..chain.moments import first_moments
from ..chain.policy import DEFAULT_POLICY, RolePolicy, low_precision_target, role_of
from ..codec.delta import DeltaEncoder
from ..errors import InvalidArgumentError
from .partition import Piece

__all__ = ["FLOATS", "MIN_ELEMENTS", "chained", "check", "direction_of", "direction_view",
           "directions", "dtype_name", "fqn", "new_encoder", "role_path", "starts_at_zero"]

MIN_ELEMENTS = 8     # smaller floating pieces (step counts) are stored exactly, every save
FLOATS = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
_NAMES = {str(t): n for t, n in zip(FLOATS, ("F16", "BF16", "F32", "F64"))}


def dtype_name(info) -> str | None:
    """The codec's name of a stored item's dtype (a merged keyframe holds it widened)."""
    return _NAMES.get(info.dtype)


def chained(info) -> str | None:
    """:func:`dtype_name` of a stored item a chain tracks (a delta, or a floating keyframe
    of :data:`MIN_ELEMENTS` or more)."""
    tracked = info.codec == "delta" or (info.codec == "exact" and info.piece is not None
                                        and math.prod(info.shape) >= MIN_ELEMENTS)
    return dtype_name(info) if tracked else None


def check(bits, target):
    """The writer's target: ``DEFAULT_POLICY`` when neither ``bits`` nor ``target`` is
    given, None in LC mode (``bits``), else ``target`` checked."""
    if bits is not None and target is not None:
        raise InvalidArgumentError("give bits (LC-Checkpoint's coding) or target (the uniform "
                                   "quantizer's restored-state bound), not both")
    if bits is not None:
        if bits not in (1, 2, 3, 4):
            raise InvalidArgumentError(f"bits must be None or 1..4, got {bits!r}")
        return None
    if target is None or isinstance(target, RolePolicy):
        return DEFAULT_POLICY if target is None else target
    if isinstance(target, bool) or not isinstance(target, (int, float)) \
            or not math.isfinite(target) or not 0 <= target < 1:
        raise InvalidArgumentError(
            f"target must be a RolePolicy or a share of the tensor's norm in [0, 1), got {target!r}")
    return float(target)


def role_path(name: str) -> str:
    """A piece's dotted name as the key path a :class:`RolePolicy` reads (its role: the
    last name); a shard's ``@offsets`` (``planner.item_key``) left out."""
    return "obj" + "".join(f'["{p}"]' for p in fqn(name).split("."))


def fqn(name: str) -> str:
    """The tensor a piece belongs to: its name without a shard's ``@offsets``."""
    return name.split("@", 1)[0]


def starts_at_zero(name: str) -> bool:
    """Whether a piece new to a chain under way is coded as a delta from zero: an
    optimizer moment, whose movement since training began is its value. A weight new
    to a chain (moved rank, resized) is written exactly, as a keyframe."""
    return role_of(role_path(name)) != "weight"


def new_encoder(bits, target, name: str) -> DeltaEncoder:
    """The encoder of a new chain of piece ``name`` (its first blob a keyframe)."""
    if target is None:
        return DeltaEncoder(bits=bits)
    if isinstance(target, RolePolicy):
        return DeltaEncoder(target=target(role_path(name)), relative_to=target.relative_to,
                            update_share=target.update,
                            low_precision_target=low_precision_target(target, role_path(name)))
    return DeltaEncoder(target=target)       # a share of the norm, as DeltaCheckpointer's


def directions(planner) -> dict[str, torch.Tensor]:
    """``{dotted name of a weight: its first moment}`` in the state a DCP save planner
    holds (flattened, with its mappings), or {} where it holds none to pair."""
    state = getattr(planner, "state_dict", None)
    if not isinstance(state, Mapping):
        return {}
    mappings = getattr(planner, "mappings", None)
    try:
        nested = unflatten_state_dict(state, mappings) if mappings else state
    except (KeyError, TypeError, ValueError):
        return {}
    return first_moments(nested, dotted=True)


def direction_of(dirs: dict, piece: Piece, data: torch.Tensor) -> torch.Tensor | None:
    """The part of piece's first moment that lies where ``data`` (the piece's values) does:
    a sharded moment's local shard, a row range's rows; None where nothing fits."""
    m = direction_view(dirs, piece, data)
    return None if m is None else m.detach().cpu()


def direction_view(dirs: dict, piece: Piece, data) -> torch.Tensor | None:
    """:func:`direction_of` as a view of the moment, where it is (no copy)."""
    m = dirs.get(fqn(piece.key))
    if m is None:
        return None
    if hasattr(m, "to_local"):                  # a DTensor: sharded like its weight
        m = m.to_local()
    if m.shape != data.shape and m.dim() and 0 <= piece.start < piece.stop <= m.shape[0]:
        m = m.narrow(0, piece.start, piece.stop - piece.start)
    return m if m.shape == data.shape else None
