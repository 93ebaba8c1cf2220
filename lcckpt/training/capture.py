"""The state a manager saves and restores: model, optimizer, scheduler, scaler, named
objects, the user's ``extra`` values and the global random generators, as one tree."""

from __future__ import annotations

import re
from typing import Any, Mapping

import numpy as np
import torch

from . import rng as _rng
from ..errors import InvalidArgumentError


def handler(obj: Any):
    """(get_state, set_state) for a registered object, or None if it has neither protocol."""
    if isinstance(obj, torch.Generator):
        return obj.get_state, obj.set_state
    if isinstance(obj, np.random.Generator):
        def set_state(s, g=obj):
            g.bit_generator.state = s
        return (lambda g=obj: g.bit_generator.state), set_state
    if callable(getattr(obj, "state_dict", None)) and callable(getattr(obj, "load_state_dict", None)):
        return obj.state_dict, obj.load_state_dict
    return None


WRAPPER_PREFIXES = ("_orig_mod.", "module.")     # torch.compile's; (Distributed)DataParallel's


def unwrapped(model):
    """The module inside torch.compile's and (Distributed)DataParallel's wrappers. Its
    state dict has the model's own keys (``0.weight``, not ``_orig_mod.0.weight`` or
    ``module.0.weight``), so a checkpoint restores into the model however either run
    wrapped it (compiled to train, plain to evaluate; under DDP, then on one device)."""
    while True:
        if type(model).__name__ == "OptimizedModule" \
                and isinstance(getattr(model, "_orig_mod", None), torch.nn.Module):
            model = model._orig_mod
        elif isinstance(model, (torch.nn.DataParallel,
                                torch.nn.parallel.DistributedDataParallel)):
            model = model.module
        else:
            return model


_COMPILED = re.compile(r"(?:^|(?<=\.))_orig_mod\.")     # a compiled submodule's segment


def canonical(state: dict) -> dict:
    """A model's state dict without the ``_orig_mod.`` segments of submodules compiled
    on their own (``encoder._orig_mod.0.weight`` -> ``encoder.0.weight``, as torch's
    ``get_model_state_dict`` names them); ``state`` itself where there are none."""
    if not any(isinstance(k, str) and "_orig_mod." in k for k in state):
        return state
    return {_COMPILED.sub("", k) if isinstance(k, str) else k: v for k, v in state.items()}


def own_keys(part: dict, model) -> dict:
    """``part`` (a model's saved state dict) under the model's own keys: without the
    wrapper prefixes that every one of its keys has and the model's keys lack (a
    checkpoint written before the manager unwrapped its model), and with ``_orig_mod.``
    segments where the model has compiled submodules and the checkpoint does not."""
    own = model.state_dict().keys()
    while part and (prefix := next((p for p in WRAPPER_PREFIXES if all(
            isinstance(k, str) and k.startswith(p) for k in part)
            and not any(k.startswith(p) for k in own)), None)):
        part = {k[len(prefix):]: v for k, v in part.items()}
    part = canonical(part)
    back = {_COMPILED.sub("", k): k for k in own if "_orig_mod." in k}
    return {back.get(k, k): v for k, v in part.items()} if back else part


class Capture:
    """What one manager saves: ``collect()`` builds the tree, ``apply()`` loads one back."""

    def __init__(self, model, optimizer=None, scheduler=None, scaler=None,
                 objects: Mapping[str, Any] | None = None, extra: dict | None = None):
        self.model, self.optimizer = model, optimizer
        self.scheduler, self.scaler = scheduler, scaler
        self.objects = dict(objects or {})
        self.extra: dict = extra if extra is not None else {}
        self.rank_generators: dict | None = None   # every rank's, for the next collect()

    @property
    def model(self):
        """The model, unwrapped (:func:`unwrapped`) when it is given."""
        return self._model

    @model.setter
    def model(self, model) -> None:
        self._model = None if model is None else unwrapped(model)

    def _parts(self):
        return [("model", self.model), ("optimizer", self.optimizer),
                ("scheduler", self.scheduler), ("scaler", self.scaler)]

    def targets(self) -> dict:
        """Where a restore may decode in place: the model's own host tensors (its state
        dict shares their memory; the optimizer's state is replaced when loaded, not
        filled). Its tensors on a GPU are left to ``load_state_dict``, which copies each
        up once from the host tensor the restore decoded (filled as a target too, it
        would be copied up twice)."""
        if self.model is None:
            return {}
        return {"model": canonical({k: v for k, v in self.model.state_dict().items()
                                    if not (isinstance(v, torch.Tensor)
                                            and v.device.type != "cpu")})}

    def collect(self, manager_state: dict) -> dict:
        tree: dict[str, Any] = {"manager": manager_state}
        for key, obj in self._parts():
            if obj is not None:
                tree[key] = canonical(obj.state_dict()) if key == "model" else obj.state_dict()
        if self.objects:
            tree["objects"] = {name: handler(obj)[0]() for name, obj in self.objects.items()}
        tree["extra"] = self.extra
        tree["rng"] = _rng.capture()
        if self.rank_generators is not None:
            tree["rng_ranks"] = self.rank_generators
        return tree

    def apply(self, state: dict, where: str, rng: bool | int = True) -> dict:
        """Load ``state`` into every registered object (``where`` names the checkpoint in
        errors) and, with ``rng`` True, the global generators; returns its manager
        section. ``rng`` a global rank: that rank's generators where the checkpoint holds
        every rank's (a SIGTERM's under DDP), else none. Nothing is loaded if any part is
        missing."""
        for key, obj in self._parts():
            if obj is not None and key not in state:
                if "manager" not in state:      # a DeltaCheckpointer's own chain, say
                    raise InvalidArgumentError(
                        f"{where} holds no {key!r} state, and no CheckpointManager wrote it "
                        f"(its keys: {sorted(map(str, state))}): give the manager a directory "
                        "of its own, or read this one with lcckpt.DeltaCheckpointer")
                raise InvalidArgumentError(
                    f"{where} holds no {key!r} state; it was written by a manager without "
                    "one: create the manager with the same objects")
        missing = set(self.objects) - set(state.get("objects", {}))
        if missing:
            raise InvalidArgumentError(
                f"{where} holds no state for objects {sorted(missing)}; it holds "
                f"{sorted(state.get('objects', {}))}")
        for key, obj in self._parts():
            if obj is not None:
                try:
                    obj.load_state_dict(own_keys(state[key], obj) if key == "model"
                                        else state[key])
                except (RuntimeError, ValueError, KeyError) as e:    # torch's own wording
                    raise InvalidArgumentError(
                        f"{where} does not fit this {key}: {e} -- restore into a {key} "
                        "built as the one that wrote it, or use another directory") from e
        for name, obj in self.objects.items():
            handler(obj)[1](state["objects"][name])
        self.extra.clear()
        self.extra.update(state.get("extra", {}))
        if rng is True:
            _rng.restore(state.get("rng", {}))
        elif rng is not False and str(rng) in state.get("rng_ranks", {}):
            _rng.restore(state["rng_ranks"][str(rng)])
        return state.get("manager", {})


def delegated(name: str) -> property:
    """A property of the manager that reads and sets its :class:`Capture`'s ``name``."""
    return property(lambda self: getattr(self._capture, name),
                    lambda self, value: setattr(self._capture, name, value),
                    doc=f"The registered {name} (saved and restored with every checkpoint).")
