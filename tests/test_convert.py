"""lcckpt convert: bit-exact round trips between torch.save, safetensors and lcckpt files,
and the refusals where a format cannot hold what the input holds."""

import json
import os
import tempfile
from collections import Counter, OrderedDict

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import lcckpt
from lcckpt.cli import main
from lcckpt.interop.convert import convert, detect_format, read_checkpoint
from lcckpt.errors import InvalidArgumentError, UnsafeObjectError
from lcckpt.format.safetensors_io import read_safetensors, save_safetensors

from helpers import assert_same, metadata, same_bits, tensor_dicts


def _same(a, b) -> bool:
    """Equal trees; tensors equal bit for bit, in dtype and shape."""
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and same_bits(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and list(a) == list(b) and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(map(_same, a, b))
    return type(a) is type(b) and a == b


def _training_state():
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 3))
    opt = torch.optim.Adam(net.parameters())
    net(torch.randn(4, 8)).sum().backward()
    opt.step()
    return {"model": net.state_dict(), "optimizer": opt.state_dict(), "epoch": 3,
            "lr": 1e-3, "name": "run-1", "flags": [True, None],
            "half": torch.randn(5).to(torch.bfloat16), "nan": torch.tensor([float("nan"), -0.0])}


@pytest.mark.parametrize("compress", [False, True])
def test_torch_to_lcckpt_to_torch_is_exact(tmp_path, compress):
    state = _training_state()
    pt = tmp_path / "a.pt"
    torch.save(state, pt)
    argv = ["convert", str(pt), str(tmp_path / "a.lcc")] + (["--compress"] if compress else [])
    assert main(argv) == 0
    assert main(["convert", str(tmp_path / "a.lcc"), str(tmp_path / "b.pt")]) == 0
    back = torch.load(tmp_path / "b.pt", weights_only=True)
    assert _same(back, torch.load(pt, weights_only=True))
    assert _same(lcckpt.load(tmp_path / "a.lcc"), back)
    assert isinstance(back["model"], OrderedDict)


@pytest.mark.filterwarnings("ignore:Sparse CSR tensor support is in beta")
def test_what_torch_opens_without_code_converts_both_ways(tmp_path):
    """Sets, complex numbers, Counters, bytearrays and sparse tensors: torch.load's
    weights-only unpickler opens them, so convert takes them, and gives them back."""
    d = torch.arange(12.0).reshape(3, 4) * (torch.arange(12).reshape(3, 4) % 2)
    state = {"model": _training_state()["model"], "seen": {1, "a", (2, None)},
             "ratio": 1 - 2j, "counts": Counter(cat=3, dog=1), "buf": bytearray(b"\x01\x02"),
             "adj": d.to_sparse(), "csr": d.to_sparse_csr()}
    torch.save(state, tmp_path / "a.pt")
    convert(tmp_path / "a.pt", tmp_path / "b.lcckpt")
    convert(tmp_path / "b.lcckpt", tmp_path / "c.pt")
    for back in (lcckpt.load(tmp_path / "b.lcckpt"), torch.load(tmp_path / "c.pt", weights_only=True)):
        assert_same(state, back)


def test_safetensors_round_trips_byte_for_byte(tmp_path):
    tensors = {"w": torch.randn(6, 4), "b": torch.zeros(4, dtype=torch.float16),
               "ids": torch.arange(7), "mask": torch.tensor([True, False]),
               "bf": torch.randn(3).to(torch.bfloat16)}
    src = tmp_path / "m.safetensors"
    save_safetensors(tensors, src, metadata={"format": "pt", "note": "ünïcode"})
    for compress in ([], ["--compress"]):
        assert main(["convert", str(src), str(tmp_path / "m.lcc"), *compress]) == 0
        assert main(["convert", str(tmp_path / "m.lcc"), str(tmp_path / "n.safetensors")]) == 0
        assert (tmp_path / "n.safetensors").read_bytes() == src.read_bytes()
    # through torch.save the tensors survive; the metadata cannot and is reported
    assert main(["convert", str(src), str(tmp_path / "m.pt")]) == 0
    assert main(["convert", str(tmp_path / "m.pt"), str(tmp_path / "o.safetensors")]) == 0
    got, meta = read_safetensors(tmp_path / "o.safetensors")
    assert _same(dict(sorted(got.items())), dict(sorted(tensors.items()))) and meta is None


def test_metadata_loss_is_reported(tmp_path, capsys):
    src = tmp_path / "m.safetensors"
    save_safetensors({"w": torch.ones(2)}, src, metadata={"format": "pt"})
    assert main(["convert", str(src), str(tmp_path / "m.pt")]) == 0
    assert "metadata (1 keys)" in capsys.readouterr().err


def test_reading_safetensors_with_the_reference_library(tmp_path):
    st = pytest.importorskip("safetensors.torch")
    pt = tmp_path / "a.pt"
    sd = _training_state()["model"]
    torch.save(sd, pt)
    assert main(["convert", str(pt), str(tmp_path / "a.safetensors")]) == 0
    assert _same(dict(sorted(st.load_file(tmp_path / "a.safetensors").items())),
                 dict(sorted(sd.items())))


def test_chain_step_to_torch(tmp_path):
    ck = lcckpt.DeltaCheckpointer(tmp_path / "ck")
    w = torch.randn(5000)
    for s in range(3):
        ck.save(s, {"w": w + s, "step": s})
    assert main(["convert", str(tmp_path / "ck"), str(tmp_path / "s1.pt"), "--step", "1"]) == 0
    assert _same(torch.load(tmp_path / "s1.pt", weights_only=True), ck.load(1))
    assert main(["convert", str(tmp_path / "ck"), str(tmp_path / "s.pt")]) == 0
    assert torch.load(tmp_path / "s.pt", weights_only=True)["step"] == 2


def test_a_chain_delta_file_converts_as_its_step(tmp_path, capsys):
    """A delta file of a chain reads as its step, replayed by the directory around it
    (convert and bench take files); one moved out of its directory says what to give."""
    ck = lcckpt.DeltaCheckpointer(tmp_path / "ck")
    w = torch.randn(5000, generator=torch.Generator().manual_seed(0))
    for s in range(3):
        ck.save(s, {"w": w + 0.01 * s, "step": s})
    ck.close()
    delta = tmp_path / "ck" / "step-000000000002.lcc"
    assert main(["convert", str(delta), str(tmp_path / "s2.pt")]) == 0
    assert _same(torch.load(tmp_path / "s2.pt", weights_only=True), ck.load(2))
    obj, _, fmt = read_checkpoint(delta)
    assert fmt == "lcckpt" and _same(obj, ck.load(2))
    assert _same(read_checkpoint(tmp_path / "ck" / "step-000000000000.lcc")[0], ck.load(0))
    lone = tmp_path / "lone.lcc"
    lone.write_bytes(delta.read_bytes())
    capsys.readouterr()
    assert main(["convert", str(lone), str(tmp_path / "x.pt")]) == 1
    err = capsys.readouterr().err
    assert "step 2 of a DeltaCheckpointer chain" in err and "--step 2" in err, err
    assert not (tmp_path / "x.pt").exists()


def test_refusals(tmp_path):
    nested = tmp_path / "n.pt"
    torch.save(_training_state(), nested)
    with pytest.raises(InvalidArgumentError, match="only named tensors"):
        convert(nested, tmp_path / "n.safetensors")
    arr = tmp_path / "arr.lcc"
    lcckpt.save({"a": np.arange(3)}, arr)                  # numpy: not weights-only loadable
    with pytest.raises(UnsafeObjectError, match=r"weights_only.*\['a'\] is a numpy\.ndarray"):
        convert(arr, tmp_path / "arr.pt")
    assert not (tmp_path / "arr.pt").exists() and sorted(p.name for p in tmp_path.iterdir()) \
        == ["arr.lcc", "n.pt"]
    with pytest.raises(InvalidArgumentError, match="output format"):
        convert(nested, tmp_path / "n.zip")
    with pytest.raises(InvalidArgumentError, match="input file"):
        convert(nested, nested)
    with pytest.raises(InvalidArgumentError, match="--compress"):
        convert(nested, tmp_path / "c.pt", compress=True)
    with pytest.raises(InvalidArgumentError, match="--step"):
        convert(nested, tmp_path / "c.lcc", step=3)


def test_a_key_path_converts_one_part_of_a_training_checkpoint(tmp_path, capsys):
    """A training checkpoint ({"model", "optimizer", ...}) cannot be a safetensors file;
    its model's state_dict can: ``key="model"`` (``--key model``). Dots join the levels,
    and a state_dict's own dotted names are found whole."""
    state = _training_state()
    src = tmp_path / "ckpt.pt"
    torch.save(state, src)
    with pytest.raises(InvalidArgumentError, match=r"--key model\)"):
        convert(src, tmp_path / "m.safetensors")
    doc = convert(src, tmp_path / "m.safetensors", key="model")
    assert doc["tensors"] == 4 and doc["input_bytes"] == os.path.getsize(src)
    tensors, _ = read_safetensors(tmp_path / "m.safetensors")
    assert _same(dict(sorted(tensors.items())), dict(sorted(state["model"].items())))
    assert main(["convert", str(src), str(tmp_path / "w.pt"), "--key", "model.2.weight"]) == 0
    assert same_bits(torch.load(tmp_path / "w.pt", weights_only=True), state["model"]["2.weight"])
    convert(src, tmp_path / "b.pt", key="optimizer.param_groups.0.betas")
    assert torch.load(tmp_path / "b.pt", weights_only=True) == state["optimizer"]["param_groups"][0]["betas"]
    capsys.readouterr()
    for bad, where in (("optimizer.nope", "at optimizer it holds 'state', 'param_groups'"),
                       ("model.2.weight.x", "at model.2.weight it holds a Tensor"),
                       ("epoch.1", "at epoch it holds an int")):
        with pytest.raises(InvalidArgumentError, match=where):
            convert(src, tmp_path / "x.pt", key=bad)
    assert main(["convert", str(src), str(tmp_path / "x.pt"), "--key", "nope"]) == 1
    assert "has no key 'nope': at the top it holds 'model', 'optimizer'" in capsys.readouterr().err
    assert not (tmp_path / "x.pt").exists()


def test_to_overrides_the_extension(tmp_path, capsys):
    pt = tmp_path / "a.pt"
    torch.save({"w": torch.randn(3)}, pt)
    assert main(["convert", str(pt), str(tmp_path / "out.bin"), "--to", "safetensors",
                 "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["output_format"] == "safetensors" and doc["tensors"] == 1
    assert detect_format(tmp_path / "out.bin") == "safetensors"
    obj, meta, fmt = read_checkpoint(tmp_path / "out.bin")
    assert fmt == "safetensors" and _same(obj, torch.load(pt, weights_only=True))


@settings(max_examples=15, deadline=None)
@given(tensor_dicts, metadata, st.booleans())
def test_safetensors_through_lcckpt_is_byte_identical(tensors, meta, compress):
    with tempfile.TemporaryDirectory() as d:
        src, mid, out = (os.path.join(d, n) for n in ("a.safetensors", "b.lcc", "c.safetensors"))
        save_safetensors(tensors, src, metadata=meta)
        convert(src, mid, compress=compress)
        convert(mid, out)
        with open(src, "rb") as f, open(out, "rb") as g:
            assert f.read() == g.read()


def test_meta_tensors_convert_where_the_format_holds_them(tmp_path):
    """torch.save and lcckpt keep meta tensors (no data); safetensors cannot, and says so
    instead of failing inside torch ("Cannot copy out of meta tensor")."""
    sd = torch.nn.Linear(5, 3, device="meta").state_dict()
    lcckpt.save({"model": sd, "real": torch.ones(2)}, tmp_path / "m.lcc")
    doc = convert(tmp_path / "m.lcc", tmp_path / "m.pt")
    assert doc["tensors"] == 1                              # the tensors that hold data
    back = torch.load(tmp_path / "m.pt", weights_only=True)
    assert back["model"]["weight"].is_meta and back["model"]["weight"].shape == (3, 5)
    with pytest.raises(InvalidArgumentError, match=r"\['weight'\] is a meta tensor"):
        convert(tmp_path / "m.lcc", tmp_path / "m.safetensors", key="model")
    assert not (tmp_path / "m.safetensors").exists()
    assert main(["bench", "--checkpoint", str(tmp_path / "m.lcc"), str(tmp_path / "m.pt")]) == 0
