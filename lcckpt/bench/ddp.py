"""What a CheckpointManager costs a DDP loop: two gloo ranks on this host (one thread
each) train an MLP on random batches for ``--steps`` iterations, three ways taking turns:
no manager, a manager on every rank (rank 0 writes every ``--every`` iterations in the
background), and the same with ``sigterm=True`` (the ranks agree on a pending SIGTERM
about once a second: lcckpt/training/signals.py). Prints the median time per iteration of
each over ``--rounds`` rounds, and what the manager and the agreement add to it.

    python benchmarks/ddp.py [--steps 300] [--every 50] [--rounds 3]
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time

MODES = ("plain", "manager", "manager+sigterm")


def _rank(rank: int, world: int, init: str, root: str, steps: int, every: int,
          rounds: int, out: str) -> None:
    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.nn.parallel import DistributedDataParallel as DDP
    from lcckpt import CheckpointManager
    os.environ["LCCKPT_THREADS"] = "1"
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    times: dict[str, list[float]] = {m: [] for m in MODES}
    g = torch.Generator().manual_seed(rank)
    for r in range(rounds):
        for mode in MODES:
            torch.manual_seed(0)
            model = DDP(nn.Sequential(nn.Linear(256, 1024), nn.ReLU(), nn.Linear(1024, 10)))
            opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
            mgr = None if mode == "plain" else CheckpointManager(
                os.path.join(root, f"{mode}-{r}"), model, opt, every=every,
                sigterm=mode.endswith("sigterm"))
            dist.barrier()
            t0 = time.perf_counter()
            for _ in range(steps):
                loss = nn.functional.cross_entropy(
                    model(torch.randn(64, 256, generator=g)),
                    torch.randint(0, 10, (64,), generator=g))
                opt.zero_grad()
                loss.backward()
                opt.step()
                if mgr is not None:
                    mgr.step(loss)
            dist.barrier()
            times[mode].append((time.perf_counter() - t0) / steps)
            if mgr is not None:
                mgr.close()
    if rank == 0:
        with open(out, "w") as f:
            json.dump(times, f)
    dist.destroy_process_group()


def run(steps: int = 300, every: int = 50, rounds: int = 3) -> dict:
    import statistics
    import torch.multiprocessing as mp
    with tempfile.TemporaryDirectory() as root:
        out = os.path.join(root, "times.json")
        init = f"file://{os.path.join(root, 'rendezvous')}"
        mp.spawn(_rank, args=(2, init, root, steps, every, rounds, out), nprocs=2, join=True)
        with open(out) as f:
            times = json.load(f)
    med = {m: statistics.median(v) for m, v in times.items()}
    return {"steps": steps, "every": every, "rounds": rounds, "per_iteration_s": times,
            "median_s": med,
            "manager_adds": med["manager"] / med["plain"] - 1,
            "sigterm_adds": med["manager+sigterm"] / med["manager"] - 1}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--every", type=int, default=50)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--json", default=None)
    a = ap.parse_args(argv)
    res = run(a.steps, a.every, a.rounds)
    for m in MODES:
        print(f"{m:16s} {res['median_s'][m] * 1e3:8.3f} ms/iteration (rounds: "
              + ", ".join(f"{t * 1e3:.3f}" for t in res["per_iteration_s"][m]) + ")")
    print(f"the manager adds {res['manager_adds']:+.1%} per iteration (rank 0 writing every "
          f"{res['every']} in the background); the SIGTERM agreement {res['sigterm_adds']:+.1%}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(res, f, indent=1)
    return 0
