"""Real training trajectories for benchmarks.

Compression ratios of delta checkpoints depend on how weights actually move
during training, so benchmarks use real optimizer steps rather than random
noise. The data is scikit-learn's bundled 8x8 digits set: no download, and a
small CNN learns it in a few seconds on a laptop CPU. ``WideMLP`` exists only to
get a ~20M-element delta with the same data.
"""

from __future__ import annotations

import copy
import functools
import sys
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

import numpy as np
import torch
from torch import nn
from torch.nn import functional as F

from ..errors import InvalidArgumentError

# The split is fixed independently of the training seed, so accuracies of
# different seeds are measured on the same held-out images.
_SPLIT_SEED = 0
_TEST_FRACTION = 0.25
_DEFAULT_LR = {("cnn", "sgd"): 0.05, ("mlp", "sgd"): 0.01, ("cnn", "adam"): 1e-3, ("mlp", "adam"): 1e-3}


def _bench_import_error(name: str) -> ImportError:
    return ImportError(
        f"{name} is needed for lcckpt's benchmarks; install it with "
        "pip install 'lcckpt[bench]'"
    )


@functools.lru_cache(maxsize=1)
def _digits() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Standardized (x_train, y_train, x_test, y_test); x has shape (N, 1, 8, 8)."""
    try:
        from sklearn.datasets import load_digits
        from sklearn.model_selection import train_test_split
    except ImportError as exc:
        raise _bench_import_error("scikit-learn") from exc
    data = load_digits()
    x_tr, x_te, y_tr, y_te = train_test_split(
        data.data.astype(np.float32), data.target.astype(np.int64),
        test_size=_TEST_FRACTION, random_state=_SPLIT_SEED, stratify=data.target,
    )
    # Training-set statistics only; border pixels that are always 0 keep std 1.
    mean = x_tr.mean(axis=0)
    std = x_tr.std(axis=0)
    std[std == 0] = 1.0
    def prep(x: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(((x - mean) / std).reshape(-1, 1, 8, 8).astype(np.float32))
    return prep(x_tr), torch.from_numpy(y_tr), prep(x_te), torch.from_numpy(y_te)


class SmallCNN(nn.Module):
    """Two unpadded 3x3 convolutions and two linear layers (38,282 parameters)."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(1, 16, 3)
        self.conv2 = nn.Conv2d(16, 32, 3)
        self.fc1 = nn.Linear(32 * 4 * 4, 64)
        self.fc2 = nn.Linear(64, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.relu(self.conv1(x))
        x = F.relu(self.conv2(x))
        x = F.relu(self.fc1(torch.flatten(x, 1)))
        return self.fc2(x)


class WideMLP(nn.Module):
    """64 -> hidden -> hidden -> 10; hidden=4480 gives about 20.4M parameters."""

    def __init__(self, hidden: int = 4480) -> None:
        super().__init__()
        self.fc1 = nn.Linear(64, hidden)
        self.fc2 = nn.Linear(hidden, hidden)
        self.fc3 = nn.Linear(hidden, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.relu(self.fc1(torch.flatten(x, 1)))
        x = F.relu(self.fc2(x))
        return self.fc3(x)


_MODELS: dict[str, Callable[[], nn.Module]] = {"cnn": SmallCNN, "mlp": WideMLP}


@dataclass
class Trajectory:
    """Snapshots of one training run plus what is needed to evaluate them.

    ``snapshots`` is a list of ``(step, {"model": state_dict, "optim": state_dict})``
    with every tensor an independent copy, so later training cannot change them.
    """

    snapshots: list[tuple[int, dict[str, Any]]]
    model_name: str
    optimizer_name: str
    make_model: Callable[[], nn.Module]
    _x_test: torch.Tensor = field(repr=False)
    _y_test: torch.Tensor = field(repr=False)

    def _logits(self, model_state_dict: Mapping[str, torch.Tensor]) -> torch.Tensor:
        model = self.make_model()
        model.load_state_dict(model_state_dict)
        model.eval()
        with torch.no_grad():
            return model(self._x_test)

    def accuracy(self, model_state_dict: Mapping[str, torch.Tensor]) -> float:
        """Fraction of held-out digits classified correctly."""
        logits = self._logits(model_state_dict)
        return float((logits.argmax(1) == self._y_test).float().mean())

    def loss(self, model_state_dict: Mapping[str, torch.Tensor]) -> float:
        """Mean cross-entropy on the held-out digits."""
        return float(F.cross_entropy(self._logits(model_state_dict), self._y_test))


def _snapshot(model: nn.Module, opt: torch.optim.Optimizer) -> dict[str, Any]:
    return {
        "model": {k: v.detach().clone() for k, v in model.state_dict().items()},
        # state_dict() hands out the live buffers; deepcopy clones the tensors.
        "optim": copy.deepcopy(opt.state_dict()),
    }


def train_trajectory(
    model: str = "cnn",
    optimizer: str = "sgd",
    steps: int = 200,
    snapshot_every: int = 10,
    batch_size: int = 64,
    lr: float | None = None,
    seed: int = 0,
    progress: bool = False,
) -> Trajectory:
    """Train ``model`` ("cnn" or "mlp") on digits and snapshot it along the way.

    Snapshots are taken at step 0 and after every ``snapshot_every`` steps.
    SGD uses momentum 0.9 (lr 0.05 for the CNN, 0.01 for the MLP); Adam uses
    lr 1e-3. Minibatches come from a seeded generator, so the same ``seed``
    gives bit-identical snapshots on the same machine and thread count.
    """
    if model not in _MODELS:
        raise InvalidArgumentError(f"model must be 'cnn' or 'mlp', got {model!r}")
    if optimizer not in ("sgd", "adam"):
        raise InvalidArgumentError(f"optimizer must be 'sgd' or 'adam', got {optimizer!r}")
    if steps < 0 or snapshot_every < 1 or batch_size < 1:
        raise InvalidArgumentError(
            f"need steps >= 0, snapshot_every >= 1, batch_size >= 1; got "
            f"{steps}, {snapshot_every}, {batch_size}"
        )
    x_train, y_train, x_test, y_test = _digits()
    make_model = _MODELS[model]
    lr = _DEFAULT_LR[(model, optimizer)] if lr is None else lr

    torch.manual_seed(seed)
    net = make_model()
    if optimizer == "sgd":
        opt: torch.optim.Optimizer = torch.optim.SGD(net.parameters(), lr=lr, momentum=0.9)
    else:
        opt = torch.optim.Adam(net.parameters(), lr=lr)
    gen = torch.Generator().manual_seed(seed)

    snapshots = [(0, _snapshot(net, opt))]
    order = torch.empty(0, dtype=torch.long)
    net.train()
    for step in _progress(range(1, steps + 1), progress, f"{model}/{optimizer}"):
        if len(order) < batch_size:  # reshuffle per epoch; drop the ragged tail
            order = torch.randperm(len(x_train), generator=gen)
        idx, order = order[:batch_size], order[batch_size:]
        opt.zero_grad(set_to_none=True)
        F.cross_entropy(net(x_train[idx]), y_train[idx]).backward()
        opt.step()
        if step % snapshot_every == 0:
            snapshots.append((step, _snapshot(net, opt)))
    return Trajectory(snapshots, model, optimizer, make_model, x_test, y_test)


def _progress(it: range, enabled: bool, desc: str):
    """A tqdm bar on stderr, but only for a person watching a terminal."""
    if not (enabled and sys.stderr.isatty()):
        return it
    try:
        from tqdm import tqdm
    except ImportError as exc:
        raise _bench_import_error("tqdm") from exc
    return tqdm(it, desc=desc, file=sys.stderr, leave=False)


def flat_float_params(
    state: Mapping[str, Any], *, include_optim: bool = False
) -> dict[str, np.ndarray]:
    """Floating tensors of a snapshot as float32 arrays, keyed by name.

    ``state`` is a snapshot (``{"model": ..., "optim": ...}``) or a bare model
    state_dict. Model tensors keep their state_dict names. With
    ``include_optim``, per-parameter optimizer buffers (``momentum_buffer``,
    ``exp_avg``, ``exp_avg_sq``) are added as ``"optim.state.<id>.<key>"``;
    the scalar ``step`` counter is skipped since it is not a weight-like array.
    Arrays are copies, so benchmarks may modify them freely.
    """
    is_snapshot = isinstance(state.get("model"), Mapping)
    model_sd = state["model"] if is_snapshot else state
    out = {name: _f32(t) for name, t in model_sd.items() if _is_float(t)}
    if include_optim:
        if not is_snapshot:
            raise InvalidArgumentError("include_optim needs a snapshot with an 'optim' entry")
        for pid, buffers in state["optim"].get("state", {}).items():
            for key, t in buffers.items():
                if key != "step" and _is_float(t) and t.dim() > 0:
                    out[f"optim.state.{pid}.{key}"] = _f32(t)
    return out


def _is_float(t: Any) -> bool:
    return isinstance(t, torch.Tensor) and t.is_floating_point()


def _f32(t: torch.Tensor) -> np.ndarray:
    return t.detach().to(device="cpu", dtype=torch.float32, copy=True).numpy()


def digits_data() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The standardized digits split every trajectory trains and evaluates on:
    ``(x_train, y_train, x_test, y_test)``, x of shape (N, 1, 8, 8)."""
    return _digits()


def train_with_restores(steps: int, seed: int, optimizer: str, interrupt_at=(), *,
                        save, restore, save_every: int = 10, batch_size: int = 64) -> float:
    """Train the digits CNN, calling ``save(step, {"model", "optim"})`` every
    ``save_every`` steps; after each step in ``interrupt_at`` model and optimizer are
    rebuilt from ``restore()`` and training goes on with the same minibatches. Returns
    the final held-out accuracy (the resume experiment of lcckpt/bench/quality.py)."""
    x_tr, y_tr, x_te, y_te = _digits()
    lr = _DEFAULT_LR[("cnn", optimizer)]
    torch.manual_seed(seed)
    net = SmallCNN()

    def make_opt(params):
        if optimizer == "sgd":
            return torch.optim.SGD(params, lr=lr, momentum=0.9)
        return torch.optim.Adam(params, lr=lr)

    opt = make_opt(net.parameters())
    gen = torch.Generator().manual_seed(seed)
    order = torch.empty(0, dtype=torch.long)
    for step in range(1, steps + 1):
        if len(order) < batch_size:
            order = torch.randperm(len(x_tr), generator=gen)
        idx, order = order[:batch_size], order[batch_size:]
        net.train()
        opt.zero_grad(set_to_none=True)
        F.cross_entropy(net(x_tr[idx]), y_tr[idx]).backward()
        opt.step()
        if step % save_every == 0:
            save(step, {"model": net.state_dict(), "optim": opt.state_dict()})
        if step in interrupt_at:
            state = restore()
            net = SmallCNN()
            net.load_state_dict(state["model"])
            opt = make_opt(net.parameters())
            opt.load_state_dict(state["optim"])
    net.eval()
    with torch.no_grad():
        return float((net(x_te).argmax(1) == y_te).float().mean())
