"""Damage a saved file many ways and load each copy; print the outcomes as JSON.

Run in a subprocess by test_corruption.py, so that a crash of the interpreter (rather than
an exception) is seen as a failure too. Usage: _fuzz_worker.py FILE SEED FLIPS TRUNCATIONS
"""

import io
import json
import os
import random
import sys
import tempfile

from lcckpt.container import read_container
from lcckpt.errors import LcckptError
from lcckpt.serialization import load
from helpers import NonSeekableStream




def _outcome(data: bytes, mode: int, scratch: str) -> str:
    try:
        if mode == 0:
            load(io.BytesIO(data))
        elif mode == 1:
            load(NonSeekableStream(data))
        else:
            with open(scratch, "wb") as f:
                f.write(data)
            load(scratch)
            with read_container(scratch) as c:
                c.verify()
    except LcckptError as e:
        return type(e).__name__
    except BaseException as e:  # anything else is a bug
        return f"OTHER {type(e).__name__}: {str(e)[:200]}"
    return "LOADED"


def main() -> None:
    path, seed, flips, truncations = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
    original = open(path, "rb").read()
    with read_container(original) as c:
        head_end = c.data_start  # prefix, header and its padding
    rng = random.Random(seed)
    results = {"size": len(original), "outcomes": {}, "failures": []}
    fd, scratch = tempfile.mkstemp()
    os.close(fd)
    cases = []
    for i in range(flips):
        # half the flips land in the small prefix/header region, half anywhere
        limit = head_end if i % 2 else len(original)
        cases.append(("flip", rng.randrange(limit * 8)))
    lengths = list(range(0, min(64, len(original)))) + [rng.randrange(len(original)) for _ in range(truncations)]
    cases += [("truncate", n) for n in lengths]
    try:
        for i, (kind, where) in enumerate(cases):
            data = bytearray(original)
            if kind == "flip":
                data[where // 8] ^= 1 << (where % 8)
            else:
                del data[where:]
            outcome = _outcome(bytes(data), i % 3, scratch)
            results["outcomes"][outcome] = results["outcomes"].get(outcome, 0) + 1
            if outcome == "LOADED" or outcome.startswith("OTHER"):
                results["failures"].append({"case": kind, "at": where, "outcome": outcome})
    finally:
        os.unlink(scratch)
    results["cases"] = len(cases)
    print(json.dumps(results))


if __name__ == "__main__":
    main()
