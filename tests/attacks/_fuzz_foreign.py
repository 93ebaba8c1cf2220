"""Damage and forge torch.save and safetensors files, load each copy, print JSON outcomes.

Run by fuzz_large.py in a subprocess under a 4 GB address-space limit, like
_fuzz_worker.py for lcckpt files. The cases:

- *damaged* (bit flips, half of them in the zip's directory or the safetensors header;
  truncations): ``lcckpt.load`` raises an LcckptError, or returns an object that is fully
  usable. A torch.save file that loads other data must then fail ``lcckpt verify``
  (zip CRC-32s, which ``torch.load`` does not check). safetensors has no checksum of its
  data: a flip there loads silently, in every reader; those are counted apart as
  ``undetectable``, never as a pass of the check;
- *zip bombs*: torch.save zips rewritten with deflated members of up to 1 GiB of zeros;
- *crafted safetensors headers*: hostile shapes, dtypes, offsets, metadata, length
  prefixes (every JSON value an attacker can choose).

Failures: an exception outside the LcckptError hierarchy, a crash or MemoryError of the
interpreter, or a damaged torch.save file that loads other data and passes ``verify``.

Usage: _fuzz_foreign.py SEED FLIPS TRUNCATIONS CRAFTED [--mem-gb G]
"""

import argparse
import io
import json
import os
import random
import resource
import struct
import sys
import tempfile
import zipfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

import lcckpt  # noqa: E402
from lcckpt.cli import verify_file  # noqa: E402
from lcckpt.errors import LcckptError  # noqa: E402
from lcckpt.format.safetensors_io import save_safetensors  # noqa: E402


def _state(seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {"conv.weight": torch.randn(8, 3, 3, 3, generator=g),
            "conv.bias": torch.randn(8, generator=g),
            "fc.weight": torch.randn(10, 288, generator=g).half(),
            "bn.num_batches_tracked": torch.tensor(7),
            "mask": torch.rand(64, generator=g) > 0.5}


def _same(a, b) -> bool:
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    return isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape \
        and torch.equal(a, b)


def _touch(obj) -> None:
    repr(obj)
    for v in (obj.values() if isinstance(obj, dict) else []):
        if isinstance(v, torch.Tensor):
            v.float().sum()


def _load(data: bytes, scratch: str):
    """``(outcome, object or None)``; every load goes through a file, as users load."""
    with open(scratch, "wb") as f:
        f.write(data)
    try:
        obj = lcckpt.load(scratch)
        _touch(obj)
        return "LOADED", obj
    except LcckptError as e:
        return type(e).__name__, None
    except BaseException as e:        # noqa: BLE001 (anything else is a bug)
        return f"OTHER {type(e).__name__}: {str(e)[:200]}", None


def _verified(data: bytes, scratch: str) -> bool:
    with open(scratch, "wb") as f:
        f.write(data)
    try:
        return verify_file(scratch)["ok"]
    except LcckptError:
        return False


def _zip_directory_start(raw: bytes) -> int:
    end = raw.rfind(b"PK\x05\x06")
    return struct.unpack("<I", raw[end + 16:end + 20])[0] if end >= 0 else 0


def damaged(raw: bytes, head: tuple[int, int], rng, flips: int, truncations: int):
    for i in range(flips):
        lo, hi = head if i % 2 else (0, len(raw))
        where = rng.randrange(lo * 8, hi * 8)
        data = bytearray(raw)
        data[where // 8] ^= 1 << (where % 8)
        yield "flip", where, bytes(data)
    for n in list(range(0, 64)) + [rng.randrange(len(raw)) for _ in range(truncations)]:
        yield "truncate", n, raw[:n]


def zip_bombs(rng, n: int):
    for _ in range(n):
        numel = rng.choice([1 << 20, 1 << 24, 1 << 26, 1 << 28])
        plain = io.BytesIO()
        torch.save({"w": torch.zeros(numel, dtype=torch.uint8)}, plain)
        plain.seek(0)
        out = io.BytesIO()
        with zipfile.ZipFile(plain) as src, \
                zipfile.ZipFile(out, "w", zipfile.ZIP_DEFLATED, compresslevel=1) as dst:
            for info in src.infolist():
                dst.writestr(info.filename, src.read(info.filename))
        yield "zip-bomb", numel, out.getvalue()


_HOSTILE = {
    "shape": [[2**64], [0, 2**64], [2**62, 0], [-1], [1.5], "3", [2**31] * 3, [1] * 70, None,
              [2**48], [2**24, 2**24]],
    "dtype": ["F99", "", None, 3, "F8_E4M3", "C64", "BOOL", "I4"],
    "data_offsets": [[0, 2**64], [10, 5], [-1, 4], [0, 2**40], [0], "0,4", [0.0, 4.0],
                     [2**63, 2**63 + 8], [4, 4], None],
}


def crafted_safetensors(raw: bytes, rng, n: int):
    size = struct.unpack("<Q", raw[:8])[0]
    header = json.loads(raw[8:8 + size])
    body = raw[8 + size:]
    names = [k for k in header if k != "__metadata__"]
    for _ in range(n):
        h = json.loads(json.dumps(header))
        r = rng.random()
        if r < 0.6:
            key = rng.choice(sorted(_HOSTILE))
            h[rng.choice(names)][key] = rng.choice(_HOSTILE[key])
            what = key
        elif r < 0.7:
            h["__metadata__"] = rng.choice([{"a": 1}, [], "x", {"a": {"b": "c"}}, None])
            what = "metadata"
        elif r < 0.8:
            a, b = rng.sample(names, 2)      # two tensors over one span
            h[a]["data_offsets"] = list(h[b]["data_offsets"])
            what = "overlap"
        elif r < 0.9:
            h[rng.choice(names)]["extra"] = "x" * rng.choice([1, 10_000])
            what = "extra key"
        else:
            enc = json.dumps(h).encode()
            prefix = rng.choice([0, 1, len(enc) + 1, len(raw), 2**63, 2**64 - 1, 100 << 20])
            yield "header", ["length prefix", prefix], struct.pack("<Q", prefix) + enc + body
            continue
        enc = json.dumps(h).encode()
        yield "header", [what], struct.pack("<Q", len(enc)) + enc + body


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("seed", type=int)
    ap.add_argument("flips", type=int)
    ap.add_argument("truncations", type=int)
    ap.add_argument("crafted", type=int)
    ap.add_argument("--mem-gb", type=float, default=4.0)
    args = ap.parse_args()
    limit = int(args.mem_gb * 2**30)
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    rng = random.Random(args.seed)
    state = _state(args.seed)
    buf = io.BytesIO()
    torch.save(state, buf)
    torch_raw = buf.getvalue()
    buf = io.BytesIO()
    save_safetensors(state, buf)
    st_raw = buf.getvalue()
    st_head = (0, 8 + struct.unpack("<Q", st_raw[:8])[0])
    results = {"outcomes": {}, "kinds": {}, "failures": [], "sizes": {
        "torch": len(torch_raw), "safetensors": len(st_raw)}}
    fd, scratch = tempfile.mkstemp()
    os.close(fd)

    def record(fmt, kind, where, outcome, ok):
        kind = f"{fmt} {kind}"
        results["outcomes"][f"{fmt} {outcome}"] = results["outcomes"].get(f"{fmt} {outcome}", 0) + 1
        results["kinds"][kind] = results["kinds"].get(kind, 0) + 1
        if not ok:
            results["failures"].append({"case": kind, "at": repr(where)[:200], "outcome": outcome})

    try:
        cases = [("torch", damaged(torch_raw, (_zip_directory_start(torch_raw), len(torch_raw)),
                                   rng, args.flips, args.truncations)),
                 ("safetensors", damaged(st_raw, st_head, rng, args.flips, args.truncations))]
        for fmt, gen in cases:
            for kind, where, data in gen:
                outcome, obj = _load(data, scratch)
                ok = not outcome.startswith("OTHER")
                if obj is not None and not _same(state, obj):
                    if _verified(data, scratch):
                        outcome = "LOADED OTHER DATA +VERIFIED"
                        ok = ok and fmt == "safetensors"     # no checksum in the format
                        if fmt == "safetensors":
                            outcome = "undetectable (no checksum in the format)"
                    else:
                        outcome = "LOADED OTHER DATA, verify fails"
                record(fmt, kind, where, outcome, ok)
        for kind, where, data in zip_bombs(rng, max(args.crafted // 10, 4)):
            outcome, obj = _load(data, scratch)
            record("torch", kind, where, outcome, not outcome.startswith("OTHER"))
            del obj
        for kind, where, data in crafted_safetensors(st_raw, rng, args.crafted):
            outcome, obj = _load(data, scratch)
            record("safetensors", kind, where, outcome, not outcome.startswith("OTHER"))
    finally:
        os.unlink(scratch)
    results["cases"] = sum(results["kinds"].values())
    print(json.dumps(results))


if __name__ == "__main__":
    main()
