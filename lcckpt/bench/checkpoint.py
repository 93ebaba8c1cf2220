"""Benchmark on the user's own checkpoints (``lcckpt bench --checkpoint A.pt [B.pt ...]``).

One file: the lossless codec against torch.save's size and zstd-1/3 of that file. Two or
more files of one run: each file after the first as a delta on the one before, through a
real :class:`~lcckpt.DeltaCheckpointer` (the files a user would get), at several
settings, beside torch.save, zstd of each torch.save file and zstd of the exact fp32 delta.
Every lossy row carries its error next to its ratio, measured on the restored tensors:

* ``err_state``: ||restored - true|| / ||true|| over all floating tensors (worst file);
* ``err_vs_change``: ||restored - true|| / ||true - previous true||, the error against how
  far the state moved since the previous file (worst file). Above 1 the restored state is
  further from the truth than the previous checkpoint was: the delta kept little.
* ``worst_tensor_err_vs_change`` (and ``worst_tensor``): the same for the single tensor
  where it is largest, since a fast-moving optimizer moment can hide a lost weight delta;
  ``worst_by_role``: the same per role (weights, first and second moments: the default
  holds the moments far looser, by design, so the summary judges the weights).

Speeds are decimal MB of tensor data per second of ``save``/``load`` (encode and write,
read and decode), medians over the files; the zstd rows time compress/decompress only.
:func:`stream` is also what ``make demo`` runs on its own training run.

Deliberately not done here: accuracy of the restored model (the files carry no model or
data; :func:`stream` takes an ``accuracy`` callback for runs that do).
"""

from __future__ import annotations

import gc
import io
import math
import os
import statistics
import sys
import tempfile
import textwrap
import time
from typing import Any, Callable

import numpy as np
import torch

import lcckpt
from lcckpt.bench.inputs import read_any
from lcckpt.bench.norms import sq_dist
from lcckpt.bench.timing import environment, format_table, zstandard_module
from lcckpt.interop.convert import flat_tensors
from lcckpt.chain.policy import DEFAULT_POLICY, role_of
from lcckpt.errors import InvalidArgumentError

MB = 1e6
FLOATS = (torch.float16, torch.bfloat16, torch.float32, torch.float64)

# (label, DeltaCheckpointer settings): the defaults (restored-state targets per tensor
# role), the paper's coder at its usual 2 bits, the sub-bit coders at 2 bits, and the most
# bits LC's quantizer offers
DEFAULT = "lcckpt default"
SETTINGS = [
    (DEFAULT, {}),
    ("LC-faithful b=2 (huffman)", {"bits": 2, "coder": "huffman"}),
    ("LC b=2", {"bits": 2}),
    ("LC b=4", {"bits": 4}),
]


def progress(total: int, desc: str):
    """A tqdm bar on stderr when stderr is a terminal; otherwise a no-op with ``update``."""
    if sys.stderr.isatty():
        try:
            from tqdm import tqdm
            return tqdm(total=total, desc=desc, file=sys.stderr, leave=False)
        except ImportError:
            pass

    class _Quiet:
        def update(self, n=1):
            pass

        def close(self):
            pass

    return _Quiet()


def trim_heap() -> None:
    """Give the C heap's free memory back to the system (glibc ``malloc_trim``; nothing
    elsewhere). Freed arrays of the pool's threads otherwise stay in their arenas, and
    each setting of a run would start from where the last one peaked."""
    try:
        import ctypes
        ctypes.CDLL(None).malloc_trim(0)
    except (OSError, AttributeError):
        pass


def _floats(obj) -> dict[str, torch.Tensor]:
    """The floating tensors of ``obj`` by name, as they are (widened one at a time when
    compared, so a large state is never held twice in float64)."""
    return {k: t.detach() for k, t in flat_tensors(obj).items() if t.dtype in FLOATS}


def _f64(t: torch.Tensor) -> np.ndarray:
    return t.to("cpu", torch.float64).reshape(-1).numpy()


PIECE = 1 << 20          # elements widened to float64 at a time


def _moved(truth, previous) -> tuple[float, float]:
    """``(||truth - previous||², ||truth||²)`` in float64, a million elements at a time
    (no float64 copy of a large tensor); ``previous=None``: all of ``truth`` moved."""
    t = truth.reshape(-1)
    p = None if previous is None else previous.reshape(-1)
    moved = norm = 0.0
    for lo in range(0, t.numel(), PIECE):
        u = _f64(t[lo:lo + PIECE])
        sq = sq_dist(u)
        norm += sq
        moved += sq if p is None else sq_dist(u, _f64(p[lo:lo + PIECE]))
    return moved, norm


def _err(truth, restored) -> float:
    """``||restored - truth||²`` in float64, a million elements at a time."""
    t, r = truth.reshape(-1), restored.reshape(-1)
    return sum(sq_dist(_f64(r[lo:lo + PIECE]), _f64(t[lo:lo + PIECE]))
               for lo in range(0, t.numel(), PIECE))


def _raw_bytes(obj) -> int:
    return sum(t.numel() * t.element_size() for t in flat_tensors(obj).values())


def _u8(t: torch.Tensor) -> torch.Tensor:
    """The tensor's bytes as a flat uint8 tensor, a view where it is contiguous on the CPU."""
    return t.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8)


def _bytes(t: torch.Tensor) -> memoryview:
    return memoryview(_u8(t).numpy())


def _torch_bytes(obj) -> bytes:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def _contents(f) -> bytes:
    """A torch.save file's bytes, given as bytes or as a path."""
    if isinstance(f, (bytes, bytearray, memoryview)):
        return f
    with open(f, "rb") as fh:
        return fh.read()


def _zstd_compress(c, f) -> bytes:
    """zstd of a torch.save file (bytes or a path), read in pieces."""
    out = io.BytesIO()
    with (open(f, "rb") if not isinstance(f, (bytes, bytearray, memoryview))
          else io.BytesIO(f)) as src:
        c.copy_stream(src, out)
    return out.getvalue()           # shares the buffer: no copy


def _zstd_drain(d, z) -> int:
    """Decompress ``z`` in pieces, keeping none (the time of a streaming reader)."""
    n = 0
    with d.stream_reader(io.BytesIO(z)) as r:
        while chunk := r.read(1 << 22):
            n += len(chunk)
    return n


def _size(f) -> int:
    return len(f) if isinstance(f, (bytes, bytearray, memoryview)) else os.path.getsize(f)


def _median(xs):
    return statistics.median(xs) if xs else float("nan")


def _timed(fn):
    t0 = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - t0


# --- one file ----------------------------------------------------------------------------

def single(obj, torch_file: bytes, label: str, runs: int = 3) -> dict:
    """Lossless codec against torch.save and zstd-1/3 of the torch.save file."""
    zstandard = zstandard_module()
    raw = _raw_bytes(obj)
    rows = [{"method": "torch.save", "bytes": len(torch_file), "exact": True}]
    buf = io.BytesIO()
    lcckpt.save(obj, buf, compress=True)
    blob = buf.getvalue()
    back = lcckpt.load(io.BytesIO(blob))
    exact = all(a.dtype == b.dtype and a.shape == b.shape and torch.equal(_u8(a), _u8(b))
                for a, b in zip(flat_tensors(obj).values(), flat_tensors(back).values()))
    te = [_timed(lambda: lcckpt.save(obj, io.BytesIO(), compress=True))[1] for _ in range(runs)]
    td = [_timed(lambda: lcckpt.load(io.BytesIO(blob)))[1] for _ in range(runs)]
    rows.append({"method": "lcckpt lossless", "bytes": len(blob), "exact": exact,
                 "enc_MBps": raw / _median(te) / MB, "dec_MBps": raw / _median(td) / MB})
    for level in (1, 3):
        c, d = zstandard.ZstdCompressor(level=level), zstandard.ZstdDecompressor()
        z = c.compress(torch_file)
        te = [_timed(lambda: c.compress(torch_file))[1] for _ in range(runs)]
        td = [_timed(lambda: d.decompress(z))[1] for _ in range(runs)]
        rows.append({"method": f"zstd-{level} of torch.save", "bytes": len(z), "exact": True,
                     "enc_MBps": len(torch_file) / _median(te) / MB,
                     "dec_MBps": len(torch_file) / _median(td) / MB})
    for r in rows:
        r["ratio"] = len(torch_file) / r["bytes"]
    return {"file": label, "tensor_bytes": raw, "tensors": len(flat_tensors(obj)), "rows": rows}


# --- a run of files ----------------------------------------------------------------------

class Files:
    """The states of a run as a sequence that loads file ``i`` when it is asked for (any
    format lcckpt reads), so that a run of large checkpoints is never held at once:
    :func:`stream` takes the states one or two at a time."""

    def __init__(self, paths):
        self.paths = list(paths)

    def __len__(self) -> int:
        return len(self.paths)

    def __getitem__(self, i: int):
        return read_any(self.paths[i])[0]


def _movements(truth: dict, previous: dict | None) -> dict[str, tuple[float, float]]:
    """Per floating tensor ``(||truth - previous||², ||truth||²)`` (a tensor new since
    ``previous``, or of another shape, moved all of it)."""
    out = {}
    for k, t in truth.items():
        p = None if previous is None else previous.get(k)
        out[k] = _moved(t, p if p is not None and p.shape == t.shape else None)
    return out


def _errors(restored, truth, moved) -> tuple[float, float, dict]:
    """``(error of the state, error over the step, {role: (worst tensor's error over its
    step, its name)})``: one number can hide a tensor the delta lost, when others (an
    optimizer's moments) move more. What the step did not change lost nothing at it (its
    error, from earlier steps, is in the first number). ``moved``: :func:`_movements`."""
    res = tgt = step = 0.0
    roles: dict[str, tuple[float, str]] = {}
    for k, t in truth.items():
        r = _err(t, restored[k])
        m, n = moved[k]
        res, tgt, step = res + r, tgt + n, step + m
        if r > 0 and m > 0:
            w = (math.sqrt(r / m), k)
            role = role_of(f'["{k.rsplit(".", 1)[-1]}"]')       # by its last name: exp_avg, ...
            roles[role] = max(roles.get(role, (0.0, "")), w)
    return math.sqrt(res / tgt) if tgt else 0.0, math.sqrt(res / step) if step else 0.0, roles


def _chain_row(label, settings, objs, raw, moved, accuracy, bar) -> dict:
    """Write every state through a DeltaCheckpointer; measure size, speed and error.
    ``objs`` is read in order, one state at a time (a :class:`Files` loads each here)."""
    with tempfile.TemporaryDirectory(prefix="lcckpt-bench-") as d:
        ck = lcckpt.DeltaCheckpointer(d, keyframe_every=None, **settings)
        save_s, sizes = [], []
        for i in range(len(objs)):
            obj = objs[i]
            path, t = _timed(lambda: ck.save(i, obj))
            del obj
            save_s.append(t)
            sizes.append(os.path.getsize(path))
            bar.update()
        lossy = sum(t.get("kind") in ("lossy", "uniform") for i in range(1, len(objs))
                    for t in ck.info(i).get("tensors", {}).values())
        tracked = sum(len(ck.info(i).get("tensors", {})) for i in range(1, len(objs)))
        ck.close()
        ck = lcckpt.DeltaCheckpointer(d)     # a reader: the writer's references (a state) go
        load_s, err_w, err_c, worst, acc, roles = [], [], [], [], [], {}
        it = iter(ck.replay(copy=False))     # each state used before the next is taken
        for i in range(len(objs)):
            (_, obj), t = _timed(lambda: next(it))
            load_s.append(t)
            if i:
                ew, ec, by_role = _errors(_floats(obj), _floats(objs[i]), moved[i])
                for role, w in by_role.items():
                    roles[role] = max(roles.get(role, (0.0, "")), w)
                err_w.append(ew)
                err_c.append(ec)
                worst.append(max(by_role.values(), default=(0.0, "")))
                if accuracy is not None:
                    acc.append(accuracy(obj))
            bar.update()
    deltas = sum(sizes[1:])
    row = {"method": label, "bytes": deltas, "keyframe_bytes": sizes[0],
           "enc_MBps": _median([r / t / MB for r, t in zip(raw[1:], save_s[1:])]),
           "dec_MBps": _median([r / t / MB for r, t in zip(raw[1:], load_s[1:])]),
           "err_state": max(err_w), "err_vs_change": max(err_c),
           "worst_tensor_err_vs_change": max(worst)[0], "worst_tensor": max(worst)[1],
           "worst_by_role": {r: {"err_vs_change": v, "tensor": k} for r, (v, k) in roles.items()},
           "lossy_tensors": f"{lossy}/{tracked}", "exact": False,
           "per_file": [{"bytes": s, "err_state": a, "err_vs_change": b,
                         "worst_tensor_err_vs_change": w[0], "worst_tensor": w[1]}
                        for s, a, b, w in zip(sizes[1:], err_w, err_c, worst)]}
    if acc:
        row["accuracy"] = acc[-1]
        row["accuracy_min"] = min(acc)
        for f, a in zip(row["per_file"], acc):
            f["accuracy"] = a
    return row


def _exact_rows(objs: list, raw: list, torch_files: list, zstandard, bar) -> list[dict]:
    """The exact baselines of files 2..n: lcckpt lossless of every file, zstd-1/3 of every
    torch.save file, and zstd-3 of the exact delta of the floating tensors (what a generic
    tool gets from deltas)."""
    n = len(objs) - 1
    rows = []
    # lcckpt lossless of every file, and zstd of every torch.save file
    sizes, te, td = [], [], []
    with tempfile.TemporaryDirectory(prefix="lcckpt-bench-") as d:
        path = os.path.join(d, "file.lcc")
        for i in range(1, len(objs)):
            o, r = objs[i], raw[i]          # saved to a path: written as it is encoded
            _, t = _timed(lambda: lcckpt.save(o, path, compress=True))
            te.append(r / t / MB)
            sizes.append(os.path.getsize(path))
            o = None
            td.append(r / _timed(lambda: lcckpt.load(path))[1] / MB)
            bar.update()
    rows.append({"method": "lcckpt lossless (each file)", "bytes": sum(sizes),
                 "enc_MBps": _median(te), "dec_MBps": _median(td), "exact": True})
    trim_heap()          # the loaded state and the reads' buffers: freed
    for level in (1, 3):
        c, d = zstandard.ZstdCompressor(level=level), zstandard.ZstdDecompressor()
        sizes, te, td = [], [], []
        for f in torch_files[1:]:       # streamed: neither the file nor its copy is held
            n = _size(f)
            z, t = _timed(lambda: _zstd_compress(c, f))
            te.append(n / t / MB)
            td.append(n / _timed(lambda: _zstd_drain(d, z))[1] / MB)
            sizes.append(len(z))
            del z
        rows.append({"method": f"zstd-{level} of torch.save", "bytes": sum(sizes),
                     "enc_MBps": _median(te), "dec_MBps": _median(td), "exact": True})
        bar.update(n)
    trim_heap()          # the compressed files' buffers: freed
    # the exact delta of the floating tensors, zstd-3: what a generic tool gets from deltas
    c = zstandard.ZstdCompressor(level=3)
    sizes, te = [], []
    fp = flat_tensors(objs[0])
    for i in range(1, len(objs)):
        fc = flat_tensors(objs[i])
        co, nz, nbytes, t = c.compressobj(), 0, 0, 0.0    # piece by piece: no joined copy
        for k in fc:
            for piece in _delta_pieces(fc[k], fp.get(k)):
                z, dt = _timed(lambda: co.compress(piece))
                nz, nbytes, t = nz + len(z), nbytes + len(piece), t + dt
        z, dt = _timed(co.flush)
        te.append(nbytes / (t + dt) / MB)
        sizes.append(nz + len(z))
        fp = fc
    rows.append({"method": "zstd-3 of the exact delta", "bytes": sum(sizes),
                 "enc_MBps": _median(te), "exact": True})
    return rows


def _delta_pieces(cur: torch.Tensor, prev: torch.Tensor | None):
    """The bytes of ``cur - prev`` (of ``cur`` where ``prev`` is missing, of another
    shape, or not floating), :data:`PIECE` elements at a time through one buffer: a
    whole-tensor difference would hold another copy of the largest tensor."""
    if cur.dtype not in FLOATS or prev is None or prev.shape != cur.shape:
        yield _bytes(cur)
        return
    c, p = cur.detach().reshape(-1), prev.detach().reshape(-1).to(cur.dtype)
    buf = torch.empty(min(PIECE, c.numel()), dtype=cur.dtype)
    for lo in range(0, c.numel(), PIECE):
        n = min(PIECE, c.numel() - lo)
        torch.sub(c[lo:lo + n], p[lo:lo + n], out=buf[:n])
        yield _bytes(buf[:n])


def stream(objs: list, torch_files: list[bytes], *, settings=None, error_bounds=(),
           accuracy: Callable[[Any], float] | None = None, desc: str = "bench") -> dict:
    """Files 2..n of a run as deltas, beside torch.save and zstd of the same files.

    ``objs``: the states, oldest first: a list, or a :class:`Files` that loads each when
    it is needed (every row reads them in order, holding one or two); ``torch_files``:
    their torch.save files, as bytes or as paths (read one at a time when compressed).
    ``accuracy(obj) -> float``, if given, scores each restored state (and the true ones).
    """
    if len(objs) < 2:
        raise InvalidArgumentError("a delta stream needs at least two checkpoints of one run")
    zstandard = zstandard_module()
    settings = list(settings if settings is not None else SETTINGS)
    settings += [(f"lcckpt b=2, error <= {eb:g}", {"bits": 2, "error_bound": eb})
                 for eb in error_bounds]
    raw, moved, true_acc, last = [], [], [], None
    n = len(objs) - 1
    bar = progress(2 * len(objs) * len(settings) + 4 * n + 1, desc)
    for i in range(len(objs)):          # what the rows compare with, one state at a time
        o = objs[i]
        truth = _floats(o)
        if last is not None and not any(k in last and last[k].shape == v.shape
                                        for k, v in truth.items()):
            raise InvalidArgumentError(     # optimizer state may appear after the first step
                f"checkpoints {i} and {i + 1} share no floating tensor (same name and shape): "
                "a delta stream needs files of one run, oldest first")
        raw.append(_raw_bytes(o))
        moved.append(_movements(truth, last))
        if i == 0:
            tensors = len(flat_tensors(o))
        if i == n:
            floats = int(sum(v.numel() for v in truth.values()))
        if accuracy is not None:
            true_acc.append(accuracy(o))
        o, last = None, truth
        bar.update()
    last = truth = None
    rows = [{"method": "torch.save", "bytes": sum(map(_size, torch_files[1:])), "exact": True}]
    rows += _exact_rows(objs, raw, torch_files, zstandard, bar)
    true_acc = true_acc if accuracy is not None else None
    for label, kw in settings:
        gc.collect()                     # the previous setting's chain and references,
        trim_heap()                      # given back to the system before the next one
        row = _chain_row(label, kw, objs, raw, moved, accuracy, bar)
        if true_acc is not None:
            row["accuracy_drop_max"] = max(t - f["accuracy"]
                                           for t, f in zip(true_acc[1:], row["per_file"]))
        rows.append(row)
    bar.close()
    base = rows[0]["bytes"]
    for r in rows:
        r["ratio"] = base / r["bytes"] if r["bytes"] else math.inf
    doc = {"files": len(objs), "deltas": n, "tensor_bytes": raw[0],
           "tensors": tensors, "float_elements": floats, "rows": rows}
    if true_acc is not None:
        doc["accuracy_true"] = true_acc[-1]
        doc["accuracy_true_per_file"] = true_acc
    return doc


# --- the command -------------------------------------------------------------------------

COLUMNS = {"method": "method", "bytes": "MB", "ratio": "x smaller", "err_state": "err_state",
           "err_vs_change": "err/step", "worst_tensor_err_vs_change": "worst tensor err/step",
           "enc_MBps": "save MB/s", "dec_MBps": "load MB/s"}


def table(rows: list[dict]) -> str:
    """The stream's rows as a text table (MB, short headers)."""
    return format_table([{h: (r.get(k) / MB if k == "bytes" else r.get(k))
                          for k, h in COLUMNS.items()} for r in rows], list(COLUMNS.values()))


def run(paths: list[str], *, error_bounds=(), runs: int = 3, log=print) -> dict:
    """Benchmark the files (any format lcckpt reads); returns the JSON doc. A run of
    files is read one state at a time (:class:`Files`): beside the writer's or reader's
    references, the bench holds one or two states, however many files there are."""
    lcckpt.warmup()
    doc: dict[str, Any] = {"environment": environment(), "paths": list(paths)}
    if len(paths) == 1:
        obj, fmt = read_any(paths[0])
        tfile = _contents(paths[0]) if fmt == "torch" else _torch_bytes(obj)
        doc["single"] = single(obj, tfile, paths[0], runs)
        d = doc["single"]
        log(f"{paths[0]}: {d['tensors']} tensors, {d['tensor_bytes'] / MB:.2f} MB of tensor "
            f"data; ratios against torch.save ({d['rows'][0]['bytes'] / MB:.2f} MB)")
        log(format_table(d["rows"], ["method", "bytes", "ratio", "exact", "enc_MBps",
                                     "dec_MBps"]))
        return doc
    from lcckpt.interop.convert import detect_format
    with tempfile.TemporaryDirectory(prefix="lcckpt-bench-") as d:
        torch_files = []                  # paths: torch.save of the other formats' states
        bar = progress(len(paths), "formats")
        for i, p in enumerate(paths):
            if not os.path.isdir(p) and detect_format(p) == "torch":
                torch_files.append(os.fspath(p))
            else:
                torch_files.append(os.path.join(d, f"{i}.pt"))
                torch.save(read_any(p)[0], torch_files[-1])
            bar.update()
        bar.close()
        doc["stream"] = stream(Files(paths), torch_files, error_bounds=error_bounds)
    s = doc["stream"]
    log(f"{len(paths)} checkpoints, {s['tensors']} tensors ({s['float_elements']:,} floating "
        f"elements, {s['tensor_bytes'] / MB:.2f} MB each); the {s['deltas']} file(s) after "
        "the first, as deltas; ratio against torch.save")
    log(table(s["rows"]))
    log(summary_line(s))
    return doc


def summary_line(s: dict) -> str:
    """The default's ratio against torch.save and zstd-3, and what its deltas kept."""
    rows = {r["method"]: r for r in s["rows"]}
    d, z = rows.get(DEFAULT), rows.get("zstd-3 of torch.save")
    if d is None or z is None:
        return ""
    roles = d.get("worst_by_role", {})
    w = roles.get("weight", {"err_vs_change": 0.0, "tensor": ""})
    worst = w["err_vs_change"]
    kept = ("every weight is restored exactly" if worst == 0 else
            f"every weight's restored error stays under {worst:.2g} of its step's change"
            if worst < 0.5 else
            f"but the weight {w['tensor']} lost most of its change (error {worst:.2f} of "
            "its step): DeltaCheckpointer(target=lcckpt.RolePolicy(weight=...)) with a "
            "smaller share keeps more")
    moments = ", ".join(f"{r.replace('_', ' ')}s up to {roles[r]['err_vs_change']:.2g}"
                        for r in ("first_moment", "second_moment") if r in roles)
    if moments:
        kept += (f" (optimizer moments are held to {DEFAULT_POLICY.first_moment:g} and "
                 f"{DEFAULT_POLICY.second_moment:g} of their movement, by design: {moments})")
    state = "is exact" if d["err_state"] == 0 else f"is within {d['err_state']:.2g} relative error"
    return textwrap.fill(
        f"Default chain: {d['ratio']:.1f}x smaller than torch.save and "
        f"{z['bytes'] / d['bytes']:.1f}x smaller than zstd-3 of the same files; the restored "
        f"state {state}; {kept}.", 92)
