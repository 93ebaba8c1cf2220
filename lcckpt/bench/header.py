"""What the container's header costs: delta file sizes of a small model, header time of a big one.

Two measurements:

- **Small files.** The digits CNN trains with SGD (momentum), or Adam, for ``steps`` steps;
  every ``snapshot_every`` steps a snapshot goes into a ``DeltaCheckpointer`` with default
  settings. For each delta file: its size, the header as stored and as JSON, what its
  blobs spend on their own headers (fields, code tables and CRCs) and on coded data, and
  the size
  the same header and sections would take laid out as format version 2 (header not
  compressed, 64-byte alignment), as version 3 (zlib without the preset dictionary,
  every delta section's key and every stat written out) and as version 4 (every section
  aligned, not only raw ones); computed from the parsed header, whose JSON differs from
  theirs only in the version digit, the section offsets, and for version 3 the keys and
  stats that version 4 leaves out.
- **Big headers.** A container of ``tensors`` small sections with chain-like metadata is
  written to memory and read back, with the header compressed and plain, interleaved
  (medians over ``reps``): what compressing and inflating a header of that size costs.

Deliberately not here: codec or chain settings (the files are what the defaults write).
"""

from __future__ import annotations

import argparse
import io
import json
import os
import statistics
import tempfile
import time
import zlib

import torch

from ..chain.session import finite
from ..errors import LcckptError
from ..format import container as C
from ..format import header as H
from ..format import serialization
from ..chain.checkpointer import DeltaCheckpointer
from .timing import environment, format_table


def _align(n: int, a: int) -> int:
    return -(-n // a) * a


def layout(c: C.Container, version: int, compress: bool) -> tuple[int, int]:
    """File size and stored header size of ``c``'s header and sections laid out as
    ``version`` (2 to 5)."""
    a = C.ALIGNMENTS[version]
    sections, end = [], 0
    for i, s in enumerate(c.sections):
        s = {**s, "offset": H.section_start(end, s["meta"], version) if i else 0}
        sections.append(H.stored_entry(s) if version >= H.DICT_VERSION else s)
        end = s["offset"] + s["length"]
    meta = c.meta if version >= H.DICT_VERSION else _with_derived(c)
    header = json.dumps({"version": version, "meta": meta, "sections": sections},
                        ensure_ascii=True, allow_nan=False, separators=(",", ":")).encode()
    if version >= H.DICT_VERSION:
        header = H.pack(header, compress)[0]
    elif compress and len(z := zlib.compress(header, H.HEADER_ZLIB_LEVEL)) < len(header):
        header = z
    return _align(C.PREFIX_SIZE + len(header), a) + end, len(header)


def _with_derived(c: C.Container) -> dict:
    """A chain file's meta with the stats versions 2 and 3 wrote and 4 derives (the
    share of the movement; a uniform delta's step, which format version 5 leaves to
    its blob)."""
    from ..codec.blob import parse
    meta = c.meta
    chain = meta.get("lcckpt_chain")
    if not isinstance(chain, dict) or not isinstance(chain.get("tensors"), dict):
        return meta
    steps = {}
    for i, s in enumerate(c.sections):
        key = (s["meta"].get("codec_params") or {}).get("key", s["name"])
        try:
            p = parse(bytes(c.data(i)), check_payload=False)[1]
        except LcckptError:                 # not a blob
            continue
        if p.step:
            steps[key] = float(f"{p.step:.4g}")
    tensors = {}
    for k, st in chain["tensors"].items():
        if st.get("movement"):
            at = list(st).index("movement") + 1          # where the writer put it
            items = list(st.items())
            items.insert(at, ("error_vs_movement", finite(st["rel_error"] / st["movement"])))
            st = dict(items)
        if k in steps and "step" not in st:
            st = {**st, "step": steps[k]}
        tensors[k] = st
    return {**meta, "lcckpt_chain": {**chain, "tensors": tensors}}


def _blob_headers(c: C.Container) -> int:
    """Bytes of ``c``'s sections that are their blobs' headers and CRCs, not coded data."""
    from ..codec.blob import parse
    n = 0
    for i in range(len(c)):
        try:
            n += parse(bytes(c.data(i)), check_payload=False)[1].payload_base + 4
        except LcckptError:                 # not a blob
            pass
    return n


def chain_files(steps: int = 200, snapshot_every: int = 10, directory: str | None = None,
                optimizer: str = "sgd") -> dict:
    """Sizes of the delta files of the digits CNN chain (default DeltaCheckpointer)."""
    from .trajectory import train_trajectory

    traj = train_trajectory(model="cnn", optimizer=optimizer, steps=steps,
                            snapshot_every=snapshot_every)
    rows = []
    with tempfile.TemporaryDirectory(dir=directory) as d:
        ck = DeltaCheckpointer(d)
        for step, snap in traj.snapshots:
            ck.save(step, snap)
        for step in ck.steps():
            if ck.info(step)["kind"] != "delta":
                continue
            with C.read_container(ck.path(step)) as c:
                data = sum(s["length"] for s in c.sections)
                v2_bytes, v2_header = layout(c, 2, False)
                v3_bytes, v3_header = layout(c, 3, True)
                rows.append({"step": step, "file_bytes": c.size, "v2_bytes": v2_bytes,
                             "v3_bytes": v3_bytes, "v4_bytes": layout(c, 4, True)[0],
                             "header_stored": c.header_bytes,
                             "header_json": c.header_json_bytes, "v2_header": v2_header,
                             "v3_header": v3_header, "section_bytes": data, "sections": len(c),
                             "blob_headers": _blob_headers(c),
                             "padding": c.size - C.PREFIX_SIZE - c.header_bytes - data,
                             "v2_padding": v2_bytes - C.PREFIX_SIZE - v2_header - data})
                assert (c.size, c.header_bytes) == layout(c, c.version, True)
                assert c.size == os.path.getsize(ck.path(step))
        ck.close()
    mean = {k: statistics.fmean(r[k] for r in rows) for k in rows[0] if k != "step"} if rows else {}
    return {"steps": steps, "snapshot_every": snapshot_every, "optimizer": optimizer,
            "deltas": len(rows), "files": rows, "mean": mean}


def big_header(tensors: int = 20_000, reps: int = 5) -> dict:
    """Write and read times of a container of ``tensors`` sections, header compressed vs
    plain, interleaved; medians over ``reps`` and the header sizes."""
    obj = {"model": {f"layers.{i // 10}.block{i % 10}.weight": torch.zeros(4)
                     for i in range(tensors)}}
    meta, sections = serialization.pack(obj)
    meta["stats"] = {name: {"kind": "uniform", "bits": 5, "bits_per_element": 6.611111,
                            "rel_error": 0.009806, "nbytes": 119, "target": 0.01}
                     for name, _, _ in sections}
    times = {(w, z): [] for w in ("write", "read") for z in (True, False)}
    files, stored = {}, {}
    for _ in range(reps):
        for z in (True, False):
            f = io.BytesIO()
            t0 = time.perf_counter()
            C.write_container(f, sections, meta, compress_header=z)
            t1 = time.perf_counter()
            files[z] = f.getvalue()
            with C.read_container(files[z]) as c:
                t2 = time.perf_counter()
                stored[z], json_bytes = c.header_bytes, c.header_json_bytes
            times["write", z].append(t1 - t0)
            times["read", z].append(t2 - t1)
    t_zlib = []
    plain = files[False][C.PREFIX_SIZE:C.PREFIX_SIZE + json_bytes]
    for _ in range(reps):
        t0 = time.perf_counter()
        H.pack(plain, True)
        t_zlib.append(time.perf_counter() - t0)
    rows = [{"op": op, "header": "zlib" if z else "plain", "header_bytes": stored[z],
             "median_s": statistics.median(times[op, z]), "min_s": min(times[op, z])}
            for op in ("write", "read") for z in (True, False)]
    return {"tensors": tensors, "reps": reps, "header_json_bytes": json_bytes,
            "header_zlib_bytes": stored[True], "zlib_compress_s": statistics.median(t_zlib),
            "file_bytes": {"zlib": len(files[True]), "plain": len(files[False])}, "rows": rows}


def run(steps: int = 200, snapshot_every: int = 10, tensors: int = 20_000, reps: int = 5,
        directory: str | None = None, optimizer: str = "sgd") -> dict:
    """Both measurements; a JSON-able dict."""
    return {"environment": environment(),
            "chain": chain_files(steps, snapshot_every, directory, optimizer),
            "big_header": big_header(tensors, reps)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--snapshot-every", type=int, default=10)
    ap.add_argument("--tensors", type=int, default=20_000, help="sections of the big header")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--optimizer", choices=("sgd", "adam"), default="sgd")
    ap.add_argument("--json", default=None, help="also write the result here")
    args = ap.parse_args(argv)
    res = run(args.steps, args.snapshot_every, args.tensors, args.reps, optimizer=args.optimizer)
    ch = res["chain"]
    opt = "SGD momentum" if ch["optimizer"] == "sgd" else "Adam"
    print(f"digits CNN, {opt}, {ch['steps']} steps, a snapshot every "
          f"{ch['snapshot_every']}: {ch['deltas']} delta files")
    print(format_table(ch["files"], ["step", "file_bytes", "v2_bytes", "v3_bytes", "v4_bytes",
                                     "header_stored", "v2_header", "v3_header",
                                     "section_bytes", "blob_headers", "padding",
                                     "v2_padding"]))
    m = ch["mean"]
    if m:
        print(f"mean delta file: {m['file_bytes']:,.0f} bytes (as format v2: {m['v2_bytes']:,.0f}, "
              f"{m['file_bytes'] / m['v2_bytes']:.1%}; as v3: {m['v3_bytes']:,.0f}; as v4, "
              f"coded sections aligned too: {m['v4_bytes']:,.0f}); header "
              f"{m['header_stored']:,.0f} stored of {m['header_json']:,.0f} JSON bytes (v2: "
              f"{m['v2_header']:,.0f}, v3: {m['v3_header']:,.0f}); padding "
              f"{m['padding']:,.0f} (v2: {m['v2_padding']:,.0f}); "
              f"sections {m['section_bytes']:,.0f}, of which blob headers "
              f"{m['blob_headers']:,.0f}")
    b = res["big_header"]
    print(f"\n{b['tensors']:,} tensors: header {b['header_json_bytes']:,} bytes of JSON, "
          f"{b['header_zlib_bytes']:,} compressed (zlib level {H.HEADER_ZLIB_LEVEL} alone: "
          f"{b['zlib_compress_s'] * 1e3:.1f} ms)")
    print(format_table(b["rows"], ["op", "header", "header_bytes", "median_s", "min_s"]))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=2)
    return 0
