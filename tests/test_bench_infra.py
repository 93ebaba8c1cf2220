"""The benchmark infrastructure: trajectories are real, reproducible and safe to keep."""

import numpy as np
import pytest
import torch

pytest.importorskip("sklearn")

from lcckpt.bench.timing import format_table, measure, throughput_mbs  # noqa: E402
from lcckpt.bench.trajectory import WideMLP, _snapshot, flat_float_params, train_trajectory


def _assert_states_equal(a, b):
    fa = flat_float_params(a, include_optim=True)
    fb = flat_float_params(b, include_optim=True)
    assert fa.keys() == fb.keys()
    for k in fa:
        np.testing.assert_array_equal(fa[k], fb[k])


@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
def test_cnn_trajectory_is_deterministic(optimizer):
    a = train_trajectory("cnn", optimizer, steps=12, snapshot_every=4, seed=3)
    b = train_trajectory("cnn", optimizer, steps=12, snapshot_every=4, seed=3)
    assert [s for s, _ in a.snapshots] == [0, 4, 8, 12]
    for (_, sa), (_, sb) in zip(a.snapshots, b.snapshots):
        _assert_states_equal(sa, sb)
    # A different seed must give a different run, or the test above proves nothing.
    c = train_trajectory("cnn", optimizer, steps=4, snapshot_every=4, seed=4)
    assert not torch.equal(c.snapshots[-1][1]["model"]["fc2.weight"],
                           a.snapshots[1][1]["model"]["fc2.weight"])


def test_snapshots_are_independent_copies():
    traj = train_trajectory("cnn", "sgd", steps=4, snapshot_every=2)
    (_, s2), (_, s4) = traj.snapshots[1:]
    # Training went on after step 2; a snapshot aliasing the live tensors would
    # equal the final one.
    assert not torch.equal(s2["model"]["fc1.weight"], s4["model"]["fc1.weight"])
    assert not torch.equal(s2["optim"]["state"][0]["momentum_buffer"],
                           s4["optim"]["state"][0]["momentum_buffer"])

    # Mutating the model and optimizer in place after a snapshot leaves it intact.
    model = traj.make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.zeros(2, 1, 8, 8)).sum().backward()
    opt.step()
    snap = _snapshot(model, opt)
    kept = flat_float_params(snap, include_optim=True)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
            opt.state[p]["momentum_buffer"].add_(1.0)
    now = flat_float_params(snap, include_optim=True)
    for k in kept:
        np.testing.assert_array_equal(kept[k], now[k])

    # The flattened arrays are copies too.
    flat_float_params(s4)["fc1.weight"][...] = 0
    assert s4["model"]["fc1.weight"].abs().sum() > 0


def test_optimizer_state_names_and_dtypes():
    traj = train_trajectory("cnn", "adam", steps=2, snapshot_every=2)
    flat = flat_float_params(traj.snapshots[-1][1], include_optim=True)
    assert "optim.state.3.exp_avg" in flat and "optim.state.3.exp_avg_sq" in flat
    assert not any(k.endswith(".step") for k in flat)
    assert all(v.dtype == np.float32 for v in flat.values())
    assert flat["optim.state.0.exp_avg"].shape == flat["conv1.weight"].shape


def test_trained_cnn_beats_chance_clearly():
    traj = train_trajectory("cnn", "sgd", steps=200)
    assert [s for s, _ in traj.snapshots] == list(range(0, 201, 10))
    first, last = traj.snapshots[0][1]["model"], traj.snapshots[-1][1]["model"]
    assert traj.accuracy(last) > 0.9  # observed 0.978 for seed 0; chance is 0.1
    assert traj.loss(last) < traj.loss(first)


def test_wide_mlp_has_about_20m_parameters():
    n = sum(p.numel() for p in WideMLP().parameters())
    assert abs(n - 20_000_000) <= 0.15 * 20_000_000


def test_measure_honours_min_runs_and_min_time(monkeypatch):
    """On a clock that each call of ``fn`` moves by a known amount (no sleeping, no real
    time): the run count follows ``min_runs``, ``min_time`` and ``max_runs``."""
    from lcckpt.bench import timing
    now = {"wall": 0.0, "cpu": 0.0}
    monkeypatch.setattr(timing.time, "perf_counter", lambda: now["wall"])
    monkeypatch.setattr(timing.time, "process_time", lambda: now["cpu"])

    def work(wall, cpu=0.0):
        def fn():
            now["wall"] += wall
            now["cpu"] += cpu
        return fn
    t = measure(work(0.0625), min_runs=3, min_time=0.5)       # binary fractions: exact sums
    assert t.runs == 8 and t.median_s == 0.0625 and t.cpu_s == 0.0
    t = measure(work(0.25, cpu=0.125), min_runs=4, min_time=0.0)
    assert t.runs == 4 and t.cpu_s == 0.125
    assert measure(work(0.0), min_runs=1, min_time=10.0, max_runs=7).runs == 7


def test_throughput():
    assert throughput_mbs(2_000_000, 0.5) == pytest.approx(4.0)


def test_format_table_aligns_columns():
    rows = [{"name": "lc", "ratio": 12.3456, "n": 3}, {"name": "zstd-19", "ratio": None, "n": 1000}]
    lines = format_table(rows, ["name", "ratio", "n"]).splitlines()
    assert len(lines) == 4
    assert lines[0].split() == ["name", "ratio", "n"]
    assert set(lines[1]) <= {"-", " "}
    # Numbers are right-aligned, so every line ends where the last column ends.
    assert len({len(line) for line in lines}) == 1
    assert lines[2].endswith(" 3") and lines[3].endswith(" 1000")
    ratio_end = lines[0].index("ratio") + len("ratio")
    assert lines[2][:ratio_end].endswith("12.346") and lines[3][:ratio_end].endswith("-")
    assert lines[2].startswith("lc ") and lines[3].startswith("zstd-19 ")


def test_layouts_paths_and_a_small_run_that_restores_bit_for_bit():
    from lcckpt.bench.layout import LAYOUTS, path_of, run_layout
    for i in range(1, 200):
        assert path_of("chain", i) == list(range(1, i + 1))
        assert path_of("keyframe", i) == [i]
        skip = path_of("skip", i)
        assert skip[-1] == i and skip == sorted(skip) and len(skip) == bin(i).count("1")
    g = torch.Generator().manual_seed(0)
    w = torch.randn(64, 32, generator=g)
    states = []
    for _ in range(7):                       # a random walk: its displacement grows
        w = w + 0.01 * torch.randn(64, 32, generator=g)
        states.append({"/model/fc.weight": w.clone(), "/model/fc.bias": w[0].clone()})
    sizes = {}
    for layout in LAYOUTS:                   # run_layout raises if a restore is not exact
        rows = list(run_layout(states, layout, repeats=1))
        assert len(rows) == 6 and all(n > 0 and t >= 0 for n, t in rows)
        sizes[layout] = sum(n for n, _ in rows)
    assert sizes["keyframe"] > sizes["chain"]


def test_quality_plot_merges_runs_and_draws_every_point(tmp_path, monkeypatch):
    """The bytes-vs-drop plot of merged runs: one marker per setting (the distributed and
    keyframe-interval rows left out), each at its whole-run ratio and drop."""
    pytest.importorskip("matplotlib")
    import json
    from lcckpt.bench import quality
    rows = {"default": (16.5, 0.22), "lc b=2": (19.8, 20.2),
            "lossless (every save a keyframe)": (1.2, 0.0),
            "default, keyframe_every=10": (6.4, 0.22), "distributed default": (5.8, 0.22)}
    paths = []
    for i, (name, (x, y)) in enumerate(rows.items()):
        p = tmp_path / f"{i}.json"
        p.write_text(json.dumps({"workloads": {"cnn-sgd": {name: {"whole_run_ratio": x,
                                                                   "worst_drop_points": y}}},
                                 "resume": {}}))
        paths.append(str(p))
    merged = quality.merge(paths)
    assert list(merged["workloads"]["cnn-sgd"]) == list(rows)
    import matplotlib.pyplot as plt
    drawn = []
    real = plt.Axes.scatter
    monkeypatch.setattr(plt.Axes, "scatter",
                        lambda self, x, y, **kw: drawn.append((x, y)) or real(self, x, y, **kw))
    quality._plot(merged, str(tmp_path / "q.png"))
    assert sorted(drawn) == sorted(v for k, v in rows.items() if "keyframe_every" not in k
                                   and not k.startswith("distributed"))
    assert (tmp_path / "q.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_the_trainer_benchmark_weighs_first_moment_errors_as_adam_does():
    """``m1_err_adam`` divides each element's error by √v + ε, as Adam's step divides its
    first moment: the same error counts for far more where the second moment is small,
    while the plain relative L2 error cannot tell the two apart."""
    from lcckpt.bench.trainer import _moment_errors

    m = torch.tensor([1.0, 1.0])
    v = torch.tensor([1.0, 1e-4])
    exact = {"optimizer": {"state": {0: {"exp_avg": m, "exp_avg_sq": v}}}}

    def restored(m1, m2=v):
        return {"optimizer": {"state": {0: {"exp_avg": torch.tensor(m1), "exp_avg_sq": m2}}}}

    assert _moment_errors(exact, restored([1.0, 1.0])) == {
        "m1_err": 0.0, "m1_err_adam": 0.0, "m2_root_ratio": [1.0, 1.0, 1.0]}
    # the second moment restored 4x too large on the small element: that step is halved
    p1, p50, p99 = _moment_errors(exact, restored([1.0, 1.0], v * torch.tensor([1.0, 4.0])))[
        "m2_root_ratio"]
    assert p1 == pytest.approx(1.01) and p50 == pytest.approx(1.5) and p99 == pytest.approx(1.99)
    big_v, small_v = (_moment_errors(exact, restored(x)) for x in ([1.5, 1.0], [1.0, 1.5]))
    assert big_v["m1_err"] == pytest.approx(small_v["m1_err"]) == pytest.approx(0.5 / 2 ** 0.5)
    root = (v.double().sqrt() + 1e-8).tolist()                 # the oracle, written out
    norm = ((1 / root[0]) ** 2 + (1 / root[1]) ** 2) ** 0.5
    assert big_v["m1_err_adam"] == pytest.approx(0.5 / root[0] / norm)
    assert small_v["m1_err_adam"] == pytest.approx(0.5 / root[1] / norm)
    assert small_v["m1_err_adam"] > 50 * big_v["m1_err_adam"]
