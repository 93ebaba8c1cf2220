"""The runs coder's decode on a real chain's streams, one thread, one stream at a time.

    python benchmarks/runs_decode.py [--model minilm|mlp] [--deltas 10] [--rounds 15]
                                     [--keep FILE | --reuse FILE]

Writes ``benchmarks/save.py``'s chain (a keyframe and ``--deltas`` default deltas of the
MiniLM-L6 fine-tune under AdamW, or of the MLP under Adam), restores its newest step
once and keeps every runs-coded chunk of 100K symbols or more that the restore decoded
(its bytes, code and centroids). Then, in ``--rounds`` rounds taking turns, each kept
chunk is decoded into one float buffer, in cache as a replay's chunk is (the adding
path), with the stream's multi-item table and with the one-letter path alone; the
table's build time is timed apart. Prints medians in ns per coded byte and per nonzero
decoded float, and a digest of the decoded floats. To compare two versions of lcckpt,
keep the chunks once (``--keep FILE``) and decode them with each (``--reuse FILE``, the
other version first on ``PYTHONPATH``), taking turns: both must print the same digest.
"""

import argparse
import hashlib
import os
import shutil
import statistics
import sys
import tempfile
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import lcckpt  # noqa: E402
from lcckpt.codec.kernels import runs as rk  # noqa: E402
from save import _trajectory  # noqa: E402

MIN_SYMBOLS = 100_000


def capture(model: str, deltas: int) -> list:
    """The runs chunks of 100K symbols or more that restoring the newest step adds."""
    snaps, _, _ = _trajectory(model, deltas)
    kept, plain = [], rk.decode_runs

    def keep(buf, start, end, n, S, table, tb, out, o, cent, fout, apply, multi):
        if apply and n >= MIN_SYMBOLS:
            kept.append(dict(buf=np.array(buf[start:end]), n=n, S=S, table=table.copy(),
                             tb=tb, cent=np.array(cent)))
        return plain(buf, start, end, n, S, table, tb, out, o, cent, fout, apply, multi)

    d = tempfile.mkdtemp(prefix="lcckpt-runs-")
    try:
        with lcckpt.DeltaCheckpointer(d, keyframe_every=None) as ck:
            for step, state in snaps[1: deltas + 2]:
                ck.save(step, state)
            rk.decode_runs = keep
            try:
                ck.load(step)
            finally:
                rk.decode_runs = plain
    finally:
        shutil.rmtree(d, ignore_errors=True)
    for c in kept:                      # the code lengths, back from the one-letter table
        e = c["table"].astype(np.int64)
        lengths = np.zeros(rk.RUN_CLASSES * c["S"], np.uint8)
        lengths[e[e & 15 > 0] >> 4] = e[e & 15 > 0] & 15
        c["lengths"] = lengths
    return kept


_FIELDS = ("buf", "table", "cent", "lengths")


def keep_chunks(path: str, chunks: list) -> None:
    arrays = {f: np.concatenate([c[f] for c in chunks]) for f in _FIELDS}
    arrays.update({f + "_at": np.cumsum([0] + [c[f].size for c in chunks]) for f in _FIELDS})
    arrays.update({f: np.array([c[f] for c in chunks], np.int64) for f in ("n", "S", "tb")})
    np.savez(path, **arrays)


def reuse_chunks(path: str) -> list:
    with np.load(path) as z:
        a = {k: z[k] for k in z.files}
    return [dict({f: a[f][a[f + "_at"][i]:a[f + "_at"][i + 1]] for f in _FIELDS},
                 n=int(a["n"][i]), S=int(a["S"][i]), tb=int(a["tb"][i]))
            for i in range(a["n"].size)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", choices=("minilm", "mlp"), default="minilm")
    ap.add_argument("--deltas", type=int, default=10)
    ap.add_argument("--rounds", type=int, default=15)
    g = ap.add_mutually_exclusive_group()
    g.add_argument("--keep", metavar="FILE", help="save the captured chunks (.npz)")
    g.add_argument("--reuse", metavar="FILE", help="decode chunks saved by --keep")
    a = ap.parse_args()
    lcckpt.warmup()
    chunks = reuse_chunks(a.reuse) if a.reuse else capture(a.model, a.deltas)
    if a.keep:
        keep_chunks(a.keep, chunks)
    nbytes = sum(c["buf"].size for c in chunks)
    out = np.zeros(max(c["n"] for c in chunks), np.float32)
    none = np.zeros(0, np.uint64)

    def tables():
        return [rk.runs_decode_table(c["lengths"], c["S"]) for c in chunks]

    multis = tables()

    def decode(use_multi: bool, digest=None):
        nonzero = 0
        for c, m in zip(chunks, multis):
            if digest is not None:
                out[:c["n"]] = 0
            used = rk.decode_runs(c["buf"], 0, c["buf"].size, c["n"], c["S"], c["table"], c["tb"],
                                  out, 0, c["cent"], out, True, m if use_multi else none)
            if used < 0:
                raise SystemExit("a kept chunk did not decode")
            if digest is not None:
                digest.update(out[:c["n"]].tobytes())
                nonzero += int(np.count_nonzero(out[:c["n"]]))
        return nonzero

    h = hashlib.sha1()
    nonzero = decode(True, h)
    digest = h.hexdigest()[:16]
    times = {"multi": [], "one letter": [], "tables": []}
    for _ in range(a.rounds):
        for name, f in (("multi", lambda: decode(True)), ("one letter", lambda: decode(False)),
                        ("tables", tables)):
            t = time.perf_counter()
            f()
            times[name].append(time.perf_counter() - t)
    print(f"{a.reuse or a.model}: {len(chunks)} runs chunks, {nbytes / 1e6:.2f} MB coded, "
          f"{sum(c['n'] for c in chunks) / 1e6:.1f}M symbols, {nonzero / 1e6:.2f}M nonzero; "
          f"decoded floats' digest {digest}")
    for name in ("multi", "one letter"):
        t = statistics.median(times[name])
        print(f"  {name:10s} {t * 1e3:7.1f} ms  {t / nbytes * 1e9:5.2f} ns/byte  "
              f"{t / nonzero * 1e9:5.2f} ns/nonzero")
    print(f"  tables     {statistics.median(times['tables']) / len(chunks) * 1e6:7.1f} us each")


if __name__ == "__main__":
    main()
