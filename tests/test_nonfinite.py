"""NaN and Inf in a chain's tensors: a buffer that holds them by design (an attention
mask of -inf) and a step whose weights diverged. Neither may stop the chain."""

import warnings

import pytest
import torch

from lcckpt import DeltaCheckpointer
from lcckpt.chain.policy import RolePolicy

from helpers import same_bits


def _saved(ck, step, state):
    """Save ``state``; return the warnings the save gave."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ck.save(step, state)
    return [str(c.message) for c in caught]


@pytest.mark.parametrize("side", [64, 256])       # the base kept exactly, and sketched
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_mask_of_minus_inf_costs_a_few_bytes_a_delta_and_restores_bit_for_bit(
        tmp_path, side, dtype):
    """A causal mask buffer of -inf never changes: each delta codes it as unchanged,
    without a warning, and every step (also after a resume) gives it back bit for bit."""
    g = torch.Generator().manual_seed(1)
    mask = torch.full((side, side), float("-inf")).triu(1).to(dtype)
    w = torch.randn(20000, generator=g).to(dtype)
    ck = DeltaCheckpointer(tmp_path)
    for step in range(4):
        w = w + (0.01 * torch.randn(20000, generator=g)).to(dtype)
        assert _saved(ck, step, {"w": w, "mask": mask}) == []
        assert same_bits(ck.load(step)["mask"], mask)
        if step:
            kept = ck.info(step)["tensors"]['obj["mask"]']
            assert kept["kind"] == "uniform" and kept["nbytes"] < 100
    ck.close()
    ck = DeltaCheckpointer(tmp_path)
    ck.load(resume=True)
    assert _saved(ck, 4, {"w": w, "mask": mask}) == []
    assert same_bits(ck.load(4)["mask"], mask)


def test_an_inf_without_nan_is_stored_exactly_and_the_chain_goes_on(tmp_path):
    """A step whose weight overflowed to +Inf (no NaN) is stored exactly with a warning,
    as a NaN step is; the step after it too, since its reference holds the Inf."""
    g = torch.Generator().manual_seed(2)
    w = torch.randn(5000, generator=g)
    bad = w + 0.02
    bad[11] = float("inf")
    steps = [w, w + 0.01, bad, w + 0.03, w + 0.04]
    ck = DeltaCheckpointer(tmp_path)
    said = [_saved(ck, step, {"w": x}) for step, x in enumerate(steps)]
    assert said[0] == said[1] == said[4] == []
    assert len(said[2]) == 1 and "the tensor holds NaN/Inf" in said[2][0]
    assert len(said[3]) == 1 and "the step before" in said[3][0]
    for step, x in enumerate(steps):
        if step in (0, 2, 3):
            assert same_bits(ck.load(step)["w"], x)
    assert ck.info(4)["tensors"]['obj["w"]']["kind"] == "uniform"


@pytest.mark.parametrize("n", [3000, 50000])      # the base kept exactly, and sketched
def test_a_keyframe_holding_nan_leaves_later_steps_held_to_their_norm(tmp_path, n):
    """A keyframe with a NaN measures no movement: the step after it is stored exactly
    (its reference holds the NaN), and later deltas keep the weight's share of the
    tensor's own norm, as a tensor without a keyframe does."""
    g = torch.Generator().manual_seed(3)
    w = torch.randn(n, generator=g)
    first = w.clone()
    first[5] = float("nan")
    ck = DeltaCheckpointer(tmp_path)
    assert _saved(ck, 0, {"w": first}) == []
    assert "the step before" in _saved(ck, 1, {"w": w})[0]
    for step in (2, 3):
        w = w + 0.01 * torch.randn(n, generator=g)
        assert _saved(ck, step, {"w": w}) == []
        assert ck.info(step)["tensors"]['obj["w"]']["kind"] == "uniform"
        err = float(torch.linalg.vector_norm(ck.load(step)["w"] - w))
        assert 0 < err <= RolePolicy().weight * float(torch.linalg.vector_norm(w)) * 1.001


@pytest.mark.parametrize("kw", [{}, {"bits": 2}])     # the default chain, and LC mode
def test_a_trained_bias_whose_masked_entries_stay_minus_inf_is_coded_as_a_delta(tmp_path, kw):
    """A learned attention bias with -inf at its masked places: the finite part moves,
    the -inf stay. Each delta codes the finite part (a fraction of an exact blob, no
    warning); the -inf come back bit for bit, the rest within the chain's target. One
    whose -inf moved is stored exactly, with the warning."""
    g = torch.Generator().manual_seed(6)
    keep = torch.rand(300, 300, generator=g) < 0.7
    bias = torch.where(keep, torch.randn(300, 300, generator=g), float("-inf"))
    ck = DeltaCheckpointer(tmp_path, **kw)
    assert _saved(ck, 0, {"bias": bias}) == []
    exact = ck.info(0)["tensors"]['obj["bias"]']["nbytes"]
    for step in (1, 2, 3):
        bias = bias + torch.where(keep, 0.01 * torch.randn(300, 300, generator=g), 0.0)
        assert _saved(ck, step, {"bias": bias}) == []
        kept = ck.info(step)["tensors"]['obj["bias"]']
        assert kept["kind"] != "lossless" and kept["nbytes"] < exact / 2
        got = ck.load(step)["bias"]
        assert same_bits(got[~keep], bias[~keep])
        err = float(torch.linalg.vector_norm(got[keep] - bias[keep]))
        assert err <= 0.05 * float(torch.linalg.vector_norm(bias[keep]))
    moved = bias.clone()
    moved[0, 0], moved[0, 1] = moved[0, 1], moved[0, 0]
    moved[1, :] = float("-inf")
    said = _saved(ck, 4, {"bias": moved})
    assert len(said) == 1 and "the tensor holds NaN/Inf" in said[0]
    assert same_bits(ck.load(4)["bias"], moved)


@pytest.mark.parametrize("n", [1000, 5000])       # the base kept exactly, and sketched
def test_a_signalling_nan_is_kept_bit_for_bit_at_every_step(tmp_path, n):
    """Adding zero makes a signalling NaN quiet, so a tensor holding one, unchanged, is not
    coded as a masked delta but stored exactly: every step gives its bits back; and a
    keyframe holding it gives no cast warning."""
    g = torch.Generator().manual_seed(5)
    w = torch.randn(n, generator=g)
    w.view(torch.int32)[:3] = torch.tensor([0x7F800001, 0x7FA00000, -0x3FFFFF], dtype=torch.int32)
    assert torch.isnan(w[:3]).all()
    ck = DeltaCheckpointer(tmp_path)
    for step in range(3):
        x = w.clone()
        x[3:] += 0.01 * step
        said = _saved(ck, step, {"w": x})
        assert not any("invalid value" in s for s in said)
        assert same_bits(ck.load(step)["w"], x)
