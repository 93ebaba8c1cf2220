"""Checkpoints plain DCP wrote, read by lcckpt.distributed.load and ``lcckpt convert``
without running code from them (lcckpt/distributed/plain.py)."""

import dataclasses
import os
import pickle

import pytest
import torch
import torch.distributed.checkpoint as dcp

import lcckpt
import lcckpt.distributed as ld
from lcckpt.cli import main
from lcckpt.errors import CorruptDataError, UnsafeObjectError

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


class Payload:
    """A value only pickle stores (a class of this test module)."""

    def __reduce__(self):
        return (os.system, ("echo pwned",))


def _plain(path, extra=None):
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 4)
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(2, 8)).sum().backward()
    opt.step()
    state = {"model": model.state_dict(), "optim": opt.state_dict(), "epoch": 2, **(extra or {})}
    dcp.save(state, checkpoint_id=str(path), no_dist=True)
    return model, opt


def _rewrite_metadata(path, change):
    with open(path / ".metadata", "rb") as f:
        md = pickle.load(f)                 # the test's own file: trusted here
    change(md)
    with open(path / ".metadata", "wb") as f:
        pickle.dump(md, f)


def test_a_plain_checkpoint_loads_whole_and_into_fresh_objects(tmp_path):
    model, opt = _plain(tmp_path / "c")
    whole = {}
    ld.load(whole, tmp_path / "c")
    assert whole["epoch"] == 2 and sorted(whole["optim"]["state"]) == [0, 1]
    model2 = torch.nn.Linear(8, 4)
    opt2 = torch.optim.AdamW(model2.parameters(), lr=5.0)
    target = {"model": model2.state_dict(), "optim": opt2.state_dict()}
    ld.load(target, tmp_path / "c")
    opt2.load_state_dict(target["optim"])
    assert torch.equal(model2.weight, model.weight) and opt2.param_groups[0]["lr"] == 1e-3
    assert torch.equal(opt2.state_dict()["state"][1]["exp_avg"], opt.state_dict()["state"][1]["exp_avg"])
    assert main(["convert", str(tmp_path / "c"), str(tmp_path / "c.pt")]) == 0
    assert torch.equal(lcckpt.load(tmp_path / "c.pt")["model"]["weight"], model.weight)


def test_metadata_that_would_run_code_is_refused(tmp_path):
    _plain(tmp_path / "c")
    with open(tmp_path / "c" / ".metadata", "wb") as f:
        pickle.dump(Payload(), f)
    with pytest.raises(UnsafeObjectError, match="posix.system|os.system"):
        ld.load({}, tmp_path / "c")


def test_a_value_only_pickle_stores_is_refused(tmp_path):
    _plain(tmp_path / "c", extra={"hook": Payload()})
    with pytest.raises(UnsafeObjectError, match="'hook' needs unrestricted unpickling"):
        ld.load({}, tmp_path / "c")


@pytest.mark.parametrize("forge, match", [
    (lambda info: {"relative_path": "../outside.distcp"}, "not a file of the checkpoint"),
    (lambda info: {"relative_path": "/etc/hostname"}, "not a file of the checkpoint"),
    (lambda info: {"length": info.length + 10**9}, "does not lie inside"),
    (lambda info: {"offset": -1}, "does not lie inside"),
    (lambda info: {"transform_descriptors": 7}, "does not lie inside"),
])
def test_an_item_outside_the_checkpoint_s_files_is_refused(tmp_path, forge, match):
    _plain(tmp_path / "c")
    (tmp_path / "outside.distcp").write_bytes(b"x" * 100)

    def change(md):
        idx = next(iter(md.storage_data))
        info = md.storage_data[idx]
        md.storage_data[idx] = dataclasses.replace(info, **forge(info))
    _rewrite_metadata(tmp_path / "c", change)
    with pytest.raises(CorruptDataError, match=match):
        ld.load({}, tmp_path / "c")


def test_a_truncated_file_is_refused_before_it_is_read(tmp_path):
    _plain(tmp_path / "c")
    name = next(n for n in os.listdir(tmp_path / "c") if n.endswith(".distcp"))
    with open(tmp_path / "c" / name, "r+b") as f:
        f.truncate(os.path.getsize(f.name) // 2)
    with pytest.raises(CorruptDataError, match="damaged, truncated or forged"):
        ld.load({}, tmp_path / "c")


@pytest.mark.slow
def test_two_fsdp2_ranks_plain_checkpoint_converts_to_one_file(tmp_path):
    """A safe ``dcp_to_torch_save``: each rank's shards read back into whole tensors."""
    import sys
    sys.path.insert(0, os.path.dirname(__file__))
    import _dist_worker as W
    W.spawn(W.plain_fsdp_worker, (2, W.rendezvous(tmp_path), str(tmp_path)), 2, str(tmp_path))
    assert sorted(n for n in os.listdir(tmp_path / "plain") if n.endswith(".distcp")) == [
        "__0_0.distcp", "__1_0.distcp"]
    assert main(["convert", str(tmp_path / "plain"), str(tmp_path / "whole.pt")]) == 0
    got, want = lcckpt.load(tmp_path / "whole.pt"), torch.load(tmp_path / "plain.expected.pt")
    assert got["epoch"] == 4 and sorted(got["optim"]["state"]) == [0, 1, 2, 3]
    for k, v in want.items():
        assert torch.equal(got["model"][k], v), k


def test_a_flipped_bit_in_a_tensor_fails_its_crc_where_torch_load_takes_it(tmp_path, capsys):
    import io
    import struct
    import zipfile
    from lcckpt.distributed.plain import PlainReader
    from lcckpt.errors import ChecksumError
    _plain(tmp_path / "c")
    md = PlainReader(tmp_path / "c").read_metadata()
    info = next(v for k, v in md.storage_data.items() if k.fqn == "model.weight")
    path = tmp_path / "c" / info.relative_path
    raw = bytearray(path.read_bytes())
    item = bytes(raw[info.offset:info.offset + info.length])
    member = next(i for i in zipfile.ZipFile(io.BytesIO(item)).infolist() if "/data/" in i.filename)
    name_len, extra_len = struct.unpack("<HH", item[member.header_offset + 26:member.header_offset + 30])
    raw[info.offset + member.header_offset + 30 + name_len + extra_len + 5] ^= 0x40
    path.write_bytes(bytes(raw))
    with pytest.raises(ChecksumError, match="Bad CRC-32"):
        ld.load({}, tmp_path / "c")
    assert main(["verify", str(tmp_path / "c")]) == 1
    assert "Bad CRC-32" in capsys.readouterr().err
