"""How much a delta could shrink if it were predicted (a measurement; nothing here codes).

A delta stores ``u - ref``. Between two checkpoints an optimizer with momentum keeps moving
each weight much as it did before, so part of the next delta is already known to the
decoder: the previous delta, or for Adam the direction ``m / (sqrt(v) + eps)`` of the
moments in the restored state. Coding only the residual ``d - a·p`` (``a`` fitted per
tensor by least squares) would save, at a fixed error, about ``0.5·log2(var(d) /
var(d - a·p))`` bits per element at the uniform quantizer's rates (the high-rate
approximation: at a bit or two per element the saving is smaller).

For each large weight tensor of a real run (the quality benchmark's trajectories:
lcckpt/bench/quality.py), this prints the median over checkpoints of that figure for three
predictors: the previous delta, Adam's direction (the run's optimizer state at the previous
checkpoint; momentum for SGD), and both together.

    python benchmarks/predict.py [--workloads cnn-adam cnn-sgd minilm-finetune minilm-scratch]
                                 [--minilm-steps 30]
"""

from __future__ import annotations

import argparse

import numpy as np

from lcckpt.bench.quality import WORKLOADS, _param_names


def _trajectory(workload: str, minilm_steps: int):
    if workload.startswith("cnn-"):
        from lcckpt.bench.quality import make_trajectory
        return make_trajectory(workload).snapshots
    from lcckpt.bench.finetune import finetune_trajectory
    return finetune_trajectory(steps=minilm_steps, snapshot_every=3,
                               pretrained=workload == "minilm-finetune").snapshots


def _direction(state: dict) -> np.ndarray:
    if "exp_avg_sq" in state:
        return (state["exp_avg"] / (state["exp_avg_sq"].sqrt() + 1e-8)).double().numpy().ravel()
    return state["momentum_buffer"].double().numpy().ravel()


def _bits_saved(d: np.ndarray, basis: np.ndarray) -> float:
    coef, *_ = np.linalg.lstsq(basis, d, rcond=None)
    r = d - basis @ coef
    return 0.5 * float(np.log2((d @ d) / (r @ r))) if r @ r > 0 else float("inf")


def measure(workload: str, minilm_steps: int = 30, min_elements: int = 1000,
            most: int = 12) -> list[tuple]:
    """``(tensor, median bits saved: previous delta, Adam's direction, both)`` per tensor."""
    snaps = _trajectory(workload, minilm_steps)
    names = _param_names(workload)
    model = snaps[0][1]["model"]
    rows = []
    for i, name in enumerate(names):
        if model[name].numel() < min_elements or len(rows) >= most:
            continue
        saved = []
        for t in range(2, len(snaps)):
            a, b, z = snaps[t - 1][1], snaps[t][1], snaps[t - 2][1]
            d = (b["model"][name] - a["model"][name]).double().numpy().ravel()
            prev = (a["model"][name] - z["model"][name]).double().numpy().ravel()
            direction = _direction(a["optim"]["state"][i])
            saved.append([_bits_saved(d, prev[:, None]), _bits_saved(d, direction[:, None]),
                          _bits_saved(d, np.stack([prev, direction], 1))])
        rows.append((name, int(model[name].numel()), *np.median(np.array(saved), axis=0)))
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--workloads", nargs="+", choices=WORKLOADS, default=list(WORKLOADS))
    ap.add_argument("--minilm-steps", type=int, default=30,
                    help="fine-tune steps of the MiniLM runs (a checkpoint every 3)")
    args = ap.parse_args(argv)
    for w in args.workloads:
        print(f"\n{w}: median bits per element saved, over checkpoints")
        print(f"{'tensor':55s} {'elements':>9s} {'previous':>9s} {'adam dir':>9s} {'both':>6s}")
        for name, n, prev, direction, both in measure(w, args.minilm_steps):
            print(f"{name:55s} {n:9d} {prev:9.2f} {direction:9.2f} {both:6.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
