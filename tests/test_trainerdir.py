"""A Trainer's checkpoint-N directory as one checkpoint: read_checkpoint, convert, inspect,
verify. Built here as the Trainer lays it out, so these run without transformers."""

import json
import os
import pickle
import random

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

import lcckpt
from lcckpt.cli import main
from lcckpt.errors import CorruptDataError, InvalidArgumentError
from lcckpt.interop import trainerdir
from lcckpt.interop.convert import detect_format, read_checkpoint


class _Boom:
    def __reduce__(self):
        return (os.system, ("touch pwned",))


def _checkpoint(d, step=4):
    """model.safetensors, optimizer.pt, scheduler.pt, rng_state.pth, trainer_state.json,
    and a training_args.bin that would run code if unpickled."""
    d.mkdir(parents=True)
    g = torch.Generator().manual_seed(step)
    w = {"fc.weight": torch.randn(8, 4, generator=g), "fc.bias": torch.randn(8, generator=g)}
    save_file(w, str(d / "model.safetensors"))
    opt = {"state": {0: {"step": torch.tensor(float(step)), "exp_avg": torch.randn(8, 4, generator=g)}},
           "param_groups": [{"lr": 1e-3, "params": [0]}]}
    torch.save(opt, d / "optimizer.pt")
    torch.save({"last_epoch": step, "_last_lr": [1e-3]}, d / "scheduler.pt")
    torch.save({"python": random.getstate(), "numpy": np.random.get_state(),
                "cpu": torch.random.get_rng_state()}, d / "rng_state.pth")
    (d / "trainer_state.json").write_text(json.dumps({"global_step": step, "log_history": []}))
    (d / "training_args.bin").write_bytes(pickle.dumps(_Boom()))
    return w, opt


def test_a_trainer_directory_reads_as_one_checkpoint(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    w, opt = _checkpoint(tmp_path / "checkpoint-4")
    path = str(tmp_path / "checkpoint-4")
    assert detect_format(path) == "trainer" and trainerdir.global_step(path) == 4
    obj, meta, fmt = read_checkpoint(path)
    assert fmt == "trainer" and meta is None
    assert sorted(obj) == ["model", "optimizer", "rng", "scheduler", "trainer_state"]
    assert all(torch.equal(obj["model"][k], v) for k, v in w.items())
    assert torch.equal(obj["optimizer"]["state"][0]["exp_avg"], opt["state"][0]["exp_avg"])
    assert isinstance(obj["rng"]["numpy"][1], np.ndarray)
    assert json.loads(obj["trainer_state"])["global_step"] == 4
    assert not os.path.exists("pwned")                   # training_args.bin never read
    with pytest.raises(InvalidArgumentError, match="Trainer checkpoint directory"):
        read_checkpoint(path, step=4)


def test_convert_inspect_and_verify_take_a_trainer_directory(tmp_path, capsys):
    w, opt = _checkpoint(tmp_path / "checkpoint-4")
    src = str(tmp_path / "checkpoint-4")
    assert main(["convert", src, str(tmp_path / "c.lcc"), "--compress"]) == 0
    back = lcckpt.load(tmp_path / "c.lcc")
    assert all(torch.equal(back["model"][k], v) for k, v in w.items())
    assert main(["convert", src, str(tmp_path / "m.safetensors"), "--key", "model"]) == 0
    capsys.readouterr()
    assert main(["inspect", src, "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["format"] == "trainer" and doc["global_step"] == 4
    assert [r["part"] for r in doc["files"]] == ["model", "optimizer", "scheduler", "rng"]
    assert [r["format"] for r in doc["files"]] == ["safetensors", "torch", "torch", "torch"]
    assert main(["verify", src]) == 0
    assert "OK: 4 of 4 checks passed" in capsys.readouterr().out
    raw = bytearray((tmp_path / "checkpoint-4" / "optimizer.pt").read_bytes())
    at = raw.index(opt["state"][0]["exp_avg"].numpy().tobytes())    # a tensor's bytes
    raw[at + 5] ^= 0xFF
    (tmp_path / "checkpoint-4" / "optimizer.pt").write_bytes(bytes(raw))
    assert main(["verify", src]) == 1
    assert "optimizer.pt" in capsys.readouterr().err


@pytest.mark.parametrize("layout", ["pytorch_model.bin", "model.safetensors.index.json"])
def test_the_weights_in_any_layout_save_pretrained_writes(tmp_path, layout):
    """save_safetensors=False writes pytorch_model.bin; a large model, shards and an index."""
    d = tmp_path / "checkpoint-4"
    w, _ = _checkpoint(d)
    os.remove(d / "model.safetensors")
    if layout == "pytorch_model.bin":
        torch.save(w, d / layout)
    else:
        names = sorted(w)
        for i, name in enumerate(names):
            save_file({name: w[name]}, str(d / f"model-0000{i + 1}-of-00002.safetensors"))
        (d / layout).write_text(json.dumps({"metadata": {}, "weight_map": {
            n: f"model-0000{i + 1}-of-00002.safetensors" for i, n in enumerate(names)}}))
    assert trainerdir.files(str(d))["model"] == str(d / layout)
    got = read_checkpoint(str(d))[0]["model"]
    assert got.keys() == w.keys() and all(torch.equal(got[k], v) for k, v in w.items())
    assert main(["verify", str(d)]) == 0


def test_what_is_not_a_whole_trainer_directory_is_refused(tmp_path):
    d = tmp_path / "checkpoint-2"
    _checkpoint(d, step=2)
    os.remove(d / "model.safetensors")
    with pytest.raises(InvalidArgumentError, match="holds no model weights"):
        read_checkpoint(str(d))
    (d / "trainer_state.json").write_text('{"log_history": []}')
    with pytest.raises(CorruptDataError, match="names no global_step"):
        trainerdir.global_step(str(d))
    (d / "trainer_state.json").write_text('{"global_step": "2"}')
    with pytest.raises(CorruptDataError, match="is not a step number"):
        trainerdir.global_step(str(d))
    os.remove(d / "trainer_state.json")
    assert detect_format(str(d)) == "chain"             # any other directory


def test_bench_takes_trainer_directories_by_their_steps(tmp_path):
    for step in (500, 1000, 1500):
        _checkpoint(tmp_path / f"checkpoint-{step}", step=step)
    names = sorted(str(p) for p in tmp_path.iterdir())          # as a shell's glob lists them
    assert [os.path.basename(p) for p in names] == ["checkpoint-1000", "checkpoint-1500",
                                                    "checkpoint-500"]
    assert [trainerdir.global_step(p) for p in trainerdir.in_step_order(names)] == [500, 1000, 1500]
    mixed = names + [str(tmp_path / "x.pt")]
    assert trainerdir.in_step_order(mixed) == mixed                 # not all directories: as given


def test_a_trainer_output_directory_is_inspected_and_verified_checkpoint_by_checkpoint(
        tmp_path, capsys, monkeypatch):
    """``output_dir`` holding ``checkpoint-N`` directories (and the run's own files):
    one row per checkpoint directory, each verified; training_args.bin is never read."""
    monkeypatch.chdir(tmp_path)
    for step in (4, 8):
        _, opt = _checkpoint(tmp_path / "out" / f"checkpoint-{step}", step)
    (tmp_path / "out" / "training_args.bin").write_bytes(pickle.dumps(_Boom()))
    assert main(["inspect", str(tmp_path / "out"), "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)["entries"]
    assert [(r["name"], r["kind"], r["holds"]) for r in rows] == [
        ("checkpoint-4", "trainer", "step 4, 4 files"),
        ("checkpoint-8", "trainer", "step 8, 4 files")]
    assert main(["verify", str(tmp_path / "out")]) == 0
    assert "OK: 8 of 8 checks passed" in capsys.readouterr().out
    raw = bytearray((tmp_path / "out" / "checkpoint-8" / "optimizer.pt").read_bytes())
    raw[raw.index(opt["state"][0]["exp_avg"].numpy().tobytes()) + 5] ^= 0xFF
    (tmp_path / "out" / "checkpoint-8" / "optimizer.pt").write_bytes(bytes(raw))
    assert main(["verify", str(tmp_path / "out")]) == 1
    assert "checkpoint-8" in capsys.readouterr().err
    assert not os.path.exists("pwned") and not os.path.exists(tmp_path / "pwned")


def test_a_ddp_run_s_directory_reads_every_process_s_generators(tmp_path):
    """Under DDP the Trainer writes rng_state_{i}.pth per process and no rng_state.pth:
    ``rng`` is process 0's, ``rng_ranks`` all of them, by index, up to the first gap."""
    d = tmp_path / "checkpoint-4"
    _checkpoint(d)
    os.remove(d / "rng_state.pth")
    states = [torch.Generator().manual_seed(i).get_state() for i in range(3)]
    for i, g in enumerate(states):
        torch.save({"cpu": g}, d / f"rng_state_{i}.pth")
    torch.save({"cpu": states[0]}, d / "rng_state_4.pth")     # after a gap: not a process
    obj, _, _ = read_checkpoint(str(d))
    assert torch.equal(obj["rng"]["cpu"], states[0])
    assert sorted(obj["rng_ranks"]) == ["0", "1", "2"]
    assert all(torch.equal(obj["rng_ranks"][str(i)]["cpu"], g) for i, g in enumerate(states))
    os.remove(d / "rng_state_0.pth")
    assert "rng_ranks" not in read_checkpoint(str(d))[0]
