"""The command line: inspect and verify on files and chains, exit codes, JSON."""

import os
import json
import warnings

import pytest
import torch

import lcckpt
from lcckpt.chain.policy import DEFAULT_POLICY
from lcckpt.cli import main


@pytest.fixture()
def chain_dir(tmp_path):
    ck = lcckpt.DeltaCheckpointer(tmp_path / "ck", keyframe_every=3)
    w = torch.randn(5000)
    for s in range(5):
        w = w + 0.01 * torch.randn(5000)
        ck.save(s, {"w": w.clone(), "step": s})
    return tmp_path / "ck"


def test_inspect_chain_json(chain_dir, capsys):
    assert main(["inspect", str(chain_dir), "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert [r["step"] for r in doc["steps"]] == [0, 1, 2, 3, 4]
    assert [r["kind"] for r in doc["steps"]] == ["keyframe", "delta", "delta", "keyframe", "delta"]
    key = doc["steps"][0]["ratio"]
    # a random walk's first deltas after a keyframe are held to 5% of their update (more
    # than 0.3% of a step or two of movement): files of 5,000 elements smaller than the
    # keyframe's, each tensor within its target and none missed
    assert all(r["ratio"] > 1.3 * key for r in doc["steps"] if r["kind"] == "delta")
    assert all(0 < r["w_err/move"] <= DEFAULT_POLICY.update and r["missed"] == 0
               for r in doc["steps"] if r["kind"] == "delta")


def test_inspect_chain_table_has_a_legend(chain_dir, capsys):
    assert main(["inspect", str(chain_dir)]) == 0
    out = capsys.readouterr().out
    assert "w_err/move" in out and "as a share of their movement since the keyframe" in out


def test_inspect_counts_the_tensors_a_delta_stored_exactly(tmp_path, capsys):
    """A NaN step and the step after it store the tensor exactly: inspect says how many,
    and its legend where to read why; steps without one show no count."""
    ck = lcckpt.DeltaCheckpointer(tmp_path / "ck")
    w = torch.linspace(-1, 1, 5000)
    with pytest.warns(RuntimeWarning, match="NaN"):
        for s in range(4):
            x = w + 0.01 * s
            if s == 2:
                x[3] = float("nan")
            ck.save(s, {"w": x, "b": 2 * w + 0.01 * s})
    assert main(["inspect", str(tmp_path / "ck"), "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)["steps"]
    assert [r.get("stored_exact") for r in rows] == [None, None, 1, 1]
    assert main(["inspect", str(tmp_path / "ck")]) == 0
    assert "stored_exact: tensors of a delta stored exactly instead" in capsys.readouterr().out


def test_inspect_file_table(tmp_path, capsys):
    lcckpt.save({"a": torch.randn(1000), "n": 3}, tmp_path / "x.lcc", compress=True)
    assert main(["inspect", str(tmp_path / "x.lcc")]) == 0
    out = capsys.readouterr().out
    assert "lossless" in out and "[1000]" in out


def test_inspect_torch_file(tmp_path, capsys):
    torch.save({"a": torch.randn(3)}, tmp_path / "t.pt")
    assert main(["inspect", str(tmp_path / "t.pt")]) == 0
    assert "torch.save" in capsys.readouterr().out


def test_inspect_counts_a_torch_files_shared_storage_once(tmp_path, capsys):
    """Tied weights (one tensor under two names) and views are one storage in the file:
    ``raw_bytes`` counts it once, as torch.save stores it."""
    w = torch.randn(100, 10)
    torch.save({"emb": w, "head": w, "rows": w[:5], "b": torch.zeros(7)}, tmp_path / "t.pt")
    assert main(["inspect", "--json", str(tmp_path / "t.pt")]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["raw_bytes"] == 4000 + 28 and doc["tensor_count"] == 4
    odd = {"sparse": torch.eye(3).to_sparse(), "csr": torch.eye(3).to_sparse_csr(),
           "meta": torch.empty(5, device="meta"), "w": torch.ones(2)}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")          # torch's beta notes on sparse layouts
        torch.save(odd, tmp_path / "odd.pt")
        assert main(["inspect", "--json", str(tmp_path / "odd.pt")]) == 0
    assert json.loads(capsys.readouterr().out)["tensor_count"] >= 3


def test_verify_passes_then_fails_on_damage(chain_dir, capsys):
    assert main(["verify", str(chain_dir)]) == 0
    assert "OK" in capsys.readouterr().out
    victim = chain_dir / "step-000000000002.lcc"
    data = bytearray(victim.read_bytes())
    data[-3] ^= 0x10
    victim.write_bytes(bytes(data))
    assert main(["verify", str(chain_dir), "--json"]) == 1
    doc = json.loads(capsys.readouterr().out)
    assert not doc["ok"] and any(r["step"] == 2 and not r["ok"] for r in doc["report"])


def test_verify_detects_missing_link(chain_dir, capsys):
    (chain_dir / "step-000000000001.lcc").unlink()
    assert main(["verify", str(chain_dir)]) == 1
    assert "FAILED" in capsys.readouterr().out


def test_verify_single_file(tmp_path, capsys):
    p = tmp_path / "x.lcc"
    lcckpt.save({"a": torch.randn(100)}, p)
    assert main(["verify", str(p)]) == 0
    p.write_bytes(p.read_bytes()[:-7])
    assert main(["verify", str(p)]) == 1


def test_rollback_sets_the_later_steps_aside(chain_dir, capsys):
    """``lcckpt rollback DIR STEP``: an unknown step and a directory a writer holds are
    refused (exit 1, nothing renamed); then the later steps are set aside."""
    assert main(["rollback", str(chain_dir), "9"]) == 1
    assert "holds steps [0, 1, 2, 3, 4]" in capsys.readouterr().err
    with lcckpt.DeltaCheckpointer(chain_dir) as ck:
        ck.save(5, {"w": torch.zeros(5000), "step": 5})          # holds the writer's lock
        assert main(["rollback", str(chain_dir), "1"]) == 1
        assert ck.steps() == [0, 1, 2, 3, 4, 5]
    assert main(["rollback", str(chain_dir), "1"]) == 0
    assert "set aside as *.rolledback: 2, 3, 4, 5; the next save goes on from step 1" \
        in capsys.readouterr().out
    assert lcckpt.DeltaCheckpointer(chain_dir).steps() == [0, 1]


def test_missing_path_is_usage_error(tmp_path, capsys):
    assert main(["verify", str(tmp_path / "nope")]) == 2
    assert "no such file" in capsys.readouterr().err


def test_bench_help():
    with pytest.raises(SystemExit) as e:
        main(["bench", "--help"])
    assert e.value.code == 0


# --- bad input, through main(argv): one line on stderr, non-zero exit, no traceback -------


class NotAllowed:
    """Unpickling this needs arbitrary code: torch's weights-only loader refuses it."""


@pytest.fixture()
def files(tmp_path, chain_dir):
    """name -> path of every kind of bad or foreign input."""
    text = tmp_path / "notes.txt"
    text.write_text("hello, these are notes\n")
    empty = tmp_path / "empty.lcc"
    empty.write_bytes(b"")
    good = tmp_path / "good.lcc"
    lcckpt.save({"a": torch.randn(300)}, good)
    trunc = tmp_path / "trunc.lcc"
    trunc.write_bytes(good.read_bytes()[:-20])
    pt = tmp_path / "good.pt"
    torch.save({"a": torch.randn(300)}, pt)
    trunc_pt = tmp_path / "trunc.pt"
    trunc_pt.write_bytes(pt.read_bytes()[:200])
    unsafe = tmp_path / "unsafe.pt"
    torch.save({"a": torch.ones(2), "obj": NotAllowed()}, unsafe)
    st = tmp_path / "good.safetensors"
    from lcckpt.format.safetensors_io import save_safetensors
    save_safetensors({"a": torch.randn(300)}, st)
    trunc_st = tmp_path / "trunc.safetensors"
    trunc_st.write_bytes(st.read_bytes()[:-8])
    empty_dir = tmp_path / "emptydir"
    empty_dir.mkdir()
    text_dir = tmp_path / "textdir"
    text_dir.mkdir()
    (text_dir / "readme.txt").write_text("no checkpoints here")
    damaged = tmp_path / "damaged"
    import shutil
    shutil.copytree(chain_dir, damaged)
    victim = damaged / "step-000000000000.lcc"
    victim.write_bytes(victim.read_bytes()[:100])
    return {"text": text, "empty": empty, "trunc": trunc, "trunc_pt": trunc_pt,
            "unsafe": unsafe, "trunc_st": trunc_st, "empty_dir": empty_dir,
            "text_dir": text_dir, "damaged_chain": damaged, "missing": tmp_path / "nope.lcc"}


def _one_line_error(capsys, rc, expect_rc=None):
    err = capsys.readouterr().err
    assert rc != 0 if expect_rc is None else rc == expect_rc
    assert "Traceback" not in err
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert len(lines) == 1, err
    return lines[0]


BAD = ["text", "empty", "trunc", "trunc_pt", "unsafe", "trunc_st", "empty_dir", "text_dir",
       "missing"]


@pytest.mark.parametrize("kind", BAD + ["damaged_chain"])
@pytest.mark.parametrize("command", ["inspect", "verify"])
def test_bad_input_is_one_line(files, capsys, command, kind):
    rc = main([command, str(files[kind])])
    if kind == "damaged_chain" and command == "inspect":
        err = capsys.readouterr().err        # a row per step, then what is wrong
        assert rc == 1 and "Traceback" not in err and "step 0" in err
        return
    line = _one_line_error(capsys, rc)
    assert line.startswith(f"lcckpt {command}: ")


@pytest.mark.parametrize("kind", BAD)
def test_convert_bad_input_is_one_line(files, tmp_path, capsys, kind):
    out = tmp_path / "out.lcc"
    line = _one_line_error(capsys, main(["convert", str(files[kind]), str(out)]))
    assert line.startswith("lcckpt convert: ")
    assert not out.exists()


@pytest.mark.parametrize("kind", ["text", "empty", "unsafe", "missing"])
def test_bench_bad_checkpoint_is_one_line(files, capsys, kind):
    line = _one_line_error(capsys, main(["bench", "--checkpoint", str(files[kind])]))
    assert line.startswith("lcckpt bench: ")


def test_unsafe_torch_file_is_refused_not_run(files, tmp_path, capsys):
    out = tmp_path / "x.lcc"
    line = _one_line_error(capsys, main(["convert", str(files["unsafe"]), str(out)]), 1)
    assert "arbitrary code" in line and "NotAllowed" in line


def test_empty_or_foreign_directory_fails_verify(files, capsys):
    for kind in ("empty_dir", "text_dir"):
        line = _one_line_error(capsys, main(["verify", str(files[kind])]), 1)
        assert "no checkpoints" in line


def test_inspect_warns_when_keyframe_is_gone(chain_dir, capsys):
    (chain_dir / "step-000000000000.lcc").unlink()
    assert main(["inspect", str(chain_dir), "--json"]) == 1
    out = capsys.readouterr()
    doc = json.loads(out.out)
    assert [r["restorable"] for r in doc["steps"]] == [False, False, True, True]
    assert "step 1 is a delta on step 0, which is missing" in out.err
    assert "2 of 4 steps cannot be restored (1, 2)" in out.err


@pytest.mark.parametrize("argv", [["inspect", "x", "--jsn"], ["verify"], ["convert", "a"],
                                  ["bench", "--bits", "7"], ["bench", "--frobnicate"],
                                  ["convert", "a", "b", "--to", "zip"], []])
def test_bad_arguments_exit_2_with_the_subcommand_usage(argv, capsys):
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and "error:" in err
    if argv:
        assert f"usage: lcckpt {argv[0]}" in err


def test_error_bound_out_of_range(tmp_path, capsys):
    p = tmp_path / "a.pt"
    torch.save({"w": torch.randn(10)}, p)
    line = _one_line_error(capsys, main(["bench", "--checkpoint", str(p), "--error-bound", "2"]))
    assert "--error-bound" in line


def test_version(capsys):
    with pytest.raises(SystemExit) as e:
        main(["--version"])
    assert e.value.code == 0
    assert capsys.readouterr().out.strip() == f"lcckpt {lcckpt.__version__}"


def test_inspect_and_verify_safetensors(tmp_path, capsys):
    from lcckpt.format.safetensors_io import save_safetensors
    p = tmp_path / "m.safetensors"
    save_safetensors({"w": torch.randn(4, 5), "b": torch.zeros(5)}, p, metadata={"format": "pt"})
    assert main(["inspect", str(p), "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["format"] == "safetensors" and doc["metadata"] == {"format": "pt"}
    assert {t["name"]: t["shape"] for t in doc["tensors"]} == {"w": [4, 5], "b": [5]}
    assert main(["verify", str(p)]) == 0


def test_bench_suites_are_reached_through_bench(capsys):
    from lcckpt.cli import SUITES
    for name in SUITES:
        with pytest.raises(SystemExit) as e:
            main(["bench", name, "--help"])
        assert e.value.code == 0
        assert "usage" in capsys.readouterr().out


def test_inspect_names_uniform_deltas(tmp_path, capsys):
    import torch
    ck = lcckpt.DeltaCheckpointer(tmp_path / "run", min_delta_elements=64)   # default targets
    w = torch.randn(200, 50)
    ck.save(0, {"w": w})
    ck.save(1, {"w": w + 0.01 * torch.randn_like(w)})
    ck.close()
    assert main(["inspect", str(ck.path(1)), "--json"]) == 0
    assert '"uniform delta"' in capsys.readouterr().out
    assert main(["inspect", str(tmp_path / "run"), "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)["steps"]
    got = rows[1]["max_rel_error"]                   # the restored error the file reports
    assert 0 < got <= 0.01 and got == ck.info(1)["tensors"]['obj["w"]']["rel_error"]


def test_max_bytes_on_every_reading_command(tmp_path, capsys):
    """--max-bytes sets the limit of every load a command makes: a small one refuses, a
    large one or 'none' lets the same files through."""
    torch.save({"w": torch.zeros(50_000)}, tmp_path / "a.pt")
    ck = lcckpt.DeltaCheckpointer(tmp_path / "ck")
    ck.save(0, {"w": torch.randn(50_000)})
    ck.save(1, {"w": torch.randn(50_000)})
    for cmd in (["verify", str(tmp_path / "ck")], ["verify", str(tmp_path / "a.pt")],
                ["convert", str(tmp_path / "a.pt"), str(tmp_path / "b.lcc")]):
        assert main(cmd + ["--max-bytes", "1000"]) == 1, cmd
        assert "max_bytes" in capsys.readouterr().err
        assert main(cmd + ["--max-bytes", "1G"]) == 0, cmd
        assert main(cmd + ["--max-bytes", "none"]) == 0, cmd
    with pytest.raises(SystemExit):
        main(["verify", str(tmp_path / "ck"), "--max-bytes", "lots"])
    assert lcckpt.limits.get_max_bytes() == "auto"          # restored after the command


def test_a_closed_pipe_ends_quietly(tmp_path):
    """``lcckpt inspect BIG | head -1``: the reader goes away, the command stops without an
    error line (exit status 141, as for SIGPIPE)."""
    import subprocess
    import sys
    path = tmp_path / "many.lcc"
    lcckpt.save({f"t{i}": torch.zeros(2) for i in range(3000)}, path)
    p = subprocess.Popen([sys.executable, "-m", "lcckpt", "inspect", str(path)],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    p.stdout.readline()
    p.stdout.close()                            # before the table is written
    err = p.stderr.read().decode()
    assert p.wait(timeout=120) == 141 and err == ""


def test_inspect_counts_a_miss_only_beyond_the_stats_rounding():
    """Stats are stored to 4 significant digits, so the error/movement ratio a reader
    derives can land a hair past the target the writer met (0.8601 / 1.075 = 0.80009
    against 0.8, a first moment's share, as a real MiniLM chain stored it)."""
    from lcckpt.interop.steprows import movement_columns as _movement_columns
    key = 'obj["optim"]["state"][4]["exp_avg"]'
    met = {key: {"target": 0.8, "error_vs_movement": 0.8001}}
    assert _movement_columns(met)["missed"] == 0
    past = {key: {"target": 0.8, "error_vs_movement": 0.81}}
    assert _movement_columns(past)["missed"] == 1
    half = {'obj["w"]': {"target": 0.05, "error_vs_movement": 0.6}}   # past half the movement
    assert _movement_columns(half)["missed"] == 1


@pytest.mark.parametrize("header", [True, False])
def test_a_file_pointing_at_a_chain_step_is_inspected_and_verified_with_its_step(
        chain_dir, tmp_path, capsys, header):
    """A file that holds a chain step's place (``LcckptCheckpointIO(chain=...)``'s):
    inspect names the step and the chain; verify checks the files its restore reads and
    fails when one is damaged or gone, and when the chain does not hold the step. Also a
    file written before headers named the step (``header=False``): found by loading it."""
    from lcckpt.chain.pointer import POINTER

    def metadata(state):
        from lcckpt.chain.pointer import metadata
        return metadata(state) if header else None
    state = {"loops": {"at": 4}, POINTER: {"chain": "ck", "step": 4}}
    lcckpt.save(state, tmp_path / "last.ckpt", metadata=metadata(state))
    assert main(["inspect", str(tmp_path / "last.ckpt"), "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["points_at"] == {"chain": str(chain_dir), "step": 4}
    assert main(["inspect", str(tmp_path / "last.ckpt")]) == 0
    assert f"step 4 of the chain in {chain_dir}" in capsys.readouterr().out
    assert main(["verify", str(tmp_path / "last.ckpt")]) == 0
    capsys.readouterr()
    keyframe = chain_dir / "step-000000000003.lcc"        # step 4's base, a keyframe
    data = bytearray(keyframe.read_bytes())
    data[-10] ^= 0xFF
    keyframe.write_bytes(bytes(data))
    assert main(["verify", str(tmp_path / "last.ckpt")]) == 1
    assert "step-000000000003.lcc" in capsys.readouterr().err
    keyframe.unlink()
    assert main(["verify", str(tmp_path / "last.ckpt")]) == 1
    capsys.readouterr()
    gone = {**state, POINTER: {"chain": "ck", "step": 9}}
    lcckpt.save(gone, tmp_path / "gone.ckpt", metadata=metadata(gone))
    assert main(["inspect", str(tmp_path / "gone.ckpt")]) == 1
    assert "which does not hold it" in capsys.readouterr().err
    assert main(["verify", str(tmp_path / "gone.ckpt")]) == 1
    assert "which does not hold it" in capsys.readouterr().err


def test_a_directory_of_checkpoints_is_inspected_and_verified_entry_by_entry(
        chain_dir, tmp_path, capsys):
    """A run's output directory (files of several formats, a chain, a file pointing at
    one of its steps, a stray text file): inspect gives one row per checkpoint, verify
    checks each; a damaged file fails both, naming it; a directory with none is an
    error as before."""
    from lcckpt.chain.pointer import POINTER, metadata
    state = {"loops": {"at": 4}, POINTER: {"chain": "ck", "step": 4}}
    lcckpt.save(state, tmp_path / "last.ckpt", metadata=metadata(state))
    torch.save({"w": torch.randn(3)}, tmp_path / "old.pt")
    lcckpt.save_safetensors({"w": torch.randn(3)}, tmp_path / "w.safetensors")
    lcckpt.save({"a": torch.randn(10), "b": torch.randn(4)}, tmp_path / "x.lcc")
    (tmp_path / "notes.txt").write_text("not a checkpoint")
    assert main(["inspect", str(tmp_path), "--json"]) == 0
    rows = {r["name"]: r for r in json.loads(capsys.readouterr().out)["entries"]}
    assert sorted(rows) == ["ck", "last.ckpt", "old.pt", "w.safetensors", "x.lcc"]
    assert rows["ck"]["holds"] == "5 steps, 0 to 4"
    from lcckpt.interop.folder import row
    assert row("one", "chain", {"steps": [{"step": 7, "file_bytes": 9}]})["holds"] == "step 7"
    assert rows["last.ckpt"]["holds"].startswith("its state at step 4 of")
    assert rows["x.lcc"]["holds"] == "2 tensors" and rows["old.pt"]["holds"] == "1 tensor"
    assert main(["inspect", str(tmp_path)]) == 0
    assert "5 checkpoints" in capsys.readouterr().out
    assert main(["verify", str(tmp_path), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)["report"]
    assert len(report) == 4 + 5 and all(r["ok"] for r in report)   # four files, five steps
    data = bytearray((tmp_path / "x.lcc").read_bytes())
    data[-3] ^= 0xFF
    (tmp_path / "x.lcc").write_bytes(bytes(data))
    assert main(["verify", str(tmp_path)]) == 1
    assert "x.lcc" in capsys.readouterr().err
    (tmp_path / "x.lcc").write_bytes(b"LCCKPT" + bytes(10))       # a header cut short
    assert main(["inspect", str(tmp_path)]) == 1
    assert "x.lcc" in capsys.readouterr().err
    (tmp_path / "x.lcc").unlink()
    (tmp_path / "cut.pt").write_bytes(b"")                        # named like one: named
    assert main(["verify", str(tmp_path)]) == 1
    assert "cut.pt" in capsys.readouterr().err
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "notes.txt").write_text("x")
    assert main(["inspect", str(empty)]) == 1
    assert "holds no checkpoints" in capsys.readouterr().err


def test_a_directory_of_checkpoint_files_one_level_down_is_a_folder_entry(tmp_path, capsys):
    """Accelerate's ``save_state`` writes a directory of files (``checkpoint_0``: weights,
    optimizer, scheduler, generators): a run's directory lists it as one entry, and
    verify checks every file in it; convert of it names the files it could convert."""
    run = tmp_path / "run"
    ck = run / "checkpoint_0"
    ck.mkdir(parents=True)
    lcckpt.save_safetensors({"w": torch.randn(3)}, ck / "model.safetensors")
    torch.save({"state": {0: {"step": torch.tensor(1.0)}}}, ck / "optimizer.bin")
    torch.save({"last_epoch": 1}, ck / "scheduler.bin")
    (run / "logs").mkdir()
    (run / "logs" / "events.txt").write_text("not a checkpoint")
    assert main(["inspect", str(run), "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)["entries"]
    assert [(r["name"], r["kind"], r["holds"]) for r in rows] == [
        ("checkpoint_0", "folder", "3 checkpoints")]
    assert rows[0]["file_bytes"] == sum(f.stat().st_size for f in ck.iterdir())
    assert main(["inspect", str(run)]) == 0
    assert f"{run}: 1 checkpoint\n" in capsys.readouterr().out
    assert main(["verify", str(run), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)["report"]
    assert sorted(os.path.basename(r["path"]) for r in report) == [
        "model.safetensors", "optimizer.bin", "scheduler.bin"]
    (ck / "optimizer.bin").write_bytes((ck / "optimizer.bin").read_bytes()[:-30])
    assert main(["verify", str(run)]) == 1
    assert "optimizer.bin" in capsys.readouterr().err
    assert main(["convert", str(ck), str(tmp_path / "x.lcc")]) == 1
    assert "(model.safetensors, optimizer.bin, scheduler.bin): give one of them" in \
        capsys.readouterr().err
    assert main(["convert", str(ck / "scheduler.bin"), str(tmp_path / "s.lcc")]) == 0
    assert "0 tensors, exact" in capsys.readouterr().out


def test_convert_of_a_chain_step_says_whether_it_restores_exactly(chain_dir, tmp_path, capsys):
    """A delta's step is written as the chain restores it, not as saved: the line said
    "exact" of every conversion."""
    ck = lcckpt.DeltaCheckpointer(chain_dir)
    kinds = {s: ck.info(s)["kind"] for s in ck.steps()}
    delta = max(s for s, k in kinds.items() if k == "delta")
    assert main(["convert", str(chain_dir), str(tmp_path / "d.pt"), "--step", str(delta)]) == 0
    out = capsys.readouterr().out
    assert f"step {delta} as the chain restores it" in out and "exact" not in out
    assert main(["convert", str(chain_dir), str(tmp_path / "k.pt"), "--step", "0"]) == 0
    assert capsys.readouterr().out.rstrip().endswith("exact") and kinds[0] == "keyframe"
    assert main(["convert", str(chain_dir), str(tmp_path / "n.pt"), "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert (doc["step"], doc["step_kind"]) == (ck.steps()[-1], kinds[ck.steps()[-1]])


def test_convert_writes_the_whole_checkpoint_a_file_of_a_chain_step_stands_for(
        chain_dir, tmp_path, capsys):
    """``lcckpt convert`` of a file that holds a chain step's place writes the state the
    step restores, beside the file's own values, without the pointer."""
    from lcckpt.chain.pointer import POINTER, metadata
    state = {"loops": {"at": 4}, POINTER: {"chain": "ck", "step": 4}}
    lcckpt.save(state, tmp_path / "last.ckpt", metadata=metadata(state))
    assert main(["convert", str(tmp_path / "last.ckpt"), str(tmp_path / "last.pt")]) == 0
    out = torch.load(tmp_path / "last.pt", weights_only=True)
    want = lcckpt.DeltaCheckpointer(chain_dir).load(4)
    assert sorted(out) == ["loops", "step", "w"] and out["loops"] == {"at": 4}
    assert torch.equal(out["w"], want["w"]) and out["step"] == 4
    gone = {**state, POINTER: {"chain": "ck", "step": 9}}
    lcckpt.save(gone, tmp_path / "gone.ckpt", metadata=metadata(gone))
    assert main(["convert", str(tmp_path / "gone.ckpt"), str(tmp_path / "gone.pt")]) == 1
    assert "does not hold it" in capsys.readouterr().err


def test_a_torchscript_archive_is_named_once_with_its_path(tmp_path, capsys):
    path = tmp_path / "scripted.pt"
    torch.jit.save(torch.jit.script(torch.nn.Linear(3, 2)), path)
    for argv in (["verify", str(path)], ["convert", str(path), str(tmp_path / "o.lcc")],
                 ["inspect", str(path)]):
        line = _one_line_error(capsys, main(argv), 1)
        assert "TorchScript archive" in line and "torch.jit.load" in line, line
        assert line.count(str(path)) == 1, line


def test_inspect_maps_a_torch_zip_instead_of_reading_it(tmp_path, capsys, monkeypatch):
    from lcckpt.interop import convert as convert_mod
    state = {"w": torch.randn(64, 64), "b": torch.ones(3)}
    torch.save(state, tmp_path / "z.pt")
    torch.save(state, tmp_path / "old.pt", _use_new_zipfile_serialization=False)
    asked = []
    real = convert_mod.serialization.load

    def spy(path, *a, **kw):
        asked.append(kw.get("mmap"))
        return real(path, *a, **kw)
    monkeypatch.setattr(convert_mod.serialization, "load", spy)
    for name in ("z.pt", "old.pt"):
        assert main(["inspect", str(tmp_path / name), "--json"]) == 0
        doc = json.loads(capsys.readouterr().out)
        assert doc["tensor_count"] == 2 and doc["raw_bytes"] == 64 * 64 * 4 + 12
    assert asked == [True, False]              # the legacy format cannot be mapped


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="needs FIFOs")
@pytest.mark.parametrize("command", [["inspect"], ["verify"], ["convert", "OUT"],
                                     ["bench", "--checkpoint"]])
def test_a_pipe_given_as_a_file_is_refused_by_name(tmp_path, capsys, command):
    """``cat a.pt | lcckpt convert /dev/stdin b.lcc``: the commands read their files at
    any offset, and more than once; a pipe failed with "Illegal seek", or was called
    "not a safetensors file: 0 bytes". It is refused before anything is read."""
    pipe = tmp_path / "pipe"
    os.mkfifo(pipe)
    argv = [command[0], *command[1:-1]] if command[-1] == "OUT" else list(command)
    argv = argv + [str(pipe)] + ([str(tmp_path / "out.lcc")] if command[-1] == "OUT" else [])
    import threading
    out = []
    run = threading.Thread(target=lambda: out.append(main(argv)), daemon=True)
    run.start()                                 # opening a pipe with no writer blocks
    run.join(60)
    assert out == [2], "refused at once" if out else "it opened the pipe and waited"
    assert "is a pipe or a device: write it to a file first" in capsys.readouterr().err
    assert not (tmp_path / "out.lcc").exists()
