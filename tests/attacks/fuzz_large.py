"""The large fuzz run (not part of the default suite): thousands of damaged, forged,
linked and faulted cases, each loaded in a worker process under a 4 GB address-space limit.

    python tests/attacks/fuzz_large.py [--seed 0] [--scale 1]

Builds plain, compressed and chain checkpoints of a small model, of states made to
have many equal-length sections and of sparse moments (exact blobs with zero runs),
then runs tests/_fuzz_worker.py on each: bit flips, truncations, every swap of
equal-length sections, every same-length splice from a neighbouring file,
decompression bombs and forged headers. Then
tests/attacks/_fuzz_foreign.py (torch.save and safetensors files: flips, truncations,
zip bombs, crafted safetensors headers) and tests/attacks/_fuzz_storage.py (injected
EIO/EPERM/ENOSPC/EROFS on every fsync, rename, unlink and create of a run of saves; a
tmpfs that fills up or turns read-only, where it can be mounted; symlinks and hard links
in and out of a chain directory). Prints one row per worker and the totals; exits 1 if
any case loaded wrong data silently, passed ``verify``, escaped the LcckptError
hierarchy, lost a committed step or touched a file outside its directory.
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
TESTS = os.path.dirname(HERE)
ROOT = os.path.dirname(TESTS)
sys.path[:0] = [ROOT, TESTS]

import torch  # noqa: E402

import lcckpt  # noqa: E402


def _model_state(seed: int) -> dict:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3), torch.nn.BatchNorm2d(8),
                                torch.nn.ReLU(), torch.nn.Flatten(), torch.nn.Linear(8 * 6 * 6, 10))
    opt = torch.optim.Adam(model.parameters())
    for _ in range(2):
        opt.zero_grad()
        model(torch.randn(4, 3, 8, 8)).sum().backward()
        opt.step()
    return {"model": model.state_dict(), "optim": opt.state_dict(), "epoch": 2}


def _twins(seed: int) -> dict:
    """Many tensors of one size: every compressed section has equal-length partners."""
    g = torch.Generator().manual_seed(seed)
    out = {f"w{i}": torch.randint(-2**31, 2**31 - 1, (64,), dtype=torch.int32, generator=g)
           for i in range(12)}
    out.update({f"c{i}": torch.full((32,), float(i)) for i in range(8)})
    return out


def _sparse(seed: int) -> dict:
    """Moments of embedding rows no batch used: exact blobs with zero-runs chunks (v4)."""
    g = torch.Generator().manual_seed(seed)
    m = torch.randn(600, 128, generator=g) * 1e-3
    m[torch.rand(600, generator=g) < 0.8] = 0
    h = torch.randn(70000, generator=g) * (torch.rand(70000, generator=g) < 0.1)
    return {"exp_avg": m, "exp_avg_sq": m.square(), "h": h.half()}


def _zeros(seed: int) -> dict:
    """Zero buffers stored as ``zeros`` sections (no payload) beside coded tensors."""
    g = torch.Generator().manual_seed(seed)
    return {"cache": torch.zeros(16, 1024), "mask": torch.zeros(70000, dtype=torch.bool),
            "w": torch.randn(100, 100, generator=g), "b": torch.zeros(8)}


def build(d: str, seed: int) -> list[dict]:
    jobs = []
    for name, make, kw in (("model-plain", _model_state, {}),
                           ("model-compressed", _model_state, {"compress": True}),
                           ("twins-compressed", _twins, {"compress": True}),
                           ("sparse-compressed", _sparse, {"compress": True}),
                           ("zeros-compressed", _zeros, {"compress": True})):
        a, b = os.path.join(d, name + ".a"), os.path.join(d, name + ".b")
        lcckpt.save(make(seed), a, **kw)
        lcckpt.save(make(seed + 1), b, **kw)
        jobs.append({"name": name, "file": a, "donor": b})
    chain = os.path.join(d, "chain")
    ck = lcckpt.DeltaCheckpointer(chain, keyframe_every=6, min_delta_elements=64,
                                  keyframe_coding="raw", keep_last=12)
    u = torch.randn(4096, generator=torch.Generator().manual_seed(seed))
    for step in range(20):
        u = u + 0.01 * torch.randn(4096)
        ck.save(step, {"u": u.clone(), "v": -u, "w": u * 2, "step": step})
        if step == 10:
            ck.merge()
    ck.close()
    jobs[-1]["chain"] = chain
    return jobs


def run(seed: int = 0, scale: int = 1) -> dict:
    with tempfile.TemporaryDirectory() as d:
        jobs = build(d, seed)
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([ROOT, TESTS])}
        rows, failures = [], []
        for k, job in enumerate(jobs):
            args = [sys.executable, os.path.join(TESTS, "_fuzz_worker.py"), job["file"],
                    str(seed * 100 + k), str(300 * scale), str(100 * scale),
                    "--donor", job["donor"], "--forged", str(150 * scale)]
            if "chain" in job:
                args += ["--chain", job["chain"]]
            proc = subprocess.run(args, capture_output=True, text=True, env=env)
            if proc.returncode != 0:
                failures.append({"file": job["name"], "crash": proc.stderr[-2000:]})
                continue
            rep = json.loads(proc.stdout)
            rows.append({"file": job["name"], "bytes": rep["size"], "cases": rep["cases"],
                         **rep["kinds"], "failures": len(rep["failures"])})
            failures += [{"file": job["name"], **f} for f in rep["failures"]]
            for outcome, n in rep["outcomes"].items():
                rows[-1].setdefault("outcomes", {})[outcome] = n
        for name, script, extra in (
                ("torch+safetensors", "_fuzz_foreign.py",
                 [str(seed), str(300 * scale), str(100 * scale), str(300 * scale)]),
                ("storage+links", "_fuzz_storage.py", [str(seed), "--scale", str(scale)])):
            proc = subprocess.run([sys.executable, os.path.join(HERE, script), *extra],
                                  capture_output=True, text=True, env=env)
            if proc.returncode != 0:
                failures.append({"file": name, "crash": proc.stderr[-2000:]})
                continue
            rep = json.loads(proc.stdout)
            rows.append({"file": name, "bytes": 0, "cases": rep["cases"], **rep["kinds"],
                         "failures": len(rep["failures"]), "outcomes": rep["outcomes"],
                         "notes": rep.get("notes", [])})
            failures += [{"file": name, **f} for f in rep["failures"]]
    return {"rows": rows, "cases": sum(r["cases"] for r in rows), "failures": failures}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--scale", type=int, default=1)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    res = run(args.seed, args.scale)
    if args.json:
        print(json.dumps(res, indent=1))
    else:
        kinds = ["flip", "truncate", "swap", "splice", "bomb", "header", "tree",
                 "chain-swap", "chain-splice"]
        print(f"{'file':18} {'bytes':>7} {'cases':>6} " + " ".join(f"{k:>12}" for k in kinds)
              + f" {'failures':>8}")
        for r in res["rows"]:
            print(f"{r['file']:18} {r['bytes']:7d} {r['cases']:6d} "
                  + " ".join(f"{r.get(k, 0):12d}" for k in kinds) + f" {r['failures']:8d}")
        for r in res["rows"]:
            extra = {k: v for k, v in r.items() if k not in kinds and k not in (
                "file", "bytes", "cases", "failures", "outcomes", "notes")}
            if extra:
                print(f"  {r['file']} cases: {json.dumps(extra)}")
        for r in res["rows"]:
            print(f"  {r['file']}: {json.dumps(r['outcomes'], sort_keys=True)}")
            for note in r.get("notes", []):
                print(f"  {r['file']}: {note}")
        print(f"total: {res['cases']} cases, {len(res['failures'])} failures")
        for f in res["failures"][:20]:
            print("FAIL", json.dumps(f)[:300])
    return 1 if res["failures"] else 0


if __name__ == "__main__":
    sys.exit(main())
