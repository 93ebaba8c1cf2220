"""Format version 3 through the torch-level paths: 16-byte aligned sections still give
zero-copy ``mmap`` views and lazy row reads of every dtype, and a small model's delta
file is smaller than the same content laid out as version 2."""

import json
import os

import pytest
import torch
from helpers import same_bits

import lcckpt
from lcckpt.format import container as C
from lcckpt.codec import dtypes
from lcckpt.interop.reader import open as lazy_open

pytestmark = pytest.mark.filterwarnings("ignore:ComplexHalf support is experimental")


def _every_dtype() -> dict:
    """One tensor of each dtype, each after a 3-byte tensor: offsets that are multiples of
    16 but not of 64 (and not of the larger item sizes' multiples in version 2's sense)."""
    g = torch.Generator().manual_seed(0)
    obj = {}
    for i, dt in enumerate(dtypes.TORCH_NAME):
        raw = torch.randint(0, 256, (5, 3 * dt.itemsize), dtype=torch.uint8, generator=g)
        obj[f"odd{i}"] = torch.randint(0, 256, (3,), dtype=torch.uint8, generator=g)
        obj[dtypes.TORCH_NAME[dt]] = (raw % 2 if dt == torch.bool else raw).view(dt)
    return obj


def test_mmap_and_lazy_reads_of_every_dtype_at_16_byte_offsets(tmp_path):
    path = tmp_path / "all.lc"
    obj = _every_dtype()
    lcckpt.save(obj, path)
    with C.read_container(path) as c:
        assert c.version == 4          # raw sections only: laid out as version 4 lays them
        starts = [c.data_start + s["offset"] for s in c.sections]
    assert all(s % 16 == 0 for s in starts) and any(s % 64 for s in starts)
    mapped = lcckpt.load(path, mmap=True)
    with lazy_open(path) as f:
        for key, t in obj.items():
            assert same_bits(mapped[key], t), key
            assert same_bits(f.get_tensor(key), t), key
            assert same_bits(f.get_slice(key)[1:3], t[1:3]), key
    storage = next(iter(mapped.values())).untyped_storage()
    assert all(v.untyped_storage().data_ptr() == storage.data_ptr()   # views of one map
               for v in mapped.values())


def _v2_size(c: C.Container) -> int:
    """The size of the same header and sections laid out as version 2: the header stored
    uncompressed (its JSON differs only in the version digit), 64-byte alignment."""
    size = -(-(C.PREFIX_SIZE + c.header_json_bytes) // 64) * 64
    for i, s in enumerate(c.sections):
        size += s["length"] if i == len(c.sections) - 1 else -(-s["length"] // 64) * 64
    return size


def test_small_model_delta_files_shrink(tmp_path):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    ck = lcckpt.DeltaCheckpointer(tmp_path / "chain")
    for step in range(3):
        opt.zero_grad()
        model(torch.randn(8, 16)).square().mean().backward()
        opt.step()
        ck.save(step, {"model": model.state_dict(), "optim": opt.state_dict()})
    deltas = [s for s in ck.steps() if ck.info(s)["kind"] == "delta"]
    assert deltas
    for step in deltas:
        path = ck.path(step)
        with C.read_container(path) as c:
            assert c.header_compressed and c.header_bytes * 3 < c.header_json_bytes
            assert os.path.getsize(path) == c.size < _v2_size(c) - 2 * c.header_bytes
    ck.close()


def test_header_benchmark_reports_both_layouts():
    pytest.importorskip("sklearn")
    from lcckpt.bench import header

    res = header.run(steps=20, snapshot_every=10, tensors=300, reps=1)
    json.dumps(res)
    ch, big = res["chain"], res["big_header"]
    assert ch["deltas"] == 2 and len(ch["files"]) == 2
    for r in ch["files"]:
        assert r["header_stored"] < r["header_json"] and r["padding"] < r["v2_padding"]
        assert r["header_stored"] < r["v3_header"] and r["file_bytes"] < r["v3_bytes"]
        assert 20 * r["sections"] < r["blob_headers"] < r["section_bytes"]   # ~20+ B a blob
        assert r["file_bytes"] == 24 + r["header_stored"] + r["section_bytes"] + r["padding"]
        assert r["v2_bytes"] == 24 + r["v2_header"] + r["section_bytes"] + r["v2_padding"]
    assert big["header_zlib_bytes"] < big["header_json_bytes"]
    assert big["file_bytes"]["zlib"] < big["file_bytes"]["plain"]
    assert {(r["op"], r["header"]) for r in big["rows"]} == {
        (op, h) for op in ("write", "read") for h in ("zlib", "plain")}
