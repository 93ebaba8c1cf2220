"""What a CheckpointManager accepts: its arguments checked, with what is wrong, before
anything is built, and the LC-Checkpoint bit policy it offers."""

from __future__ import annotations

import math

import torch

from ..errors import InvalidArgumentError
from .capture import handler

POLICIES = ("young_daly", "convergence", "exploratory")
BACKPRESSURE = ("defer", "wait")


def default_bits(key: str) -> int:
    """4 bits for optimizer state, 2 for everything else.

    Adam's moments change by about their own size between checkpoints and 2 bits track
    them poorly (docs/chain.md); a manager exists to resume, so they get more.
    """
    return 4 if key.startswith('obj["optimizer"]') else 2


def check_arguments(model, policy, mtbf, every, total_steps, objects, extra, downtime,
                     restart_cost, profile_at, backpressure, background=True,
                     optimizer=None) -> None:
    """CheckpointManager's arguments, refused with what is wrong before anything is built."""
    if policy not in POLICIES:
        raise InvalidArgumentError(f"policy must be one of {POLICIES}, got {policy!r}")
    if backpressure not in BACKPRESSURE:
        raise InvalidArgumentError(f"backpressure must be one of {BACKPRESSURE}, got {backpressure!r}")
    overlap = type(background) is str and background == "overlap"
    if not (type(background) is bool or overlap):
        raise InvalidArgumentError(
            f"background must be True, False or 'overlap', got {background!r}")
    if overlap and optimizer is None:
        raise InvalidArgumentError(
            "background='overlap' needs the optimizer: its step() is what waits for the "
            "write from the live state")
    if every is not None and (type(every) is not int or every < 1):
        raise InvalidArgumentError(f"every must be a positive int or None, got {every!r}")
    if every is None:
        if mtbf is None:
            raise InvalidArgumentError(
                "give mtbf (mean seconds between failures of the whole job) so the manager "
                "can plan, or every=N for a fixed interval")
        if not (isinstance(mtbf, (int, float)) and mtbf > 0):
            raise InvalidArgumentError(f"mtbf must be a positive number of seconds, got {mtbf!r}")
    for name, v in (("downtime", downtime), ("restart_cost", restart_cost)):
        if v is not None and not (isinstance(v, (int, float)) and math.isfinite(v) and v >= 0):
            raise InvalidArgumentError(f"{name} must be a finite number >= 0, got {v!r}")
    if total_steps is not None and (type(total_steps) is not int or total_steps < 1):
        raise InvalidArgumentError(f"total_steps must be a positive int or None, got {total_steps!r}")
    if type(profile_at) is not int or profile_at < 1:
        raise InvalidArgumentError(f"profile_at must be a positive int, got {profile_at!r}")
    if not hasattr(model, "state_dict"):
        raise InvalidArgumentError(f"model must have state_dict(), got {type(model).__name__}")
    if isinstance(model, torch.optim.Optimizer) or isinstance(optimizer, torch.nn.Module):
        raise InvalidArgumentError(
            f"model is a {type(model).__name__} and optimizer a {type(optimizer).__name__}: "
            "give them in this order, CheckpointManager(directory, model, optimizer)")
    if optimizer is not None and hasattr(optimizer, "optimizer") and \
            not hasattr(optimizer, "param_groups"):      # an LR scheduler, which wraps one
        raise InvalidArgumentError(
            f"optimizer is a {type(optimizer).__name__}, which holds an optimizer: give the "
            "optimizer itself, and the scheduler as scheduler=...")
    if optimizer is not None and not (hasattr(optimizer, "state_dict")
                                      and hasattr(optimizer, "load_state_dict")):
        raise InvalidArgumentError(f"optimizer must have state_dict() and load_state_dict(), "
                                   f"got {type(optimizer).__name__}")
    for name, obj in dict(objects or {}).items():
        if not isinstance(name, str) or handler(obj) is None:
            raise InvalidArgumentError(
                f"objects[{name!r}] must be keyed by a str and have state_dict() and "
                "load_state_dict() (or be a torch.Generator / numpy.random.Generator); "
                f"got {type(obj).__name__}")
    if extra is not None and not isinstance(extra, dict):
        raise InvalidArgumentError(f"extra must be a dict, got {type(extra).__name__}")
