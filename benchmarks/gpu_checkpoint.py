"""What checkpoints of a CUDA model cost a training loop, against torch.save / torch.load.

Needs a GPU: ``python benchmarks/gpu_checkpoint.py [--width 4096]``. An MLP of six
``width``x``width`` layers with AdamW (101M parameters, 1.2 GB of state at 4096) trains
on random batches. Reported, after ``lcckpt.warmup()`` (timed: on a fresh install it
compiles the kernels):
- ``torch.save`` and ``torch.load(map_location="cuda")`` of the model's and optimizer's
  state dicts, and ``lcckpt.save`` / ``lcckpt.load`` of the same, uncompressed and with
  ``compress=True`` (exact);
- a ``CheckpointManager`` saving every 5 steps in each background mode: the stall of a
  checkpointing step beyond a plain step, with no write in flight (the first one allocates
  the pinned buffers), and how long the background write then took;
- the manager's restore of its newest step (a keyframe and three deltas) into a fresh
  CUDA model and optimizer, and its largest relative error over the model's tensors.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import statistics
import sys
import tempfile
import time

import torch
from torch import nn

import lcckpt
from lcckpt.training.manager import CheckpointManager


def _timed(fn):
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    out = fn()
    torch.cuda.synchronize()
    return time.perf_counter() - t0, out


def _build(width, seed=0):
    torch.manual_seed(seed)
    model = nn.Sequential(*[nn.Sequential(nn.Linear(width, width), nn.GELU())
                            for _ in range(6)], nn.Linear(width, 10)).cuda()
    return model, torch.optim.AdamW(model.parameters(), lr=1e-4)


def _files(model, opt, d) -> dict:
    state = lambda: {"model": model.state_dict(), "opt": opt.state_dict()}  # noqa: E731
    out = {}
    out["torch.save s"], _ = _timed(lambda: torch.save(state(), f"{d}/t.pt"))
    out["torch.load s"], _ = _timed(lambda: torch.load(f"{d}/t.pt", map_location="cuda"))
    for name, compress in (("t.lcc", False), ("c.lcc", True)):
        tag = "lcckpt compressed" if compress else "lcckpt"
        out[f"{tag} save s"], _ = _timed(
            lambda: lcckpt.save(state(), f"{d}/{name}", compress=compress))
        out[f"{tag} load s"], _ = _timed(lambda: lcckpt.load(f"{d}/{name}", map_location="cuda"))
    out["MB"] = {p: round(os.path.getsize(f"{d}/{p}") / 1e6, 1)
                 for p in ("t.pt", "t.lcc", "c.lcc")}
    return out


def _manager(model, opt, step, background, d, width) -> dict:
    row: dict = {"stall ms": [], "write s": []}
    with CheckpointManager(d, model, opt, every=5, backpressure="wait",
                           background=background) as mgr:
        plain = statistics.median(_timed(step)[0] for _ in range(10))
        for i in range(1, 21):
            if i % 5:
                mgr.step(step())
                continue
            mgr.wait()
            t, loss = _timed(step)
            s, _ = _timed(lambda: mgr.step(loss))
            row["stall ms"].append(round(1e3 * (t + s - plain), 1))
            row["write s"].append(round(_timed(mgr.wait)[0], 2))
    row["step ms"] = round(1e3 * plain, 2)
    row["MB on disk"] = round(sum(p.stat().st_size for p in pathlib.Path(d).rglob("*")
                                  if p.is_file()) / 1e6, 1)
    fresh, fresh_opt = _build(width, seed=3)
    with CheckpointManager(d, fresh, fresh_opt, every=5) as mgr:
        row["restore s"], row["restored step"] = _timed(mgr.restore)
    row["restore max rel err"] = max(
        ((fresh.state_dict()[k].double() - v.double()).norm() / v.double().norm()).item()
        for k, v in model.state_dict().items())
    return row


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--width", type=int, default=4096)
    ap.add_argument("--json", metavar="PATH", help="also write the result as JSON")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("gpu_checkpoint benchmark: no CUDA device, nothing to measure")
        return 0
    res: dict = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                 "cpus": os.cpu_count()}
    res["warmup s"], _ = _timed(lcckpt.warmup)
    model, opt = _build(args.width)
    g = torch.Generator(device="cuda").manual_seed(1)

    def step():
        loss = model(torch.randn(512, args.width, device="cuda", generator=g)).logsumexp(1).mean()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        return loss
    for _ in range(5):
        step()
    res["state GB"] = sum(t.nbytes for t in model.state_dict().values()) * 3 / 1e9
    with tempfile.TemporaryDirectory() as d:
        res["files"] = _files(model, opt, d)
    print(json.dumps(res, indent=1), flush=True)
    for background in (True, "overlap"):
        with tempfile.TemporaryDirectory() as d:
            res[f"background={background}"] = row = _manager(model, opt, step, background, d,
                                                             args.width)
        print(f"background={background}: {json.dumps(row)}", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
