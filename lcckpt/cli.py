"""Command line: ``lcckpt bench | inspect | verify | convert``.

``main(argv) -> int`` is plain argparse so it can be called from tests. ``inspect`` and
``verify`` take a checkpoint file (lcckpt, torch.save or safetensors), a
:class:`DeltaCheckpointer` directory, a Trainer's ``checkpoint-N``, a distributed
checkpoint (one, or a ``DistributedCheckpointer`` directory: ``distributed/report.py``)
or a directory holding any of them (``interop/folder.py``); ``--json`` prints JSON.
``convert`` moves a checkpoint between the three file formats, either way, and writes a
distributed checkpoint as one file.

Exit codes: 0 success; 1 the data is bad (damaged, missing link, unsafe, unknown format)
or a check failed; 2 bad usage (unknown option, missing path). Every failure is one line
on stderr, never a traceback.
"""

import argparse
import json
import os
import re
import sys

from .errors import CorruptDataError, LcckptError
from .util.paths import distributed_hint, is_stream
from .util.bars import byte_bar, items as _progress
from .util.table import count, format_table as _table
from .interop.steprows import (FALLBACK_LEGEND, MOVEMENT_LEGEND, ROLE_COLUMNS, fallback_column,
                               judge_links, movement_columns, set_aside_files)


def _blob_info(data) -> dict:
    from .codec.blob import LOSSY, UNIFORM, parse
    _, p = parse(data)
    if p.kind == LOSSY:
        return {"blob": "lossy delta", "bits": p.bits}
    if p.kind == UNIFORM:
        return {"blob": "uniform delta", "bits": p.bits, "step": p.step,
                "escapes": int(p.esc_idx.size)}
    return {"blob": "lossless"}


def inspect_file(path: str) -> dict:
    """What a checkpoint file holds: format, meta, and per section/tensor sizes and codecs."""
    from .interop.convert import detect_format
    fmt = detect_format(path)
    size = os.path.getsize(path)
    if fmt == "sharded":
        from .format.sharded import read_index
        shards = {}
        for name, shard in read_index(path):
            shards.setdefault(shard, []).append(name)
        return {"path": path, "format": "sharded", "file_bytes": size,
                "shards": [{"file": f, "tensors": len(n)} for f, n in shards.items()]}
    if fmt == "safetensors":
        from .format.safetensors_io import read_header
        entries, meta = read_header(path)
        return {"path": path, "format": "safetensors", "file_bytes": size,
                "raw_bytes": sum(e["nbytes"] for e in entries), "metadata": meta,
                "tensors": entries}
    if fmt == "torch":
        from .interop.convert import flat_tensors, load_torch, stored_bytes
        obj = load_torch(path, mmap=True)           # weights only; mapped: shapes, no reads
        ts = list(flat_tensors(obj).items())
        return {"path": path, "format": "torch.save", "file_bytes": size,
                "raw_bytes": stored_bytes(t for _, t in ts),
                "tensor_count": len(ts),
                "top_level": sorted(map(str, obj)) if isinstance(obj, dict) else type(obj).__name__}
    from .format.container import read_container
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
        from .chain.pointer import pointed_step
        return {"path": path, "format": "lcckpt", "version": c.version,
                "file_bytes": size, "raw_bytes": raw, "header_bytes": c.header_bytes,
                "header_json_bytes": c.header_json_bytes,
                "chain": c.meta.get("lcckpt_chain"), "sections": sections,
                **pointed_step(path, c.meta, size)}


def _no_checkpoints(path: str) -> CorruptDataError:
    others = sorted(os.listdir(path))
    what = (f"it holds {count(len(others), 'other entry', 'other entries')}, e.g. "
            f"{others[0]!r}" if others else "it is empty")
    return CorruptDataError(f"{path} holds no checkpoints (no step-NNNNNNNNNNNN.lcc files, "
                            f"no checkpoint files or directories; {what}); give a checkpoint "
                            "file or a directory of them")


def inspect_trainer_dir(path: str) -> dict:
    """A Trainer's ``checkpoint-N`` directory: its step and the files it holds."""
    from .interop import trainerdir
    from .interop.convert import detect_format
    rows = [{"part": part, "file": os.path.basename(f), "format": detect_format(f),
             "file_bytes": os.path.getsize(f)} for part, f in trainerdir.files(path).items()]
    return {"path": path, "format": "trainer", "global_step": trainerdir.global_step(path),
            "file_bytes": sum(r["file_bytes"] for r in rows), "files": rows}


def inspect_dir(path: str) -> dict:
    """One row per step, and the problems: damaged files and links that cannot restore."""
    from .chain.checkpointer import DeltaCheckpointer
    ck = DeltaCheckpointer(path)
    steps = ck.steps()
    if not steps:
        return inspect_folder(path)
    rows, problems, infos = [], [], {}
    for step in _progress(steps, "inspect"):
        try:
            info = infos[step] = ck.info(step)
            f = inspect_file(ck.path(step))
        except (LcckptError, OSError) as e:
            rows.append({"step": step, "kind": "damaged"})
            problems.append(f"step {step}: {_describe(e)}")
            continue
        lossy = [t for t in info.get("tensors", {}).values() if t.get("kind") in ("lossy", "uniform")]
        rows.append({"step": step, "kind": info.get("kind"),
                     "base": (info.get("base") or {}).get("step"),
                     "file_bytes": f["file_bytes"], "raw_bytes": f["raw_bytes"],
                     "ratio": f["raw_bytes"] / f["file_bytes"] if f["file_bytes"] else None,
                     "max_rel_error": max((t.get("rel_error") or 0 for t in lossy), default=0.0),
                     **movement_columns(info.get("tensors", {})),
                     **fallback_column(info)})
    ok = judge_links(rows, infos, problems)
    lost = [s for s in steps if not ok[s]]
    if lost:
        problems.append(f"{len(lost)} of {len(steps)} steps cannot be restored "
                        f"({_span(lost)}); restorable: {_span([s for s in steps if ok[s]]) or 'none'}")
    return {"path": path, "format": "lcckpt chain", "steps": rows, "problems": problems,
            "set_aside": set_aside_files(path)}


def _folder(path: str) -> list[tuple[str, str]]:
    """The checkpoints a directory holds, one level down (files, chains, Trainer and
    distributed checkpoints), as ``(path, kind)``; none: :func:`_no_checkpoints`."""
    from .interop import folder
    found = folder.entries(path, _distributed)
    if not found:
        raise _no_checkpoints(path)
    return found


def inspect_folder(path: str) -> dict:
    """One row per checkpoint a directory holds (:func:`_folder`)."""
    from .interop import folder
    rows, problems = [], []
    for entry, kind in _progress(_folder(path), "inspect"):
        try:
            doc = (inspect_file if kind == "file" else inspect_trainer_dir if kind == "trainer"
                   else _distributed(entry).inspect if kind == "distributed"
                   else inspect_dir)(entry)
            rows.append(folder.row(entry, kind, doc))
            problems += doc.get("problems", [])
        except (LcckptError, OSError) as e:
            rows.append({"name": os.path.basename(entry), "kind": "unreadable"})
            problems.append(f"{entry}: {_describe(e)}")
    return {"path": path, "format": "folder", "entries": rows, "problems": problems}


def _verify_entry(entry: str, kind: str) -> list[dict]:
    try:
        if kind == "distributed":
            return _distributed(entry).verify(entry, _progress)
        return verify_dir(entry) if kind != "file" else [verify_file(entry)]
    except (LcckptError, OSError) as e:
        return [{"path": entry, "ok": False, "error": _describe(e)}]


def _span(steps: list[int]) -> str:
    if len(steps) <= 6:
        return ", ".join(map(str, steps))
    return f"{', '.join(map(str, steps[:3]))}, ..., {steps[-1]}"


def verify_file(path: str) -> dict:
    """Check every checksum and structure of one file; returns a report entry with
    ``ok`` and, for lcckpt files, ``expansion`` (decoded / stored bytes) and ``warnings``.
    Raises an LcckptError for a torch or safetensors file that fails."""
    from .interop.convert import check_torch_crcs, detect_format, load_torch, read_checkpoint
    fmt = detect_format(path)
    if fmt == "sharded":                 # every shard, and every tensor in its shard
        from .format.sharded import load_index

        def shard(where):                # each shard read once (a load checks what it reads)
            kind = detect_format(where)
            if kind == "torch":
                check_torch_crcs(where)  # torch.load itself does not check them
            elif kind != "safetensors" and not (r := verify_file(where))["ok"]:
                raise CorruptDataError(f"shard {where}: {r.get('error')}")
            return read_checkpoint(where)[0]
        load_index(path, shard)
        return {"path": path, "ok": True}
    if fmt == "safetensors":
        from .format.safetensors_io import verify_safetensors
        verify_safetensors(path)
        return {"path": path, "ok": True}
    if fmt == "torch":
        check_torch_crcs(path)           # torch.load itself does not check them
        load_torch(path, mmap=True)      # its pickle loads (weights only); values checked above
        return {"path": path, "ok": True}
    from .chain.pointer import pointer_of, verify_pointed
    from .format.verify import verify_file as verify_container
    r = verify_container(path)
    error = r["error"]
    if r["ok"] and (ref := pointer_of(path, load_old=True)) is not None:
        error = verify_pointed(path, ref)
    return {"path": path, "ok": error is None, "error": error, "expansion": r["expansion"],
            "warnings": r["warnings"]}


def verify_dir(path: str) -> list[dict]:
    """Check every file, then replay the whole chain (every link, every decode); of a
    Trainer's checkpoint directory, every file it holds."""
    from .interop import trainerdir
    if trainerdir.is_trainer_dir(path):
        try:
            trainerdir.global_step(path)
            parts = trainerdir.files(path)
        except LcckptError as e:
            return [{"path": path, "ok": False, "error": _describe(e)}]
        return [r for f in parts.values() for r in _verify_entry(f, "file")]
    from .chain.checkpointer import DeltaCheckpointer
    ck = DeltaCheckpointer(path)
    if not ck.steps():
        return [r for entry, kind in _folder(path) for r in _verify_entry(entry, kind)]
    report = [{"path": p, "ok": False, "error": "named like a step but not a regular file "
               "(a link or a directory): not part of the chain; remove it"}
              for p in ck.strays()]
    for step in _progress(ck.steps(), "checksums"):
        try:
            report.append({"step": step, **verify_file(ck.path(step))})
        except (LcckptError, OSError) as e:
            report.append({"step": step, "ok": False, "error": _describe(e)})
    if all(r["ok"] for r in report):
        try:
            # every delta decoded along its chain; other sections were checked file by file
            for _ in _progress(ck.replay(build=False), "chain"):
                pass
        except (LcckptError, OSError) as e:
            report.append({"step": None, "ok": False, "error": _describe(e)})
    return report


def _distributed(path: str):
    """lcckpt.distributed's report module where ``path`` is a DCP checkpoint or steps of
    them (imported only then: it loads torch.distributed), else None."""
    if not os.path.isdir(path) or distributed_hint(path) is None:
        return None
    from .distributed import report
    return report


def _inspect(args) -> int:
    from .interop.trainerdir import is_trainer_dir
    dist = _distributed(args.path)
    doc = (dist.inspect if dist else inspect_trainer_dir if is_trainer_dir(args.path)
           else inspect_dir if os.path.isdir(args.path) else inspect_file)(args.path)
    problems = doc.get("problems", [])
    if args.json:
        print(json.dumps(doc, indent=1, default=str))
    elif dist:
        print(dist.text(doc, _table))
    elif doc.get("format") == "folder":
        print(f"{doc['path']}: {count(len(doc['entries']), 'checkpoint')}")
        print(_table(doc["entries"], ["name", "kind", "file_bytes", "holds"]))
    elif doc.get("format") == "trainer":
        print(f"{doc['path']}: Trainer checkpoint directory, step {doc['global_step']}, "
              f"{doc['file_bytes']:,} bytes in {len(doc['files'])} files (inspect each file "
              "for its tensors)")
        print(_table(doc["files"], ["part", "file", "format", "file_bytes"]))
    elif "steps" in doc:
        print(f"{doc['path']}: {count(len(doc['steps']), 'checkpoint')}")
        cols = ["step", "kind", "base", "restorable", "file_bytes", "raw_bytes", "ratio",
                "max_rel_error"]
        moved = [c for c in (*ROLE_COLUMNS.values(), "missed", "stored_exact")
                 if any(c in r for r in doc["steps"])]
        print(_table(doc["steps"], cols + moved))
        if any(c in moved for c in ROLE_COLUMNS.values()):
            print(MOVEMENT_LEGEND)
        if "stored_exact" in moved:
            print(FALLBACK_LEGEND)
        if doc["set_aside"]:
            print("set aside, not steps of the chain: " + ", ".join(doc["set_aside"]))
    elif doc["format"] == "lcckpt":
        chain = doc["chain"] or {}
        print(f"{doc['path']}: lcckpt v{doc['version']}, {doc['file_bytes']:,} bytes "
              f"({doc['raw_bytes']:,} raw; header {doc['header_bytes']:,}"
              + (f", {doc['header_json_bytes']:,} inflated" if doc["header_bytes"]
                 != doc["header_json_bytes"] else "") + ")"
              + (f", chain step {chain.get('step')} ({chain.get('kind')})" if chain else ""))
        print(_table(doc["sections"], ["name", "dtype", "shape", "codec", "blob", "bits",
                                       "raw_bytes", "stored_bytes"]))
        if "points_at" in doc:
            at = doc["points_at"]
            print(f"its model and optimizer state: step {at['step']} of the chain in "
                  f"{at['chain']} (a file of LcckptCheckpointIO(chain=...); `lcckpt inspect "
                  f"{at['chain']}` shows the chain)")
    elif doc["format"] == "safetensors":
        print(f"{doc['path']}: safetensors, {doc['file_bytes']:,} bytes, "
              f"{count(len(doc['tensors']), 'tensor')}" + (f"; metadata {doc['metadata']}"
                                                  if doc["metadata"] else ""))
        print(_table(doc["tensors"], ["name", "dtype", "shape", "nbytes"]))
    elif doc["format"] == "sharded":
        print(f"{doc['path']}: shard index, {sum(r['tensors'] for r in doc['shards'])} tensors "
              f"in {len(doc['shards'])} files (inspect each file for its tensors)")
        print(_table(doc["shards"], ["file", "tensors"]))
    else:
        print(f"{doc['path']}: torch.save file, {doc['file_bytes']:,} bytes, "
              f"{count(doc['tensor_count'], 'tensor')} ({doc['raw_bytes']:,} bytes); "
              f"top level: {doc['top_level']}")
    for p in problems:
        _fail("inspect", p, "warning")
    return 1 if problems else 0


def _verify(args) -> int:
    if dist := _distributed(args.path):
        report = dist.verify(args.path, _progress)
    elif os.path.isdir(args.path):
        report = verify_dir(args.path)
    else:
        try:
            report = [verify_file(args.path)]
        except (LcckptError, OSError) as e:
            report = [{"path": args.path, "ok": False, "error": _describe(e)}]
    ok = all(r["ok"] for r in report)
    if args.json:
        print(json.dumps({"ok": ok, "report": report}, indent=1))
    else:
        for r in report:
            where = r.get("path") or (f"step {r['step']}" if r.get("step") is not None
                                      else "chain")
            for w in r.get("warnings") or ():
                _fail("verify", f"{where}: {w}", "warning")
            if not r["ok"]:   # a message that names its path is not prefixed again
                _fail("verify", r["error"] if r.get("path") and r["path"] in r["error"]
                      else f"{where}: {r['error']}", "FAIL")
        top = max((r["expansion"] for r in report if r.get("expansion") is not None), default=None)
        if top is not None:
            print(f"largest expansion: {top:g}x (bytes decoded per byte stored; a load refuses "
                  "more than its max_bytes allows)")
        print(f"{'OK' if ok else 'FAILED'}: {sum(r['ok'] for r in report)} of {len(report)} checks passed")
    return 0 if ok else 1


def _convert(args) -> int:
    from .interop.convert import convert
    dist = _distributed(args.input)   # one DCP checkpoint, or a step of a chain of them
    src = dist.checkpoint_dir(args.input, args.step) if dist else args.input
    with byte_bar("convert") as bar:
        doc = convert(src, args.output, to=args.to, compress=args.compress,
                      step=None if dist else args.step, key=args.key, read=dist and dist.read,
                      progress=bar)
    if dist:                          # a chain's delta step is written as it restores
        doc.update(dist.step_kind(src))
    if doc.get("dropped_metadata"):
        _fail("convert", f"the input's safetensors metadata ({doc['dropped_metadata']} keys) "
                         "has no place in a torch.save file and was not kept", "warning")
    if args.json:
        print(json.dumps(doc, indent=1))
    else:
        print(f"{doc['input']} ({doc['input_format']}, {doc['input_bytes']:,} bytes) -> "
              f"{doc['output']} ({doc['output_format']}, {doc['output_bytes']:,} bytes), "
              f"{count(doc['tensors'], 'tensor')}, " + ("exact" if doc.get("step_kind") in
              (None, "keyframe") else f"step {doc['step']} as the chain restores it (a delta: "
              "within the chain's targets of the state saved)"))
    return 0


def _bench(args) -> int:
    from .bench.codec import run_cli
    return run_cli(args)


def _describe(e: BaseException) -> str:
    """One line: what went wrong, from the exception's own message."""
    if isinstance(e, OSError) and e.strerror:
        msg = f"{e.filename}: {e.strerror}" if e.filename else e.strerror
    else:
        msg = str(e) or type(e).__name__
    return " ".join(re.sub(r"\x1b\[[0-9;]*m", "", msg).split())   # no terminal colours


def _fail(command: str, msg: str, level: str = "error") -> None:
    print(f"lcckpt {command}: {level}: {msg}", file=sys.stderr)


def build_parser() -> tuple[argparse.ArgumentParser, dict[str, argparse.ArgumentParser]]:
    from . import __version__
    from .bench.codec import add_arguments as add_bench_arguments
    ap = argparse.ArgumentParser(prog="lcckpt", description="LC-Checkpoint compressed checkpoints")
    ap.add_argument("--version", action="version", version=f"lcckpt {__version__}")
    sub = ap.add_subparsers(dest="command", required=True, metavar="COMMAND")
    subs = {}
    p = subs["bench"] = sub.add_parser(
        "bench", help="codec benchmark: built-in training runs, or your own checkpoints",
        description="Codec benchmark on real training runs, or on your own checkpoints "
                    "(--checkpoint). Other suites: lcckpt bench {" + ",".join(SUITES)
                    + "} [--help].")
    add_bench_arguments(p)
    _add_max_bytes(p)
    for name, helptext in (("inspect", "show what a checkpoint file or directory holds"),
                           ("verify", "check every checksum and chain link (exit 0 if all hold)")):
        p = subs[name] = sub.add_parser(name, help=helptext, description=helptext)
        p.add_argument("path", help="a checkpoint file (lcckpt, torch.save, safetensors), a "
                                    "DeltaCheckpointer directory, a distributed checkpoint "
                                    "or a directory holding checkpoints")
        p.add_argument("--json", action="store_true", help="print JSON")
        _add_max_bytes(p)
    p = subs["convert"] = sub.add_parser(
        "convert", help="convert between torch.save, safetensors and lcckpt files (exact)",
        description="Convert a checkpoint between torch.save (.pt), safetensors and lcckpt "
                    "(.lcc) files, keeping every tensor bit for bit. A torch file that needs "
                    "arbitrary code to unpickle is refused, never executed.")
    p.add_argument("input", help="a checkpoint file, a DeltaCheckpointer directory or a "
                                 "distributed checkpoint (or a DistributedCheckpointer's)")
    p.add_argument("output", help="the file to write; its extension picks the format")
    p.add_argument("--to", choices=["lcckpt", "torch", "safetensors"],
                   help="output format (default: from the output's extension)")
    p.add_argument("--compress", action="store_true",
                   help="lcckpt output: lossless compression of every tensor")
    p.add_argument("--step", type=int, help="which step of a directory input (default: newest)")
    p.add_argument("--key", help="write only the value at this key path, levels joined by "
                                 "dots (model: a training checkpoint's state_dict, e.g. for "
                                 "a .safetensors output)")
    p.add_argument("--json", action="store_true", help="print what was done as JSON")
    _add_max_bytes(p)
    text = "set a chain's steps after STEP aside (*.rolledback): its next save goes on from STEP"
    p = subs["rollback"] = sub.add_parser("rollback", help=text, description=text)
    p.add_argument("path", help="a DeltaCheckpointer directory (no writer may hold it)")
    p.add_argument("step", type=int, help="the step the run goes on from")
    return ap, subs


def _rollback(args) -> int:
    from .chain.checkpointer import DeltaCheckpointer
    with DeltaCheckpointer(args.path) as ck:
        gone = ck.rollback(args.step)
    print(f"{args.path}: steps set aside as *.rolledback: {_span(gone) or 'none'}; the "
          f"next save goes on from step {args.step}")
    return 0


def _add_max_bytes(p: argparse.ArgumentParser) -> None:
    from .limits import parse_max_bytes
    p.add_argument("--max-bytes", type=parse_max_bytes, metavar="N",
                   help="the most bytes any one load may decode: a number (8G), 'auto' "
                        "(default: 192 MiB + 32x the file's size, at most the memory left; "
                        "a chain's deltas counted against what its keyframe holds) or 'none' (files you trust)")


_COMMANDS = {"bench": _bench, "inspect": _inspect, "verify": _verify, "convert": _convert,
             "rollback": _rollback}


# ``lcckpt bench SUITE ...``: the other benchmark suites, each a module with main(argv)
SUITES = {"schedule": "lcckpt.bench.schedule", "lazy": "lcckpt.bench.lazy",
          "manager": "lcckpt.bench.manager", "exact": "lcckpt.bench.exact",
          "distributed": "lcckpt.bench.distributed", "quality": "lcckpt.bench.quality",
          "header": "lcckpt.bench.header", "trainer": "lcckpt.bench.trainer"}


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if len(argv) >= 2 and argv[0] == "bench" and argv[1] in SUITES:
        import importlib
        suite = importlib.import_module(SUITES[argv[1]])
        return _guarded(f"bench {argv[1]}", lambda: suite.main(argv[2:]))
    ap, subs = build_parser()
    args, rest = ap.parse_known_args(argv)
    if rest:
        subs[args.command].error(f"unrecognized arguments: {' '.join(rest)}")
    for path in [getattr(args, "path", None), getattr(args, "input", None),
                 *(getattr(args, "checkpoint", None) or [])]:
        if path is not None and not os.path.exists(path):
            _fail(args.command, f"{path}: no such file or directory")
            return 2
        if path is not None and is_stream(path):      # read at any offset, and more than once
            _fail(args.command, f"{path} is a pipe or a device: write it to a file first")
            return 2
    if getattr(args, "max_bytes", None) is not None or "--max-bytes" in argv:
        from . import limits  # every load of this command, chains included
        old = limits.set_max_bytes(args.max_bytes)
        try:
            return _guarded(args.command, lambda: _COMMANDS[args.command](args))
        finally:
            limits.set_max_bytes(old)
    return _guarded(args.command, lambda: _COMMANDS[args.command](args))


def _guarded(command: str, run) -> int:
    """Run a command; every failure becomes one line on stderr and an exit code."""
    try:
        return run()
    except KeyboardInterrupt:
        _fail(command, "interrupted")
        return 130
    except BrokenPipeError:      # the reader went away (`| head`): stop quietly, as cat does
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())   # the interpreter's last flush must not fail
        os.close(devnull)
        return 141 if os.name == "posix" else 1  # the shell's code for SIGPIPE
    except (LcckptError, OSError, ImportError) as e:
        _fail(command, _describe(e))
        return 1
    except Exception as e:  # a bug of ours: still one line, with what to do about it
        _fail(command, f"unexpected {type(e).__name__}: {_describe(e)} (this is a bug in "
                       "lcckpt; please report it with the command that caused it)")
        return 1
