"""lcckpt bench --checkpoint on small files of a real (tiny) training run, and the demo's
short story table."""

import json
import math

import numpy as np
import pytest
import torch

import lcckpt
from lcckpt.bench import checkpoint as cb
from lcckpt.bench.codec import story
from lcckpt.cli import main
from lcckpt.format.safetensors_io import save_safetensors

pytest.importorskip("zstandard")


def _run_states(n=3, steps_between=3):
    """States of a small model trained with SGD+momentum, a few steps apart."""
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(32, 128), torch.nn.Tanh(), torch.nn.Linear(128, 4))
    opt = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
    x, y = torch.randn(64, 32), torch.randint(0, 4, (64,))
    states = []
    for _ in range(n):
        for _ in range(steps_between):
            opt.zero_grad()
            torch.nn.functional.cross_entropy(net(x), y).backward()
            opt.step()
        states.append({k: v.clone() for k, v in net.state_dict().items()})
    return states, (net, x, y)


@pytest.fixture(scope="module")
def run_files(tmp_path_factory):
    d = tmp_path_factory.mktemp("run")
    states, _ = _run_states()
    paths = []
    for i, s in enumerate(states):
        p = d / f"ck{i}.pt"
        torch.save(s, p)
        paths.append(str(p))
    return d, paths, states


def test_one_file(run_files, capsys):
    d, paths, _ = run_files
    out = d / "one.json"
    assert main(["bench", "--checkpoint", paths[0], "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "zstd-3 of torch.save" in text and "lcckpt lossless" in text
    rows = {r["method"]: r for r in json.loads(out.read_text())["single"]["rows"]}
    assert rows["lcckpt lossless"]["exact"] is True
    assert rows["torch.save"]["ratio"] == 1.0
    assert all(r["bytes"] > 0 for r in rows.values())


def test_json_without_a_path_is_printed_alone_on_stdout(run_files, capsys):
    _, paths, _ = run_files
    assert main(["bench", "--checkpoint", paths[0], "--json"]) == 0
    out, err = capsys.readouterr()
    rows = {r["method"] for r in json.loads(out)["single"]["rows"]}   # nothing else there
    assert "lcckpt lossless" in rows
    assert "zstd-3 of torch.save" in err                                # the tables


def test_stream_of_files(run_files, capsys):
    d, paths, states = run_files
    out, png = d / "s.json", d / "s.png"
    assert main(["bench", "--checkpoint", *paths, "--error-bound", "0.001",
                 "--json", str(out), "--plot", str(png)]) == 0
    text = capsys.readouterr().out
    assert "worst tensor err/step" in text and "lcckpt default" in text
    s = json.loads(out.read_text())["stream"]
    rows = {r["method"]: r for r in s["rows"]}
    assert s["files"] == 3 and s["deltas"] == 2
    assert rows["torch.save"]["bytes"] == sum((d / f"ck{i}.pt").stat().st_size for i in (1, 2))
    for label, _ in cb.SETTINGS:
        r = rows[label]
        assert r["bytes"] > 0 and math.isfinite(r["err_state"]) and len(r["per_file"]) == 2
        # one number for all state never exceeds its worst tensor (a mediant)
        assert r["worst_tensor_err_vs_change"] >= r["err_vs_change"] * (1 - 1e-9)
        assert r["worst_tensor"] in states[0]
    # the error bound is a promise: every restored state is within it (plus fp32 rounding)
    bound = rows["lcckpt b=2, error <= 0.001"]
    assert bound["err_state"] <= 0.001 * (1 + 1e-4) + 1e-6
    # more bits never give a larger error on these states
    assert rows["LC b=4"]["err_state"] <= rows["LC b=2"]["err_state"]
    # the default's deltas are uniform blobs, LC's lossy ones: both counted as lossy
    for label in ("lcckpt default", "LC b=2"):
        lossy, tracked = map(int, rows[label]["lossy_tensors"].split("/"))
        assert 0 < lossy <= tracked
    assert png.stat().st_size > 0


def test_mixed_formats_of_one_run(run_files, capsys):
    d, paths, states = run_files
    save_safetensors(states[1], d / "ck1.safetensors")
    lcckpt.save(states[2], d / "ck2.lcc", compress=True)
    assert main(["bench", "--checkpoint", paths[0], str(d / "ck1.safetensors"),
                 str(d / "ck2.lcc")]) == 0
    assert "lcckpt default" in capsys.readouterr().out


def test_files_of_different_runs_are_refused(run_files, tmp_path, capsys):
    _, paths, _ = run_files
    other = tmp_path / "other.pt"
    torch.save({"something": torch.randn(10, 10)}, other)
    assert main(["bench", "--checkpoint", paths[0], str(other)]) == 1
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "share no floating tensor" in err


def test_story_puts_the_error_beside_every_lossy_ratio():
    states, (net, x, y) = _run_states(n=3)

    def accuracy(sd):
        net.load_state_dict(sd)
        return float((net(x).argmax(1) == y).float().mean())

    tfiles = [cb._torch_bytes(s) for s in states]
    s = cb.stream(states, tfiles, accuracy=accuracy)
    s.update(every=3)
    text = story(s)
    assert "Verdict" in text and "torch.save" in text
    table = [ln for ln in text.splitlines() if ln.startswith("chain")]
    assert len(table) == len(cb.SETTINGS)
    for ln in table:            # ratio, error, error/step, accuracy, worst drop, speeds
        cells = ln.split()
        assert cells[-7].endswith("x") and float(cells[-6]) >= 0 and float(cells[-5]) >= 0
        assert cells[-4].endswith("%") and cells[-2] == "pt" and "/" in cells[-1]
    assert max(len(ln) for ln in text.splitlines()) <= 100


def test_exact_delta_pieces_are_the_whole_difference(monkeypatch):
    """The zstd-of-the-exact-delta row streams each tensor's difference a piece at a time
    through one buffer: joined, the pieces are the bytes of the whole difference, in the
    tensor's own dtype, and a tensor without a like-shaped previous one goes whole."""
    monkeypatch.setattr(cb, "PIECE", 1000)
    g = torch.Generator().manual_seed(0)
    for dtype in (torch.float32, torch.bfloat16):
        cur, prev = (torch.randn(3, 1234, generator=g).to(dtype) for _ in range(2))
        pieces = [bytes(p) for p in cb._delta_pieces(cur, prev)]
        assert len(pieces) == 4
        assert b"".join(pieces) == bytes(cb._bytes(cur - prev))
    ints = torch.arange(2500)
    assert b"".join(bytes(p) for p in cb._delta_pieces(ints, ints)) == bytes(cb._bytes(ints))
    assert b"".join(bytes(p) for p in cb._delta_pieces(cur, None)) == bytes(cb._bytes(cur))
    assert b"".join(bytes(p) for p in cb._delta_pieces(cur, prev[:, :5])) == bytes(cb._bytes(cur))


def test_the_summary_judges_weights_against_their_steps_and_reports_moments_apart(tmp_path):
    """Adam's first moment is held to 0.8 of its movement by design; the summary used to
    call that "lost most of its change" and advise more bits for the default. It now
    judges the weights, names a lost weight, and reports each moment role beside them."""
    torch.manual_seed(0)
    net = torch.nn.Linear(64, 64)
    opt = torch.optim.Adam(net.parameters(), lr=1e-3)
    paths = []
    for i in range(3):
        net(torch.randn(16, 64)).square().mean().backward()
        opt.step()
        opt.zero_grad()
        paths.append(tmp_path / f"{i}.pt")
        torch.save({"model": net.state_dict(), "optim": opt.state_dict()}, paths[-1])
    out = tmp_path / "s.json"
    assert main(["bench", "--checkpoint", *map(str, paths), "--json", str(out)]) == 0
    s = json.loads(out.read_text())["stream"]
    default = next(r for r in s["rows"] if r["method"] == cb.DEFAULT)
    roles = default["worst_by_role"]
    assert set(roles) == {"weight", "first_moment", "second_moment"}
    assert roles["weight"]["tensor"].startswith("model.")
    assert roles["first_moment"]["tensor"].endswith(".exp_avg")
    assert default["worst_tensor_err_vs_change"] == max(r["err_vs_change"] for r in roles.values())
    line = " ".join(cb.summary_line(s).split())          # unwrapped
    assert "every weight's restored error stays under" in line and "by design" in line
    lost = dict(default, worst_by_role=dict(roles, weight={"err_vs_change": 0.9,
                                                           "tensor": "model.weight"}))
    rows = [lost if r is default else r for r in s["rows"]]
    assert "the weight model.weight lost most of its change" in \
        " ".join(cb.summary_line(dict(s, rows=rows)).split())
    exact = dict(default, err_state=0.0, worst_by_role={"weight": {"err_vs_change": 0.0,
                                                                   "tensor": "model.weight"}})
    line = " ".join(cb.summary_line(dict(s, rows=[exact if r is default else r
                                                  for r in s["rows"]])).split())
    assert "the restored state is exact; every weight is restored exactly." in line


def test_a_mask_of_minus_inf_and_a_nan_buffer_leave_the_errors_finite(tmp_path, capsys):
    """Files whose model holds -inf and NaN by design (a mask buffer, an unset statistic)
    given back as they were: every method's errors are finite, not NaN, and the default's
    within its usual range; sq_dist counts a restored NaN where the truth is finite as
    infinitely wrong."""
    states, _ = _run_states()
    mask = torch.full((64, 64), float("-inf")).triu(1)
    paths = []
    for i, s in enumerate(states):
        paths.append(str(tmp_path / f"m{i}.pt"))
        torch.save({**s, "mask": mask, "unset": torch.full((3000,), float("nan"))}, paths[-1])
    out = tmp_path / "m.json"
    assert main(["bench", "--checkpoint", *paths, "--json", str(out)]) == 0
    assert "nan" not in capsys.readouterr().out
    rows = {r["method"]: r for r in json.loads(out.read_text())["stream"]["rows"]}
    for label, _ in cb.SETTINGS:
        assert math.isfinite(rows[label]["err_state"]), label
    assert rows[cb.DEFAULT]["err_state"] < 0.01
    from lcckpt.bench.norms import sq_dist
    a = np.array([1.0, np.inf, np.nan, -np.inf])
    assert sq_dist(a) == 1.0 and sq_dist(a, a.copy()) == 0.0
    assert sq_dist(a, np.array([1.0, np.inf, 0.0, -np.inf])) == np.inf
    assert sq_dist(a, np.array([3.0, np.inf, np.nan, np.inf])) == np.inf


def test_a_tensor_a_step_left_unchanged_is_not_said_to_have_lost_its_change(tmp_path):
    """A bias frozen after the second file keeps the small error earlier deltas left:
    over its step (zero) that was an infinite error, and the summary said the weight
    "lost most of its change". A step that changed nothing lost nothing at it (the
    error is still in the state's error column)."""
    g = torch.Generator().manual_seed(3)
    w, b = torch.randn(256, 128, generator=g), torch.randn(256, generator=g)
    paths = []
    for i in range(4):
        w = w + 0.01 * torch.randn(w.shape, generator=g)
        if i < 2:
            b = b + 0.01 * torch.randn(b.shape, generator=g)
        paths.append(str(tmp_path / f"{i}.pt"))
        torch.save({"a.weight": w, "a.bias": b}, paths[-1])
    out = tmp_path / "s.json"
    assert main(["bench", "--checkpoint", *paths, "--json", str(out)]) == 0
    s = json.loads(out.read_text())["stream"]
    default = next(r for r in s["rows"] if r["method"] == cb.DEFAULT)
    assert 0 < default["worst_tensor_err_vs_change"] < 0.5
    assert "lost most of its change" not in " ".join(cb.summary_line(s).split())
