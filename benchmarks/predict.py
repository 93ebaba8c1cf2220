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

``--coded`` measures the first predictor with the real encoder instead: the run is saved
as a default chain twice, as the library codes it and with every tracked delta coded
against ``ref + a·p`` (``p`` the previous restored delta, ``ref - ref_prev``; ``a`` fitted
per tensor and step), each held to the same target (its update share still a share of
``u - ref``, what the delta sends). It prints the delta and whole-run bytes of both. The
predicted chain exists only in the writer (no reader knows the prediction): its files
are counted, not restored.

    python benchmarks/predict.py [--workloads cnn-adam cnn-sgd minilm-finetune minilm-scratch]
                                 [--minilm-steps 30] [--coded]
"""

from __future__ import annotations

import argparse
import contextlib
import tempfile
from types import SimpleNamespace

import numpy as np

from lcckpt.bench.quality import WORKLOADS, _param_names, make_trajectory


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
    snaps = make_trajectory(workload, minilm_steps).snapshots
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


@contextlib.contextmanager
def _predicted():
    """Every ``DeltaEncoder`` delta coded against ``ref + a·(ref - ref_prev)`` (the
    writer's side only), its target computed from ``u - ref`` as without it."""
    from lcckpt.codec import delta as dm
    encode, config_for = dm.DeltaEncoder.encode_parts, dm.DeltaEncoder._config_for

    def encode_parts(self, x, *, keyframe=False, **kw):
        a, dt = dm.dtypes.to_numpy(x)
        u = dm.dtypes.to_float_work(a, dt).reshape(-1)
        is_delta = not (keyframe or self.ref is None or dt != self.dtype
                        or a.shape != self.shape)
        before = None if self.ref is None else self.ref.copy()
        prev, self._update_sq = getattr(self, "_prev", None), None
        if is_delta and prev is not None and prev.shape == u.shape:
            p = self.ref - prev
            d = u - self.ref
            pp = float(p.astype(np.float64) @ p)
            if pp > 0:
                self._update_sq = float(d.astype(np.float64) @ d)
                self.ref += np.float32(float(d.astype(np.float64) @ p) / pp) * p
        out = encode(self, x, keyframe=keyframe, **kw)
        self._prev = before if is_delta else None
        return out

    def _config_for(self, u, dt, sv=None):
        update_sq = getattr(self, "_update_sq", None)
        if update_sq is not None and sv is not None:     # the update is u - ref, as unpredicted
            sv.model.total_sq = lambda: update_sq
        return config_for(self, u, dt, sv)
    dm.DeltaEncoder.encode_parts, dm.DeltaEncoder._config_for = encode_parts, _config_for
    try:
        yield
    finally:
        dm.DeltaEncoder.encode_parts, dm.DeltaEncoder._config_for = encode, config_for


def coded(workload: str, minilm_steps: int = 30) -> dict:
    """Delta and whole-run bytes of a default chain, without and with the prediction."""
    from lcckpt import DeltaCheckpointer
    from lcckpt.bench.quality import torch_bytes
    snaps = make_trajectory(workload, minilm_steps).snapshots
    out = {"torch": sum(torch_bytes(SimpleNamespace(snapshots=snaps)))}
    for kind in ("as coded", "predicted"):
        with tempfile.TemporaryDirectory() as d, \
                (_predicted() if kind == "predicted" else contextlib.nullcontext()):
            ck = DeltaCheckpointer(d, keyframe_every=50)
            deltas = total = 0
            for step, snap in snaps:
                ck.save(step, snap)
                total += ck.last_save["nbytes"]
                deltas += ck.last_save["nbytes"] if ck.last_save["kind"] == "delta" else 0
            ck.close()
        out[kind] = (deltas, total)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--workloads", nargs="+", choices=WORKLOADS, default=list(WORKLOADS))
    ap.add_argument("--minilm-steps", type=int, default=30,
                    help="fine-tune steps of the MiniLM runs (a checkpoint every 3)")
    ap.add_argument("--coded", action="store_true",
                    help="code the runs with the previous delta as predictor (see above)")
    args = ap.parse_args(argv)
    for w in args.workloads:
        if args.coded:
            r = coded(w, args.minilm_steps)
            (d0, t0), (d1, t1) = r["as coded"], r["predicted"]
            print(f"{w}: delta bytes {d0:,} -> {d1:,} ({d1 / d0 - 1:+.1%}), whole run "
                  f"{r['torch'] / t0:.2f}x -> {r['torch'] / t1:.2f}x torch.save")
            continue
        print(f"\n{w}: median bits per element saved, over checkpoints")
        print(f"{'tensor':55s} {'elements':>9s} {'previous':>9s} {'adam dir':>9s} {'both':>6s}")
        for name, n, prev, direction, both in measure(w, args.minilm_steps):
            print(f"{name:55s} {n:9d} {prev:9.2f} {direction:9.2f} {both:6.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
