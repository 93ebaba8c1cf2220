"""A distributed chain's deltas held to the same restored-state targets as a
DeltaCheckpointer's (by role, steered by the first moments), with LC's bits as an option."""

import math
import warnings

import pytest
import torch
from torch import nn
from torch.distributed.checkpoint._nested_dict import flatten_state_dict

import lcckpt.distributed as ld
from lcckpt import DEFAULT_POLICY, RolePolicy
from lcckpt.bench.quality import zeroed
from lcckpt.distributed import targets
from lcckpt.distributed.partition import Piece
from lcckpt.errors import InvalidArgumentError


def _net():
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(64, 128), nn.BatchNorm1d(128), nn.ReLU(), nn.Linear(128, 10))
    return net, torch.optim.Adam(net.parameters(), lr=1e-2)


def _train(net, opt, steps, g):
    for _ in range(steps):
        opt.zero_grad()
        x = torch.randn(32, 64, generator=g)
        nn.functional.cross_entropy(net(x), (x[:, 0] > 0).long()).backward()
        opt.step()


def _state(net, opt):
    return {"model": net.state_dict(), "optim": opt.state_dict()}


def _flat(state):
    return {k: v.clone() for k, v in flatten_state_dict(state)[0].items()
            if isinstance(v, torch.Tensor) and v.is_floating_point()}


def test_the_default_chain_holds_each_role_to_its_target(tmp_path):
    """Every restored floating tensor is the writer's reference, bit for bit, and within
    its role's share of its movement since the keyframe, or of the update its delta sent."""
    net, opt = _net()
    g = torch.Generator().manual_seed(1)
    ck = ld.DistributedCheckpointer(tmp_path, keyframe_every=10)
    keyframe, prev, codecs = None, None, []
    for step in range(13):                  # late in a chain the movement's share rules
        _train(net, opt, 1, g)
        true = _flat(_state(net, opt))
        md = ck.save(step, _state(net, opt))
        codecs.append({k.fqn: i.codec for k, i in md.storage_data.items()}["model.0.weight"])
        back = zeroed(_state(net, opt))
        assert ck.load(back) == step
        got = _flat(back)
        refs = {p.key: t for p, t in ck.references().items()}
        if step % 10 == 0:
            keyframe = true
        for k, t in true.items():
            if k not in refs:                   # a scalar (Adam's step): stored exactly
                assert t.numel() < targets.MIN_ELEMENTS and torch.equal(got[k], t), k
                continue
            assert torch.equal(got[k], refs[k]), (step, k)
            err = (got[k].double() - t.double()).norm().item()
            moved = (t.double() - keyframe[k].double()).norm().item()
            sent = (t.double() - prev[k].double()).norm().item() if step % 10 else 0.0
            share = DEFAULT_POLICY(targets.role_path(k))
            allowed = max(share * moved, DEFAULT_POLICY.update * sent,
                          2.0 ** -26 * t.double().norm().item())   # fp32 precision
            assert err <= allowed * (1 + 1e-6) + 1e-30, (step, k, err, allowed)
        prev = got
    assert codecs == ["exact"] + ["delta"] * 9 + ["exact", "delta", "delta"]


def test_weights_are_steered_by_their_first_moments(tmp_path, monkeypatch):
    """Each weight piece is given its own Adam ``exp_avg`` as the direction, the moments
    and BatchNorm's running statistics none; LC's bits steer nothing."""
    net, opt = _net()
    _train(net, opt, 2, torch.Generator().manual_seed(2))
    seen = {}
    real = targets.direction_of

    def spy(dirs, piece, data):
        m = real(dirs, piece, data)
        seen[piece.key] = m
        return m
    monkeypatch.setattr(targets, "direction_of", spy)
    state = _state(net, opt)
    ck = ld.DistributedCheckpointer(tmp_path / "default")
    ck.save(0, state)
    ck.save(1, state)
    params = dict(net.named_parameters())
    for name, p in params.items():
        assert torch.equal(seen[f"model.{name}"], opt.state[p]["exp_avg"])
    others = {k for k, m in seen.items() if m is not None} - {f"model.{n}" for n in params}
    assert not others
    assert "model.1.running_mean" in seen and "optim.state.0.exp_avg" in seen
    seen.clear()
    lc = ld.DistributedCheckpointer(tmp_path / "lc", bits=2)
    lc.save(0, state)
    lc.save(1, state)
    assert seen and all(m is None for m in seen.values())


def test_a_row_piece_and_a_shard_get_their_part_of_the_moment():
    m = torch.arange(40.0).reshape(10, 4)
    rows = targets.direction_of({"w": m}, Piece("w", 3, 7), torch.zeros(4, 4))
    assert torch.equal(rows, m[3:7])
    assert torch.equal(targets.direction_of({"w": m}, Piece("w", 0, 10), torch.zeros(10, 4)), m)
    assert targets.direction_of({"w": m}, Piece("w", 0, 10), torch.zeros(3, 3)) is None
    assert targets.direction_of({}, Piece("w", 0, 10), torch.zeros(10, 4)) is None


def test_lc_bits_and_targets_are_options(tmp_path):
    assert targets.check(None, None) is DEFAULT_POLICY
    assert targets.check(2, None) is None
    assert targets.check(None, 0.01) == 0.01
    policy = RolePolicy(weight=0.001)
    assert targets.check(None, policy) is policy
    for bits, target, what in [(2, 0.01, "not both"), (5, None, "bits"), (None, 1.5, "target"),
                               (None, math.nan, "target"), (None, "x", "target")]:
        with pytest.raises(InvalidArgumentError, match=what):
            targets.check(bits, target)
    assert ld.CompressedWriter(tmp_path).chain is False          # an exact checkpoint
    assert ld.CompressedWriter(tmp_path, bits=2).target is None   # LC
    assert ld.CompressedWriter(tmp_path, chain=True).target is DEFAULT_POLICY
    enc = targets.new_encoder(None, RolePolicy(first_moment=0.5), "optim.state.3.exp_avg")
    assert enc.config.target == 0.5 and enc.relative_to == "movement"
    assert enc.low_precision_target == 0.3          # bf16/fp16 first moments, as a chain's
    assert targets.new_encoder(None, DEFAULT_POLICY, "model.w").low_precision_target is None
    assert targets.new_encoder(None, 0.02, "w").relative_to == "norm"
    assert targets.new_encoder(3, None, "w").config.bits == 3


def test_moments_new_to_a_chain_start_from_zero_and_a_new_weight_exactly(tmp_path):
    """An optimizer's moments that first appear after the keyframe are deltas against
    zeros (their chains say so), a weight new to the chain is an exact keyframe; every
    step loads as the writer's references, through a merge as well."""
    net, opt = _net()
    g = torch.Generator().manual_seed(3)
    ck = ld.DistributedCheckpointer(tmp_path, keyframe_every=10)
    infos = []
    for step in range(4):
        state = _state(net, opt)
        if step >= 2:
            state["extra.weight"] = torch.full((7, 3), float(step))
        md = ck.save(step, state)
        infos.append({k.fqn: i for k, i in md.storage_data.items()})
        back = zeroed(state)
        assert ck.load(back, step) == step
        got = _flat(back)
        for p, ref in ck.references().items():
            assert torch.equal(got[p.key], ref), (step, p)
        _train(net, opt, 1, g)                  # step 0 is saved before the first step
    first = infos[1]["optim.state.0.exp_avg"]
    assert first.codec == "delta" and first.zero_base and first.chain == ()
    later = infos[3]["optim.state.0.exp_avg_sq"]
    assert later.codec == "delta" and later.zero_base and len(later.chain) == 2
    assert infos[2]["extra.weight"].codec == "exact"
    assert infos[3]["optim.state.0.step"].codec == "exact"      # a scalar: stored exactly
    assert infos[3]["model.0.weight"].codec == "delta" and not infos[3]["model.0.weight"].zero_base
    # the newest step merged into a keyframe: its chains start there, not from zero
    assert ck.merge() == 3
    _train(net, opt, 1, g)
    state = _state(net, opt) | {"extra.weight": torch.full((7, 3), 4.0)}
    md = ck.save(4, state)
    info = {k.fqn: i for k, i in md.storage_data.items()}["optim.state.0.exp_avg"]
    assert info.codec == "delta" and not info.zero_base and len(info.chain) == 1
    back = zeroed(state)
    assert ck.load(back, 4) == 4
    got = _flat(back)
    for p, ref in ck.references().items():
        assert torch.equal(got[p.key], ref), p


def test_a_shards_name_keeps_its_role_and_its_moment():
    """A DTensor shard's piece is named ``fqn@offsets`` (planner.item_key)."""
    assert targets.role_path("optim.state.0.exp_avg@(64, 0)") == targets.role_path(
        "optim.state.0.exp_avg")
    assert targets.new_encoder(None, DEFAULT_POLICY, "optim.state.0.exp_avg@(64, 0)") \
        .config.target == DEFAULT_POLICY.first_moment
    assert targets.starts_at_zero("optim.state.0.exp_avg_sq@(0,)")
    assert not targets.starts_at_zero("model.0.weight@(0, 0)")
    m = torch.arange(8.0).reshape(4, 2)
    got = targets.direction_of({"model.0.weight": m}, Piece("model.0.weight@(4, 0)", 0, 4),
                               torch.zeros(4, 2))
    assert torch.equal(got, m)


def test_a_nan_step_is_stored_exactly_and_its_warning_names_the_piece(tmp_path):
    """As in DeltaCheckpointer: the warning names the tensor, and whether it held the
    NaN or the restored step before it did."""
    ck = ld.DistributedCheckpointer(tmp_path)
    w = torch.linspace(-1, 1, 5000)
    said = {}
    for step in range(4):
        x = w + 0.01 * step
        if step == 2:
            x[3] = float("nan")
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            ck.save(step, {"w": x})
        said[step] = [str(c.message) for c in caught if "NaN" in str(c.message)]
    assert said[0] == said[1] == []
    assert len(said[2]) == 1 and ": w: the tensor holds NaN" in said[2][0]
    assert len(said[3]) == 1 and ": w: the step before, as restored, held NaN" in said[3][0]
    got = {"w": torch.zeros(5000)}
    ck.load(got, 2)
    assert math.isnan(got["w"][3]) and torch.equal(got["w"][4:], (w + 0.02)[4:])


def test_a_mask_of_minus_inf_goes_on_as_unchanged(tmp_path):
    """A buffer that holds -inf by design is coded as unchanged at each delta, with no
    warning, and restores bit for bit."""
    ck = ld.DistributedCheckpointer(tmp_path)
    mask = torch.full((80, 80), float("-inf")).triu(1)
    w = torch.linspace(-1, 1, 5000)
    for step in range(3):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            ck.save(step, {"w": w + 0.01 * step, "mask": mask})
        assert [str(c.message) for c in caught if "NaN" in str(c.message)] == []
        got = {"w": torch.zeros(5000), "mask": torch.zeros(80, 80)}
        ck.load(got, step)
        assert torch.equal(got["mask"], mask)
