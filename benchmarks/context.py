"""How much a weight delta's symbols could shrink if coded by row and column scale (a
measurement; nothing here codes).

A weight delta is far from uniform across a matrix: a unit that was rarely active moves
little along its whole row, an input feature along its whole column, so ``|d[i, j]|``
follows ``r[i]·c[j]``, the row's and the column's RMS. The library codes a tensor's
quantized symbols with one code per stream (order 0). A coder that first sends each row's
and each column's scale class (3 bits each) could pick the code of each element by the
class of ``r[i]·c[j]`` (16 classes).

For the large weight tensors of a real run (the quality benchmark's trajectories), each
delta between consecutive checkpoints is quantized uniformly with the step that gives
``--bits`` bits per element of order-0 entropy (the default codes these tensors at about
2-3), and its symbols' code length is counted with an adaptive coder's model
(Krichevsky-Trofimov counts, so no table is sent and nothing is fitted after the fact):
once with one model for the tensor, once with a model per scale class plus the classes'
3 bits per row and per column. Printed: the median over checkpoints of the second over
the first, per tensor.

    python benchmarks/context.py [--workloads cnn-sgd cnn-adam minilm-finetune]
                                 [--bits 2.4] [--minilm-steps 30]
"""

from __future__ import annotations

import argparse
from math import lgamma, log

import numpy as np

from lcckpt.bench.quality import WORKLOADS, make_trajectory


def kt_bits(sym: np.ndarray) -> float:
    """Bits an adaptive Krichevsky-Trofimov model codes ``sym`` in, over its distinct
    letters (whose list the classes' headers would carry: 8 bits each)."""
    if sym.size == 0:
        return 0.0
    _, counts = np.unique(sym, return_counts=True)
    k = counts.size
    # log2 of n!·Γ(k/2) / (Γ(n + k/2)·Π Γ(c + 1/2)/Γ(1/2)): the sequential KT probability.
    ln = (lgamma(sym.size + k / 2) - lgamma(k / 2)
          - sum(lgamma(c + 0.5) - lgamma(0.5) for c in counts.tolist()))
    return ln / log(2) + 8 * k


def _classes(v: np.ndarray, n: int) -> np.ndarray:
    lv = np.log2(np.maximum(v, 1e-30))
    return np.searchsorted(np.quantile(lv, np.linspace(0, 1, n + 1)[1:-1]), lv)


def _symbols(d: np.ndarray, bits: float) -> np.ndarray:
    """``round(d / q)`` with the step ``q`` whose order-0 entropy is ``bits`` per element."""
    def entropy(q):
        s = np.round(d / q).astype(np.int64).ravel()
        c = np.bincount(s - s.min())
        p = c[c > 0] / s.size
        return -(p * np.log2(p)).sum()
    lo, hi = 1e-12 * np.abs(d).max() + 1e-30, 4 * np.abs(d).max() + 1e-30
    for _ in range(50):
        q = np.sqrt(lo * hi)
        lo, hi = (q, hi) if entropy(q) > bits else (lo, q)
    return np.round(d / hi).astype(np.int64)


def by_scale(d: np.ndarray, bits: float) -> float:
    """Code length by scale class over order-0 code length, for one matrix delta."""
    d = d.reshape(d.shape[0], -1).astype(np.float64)
    s = _symbols(d, bits)
    r, c = np.sqrt((d ** 2).mean(1)), np.sqrt((d ** 2).mean(0))
    ctx = _classes(np.outer(r, c).ravel(), 16)
    flat = s.ravel()
    ctx_bits = sum(kt_bits(flat[ctx == k]) for k in np.unique(ctx)) + 3 * sum(d.shape)
    return ctx_bits / kt_bits(flat)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workloads", nargs="+", default=["cnn-sgd", "cnn-adam"],
                    choices=WORKLOADS)
    ap.add_argument("--bits", type=float, default=2.4)
    ap.add_argument("--minilm-steps", type=int, default=30)
    ap.add_argument("--min-size", type=int, default=4096, help="skip smaller tensors")
    args = ap.parse_args(argv)
    for w in args.workloads:
        traj = make_trajectory(w, args.minilm_steps)
        snaps = [s["model"] for _, s in traj.snapshots]
        names = [k for k, v in snaps[0].items()
                 if v.dim() >= 2 and v.numel() >= args.min_size and v.is_floating_point()]
        ratios = {k: [] for k in names}
        for a, b in zip(snaps, snaps[1:]):
            for k in names:
                d = (b[k] - a[k]).float().numpy()
                if np.any(d):
                    ratios[k].append(by_scale(d, args.bits))
        med = {k: float(np.median(v)) for k, v in ratios.items() if v}
        weights = {k: snaps[0][k].numel() for k in med}
        mean = sum(med[k] * weights[k] for k in med) / sum(weights.values())
        print(f"{w}: {len(snaps) - 1} deltas at {args.bits} bits/element; code length by "
              f"scale class / order 0, median per tensor (elements-weighted mean {mean:.3f})")
        for k in sorted(med, key=lambda k: -weights[k]):
            print(f"  {k:55s} {str(tuple(snaps[0][k].shape)):14s} {med[k]:.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
