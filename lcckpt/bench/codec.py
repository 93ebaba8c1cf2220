"""Codec benchmark on real training trajectories (digits CNN, SGD and Adam; a wide MLP).

Prints readable tables and, with ``--json``, one JSON document. Sections:

* chain      - per checkpoint of a real run: bits/element after each stage (buckets,
               promotion, coding), order-0 entropy, every coder's size, ratio, error,
               accuracy of the restored model, zstd-1 on the same delta bytes;
* speed      - encode/decode MB/s on a ~20M-element fp32 delta of the wide MLP against
               zstd level 1 on the same bytes, in the same run (medians);
* dense      - the same MLP under Adam (a dense delta, every weight moves): lcckpt b=2
               against zstd-1 and zstd-3 on the same threads, interleaved, with a
               bytes-per-element traffic model of each pass against a numpy copy;
* default    - the default encoder (the chain's weight target) on that run's largest
               weight, whole and pass by pass, against the same traffic model;
* lossless   - the exact codec on trained weights (fp32 and bf16) against zstd 1/3 on raw
               and byte-grouped bytes;
* latency    - the first encode in a fresh process, Numba cache warm.

Run it as ``lcckpt bench`` or ``python benchmarks/codec.py`` ([--quick] [--json out.json]).
"""

import argparse
import contextlib
import io
import json
import os
import sys
import textwrap
import time

import numpy as np
import torch

import lcckpt
from lcckpt.codec.kernels.huffman import code_lengths
from lcckpt.bench.default import default_encode
from lcckpt.bench.dense import dense, lossless
from lcckpt.bench.timing import (MB, environment, format_table, latency, median_time,
                                 zstandard, zstd_compress)
from lcckpt.bench.trajectory import flat_float_params, train_trajectory

def _optimal_huffman_bits(counts: np.ndarray) -> int:
    """Bits of an optimal Huffman code of ``counts``: the length-limited code of at most
    16 symbols with a 32-bit limit never binds (a Huffman code of n symbols is at most
    n - 1 bits deep); the tests check these lengths against an independent heap Huffman
    (tests/oracles.py). A lone symbol costs a bit per element, as the coder counts it."""
    counts = np.asarray(counts, np.int64)
    if np.count_nonzero(counts) <= 1:
        return int(counts.sum())
    return int(counts @ code_lengths(counts, 32))


# --- chain -----------------------------------------------------------------------------

def _add_tensor(tot: dict, encs: dict, dec, name: str, u: np.ndarray, bits: int):
    """Code one tensor of one checkpoint with both coders, decode it, and add what the
    table counts to ``tot`` (nothing for a keyframe, which is not a delta). Returns the
    restored values."""
    ref_before = encs["auto"][name].ref
    ref_before = None if ref_before is None else ref_before.copy()
    delta = None if ref_before is None else (u - ref_before)
    blob_h, st_h = encs["huffman"][name].encode(u, report=True)
    blob_a, st = encs["auto"][name].encode(u, report=True)
    y = dec.decode(blob_a)
    assert np.array_equal(encs["huffman"][name].ref, encs["auto"][name].ref)
    if delta is None:
        return y
    tot["n"] += u.size
    tot["raw"] += u.nbytes
    tot["huff"] += len(blob_h)
    tot["huff_payload"] += st_h.payload_bytes
    tot["auto"] += len(blob_a)
    tot["auto_payload"] += st.payload_bytes
    tot["zstd"] += len(zstd_compress(delta.tobytes(), 1))
    tot["ent"] += st.symbol_entropy * u.size
    tot["bucket"] += st.bucket_entropy * u.size
    if "grouped" not in st.mode_bits:     # pruned as hopeless: measure it anyway
        _, sg = lcckpt.encode(delta, bits=bits, coder="grouped", report=True)
        tot["grouped"] += 8 * sg.payload_bytes
    else:
        tot["grouped"] += st.mode_bits["grouped"] * u.size
    tot["runs"] += st.mode_bits.get("runs", 0) * u.size
    tot["ideal"] += _optimal_huffman_bits(np.array(st.symbol_counts))
    tot["res"] += float(np.sum((u.astype(np.float64) - y) ** 2))
    tot["tgt"] += float(np.sum(u.astype(np.float64) ** 2))
    return y


def _chain_row(step: int, tot: dict, acc_true: float, acc: float) -> dict:
    n = tot["n"]
    row = {
        "step": step, "elements": n,
        "bucket_bpe": tot["bucket"] / n, "entropy_bpe": tot["ent"] / n,
        "huffman_bpe": 8 * tot["huff"] / n, "huffman_payload_bpe": 8 * tot["huff_payload"] / n,
        "ideal_huffman_bpe": tot["ideal"] / n,
        "grouped_bpe": tot["grouped"] / n, "runs_bpe": tot["runs"] / n,
        "auto_payload_bpe": 8 * tot["auto_payload"] / n, "auto_bpe": 8 * tot["auto"] / n,
        "ratio_huffman": tot["raw"] / tot["huff"], "ratio_auto": tot["raw"] / tot["auto"],
        "ratio_zstd1": tot["raw"] / tot["zstd"],
        "rel_error": float(np.sqrt(tot["res"] / tot["tgt"])),
        "acc_true": acc_true, "acc_restored": acc,
    }
    row["auto_vs_best"] = row["auto_payload_bpe"] / min(
        row["entropy_bpe"], row["grouped_bpe"], row["runs_bpe"])
    return row


def _chain_summary(rows: list, ntensors: int) -> dict:
    raw = sum(r["elements"] for r in rows) * 4
    return {
        "ratio_huffman": raw / sum(r["huffman_bpe"] * r["elements"] / 8 for r in rows),
        "ratio_auto": raw / sum(r["auto_bpe"] * r["elements"] / 8 for r in rows),
        "auto_vs_huffman": sum(r["huffman_bpe"] for r in rows) / sum(r["auto_bpe"] for r in rows),
        "huffman_payload_vs_ideal_max": max(r["huffman_payload_bpe"] / r["ideal_huffman_bpe"]
                                            for r in rows),
        "huffman_header_bytes_per_tensor": (sum(r["huffman_bpe"] - r["huffman_payload_bpe"]
                                                for r in rows) / len(rows))
        * rows[0]["elements"] / 8 / ntensors,
        "auto_vs_huffman_median": float(np.median([r["huffman_bpe"] / r["auto_bpe"]
                                                   for r in rows])),
        "auto_vs_best_max": max(r["auto_vs_best"] for r in rows),
    }


def chain(model, optimizer, steps, every, bits, log, traj=None):
    """Per checkpoint of a real run: bits per element after each stage, every coder's
    size, the restored error and accuracy, zstd-1 on the same delta bytes."""
    if traj is None:
        traj = train_trajectory(model=model, optimizer=optimizer, steps=steps,
                                snapshot_every=every)
    encs = {c: {} for c in ("huffman", "auto")}
    decs = {}
    rows = []
    for step, state in traj.snapshots:
        tot = dict(n=0, raw=0, huff=0, huff_payload=0, auto=0, auto_payload=0, ideal=0, zstd=0,
                   ent=0.0, bucket=0.0, grouped=0.0, runs=0.0, res=0.0, tgt=0.0)
        restored = {}
        for name, u in flat_float_params(state["model"]).items():
            for coder, d in encs.items():
                d.setdefault(name, lcckpt.DeltaEncoder(bits=bits, coder=coder))
            y = _add_tensor(tot, encs, decs.setdefault(name, lcckpt.DeltaDecoder()), name,
                            u.reshape(-1), bits)
            restored[name] = torch.from_numpy(np.array(y, copy=True))
        if tot["n"] == 0:
            continue
        acc = traj.accuracy({k: restored[k].reshape(v.shape) for k, v in state["model"].items()})
        rows.append(_chain_row(step, tot, traj.accuracy(state["model"]), acc))
    cols = ["step", "bucket_bpe", "entropy_bpe", "huffman_payload_bpe", "ideal_huffman_bpe",
            "huffman_bpe",
            "grouped_bpe", "runs_bpe", "auto_payload_bpe", "auto_bpe", "auto_vs_best",
            "ratio_huffman", "ratio_auto", "ratio_zstd1", "rel_error", "acc_true",
            "acc_restored"]
    log(f"\n## chain: {model}/{optimizer}, bits={bits}, deltas every {every} steps "
        f"({rows[0]['elements'] if rows else 0} parameters)")
    log(format_table(rows, cols))
    summary = _chain_summary(rows, len(flat_float_params(traj.snapshots[0][1]["model"])))
    log("summary: " + json.dumps({k: round(v, 4) if isinstance(v, float) else v
                                  for k, v in summary.items()}))
    return {"model": model, "optimizer": optimizer, "bits": bits, "rows": rows,
            "summary": summary}


# --- speed -----------------------------------------------------------------------------

def speed(steps, every, runs, log):
    traj = train_trajectory(model="mlp", optimizer="sgd", steps=steps, snapshot_every=every)
    (_, s0), (_, s1) = traj.snapshots[-2], traj.snapshots[-1]
    u0 = np.concatenate([v.reshape(-1) for v in flat_float_params(s0["model"]).values()])
    u1 = np.concatenate([v.reshape(-1) for v in flat_float_params(s1["model"]).values()])
    delta = u1 - u0
    raw = delta.tobytes()
    nbytes = len(raw)
    rows = []
    for coder in ("huffman", "auto"):
        lcckpt.decode(lcckpt.encode(delta, bits=2, coder=coder))          # warm
        blob = lcckpt.encode(delta, bits=2, coder=coder)
        te = median_time(lambda: lcckpt.encode(delta, bits=2, coder=coder), runs)
        td = median_time(lambda: lcckpt.decode(blob), runs)
        rows.append({"codec": f"lcckpt {coder} b=2", "ratio": nbytes / len(blob),
                     "enc_MBps": nbytes / te / MB, "dec_MBps": nbytes / td / MB})
    # the real step: delta against the reference, then the reference update
    enc = lcckpt.DeltaEncoder(bits=2)
    enc.encode(u0)
    ref0 = enc.ref.copy()
    t_step = median_time(lambda: enc.encode(u1), runs, setup=lambda: enc.ref.__setitem__(
        slice(None), ref0))
    rows.append({"codec": "DeltaEncoder step (auto)", "ratio": float("nan"),
                 "enc_MBps": nbytes / t_step / MB, "dec_MBps": float("nan")})
    for level, threads in ((1, 0), (1, 2)):
        z = zstd_compress(raw, level, threads)
        d = zstandard.ZstdDecompressor()
        te = median_time(lambda: zstd_compress(raw, level, threads), runs)
        td = median_time(lambda: d.decompress(z), runs)
        rows.append({"codec": f"zstd-{level}" + (f" ({threads} threads)" if threads else ""),
                     "ratio": nbytes / len(z), "enc_MBps": nbytes / te / MB,
                     "dec_MBps": nbytes / td / MB})
    z1 = rows[-2]
    for r in rows:
        r["enc_vs_zstd1"] = r["enc_MBps"] / z1["enc_MBps"]
        r["dec_vs_zstd1"] = r["dec_MBps"] / z1["dec_MBps"]
    log(f"\n## speed: wide-MLP delta, {delta.size:,} fp32 elements ({nbytes / MB:.0f} MB), "
        f"median of {runs}, {lcckpt.util.pool.threads()} threads")
    log(format_table(rows, ["codec", "ratio", "enc_MBps", "dec_MBps", "enc_vs_zstd1",
                            "dec_vs_zstd1"]))
    return {"elements": int(delta.size), "rows": rows}


def _say(msg: str) -> None:
    """A progress line on stderr: what the benchmark is doing now."""
    print(msg, file=sys.stderr, flush=True)


def run(quick: bool = False, bits: int = 2, log=print, say=_say, on_story=None) -> dict:
    """All sections; returns the JSON document. ``log`` gets the detailed tables, ``say``
    one progress line per phase, ``on_story`` the short story's data (``doc["story"]``,
    for :func:`story`) as soon as it is measured."""
    from lcckpt.bench.checkpoint import stream
    torch.manual_seed(0)
    t0 = time.time()
    lcckpt.DeltaEncoder(bits=bits)                 # bad bits fail now, not after training
    lcckpt.warmup()
    doc = {"environment": environment(), "quick": quick, "bits": bits, "chains": []}
    steps, every = (120, 10) if quick else (300, 10)
    say(f"[1/5] training a small CNN on handwritten digits ({steps} SGD steps, a checkpoint "
        f"every {every})")
    traj = train_trajectory(model="cnn", optimizer="sgd", steps=steps, snapshot_every=every,
                            progress=sys.stderr.isatty())
    say(f"[2/5] storing its {len(traj.snapshots)} checkpoints as torch.save, zstd, lcckpt "
        "lossless and delta chains, then restoring them")
    objs = [state for _, state in traj.snapshots]
    tfiles = []
    for o in objs:
        buf = io.BytesIO()
        torch.save(o, buf)
        tfiles.append(buf.getvalue())
    doc["story"] = stream(objs, tfiles, accuracy=lambda o: traj.accuracy(o["model"]),
                          desc="chains")
    doc["story"].update({"model": "cnn", "optimizer": "sgd", "steps": steps, "every": every})
    if on_story is not None:
        on_story(doc["story"])
    say("[3/5] per-checkpoint detail of the 2-bit deltas (SGD, then Adam)")
    doc["chains"].append(chain("cnn", "sgd", steps, every, bits, log, traj=traj))
    doc["chains"].append(chain("cnn", "adam", steps, every, bits, log))
    mlp_steps, mlp_every, runs = (10, 5, 3) if quick else (30, 10, 7)
    say("[4/5] speed on a 20M-element delta of a wide MLP, against zstd-1")
    doc["speed"] = speed(mlp_steps, mlp_every, runs, log)
    say("      and on a dense delta of the same MLP under Adam, against zstd-1 and zstd-3")
    doc["dense"] = dense(*((6, 3) if quick else (12, 4)), runs, log)
    say("      and the default encoder on that run's largest weight, pass by pass")
    doc["default"] = default_encode(*((6, 3) if quick else (12, 4)), runs, log)
    say("[5/5] lossless coding of trained weights, and first-call latency")
    w = np.concatenate([v.reshape(-1) for v in
                        flat_float_params(traj.snapshots[-1][1]["model"]).values()])
    mlp = train_trajectory(model="mlp", optimizer="sgd", steps=mlp_every, snapshot_every=mlp_every)
    wm = np.concatenate([v.reshape(-1) for v in
                         flat_float_params(mlp.snapshots[-1][1]["model"]).values()])
    w, wm = torch.from_numpy(w), torch.from_numpy(wm)
    doc["lossless"] = lossless({"cnn fp32": w, "cnn bf16": w.to(torch.bfloat16),
                                "mlp fp32": wm, "mlp bf16": wm.to(torch.bfloat16)}, runs, log)
    doc["latency"] = latency(log)
    doc["seconds"] = time.time() - t0
    log(f"\ntotal {doc['seconds']:.0f} s")
    return doc


_STORY_NAMES = {"lcckpt lossless (each file)": "lcckpt lossless",
                "zstd-1 of torch.save": "zstd-1 of each file",
                "zstd-3 of torch.save": "zstd-3 of each file",
                "zstd-3 of the exact delta": "zstd-3 of fp32 deltas",
                "lcckpt default": "chain, default targets",
                "LC-faithful b=2 (huffman)": "chain LC b=2, Huffman",
                "LC b=2": "chain LC b=2",
                "LC b=4": "chain LC b=4"}


def _cell(v, fmt: str) -> str:
    return v if isinstance(v, str) else ("-" if v is None else format(v, fmt))


def story(s: dict) -> str:
    """The short table and verdict of :func:`stream` on a training run, < 100 columns."""
    head = ["", "MB", "x smaller", "error", "error/step", "accuracy", "worst drop",
            "MB/s save/load"]
    cells = []
    for r in s["rows"]:
        exact = r.get("exact")
        acc = s["accuracy_true"] if exact else r["accuracy"]
        speed = "/".join(_cell(r.get(k), ".0f") for k in ("enc_MBps", "dec_MBps"))
        cells.append([_STORY_NAMES.get(r["method"], r["method"]), _cell(r["bytes"] / MB, ".2f"),
                      _cell(r["ratio"], ".1f") + "x",
                      "exact" if exact else _cell(r["err_state"], ".3f"),
                      "exact" if exact else _cell(r["err_vs_change"], ".2f"),
                      f"{100 * acc:.1f}%",
                      "0" if exact else f"{100 * r['accuracy_drop_max']:.1f} pt", speed])
    widths = [max(len(row[i]) for row in cells + [head]) for i in range(len(head))]
    table = "\n".join("  ".join(c.ljust(w) if i == 0 else c.rjust(w)
                                for i, (c, w) in enumerate(zip(row, widths))).rstrip()
                      for row in [head] + cells)
    by = {r["method"]: r for r in s["rows"]}
    d, z, lc = by["lcckpt default"], by["zstd-3 of torch.save"], by.get("LC b=2")
    wrap = lambda text: textwrap.fill(text, 92)                      # noqa: E731
    behind = (f"; at its worst checkpoint it was {100 * d['accuracy_drop_max']:.1f} points "
              "behind" if d["accuracy_drop_max"] > 0.005 else
              "; no restored checkpoint fell more than half a point behind the true model")
    versus = (f" LC-Checkpoint's own 2-bit coding is {lc['ratio']:.1f}x smaller than "
              f"torch.save but fell {100 * lc['accuracy_drop_max']:.1f} points behind at its "
              "worst checkpoint: the default bounds each tensor's restored error instead "
              "(docs/chain.md)." if lc else "")
    lines = [
        wrap(f"A small CNN learns handwritten digits: {s['files']} checkpoints of its weights "
             f"and SGD momentum ({s['float_elements']:,} floats), one every {s['every']} steps. "
             f"Sizes are of the {s['deltas']} checkpoints after the first (in a chain, the "
             "deltas); x smaller is against torch.save."),
        wrap("error: ||restored - true|| / ||true|| of all floating state, worst checkpoint. "
             "error/step: that error over how far the state moved since the previous "
             "checkpoint (above 1, the delta kept less than the step). accuracy: of the "
             "last restored model on held-out digits; worst drop: the largest fall below the "
             "true model's accuracy at any checkpoint."),
        "",
        table,
        "",
        wrap(f"Verdict: the default chain stores these checkpoints {d['ratio']:.1f}x "
             f"smaller than torch.save ({z['bytes'] / d['bytes']:.1f}x smaller than zstd-3), and "
             f"the last restored model scores {100 * d['accuracy']:.1f}% against the true "
             f"model's {100 * s['accuracy_true']:.1f}%{behind}." + versus),
        wrap("Speeds on files this small are mostly per-file overhead (and a disk sync per "
             "save); the JSON's 'speed' section times a 20M-element delta."),
    ]
    return "\n".join(lines)


def _plot_story(s: dict, a, b) -> None:
    """Each chain setting of the summary, checkpoint by checkpoint: kB on disk (``a``) and
    restored accuracy beside the true model's (``b``)."""
    true = s.get("accuracy_true_per_file")
    if true is not None:                       # under the chains, which mostly sit on it
        b.plot(range(1, len(true) + 1), [100 * t for t in true], color="lightgrey", lw=4,
               label="true model")
    for r in s["rows"]:
        if "per_file" not in r:
            if r["method"] == "torch.save":
                a.axhline(r["bytes"] / s["deltas"] / 1e3, color="grey", ls="--",
                          label="torch.save (mean)")
            continue
        x = list(range(2, len(r["per_file"]) + 2))
        line, = a.plot(x, [f["bytes"] / 1e3 for f in r["per_file"]], marker="o", ms=3,
                       label=r["method"])
        if true is not None:
            b.plot(x, [100 * f["accuracy"] for f in r["per_file"]], marker="o", ms=3,
                   color=line.get_color(), label=r["method"])
    a.set_yscale("log")
    a.set_ylabel("kB on disk per checkpoint")
    a.set_title(f"{s.get('model', '')} / {s.get('optimizer', '')}: every chain setting")
    b.set_ylabel("held-out accuracy (%)")
    b.set_title("restored checkpoints against the true model")
    for ax in (a, b):
        ax.set_xlabel("checkpoint")
        ax.legend(fontsize=7)


def plot(doc: dict, path: str):
    """The summary's chains checkpoint by checkpoint (the default first among them), then
    bits per element and restored accuracy along each LC chain, drawn from the JSON."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as e:
        raise ImportError("plots need matplotlib: pip install 'lcckpt[plot]'") from e
    chains = doc["chains"]
    top = 1 if "story" in doc else 0
    cols = max(2, len(chains)) if top else len(chains)
    fig, axes = plt.subplots(2 + top, cols, figsize=(6 * cols, 3.5 * (2 + top)),
                             squeeze=False)
    if top:
        _plot_story(doc["story"], axes[0][0], axes[0][1])
        for ax in axes[0][2:]:
            ax.axis("off")
    for col, ch in enumerate(chains):
        rows = ch["rows"]
        steps = [r["step"] for r in rows]
        ax = axes[top][col]
        for key, label in (("huffman_bpe", "LC faithful (Huffman)"), ("grouped_bpe", "grouped"),
                           ("runs_bpe", "zero runs"), ("auto_bpe", "auto (whole blob)"),
                           ("entropy_bpe", "order-0 entropy")):
            ax.plot(steps, [r[key] for r in rows], marker="o", ms=3, label=label)
        ax.set_title(f"{ch['model']} / {ch['optimizer']}, b={ch['bits']}")
        ax.set_ylabel("bits per element")
        ax.legend(fontsize=8)
        ax = axes[top + 1][col]
        ax.plot(steps, [100 * r["acc_true"] for r in rows], marker="o", ms=3, label="true model")
        ax.plot(steps, [100 * r["acc_restored"] for r in rows], marker="o", ms=3,
                label=f"restored from the LC b={ch['bits']} chain")
        ax.set_xlabel("training step")
        ax.set_ylabel("held-out accuracy (%)")
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def plot_stream(s: dict, path: str):
    """Bytes and error per checkpoint for each chain setting of :func:`stream`'s result."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as e:
        raise ImportError("plots need matplotlib: pip install 'lcckpt[plot]'") from e
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    for r in s["rows"]:
        if "per_file" not in r:
            if r["method"] in ("torch.save", "zstd-3 of torch.save"):
                a.axhline(r["bytes"] / s["deltas"] / 1e3, color="grey",
                          ls=":" if "zstd" in r["method"] else "--",
                          label=f"{r['method']} (mean)")
            continue
        x = list(range(2, len(r["per_file"]) + 2))
        line, = a.plot(x, [f["bytes"] / 1e3 for f in r["per_file"]], marker="o", ms=3,
                       label=r["method"])
        b.plot(x, [f["err_vs_change"] for f in r["per_file"]], marker="o", ms=3,
               color=line.get_color(), label=f"{r['method']}: all state")
        b.plot(x, [f["worst_tensor_err_vs_change"] for f in r["per_file"]], ls="--",
               color=line.get_color(), label="  worst tensor")
    for ax in (a, b):
        ax.set_xlabel("checkpoint (delta on the one before)")
        ax.set_yscale("log")
        ax.xaxis.get_major_locator().set_params(integer=True)
    a.set_ylabel("kB on disk")
    a.legend(fontsize=7)
    b.axhline(1, color="grey", lw=0.8)
    b.set_ylabel("error / step (1 = as far as the previous state)")
    b.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def add_arguments(ap: argparse.ArgumentParser) -> None:
    """The benchmark's options (shared by ``lcckpt bench`` and benchmarks/codec.py)."""
    ap.add_argument("--checkpoint", nargs="+", metavar="FILE",
                    help="benchmark your own checkpoints instead (.pt, .safetensors, .lcc): one "
                         "file for the lossless codec, two or more files of one run, oldest "
                         "first, for the delta chain")
    ap.add_argument("--error-bound", type=float, action="append", default=[], metavar="E",
                    help="with --checkpoint: also a 2-bit chain whose every delta keeps the "
                         "relative error of the state within E (repeatable)")
    ap.add_argument("--quick", action="store_true", help="short version (make demo)")
    ap.add_argument("--tables", action="store_true",
                    help="print every detailed table, not only the summary")
    ap.add_argument("--json", metavar="PATH", nargs="?", const="-",
                    help="write the full JSON document here; without PATH (or '-') print "
                         "it, the tables going to stderr")
    ap.add_argument("--plot", metavar="PATH", help="draw the results (PNG)")
    ap.add_argument("--bits", type=int, default=2, choices=range(1, 5), metavar="{1..4}",
                    help="bits per delta element of the detailed chain tables (default 2)")


def run_cli(args) -> int:
    """Run what ``args`` (from :func:`add_arguments`) asks for; print, write JSON and plot.
    ``--json`` alone prints the document to stdout, alone there (as inspect's does)."""
    if args.json != "-":
        _run_cli(args, hint=True)
        return 0
    with contextlib.redirect_stdout(sys.stderr):
        args.json = None
        doc = _run_cli(args, hint=False)
    json.dump(doc, sys.stdout, indent=1, default=float)
    sys.stdout.write("\n")
    return 0


def _run_cli(args, hint: bool) -> dict:
    """The run, its tables printed and its document written or drawn; the document."""
    from lcckpt.bench import checkpoint
    for e in args.error_bound:
        if not 0 < e < 1:
            raise lcckpt.InvalidArgumentError(f"--error-bound must be in (0, 1), got {e}")
    if args.error_bound and not args.checkpoint:
        raise lcckpt.InvalidArgumentError("--error-bound applies to --checkpoint runs")
    for out in (args.json, args.plot):
        parent = os.path.dirname(os.path.abspath(out)) if out else None
        if parent and not os.path.isdir(parent):
            raise FileNotFoundError(2, "no such directory for the output", parent)
    if args.checkpoint:
        from lcckpt.interop.trainerdir import in_step_order   # checkpoint-N: by their steps
        doc = checkpoint.run(in_step_order(args.checkpoint), error_bounds=args.error_bound)
    else:
        doc = run(args.quick, args.bits, log=print if args.tables else (lambda *a: None),
                  on_story=lambda s: print(story(s) + "\n", flush=True))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(doc, f, indent=1, default=float)
    if args.plot:
        if "stream" in doc:
            plot_stream(doc["stream"], args.plot)
        elif "chains" in doc:
            plot(doc, args.plot)
        else:
            print("(one file: nothing to plot)", file=sys.stderr)
            args.plot = None
    wrote = [f"full JSON: {args.json}" if args.json else None,
             f"plot: {args.plot}" if args.plot else None]
    if any(wrote):
        print("\n" + "; ".join(w for w in wrote if w))
    elif not args.checkpoint and hint:
        print("\n(--json PATH and --plot PATH keep every number and draw them)")
    return doc


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="lcckpt bench", description=__doc__.splitlines()[0])
    add_arguments(ap)
    return run_cli(ap.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
