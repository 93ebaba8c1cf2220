"""A CheckpointManager's restore under DDP: every rank reading and decoding the chain,
against the writer alone reading it and sending the state to the others
(``restore(cooperative=...)``, lcckpt/training/broadcast.py).

The state is the memory benchmark's (the ~20M-parameter MLP under Adam, about 245 MB with
both moments), written by a manager as a keyframe and ``--deltas`` deltas (a checkpoint
every 2 training steps), the newest restored. ``--ranks`` gloo ranks
on this host (each with lcckpt's default threads, as a user's ranks have) restore it into
a fresh model and Adam optimizer, one mode per spawn of the ranks, the modes taking turns
for ``--rounds`` spawns each. Per restore: the wall time of the slowest rank, the CPU
seconds of all ranks together (``getrusage``: every thread), and each rank's peak resident
memory beyond what it held before (``VmHWM`` reset just before; a fresh process each).

    python benchmarks/ddp_restore.py [--ranks 2 3] [--deltas 10] [--rounds 3]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import tempfile
import time

MODES = ("each-reads", "cooperative")


def _status(key: str) -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(key + ":"))


def _cpu() -> float:
    u = resource.getrusage(resource.RUSAGE_SELF)
    return u.ru_utime + u.ru_stime


def _rank(rank: int, world: int, init: str, d: str, mode: str, out: str) -> None:
    import torch
    import torch.distributed as dist
    import lcckpt
    from lcckpt.bench.trajectory import _MODELS
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    lcckpt.warmup()
    model = _MODELS["mlp"]()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    mgr = lcckpt.CheckpointManager(d, model, opt, every=1, background=False)
    dist.barrier()
    before, cpu0 = _status("VmRSS"), _cpu()
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")                                    # VmHWM from here
    t0 = time.perf_counter()
    step = mgr.restore(cooperative=mode == "cooperative")
    wall, cpu, peak = time.perf_counter() - t0, _cpu() - cpu0, _status("VmHWM") - before
    mgr.close()
    got = [None] * world
    dist.all_gather_object(got, {"step": step, "wall": wall, "cpu": cpu, "extra": peak})
    if rank == 0:
        with open(out, "w") as f:
            json.dump(got, f)
    dist.destroy_process_group()


def _prepare(d: str, deltas: int) -> int:
    """A manager's chain (keyframe + ``deltas`` deltas) of the MLP under Adam; its state's
    bytes."""
    import torch
    import lcckpt
    from ..interop.convert import flat_tensors
    from .trajectory import _MODELS, train_trajectory
    traj = train_trajectory(model="mlp", optimizer="adam", steps=2 * deltas + 2,
                            snapshot_every=2)
    snaps = [s for _, s in traj.snapshots[-(deltas + 1):]]
    model = _MODELS["mlp"]()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    with lcckpt.CheckpointManager(d, model, opt, every=1, background=False) as m:
        for s in snaps:
            model.load_state_dict(s["model"])
            opt.load_state_dict(s["optim"])
            m.step()
    return sum(v.numel() * v.element_size() for v in flat_tensors(snaps[-1]).values())


def run(ranks=(2, 3), deltas: int = 10, rounds: int = 3) -> dict:
    import torch.multiprocessing as mp
    res: dict = {"rounds": rounds, "deltas": deltas, "runs": {}}
    with tempfile.TemporaryDirectory() as root:
        d = os.path.join(root, "ck")
        res["state_bytes"] = _prepare(d, deltas)
        for world in ranks:
            runs = {m: [] for m in MODES}
            for r in range(rounds):
                for mode in MODES:
                    out = os.path.join(root, f"{world}-{mode}-{r}.json")
                    init = f"file://{os.path.join(root, f'rdv-{world}-{mode}-{r}')}"
                    mp.spawn(_rank, args=(world, init, d, mode, out), nprocs=world, join=True)
                    with open(out) as f:
                        runs[mode].append(json.load(f))
            res["runs"][world] = runs
    return res


def summary(res: dict) -> list[dict]:
    rows = []
    for world, runs in res["runs"].items():
        for mode, rr in runs.items():
            rows.append({"ranks": int(world), "mode": mode,
                         "wall_s": statistics.median(max(x["wall"] for x in r) for r in rr),
                         "cpu_s": statistics.median(sum(x["cpu"] for x in r) for r in rr),
                         "writer_mb": statistics.median(r[0]["extra"] for r in rr) / 1e6,
                         "other_mb": statistics.median(max(x["extra"] for x in r[1:])
                                                       for r in rr) / 1e6})
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--ranks", type=int, nargs="+", default=[2, 3])
    ap.add_argument("--deltas", type=int, default=10)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--json", default=None)
    a = ap.parse_args(argv)
    res = run(tuple(a.ranks), a.deltas, a.rounds)
    print(f"state {res['state_bytes'] / 1e6:.1f} MB, a keyframe and {a.deltas} deltas; "
          f"medians of {a.rounds} restores; "
          "memory: peak beyond what the rank held before")
    print(f"{'ranks':>5}  {'mode':12s} {'wall s':>7} {'CPU s (all ranks)':>18} "
          f"{'writer MB':>10} {'other rank MB':>14}")
    for row in summary(res):
        print(f"{row['ranks']:>5}  {row['mode']:12s} {row['wall_s']:7.3f} {row['cpu_s']:18.3f} "
              f"{row['writer_mb']:10.1f} {row['other_mb']:14.1f}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(res, f, indent=1)
    return 0
