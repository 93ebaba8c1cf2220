"""A distributed checkpoint's ``.metadata`` is read from the file, so a forged record must
not make a load allocate by its word: each stored tensor item's shape is held to DCP's
chunk of it (lcckpt/distributed/metadata.py::check_items), and a blob of another shape is
refused before it is decoded."""

import io
import pickle

import pytest
import torch

import lcckpt.distributed as ld
from lcckpt.codec import tensor as tensor_codec
from lcckpt.distributed.metadata import MetadataUnpickler
from lcckpt.distributed.storage import CompressedReader, LcckptStorageInfo
from lcckpt.errors import CorruptDataError


def _state():
    g = torch.Generator().manual_seed(0)
    return {"a": torch.randn(1000, 4, generator=g), "b": torch.randn(10, 4, generator=g),
            "n": 7}


def _forge(directory, change):
    """Rewrite ``directory``'s metadata with ``change(md)`` applied."""
    path = directory / ".metadata"
    md = MetadataUnpickler(io.BytesIO(path.read_bytes()), LcckptStorageInfo).load()
    change(md)
    path.write_bytes(pickle.dumps(md))


def _item(md, fqn):
    return next((idx, info) for idx, info in md.storage_data.items() if idx.fqn == fqn)


def _target():
    return {"a": torch.zeros(1000, 4), "b": torch.zeros(10, 4), "n": 0}


def test_an_unforged_checkpoint_passes_the_checks(tmp_path):
    state = _state()
    ld.save(state, tmp_path / "c")
    got = _target()
    ld.load(got, tmp_path / "c")
    assert torch.equal(got["a"], state["a"]) and got["n"] == 7


def test_an_item_shape_that_is_not_its_chunks_is_refused_before_any_read(tmp_path):
    ld.save(_state(), tmp_path / "c")

    def huge(md):
        _item(md, "b")[1].shape = (10 ** 12,)
    _forge(tmp_path / "c", huge)
    with pytest.raises(CorruptDataError, match="b .*matches no chunk"):
        ld.load(_target(), tmp_path / "c")
    with pytest.raises(CorruptDataError, match="matches no chunk"):
        CompressedReader(tmp_path / "c").read_metadata()


@pytest.mark.parametrize("sizes", [(2000, 4), (1000, 4, 1), (-1, 4)])
def test_a_chunk_outside_its_tensor_is_refused(tmp_path, sizes):
    ld.save(_state(), tmp_path / "c")

    def grow(md):
        md.state_dict_metadata["a"].chunks[0].sizes = torch.Size(sizes)
        _item(md, "a")[1].shape = tuple(sizes)
    _forge(tmp_path / "c", grow)
    with pytest.raises(CorruptDataError, match="does not fit"):
        ld.load(_target(), tmp_path / "c")


def test_a_value_record_on_a_tensor_or_an_unknown_codec_is_refused(tmp_path):
    ld.save(_state(), tmp_path / "c")
    _forge(tmp_path / "c", lambda md: setattr(_item(md, "a")[1], "codec", "tree"))
    with pytest.raises(CorruptDataError, match="matches no chunk"):
        ld.load(_target(), tmp_path / "c")
    ld.save(_state(), tmp_path / "d")
    _forge(tmp_path / "d", lambda md: setattr(_item(md, "a")[1], "codec", "zeros"))
    with pytest.raises(CorruptDataError, match="'zeros'"):
        ld.load(_target(), tmp_path / "d")


@pytest.mark.parametrize("whole", [True, False])
def test_an_exact_blob_of_another_shape_is_refused_before_decoding(tmp_path, monkeypatch,
                                                                   whole):
    """``b``'s record points at ``a``'s blob (1000x4 values for a 10x4 item): the load
    names the damage and decodes nothing, whether ``b``'s target takes it whole or not
    (a bf16 target: the item is decoded into memory of its own, then converted)."""
    ld.save(_state(), tmp_path / "c")

    def swap(md):
        a, b = _item(md, "a")[1], _item(md, "b")[1]
        b.relative_path, b.offset, b.length = a.relative_path, a.offset, a.length
    _forge(tmp_path / "c", swap)
    decoded = []
    real = tensor_codec._run_exact
    monkeypatch.setattr(tensor_codec, "_run_exact", lambda *a: decoded.append(1) or real(*a))
    target = {"b": torch.zeros(10, 4) if whole else torch.zeros(10, 4, dtype=torch.bfloat16)}
    with pytest.raises(CorruptDataError, match="1000, 4"):
        ld.load(target, tmp_path / "c")
    assert decoded == []


def test_a_delta_blob_of_another_shape_is_refused(tmp_path):
    g = torch.Generator().manual_seed(1)
    state = {"a": torch.randn(1000, 4, generator=g), "b": torch.randn(10, 4, generator=g)}
    ck = ld.DistributedCheckpointer(tmp_path / "ch")
    ck.save(0, state)
    ck.save(1, {k: v + 0.01 for k, v in state.items()})
    step = tmp_path / "ch" / sorted(p.name for p in (tmp_path / "ch").iterdir()
                                    if p.name.startswith("step"))[-1]

    def swap(md):
        a, b = _item(md, "a")[1], _item(md, "b")[1]
        assert a.codec == b.codec == "delta"
        b.chain = a.chain
    _forge(step, swap)
    with pytest.raises(CorruptDataError, match="shape"):
        ck.load({"a": torch.zeros(1000, 4), "b": torch.zeros(10, 4)})
