"""Command line: ``lcckpt bench | inspect | verify``.

``main(argv) -> int`` is plain argparse so it can be called from tests. ``inspect`` and
``verify`` take a checkpoint file or a :class:`DeltaCheckpointer` directory; ``--json``
prints one JSON document instead of tables. ``verify`` exits 0 only if every checksum and
every chain link holds, 1 otherwise, 2 on bad usage.
"""

import argparse
import json
import os
import sys

from .errors import LcckptError

MAGIC = b"LCCKPT"


def _progress(items, desc: str):
    """tqdm on stderr when it is a terminal and tqdm is installed; plain iteration otherwise."""
    if not sys.stderr.isatty():
        return items
    try:
        from tqdm import tqdm
    except ImportError:
        return items
    return tqdm(items, desc=desc, file=sys.stderr, leave=False)


def _is_container(path: str) -> bool:
    with open(path, "rb") as f:
        return f.read(len(MAGIC)) == MAGIC


def _blob_info(data) -> dict:
    from .blob import LOSSY, parse
    _, p = parse(data)
    info = {"blob": "lossy delta" if p.kind == LOSSY else "lossless"}
    if p.kind == LOSSY:
        info["bits"] = p.bits
    return info


def inspect_file(path: str) -> dict:
    """What a checkpoint file holds: format, meta, and per section sizes and codecs."""
    if not _is_container(path):
        from .serialization import load
        obj = load(path)                         # plain torch.save file: weights_only rules
        return {"path": path, "format": "torch.save", "file_bytes": os.path.getsize(path),
                "top_level": sorted(map(str, obj)) if isinstance(obj, dict) else type(obj).__name__}
    from .container import read_container
    with read_container(path) as c:
        sections = []
        for i, s in enumerate(c.sections):
            m = s.get("meta", {})
            row = {"name": s["name"], "dtype": m.get("dtype"), "shape": m.get("shape"),
                   "codec": m.get("codec"), "raw_bytes": m.get("nbytes"), "stored_bytes": s["length"]}
            if m.get("codec") in ("lossless", "delta"):
                row.update(_blob_info(c.data(i)))
            sections.append(row)
        raw = sum(r["raw_bytes"] or 0 for r in sections)
        return {"path": path, "format": "lcckpt", "version": c.version,
                "file_bytes": os.path.getsize(path), "raw_bytes": raw,
                "chain": c.meta.get("lcckpt_chain"), "sections": sections}


def inspect_dir(path: str) -> dict:
    from .chain import DeltaCheckpointer
    ck = DeltaCheckpointer(path)
    rows = []
    for step in _progress(ck.steps(), "inspect"):
        info = ck.info(step)
        f = inspect_file(ck.path(step))
        tensors = info.get("tensors", {})
        lossy = [t for t in tensors.values() if t.get("kind") == "lossy"]
        rows.append({"step": step, "kind": info.get("kind"),
                     "base": (info.get("base") or {}).get("step"),
                     "file_bytes": f["file_bytes"], "raw_bytes": f["raw_bytes"],
                     "ratio": f["raw_bytes"] / f["file_bytes"] if f["file_bytes"] else None,
                     "max_rel_error": max((t.get("rel_error", 0) for t in lossy), default=0.0)})
    return {"path": path, "format": "lcckpt chain", "steps": rows}


def verify_file(path: str) -> None:
    """Raise an LcckptError unless every checksum of the file holds."""
    if not _is_container(path):
        from .serialization import load
        load(path)
        return
    from .blob import parse
    from .container import read_container
    with read_container(path) as c:
        c.verify()
        for i, s in enumerate(c.sections):
            if s.get("meta", {}).get("codec") in ("lossless", "delta"):
                parse(c.data(i))                 # the blob's own checksums and structure


def verify_dir(path: str) -> list[dict]:
    """Check every file, then replay the whole chain (every link, every decode)."""
    from .chain import DeltaCheckpointer
    ck = DeltaCheckpointer(path)
    report = []
    for step in _progress(ck.steps(), "checksums"):
        try:
            verify_file(ck.path(step))
            report.append({"step": step, "ok": True})
        except (LcckptError, OSError) as e:
            report.append({"step": step, "ok": False, "error": f"{type(e).__name__}: {e}"})
    if all(r["ok"] for r in report):
        try:
            for _ in _progress(ck.replay(), "chain"):
                pass
        except (LcckptError, OSError) as e:
            report.append({"step": None, "ok": False, "error": f"{type(e).__name__}: {e}"})
    return report


def _table(rows, cols):
    from .bench.timing import format_table
    return format_table(rows, cols)


def _inspect(args) -> int:
    doc = inspect_dir(args.path) if os.path.isdir(args.path) else inspect_file(args.path)
    if args.json:
        print(json.dumps(doc, indent=1, default=str))
    elif "steps" in doc:
        print(f"{doc['path']}: {len(doc['steps'])} checkpoints")
        print(_table(doc["steps"], ["step", "kind", "base", "file_bytes", "raw_bytes", "ratio",
                                    "max_rel_error"]))
    elif doc["format"] == "lcckpt":
        chain = doc["chain"] or {}
        print(f"{doc['path']}: lcckpt v{doc['version']}, {doc['file_bytes']:,} bytes "
              f"({doc['raw_bytes']:,} raw)" + (f", chain step {chain.get('step')} "
                                                f"({chain.get('kind')})" if chain else ""))
        print(_table(doc["sections"], ["name", "dtype", "shape", "codec", "blob", "bits",
                                       "raw_bytes", "stored_bytes"]))
    else:
        print(f"{doc['path']}: torch.save file, {doc['file_bytes']:,} bytes; "
              f"top level: {doc['top_level']}")
    return 0


def _verify(args) -> int:
    if os.path.isdir(args.path):
        report = verify_dir(args.path)
    else:
        try:
            verify_file(args.path)
            report = [{"path": args.path, "ok": True}]
        except (LcckptError, OSError) as e:
            report = [{"path": args.path, "ok": False, "error": f"{type(e).__name__}: {e}"}]
    ok = all(r["ok"] for r in report)
    if args.json:
        print(json.dumps({"ok": ok, "report": report}, indent=1))
    else:
        for r in report:
            if not r["ok"]:
                print(f"FAIL {r.get('step', r.get('path'))}: {r['error']}")
        print(f"{'OK' if ok else 'FAILED'}: {sum(r['ok'] for r in report)} of {len(report)} checks passed")
    return 0 if ok else 1


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="lcckpt", description="LC-Checkpoint compressed checkpoints")
    sub = ap.add_subparsers(dest="command", required=True)
    sub.add_parser("bench", add_help=False,
                   help="codec benchmark on real training runs (see `lcckpt bench --help`)")
    for name, helptext in (("inspect", "show what a checkpoint file or directory holds"),
                           ("verify", "check every checksum and chain link (exit 0 if all hold)")):
        p = sub.add_parser(name, help=helptext)
        p.add_argument("path", help="a checkpoint file or a DeltaCheckpointer directory")
        p.add_argument("--json", action="store_true", help="print JSON")
    args, rest = ap.parse_known_args(argv)
    if args.command == "bench":
        from .bench.codec import main as bench_main
        return bench_main(rest)
    if rest:
        ap.error(f"unrecognized arguments: {' '.join(rest)}")
    if not os.path.exists(args.path):
        print(f"lcckpt {args.command}: {args.path}: no such file or directory", file=sys.stderr)
        return 2
    return _inspect(args) if args.command == "inspect" else _verify(args)
