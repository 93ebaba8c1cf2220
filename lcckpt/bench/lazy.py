"""Lazy reads against full loads: one small tensor of a large file, and a few rows.

Writes a file of ``size_mb`` MB (float32 tensors of 64 MB each plus one small tensor),
then times ``lcckpt.load`` of the whole file against ``lcckpt.interop.reader.open(path)
.get_tensor(small)`` and a 16-row ``get_slice`` of a large tensor (open included in both).
Both run from the page cache after the write: the ratio is the work saved, not disk speed.
Stored raw by default; ``codec="lossless"`` shows a coded file.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile

import torch

from ..format import serialization
from ..interop.reader import open as lazy_open
from .timing import environment, format_table, measure


def run(size_mb: int = 512, codec: str = "raw", directory: str | None = None,
        min_runs: int = 3) -> dict:
    """Time full and lazy reads of one file of ``size_mb`` MB; returns a JSON-able dict."""
    per = 16 << 20                                     # elements: 64 MB per big tensor
    n_big = max(1, size_mb * (1 << 20) // (per * 4))
    g = torch.Generator().manual_seed(0)
    obj = {"model": {f"layer{i}.weight": torch.randn(per // 4096, 4096, generator=g)
                     for i in range(n_big)}}
    obj["model"]["head.bias"] = torch.randn(1000, generator=g)
    with tempfile.TemporaryDirectory(dir=directory) as d:
        path = os.path.join(d, "big.lcckpt")
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
    res = {"environment": environment(), "codec": codec, "file_bytes": file_bytes,
           "tensors": n_big + 1, "rows": []}
    for name, t in (("lcckpt.load (whole file)", full), ("get_tensor(small, 4 KB)", lazy_small),
                    ("get_slice(big)[100:116]", lazy_rows)):
        res["rows"].append({"read": name, "median_s": t.median_s, "min_s": t.min_s,
                            "runs": t.runs, "speedup": full.median_s / t.median_s})
    return res


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size-mb", type=int, default=512, help="file size in MB (default 512)")
    ap.add_argument("--codec", default="raw", choices=["raw", "lossless"])
    ap.add_argument("--dir", default=None, help="where to write the temporary file")
    ap.add_argument("--json", default=None, help="also write the result here")
    args = ap.parse_args(argv)
    res = run(args.size_mb, args.codec, args.dir)
    print(f"file: {res['file_bytes'] / 1e6:.0f} MB, {res['tensors']} tensors, codec {res['codec']}")
    print(format_table(res["rows"], ["read", "median_s", "min_s", "runs", "speedup"]))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=2)
    return 0
