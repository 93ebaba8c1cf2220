"""Memory of a writer whose state is mostly frozen: a LoRA fine-tune of MiniLM-L6.

``python benchmarks/frozen.py [--dtype fp32|bf16] [--steps 30] [--every 3]``

The fine-tune of the quality benchmark's ``minilm-lora`` workload (rank-8 adapters on
the attention's query and value projections of the pretrained all-MiniLM-L6-v2, the rest
of the encoder frozen, AdamW on what trains; ``lcckpt.bench.finetune.train``) saves
``model.state_dict()`` and AdamW's state into a default ``DeltaCheckpointer`` every
``--every`` steps, in a child process per mode:

* ``parked``: as the library does: a tensor whose delta came out zero leaves the
  writer's memory (lcckpt/codec/parked.py);
* ``kept``: every reference kept in memory (parking turned off), as before.

Each child reports its resident memory at the end of the last save beyond what it held
as the first began (the model, the optimizer, the task's data and the state being saved
are resident at both; both taken after ``malloc_trim``, which gives freed memory back),
its peak beyond that start, the bytes of the references the writer holds at the end, the
median delta save, and the files' digest; the two modes must write the same files, bit
for bit.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile

from ..errors import InvalidArgumentError

MB = 1e6

_CHILD = r"""
import gc, hashlib, json, os, sys, time, torch
import lcckpt, lcckpt.codec.delta as delta_mod
from lcckpt.bench import finetune
from lcckpt.bench.checkpoint import trim_heap

def status(key):
    with open("/proc/self/status") as f:
        return next(int(l.split()[1]) * 1024 for l in f if l.startswith(key + ":"))

mode, d, dtype = sys.argv[1:4]
steps, every = int(sys.argv[4]), int(sys.argv[5])
if mode == "kept":
    delta_mod.PARK_MIN = 1 << 62
lcckpt.warmup()
torch.set_num_threads(2)
finetune.docstring_task(0)          # the data and tokenizer, resident before
finetune.train(steps=1, lora=8, dtype=None if dtype == "fp32" else torch.bfloat16)
ck, times, before, last = None, [], None, []

def trimmed_rss():
    gc.collect()
    trim_heap()                      # what the allocator keeps of freed memory, given back
    return status("VmRSS")

def save(step, state):
    global ck, before
    if ck is None:
        before = trimmed_rss()
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        ck = lcckpt.DeltaCheckpointer(os.path.join(d, mode))
    t0 = time.perf_counter()
    ck.save(step, state)
    times.append(time.perf_counter() - t0)
    last.append(trimmed_rss())       # the state saved is resident here, as at the first

finetune.train(steps=steps, lora=8, save=save, save_every=every,
               dtype=None if dtype == "fp32" else torch.bfloat16)
held = sum(e._ref.nbytes for e in ck._encoders.values()
           if isinstance(e, delta_mod.DeltaEncoder) and e._ref is not None)
parked = sum(1 for e in ck._encoders.values()
             if isinstance(e, delta_mod.DeltaEncoder) and e.parked)
h = hashlib.sha256()
for s in ck.steps():
    with open(ck.path(s), "rb") as f:
        h.update(f.read())
peak, after = status("VmHWM"), last[-1]
print(json.dumps({"mode": mode, "resident": after - before, "peak": peak - before,
                  "held": held, "parked": parked, "tensors": len(ck._encoders),
                  "files": sum(os.path.getsize(ck.path(s)) for s in ck.steps()),
                  "digest": h.hexdigest(), "saves": len(times),
                  "delta_save_s": sorted(times[1:])[len(times[1:]) // 2]}))
"""


def run(dtype: str = "fp32", steps: int = 30, every: int = 3) -> dict:
    if sys.platform != "linux":
        raise RuntimeError("the memory benchmark reads /proc/self/status (Linux only)")
    if every < 1 or steps < 2 * every:
        raise InvalidArgumentError(f"need every >= 1 and steps >= 2 * every (a keyframe and "
                                   f"a delta at least), got steps={steps}, every={every}")
    rows = []
    with tempfile.TemporaryDirectory() as d:
        for mode in ("parked", "kept"):
            p = subprocess.run([sys.executable, "-c", _CHILD, mode, d, dtype, str(steps),
                                str(every)], capture_output=True, text=True, check=False)
            if p.returncode:
                raise RuntimeError(f"mode {mode!r} failed:\n{p.stderr[-3000:]}")
            rows.append(json.loads(p.stdout.strip().splitlines()[-1]))
    same = rows[0]["digest"] == rows[1]["digest"]
    return {"dtype": dtype, "steps": steps, "every": every, "rows": rows, "same_files": same}


def table(res: dict) -> str:
    from ..util.table import format_table
    rows = [{"mode": r["mode"], "saves": r["saves"], "parked tensors":
             f"{r['parked']} of {r['tensors']}", "references held MB": r["held"] / MB,
             "resident after MB": r["resident"] / MB, "peak MB": r["peak"] / MB,
             "files MB": r["files"] / MB, "delta save s (median)": r["delta_save_s"]}
            for r in res["rows"]]
    return format_table(rows, list(rows[0]))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--every", type=int, default=3)
    ap.add_argument("--json", default=None)
    a = ap.parse_args(argv)
    res = run(a.dtype, a.steps, a.every)
    print(f"MiniLM-L6 LoRA fine-tune ({a.dtype}), {a.steps} steps, a save every {a.every}; "
          "memory beyond the start of the first save")
    print(table(res))
    print("same files in both modes:", "yes" if res["same_files"] else "NO")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(res, f, indent=1)
    return 0 if res["same_files"] else 1
