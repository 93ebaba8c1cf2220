"""Damage and forge saved files many ways, load each copy, print the outcomes as JSON.

Run in a subprocess (by test_corruption.py and tests/attacks/fuzz_large.py), under a
memory limit, so that a crash or a runaway allocation of the interpreter is seen as a
failure too. Two kinds of case:

- *damaged* (bit flips, truncations, every swap of two equal-length sections, splices of
  same-length sections from a donor file): the bytes differ from what was written, so a
  load must raise an LcckptError and ``verify_file`` must fail; anything else is a
  silent-wrong result.
- *forged* (decompression bombs, hostile values in a header with valid checksums): a
  load may refuse with an LcckptError, or succeed with an object that is fully usable
  (repr works, tensors hold their data); any other exception is an escape.

Usage: _fuzz_worker.py FILE SEED FLIPS TRUNCATIONS [--donor FILE] [--forged N]
       [--chain DIR] [--mem-gb G]
"""

import argparse
import io
import json
import os
import random
import resource
import shutil
import sys
import tempfile

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "attacks"))

import torch  # noqa: E402

import craft  # noqa: E402
from helpers import NonSeekableStream  # noqa: E402
from lcckpt.chain.checkpointer import DeltaCheckpointer  # noqa: E402
from lcckpt.format.container import read_container  # noqa: E402
from lcckpt.format.verify import verify_file  # noqa: E402
from lcckpt.errors import LcckptError  # noqa: E402
from lcckpt.format.serialization import load  # noqa: E402


def _touch(obj) -> None:
    """Use everything a load returned: a value that fails later is an escape now."""
    repr(obj)
    stack = [obj]
    while stack:
        v = stack.pop()
        if isinstance(v, dict):
            stack.extend(v.keys())
            stack.extend(v.values())
        elif isinstance(v, (list, tuple)):
            stack.extend(v)
        elif isinstance(v, torch.Tensor):
            if v.device.type == "meta":
                raise AssertionError("a tensor without data")
            v.sum()


def _load(data: bytes, mode: int, scratch: str) -> str:
    try:
        if mode == 0:
            _touch(load(io.BytesIO(data)))
        elif mode == 1:
            _touch(load(NonSeekableStream(data)))
        else:
            with open(scratch, "wb") as f:
                f.write(data)
            _touch(load(scratch))
    except LcckptError as e:
        return type(e).__name__
    except BaseException as e:  # anything else is a bug
        return f"OTHER {type(e).__name__}: {str(e)[:200]}"
    return "LOADED"


def _verify(data: bytes, scratch: str) -> bool:
    with open(scratch, "wb") as f:
        f.write(data)
    try:
        return verify_file(scratch)["ok"]
    except LcckptError:
        return False


def damaged_cases(original: bytes, rng, flips: int, truncations: int, donor):
    with read_container(original) as c:
        head_end = c.data_start  # prefix, header and its padding
    for i in range(flips):
        # half the flips land in the small prefix/header region, half anywhere
        where = rng.randrange((head_end if i % 2 else len(original)) * 8)
        data = bytearray(original)
        data[where // 8] ^= 1 << (where % 8)
        yield "flip", where, bytes(data)
    lengths = list(range(0, min(64, len(original)))) + [rng.randrange(len(original))
                                                         for _ in range(truncations)]
    for n in lengths:
        yield "truncate", n, original[:n]
    for i, j in craft.equal_length_pairs(original):
        data = craft.swap(original, i, j)
        if data != original:                     # equal sections: nothing was changed
            yield "swap", [i, j], data
    if donor is not None:
        mine, theirs = craft.section_spans(original), craft.section_spans(donor)
        for i, (_, n) in enumerate(mine):
            for j, (_, m) in enumerate(theirs):
                if n == m and n > 0:
                    data = craft.splice(original, i, donor, j)
                    if data != original:
                        yield "splice", [i, j], data


def forged_cases(original: bytes, rng, n: int):
    dtypes = ["F32", "F16", "BF16", "F64", "I64", "U8"]
    hostile = {
        "shape": [[0, 2**64], [0, 2**63 - 1], [2**62], [-1], [1.5], "x", [2**20] * 5, [], [0]],
        "device": ["hpu", "privateuseone", "meta", "cuda:99", "xla", "", 3, None, "cpu:0"],
        "dtype": ["F99", "F8_E4M3", "BOOL", 1, None],
        "nbytes": [0, -4, 2**70, "4", 4.0],
        "codec": ["delta", "lossless", "raw", "nope", 0],
        "codec_params": [[], {"key": 3}, {"key": "k"}],
    }
    trees = [{"$": "size", "v": [2**63]}, {"$": "size", "v": [-(2**63)]}, {"$": "device", "v": "hpu"},
             {"$": "tensor", "s": 0, "obj": 2**70}, {"$": "int", "hex": "0x" + "f" * 5000},
             {"$": "dtype", "v": "F8_E8M0"}, {"$": "npscalar", "dtype": "F16", "hex": "0000"},
             {"$": "ndarray", "s": 0}, {"$": "bytes", "s": 0}]
    with read_container(original) as c:
        nsec = len(c.sections)
    for k in range(n):
        r = rng.random()
        if r < 0.4:
            shape = [rng.choice([1, 3, 2**10, 2**20, 2**24, 2**26, 2**28])
                     for _ in range(rng.randrange(1, 3))]
            dtype = rng.choice(dtypes[:4] if rng.random() < 0.5 else dtypes)
            lossy = dtype in ("F32", "F16", "BF16", "F64") and rng.random() < 0.5
            size = 1
            for d in shape:
                size *= d
            if size > 2**34:
                shape = [2**30]
            blob = craft.const_blob(shape, dtype, lossy=lossy, log2=rng.choice([18, 24]))
            meta_shape = shape if rng.random() < 0.7 else [rng.choice([1, 16, 2**20])]
            yield "bomb", [shape, dtype, lossy], craft.tensor_file(
                blob, shape, dtype, codec="delta" if lossy or rng.random() < 0.3 else "lossless",
                meta_shape=meta_shape)
        elif r < 0.8 and nsec:
            key = rng.choice(sorted(hostile))
            value = rng.choice(hostile[key])
            yield "header", [key, value], craft.with_section_meta(
                original, rng.randrange(nsec), **{key: value})
        else:
            tree = rng.choice(trees)
            yield "tree", tree, craft.with_tree(original, {"$": "dict", "items": [["x", tree]]})


def chain_cases(directory: str, rng):
    """Every swap of equal-length sections in every file of a chain, and each file's
    sections spliced from the next file's: yields (step, path, damaged bytes)."""
    ck = DeltaCheckpointer(directory)
    steps = ck.steps()
    for k, step in enumerate(steps):
        path = ck.path(step)
        raw = open(path, "rb").read()
        for i, j in craft.equal_length_pairs(raw):
            data = craft.swap(raw, i, j)
            if data != raw:
                yield "chain-swap", [step, i, j], step, path, raw, data
        if k + 1 < len(steps):
            donor = open(ck.path(steps[k + 1]), "rb").read()
            mine, theirs = craft.section_spans(raw), craft.section_spans(donor)
            for i, (_, n) in enumerate(mine):
                if i < len(theirs) and theirs[i][1] == n and n:
                    data = craft.splice(raw, i, donor, i)
                    if data != raw:
                        yield "chain-splice", [step, i], step, path, raw, data


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("file")
    ap.add_argument("seed", type=int)
    ap.add_argument("flips", type=int)
    ap.add_argument("truncations", type=int)
    ap.add_argument("--donor")
    ap.add_argument("--forged", type=int, default=0)
    ap.add_argument("--chain")
    ap.add_argument("--mem-gb", type=float, default=4.0)
    args = ap.parse_args()
    limit = int(args.mem_gb * 2**30)
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))

    original = open(args.file, "rb").read()
    donor = open(args.donor, "rb").read() if args.donor else None
    rng = random.Random(args.seed)
    results = {"size": len(original), "outcomes": {}, "kinds": {}, "failures": []}
    fd, scratch = tempfile.mkstemp()
    os.close(fd)

    def record(kind, where, outcome, ok):
        results["outcomes"][outcome] = results["outcomes"].get(outcome, 0) + 1
        results["kinds"][kind] = results["kinds"].get(kind, 0) + 1
        if not ok:
            results["failures"].append({"case": kind, "at": repr(where)[:200], "outcome": outcome})

    try:
        for i, (kind, where, data) in enumerate(damaged_cases(original, rng, args.flips,
                                                              args.truncations, donor)):
            outcome = _load(data, i % 3, scratch)
            verified = _verify(data, scratch)
            if verified:
                outcome += " +VERIFIED"
            record(kind, where, outcome, outcome.split()[0] not in ("LOADED", "OTHER")
                   and not verified)
        for i, (kind, where, data) in enumerate(forged_cases(original, rng, args.forged)):
            outcome = _load(data, i % 3, scratch)
            record(kind, where, outcome, not outcome.startswith("OTHER"))
        if args.chain:
            work = tempfile.mkdtemp()
            try:
                copy = os.path.join(work, "chain")
                shutil.copytree(args.chain, copy)
                for kind, where, step, path, raw, data in chain_cases(copy, rng):
                    with open(path, "wb") as f:
                        f.write(data)
                    try:
                        DeltaCheckpointer(copy).load(step)
                        outcome = "LOADED"
                    except LcckptError as e:
                        outcome = type(e).__name__
                    except BaseException as e:
                        outcome = f"OTHER {type(e).__name__}: {str(e)[:200]}"
                    verified = verify_file(path)["ok"]
                    if verified:
                        outcome += " +VERIFIED"
                    with open(path, "wb") as f:
                        f.write(raw)
                    record(kind, where, outcome, outcome.split()[0] not in ("LOADED", "OTHER")
                           and not verified)
            finally:
                shutil.rmtree(work)
    finally:
        os.unlink(scratch)
    results["cases"] = sum(results["kinds"].values())
    print(json.dumps(results))


if __name__ == "__main__":
    main()
