"""Peak resident memory of the default path, each case in a child process of its own.

The state is the save benchmark's: the ~20M-parameter MLP trained on digits with Adam
(``train_trajectory(model="mlp", optimizer="adam")``), about 245 MB with both moments.
Three snapshots are written with ``torch.save`` first; each child then imports, loads what
it needs, and reports its resident memory before the measured call and the peak during it
(``VmHWM``, reset through ``/proc/self/clear_refs`` just before the call, so the peak is
the call's own and not the loading's). Cases:

* ``save``: a default ``DeltaCheckpointer`` made and used for a keyframe and two deltas,
  in a process holding the three states; ``delta``: the second delta save alone, the
  writer's reference already resident;
* ``restore``: ``DeltaCheckpointer.load`` of the newest step (keyframe + 2 deltas) in a
  process that holds nothing else; ``restore-into``: the same with ``into=`` that step's
  state, which the process holds already (its tensors are decoded into);
* ``manager``: a ``CheckpointManager`` made for a live model and Adam optimizer, and
  three checkpoints (a keyframe, two deltas) taken by ``step()`` and written in the
  background from a snapshot, each waited for; ``manager-sync``: the same with
  ``background=False`` (written in ``step()`` from the live state, no snapshot);
  ``manager-overlap``: with ``background="overlap"`` (written in the background from the
  live state, the optimizer's next step waiting for it); ``restart``: a new process's
  model and empty Adam optimizer, ``restore()`` of a manager's run of the three states,
  then one checkpoint written in ``step()``; ``restart-rank``: that restore on a rank
  that does not write (``writer=False``, as DDP's other ranks), which keeps no reference;
* ``bench``: ``lcckpt bench --checkpoint`` of two of the torch files;
* ``dist-restore``: ``lcckpt.distributed.load`` of an exact distributed checkpoint of the
  newest state (``lcckpt.distributed.save``, one process) into that state's tensors,
  which the process holds already; ``dist-chain``: the same from a default distributed
  chain of the three states (``DistributedCheckpointer.load``: keyframe + 2 deltas).

Each case's "extra" is peak minus what the process held before (its states, or for
``restore`` and ``bench`` the imported interpreter alone), against the bars of the plan:
beyond the state, a save or restore at most the reference plus 10% of the state (for
``delta`` the reference is resident before; a restore makes the state; ``restore-into``,
``dist-restore`` and ``dist-chain`` keep no reference and load into tensors they hold;
``restart`` makes all of the state but the model, which the process holds), the manager
at most 1.5x the state, ``bench`` at most 3x one state.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

MB = 1e6

_CHILD = r"""
import json, os, sys, torch
import lcckpt

def status(key):
    with open("/proc/self/status") as f:
        return next(int(l.split()[1]) * 1024 for l in f if l.startswith(key + ":"))

def reset_peak():
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")

case, d = sys.argv[1], sys.argv[2]
lcckpt.warmup()
torch.set_num_threads(2)
out = {}
if case in ("save", "delta"):
    snaps = [torch.load(f"{d}/s{i}.pt") for i in range(3)]
    if case == "save":
        before = status("VmRSS"); reset_peak()
    ck = lcckpt.DeltaCheckpointer(f"{d}/chain_{case}")
    ck.save(0, snaps[0])
    ck.save(1, snaps[1])
    if case == "delta":
        before = status("VmRSS"); reset_peak()
    ck.save(2, snaps[2])
    out["calls"] = ("DeltaCheckpointer(d), keyframe + 2 delta saves" if case == "save"
                    else "the second delta save alone")
elif case == "restore":
    ck = lcckpt.DeltaCheckpointer(f"{d}/chain")
    before = status("VmRSS"); reset_peak()
    state = ck.load()
    out["calls"] = "DeltaCheckpointer.load (newest: keyframe + 2 deltas)"
elif case == "restore-into":
    target = torch.load(f"{d}/s2.pt")
    ck = lcckpt.DeltaCheckpointer(f"{d}/chain")
    before = status("VmRSS"); reset_peak()
    state = ck.load(into=target)
    out["calls"] = "DeltaCheckpointer.load(into=...) of the newest step into the state's tensors"
elif case.startswith("manager"):
    from lcckpt.bench.trajectory import _MODELS
    sd = torch.load(f"{d}/s2.pt")
    model = _MODELS["mlp"]()
    model.load_state_dict(sd["model"])
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    opt.load_state_dict(sd["optim"])
    del sd
    before = status("VmRSS"); reset_peak()
    background = {"manager": True, "manager-sync": False, "manager-overlap": "overlap"}[case]
    m = lcckpt.CheckpointManager(f"{d}/{case}", model, opt, every=1, background=background)
    for _ in range(3):                   # a keyframe, then two deltas
        m.step()                         # every=1: each step takes one
        m.wait()
        with torch.no_grad():
            for p in model.parameters():
                p.add_(1e-4)
    out["calls"] = "CheckpointManager: keyframe + 2 delta checkpoints, " + {
        "manager": "written in the background, each waited for",
        "manager-sync": "background=False (written in step())",
        "manager-overlap": "background='overlap' (from the live state), each waited for"}[case]
    m.close()
elif case in ("restart", "restart-rank"):
    from lcckpt.bench.trajectory import _MODELS
    model = _MODELS["mlp"]()             # a new process: a fresh model, no optimizer state
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    writer = case == "restart"
    before = status("VmRSS"); reset_peak()
    m = lcckpt.CheckpointManager(f"{d}/restart", model, opt, every=1, background=False,
                                 writer=writer)
    m.restore()
    if writer:
        with torch.no_grad():
            for p in model.parameters():
                p.add_(1e-4)
        m.step()
    m.close()
    out["calls"] = ("CheckpointManager.restore (keyframe + 2 deltas), then a checkpoint in "
                    "step()" if writer else "CheckpointManager(writer=False).restore "
                    "(keyframe + 2 deltas)")
elif case == "bench":
    from lcckpt.cli import main
    before = status("VmRSS"); reset_peak()
    with open(os.devnull, "w") as null:
        old, sys.stdout = sys.stdout, null
        try:
            main(["bench", "--checkpoint", f"{d}/s1.pt", f"{d}/s2.pt"])
        finally:
            sys.stdout = old
    out["calls"] = "lcckpt bench --checkpoint s1.pt s2.pt"
elif case == "dist-restore":
    import lcckpt.distributed as ld
    target = torch.load(f"{d}/s2.pt")
    before = status("VmRSS"); reset_peak()
    ld.load(target, f"{d}/dist")
    out["calls"] = "lcckpt.distributed.load of an exact checkpoint into the state's tensors"
elif case == "dist-chain":
    import lcckpt.distributed as ld
    target = torch.load(f"{d}/s2.pt")
    ck = ld.DistributedCheckpointer(f"{d}/dchain")
    before = status("VmRSS"); reset_peak()
    ck.load(target)
    out["calls"] = "DistributedCheckpointer.load (keyframe + 2 deltas) into the state's tensors"
out.update(before=before, peak=status("VmHWM"))
print(json.dumps(out))
"""

CASES = ("save", "delta", "restore", "restore-into", "manager", "manager-sync",
         "manager-overlap", "restart", "restart-rank", "bench", "dist-restore", "dist-chain")


def prepare(d: str, steps: int = 6) -> dict:
    """Three snapshots of the MLP under Adam as torch files, and a default chain of them."""
    import warnings

    import torch

    import lcckpt
    import lcckpt.distributed as ld
    from ..interop.convert import flat_tensors
    from .trajectory import _MODELS, train_trajectory
    traj = train_trajectory(model="mlp", optimizer="adam", steps=steps,
                            snapshot_every=steps // 3)
    snaps = [s for _, s in traj.snapshots[-3:]]
    with lcckpt.DeltaCheckpointer(os.path.join(d, "chain")) as ck:
        for i, s in enumerate(snaps):
            torch.save(s, os.path.join(d, f"s{i}.pt"))
            ck.save(i, s)
    with warnings.catch_warnings():          # DCP: no process group, one process saves
        warnings.simplefilter("ignore", UserWarning)
        ld.save(snaps[-1], os.path.join(d, "dist"))
        dchain = ld.DistributedCheckpointer(os.path.join(d, "dchain"))
        for i, s in enumerate(snaps):
            dchain.save(i, s)
    model = _MODELS["mlp"]()                 # a manager's run of the same states
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    with lcckpt.CheckpointManager(os.path.join(d, "restart"), model, opt, every=1,
                                  background=False) as m:
        for s in snaps:
            model.load_state_dict(s["model"])
            opt.load_state_dict(s["optim"])
            m.step()
    tensors = flat_tensors(snaps[-1]).values()
    return {"state_bytes": sum(v.numel() * v.element_size() for v in tensors),
            "fp32_tracked_bytes": sum(v.numel() * 4 for v in tensors
                                      if v.is_floating_point() and v.numel() >= 1024),
            "model_bytes": sum(v.numel() * v.element_size() for v in snaps[-1]["model"].values())}


def run(cases=CASES, directory: str | None = None) -> dict:
    if sys.platform != "linux":
        raise RuntimeError("the memory benchmark reads /proc/self/status (Linux only)")
    with tempfile.TemporaryDirectory(dir=directory) as d:
        info = prepare(d)
        rows = []
        for case in cases:
            p = subprocess.run([sys.executable, "-c", _CHILD, case, d], capture_output=True,
                               text=True, check=False)
            if p.returncode:
                raise RuntimeError(f"memory case {case!r} failed:\n{p.stderr[-3000:]}")
            r = json.loads(p.stdout.strip().splitlines()[-1])
            r["case"], r["extra"] = case, r["peak"] - r["before"]
            rows.append(r)
    s, ref = info["state_bytes"], info["fp32_tracked_bytes"]
    # beyond the process's own state: a save or a restore at most the reference + 10% of
    # the state (a save's "before" holds both already; a restore makes the state itself;
    # a restart's process holds the model, the restore brings the rest of the state)
    bars = {"save": ref + 0.1 * s, "delta": 0.1 * s, "restore": s + ref + 0.1 * s,
            "restore-into": 0.1 * s, "manager": 1.5 * s, "manager-sync": 1.5 * s,
            "manager-overlap": 1.5 * s, "restart": s - info["model_bytes"] + ref + 0.1 * s,
            "restart-rank": s - info["model_bytes"] + 0.1 * s,
            "bench": 3 * s, "dist-restore": 0.1 * s, "dist-chain": 0.1 * s}
    for r in rows:
        r["bar"] = bars[r["case"]]
        r["extra_over_state"] = r["extra"] / s
    return {**info, "rows": rows}


def table(res: dict) -> str:
    from .timing import format_table
    s = res["state_bytes"]
    rows = [{"case": r["case"], "what": r["calls"], "before MB": r["before"] / MB,
             "peak MB": r["peak"] / MB, "extra MB": r["extra"] / MB,
             "extra / state": r["extra"] / s, "bar MB": r["bar"] / MB,
             "within": "yes" if r["extra"] <= r["bar"] else "NO"} for r in res["rows"]]
    return format_table(rows, ["case", "what", "before MB", "peak MB", "extra MB",
                               "extra / state", "bar MB", "within"])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--cases", nargs="+", choices=CASES, default=list(CASES))
    ap.add_argument("--dir", default=None, help="where to write (default: a temp directory)")
    ap.add_argument("--json", default=None)
    a = ap.parse_args(argv)
    res = run(a.cases, a.dir)
    print(f"state: {res['state_bytes'] / MB:.1f} MB (floats tracked as fp32: "
          f"{res['fp32_tracked_bytes'] / MB:.1f} MB, the reference a writer keeps)")
    print(table(res))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(res, f, indent=1)
    return 0
