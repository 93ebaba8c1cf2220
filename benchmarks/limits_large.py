"""The default limits accept the library's own large files: a 1 GiB state, at the defaults.

    python benchmarks/limits_large.py [--gib 1] [--json]

Writes, with ``CheckpointManager(every=1)``, a keyframe and three deltas of a model
holding ``--gib`` GiB of fp32 weights, where each step changes one 4,096-element block
(so each delta is about a million times smaller than the state), then two ``torch.save``
files of the state. Each check runs in a fresh child process with the process default
``max_bytes="auto"``, reporting its outcome and peak resident memory:

* ``lcckpt verify`` on the chain directory (exit 0, every step OK);
* ``CheckpointManager.restore()`` (the newest step, each tensor within 1% of what it
  moved since the keyframe, nothing set aside);
* ``lcckpt.load`` of the newest step through the chain, and of the keyframe as a file;
* ``lcckpt bench --checkpoint`` on the two torch.save files.

Exits 1 if any check fails. Needs about 3 x the state in free RAM and disk.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, ROOT)

import lcckpt  # noqa: E402

BLOCK = 4096


class Big(torch.nn.Module):
    def __init__(self, gib: float):
        super().__init__()
        n = int(gib * (1 << 30)) // 4 // 4
        self.w = torch.nn.ParameterList(torch.nn.Parameter(torch.zeros(n)) for _ in range(4))
        g = torch.Generator().manual_seed(0)
        with torch.no_grad():
            for p in self.w:
                p.normal_(generator=g)


def _write(d: str, gib: float) -> dict:
    model = Big(gib)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sizes = {}
    with lcckpt.CheckpointManager(os.path.join(d, "ck"), model, opt, every=1) as mgr:
        for step in range(4):
            with torch.no_grad():        # one block of one tensor moves per step
                p = model.w[step % 4]
                p[step * BLOCK:(step + 1) * BLOCK] += 0.01
            mgr.step()
            mgr.wait()
        final = [p.detach().clone() for p in model.w]
    ck = lcckpt.DeltaCheckpointer(os.path.join(d, "ck"))
    for s in ck.steps():
        sizes[s] = os.path.getsize(ck.path(s))
    torch.save(model.state_dict(), os.path.join(d, "a.pt"))
    with torch.no_grad():
        model.w[0][:BLOCK] += 0.01
    torch.save(model.state_dict(), os.path.join(d, "b.pt"))
    torch.save(final, os.path.join(d, "final.pt"))
    return {"files": sizes, "state_bytes": sum(p.numel() * 4 for p in model.w)}


_RESTORE = """
import sys, os, torch, lcckpt
sys.path.insert(0, sys.argv[2])
from limits_large import BLOCK, Big
d, gib = sys.argv[1], float(sys.argv[3])
model = Big(gib)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
with lcckpt.CheckpointManager(os.path.join(d, "ck"), model, opt, every=1) as mgr:
    step = mgr.restore()
final = torch.load(os.path.join(d, "final.pt"))
moved = 0.01 * BLOCK ** 0.5          # what one step moved a tensor, since the keyframe
err = max(float((p.detach() - f).norm()) / moved for p, f in zip(model.w, final))
damaged = [n for n in os.listdir(os.path.join(d, "ck")) if n.endswith(".damaged")]
print("restored step", step, f"error {err:.2g} of the movement", "damaged", len(damaged))
sys.exit(0 if err <= 0.01 and not damaged else 1)
"""

_LOAD = """
import sys, os, lcckpt
d = sys.argv[1]
ck = lcckpt.DeltaCheckpointer(os.path.join(d, "ck"))
steps = ck.steps()
ck.load(steps[-1])
lcckpt.load(ck.path(steps[0]))
print("loaded step", steps[-1], "through the chain and step", steps[0], "as a file")
"""


def _peak(args: list[str]) -> dict:
    """Run ``args`` in a child process: its exit code, last line of output, and peak
    resident memory (the wrapper's RUSAGE_CHILDREN once the child has exited)."""
    wrapper = ("import resource, subprocess, sys, json; "
               "p = subprocess.run(sys.argv[1:], capture_output=True, text=True); "
               "print(json.dumps({'rc': p.returncode, 'out': p.stdout.strip().splitlines()[-1:], "
               "'err': p.stderr[-600:], "
               "'rss_kib': resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss}))")
    t = time.perf_counter()
    p = subprocess.run([sys.executable, "-c", wrapper, *args], capture_output=True, text=True,
                       env={**os.environ, "PYTHONPATH": ROOT})
    rep = json.loads(p.stdout)
    rep["s"] = round(time.perf_counter() - t, 1)
    return rep


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gib", type=float, default=1.0)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    py = sys.executable
    with tempfile.TemporaryDirectory() as d:
        built = _write(d, args.gib)
        kf, *deltas = [built["files"][s] for s in sorted(built["files"])]
        checks = {
            "lcckpt verify": _peak([py, "-m", "lcckpt", "verify", os.path.join(d, "ck")]),
            "CheckpointManager.restore()": _peak([py, "-c", _RESTORE, d, HERE, str(args.gib)]),
            "DeltaCheckpointer.load / lcckpt.load": _peak([py, "-c", _LOAD, d]),
            "lcckpt bench --checkpoint": _peak([py, "-m", "lcckpt", "bench", "--checkpoint",
                                                os.path.join(d, "a.pt"), os.path.join(d, "b.pt")]),
        }
    res = {"state_bytes": built["state_bytes"], "keyframe_bytes": kf, "delta_bytes": deltas,
           "smallest_delta_ratio": round(built["state_bytes"] / max(deltas)),
           "checks": checks}
    if args.json:
        print(json.dumps(res, indent=1))
    else:
        print(f"state {res['state_bytes'] / 2**30:.2f} GiB; keyframe {kf:,} B; deltas "
              f"{', '.join(f'{n:,}' for n in deltas)} B (each >= {res['smallest_delta_ratio']:,}x "
              "smaller than the state)")
        for name, r in checks.items():
            print(f"{name:40} rc={r['rc']} peak RSS {r['rss_kib'] / 2**20:.2f} GiB "
                  f"{r['s']:6.1f} s  {' '.join(r['out'])}")
            if r["rc"]:
                print("   ", r["err"].strip().replace("\n", "\n    "))
    return 1 if any(r["rc"] for r in checks.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
