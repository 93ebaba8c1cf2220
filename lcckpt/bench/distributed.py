"""Distributed save benchmark: 1 rank against 2 ranks on the same replicated state.

The state is one dominant embedding plus many small tensors (``bench_state``), the same on
every rank, as in data-parallel training. The configurations run in one set of spawned gloo
ranks on this machine, taking turns round by round (a 1-rank configuration saves through a
1-rank group while the other rank waits), every rank with ``threads`` compression threads
(``LCCKPT_THREADS``):

* ``1 rank``: lcckpt's compressed writer, one rank writes everything;
* ``2 ranks, DCP default planner``: DCP's dedup of replicated items (first come to the
  least-loaded rank, never split) with the same compressed writer;
* ``2 ranks, balanced planner``: lcckpt.distributed's partitioner (split + LPT by cost).

Measured per configuration (medians over ``repeats`` rounds after one untimed warm-up round):
the save time from a barrier before to a barrier after (every rank done, metadata
committed), each rank's encoded bytes, its wall and CPU time inside ``write_data`` (encode +
write + fsync; CPU time is what a busy machine does not inflate), max/avg over ranks, and the time to load the checkpoint back on every rank
(every rank reads the whole replicated state). Dirty pages are flushed (``os.sync``,
untimed) before each save so that writeback of the previous one is not timed. Keyframes
only: exact, lossless.

Then restores (``RESTORES``): an exact checkpoint and the newest step of a chain (a keyframe
and 5 ``bits=2`` deltas), both saved by two ranks, restored by 1 rank and by 2, cooperatively
(the default) and with each rank reading all it needs, taking turns; per configuration the
median time and each rank's bytes read.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import tempfile
import time

import torch

from ..errors import InvalidArgumentError

MB = 1e6
CONFIGS = (("balanced", 1), ("dcp-default", 2), ("balanced", 2))
# restores timed: (checkpoint, ranks, cooperative); "2 alone": each rank reads all it needs
RESTORES = (("exact", "1", True), ("exact", "2", True), ("exact", "2 alone", False),
            ("chain", "1", True), ("chain", "2", True), ("chain", "2 alone", False))


def bench_state(total_mb: float = 256, dominant: float = 0.8, n_small: int = 200,
                seed: int = 0) -> dict:
    """``dominant`` of ``total_mb`` in one (rows, 1024) fp32 embedding, the rest in
    ``n_small`` equal (rows, 256) fp32 matrices; values like trained weights (N(0, 0.02))."""
    g = torch.Generator().manual_seed(seed)
    emb_rows = max(1, int(total_mb * MB * dominant / 4096))
    small_rows = max(1, int(total_mb * MB * (1 - dominant) / n_small / 1024))
    state = {"embedding.weight": torch.randn(emb_rows, 1024, generator=g).mul_(0.02)}
    for i in range(n_small):
        state[f"layers.{i}.weight"] = torch.randn(small_rows, 256, generator=g).mul_(0.02)
    state["step"] = 1000
    return state


def _one_save(cfg, planner_name, group, members, rank, state, path, check):
    """One timed save and load of ``state`` by the ranks in ``members`` (the rest wait)."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.default_planner import DefaultSavePlanner

    import lcckpt.distributed as ld
    dist.barrier()
    if rank == 0:
        os.sync()
    dist.barrier()
    stats, save_s, load_s = None, 0.0, 0.0
    if rank in members:
        planner = ld.BalancedSavePlanner() if planner_name == "balanced" else DefaultSavePlanner()
        writer = ld.CompressedWriter(path, sync_files=cfg["sync"])
        dist.barrier(group)
        t0 = time.perf_counter()
        dcp.save(state, storage_writer=writer, planner=planner, process_group=group)
        writer.commit()
        dist.barrier(group)
        save_s = time.perf_counter() - t0
        stats = dict(writer.last_write_stats)
        target = _zeros(state)
        load_s, _ = _timed_load(target, path, group)
        if check:
            assert all(torch.equal(target[k], v) if isinstance(v, torch.Tensor)
                       else target[k] == v for k, v in state.items()), "reload differs"
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, stats)
    dist.barrier()
    if rank == 0:
        shutil.rmtree(path, ignore_errors=True)
    return {"save_s": save_s, "load_s": load_s, "ranks": [g for g in gathered if g]}


def _zeros(state: dict) -> dict:
    return {k: (torch.zeros_like(v) if isinstance(v, torch.Tensor) else 0)
            for k, v in state.items()}


def bench_chain(state: dict, root: str, group=None) -> str:
    """The restore benchmarks' chain, saved by the ranks of ``group``: a keyframe and 5
    deltas (``bits=2``) of ``state``, moved by the same update on every rank (replicated).
    Returns the newest step's directory."""
    import lcckpt.distributed as ld
    ck = ld.DistributedCheckpointer(root, bits=2, keyframe_every=50, process_group=group)
    gen = torch.Generator().manual_seed(1)
    for step in range(6):
        if step:
            for v in state.values():
                if isinstance(v, torch.Tensor):
                    v.add_(torch.randn(v.shape, generator=gen).mul_(2e-4))
        ck.save(step, state)
    return ck.path(5)


def _timed_load(target, path, group, cooperative=True) -> tuple[float, int]:
    """``ld.load`` of ``path`` into ``target`` by the ranks of ``group``, barrier to
    barrier: (seconds, bytes this rank read)."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    from ..distributed.planner import SafeLoadPlanner
    from ..distributed.storage import CompressedReader
    reader = CompressedReader(path, process_group=group, cooperative=cooperative)
    dist.barrier(group)
    t0 = time.perf_counter()
    dcp.load(target, storage_reader=reader, planner=SafeLoadPlanner(), process_group=group)
    dist.barrier(group)
    return time.perf_counter() - t0, reader.bytes_read


def _restores(cfg, groups, rank, state) -> dict:
    """Restore timings at 1 and 2 ranks, taking turns: an exact checkpoint written by two
    ranks, and the newest step of a chain (a keyframe and 5 deltas, ``bits=2``).
    Returns {"exact:1": [(seconds, [bytes read per rank]), ...], ...} on rank 0."""
    import torch.distributed as dist

    import lcckpt.distributed as ld
    g2 = groups[2][0]
    exact = os.path.join(cfg["root"], "restore_exact")
    ld.save(state, exact, process_group=g2)
    chain = bench_chain(state, os.path.join(cfg["root"], "restore_chain"), g2)
    out = {f"{kind}:{w}": [] for kind, w, _ in RESTORES}
    for rep in range(cfg["repeats"] + 1):
        for kind, w, coop in RESTORES:
            group, members = groups[int(w[0])]
            secs, nbytes = 0.0, 0
            if rank in members:
                secs, nbytes = _timed_load(_zeros(state), exact if kind == "exact"
                                           else chain, group, coop)
            got = [None] * dist.get_world_size()
            dist.all_gather_object(got, (secs, nbytes))
            if rep > 0:
                out[f"{kind}:{w}"].append((got[0][0], [b for _, b in got[:int(w[0])]]))
    return {"runs": out}


def _restore_summary(rest: dict) -> list:
    rows = []
    med = statistics.median
    for kind, w, _ in RESTORES:
        one = rest["runs"][f"{kind}:1"]
        runs = rest["runs"][f"{kind}:{w}"]
        secs = med(s for s, _ in runs)
        per_rank = [med(b[k] for _, b in runs) for k in range(int(w[0]))]
        rows.append({"checkpoint": kind, "ranks": w, "restore_s": secs,
                     "restore_s_runs": [s for s, _ in runs],
                     "speedup": med(s for s, _ in one) / secs, "rank_read_bytes": per_rank,
                     "read_over_one_rank": sum(per_rank) / med(sum(b) for _, b in one)})
    return rows


def _worker(rank, world, init_method, cfg, out):
    """All configurations in one set of processes, taking turns round by round: a slow
    spell of a shared machine then hits every configuration, not only the one it met."""
    os.environ["LCCKPT_THREADS"] = str(cfg["threads"])
    torch.set_num_threads(1)
    import torch.distributed as dist

    import lcckpt
    dist.init_process_group("gloo", init_method=init_method, rank=rank,
                            world_size=world)
    groups = {n: (dist.new_group(list(range(n))), range(n)) for n in sorted(
        {w for _, w in cfg["configs"]})}
    lcckpt.warmup()
    state = bench_state(cfg["total_mb"], cfg["dominant"], cfg["n_small"])
    rows = {f"{p}:{w}": [] for p, w in cfg["configs"]}
    for rep in range(cfg["repeats"] + 1):
        for planner, w in cfg["configs"]:
            group, members = groups[w]
            path = os.path.join(cfg["root"], f"{planner}_{w}_{rep}")
            row = _one_save(cfg, planner, group, members, rank, state, path, check=rep == 0)
            if rep > 0:                    # the first round warms caches: not timed
                rows[f"{planner}:{w}"].append(row)
    if 2 in groups and 1 in groups:
        rows["restore"] = _restores(cfg, groups, rank, state)
    if rank == 0:
        with open(out, "w") as f:
            json.dump(rows, f)
    dist.destroy_process_group()


def _summary(planner: str, world: int, rows: list) -> dict:
    def med(xs):
        return statistics.median(xs)
    per_rank_bytes = [med([r["ranks"][k]["bytes"] for r in rows]) for k in range(world)]
    per_rank_raw = [med([r["ranks"][k]["raw_bytes"] for r in rows]) for k in range(world)]
    per_rank_s = [med([r["ranks"][k]["seconds"] for r in rows]) for k in range(world)]
    per_rank_cpu = [med([r["ranks"][k]["cpu_seconds"] for r in rows]) for k in range(world)]

    def imb(xs):
        avg = sum(xs) / len(xs)
        return max(xs) / avg if avg else 1.0
    return {"planner": planner, "ranks": world,
            "save_s": med([r["save_s"] for r in rows]),
            "save_s_runs": [r["save_s"] for r in rows],
            "load_s": med([r["load_s"] for r in rows]),
            "rank_bytes": per_rank_bytes, "rank_raw_bytes": per_rank_raw,
            "rank_write_s": per_rank_s, "rank_write_cpu_s": per_rank_cpu,
            "imbalance_bytes": imb(per_rank_bytes),
            "imbalance_time": imb(per_rank_s), "total_bytes": sum(per_rank_bytes)}


def run(total_mb: float = 256, dominant: float = 0.8, n_small: int = 200, repeats: int = 3,
        threads: int = 1, directory: str | None = None, configs=CONFIGS,
        sync: bool = True) -> dict:
    """Run every configuration in ``configs`` ((planner, ranks) pairs) and return the
    results as a JSON-able dict (see the module docstring). ``sync=False`` skips the fsync
    of each file, to tell compression from the disk."""
    if repeats < 1 or threads < 1 or not 0 < dominant < 1 or total_mb <= 0:
        raise InvalidArgumentError("need repeats >= 1, threads >= 1, 0 < dominant < 1, "
                                   f"total_mb > 0; got {repeats}, {threads}, {dominant}, "
                                   f"{total_mb}")
    import torch.multiprocessing as mp

    from .timing import environment
    state = bench_state(total_mb, dominant, n_small)
    tensors = [v for v in state.values() if isinstance(v, torch.Tensor)]
    info = {"bytes": sum(t.numel() * t.element_size() for t in tensors),
            "tensors": len(tensors),
            "largest_bytes": max(t.numel() * t.element_size() for t in tensors)}
    del state, tensors
    results = []
    load_before = os.getloadavg()
    world = max(w for _, w in configs)
    with tempfile.TemporaryDirectory(dir=directory) as root:
        out = os.path.join(root, "rows.json")
        cfg = {"configs": [list(c) for c in configs], "threads": threads, "repeats": repeats,
               "sync": sync,
               "root": root, "total_mb": total_mb, "dominant": dominant, "n_small": n_small}
        meet = "file://" + os.path.join(root, "rendezvous")    # no port to race for
        mp.spawn(_worker, args=(world, meet, cfg, out), nprocs=world, join=True)
        with open(out) as f:
            rows = json.load(f)
    for planner, w in configs:
        results.append(_summary(planner, w, rows[f"{planner}:{w}"]))
    restores = _restore_summary(rows["restore"]) if "restore" in rows else []
    one = next((r for r in results if r["ranks"] == 1), None)
    for r in results:
        r["speedup_vs_1_rank"] = one["save_s"] / r["save_s"] if one else None
    return {"environment": environment(), "state": info, "threads_per_rank": threads,
            "fsync": sync,
            "repeats": repeats, "loadavg_before": load_before, "loadavg_after": os.getloadavg(),
            "results": results, "restores": restores}


def table(result: dict) -> str:
    from .timing import format_table
    rows = []
    for r in result["results"]:
        rows.append({"ranks": r["ranks"], "planner": r["planner"], "save s": r["save_s"],
                     "speedup": r["speedup_vs_1_rank"], "load s": r["load_s"],
                     "MB per rank": " / ".join(f"{b / MB:.1f}" for b in r["rank_bytes"]),
                     "write s per rank": " / ".join(f"{s:.2f}" for s in r["rank_write_s"]),
                     "cpu s per rank": " / ".join(f"{s:.2f}" for s in r["rank_write_cpu_s"]),
                     "max/avg bytes": r["imbalance_bytes"], "max/avg time": r["imbalance_time"]})
    out = format_table(rows, ["ranks", "planner", "save s", "speedup", "load s", "MB per rank",
                              "write s per rank", "cpu s per rank", "max/avg bytes",
                              "max/avg time"])
    if result.get("restores"):
        rest = [{"checkpoint": r["checkpoint"], "ranks": r["ranks"], "restore s": r["restore_s"],
                 "speedup": r["speedup"],
                 "MB read per rank": " / ".join(f"{b / MB:.1f}" for b in r["rank_read_bytes"]),
                 "read / 1 rank's": r["read_over_one_rank"]} for r in result["restores"]]
        out += "\n\nrestores (\"2\": cooperative, the default: each item read and decoded by one " \
               "rank and written into the other's memory, or sent over the process group " \
               "where it cannot be; \"2 alone\": each rank reads all it needs)\n" + format_table(
                   rest, ["checkpoint", "ranks", "restore s", "speedup", "MB read per rank",
                          "read / 1 rank's"])
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description="Distributed save benchmark (1 vs 2 ranks, DCP's default planner vs the balanced one);")
    ap.add_argument("--total-mb", type=float, default=256)
    ap.add_argument("--dominant", type=float, default=0.8,
                    help="fraction of the state in the one large tensor")
    ap.add_argument("--small", type=int, default=200, help="number of small tensors")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1, help="compression threads per rank")
    ap.add_argument("--dir", default=None, help="where to write (default: a temp directory)")
    ap.add_argument("--no-fsync", action="store_true",
                    help="do not fsync the files (tells compression time from the disk's)")
    ap.add_argument("--json", default=None, help="write the result here too")
    a = ap.parse_args(argv)
    res = run(a.total_mb, a.dominant, a.small, a.repeats, a.threads, a.dir, sync=not a.no_fsync)
    s = res["state"]
    print(f"state: {s['bytes'] / 1e6:.1f} MB in {s['tensors']} tensors, largest "
          f"{s['largest_bytes'] / 1e6:.1f} MB; {res['threads_per_rank']} thread(s) per rank; "
          f"fsync {'on' if res['fsync'] else 'off'}; "
          f"load average before {res['loadavg_before'][0]:.2f}, after "
          f"{res['loadavg_after'][0]:.2f}")
    print(table(res))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(res, f, indent=1)
    return 0
