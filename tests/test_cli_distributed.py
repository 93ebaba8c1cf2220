"""``lcckpt inspect``, ``verify`` and ``convert`` on distributed checkpoints: one checkpoint
directory, and a DistributedCheckpointer's steps."""

import json
import os
import shutil

import pytest
import torch
import torch.distributed.checkpoint as dcp

import lcckpt.distributed as ld
from lcckpt.cli import main


@pytest.fixture
def chain(tmp_path):
    """Three steps (a keyframe, two deltas) of a tensor under two names and a value."""
    g = torch.Generator().manual_seed(0)
    emb = torch.randn(1000, 64, generator=g)
    ck = ld.DistributedCheckpointer(tmp_path / "c")
    for step in range(3):
        emb.add_(torch.randn(emb.shape, generator=g) * 1e-3)
        ck.save(step, {"emb": emb, "out": emb, "epoch": step})
    return ck


def _inspect(path, capsys) -> tuple[int, dict]:
    code = main(["inspect", "--json", str(path)])
    return code, json.loads(capsys.readouterr().out)


def test_inspect_shows_the_steps_and_each_item(chain, capsys):
    code, doc = _inspect(chain.directory, capsys)
    assert code == 0 and doc["format"] == "distributed chain" and not doc["problems"]
    assert [(r["step"], r["kind"], r["depth"], r["restorable"]) for r in doc["steps"]] == [
        (0, "keyframe", 0, True), (1, "delta", 1, True), (2, "delta", 2, True)]
    assert doc["steps"][2]["ratio"] > 4                     # deltas, the tie stored once
    code, doc = _inspect(chain.path(2), capsys)
    items = {r["name"]: r for r in doc["items"]}
    assert code == 0 and sorted(items) == ["emb", "epoch", "out"]
    assert items["emb"]["codec"] == "delta" and items["emb"]["depth"] == 2
    assert items["out"]["alias"] and items["out"]["stored_bytes"] == 0
    assert doc["raw_bytes"] == 1000 * 64 * 4 + items["epoch"]["raw_bytes"]
    assert doc["file_bytes"] == sum(r["stored_bytes"] for r in doc["items"])
    assert main(["inspect", str(chain.path(2))]) == 0
    assert "alias: another name of a tensor stored once" in capsys.readouterr().out


def test_verify_decodes_every_item_and_names_a_damaged_one(chain, capsys):
    assert main(["verify", str(chain.directory)]) == 0
    assert "OK: 3 of 3 checks passed" in capsys.readouterr().out
    step1 = chain.path(1)
    name = next(n for n in os.listdir(step1) if n.endswith(".distcp"))
    with open(os.path.join(step1, name), "r+b") as f:    # inside emb's delta blob
        f.seek(os.path.getsize(f.name) // 2)
        b = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([b[0] ^ 0xFF]))
    assert main(["verify", str(chain.directory)]) == 1
    err = capsys.readouterr().err
    assert "step_0000000001: emb:" in err and "step_0000000002: emb:" in err   # 2 replays 1
    assert "step_0000000000" not in err and "checksum" in err
    assert main(["verify", "--json", str(chain.path(0))]) == 0
    capsys.readouterr()
    assert main(["verify", "--max-bytes", "1K", str(chain.path(0))]) == 1   # as any load
    assert "emb: it declares 256,000 bytes" in capsys.readouterr().err


def test_a_missing_step_makes_the_later_ones_unrestorable(chain, capsys):
    shutil.rmtree(chain.path(0))
    code, doc = _inspect(chain.directory, capsys)
    assert code == 1
    assert [r["restorable"] for r in doc["steps"]] == [False, False]
    assert any("missing" in p for p in doc["problems"])
    assert main(["verify", str(chain.directory)]) == 1
    assert "FAIL" in capsys.readouterr().err


def test_a_checkpoint_plain_dcp_wrote_is_named_as_such(tmp_path, capsys):
    """Inspected from its metadata, read safely (plain.py), verified by reading it whole."""
    dcp.save({"w": torch.ones(4), "epoch": 2},
             storage_writer=dcp.FileSystemWriter(str(tmp_path / "p")))
    code, doc = _inspect(tmp_path / "p", capsys)
    assert code == 0 and doc["format"] == "distributed checkpoint (plain DCP)"
    items = {r["name"]: r for r in doc["items"]}
    assert items["w"]["shape"] == [4] and items["w"]["raw_bytes"] == 16
    assert items["w"]["rank"] == 0 and items["epoch"]["dtype"] == "value"
    assert main(["verify", str(tmp_path / "p")]) == 0
    name = next(n for n in os.listdir(tmp_path / "p") if n.endswith(".distcp"))
    with open(tmp_path / "p" / name, "r+b") as f:
        f.truncate(8)
    assert main(["verify", str(tmp_path / "p")]) == 1
    assert "damaged, truncated or forged" in capsys.readouterr().err


def test_convert_writes_a_step_of_a_chain_as_one_file(chain, tmp_path, capsys):
    """A distributed checkpoint, or a step of a DistributedCheckpointer (the newest by
    default), written as one torch.save, safetensors or lcckpt file of the whole state."""
    import lcckpt
    for step in (None, 1):
        want = {}
        assert chain.load(want, step=step) == (2 if step is None else 1)
        for out in ("a.pt", "c.lcc"):
            dst = tmp_path / f"{step}-{out}"
            args = ["convert", str(chain.directory), str(dst)] + ([] if step is None else
                                                                   ["--step", str(step)])
            assert main(args) == 0, capsys.readouterr().err
            got = lcckpt.load(dst)
            assert got["epoch"] == want["epoch"] and torch.equal(got["out"], want["emb"])
    ld.save({"model": {"w": want["emb"]}, "epoch": 1}, tmp_path / "one")
    assert main(["convert", str(tmp_path / "one"), str(tmp_path / "m.safetensors"),
                 "--key", "model"]) == 0
    assert torch.equal(lcckpt.load(tmp_path / "m.safetensors")["w"], want["emb"])
    capsys.readouterr()
    assert main(["convert", str(chain.path(0)), str(tmp_path / "k.pt"), "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["input_format"] == "distributed" and doc["input_bytes"] > 0
    assert (doc["step"], doc["step_kind"]) == (0, "keyframe")
    # a delta step is written as the chain restores it, which the line says ("exact" before)
    assert main(["convert", str(chain.directory), str(tmp_path / "d.pt")]) == 0
    assert "step 2 as the chain restores it" in capsys.readouterr().out
    assert main(["convert", str(tmp_path / "one"), str(tmp_path / "o.pt")]) == 0
    assert capsys.readouterr().out.rstrip().endswith("exact")
    assert main(["convert", str(chain.directory), str(tmp_path / "x.pt"), "--step", "7"]) == 1
    assert "step 7 is not committed" in capsys.readouterr().err
    assert main(["convert", str(chain.path(0)), str(tmp_path / "x.pt"), "--step", "0"]) == 1
    assert "leave out --step" in capsys.readouterr().err


def test_lcckpt_load_of_a_distributed_directory_says_how_to_read_it(chain):
    import lcckpt
    from lcckpt.errors import InvalidArgumentError
    with pytest.raises(InvalidArgumentError, match=r"DistributedCheckpointer's steps.*"
                       r"DistributedCheckpointer\(directory\)\.load\(\{\}\)"):
        lcckpt.load(chain.directory)
    with pytest.raises(InvalidArgumentError, match=r"a distributed checkpoint: lcckpt\."
                       r"distributed\.load\(\{\}, directory\)"):
        lcckpt.load(chain.path(1))


def test_bench_measures_the_steps_of_a_distributed_chain(chain, capsys):
    """``bench --checkpoint`` reads each step whole (and a DistributedCheckpointer
    directory as its newest step)."""
    paths = [str(chain.path(s)) for s in range(3)]
    assert main(["bench", "--checkpoint", *paths]) == 0
    out = capsys.readouterr().out
    assert "3 checkpoints" in out and "lcckpt default" in out
    assert main(["bench", "--checkpoint", str(chain.directory)]) == 0
    assert "ratios against torch.save" in capsys.readouterr().out


def test_lcckpt_s_own_readers_of_a_distributed_directory_say_how_to_read_it(chain):
    import lcckpt
    from lcckpt.errors import NotFoundError
    with pytest.raises(NotFoundError, match=r"DistributedCheckpointer's steps"):
        lcckpt.DeltaCheckpointer(chain.directory).load()
    with pytest.raises(NotFoundError, match=r"a distributed checkpoint: lcckpt\.distributed"):
        lcckpt.open(chain.path(0))
