"""The codec benchmark's dense and lossless sections: a dense 20M-element delta of a wide
MLP under Adam against zstd-1/3 with a bytes-per-element traffic model of each pass, and
the exact codec on trained weights against zstd on raw and byte-grouped bytes."""

import time

import numpy as np

import lcckpt
from lcckpt.bench.timing import MB, format_table, median_time, zstandard, zstd_compress
from lcckpt.bench.trajectory import flat_float_params, train_trajectory
from lcckpt.codec.dtypes import to_numpy


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


def _dense_delta(steps: int, every: int):
    """The last two snapshots of the wide MLP under Adam: their steps, the weights'
    delta, and the share of exact zeros in it and in ``exp_avg``'s."""
    traj = train_trajectory(model="mlp", optimizer="adam", steps=steps, snapshot_every=every)
    (st0, s0), (st1, s1) = traj.snapshots[-2], traj.snapshots[-1]
    p0 = flat_float_params(s0, include_optim=True)
    p1 = flat_float_params(s1, include_optim=True)

    def part(p, want):
        return np.concatenate([v.reshape(-1) for k, v in p.items() if want(k)])

    def is_param(k):
        return not k.startswith("optim.")

    def is_m(k):
        return k.endswith(".exp_avg")
    delta = part(p1, is_param) - part(p0, is_param)
    m_delta = part(p1, is_m) - part(p0, is_m)
    zeros = {"params": float(np.mean(delta == 0)), "exp_avg": float(np.mean(m_delta == 0))}
    return (st0, st1), delta, zeros


def _contenders(delta: np.ndarray, threads: int) -> tuple[dict, dict]:
    """The calls that race (lcckpt's encode and decode, their passes, zstd-1/3 on one
    frame per thread, a numpy copy) and what the tables need of their outputs."""
    from lcckpt.util import pool as _pool
    from lcckpt.codec import entropy, quantize
    from lcckpt.codec.config import CodecConfig
    n, nbytes = delta.size, delta.nbytes
    cs = 1 << CodecConfig(bits=2).log2
    modes = entropy.modes_for(CodecConfig(bits=2).coder, 2)
    blob = lcckpt.encode(delta, bits=2)
    faithful = lcckpt.encode(delta, bits=2, coder="huffman")
    q = quantize.quantize(delta, None, 2, cs, runs_stats=True)

    def code():                                        # the coder alone, on q's symbols
        entropy.encode(q.sym, entropy.analyze(q.sym, q.sym_hist, cs, 2, modes,
                                              (q.runs_hist, q.runs_extra)), modes,
                       nonzero=q.nonzero)
    code()
    src = np.ascontiguousarray(delta)
    dst = np.empty_like(src)
    per = -(-n // threads)

    def copy():
        _pool.run_tasks(lambda t: np.copyto(dst[t * per:(t + 1) * per],
                                            src[t * per:(t + 1) * per]), threads)
    raw = memoryview(delta).cast("B")
    zs = {}
    for level in (1, 3):
        enc, dec, dec_into, pool = _zstd_frames(level, threads)
        frames = enc(raw)
        assert b"".join(dec(frames)) == bytes(raw)
        zs[level] = (enc, dec, frames, sum(len(f) for f in frames), pool, dec_into)
    zbuf = bytearray(nbytes)                 # decode targets that already exist
    lbuf = np.empty_like(delta)
    back = lcckpt.decode(blob)
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
    out = {"blob": len(blob), "faithful": len(faithful), "zstd": {k: v[3] for k, v in zs.items()},
           "pools": [v[4] for v in zs.values()],
           "nonzero": 1 - float(q.sym_hist[:, 0].sum()) / n,
           "error": float(np.linalg.norm(back - delta) / np.linalg.norm(delta))}
    return fns, out


def _speed_rows(t: dict, cpu: dict, nbytes: int, sizes: dict) -> tuple[list, list]:
    """Ratio and MB/s (wall and per CPU second) of each codec against zstd-1; and the
    decodes into a buffer that exists (a chain restore applies a delta so)."""
    def mbps(k):
        return nbytes / t[k][0] / MB

    def rng(k):
        return nbytes / t[k][2] / MB, nbytes / t[k][1] / MB
    names = [("lcckpt b=2 (auto)", "lc", sizes["blob"]),
             ("lcckpt b=2 huffman", "lc_huff", sizes["faithful"]),
             ("zstd-1", "z1", sizes["zstd"][1]), ("zstd-3", "z3", sizes["zstd"][3])]
    rows = [{"codec": name, "ratio": nbytes / size,
             "enc_MBps": mbps(k + "_enc"), "dec_MBps": mbps(k + "_dec"),
             "enc_range": rng(k + "_enc"), "dec_range": rng(k + "_dec"),
             # MB per CPU second: the work, whatever the load
             "enc_MB_cpu_s": nbytes / cpu[k + "_enc"] / MB,
             "dec_MB_cpu_s": nbytes / cpu[k + "_dec"] / MB} for name, k, size in names]
    z1 = rows[2]
    for r in rows:
        r["enc_vs_zstd1"] = r["enc_MBps"] / z1["enc_MBps"]
        r["dec_vs_zstd1"] = r["dec_MBps"] / z1["dec_MBps"]
        r["enc_cpu_vs_zstd1"] = r["enc_MB_cpu_s"] / z1["enc_MB_cpu_s"]
        r["dec_cpu_vs_zstd1"] = r["dec_MB_cpu_s"] / z1["dec_MB_cpu_s"]
    # the same decodes without the page faults of a fresh 4-bytes-per-element output
    lc, z = mbps("lc_dec_into"), mbps("z1_dec_into")
    into = [{"codec": "lcckpt b=2 (auto)", "dec_into_MBps": lc, "dec_into_range": rng("lc_dec_into"),
             "dec_into_vs_zstd1": lc / z},
            {"codec": "zstd-1", "dec_into_MBps": z, "dec_into_range": rng("z1_dec_into"),
             "dec_into_vs_zstd1": 1.0}]
    return rows, into


def _traffic(t: dict, n: int, nonzero: float, blob_bytes: int) -> tuple[float, list]:
    """Bytes per element each pass must move at the least, at the bandwidth of a numpy
    copy (which reads 4 and writes 4 bytes per element), against the measured times."""
    bw = 8 * n / t["copy"][0]
    payload = blob_bytes / n
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
    return bw, [{"pass": p, "traffic": what, "B_per_el": b, "model_ms": 1e3 * b * n / bw,
                 "measured_ms": None if m is None else 1e3 * m,
                 "vs_model": None if m is None else m / (b * n / bw)} for p, what, b, m in model]


def dense(steps, every, runs, log):
    """A dense delta: the wide MLP under Adam, which moves every weight every step.

    ``lcckpt.encode(d, bits=2)`` and ``lcckpt.decode`` against zstd-1 and zstd-3 on the
    same bytes, on as many threads as lcckpt's pool has (zstd: one frame per thread),
    and the passes of the encode and the decode against a traffic model: bytes read and
    written per element by each pass, over the bandwidth a numpy copy gets on the same
    threads in the same run.
    """
    from lcckpt.util import pool as _pool
    (st0, st1), delta, zeros = _dense_delta(steps, every)
    n, nbytes, threads = delta.size, delta.nbytes, _pool.threads()
    fns, out = _contenders(delta, threads)
    t, cpu = _interleaved(fns, runs)
    for pool in out["pools"]:
        pool.shutdown()
    rows, into_rows = _speed_rows(t, cpu, nbytes, out)
    bw, mrows = _traffic(t, n, out["nonzero"], out["blob"])
    log(f"\n## dense: wide-MLP delta under Adam, steps {st0} -> {st1}, {n:,} fp32 elements "
        f"({nbytes / MB:.0f} MB), {threads} threads, median of {runs} interleaved rounds")
    log(f"exact zeros: params delta {100 * zeros['params']:.2f}%, exp_avg delta "
        f"{100 * zeros['exp_avg']:.2f}%; nonzero 2-bit symbols {100 * out['nonzero']:.2f}%; "
        f"restored rel. error {out['error']:.3f}")
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
            "zero_fraction": zeros, "nonzero_symbols": out["nonzero"], "rows": rows,
            "decode_into": into_rows,
            "copy_GBps": bw / 1e9, "traffic": mrows,
            "seconds": {k: v[0] for k, v in t.items()}, "cpu_seconds": cpu}


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
        te = median_time(lambda: lcckpt.encode(t, lossless=True), runs)
        td = median_time(lambda: lcckpt.decode(blob), runs)
        rows.append({"data": label, "codec": "lcckpt lossless", "ratio": nbytes / len(blob),
                     "enc_MBps": nbytes / te / MB, "dec_MBps": nbytes / td / MB})
        grouped = _byte_grouped(arr)
        for level in (1, 3):
            for how, data in (("raw", raw), ("byte-grouped", grouped)):
                z = zstd_compress(data, level)
                d = zstandard.ZstdDecompressor()
                te = median_time(lambda: zstd_compress(data, level), runs)
                td = median_time(lambda: d.decompress(z), runs)
                rows.append({"data": label, "codec": f"zstd-{level} {how}",
                             "ratio": nbytes / len(z), "enc_MBps": nbytes / te / MB,
                             "dec_MBps": nbytes / td / MB})
    log("\n## lossless: trained weights (reference points: ZipNN reports ~1.2x fp32, ~1.5x bf16)")
    log(format_table(rows, ["data", "codec", "ratio", "enc_MBps", "dec_MBps"]))
    return rows


