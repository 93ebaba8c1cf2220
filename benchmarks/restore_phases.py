"""Where a cooperative restore's time goes: an exact checkpoint of the distributed
benchmark's state (lcckpt/bench/distributed.py), or with ``--chain`` the newest step of
its chain, restored by one rank and by two, taking turns, with each phase timed on each
rank.

    python benchmarks/restore_phases.py [--total-mb 256] [--repeats 5] [--chain]

Phases (milliseconds, median over the repeats; a phase holds those indented under it):
  total        ``dcp.load``, barrier to barrier
  run          this rank's share (lcckpt/distributed/exchange.py)
    handshake    who may write into whose memory (peer.py)
    give         the decode loop: decoding, and giving items to the peers
      decode       decoding this rank's items
      writes       copies into peers' memory (on their own thread: overlapped with decode)
    failures     the failure flags' sum: waiting for the slower rank
One thread per rank (``LCCKPT_THREADS=1``), as in benchmarks/distributed.py.
"""

from __future__ import annotations

import argparse
import collections
import os
import statistics
import sys
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

PHASES = ["total", "run", "handshake", "give", "decode", "writes", "failures"]


def _timed(owner, name: str, phase: str, acc: collections.Counter) -> None:
    real = getattr(owner, name)

    def timed(*a, **k):
        t0 = time.perf_counter()
        try:
            return real(*a, **k)
        finally:
            acc[phase] += time.perf_counter() - t0
    setattr(owner, name, timed)


def _checkpoint(ld, state: dict, out: str, chain: bool) -> str:
    """An exact checkpoint of ``state``, or (``chain``) the newest step of the distributed
    benchmark's chain (a keyframe and 5 deltas, ``bits=2``), written by both ranks."""
    from lcckpt.bench.distributed import bench_chain
    if chain:
        return bench_chain(state, os.path.join(out, "chain"))
    path = os.path.join(out, "exact")
    ld.save(state, path)
    return path


def _worker(rank: int, world: int, init_method: str, args, out: str) -> None:
    os.environ["LCCKPT_THREADS"] = "1"
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init_method, rank=rank,
                            world_size=world)
    import torch.distributed.checkpoint as dcp

    import lcckpt
    import lcckpt.distributed as ld
    from lcckpt.bench.distributed import _zeros, bench_state
    from lcckpt.distributed import exchange, peer
    from lcckpt.distributed.planner import SafeLoadPlanner
    from lcckpt.distributed.storage import CompressedReader
    lcckpt.warmup()
    acc: collections.Counter = collections.Counter()
    for owner, name, phase in [(exchange, "run", "run"), (peer, "handshake", "handshake"),
                               (exchange, "_give", "give"), (exchange, "_failures", "failures"),
                               (exchange, "_write", "writes"),
                               (CompressedReader, "_item", "decode")]:
        _timed(owner, name, phase, acc)
    state = bench_state(args.total_mb)
    path = _checkpoint(ld, state, out, args.chain)
    one = dist.new_group([0])
    rows = {1: [], 2: []}
    for rep in range(args.repeats + 1):             # the first round warms caches: not kept
        for ranks in (1, 2):
            if rank < ranks:
                target = _zeros(state)
                reader = CompressedReader(path, process_group=one if ranks == 1 else None)
                if ranks == 2:
                    dist.barrier()
                acc.clear()
                t0 = time.perf_counter()
                dcp.load(target, storage_reader=reader, planner=SafeLoadPlanner(),
                         process_group=one if ranks == 1 else None)
                if ranks == 2:
                    dist.barrier()
                acc["total"] = time.perf_counter() - t0
                if rep:
                    rows[ranks].append(dict(acc))
            dist.barrier()
    got = [None] * world
    dist.all_gather_object(got, rows)
    if rank == 0:
        torch.save(got, os.path.join(out, "phases.pt"))
    dist.destroy_process_group()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--total-mb", type=float, default=256)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--chain", action="store_true",
                    help="the newest step of a chain (a keyframe and 5 deltas), not an "
                         "exact checkpoint")
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory() as out:
        meet = "file://" + os.path.join(out, "rendezvous")     # no port to race for
        mp.spawn(_worker, args=(2, meet, args, out), nprocs=2, join=True)
        got = torch.load(os.path.join(out, "phases.pt"))
    med = statistics.median
    what = "newest step of a chain (keyframe + 5 deltas)" if args.chain else "exact checkpoint"
    print(f"{what} of {args.total_mb:g} MB, median of {args.repeats} "
          "(milliseconds; one thread per rank)")
    print(f"{'phase':<10} {'1 rank':>8} {'2: rank 0':>10} {'2: rank 1':>10}")
    for phase in PHASES:
        cells = [got[0][1], got[0][2], got[1][2]]
        vals = [med(r.get(phase, 0.0) for r in rows) if rows else float("nan")
                for rows in cells]
        print(f"{phase:<10} " + " ".join(f"{v * 1e3:>{w}.1f}" for v, w in zip(vals, (8, 10, 10))))
    total1 = med(r["total"] for r in got[0][1])
    total2 = med(max(a["total"], b["total"]) for a, b in zip(got[0][2], got[1][2]))
    print(f"speedup of two ranks: {total1 / total2:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
