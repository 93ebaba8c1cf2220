"""Background saves of a distributed chain: what the training loop waits for (the stall:
staging the state to host), the whole save, and the training process's peak resident
memory, with the staging buffers reused from save to save (lcckpt) against a fresh copy
per save (DCP's default stager), in a thread and in DCP's background process.

``python benchmarks/async_save.py [--mb 256] [--saves 6] [--rounds 2]``: each case runs in
its own child process (one rank, gloo), the cases taking turns round by round; medians
over the saves after the first (the first allocates the buffers).
"""

import argparse
import json
import os
import resource
import socket
import statistics
import subprocess
import sys
import tempfile
import time


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def child(staging: str, mode: str, mb: int, saves: int) -> dict:
    import torch
    import torch.distributed as dist
    import lcckpt.distributed as ld

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{_free_port()}",
                            rank=0, world_size=1)
    torch.manual_seed(0)
    state = {f"w{i}": torch.randn(mb // 16 * 2**18) for i in range(16)}  # mb MB of fp32
    stalls, totals = [], []
    with tempfile.TemporaryDirectory() as d:
        ck = ld.DistributedCheckpointer(d, bits=2, keyframe_every=100)
        if staging == "fresh":                 # DCP's default: a new host copy per save
            ck._stager = lambda process: None
        for step in range(saves):
            for t in state.values():
                t.add_(1e-3)                   # in place, as an optimizer step
            t0 = time.perf_counter()
            fut = ck.async_save(step, state, process=mode == "process")
            t1 = time.perf_counter()
            fut.result()
            stalls.append(t1 - t0)
            totals.append(time.perf_counter() - t0)
        ck.close()
    dist.destroy_process_group()
    return {"stall_s": statistics.median(stalls[1:]), "first_stall_s": stalls[0],
            "save_s": statistics.median(totals[1:]),
            "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mb", type=int, default=256)
    ap.add_argument("--saves", type=int, default=6)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--child", nargs=2, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        print(json.dumps(child(*args.child, args.mb, args.saves)))
        return 0
    print(f"state {args.mb} MB fp32, {args.saves} saves (bits=2 chain), one rank")
    print(f"{'mode':8} {'staging':8} {'stall s':>8} {'first s':>8} {'save s':>7} {'peak MB':>8}")
    env = dict(os.environ, PYTHONWARNINGS="ignore")
    for _ in range(args.rounds):
        for mode in ("thread", "process"):
            for staging in ("fresh", "reused"):
                out = subprocess.run([sys.executable, __file__, "--mb", str(args.mb), "--saves",
                                      str(args.saves), "--child", staging, mode],
                                     capture_output=True, text=True, env=env, check=True)
                r = json.loads(out.stdout.strip().splitlines()[-1])
                print(f"{mode:8} {staging:8} {r['stall_s']:8.3f} {r['first_stall_s']:8.3f} "
                      f"{r['save_s']:7.3f} {r['peak_rss_mb']:8.0f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
