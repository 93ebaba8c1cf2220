"""Small tensors packed into one section per dtype and device (tree version 3).

A chain stores every tensor below ``min_delta_elements`` that no rule tracks in a shared
section, so 100,000 scalars cost one codec call per file, not 100,000. These tests check
that the packed tensors come back bit-exact, as separate tensors, through every way of
reading a chain, and that a hostile packed node is refused.
"""

import io
import json
import os
import sys

import pytest
import torch
from helpers import same_bits

import lcckpt
from lcckpt import DeltaCheckpointer
from lcckpt.format.container import read_container
from lcckpt.errors import CorruptDataError


def _state(step: int) -> dict:
    g = torch.Generator().manual_seed(step)
    small = {f"s{i}": torch.randn(3, generator=g) for i in range(40)}
    return {
        "big": torch.randn(5000, generator=g),           # tracked, lossy
        "small": small,
        "half": torch.randn(2, generator=g).half(),
        "bf": torch.randn(5, generator=g).bfloat16(),
        "step": torch.tensor(float(step)),                # 0-d, as Adam's step
        "count": torch.tensor(step, dtype=torch.int64),
        "mask": torch.tensor([True, step % 2 == 0]),
        "param": torch.nn.Parameter(torch.randn(4, generator=g)),
        "grad": torch.randn(2, generator=g).requires_grad_(),
        "again": small["s0"],                             # one tensor at two paths
    }


def _flat(obj, prefix=""):
    if isinstance(obj, dict):
        for k, v in obj.items():
            yield from _flat(v, f"{prefix}/{k}")
    else:
        yield prefix, obj


def test_a_chain_packs_small_tensors_and_restores_them_exactly(tmp_path):
    ck = DeltaCheckpointer(tmp_path, keyframe_every=4)
    states = [_state(i) for i in range(7)]
    for i, s in enumerate(states):
        ck.save(i, s)
    with read_container(ck.path(5)) as c:
        names = [s["name"] for s in c.sections]
        assert c.meta["lcckpt_tree"] == 3
    assert sorted(n for n in names if n.startswith("pack[")) == [
        "pack[BF16@cpu]", "pack[BOOL@cpu]", "pack[F16@cpu]", "pack[F32@cpu]", "pack[I64@cpu]"]
    assert len(names) == 6                       # the packs and the one tracked tensor
    reader = DeltaCheckpointer(tmp_path)
    for i, s in enumerate(states):
        got = reader.load(i)
        for (k, u), (k2, r) in zip(_flat(s), _flat(got)):
            assert k == k2
            if k != "/big":
                assert same_bits(u.detach(), r.detach()), (i, k)
                assert type(r) is type(u) and r.requires_grad == u.requires_grad, (i, k)
        assert got["again"] is got["small"]["s0"]          # identity kept
        ptrs = {t.untyped_storage().data_ptr() for _, t in _flat(got)}
        assert len(ptrs) == len(list(_flat(got))) - 1     # each its own storage
        before = got["small"]["s2"].clone()
        got["small"]["s1"].add_(1)                         # no view of a shared pack
        assert torch.equal(got["small"]["s2"], before)


def test_packed_tensors_read_lazily_and_through_plain_load(tmp_path):
    ck = DeltaCheckpointer(tmp_path, keyframe_every=3)
    states = [_state(i) for i in range(5)]
    for i, s in enumerate(states):
        ck.save(i, s)
    with lcckpt.open(tmp_path, step=4) as f:
        assert same_bits(f.get_tensor("small.s7"), states[4]["small"]["s7"])
        assert same_bits(f.get_tensor("step"), states[4]["step"])
        assert same_bits(f.get_slice("small.s7")[1:], states[4]["small"]["s7"][1:])
    kf = lcckpt.load(ck.path(3))                 # a keyframe reads as a plain file
    assert same_bits(kf["small"]["s39"], states[3]["small"]["s39"])
    assert same_bits(kf["mask"], states[3]["mask"])


def test_a_tensor_joining_or_leaving_the_pack_keeps_every_step_exact(tmp_path):
    ck = DeltaCheckpointer(tmp_path, keyframe_every=None)
    states = []
    for i in range(6):
        s = {"a": torch.full((3,), float(i)), "b": torch.arange(4.0) * i}
        if i in (2, 3):
            s["new"] = torch.tensor([i * 0.5])   # joins the pack, then leaves it
        if i >= 4:
            s["a"] = torch.full((5,), float(i))  # same key, another size
        states.append(s)
        ck.save(i, s)
    reader = DeltaCheckpointer(tmp_path)
    for i, s in enumerate(states):
        got = reader.load(i)
        assert got.keys() == s.keys()
        for k in s:
            assert same_bits(got[k], s[k]), (i, k)


def test_unchanged_small_tensors_cost_little_in_a_delta(tmp_path):
    state = {f"t{i}": torch.randn(3) for i in range(2000)}
    ck = DeltaCheckpointer(tmp_path)
    ck.save(0, state)
    ck.save(1, state)
    assert ck.last_save["kind"] == "delta"
    with read_container(ck.path(1)) as c:
        (pack,) = c.sections
        assert pack["name"] == "pack[F32@cpu]" and pack["length"] < 64   # "no change"
    buf = io.BytesIO()
    torch.save(state, buf)
    assert ck.last_save["nbytes"] < len(buf.getvalue()) / 20    # the header is the rest


def _packed_file(tmp_path):
    ck = DeltaCheckpointer(tmp_path / "ck")
    ck.save(0, {"a": torch.randn(3), "b": torch.randn(2)})
    ck.close()
    return ck.path(0)


@pytest.mark.parametrize("change, what", [
    ({"packed": 1}, "packed must be a boolean"),
    ({"offset": 4}, "reaches past"),
    ({"offset": None}, "offset, shape and stride"),
])
def test_a_forged_packed_node_is_refused(tmp_path, change, what):
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "attacks"))
    import craft
    path = _packed_file(tmp_path)
    raw = open(path, "rb").read()
    with read_container(raw) as c:
        tree = json.loads(json.dumps(c.meta["tree"]))
    node = tree["items"][1][1]                   # "b": offset 3 in the 5-element pack
    assert node["packed"] is True and node["offset"] == 3
    for k, v in change.items():
        if v is None:
            del node[k]
        else:
            node[k] = v
    with pytest.raises(CorruptDataError, match=what):
        lcckpt.load(io.BytesIO(craft.with_tree(raw, tree)))


@pytest.mark.parametrize("options", [{"target": None, "bits": 2},
                                     {"keyframe_coding": "raw"},
                                     {"min_delta_elements": 1}])
def test_packs_under_other_chain_settings(tmp_path, options):
    """LC mode packs everything under its 4,096-element rule, stored whole in every file;
    raw keyframes pack as well; with ``min_delta_elements=1`` nothing is small and
    nothing is packed (every float tensor is then tracked, lossy). What is packed comes
    back exact."""
    ck = DeltaCheckpointer(tmp_path, keyframe_every=3, **options)
    states = [_state(i) for i in range(5)]
    for i, s in enumerate(states):
        ck.save(i, s)
    with read_container(ck.path(4)) as c:
        packs = [s["name"] for s in c.sections if s["name"].startswith("pack[")]
        assert bool(packs) == (options.get("min_delta_elements") != 1), packs
    reader = DeltaCheckpointer(tmp_path)
    for i, s in enumerate(states):
        got = reader.load(i)
        for k, u in _flat(s):
            r = dict(_flat(got))[k]
            small = u.numel() < 8 and "min_delta_elements" not in options   # else tracked
            if isinstance(u, torch.Tensor) and (small or not u.is_floating_point()):
                assert same_bits(u.detach(), r.detach()), (options, i, k)
