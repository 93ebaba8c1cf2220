"""Checkpoint save/restore benchmark: DeltaCheckpointer against lcckpt.save and torch.save.

The state is a real model with its Adam state: the ~20M-parameter MLP trained on digits
(``train_trajectory(model="mlp", optimizer="adam", steps=22, snapshot_every=2)``; the
snapshots after steps 2, 4, ..., 22, ~245 MB each with exp_avg and exp_avg_sq: the first
is the keyframe, the other 10 the deltas); with ``--model minilm`` the pretrained
all-MiniLM-L6-v2 fine-tuned with AdamW on the docstring task (lcckpt/bench/finetune.py;
the snapshots after steps 3, 6, ..., 33, ~272 MB each); or the small CNN with ``--quick``.
Everything is written into one temp directory on the same filesystem. Every timed save
and load starts with no dirty pages (``os.sync()`` before it, untimed): on a small machine
the kernel's writeback of earlier saves otherwise competes for the CPU with whatever is
timed next, so the order of the measurements would decide the numbers.

Measured (medians of several runs, page cache warm for loads):

* save time of a DeltaCheckpointer delta step (the 10 deltas after the keyframe) and of a
  keyframe; of ``lcckpt.save`` raw and with ``compress=True``; of ``torch.save`` (plain,
  and followed by an fsync, since every lcckpt write is fsynced and atomic); and how far
  into a DeltaCheckpointer save its state was released (``save(..., released=)``: read
  no more, so a writer from the live state may let training go on; the file's sync and
  commit follow); each delta save is followed by ``torch.save`` + fsync of the same state,
  timed, so that the delta's ratio comes from rounds taken in turn, as the keyframes' do;
* restore time of the keyframe plus 10 deltas (``DeltaCheckpointer.load`` of the last
  step) against ``torch.load`` and ``lcckpt.load``, and the time to read those 11 files
  (checksums checked, nothing decoded), the loads taking turns round by round (a slow
  spell of the machine then hits all of them);
* quantization passes of each delta save: the elements the uniform quantizer's step
  search quantized, and those quantized again as they are coded (tensors whose symbols
  are not held), over the floats tracked (0 with ``--bits``);
* bytes on disk of each, split into parameters, exp_avg, exp_avg_sq and the rest (step
  counters, param_groups, header), from the per-section sizes in the container header
  (torch.save stores tensor bytes as they are: its parts are the tensors' sizes).

Usage: python benchmarks/save.py [--model mlp|minilm|cnn] [--quick] [--bits B] [--error-bound E]
       [--keyframe-coding lossless|raw] [--json out.json]
"""

import argparse
import json
import itertools
import os
import shutil
import statistics
import sys
import tempfile
import time

import torch

import lcckpt
from lcckpt.codec import uniform as _uniform
from lcckpt.bench.timing import environment, format_table
from lcckpt.bench.trajectory import train_trajectory
from lcckpt.format.container import read_container

PARTS = ("params", "exp_avg", "exp_avg_sq", "other")
MB = 1e6


def _part(section_name: str) -> str:
    if section_name.startswith('obj["model"]'):
        return "params"
    if section_name.endswith('["exp_avg"]'):
        return "exp_avg"
    if section_name.endswith('["exp_avg_sq"]'):
        return "exp_avg_sq"
    return "other"


def lcckpt_parts(path: str) -> dict:
    """Bytes per part of an lcckpt file; header and padding count as "other"."""
    out = dict.fromkeys(PARTS, 0)
    with read_container(path) as c:
        for s in c.sections:
            out[_part(s["name"])] += s["length"]
    out["other"] += os.path.getsize(path) - sum(out.values())
    return out


def _nbytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def torch_parts(state: dict, total: int) -> dict:
    """Bytes per part of torch.save, which stores every tensor's bytes as they are (an
    uncompressed zip member per storage); the pickle and zip records are "other"."""
    st = state["optim"]["state"]
    out = {
        "params": _nbytes(state["model"].values()),
        "exp_avg": _nbytes(v["exp_avg"] for v in st.values()),
        "exp_avg_sq": _nbytes(v["exp_avg_sq"] for v in st.values()),
    }
    out["other"] = total - sum(out.values())
    return out


def part_elements(state: dict) -> dict:
    st = state["optim"]["state"]
    return {
        "params": sum(v.numel() for v in state["model"].values()),
        "exp_avg": sum(v["exp_avg"].numel() for v in st.values()),
        "exp_avg_sq": sum(v["exp_avg_sq"].numel() for v in st.values()),
    }


def measure_interleaved(fns: dict, rounds: int, before, per_round=None) -> dict:
    """Median seconds of each call, the calls taking turns round by round: on a noisy
    machine a slow spell then hits every contender, not only the one measured during it.
    ``per_round``: the seconds of every round are appended to it, one dict per round."""
    times = {k: [] for k in fns}
    for _ in range(rounds):
        for k, fn in fns.items():
            before()
            t = time.perf_counter()
            fn()
            times[k].append(time.perf_counter() - t)
        if per_round is not None:
            per_round.append({k: v[-1] for k, v in times.items()})
    return {k: statistics.median(v) for k, v in times.items()}


def round_ratios(per_round: list, a: str, b: str) -> dict:
    """``a``'s time over ``b``'s in each round: median, lowest and highest."""
    r = [x[a] / x[b] for x in per_round]
    return {"median": statistics.median(r), "min": min(r), "max": max(r)}


def _count_quantized() -> list:
    """Count the elements the uniform quantizer quantizes (its step search's tries, and
    the chunks of a tensor whose symbols are not held, quantized again as they are coded)
    into the returned one-element list, for the rest of the process: per save, over the
    floats tracked, the number of quantization passes."""
    count = [0]
    real, again = _uniform._try_step, _uniform.Uniform.chunk_symbols

    def counting(u, *args, **kwargs):
        count[0] += u.size
        return real(u, *args, **kwargs)

    def counting_again(self, c, out):
        cs = self.quantizer.chunk_size
        count[0] += min(cs, self.source.size - c * cs)
        return again(self, c, out)
    _uniform._try_step = counting
    _uniform.Uniform.chunk_symbols = counting_again
    return count


def _read_files(paths):
    """Read every section of every file, checksums checked, decoding nothing: the floor
    of a restore's time that the format sets."""
    for path in paths:
        with read_container(path) as c:
            for i in range(len(c.sections)):
                c.data(i)


def _fsync_save(obj, path):
    with open(path, "wb") as f:
        torch.save(obj, f)
        f.flush()
        os.fsync(f.fileno())


def _trajectory(model: str, deltas: int):
    """``(snapshots, model name, optimizer name)``: the digits CNN or MLP under Adam, a
    snapshot every 2 steps, or the MiniLM-L6 fine-tune under AdamW, one every 3."""
    if model == "minilm":
        from lcckpt.bench.finetune import finetune_trajectory
        traj = finetune_trajectory(steps=3 * (deltas + 1), snapshot_every=3)
        return traj.snapshots, "all-MiniLM-L6-v2 fine-tune", "adamw"
    traj = train_trajectory(model=model, optimizer="adam", steps=2 * (deltas + 1),
                            snapshot_every=2)
    return traj.snapshots, traj.model_name, traj.optimizer_name


def run(model: str = "mlp", bits: int | None = None, deltas: int = 10,
        error_bound: float | None = None, keyframe_coding: str = "lossless") -> dict:
    # Adam's state is empty before the first step, so the chain starts at the snapshot
    # after the first steps (keyframe) and the deltas are the next `deltas` snapshots:
    # every file then holds parameters and both moments
    t0 = time.perf_counter()
    all_snaps, model_name, optimizer_name = _trajectory(model, deltas)
    train_s = time.perf_counter() - t0
    snaps = all_snaps[1: deltas + 2]
    del all_snaps
    assert len(snaps) == deltas + 1 and all(s["optim"]["state"] for _, s in snaps)
    state = snaps[-1][1]          # the object the single-file formats save: the last step
    elements = part_elements(state)
    raw_bytes = sum(v.numel() * v.element_size() for v in state["model"].values()) + sum(
        t.numel() * t.element_size() for s in state["optim"]["state"].values() for t in s.values())
    lcckpt.warmup()
    runs = dict(min_runs=5, max_runs=5, min_time=0.0, before=os.sync)

    rows, details = [], {}
    root = tempfile.mkdtemp(prefix="lcckpt-bench-")
    try:
        # ---- DeltaCheckpointer: one keyframe, then `deltas` deltas
        chain_dir = os.path.join(root, "chain")
        ck = lcckpt.DeltaCheckpointer(chain_dir, bits=bits, keyframe_every=None,
                                      error_bound=error_bound, keyframe_coding=keyframe_coding)
        k_step = snaps[0][0]
        ck.save(k_step, snaps[0][1])
        key_parts = lcckpt_parts(ck.path(k_step))
        delta_times, delta_parts, delta_errors, delta_passes = [], [], [], []
        released = {"delta": [], "keyframe": [], "later keyframe": []}   # s into the save

        def timing(kind):
            t0 = time.perf_counter()
            return lambda: released[kind].append(time.perf_counter() - t0)
        quantized = _count_quantized()
        delta_rounds = []          # each delta save and torch.save + fsync of the same state
        for step, snap in snaps[1:]:
            os.sync()
            quantized[0] = 0
            t = time.perf_counter()
            ck.save(step, snap, released=timing("delta"))
            delta_times.append(time.perf_counter() - t)
            os.sync()
            t = time.perf_counter()
            _fsync_save(snap, os.path.join(root, "delta-turn.pt"))
            delta_rounds.append({"delta": delta_times[-1],
                                 "torch+fsync": time.perf_counter() - t})
            delta_passes.append(quantized[0] / sum(elements.values()))
            delta_parts.append(lcckpt_parts(ck.path(step)))
            errs = {}
            for key, st in ck.info(step)["tensors"].items():   # the writer's own report
                p = _part(key)
                errs[p] = max(errs.get(p, 0.0), st["rel_error"] or 0.0)
            delta_errors.append({"step": step, **{f"{p} max rel_err": errs.get(p)
                                                  for p in PARTS[:3]}})
        assert all(ck.info(s)["kind"] == "delta" for s, _ in snaps[1:])
        last = snaps[-1][0]
        restored = ck.load(last)
        rel = {}
        for part, get in (("params", lambda s: list(s["model"].values())),
                          ("exp_avg", lambda s: [v["exp_avg"] for v in s["optim"]["state"].values()]),
                          ("exp_avg_sq", lambda s: [v["exp_avg_sq"] for v in s["optim"]["state"].values()])):
            a = torch.cat([t.reshape(-1).double() for t in get(restored)])
            b = torch.cat([t.reshape(-1).double() for t in get(state)])
            rel[part] = float((a - b).norm() / b.norm())

        # every save below takes turns round by round with the others (a slow spell of the
        # machine then hits each of them), starting with no dirty pages. A keyframe is
        # timed twice: as the first save of a new DeltaCheckpointer (its references are
        # fresh memory) and as a later keyframe of a running one (keyframe_every=1: every
        # save a keyframe, into references that already exist, as in a long run)
        kf_dir, run_dir = os.path.join(root, "kf"), os.path.join(root, "running")
        running = lcckpt.DeltaCheckpointer(run_dir, bits=bits, keyframe_every=1,
                                           error_bound=error_bound,
                                           keyframe_coding=keyframe_coding)
        running.save(0, snaps[0][1])
        later_step = itertools.count(1)
        paths = {n: os.path.join(root, n) for n in ("raw.lcc", "z.lcc", "t.pt", "tf.pt")}

        def tidy():
            shutil.rmtree(kf_dir, ignore_errors=True)
            for st in running.steps()[:-1]:          # keep the disk use to one state
                os.remove(running.path(st))
            os.sync()

        save_rounds, load_rounds = [], []
        saves = measure_interleaved({
            "keyframe": lambda: lcckpt.DeltaCheckpointer(
                kf_dir, bits=bits, error_bound=error_bound,
                keyframe_coding=keyframe_coding).save(k_step, snaps[0][1],
                                                      released=timing("keyframe")),
            "later keyframe": lambda: running.save(next(later_step), snaps[0][1],
                                                   released=timing("later keyframe")),
            "torch+fsync": lambda: _fsync_save(state, paths["tf.pt"]),
            "torch": lambda: torch.save(state, paths["t.pt"]),
            "raw": lambda: lcckpt.save(state, paths["raw.lcc"]),
            "z": lambda: lcckpt.save(state, paths["z.lcc"], compress=True),
        }, rounds=runs["max_runs"], before=tidy, per_round=save_rounds)
        assert all(running.info(st)["kind"] == "keyframe" for st in running.steps())
        running.close()
        shutil.rmtree(kf_dir, ignore_errors=True)
        shutil.rmtree(run_dir, ignore_errors=True)

        mean_delta = {p: statistics.mean(d[p] for d in delta_parts) for p in PARTS}
        rows.append(_row("DeltaCheckpointer delta (mean of %d)" % deltas,
                         statistics.median(delta_times), None, mean_delta))
        torch_total = os.path.getsize(paths["t.pt"])
        t_parts = torch_parts(state, torch_total)

        # ---- loads, interleaved round by round so that each sees the same machine state
        loads = measure_interleaved({
            "restore": lambda: ck.load(last),
            "read": lambda: _read_files([ck.path(st) for st, _ in snaps]),
            "raw": lambda: lcckpt.load(paths["raw.lcc"]),
            "z": lambda: lcckpt.load(paths["z.lcc"]),
            "torch": lambda: torch.load(paths["t.pt"], weights_only=True),
        }, rounds=runs["max_runs"], before=os.sync, per_round=load_rounds)
        rows.append(_row("DeltaCheckpointer keyframe", saves["keyframe"], None, key_parts))
        rows.append(_row("DeltaCheckpointer later keyframe", saves["later keyframe"], None,
                         None))
        rows.append(_row("DeltaCheckpointer restore K+%d" % deltas, None, loads["restore"],
                         None))
        rows.append(_row("  of which: reading its %d files (checked)" % (deltas + 1), None,
                         loads["read"], None))
        rows.append(_row("lcckpt.save raw", saves["raw"], loads["raw"],
                         lcckpt_parts(paths["raw.lcc"])))
        rows.append(_row("lcckpt.save compress=True", saves["z"], loads["z"],
                         lcckpt_parts(paths["z.lcc"])))
        rows.append(_row("torch.save", saves["torch"], loads["torch"], t_parts))
        rows.append(_row("torch.save + fsync", saves["torch+fsync"], None, None))
    finally:
        shutil.rmtree(root, ignore_errors=True)

    for r in rows:
        if r["bytes"] is not None:
            r["vs_torch"] = torch_total / r["bytes"]
            for p in ("params", "exp_avg", "exp_avg_sq"):
                r[f"{p}_bits/el"] = 8 * r[p] / elements[p] if elements[p] else None
    details.update(
        config={"model": model_name, "optimizer": optimizer_name, "bits": bits,
                "error_bound": error_bound,
                "deltas": deltas, "steps": [s for s, _ in snaps], "state_bytes": raw_bytes,
                "elements": elements, "train_s": train_s},
        delta_save_s=delta_times,
        released_s={k: statistics.median(v) for k, v in released.items()},
        delta_passes=delta_passes,
        delta_errors=delta_errors,
        restored_rel_error=rel,
        torch_parts=t_parts,
        rounds={"saves": save_rounds, "loads": load_rounds},
        versus=[{"what": what, "against": b, **round_ratios(rs, a, b)} for what, rs, a, b in (
            ("delta save", delta_rounds, "delta", "torch+fsync"),
            ("keyframe save", save_rounds, "keyframe", "torch+fsync"),
            ("later keyframe save", save_rounds, "later keyframe", "torch+fsync"),
            ("restore K+%d" % deltas, load_rounds, "restore", "torch"))],
    )
    return {"environment": environment(), "rows": rows, **details}


def _row(name, save_s, load_s, parts):
    row = {"what": name, "save_s": save_s, "load_s": load_s, "bytes": None}
    if parts is not None:
        row["bytes"] = sum(parts.values())
        row.update(parts)
    return row


def report(res: dict) -> str:
    cfg = res["config"]
    lines = [
        f"{cfg['model']} + {cfg['optimizer']}: {sum(cfg['elements'].values()) / 1e6:.1f}M "
        f"floats tracked, state {cfg['state_bytes'] / MB:.1f} MB; "
        f"{'default targets' if cfg['bits'] is None else 'LC bits=%d' % cfg['bits']}, "
        f"error_bound={cfg['error_bound']}; "
        f"chain: keyframe at step {cfg['steps'][0]}, deltas at {cfg['steps'][1:]}",
        "",
        format_table(res["rows"], ["what", "save_s", "load_s", "bytes", "vs_torch"]),
        "",
        "bytes on disk per part (DeltaCheckpointer delta: mean per delta file)",
        format_table([r for r in res["rows"] if r["bytes"] is not None],
                     ["what", "params", "exp_avg", "exp_avg_sq", "other",
                      "params_bits/el", "exp_avg_bits/el", "exp_avg_sq_bits/el"]),
        "",
        "per delta: relative L2 error of each part's worst tensor (from the file headers)",
        format_table(res["delta_errors"], list(res["delta_errors"][0])),
        "",
        "time over the baseline's, round by round (the issue's bar: <= 1.0)",
        format_table([{**v, "against": {"torch+fsync": "torch.save + fsync",
                                        "torch": "torch.load"}[v["against"]]}
                      for v in res["versus"]], ["what", "against", "median", "min", "max"]),
        "",
        "delta save times (s): " + ", ".join(f"{t:.3f}" for t in res["delta_save_s"]),
        "state released (read no more; the sync and commit follow) after, median s: "
        + ", ".join(f"{k} {v:.3f}" for k, v in res["released_s"].items()),
        "quantization passes per delta save (elements quantized / floats tracked): "
        + ", ".join(f"{p:.2f}" for p in res["delta_passes"]),
        "restored last step vs true state, relative L2 error: "
        + ", ".join(f"{k} {v:.2e}" for k, v in res["restored_rel_error"].items()),
        f"cpu: {res['environment']['cpu']} ({res['environment']['cpu_count']} cores), "
        f"torch {res['environment']['torch']}, threads {torch.get_num_threads()}",
    ]
    return "\n".join(lines)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", choices=("mlp", "minilm", "cnn"), default="mlp",
                    help="the 20M-parameter MLP under Adam (default), the all-MiniLM-L6-v2 "
                         "fine-tune under AdamW (needs the finetune extra), or the small CNN")
    ap.add_argument("--quick", action="store_true", help="the small CNN (--model cnn)")
    ap.add_argument("--bits", type=int, default=None,
                    help="LC-Checkpoint deltas at this many bits (default: the library's "
                         "default, error targets per tensor role)")
    ap.add_argument("--error-bound", type=float, default=None,
                    help="cap on each tensor's relative error (more bits, then exact)")
    ap.add_argument("--keyframe-coding", choices=("lossless", "raw"), default="lossless",
                    help="how the DeltaCheckpointer stores its keyframe")
    ap.add_argument("--json", metavar="OUT", help="also write the results as JSON")
    args = ap.parse_args(argv)
    res = run("cnn" if args.quick else args.model, args.bits, error_bound=args.error_bound,
              keyframe_coding=args.keyframe_coding)
    print(report(res))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
