"""Shard indexes as Hugging Face writes them (``model.safetensors.index.json``,
``pytorch_model.bin.index.json``): loaded, converted, inspected and verified as one
checkpoint, and refused by name where an index points outside its directory."""

import json

import pytest
import torch
from safetensors.torch import save_file

import lcckpt
from lcckpt.cli import main
from lcckpt.errors import CorruptDataError, InvalidArgumentError, NotFoundError
from lcckpt.format.safetensors_io import read_safetensors

from helpers import same_bits


def _sharded(d, torch_shards=False):
    """A model's state_dict in two shards and their index; the state_dict."""
    torch.manual_seed(0)
    sd = {"embed.weight": torch.randn(10, 4), "l0.weight": torch.randn(4, 4),
          "l0.bias": torch.randn(4), "head.weight": torch.randn(3, 4).to(torch.bfloat16)}
    names = list(sd)
    ext = "bin" if torch_shards else "safetensors"
    files = [f"model-0000{i}-of-00002.{ext}" for i in (1, 2)]
    parts = [{k: sd[k] for k in names[:2]}, {k: sd[k] for k in names[2:]}]
    for f, part in zip(files, parts):
        if torch_shards:
            torch.save(part, d / f)
        else:
            save_file(part, d / f, metadata={"format": "pt"})
    index = d / f"{'pytorch_model.bin' if torch_shards else 'model.safetensors'}.index.json"
    weight_map = {k: files[0] if k in parts[0] else files[1] for k in sorted(names)}
    index.write_text(json.dumps({"metadata": {"total_size": 0}, "weight_map": weight_map}))
    return index, sd, weight_map


@pytest.mark.parametrize("torch_shards", [False, True])
def test_an_index_loads_and_converts_as_one_checkpoint(tmp_path, torch_shards, capsys):
    index, sd, weight_map = _sharded(tmp_path, torch_shards)
    got = lcckpt.load(index)
    assert list(got) == list(weight_map)                      # the index's order
    assert all(same_bits(got[k], sd[k]) for k in sd)
    assert main(["convert", str(index), str(tmp_path / "all.lcc"), "--compress"]) == 0
    assert all(same_bits(lcckpt.load(tmp_path / "all.lcc")[k], sd[k]) for k in sd)
    assert main(["convert", str(index), str(tmp_path / "all.safetensors")]) == 0
    tensors, meta = read_safetensors(tmp_path / "all.safetensors")
    assert all(same_bits(tensors[k], sd[k]) for k in sd)
    assert meta == (None if torch_shards else {"format": "pt"})  # the shards' own, kept
    capsys.readouterr()
    assert main(["inspect", str(index)]) == 0
    assert "4 tensors in 2 files" in capsys.readouterr().out
    assert main(["verify", str(index)]) == 0
    with pytest.raises(InvalidArgumentError, match="is a shard index"):
        lcckpt.convert(index, tmp_path / "x.pt", step=3)
    targets = {k: torch.zeros_like(v) for k, v in sd.items()}
    lcckpt.load(index, into=targets)
    assert all(same_bits(targets[k], sd[k]) for k in sd)


def test_a_missing_shard_fails_by_name(tmp_path, capsys):
    index, _, weight_map = _sharded(tmp_path)
    (tmp_path / weight_map["l0.bias"]).unlink()
    with pytest.raises(NotFoundError, match="a shard the index"):
        lcckpt.load(index)
    assert main(["verify", str(index)]) == 1
    assert "model-00002-of-00002.safetensors" in capsys.readouterr().err


@pytest.mark.parametrize("edit", [
    lambda w: {**w, "l0.bias": "../elsewhere.safetensors"},
    lambda w: {**w, "l0.bias": "/etc/passwd"},
    lambda w: {**w, "l0.bias": "model.safetensors.index.json"},     # itself: no recursion
    lambda w: {**w, "l0.bias": 3},
    lambda w: {**w, "not.there": w["l0.bias"]},
    lambda w: [],
])  # fmt: skip
def test_an_index_that_points_astray_is_refused(tmp_path, edit):
    index, _, weight_map = _sharded(tmp_path)
    index.write_text(json.dumps({"weight_map": edit(weight_map)}))
    with pytest.raises(CorruptDataError):
        lcckpt.load(index)


def test_an_index_with_a_key_twice_is_refused(tmp_path):
    index, _, weight_map = _sharded(tmp_path)
    shard = weight_map["l0.bias"]
    index.write_text('{"weight_map": {"l0.bias": "%s", "l0.bias": "%s"}}' % (shard, shard))
    with pytest.raises(CorruptDataError, match="twice"):
        lcckpt.load(index)
