"""An ExCP-style baseline (Li et al., "ExCP: Extreme LLM Checkpoint Compression via
Weight-Momentum Joint Shrinking", ICML 2024), implemented from the paper for the quality
benchmark.

Per checkpoint and per parameter tensor with Adam state:

1. the weight residual against the previous checkpoint as restored, ``Δ = W_t - Ŵ_{t-1}``;
2. weight-momentum joint shrinking: ``Δ`` keeps the elements with
   ``|Δ| > median(|Δ|) · min(2.5, α / sqrt(mean(v)))`` (``v`` Adam's second moment), and
   both moments keep the elements with ``|m| > β · mean(|m|)`` where ``Δ`` was kept; the
   rest become 0;
3. non-uniform quantization: the kept values of each tensor are clustered into
   ``2**bits - 1`` centres (1-D k-means), stored as ``bits``-bit indices (0 = pruned) and
   an fp16 codebook; the indices of a checkpoint are then compressed together (LZMA, as
   the paper's 7-Zip).

Tensors without Adam state (buffers, scalars) are stored exactly. A checkpoint's size is
the LZMA stream of its indices plus codebooks and exact tensors; the first checkpoint is
stored exactly, as a chain's keyframe. Timing is not measured.
"""

from __future__ import annotations

import lzma

import numpy as np
import torch


FIT_POINTS_PER_CENTRE = 256     # as faiss' k-means, which ExCP uses: a sample fits them


def kmeans_1d(x: np.ndarray, k: int, iters: int = 12) -> np.ndarray:
    """Centres of ``x`` (1-D) for ``k`` clusters: quantile start, Lloyd iterations, on a
    seeded sample of at most ``256·k`` values (faiss' default, which ExCP's code uses)."""
    if x.size > FIT_POINTS_PER_CENTRE * k:
        x = np.random.default_rng(0).choice(x, FIT_POINTS_PER_CENTRE * k, replace=False)
    x = np.sort(x.astype(np.float64))
    c = np.unique(np.quantile(x, (np.arange(k) + 0.5) / k))
    for _ in range(iters):
        cuts = (c[1:] + c[:-1]) / 2
        idx = np.searchsorted(cuts, x)
        sums = np.bincount(idx, weights=x, minlength=c.size)
        counts = np.bincount(idx, minlength=c.size)
        new = np.where(counts > 0, sums / np.maximum(counts, 1), c)
        if np.allclose(new, c):
            break
        c = np.unique(new)
    return c


def quantize(values: np.ndarray, bits: int) -> tuple[np.ndarray, np.ndarray]:
    """``(indices uint8, codebook fp16)``: 0 for zeros, ``1 + cluster`` for the rest."""
    idx = np.zeros(values.size, np.uint8)
    nz = values != 0
    if not nz.any():
        return idx, np.zeros(0, np.float16)
    book = kmeans_1d(values[nz], (1 << bits) - 1).astype(np.float16)
    b = book.astype(np.float64)
    cuts = (b[1:] + b[:-1]) / 2
    idx[nz] = 1 + np.searchsorted(cuts, values[nz].astype(np.float64))
    return idx, book


def dequantize(idx: np.ndarray, book: np.ndarray) -> np.ndarray:
    table = np.concatenate([[0.0], book.astype(np.float64)]).astype(np.float32)
    return table[idx]


def _pack(idx: np.ndarray, bits: int) -> bytes:
    per = 8 // bits
    pad = (-idx.size) % per
    a = np.concatenate([idx, np.zeros(pad, np.uint8)]).reshape(-1, per).astype(np.uint16)
    out = np.zeros(a.shape[0], np.uint16)
    for i in range(per):
        out = (out << bits) | a[:, i]
    return out.astype(np.uint8).tobytes()


class ExcpChain:
    """Compress a run's checkpoints ExCP's way; each call returns (restored state, bytes)."""

    def __init__(self, param_names: list, alpha: float, beta: float, bits: int = 4,
                 opt_bits: int = 4):
        """``param_names``: the model's ``named_parameters()`` names, in order (how
        Adam's state is matched to the weights)."""
        self.names = list(param_names)
        self.alpha, self.beta, self.bits, self.opt_bits = alpha, beta, bits, opt_bits
        self.prev: dict | None = None          # name -> restored weights (fp32)

    def save(self, state: dict) -> tuple[dict, int]:
        model, optim = state["model"], state["optim"]
        moments = _moments_by_param(model, optim, self.names)
        if self.prev is None:                  # the keyframe: stored exactly
            self.prev = {k: v.detach().float().clone() for k, v in model.items()}
            return state, sum(t.numel() * t.element_size()
                              for t in _tensors(state))
        new_model, new_states, streams, nbytes = {}, {}, [], 0
        for name, w in model.items():
            if name not in moments or not w.is_floating_point():
                new_model[name] = w.clone()
                frozen = w.is_floating_point() and torch.equal(w.float(), self.prev[name])
                if not frozen:              # a frozen weight's residual is zero: no bytes
                    nbytes += w.numel() * w.element_size()
                    self.prev[name] = w.detach().float().clone()
                continue
            idx_pid, m, v = moments[name]
            d = (w.float() - self.prev[name]).numpy().reshape(-1)
            vm = float(v.float().mean())
            scale = min(2.5, self.alpha / np.sqrt(vm)) if vm > 0 else 2.5
            keep = np.abs(d) > np.median(np.abs(d)) * scale
            d = np.where(keep, d, 0).astype(np.float32)
            mn = m.float().numpy().reshape(-1)
            okeep = (np.abs(mn) > self.beta * np.abs(mn).mean()) & keep
            parts = []
            for arr, bits in ((d, self.bits), (np.where(okeep, mn, 0), self.opt_bits),
                              (np.where(okeep, v.float().numpy().reshape(-1), 0), self.opt_bits)):
                idx, book = quantize(arr.astype(np.float32), bits)
                streams.append(_pack(idx, bits))
                nbytes += book.nbytes
                parts.append(dequantize(idx, book))
            restored = self.prev[name] + torch.from_numpy(parts[0]).view(w.shape)
            self.prev[name] = restored
            new_model[name] = restored.to(w.dtype)
            new_states[idx_pid] = (torch.from_numpy(parts[1]).view(w.shape).to(m.dtype),
                                   torch.from_numpy(parts[2]).view(w.shape).to(v.dtype))
        nbytes += len(lzma.compress(b"".join(streams), preset=6))
        new_optim = _replace_moments(optim, new_states)
        nbytes += sum(t.numel() * t.element_size() for pid, s in optim["state"].items()
                      for k, t in s.items() if isinstance(t, torch.Tensor)
                      and k not in ("exp_avg", "exp_avg_sq"))
        return {"model": new_model, "optim": new_optim}, nbytes


def _tensors(obj):
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, dict):
        for v in obj.values():
            yield from _tensors(v)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            yield from _tensors(v)


def _moments_by_param(model: dict, optim: dict, names: list) -> dict:
    """model key -> (param id, exp_avg, exp_avg_sq): an optimizer's param ids follow
    ``model.parameters()``, whose names ``names`` lists in order."""
    ids = [p for g in optim["param_groups"] for p in g["params"]]
    out = {}
    for k, pid in zip(names, ids):
        s = optim["state"].get(pid)
        if s is not None and "exp_avg_sq" in s and s["exp_avg"].shape == model[k].shape:
            out[k] = (pid, s["exp_avg"], s["exp_avg_sq"])
    return out


def _replace_moments(optim: dict, new: dict) -> dict:
    state = {}
    for pid, s in optim["state"].items():
        s = dict(s)
        if pid in new:
            s["exp_avg"], s["exp_avg_sq"] = new[pid]
        state[pid] = s
    return {"state": state, "param_groups": optim["param_groups"]}
