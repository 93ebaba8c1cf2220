"""A distributed checkpoint's ``.metadata`` is read from the file, so a forged record must
not make a load allocate by its word: each stored tensor item's shape is held to DCP's
chunk of it (lcckpt/distributed/metadata.py::check_items), and a blob of another shape is
refused before it is decoded. No checksum covers the file: a damaged pickle (any flipped
bit, a forged memo index or frame) is refused as damage before it can allocate, or reads
as metadata that loads the saved values or fails with an lcckpt error."""

import io
import pickle

import pytest
import torch

import lcckpt.distributed as ld
from lcckpt.codec import tensor as tensor_codec
from lcckpt.distributed.metadata import MetadataUnpickler
from lcckpt.distributed.storage import CompressedReader, LcckptStorageInfo
from lcckpt.errors import CorruptDataError, LcckptError


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


def _chain_step(tmp_path):
    """A distributed chain of three steps; its newest step's directory."""
    g = torch.Generator().manual_seed(1)
    state = {"a": torch.randn(1000, 4, generator=g), "b": torch.randn(10, 4, generator=g)}
    ck = ld.DistributedCheckpointer(tmp_path / "ch")
    for step in range(3):
        ck.save(step, {k: v + 0.01 * step for k, v in state.items()})
    ck.close()
    return ck, tmp_path / "ch" / sorted(p.name for p in (tmp_path / "ch").iterdir()
                                        if p.name.startswith("step"))[-1]


def _set(fqn, **fields):
    def change(md):
        for k, v in fields.items():
            setattr(_item(md, fqn)[1], k, v)
    return change


@pytest.mark.parametrize("change, match", [
    (_set("a", codec="exact"), "matches no chunk"),      # a delta's record, called exact
    (_set("a", codec="exact", chain=()), "a delta's"),   # an exact item on a delta's blob
    (_set("a", dtype="torch.floap32"), "matches no chunk"),
    (_set("a", alias=True), "names a blob no item stores"),
    (_set("a", length=1 << 62), "expected|ends inside"),  # no buffer of that size
    (_set("a", chain=(("x", -1, 5),)), "malformed record"),
    (_set("a", rank=None), "malformed record"),
], ids=["codec", "codec-chain", "dtype", "alias", "length", "chain", "rank"])
def test_damaged_chain_records_are_named_not_followed(tmp_path, change, match):
    ck, step = _chain_step(tmp_path)
    _forge(step, change)
    with pytest.raises(LcckptError, match=match):
        ck.load({"a": torch.zeros(1000, 4), "b": torch.zeros(10, 4)})


def test_every_bit_flip_of_the_metadata_is_read_or_refused_as_damage(tmp_path):
    """A flipped bit anywhere in ``.metadata`` (no checksum covers it) gives metadata that
    passes the checks or an LcckptError: not the unpickler's TypeError, OverflowError,
    MemoryError or a record missing a field (nor a memo of gigabytes: 24 GB resident
    before the opcode scan). Loads of those that pass give the saved values or an
    LcckptError (a flipped name or size is DCP's own error about the key)."""
    state = _state()
    ld.save(state, tmp_path / "c")
    raw = (tmp_path / "c" / ".metadata").read_bytes()
    outcomes, same = {}, 0
    for i in range(len(raw) * 8):
        data = bytearray(raw)
        data[i // 8] ^= 1 << (i % 8)
        (tmp_path / "c" / ".metadata").write_bytes(bytes(data))
        try:
            CompressedReader(tmp_path / "c").read_metadata()
            outcomes["read"] = outcomes.get("read", 0) + 1
        except LcckptError as e:
            outcomes[type(e).__name__] = outcomes.get(type(e).__name__, 0) + 1
            continue
        got = _target()
        try:
            ld.load(got, tmp_path / "c")
        except LcckptError:
            continue
        same += 1
        assert torch.equal(got["a"], state["a"]) and torch.equal(got["b"], state["b"])
    assert outcomes.get("CorruptDataError", 0) > len(raw) and outcomes["read"] > same > 0


@pytest.mark.parametrize("op", [b"r\xff\xff\xff\x7f", b"p4000000000\n",
                                b"\x95" + (1 << 40).to_bytes(8, "little")],
                         ids=["LONG_BINPUT", "PUT", "FRAME"])
def test_a_forged_memo_index_or_frame_is_refused_before_unpickling(tmp_path, op):
    """The C unpickler grows its memo to twice a LONG_BINPUT's index, 8 bytes an entry, all
    written (32 GiB for this one; index 0x1000ffff measured 4.2 GB resident, 12 s): the
    opcode scan refuses it first."""
    ld.save(_state(), tmp_path / "c")
    raw = (tmp_path / "c" / ".metadata").read_bytes()
    assert raw[:2] == b"\x80\x04" and raw[2:3] == b"\x95"    # protocol 4, first a frame
    forged = raw[:2] + b"N" + op + b"0" + raw[2:] if op[:1] != b"\x95" else \
        raw[:2] + op + raw[11:]
    (tmp_path / "c" / ".metadata").write_bytes(forged)
    with pytest.raises(CorruptDataError, match="out of range"):
        CompressedReader(tmp_path / "c").read_metadata()
