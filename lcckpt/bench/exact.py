"""Exact-codec benchmark: lcckpt's lossless blobs against ZipNN and zstd on trained weights.

The weights come from a real run: the ~20M-parameter wide MLP of
:mod:`lcckpt.bench.trajectory`, trained with Adam on the digits set, all its tensors
concatenated (as a compressor of a whole weight file sees them), in fp32, bf16 and
fp16; or (``--weights minilm``, the ``finetune`` extra) the pretrained
all-MiniLM-L6-v2's own weights, concatenated the same way; or (``--weights minilm-adamw``)
AdamW's moments after three steps of its fine-tune, mostly zeros in the word embeddings. Every codec gets the same thread count (lcckpt's pool, ZipNN's ``threads``,
zstd's compression workers; zstd decompresses on one thread).

Timing is interleaved: each repetition calls every codec's encode, then every decode,
one after the other, and the report gives medians and, per repetition, the speed of
lcckpt relative to ZipNN measured back to back (the median of those ratios). On a
machine shared with other work that ratio is far steadier than absolute MB/s.

The traffic model counts the bytes per element that lcckpt's fast path moves through
memory: encode reads the words twice (the pass that codes each chunk's exponents and
the pass that writes the blob) and writes the blob once; decode reads the blob and
writes the words.
This module measures; it changes nothing in the codec.
"""

from __future__ import annotations

import os
import statistics
import time

import numpy as np
import torch

import lcckpt
from lcckpt.util import pool as _pool
from lcckpt.bench.timing import environment, format_table
from lcckpt.bench.trajectory import flat_float_params, train_trajectory
from lcckpt.codec.dtypes import to_numpy
from lcckpt.errors import InvalidArgumentError

MB = 1e6
_ZIPNN_DTYPE = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}
_TORCH_DTYPE = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def pretrained_weights() -> torch.Tensor:
    """Every floating tensor of the pretrained all-MiniLM-L6-v2, as one fp32 vector."""
    from lcckpt.bench.finetune import load_encoder
    sd = load_encoder()[0].state_dict()
    return torch.cat([v.reshape(-1) for v in sd.values() if v.is_floating_point()])


def adamw_moments(steps: int = 3) -> torch.Tensor:
    """AdamW's moments (``exp_avg``, then ``exp_avg_sq``, of every parameter) after
    ``steps`` steps of the MiniLM-L6 docstring fine-tune, as one fp32 vector: the word
    embeddings' rows of tokens no batch used hold exact zeros (a sparse plane)."""
    from lcckpt.bench.finetune import finetune_trajectory
    optim = finetune_trajectory(steps=steps, snapshot_every=steps).snapshots[-1][1]["optim"]
    return torch.cat([st[k].reshape(-1) for k in ("exp_avg", "exp_avg_sq")
                      for st in optim["state"].values()])


def trained_weights(steps: int = 30, seed: int = 0) -> torch.Tensor:
    """Every parameter of the wide MLP after ``steps`` Adam steps, as one fp32 vector."""
    traj = train_trajectory("mlp", "adam", steps=steps, snapshot_every=max(steps, 1), seed=seed)
    params = flat_float_params(traj.snapshots[-1][1]["model"])
    return torch.from_numpy(np.concatenate([v.reshape(-1) for v in params.values()]))


class _Codec:
    """encode() -> blob, decode(blob) -> bytes-like, both timed by the caller."""

    def __init__(self, name, encode, decode, prepare=None):
        self.name, self.encode, self.decode = name, encode, decode
        self.prepare = prepare or (lambda: None)       # untimed, before every encode


def _codecs(t: torch.Tensor, label: str, threads: int) -> list:
    raw = to_numpy(t)[0].tobytes()
    out = [_Codec("lcckpt", lambda _: lcckpt.encode(t, lossless=True),
                  lambda b: to_numpy(lcckpt.decode(b))[0])]
    try:
        import zipnn
    except ImportError:
        zipnn = None
    if zipnn is not None:
        z = zipnn.ZipNN(input_format="byte", bytearray_dtype=_ZIPNN_DTYPE[label], threads=threads)
        src = {}

        def prepare():                 # ZipNN 0.5 rewrites its input buffer in place
            src["b"] = bytearray(raw)
        out.append(_Codec("zipnn", lambda _: z.compress(src["b"]), z.decompress, prepare))
    try:
        import zstandard
    except ImportError:
        zstandard = None
    if zstandard is not None:
        zc = zstandard.ZstdCompressor(level=1, threads=threads)
        zd = zstandard.ZstdDecompressor()
        out.append(_Codec("zstd-1", lambda _: zc.compress(raw), zd.decompress))
    return out, raw


def _traffic(item: int, ratio: float) -> dict:
    blob = item / ratio
    return {"encode_bytes_per_element": 2 * item + blob, "decode_bytes_per_element": blob + item}


def bench_dtype(t: torch.Tensor, label: str, reps: int, threads: int, log=print) -> dict:
    """One dtype: every codec's ratio and interleaved encode/decode timings."""
    codecs, raw = _codecs(t, label, threads)
    nbytes, n = len(raw), t.numel()
    blobs, ok = {}, {}
    for c in codecs:                               # warm up, and check every round trip
        c.prepare()
        blobs[c.name] = c.encode(None)
        ok[c.name] = bytes(memoryview(c.decode(blobs[c.name])).cast("B")) == raw
    enc = {c.name: [] for c in codecs}
    dec = {c.name: [] for c in codecs}
    for _ in range(reps):
        for c in codecs:
            c.prepare()
            t0 = time.perf_counter()
            c.encode(None)
            enc[c.name].append(time.perf_counter() - t0)
        for c in codecs:
            t0 = time.perf_counter()
            c.decode(blobs[c.name])
            dec[c.name].append(time.perf_counter() - t0)
    rows = []
    for c in codecs:
        ratio = nbytes / len(blobs[c.name])
        row = {"data": label, "codec": c.name, "ratio": ratio, "roundtrip_ok": ok[c.name],
               "enc_MBps": nbytes / statistics.median(enc[c.name]) / MB,
               "dec_MBps": nbytes / statistics.median(dec[c.name]) / MB}
        if c.name == "lcckpt":
            row.update(_traffic(t.element_size(), ratio))
            row["enc_GBps_traffic"] = row["encode_bytes_per_element"] * n / statistics.median(
                enc[c.name]) / 1e9
            row["dec_GBps_traffic"] = row["decode_bytes_per_element"] * n / statistics.median(
                dec[c.name]) / 1e9
        rows.append(row)
    result = {"data": label, "elements": n, "nbytes": nbytes, "rows": rows}
    if "zipnn" in enc:
        pe = [z / l for z, l in zip(enc["zipnn"], enc["lcckpt"])]
        pd = [z / l for z, l in zip(dec["zipnn"], dec["lcckpt"])]
        pair = {"enc": statistics.median(pe), "dec": statistics.median(pd)}
        r_l, r_z = rows[0]["ratio"], next(r["ratio"] for r in rows if r["codec"] == "zipnn")
        result["vs_zipnn"] = {"encode_speed": pair["enc"], "decode_speed": pair["dec"],
                              "encode_range": _quartiles(pe), "decode_range": _quartiles(pd),
                              "ratio": r_l / r_z,
                              "meets": {"ratio>=1": r_l >= r_z, "encode>=1.5": pair["enc"] >= 1.5,
                                        "decode>=1.0": pair["dec"] >= 1.0}}
    return result


def _quartiles(v) -> str:
    """The middle half of the per-repetition ratios, as text for the table."""
    if len(v) < 4:
        return "-"
    q = statistics.quantiles(v, n=4)
    return f"{q[0]:.2f}-{q[2]:.2f}"


WEIGHTS = ("mlp", "minilm", "minilm-adamw")


def run(steps: int = 30, reps: int = 15, threads: int = 2, dtypes=("fp32", "bf16", "fp16"),
        log=print, weights: str = "mlp") -> dict:
    """Train, then benchmark each dtype; returns a JSON-able document.

    lcckpt's pool size is read from ``LCCKPT_THREADS`` when the pool starts, so set it
    (``benchmarks/exact.py`` does) before anything in the process encodes.
    """
    if _pool.threads() != threads:
        raise InvalidArgumentError(
            f"lcckpt's pool runs {_pool.threads()} threads, the benchmark asks for {threads}: "
            f"set LCCKPT_THREADS={threads} before the first encode")
    bad = [d for d in dtypes if d not in _TORCH_DTYPE]
    if bad or reps < 1:
        raise InvalidArgumentError(f"dtypes must be among {sorted(_TORCH_DTYPE)} and reps >= 1; "
                                   f"got {list(dtypes)}, reps={reps}")
    if weights not in WEIGHTS:
        raise InvalidArgumentError(f"weights must be one of {WEIGHTS}, got {weights!r}")
    lcckpt.warmup()
    if weights == "mlp":
        w = trained_weights(steps)
        model = f"wide MLP, {w.numel():,} parameters, Adam"
    elif weights == "minilm":
        w = pretrained_weights()
        model = f"pretrained all-MiniLM-L6-v2, {w.numel():,} parameters"
    else:
        w = adamw_moments()
        model = (f"AdamW moments of all-MiniLM-L6-v2 after 3 fine-tune steps, "
                 f"{w.numel():,} values, {float((w == 0).float().mean()):.1%} zeros")
    doc = {"environment": environment(), "threads": threads, "reps": reps, "steps": steps,
           "model": model, "results": []}
    for label in dtypes:
        doc["results"].append(bench_dtype(w.to(_TORCH_DTYPE[label]), label, reps, threads, log))
    rows = [r for res in doc["results"] for r in res["rows"]]
    log(f"\n## exact codecs on trained weights: {doc['model']}, {threads} threads, "
        f"median of {reps} interleaved repetitions")
    log(format_table(rows, ["data", "codec", "ratio", "enc_MBps", "dec_MBps", "roundtrip_ok"]))
    pairs = [{"data": res["data"], **{k: v for k, v in res["vs_zipnn"].items() if k != "meets"},
              **res["vs_zipnn"]["meets"]} for res in doc["results"] if "vs_zipnn" in res]
    if pairs:
        log("\nlcckpt / ZipNN (per-repetition speed ratios, median; ratio = compression ratio)")
        log(format_table(pairs, ["data", "ratio", "encode_speed", "encode_range", "decode_speed",
                                 "decode_range", "ratio>=1", "encode>=1.5", "decode>=1.0"]))
    traffic = [{"data": r["data"], **{k: r[k] for k in ("encode_bytes_per_element",
                                                         "decode_bytes_per_element",
                                                         "enc_GBps_traffic", "dec_GBps_traffic")}}
               for r in rows if r["codec"] == "lcckpt"]
    log("\nlcckpt traffic model (bytes moved per element, and the rate that implies)")
    log(format_table(traffic, ["data", "encode_bytes_per_element", "enc_GBps_traffic",
                               "decode_bytes_per_element", "dec_GBps_traffic"]))
    return doc


def main(argv=None):
    import argparse
    import json
    ap = argparse.ArgumentParser(prog="benchmarks/exact.py", description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=int(os.environ.get("LCCKPT_THREADS", 2)))
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--steps", type=int, default=30, help="Adam steps before the weights are taken")
    ap.add_argument("--dtypes", default="fp32,bf16,fp16")
    ap.add_argument("--weights", choices=WEIGHTS, default="mlp",
                    help="the trained MLP's weights, the pretrained MiniLM's, or AdamW's "
                         "moments after 3 steps of its fine-tune (both need the finetune "
                         "extra)")
    ap.add_argument("--json", help="write the JSON document here")
    args = ap.parse_args(argv)
    doc = run(args.steps, args.reps, args.threads, tuple(args.dtypes.split(",")),
              weights=args.weights)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(doc, f, indent=1, default=float)
    return 0
