"""The codec benchmark's default section: the default encoder (a chain's weight target,
the uniform quantizer) on a real dense delta, whole and pass by pass, against a
bytes-per-element traffic model of each pass over the bandwidth of a numpy copy."""

import time

import numpy as np

from lcckpt.bench.timing import format_table
from lcckpt.bench.trajectory import flat_float_params, train_trajectory


def _rounds(cases: dict, runs: int) -> dict:
    """Wall seconds of each ``(setup, fn)`` (median, min, max), the cases taking turns
    round by round; ``setup`` runs untimed before each call."""
    times = {k: [] for k in cases}
    for _ in range(runs):
        for k, (setup, fn) in cases.items():
            setup()
            t = time.perf_counter()
            fn()
            times[k].append(time.perf_counter() - t)
    return {k: (float(np.median(v)), min(v), max(v)) for k, v in times.items()}


def _chain_delta(steps: int, every: int):
    """The wide MLP under Adam, its largest weight: a default encoder that has coded a
    keyframe (third-last snapshot) and one delta (second-last), so its reference is the
    decoder's reconstruction as in a chain; the last snapshot to code next."""
    from lcckpt.chain.policy import RolePolicy
    from lcckpt.codec.delta import DeltaEncoder
    traj = train_trajectory(model="mlp", optimizer="adam", steps=steps, snapshot_every=every)
    snaps = [flat_float_params(s) for _, s in traj.snapshots[-3:]]
    name = max(snaps[0], key=lambda k: snaps[0][k].size)
    key, prev, u = (np.ascontiguousarray(s[name].reshape(-1)) for s in snaps)
    enc = DeltaEncoder(target=RolePolicy().weight, relative_to="movement",
                       update_share=RolePolicy().update)
    enc.encode_parts(key)
    enc.encode_parts(prev)
    return name, enc, u


def _search(u, ref, share, cs, sv):
    """The step search once, counting its tries (quantization passes)."""
    from lcckpt.codec import uniform
    tries = [0]
    real = uniform._try_step

    def counting(x, *args, **kwargs):
        tries[0] += 1
        return real(x, *args, **kwargs)
    uniform._try_step = counting
    try:
        return uniform.uniform_quantize(u, ref, share, cs, None, sv), tries[0]
    finally:
        uniform._try_step = real


def _cases(enc, u, threads):
    """The timed calls, each from the same reference: the whole encode and its passes
    (survey, step search, entropy analysis, coding that advances a scratch reference),
    a numpy copy for the bandwidth; and what the model needs of their outputs."""
    from lcckpt.codec import entropy, uniform
    from lcckpt.codec.config import CodecConfig
    from lcckpt.codec.dtypes import to_numpy
    from lcckpt.codec.movement import LOG2
    from lcckpt.codec.survey import survey
    from lcckpt.util import pool as _pool
    n, cs = u.size, 1 << CodecConfig().log2
    ref = enc.ref.copy()
    sv = survey(u, ref, LOG2)
    share = enc._config_for(u, to_numpy(u)[1], sv).target
    uq, tries = _search(u, ref, share, cs, sv)
    modes = entropy.uniform_modes(CodecConfig().coder, uq.bits)
    an = entropy.analyze(uq.sym, uq.sym_hist, cs, uq.bits, modes)
    scratch, dst = ref.copy(), np.empty_like(u)
    per = -(-n // threads)

    def reset():
        np.copyto(enc.ref, ref)
        np.copyto(scratch, ref)

    def copy():
        _pool.run_tasks(lambda t: np.copyto(dst[t * per:(t + 1) * per],
                                            u[t * per:(t + 1) * per]), threads)
    _, st = enc.encode_parts(u)
    reset()
    cases = {
        "whole": (reset, lambda: enc.encode_parts(u)),
        "survey": (reset, lambda: survey(u, ref, LOG2)),
        "search": (reset, lambda: uniform.uniform_quantize(u, ref, share, cs, None, sv)),
        "analysis": (reset, lambda: entropy.analyze(uq.sym, uq.sym_hist, cs, uq.bits, modes)),
        "coding": (reset, lambda: entropy.encode(uq.sym, an, modes, None,
                                                 apply=(uq.table, scratch))),
        "copy": (reset, copy),
    }
    info = {"share": share, "tries": tries, "bits": uq.bits, "escapes": uq.escapes,
            "nonzero": 1 - float(uq.sym_hist[:, 0].sum()) / n, "bytes": int(st.nbytes),
            "rel_error": st.rel_error, "histograms": 1 + (entropy.GROUPED in an.hist)}
    return cases, info


def _model(info: dict, n: int) -> list:
    """``(pass, traffic, bytes per element, case)``: what each pass must read and write."""
    payload = info["bytes"] / n
    lines = min(1.0, 1 - (1 - info["nonzero"]) ** 16)    # cache lines of the reference
    h, tries = info["histograms"], info["tries"]
    model = [
        ("survey", "read u 4, ref 4", 8.0, "survey"),
        ("step search", f"{tries} tries x (read u 4, ref 4, write symbols 1, escape bits "
         "0.125)", 9.125 * tries, "search"),
        ("entropy analysis", f"read symbols 1 x {h} histogram(s)", float(h), "analysis"),
        ("coding + reference", f"read symbols 1, write payload {payload:.3f}, reference "
         f"read+write 8 x {lines:.2f}", 1 + payload + 8 * lines, "coding"),
    ]
    return model + [("whole encode", "", sum(m[2] for m in model), "whole")]


def default_encode(steps, every, runs, log):
    """The default encoder on the wide MLP's largest weight under Adam (20M elements),
    the delta between the last two snapshots of a chain: whole
    (``DeltaEncoder.encode_parts``) and pass by pass, the calls taking turns, against
    the traffic model at the bandwidth a numpy copy gets on the same threads."""
    from lcckpt.chain.policy import RolePolicy
    from lcckpt.util import pool as _pool
    name, enc, u = _chain_delta(steps, every)
    n, threads = u.size, _pool.threads()
    cases, info = _cases(enc, u, threads)
    t = _rounds(cases, runs)
    bw = 8 * n / t["copy"][0]
    rows = [{"pass": p, "traffic": what, "B_per_el": b, "model_ms": 1e3 * b * n / bw,
             "measured_ms": 1e3 * t[k][0], "range_ms": (1e3 * t[k][1], 1e3 * t[k][2]),
             "vs_model": t[k][0] / (b * n / bw)} for p, what, b, k in _model(info, n)]
    gbps = 4 * n / t["whole"][0] / 1e9
    log(f"\n## default: the default encoder on {name} of the wide MLP under Adam, "
        f"{n:,} fp32 elements, {threads} threads, median of {runs} interleaved rounds")
    log(f"target {RolePolicy().weight:g} of the movement or {RolePolicy().update:g} of the "
        f"update, whichever allows more = {info['share']:.3g} of ||u||; "
        f"{info['bits']}-bit symbols, {100 * info['nonzero']:.1f}% nonzero, "
        f"{info['escapes']} escapes, {info['bytes'] / 1e6:.2f} MB "
        f"({8 * info['bytes'] / n:.2f} bits/element), restored rel. error "
        f"{info['rel_error']:.3g} of ||u||")
    log(f"whole encode: {1e3 * t['whole'][0]:.0f} ms = {gbps:.2f} GB/s of fp32 input "
        f"(range {4 * n / t['whole'][2] / 1e9:.2f}-{4 * n / t['whole'][1] / 1e9:.2f})")
    log(f"traffic model: numpy copy {bw / 1e9:.1f} GB/s over {threads} threads")
    log(format_table(rows, ["pass", "traffic", "B_per_el", "model_ms", "measured_ms",
                            "vs_model"]))
    return dict(info, tensor=name, elements=int(n), threads=threads, GBps=gbps,
                copy_GBps=bw / 1e9, traffic=rows, seconds={k: v[0] for k, v in t.items()})
