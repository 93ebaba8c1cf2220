"""Background saves of a distributed chain: what the training loop waits for (the stall:
staging the state to host), the whole save, and the training process's peak resident
memory, with the staging buffers reused from save to save (lcckpt) against a fresh copy
per save (DCP's default stager), in a thread and in DCP's background process, and with no
staging copy (``staging="live"``: a thread reads the state itself; DCP's background
process reads it through a bounded pool of shared buffers, lcckpt/distributed/pool.py).

``python benchmarks/async_save.py [--mb 256] [--saves 6] [--rounds 2]``: each case runs in
its own child process (one rank, gloo), the cases taking turns round by round; medians
over the saves after the first (the first allocates the buffers).

"held s": from the call to ``async_save`` until an optimizer step made right after it
returns, its optimizer hooked with ``wait_before``: all of the save with a staged copy
(which no step has to wait for; the hook waits anyway), the save's reading of the state
with ``staging="live"``.

``--state mlp --codings lc default --modes thread --stagings reused``: instead of a
drifting random state, the save benchmark's real snapshots (the ~20M-parameter MLP with
Adam after steps 2, 4, ..., 22: a keyframe and 10 deltas, each copied into the state in
place) saved with LC's 2 bits and with the default targets; also the median bytes of a
delta step.
"""

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time


def _copy_into(dst, src) -> None:
    """Every tensor of ``src`` copied into ``dst``'s, in place (as an optimizer step)."""
    for k, v in src.items():
        if isinstance(v, dict):
            _copy_into(dst[k], v)
        elif hasattr(v, "copy_"):
            dst[k].copy_(v)
        else:
            dst[k] = v


def _steps(kind: str, mb: int):
    """The state, and a function that moves it to save ``step``."""
    import copy
    import torch
    if kind == "mlp":
        from lcckpt.bench.trajectory import train_trajectory
        snaps = [s for _, s in train_trajectory(model="mlp", optimizer="adam", steps=22,
                                                snapshot_every=2).snapshots[1:]]
        state = copy.deepcopy(snaps[0])
        return state, lambda step: _copy_into(state, snaps[step % len(snaps)])
    torch.manual_seed(0)
    state = {f"w{i}": torch.randn(mb // 16 * 2**18) for i in range(16)}  # mb MB of fp32

    def move(step):
        for t in state.values():
            t.add_(1e-3)                       # in place, as an optimizer step
    return state, move


def child(staging: str, mode: str, coding: str, kind: str, mb: int, saves: int) -> dict:
    import torch
    import torch.distributed as dist
    import lcckpt.distributed as ld

    fd, meet = tempfile.mkstemp(prefix="lcckpt-rendezvous-")
    os.close(fd)
    os.unlink(meet)                        # the store creates it, and removes it at the end
    dist.init_process_group("gloo", init_method="file://" + meet, rank=0, world_size=1)
    state, move = _steps(kind, mb)
    stalls, totals, sizes, held = [], [], [], []
    opt = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.0)   # steps nothing
    with tempfile.TemporaryDirectory() as d:
        ck = ld.DistributedCheckpointer(d, keyframe_every=100,
                                        **({"bits": 2} if coding == "lc" else {}))
        if staging == "fresh":                 # DCP's default: a new host copy per save
            ck._stager = lambda process: None
        ck.wait_before(opt)
        for step in range(saves):
            move(step)
            t0 = time.perf_counter()
            fut = ck.async_save(step, state, process=mode == "process",
                                staging="live" if staging == "live" else "copy")
            t1 = time.perf_counter()
            opt.step()
            held.append(time.perf_counter() - t0)
            fut.result()
            stalls.append(t1 - t0)
            totals.append(time.perf_counter() - t0)
            where = ck.path(step)
            sizes.append(sum(os.path.getsize(os.path.join(where, f)) for f in os.listdir(where)))
        ck.close()
    dist.destroy_process_group()
    return {"stall_s": statistics.median(stalls[1:]), "first_stall_s": stalls[0],
            "save_s": statistics.median(totals[1:]), "held_s": statistics.median(held[1:]),
            "delta_mb": statistics.median(sizes[1:]) / 1e6,
            "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mb", type=int, default=256)
    ap.add_argument("--saves", type=int, default=6)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--state", choices=("random", "mlp"), default="random")
    ap.add_argument("--codings", nargs="+", choices=("lc", "default"), default=["lc"],
                    help="lc: bits=2; default: the default targets")
    ap.add_argument("--modes", nargs="+", choices=("thread", "process"),
                    default=["thread", "process"])
    ap.add_argument("--stagings", nargs="+", choices=("fresh", "reused", "live"),
                    default=["fresh", "reused", "live"])
    ap.add_argument("--child", nargs=4, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        print(json.dumps(child(*args.child, args.mb, args.saves)))
        return 0
    what = "the MLP's 11 snapshots (245 MB)" if args.state == "mlp" else f"{args.mb} MB fp32"
    print(f"state {what}, {args.saves} saves, one rank")
    print(f"{'mode':8} {'staging':8} {'coding':8} {'stall s':>8} {'first s':>8} {'save s':>7} "
          f"{'held s':>7} {'delta MB':>8} {'peak MB':>8}")
    env = dict(os.environ, PYTHONWARNINGS="ignore")
    for _ in range(args.rounds):
        for mode in args.modes:
            for staging in args.stagings:
                for coding in args.codings:
                    out = subprocess.run(
                        [sys.executable, __file__, "--mb", str(args.mb), "--saves",
                         str(args.saves), "--child", staging, mode, coding, args.state],
                        capture_output=True, text=True, env=env, check=True)
                    r = json.loads(out.stdout.strip().splitlines()[-1])
                    print(f"{mode:8} {staging:8} {coding:8} {r['stall_s']:8.3f} "
                          f"{r['first_stall_s']:8.3f} {r['save_s']:7.3f} {r['held_s']:7.3f} "
                          f"{r['delta_mb']:8.2f} "
                          f"{r['peak_rss_mb']:8.0f}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
