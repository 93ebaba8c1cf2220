"""Codec benchmark on real training trajectories (digits CNN, SGD and Adam; a wide MLP).

Prints readable tables and, with ``--json``, one JSON document. Sections:

* chain      - per checkpoint of a real run: bits/element after each stage (buckets,
               promotion, coding), order-0 entropy, every coder's size, ratio, error,
               accuracy of the restored model, zstd-1 on the same delta bytes;
* speed      - encode/decode MB/s on a ~20M-element fp32 delta of the wide MLP against
               zstd level 1 on the same bytes, in the same run (medians);
* dense      - the same MLP under Adam (a dense delta, every weight moves): lcckpt b=2
               against zstd-1 and zstd-3 on the same threads, interleaved, with a
               bytes-per-element traffic model of each pass against a numpy copy;
* lossless   - the exact codec on trained weights (fp32 and bf16) against zstd 1/3 on raw
               and byte-grouped bytes;
* latency    - the first encode in a fresh process, Numba cache warm.

Run it as ``lcckpt bench`` or ``python benchmarks/codec.py`` ([--quick] [--json out.json]).
"""

import argparse
import io
import json
import os
import subprocess
import sys
import textwrap
import time

import numpy as np
import torch

import lcckpt
from lcckpt.codec.kernels.huffman import code_lengths
from lcckpt.bench.timing import environment, format_table
from lcckpt.bench.trajectory import flat_float_params, train_trajectory
from lcckpt.codec.dtypes import to_numpy

MB = 1e6


class _Zstd:
    """zstandard, imported on first use so that ``lcckpt --help`` works without it."""

    def __getattr__(self, name):
        from lcckpt.bench.checkpoint import zstandard_module
        return getattr(zstandard_module(), name)


zstandard = _Zstd()


def _optimal_huffman_bits(counts: np.ndarray) -> int:
    """Bits of an optimal Huffman code of ``counts``: the length-limited code of at most
    16 symbols with a 32-bit limit never binds (a Huffman code of n symbols is at most
    n - 1 bits deep); the tests check these lengths against an independent heap Huffman
    (tests/oracles.py). A lone symbol costs a bit per element, as the coder counts it."""
    counts = np.asarray(counts, np.int64)
    if np.count_nonzero(counts) <= 1:
        return int(counts.sum())
    return int(counts @ code_lengths(counts, 32))


def _median_time(fn, runs, setup=None):
    times = []
    for _ in range(runs):
        if setup is not None:
            setup()
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return float(np.median(times))


def _zstd(data: bytes, level: int, threads: int = 0):
    c = zstandard.ZstdCompressor(level=level, threads=threads)
    return c.compress(data)


# --- chain -----------------------------------------------------------------------------

def chain(model, optimizer, steps, every, bits, log, traj=None):
    if traj is None:
        traj = train_trajectory(model=model, optimizer=optimizer, steps=steps,
                                snapshot_every=every)
    encs = {c: {} for c in ("huffman", "auto")}
    decs = {}
    rows = []
    for step, state in traj.snapshots:
        params = flat_float_params(state["model"])
        acc_true = traj.accuracy(state["model"])
        tot = dict(n=0, raw=0, huff=0, huff_payload=0, auto=0, auto_payload=0, ideal=0, zstd=0,
                   ent=0.0, bucket=0.0,
                   grouped=0.0, runs=0.0, res=0.0, tgt=0.0)
        restored = {}
        for name, u in params.items():
            for coder, d in encs.items():
                d.setdefault(name, lcckpt.DeltaEncoder(bits=bits, coder=coder))
            ref_before = encs["auto"][name].ref
            ref_before = None if ref_before is None else ref_before.copy()
            u = u.reshape(-1)
            delta = None if ref_before is None else (u - ref_before)
            blob_h, st_h = encs["huffman"][name].encode(u, report=True)
            payload_h = st_h.payload_bytes
            blob_a, st = encs["auto"][name].encode(u, report=True)
            dec = decs.setdefault(name, lcckpt.DeltaDecoder())
            y = dec.decode(blob_a)
            restored[name] = torch.from_numpy(np.array(y, copy=True))
            assert np.array_equal(encs["huffman"][name].ref, encs["auto"][name].ref)
            if delta is None:
                continue                                   # the keyframe is not a delta
            tot["n"] += u.size
            tot["raw"] += u.nbytes
            tot["huff"] += len(blob_h)
            tot["huff_payload"] += payload_h
            tot["auto"] += len(blob_a)
            tot["auto_payload"] += st.payload_bytes
            tot["zstd"] += len(_zstd(delta.tobytes(), 1))
            tot["ent"] += st.symbol_entropy * u.size
            tot["bucket"] += st.bucket_entropy * u.size
            if "grouped" not in st.mode_bits:     # pruned as hopeless: measure it anyway
                _, sg = lcckpt.encode(delta, bits=bits, coder="grouped", report=True)
                tot["grouped"] += 8 * sg.payload_bytes
            else:
                tot["grouped"] += st.mode_bits["grouped"] * u.size
            tot["runs"] += st.mode_bits.get("runs", 0) * u.size
            tot["ideal"] += _optimal_huffman_bits(np.array(st.symbol_counts))
            tot["res"] += float(np.sum((u.astype(np.float64) - y) ** 2))
            tot["tgt"] += float(np.sum(u.astype(np.float64) ** 2))
        if tot["n"] == 0:
            continue
        n = tot["n"]
        acc = traj.accuracy({k: restored[k].reshape(v.shape) for k, v in state["model"].items()})
        row = {
            "step": step, "elements": n,
            "bucket_bpe": tot["bucket"] / n, "entropy_bpe": tot["ent"] / n,
            "huffman_bpe": 8 * tot["huff"] / n, "huffman_payload_bpe": 8 * tot["huff_payload"] / n,
            "ideal_huffman_bpe": tot["ideal"] / n,
            "grouped_bpe": tot["grouped"] / n, "runs_bpe": tot["runs"] / n,
            "auto_payload_bpe": 8 * tot["auto_payload"] / n, "auto_bpe": 8 * tot["auto"] / n,
            "ratio_huffman": tot["raw"] / tot["huff"], "ratio_auto": tot["raw"] / tot["auto"],
            "ratio_zstd1": tot["raw"] / tot["zstd"],
            "rel_error": float(np.sqrt(tot["res"] / tot["tgt"])),
            "acc_true": acc_true, "acc_restored": acc,
        }
        row["auto_vs_best"] = row["auto_payload_bpe"] / min(
            row["entropy_bpe"], row["grouped_bpe"], row["runs_bpe"])
        rows.append(row)
    cols = ["step", "bucket_bpe", "entropy_bpe", "huffman_payload_bpe", "ideal_huffman_bpe",
            "huffman_bpe",
            "grouped_bpe", "runs_bpe", "auto_payload_bpe", "auto_bpe", "auto_vs_best",
            "ratio_huffman", "ratio_auto", "ratio_zstd1", "rel_error", "acc_true",
            "acc_restored"]
    ntensors = len(flat_float_params(traj.snapshots[0][1]["model"]))
    log(f"\n## chain: {model}/{optimizer}, bits={bits}, deltas every {every} steps "
        f"({rows[0]['elements'] if rows else 0} parameters)")
    log(format_table(rows, cols))
    raw = sum(r["elements"] for r in rows) * 4
    summary = {
        "ratio_huffman": raw / sum(r["huffman_bpe"] * r["elements"] / 8 for r in rows),
        "ratio_auto": raw / sum(r["auto_bpe"] * r["elements"] / 8 for r in rows),
        "auto_vs_huffman": sum(r["huffman_bpe"] for r in rows) / sum(r["auto_bpe"] for r in rows),
        "huffman_payload_vs_ideal_max": max(r["huffman_payload_bpe"] / r["ideal_huffman_bpe"]
                                            for r in rows),
        "huffman_header_bytes_per_tensor": (sum(r["huffman_bpe"] - r["huffman_payload_bpe"]
                                                for r in rows) / len(rows))
        * rows[0]["elements"] / 8 / ntensors,
        "auto_vs_huffman_median": float(np.median([r["huffman_bpe"] / r["auto_bpe"]
                                                   for r in rows])),
        "auto_vs_best_max": max(r["auto_vs_best"] for r in rows),
    }
    log("summary: " + json.dumps({k: round(v, 4) if isinstance(v, float) else v
                                  for k, v in summary.items()}))
    return {"model": model, "optimizer": optimizer, "bits": bits, "rows": rows,
            "summary": summary}


# --- speed -----------------------------------------------------------------------------

def speed(steps, every, runs, log):
    traj = train_trajectory(model="mlp", optimizer="sgd", steps=steps, snapshot_every=every)
    (_, s0), (_, s1) = traj.snapshots[-2], traj.snapshots[-1]
    u0 = np.concatenate([v.reshape(-1) for v in flat_float_params(s0["model"]).values()])
    u1 = np.concatenate([v.reshape(-1) for v in flat_float_params(s1["model"]).values()])
    delta = u1 - u0
    raw = delta.tobytes()
    nbytes = len(raw)
    rows = []
    for coder in ("huffman", "auto"):
        lcckpt.decode(lcckpt.encode(delta, bits=2, coder=coder))          # warm
        blob = lcckpt.encode(delta, bits=2, coder=coder)
        te = _median_time(lambda: lcckpt.encode(delta, bits=2, coder=coder), runs)
        td = _median_time(lambda: lcckpt.decode(blob), runs)
        rows.append({"codec": f"lcckpt {coder} b=2", "ratio": nbytes / len(blob),
                     "enc_MBps": nbytes / te / MB, "dec_MBps": nbytes / td / MB})
    # the real step: delta against the reference, then the reference update
    enc = lcckpt.DeltaEncoder(bits=2)
    enc.encode(u0)
    ref0 = enc.ref.copy()
    t_step = _median_time(lambda: enc.encode(u1), runs, setup=lambda: enc.ref.__setitem__(
        slice(None), ref0))
    rows.append({"codec": "DeltaEncoder step (auto)", "ratio": float("nan"),
                 "enc_MBps": nbytes / t_step / MB, "dec_MBps": float("nan")})
    for level, threads in ((1, 0), (1, 2)):
        z = _zstd(raw, level, threads)
        d = zstandard.ZstdDecompressor()
        te = _median_time(lambda: _zstd(raw, level, threads), runs)
        td = _median_time(lambda: d.decompress(z), runs)
        rows.append({"codec": f"zstd-{level}" + (f" ({threads} threads)" if threads else ""),
                     "ratio": nbytes / len(z), "enc_MBps": nbytes / te / MB,
                     "dec_MBps": nbytes / td / MB})
    z1 = rows[-2]
    for r in rows:
        r["enc_vs_zstd1"] = r["enc_MBps"] / z1["enc_MBps"]
        r["dec_vs_zstd1"] = r["dec_MBps"] / z1["dec_MBps"]
    log(f"\n## speed: wide-MLP delta, {delta.size:,} fp32 elements ({nbytes / MB:.0f} MB), "
        f"median of {runs}, {lcckpt.util.pool.threads()} threads")
    log(format_table(rows, ["codec", "ratio", "enc_MBps", "dec_MBps", "enc_vs_zstd1",
                            "dec_vs_zstd1"]))
    return {"elements": int(delta.size), "rows": rows}


# --- dense ----------------------------------------------------------------------------

def _zstd_frames(level: int, threads: int):
    """zstd at ``level`` on ``threads`` threads, both ways: the data is cut into one frame
    per thread (zstd's own decoder is single-threaded), each frame coded on its thread."""
    from concurrent.futures import ThreadPoolExecutor
    pool = ThreadPoolExecutor(threads)
    cctx = [zstandard.ZstdCompressor(level=level) for _ in range(threads)]
    dctx = [zstandard.ZstdDecompressor() for _ in range(threads)]

    def enc(data: memoryview):
        step = -(-len(data) // threads)
        return list(pool.map(lambda t: cctx[t].compress(data[t * step:(t + 1) * step]),
                             range(threads)))

    def dec(frames):
        return list(pool.map(lambda t: dctx[t].decompress(frames[t]), range(threads)))

    def dec_into(frames, out: memoryview):
        """Each frame into its slice of ``out`` (no fresh memory, like a decode into a
        buffer the caller holds)."""
        step = -(-len(out) // threads)

        def one(t):
            view, got = out[t * step:(t + 1) * step], 0
            with dctx[t].stream_reader(frames[t]) as r:
                while got < len(view):
                    k = r.readinto(view[got:])
                    if not k:
                        break
                    got += k
            return got
        return sum(pool.map(one, range(threads)))
    return enc, dec, dec_into, pool


def _interleaved(fns: dict, runs: int) -> tuple[dict, dict]:
    """Seconds of each call, the calls taking turns round by round (a slow spell of a
    shared machine then hits every contender): wall (median, min, max) and the median
    CPU seconds of the whole process (every thread), which other load disturbs less."""
    times = {k: [] for k in fns}
    cpu = {k: [] for k in fns}
    for _ in range(runs):
        for k, fn in fns.items():
            c, t = time.process_time(), time.perf_counter()
            fn()
            times[k].append(time.perf_counter() - t)
            cpu[k].append(time.process_time() - c)
    return ({k: (float(np.median(v)), min(v), max(v)) for k, v in times.items()},
            {k: float(np.median(v)) for k, v in cpu.items()})


def dense(steps, every, runs, log):
    """A dense delta: the wide MLP under Adam, which moves every weight every step.

    ``lcckpt.encode(d, bits=2)`` and ``lcckpt.decode`` against zstd-1 and zstd-3 on the
    same bytes, on as many threads as lcckpt's pool has (zstd: one frame per thread),
    and the passes of the encode and the decode against a traffic model: bytes read and
    written per element by each pass, over the bandwidth a numpy copy gets on the same
    threads in the same run.
    """
    from lcckpt.util import pool as _pool
    from lcckpt.codec import entropy, quantize
    from lcckpt.codec.config import CodecConfig
    traj = train_trajectory(model="mlp", optimizer="adam", steps=steps, snapshot_every=every)
    (st0, s0), (st1, s1) = traj.snapshots[-2], traj.snapshots[-1]
    p0 = flat_float_params(s0, include_optim=True)
    p1 = flat_float_params(s1, include_optim=True)
    part = lambda p, want: np.concatenate([v.reshape(-1) for k, v in p.items()   # noqa: E731
                                           if want(k)])
    is_param = lambda k: not k.startswith("optim.")                               # noqa: E731
    is_m = lambda k: k.endswith(".exp_avg")                                       # noqa: E731
    delta = part(p1, is_param) - part(p0, is_param)
    m_delta = part(p1, is_m) - part(p0, is_m)
    zeros = {"params": float(np.mean(delta == 0)), "exp_avg": float(np.mean(m_delta == 0))}
    n, nbytes = delta.size, delta.nbytes
    threads = _pool.threads()
    cfg = CodecConfig(bits=2)
    cs = 1 << cfg.log2
    modes = entropy.modes_for(cfg.coder, 2)
    blob = lcckpt.encode(delta, bits=2)
    back = lcckpt.decode(blob)
    faithful = lcckpt.encode(delta, bits=2, coder="huffman")
    q = quantize.quantize(delta, None, 2, cs, runs_stats=True)
    nonzero = 1 - float(q.sym_hist[:, 0].sum()) / n

    def code():                                        # the coder alone, on q's symbols
        entropy.encode(q.sym, entropy.analyze(q.sym, q.sym_hist, cs, 2, modes,
                                              (q.runs_hist, q.runs_extra)), modes,
                       nonzero=q.nonzero)
    code()
    src = np.ascontiguousarray(delta)
    dst = np.empty_like(src)
    copy_chunk = -(-n // threads)

    def copy():
        _pool.run_tasks(lambda t: np.copyto(dst[t * copy_chunk:(t + 1) * copy_chunk],
                                            src[t * copy_chunk:(t + 1) * copy_chunk]), threads)
    raw = memoryview(delta).cast("B")
    zs = {}
    for level in (1, 3):
        enc, dec, dec_into, pool = _zstd_frames(level, threads)
        frames = enc(raw)
        assert b"".join(dec(frames)) == bytes(raw)
        zs[level] = (enc, dec, frames, sum(len(f) for f in frames), pool, dec_into)
    zbuf = bytearray(nbytes)                 # decode targets that already exist
    lbuf = np.empty_like(delta)
    assert zs[1][5](zs[1][2], memoryview(zbuf)) == nbytes and zbuf == bytes(raw)
    assert np.array_equal(lcckpt.decode(blob, out=lbuf), back)
    fns = {
        "lc_enc": lambda: lcckpt.encode(delta, bits=2),
        "lc_dec": lambda: lcckpt.decode(blob),
        "lc_huff_enc": lambda: lcckpt.encode(delta, bits=2, coder="huffman"),
        "lc_huff_dec": lambda: lcckpt.decode(faithful),
        "quantize": lambda: quantize.quantize(delta, None, 2, cs, runs_stats=True),
        "code": code,
        "lc_dec_into": lambda: lcckpt.decode(blob, out=lbuf),
        "z1_enc": lambda: zs[1][0](raw), "z1_dec": lambda: zs[1][1](zs[1][2]),
        "z1_dec_into": lambda: zs[1][5](zs[1][2], memoryview(zbuf)),
        "z3_enc": lambda: zs[3][0](raw), "z3_dec": lambda: zs[3][1](zs[3][2]),
        "copy": copy,
    }
    t, cpu = _interleaved(fns, runs)
    for level in (1, 3):
        zs[level][4].shutdown()
    mbps = lambda k: nbytes / t[k][0] / MB                                        # noqa: E731
    rng = lambda k: (nbytes / t[k][2] / MB, nbytes / t[k][1] / MB)                # noqa: E731
    rows = [
        {"codec": "lcckpt b=2 (auto)", "ratio": nbytes / len(blob),
         "enc_MBps": mbps("lc_enc"), "dec_MBps": mbps("lc_dec"),
         "enc_range": rng("lc_enc"), "dec_range": rng("lc_dec")},
        {"codec": "lcckpt b=2 huffman", "ratio": nbytes / len(faithful),
         "enc_MBps": mbps("lc_huff_enc"), "dec_MBps": mbps("lc_huff_dec"),
         "enc_range": rng("lc_huff_enc"), "dec_range": rng("lc_huff_dec")},
    ]
    for level in (1, 3):
        rows.append({"codec": f"zstd-{level}", "ratio": nbytes / zs[level][3],
                     "enc_MBps": mbps(f"z{level}_enc"), "dec_MBps": mbps(f"z{level}_dec"),
                     "enc_range": rng(f"z{level}_enc"), "dec_range": rng(f"z{level}_dec")})
    keys = {"lcckpt b=2 (auto)": "lc", "lcckpt b=2 huffman": "lc_huff", "zstd-1": "z1",
            "zstd-3": "z3"}
    for r in rows:                       # MB per CPU second: the work, whatever the load
        k = keys[r["codec"]]
        r["enc_MB_cpu_s"] = nbytes / cpu[k + "_enc"] / MB
        r["dec_MB_cpu_s"] = nbytes / cpu[k + "_dec"] / MB
    z1 = rows[2]
    for r in rows:
        r["enc_vs_zstd1"] = r["enc_MBps"] / z1["enc_MBps"]
        r["dec_vs_zstd1"] = r["dec_MBps"] / z1["dec_MBps"]
        r["enc_cpu_vs_zstd1"] = r["enc_MB_cpu_s"] / z1["enc_MB_cpu_s"]
        r["dec_cpu_vs_zstd1"] = r["dec_MB_cpu_s"] / z1["dec_MB_cpu_s"]
    # into a buffer that exists (a chain restore applies deltas into its reference): the
    # same decodes without the page faults of a fresh 4-bytes-per-element output
    into = {"lcckpt": mbps("lc_dec_into"), "zstd-1": mbps("z1_dec_into")}
    into_rows = [{"codec": "lcckpt b=2 (auto)", "dec_into_MBps": into["lcckpt"],
                  "dec_into_range": rng("lc_dec_into"),
                  "dec_into_vs_zstd1": into["lcckpt"] / into["zstd-1"]},
                 {"codec": "zstd-1", "dec_into_MBps": into["zstd-1"],
                  "dec_into_range": rng("z1_dec_into"), "dec_into_vs_zstd1": 1.0}]
    # traffic model: bytes per element each pass must move at the least, at the copy's
    # bandwidth (a copy reads 4 and writes 4 bytes per element)
    bw = 8 * n / t["copy"][0]
    payload = len(blob) / n
    lines = min(1.0, 1 - (1 - nonzero) ** 16)          # cache lines of floats pass 2 reads
    model = [
        ("quantize pass 1", "read floats 4, write keys 2", 6.0, None),
        ("quantize pass 2", f"read keys 2, write listed nonzeros 4 x {nonzero:.4f}, floats "
         f"of nonzero symbols 4 x {lines:.2f}", 2 + 4 * nonzero + 4 * lines, None),
        ("quantize (passes 1+2)", "", 8 + 4 * nonzero + 4 * lines, t["quantize"][0]),
        ("entropy coding", f"read listed nonzeros 4 x {nonzero:.4f}, write payload "
         f"{payload:.3f}", 4 * nonzero + payload, t["code"][0]),
        ("whole encode", "", 8 + 4 * lines + 8 * nonzero + payload, t["lc_enc"][0]),
        ("decode", f"write floats 4, read payload {payload:.3f}", 4 + payload, t["lc_dec"][0]),
    ]
    mrows = [{"pass": p, "traffic": what, "B_per_el": b, "model_ms": 1e3 * b * n / bw,
              "measured_ms": None if m is None else 1e3 * m,
              "vs_model": None if m is None else m / (b * n / bw)} for p, what, b, m in model]
    log(f"\n## dense: wide-MLP delta under Adam, steps {st0} -> {st1}, {n:,} fp32 elements "
        f"({nbytes / MB:.0f} MB), {threads} threads, median of {runs} interleaved rounds")
    log(f"exact zeros: params delta {100 * zeros['params']:.2f}%, exp_avg delta "
        f"{100 * zeros['exp_avg']:.2f}%; nonzero 2-bit symbols {100 * nonzero:.2f}%; "
        f"restored rel. error {float(np.linalg.norm(back - delta) / np.linalg.norm(delta)):.3f}")
    log(format_table(rows, ["codec", "ratio", "enc_MBps", "dec_MBps", "enc_vs_zstd1",
                            "dec_vs_zstd1"]))
    log("decode into an existing buffer (as a chain restore applies a delta):")
    log(format_table(into_rows, ["codec", "dec_into_MBps", "dec_into_vs_zstd1"]))
    log("per CPU second (all threads of the process; a loaded machine shows in the wall "
        "times above, much less here):")
    log(format_table(rows, ["codec", "enc_MB_cpu_s", "dec_MB_cpu_s", "enc_cpu_vs_zstd1",
                            "dec_cpu_vs_zstd1"]))
    log(f"traffic model: numpy copy {bw / 1e9:.1f} GB/s over {threads} threads")
    log(format_table(mrows, ["pass", "traffic", "B_per_el", "model_ms", "measured_ms",
                             "vs_model"]))
    return {"elements": int(n), "steps": [st0, st1], "threads": threads,
            "zero_fraction": zeros, "nonzero_symbols": nonzero, "rows": rows,
            "decode_into": into_rows,
            "copy_GBps": bw / 1e9, "traffic": mrows,
            "seconds": {k: v[0] for k, v in t.items()}, "cpu_seconds": cpu}


# --- lossless --------------------------------------------------------------------------

def _byte_grouped(a: np.ndarray) -> bytes:
    return a.view(np.uint8).reshape(-1, a.itemsize).T.copy().tobytes()


def lossless(weights: dict, runs, log):
    """``weights``: label -> torch tensor (fp32 or bf16)."""
    rows = []
    for label, t in weights.items():
        arr, _ = to_numpy(t)
        raw = arr.tobytes()
        nbytes = len(raw)
        blob = lcckpt.encode(t, lossless=True)
        assert to_numpy(lcckpt.decode(blob))[0].tobytes() == raw
        te = _median_time(lambda: lcckpt.encode(t, lossless=True), runs)
        td = _median_time(lambda: lcckpt.decode(blob), runs)
        rows.append({"data": label, "codec": "lcckpt lossless", "ratio": nbytes / len(blob),
                     "enc_MBps": nbytes / te / MB, "dec_MBps": nbytes / td / MB})
        grouped = _byte_grouped(arr)
        for level in (1, 3):
            for how, data in (("raw", raw), ("byte-grouped", grouped)):
                z = _zstd(data, level)
                d = zstandard.ZstdDecompressor()
                te = _median_time(lambda: _zstd(data, level), runs)
                td = _median_time(lambda: d.decompress(z), runs)
                rows.append({"data": label, "codec": f"zstd-{level} {how}",
                             "ratio": nbytes / len(z), "enc_MBps": nbytes / te / MB,
                             "dec_MBps": nbytes / td / MB})
    log("\n## lossless: trained weights (reference points: ZipNN reports ~1.2x fp32, ~1.5x bf16)")
    log(format_table(rows, ["data", "codec", "ratio", "enc_MBps", "dec_MBps"]))
    return rows


# --- latency ---------------------------------------------------------------------------

LATENCY_SNIPPET = """
import time
t0 = time.perf_counter()
import numpy as np, lcckpt
t1 = time.perf_counter()
x = np.random.default_rng(0).standard_normal(1_000_000).astype(np.float32)
t2 = time.perf_counter()
lcckpt.decode(lcckpt.encode(x))
t3 = time.perf_counter()
print(t1 - t0, t3 - t2)
"""


def latency(log):
    subprocess.run([sys.executable, "-c", LATENCY_SNIPPET], check=True, capture_output=True)
    out = subprocess.run([sys.executable, "-c", LATENCY_SNIPPET], check=True,
                         capture_output=True, text=True).stdout.split()
    res = {"import_s": float(out[0]), "first_encode_decode_s": float(out[1])}
    log(f"\n## latency: import {res['import_s']:.2f} s, first encode+decode of 1M fp32 "
        f"(cache warm) {res['first_encode_decode_s']:.3f} s")
    return res


def _say(msg: str) -> None:
    """A progress line on stderr: what the benchmark is doing now."""
    print(msg, file=sys.stderr, flush=True)


def run(quick: bool = False, bits: int = 2, log=print, say=_say, on_story=None) -> dict:
    """All sections; returns the JSON document. ``log`` gets the detailed tables, ``say``
    one progress line per phase, ``on_story`` the short story's data (``doc["story"]``,
    for :func:`story`) as soon as it is measured."""
    from lcckpt.bench.checkpoint import stream
    torch.manual_seed(0)
    t0 = time.time()
    lcckpt.DeltaEncoder(bits=bits)                 # bad bits fail now, not after training
    lcckpt.warmup()
    doc = {"environment": environment(), "quick": quick, "bits": bits, "chains": []}
    steps, every = (120, 10) if quick else (300, 10)
    say(f"[1/5] training a small CNN on handwritten digits ({steps} SGD steps, a checkpoint "
        f"every {every})")
    traj = train_trajectory(model="cnn", optimizer="sgd", steps=steps, snapshot_every=every,
                            progress=sys.stderr.isatty())
    say(f"[2/5] storing its {len(traj.snapshots)} checkpoints as torch.save, zstd, lcckpt "
        "lossless and delta chains, then restoring them")
    objs = [state for _, state in traj.snapshots]
    tfiles = []
    for o in objs:
        buf = io.BytesIO()
        torch.save(o, buf)
        tfiles.append(buf.getvalue())
    doc["story"] = stream(objs, tfiles, accuracy=lambda o: traj.accuracy(o["model"]),
                          desc="chains")
    doc["story"].update({"model": "cnn", "optimizer": "sgd", "steps": steps, "every": every})
    if on_story is not None:
        on_story(doc["story"])
    say("[3/5] per-checkpoint detail of the 2-bit deltas (SGD, then Adam)")
    doc["chains"].append(chain("cnn", "sgd", steps, every, bits, log, traj=traj))
    doc["chains"].append(chain("cnn", "adam", steps, every, bits, log))
    mlp_steps, mlp_every, runs = (10, 5, 3) if quick else (30, 10, 7)
    say("[4/5] speed on a 20M-element delta of a wide MLP, against zstd-1")
    doc["speed"] = speed(mlp_steps, mlp_every, runs, log)
    say("      and on a dense delta of the same MLP under Adam, against zstd-1 and zstd-3")
    doc["dense"] = dense(*((6, 3) if quick else (12, 4)), runs, log)
    say("[5/5] lossless coding of trained weights, and first-call latency")
    w = np.concatenate([v.reshape(-1) for v in
                        flat_float_params(traj.snapshots[-1][1]["model"]).values()])
    mlp = train_trajectory(model="mlp", optimizer="sgd", steps=mlp_every, snapshot_every=mlp_every)
    wm = np.concatenate([v.reshape(-1) for v in
                         flat_float_params(mlp.snapshots[-1][1]["model"]).values()])
    w, wm = torch.from_numpy(w), torch.from_numpy(wm)
    doc["lossless"] = lossless({"cnn fp32": w, "cnn bf16": w.to(torch.bfloat16),
                                "mlp fp32": wm, "mlp bf16": wm.to(torch.bfloat16)}, runs, log)
    doc["latency"] = latency(log)
    doc["seconds"] = time.time() - t0
    log(f"\ntotal {doc['seconds']:.0f} s")
    return doc


_STORY_NAMES = {"lcckpt lossless (each file)": "lcckpt lossless",
                "zstd-1 of torch.save": "zstd-1 of each file",
                "zstd-3 of torch.save": "zstd-3 of each file",
                "zstd-3 of the exact delta": "zstd-3 of fp32 deltas",
                "lcckpt default": "chain, default targets",
                "LC-faithful b=2 (huffman)": "chain LC b=2, Huffman",
                "LC b=2": "chain LC b=2",
                "LC b=4": "chain LC b=4"}


def _cell(v, fmt: str) -> str:
    return v if isinstance(v, str) else ("-" if v is None else format(v, fmt))


def story(s: dict) -> str:
    """The short table and verdict of :func:`stream` on a training run, < 100 columns."""
    head = ["", "MB", "x smaller", "error", "error/step", "accuracy", "worst drop",
            "MB/s save/load"]
    cells = []
    for r in s["rows"]:
        exact = r.get("exact")
        acc = s["accuracy_true"] if exact else r["accuracy"]
        speed = "/".join(_cell(r.get(k), ".0f") for k in ("enc_MBps", "dec_MBps"))
        cells.append([_STORY_NAMES.get(r["method"], r["method"]), _cell(r["bytes"] / MB, ".2f"),
                      _cell(r["ratio"], ".1f") + "x",
                      "exact" if exact else _cell(r["err_state"], ".3f"),
                      "exact" if exact else _cell(r["err_vs_change"], ".2f"),
                      f"{100 * acc:.1f}%",
                      "0" if exact else f"{100 * r['accuracy_drop_max']:.1f} pt", speed])
    widths = [max(len(row[i]) for row in cells + [head]) for i in range(len(head))]
    table = "\n".join("  ".join(c.ljust(w) if i == 0 else c.rjust(w)
                                for i, (c, w) in enumerate(zip(row, widths))).rstrip()
                      for row in [head] + cells)
    by = {r["method"]: r for r in s["rows"]}
    d, z, lc = by["lcckpt default"], by["zstd-3 of torch.save"], by.get("LC b=2")
    wrap = lambda text: textwrap.fill(text, 92)                      # noqa: E731
    behind = (f"; at its worst checkpoint it was {100 * d['accuracy_drop_max']:.1f} points "
              "behind" if d["accuracy_drop_max"] > 0.005 else
              "; no restored checkpoint fell more than half a point behind the true model")
    versus = (f" LC-Checkpoint's own 2-bit coding is {lc['ratio']:.1f}x smaller than "
              f"torch.save but fell {100 * lc['accuracy_drop_max']:.1f} points behind at its "
              "worst checkpoint: the default bounds each tensor's restored error instead "
              "(docs/chain.md)." if lc else "")
    lines = [
        wrap(f"A small CNN learns handwritten digits: {s['files']} checkpoints of its weights "
             f"and SGD momentum ({s['float_elements']:,} floats), one every {s['every']} steps. "
             f"Sizes are of the {s['deltas']} checkpoints after the first (in a chain, the "
             "deltas); x smaller is against torch.save."),
        wrap("error: ||restored - true|| / ||true|| of all floating state, worst checkpoint. "
             "error/step: that error over how far the state moved since the previous "
             "checkpoint (above 1, the delta kept less than the step). accuracy: of the "
             "last restored model on held-out digits; worst drop: the largest fall below the "
             "true model's accuracy at any checkpoint."),
        "",
        table,
        "",
        wrap(f"Verdict: the default chain stores these checkpoints {d['ratio']:.1f}x "
             f"smaller than torch.save ({z['bytes'] / d['bytes']:.1f}x smaller than zstd-3), and "
             f"the last restored model scores {100 * d['accuracy']:.1f}% against the true "
             f"model's {100 * s['accuracy_true']:.1f}%{behind}." + versus),
        wrap("Speeds on files this small are mostly per-file overhead (and a disk sync per "
             "save); the JSON's 'speed' section times a 20M-element delta."),
    ]
    return "\n".join(lines)


def _plot_story(s: dict, a, b) -> None:
    """Each chain setting of the summary, checkpoint by checkpoint: kB on disk (``a``) and
    restored accuracy beside the true model's (``b``)."""
    true = s.get("accuracy_true_per_file")
    if true is not None:                       # under the chains, which mostly sit on it
        b.plot(range(1, len(true) + 1), [100 * t for t in true], color="lightgrey", lw=4,
               label="true model")
    for r in s["rows"]:
        if "per_file" not in r:
            if r["method"] == "torch.save":
                a.axhline(r["bytes"] / s["deltas"] / 1e3, color="grey", ls="--",
                          label="torch.save (mean)")
            continue
        x = list(range(2, len(r["per_file"]) + 2))
        line, = a.plot(x, [f["bytes"] / 1e3 for f in r["per_file"]], marker="o", ms=3,
                       label=r["method"])
        if true is not None:
            b.plot(x, [100 * f["accuracy"] for f in r["per_file"]], marker="o", ms=3,
                   color=line.get_color(), label=r["method"])
    a.set_yscale("log")
    a.set_ylabel("kB on disk per checkpoint")
    a.set_title(f"{s.get('model', '')} / {s.get('optimizer', '')}: every chain setting")
    b.set_ylabel("held-out accuracy (%)")
    b.set_title("restored checkpoints against the true model")
    for ax in (a, b):
        ax.set_xlabel("checkpoint")
        ax.legend(fontsize=7)


def plot(doc: dict, path: str):
    """The summary's chains checkpoint by checkpoint (the default first among them), then
    bits per element and restored accuracy along each LC chain, drawn from the JSON."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as e:
        raise ImportError("plots need matplotlib: pip install 'lcckpt[plot]'") from e
    chains = doc["chains"]
    top = 1 if "story" in doc else 0
    cols = max(2, len(chains)) if top else len(chains)
    fig, axes = plt.subplots(2 + top, cols, figsize=(6 * cols, 3.5 * (2 + top)),
                             squeeze=False)
    if top:
        _plot_story(doc["story"], axes[0][0], axes[0][1])
        for ax in axes[0][2:]:
            ax.axis("off")
    for col, ch in enumerate(chains):
        rows = ch["rows"]
        steps = [r["step"] for r in rows]
        ax = axes[top][col]
        for key, label in (("huffman_bpe", "LC faithful (Huffman)"), ("grouped_bpe", "grouped"),
                           ("runs_bpe", "zero runs"), ("auto_bpe", "auto (whole blob)"),
                           ("entropy_bpe", "order-0 entropy")):
            ax.plot(steps, [r[key] for r in rows], marker="o", ms=3, label=label)
        ax.set_title(f"{ch['model']} / {ch['optimizer']}, b={ch['bits']}")
        ax.set_ylabel("bits per element")
        ax.legend(fontsize=8)
        ax = axes[top + 1][col]
        ax.plot(steps, [100 * r["acc_true"] for r in rows], marker="o", ms=3, label="true model")
        ax.plot(steps, [100 * r["acc_restored"] for r in rows], marker="o", ms=3,
                label=f"restored from the LC b={ch['bits']} chain")
        ax.set_xlabel("training step")
        ax.set_ylabel("held-out accuracy (%)")
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def plot_stream(s: dict, path: str):
    """Bytes and error per checkpoint for each chain setting of :func:`stream`'s result."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as e:
        raise ImportError("plots need matplotlib: pip install 'lcckpt[plot]'") from e
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    for r in s["rows"]:
        if "per_file" not in r:
            if r["method"] in ("torch.save", "zstd-3 of torch.save"):
                a.axhline(r["bytes"] / s["deltas"] / 1e3, color="grey",
                          ls=":" if "zstd" in r["method"] else "--",
                          label=f"{r['method']} (mean)")
            continue
        x = list(range(2, len(r["per_file"]) + 2))
        line, = a.plot(x, [f["bytes"] / 1e3 for f in r["per_file"]], marker="o", ms=3,
                       label=r["method"])
        b.plot(x, [f["err_vs_change"] for f in r["per_file"]], marker="o", ms=3,
               color=line.get_color(), label=f"{r['method']}: all state")
        b.plot(x, [f["worst_tensor_err_vs_change"] for f in r["per_file"]], ls="--",
               color=line.get_color(), label="  worst tensor")
    for ax in (a, b):
        ax.set_xlabel("checkpoint (delta on the one before)")
        ax.set_yscale("log")
        ax.xaxis.get_major_locator().set_params(integer=True)
    a.set_ylabel("kB on disk")
    a.legend(fontsize=7)
    b.axhline(1, color="grey", lw=0.8)
    b.set_ylabel("error / step (1 = as far as the previous state)")
    b.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def add_arguments(ap: argparse.ArgumentParser) -> None:
    """The benchmark's options (shared by ``lcckpt bench`` and benchmarks/codec.py)."""
    ap.add_argument("--checkpoint", nargs="+", metavar="FILE",
                    help="benchmark your own checkpoints instead (.pt, .safetensors, .lcc): one "
                         "file for the lossless codec, two or more files of one run, oldest "
                         "first, for the delta chain")
    ap.add_argument("--error-bound", type=float, action="append", default=[], metavar="E",
                    help="with --checkpoint: also a 2-bit chain whose every delta keeps the "
                         "relative error of the state within E (repeatable)")
    ap.add_argument("--quick", action="store_true", help="short version (make demo)")
    ap.add_argument("--tables", action="store_true",
                    help="print every detailed table, not only the summary")
    ap.add_argument("--json", metavar="PATH", help="write the full JSON document here")
    ap.add_argument("--plot", metavar="PATH", help="draw the results (PNG)")
    ap.add_argument("--bits", type=int, default=2, choices=range(1, 5), metavar="{1..4}",
                    help="bits per delta element of the detailed chain tables (default 2)")


def run_cli(args) -> int:
    """Run what ``args`` (from :func:`add_arguments`) asks for; print, write JSON and plot."""
    from lcckpt.bench import checkpoint
    for e in args.error_bound:
        if not 0 < e < 1:
            raise lcckpt.InvalidArgumentError(f"--error-bound must be in (0, 1), got {e}")
    if args.error_bound and not args.checkpoint:
        raise lcckpt.InvalidArgumentError("--error-bound applies to --checkpoint runs")
    for out in (args.json, args.plot):
        parent = os.path.dirname(os.path.abspath(out)) if out else None
        if parent and not os.path.isdir(parent):
            raise FileNotFoundError(2, "no such directory for the output", parent)
    if args.checkpoint:
        doc = checkpoint.run(args.checkpoint, error_bounds=args.error_bound)
    else:
        doc = run(args.quick, args.bits, log=print if args.tables else (lambda *a: None),
                  on_story=lambda s: print(story(s) + "\n", flush=True))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(doc, f, indent=1, default=float)
    if args.plot:
        if "stream" in doc:
            plot_stream(doc["stream"], args.plot)
        elif "chains" in doc:
            plot(doc, args.plot)
        else:
            print("(one file: nothing to plot)", file=sys.stderr)
            args.plot = None
    wrote = [f"full JSON: {args.json}" if args.json else None,
             f"plot: {args.plot}" if args.plot else None]
    if any(wrote):
        print("\n" + "; ".join(w for w in wrote if w))
    elif not args.checkpoint:
        print("\n(--json PATH and --plot PATH keep every number and draw them)")
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="lcckpt bench", description=__doc__.splitlines()[0])
    add_arguments(ap)
    return run_cli(ap.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
