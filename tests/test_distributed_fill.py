"""A restart loads into a fresh optimizer: what the checkpoint holds under the state's empty
containers is added to them (lcckpt/distributed/fill.py), where DCP loads nothing there."""

import json
import os
import subprocess
import sys

import pytest
import torch
from hypothesis import given, settings, strategies as st
from torch import nn

import lcckpt.distributed as ld
from lcckpt.distributed.fill import fill_empty

sys.path.insert(0, os.path.dirname(__file__))
import _dist_worker as W  # noqa: E402
from helpers import assert_equal_state  # noqa: E402


def _model_and_adamw(seed: int):
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 5))
    return model, torch.optim.AdamW(model.parameters(), lr=3e-3)


def _train(model, opt, steps, seed=0):
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        opt.zero_grad()
        model(torch.randn(16, 32, generator=g)).square().mean().backward()
        opt.step()


def _fresh_restore(load):
    """A restarted run's objects, loaded by ``load(state)`` and handed to them."""
    model, opt = _model_and_adamw(seed=1)
    assert opt.state_dict()["state"] == {}                    # nothing stepped yet
    state = {"model": model.state_dict(), "optim": opt.state_dict(), "epoch": -1}
    load(state)
    opt.load_state_dict(state["optim"])
    return model, opt, state


def _assert_same_optimizer(a, b):
    sa, sb = a.state_dict(), b.state_dict()
    assert sa["param_groups"] == sb["param_groups"]
    assert sorted(sa["state"]) == sorted(sb["state"]) == list(range(4))    # int keys
    for i, entry in sa["state"].items():
        assert entry.keys() == sb["state"][i].keys()
        for k, v in entry.items():
            assert torch.equal(v, sb["state"][i][k]), (i, k)


def test_a_fresh_optimizer_restores_its_state_and_the_run_goes_on_exactly(tmp_path):
    model, opt = _model_and_adamw(seed=0)
    _train(model, opt, 3)
    ld.save({"model": model.state_dict(), "optim": opt.state_dict(), "epoch": 3}, tmp_path / "c")
    model2, opt2, state = _fresh_restore(lambda s: ld.load(s, tmp_path / "c"))
    assert state["epoch"] == 3
    _assert_same_optimizer(opt2, opt)
    _train(model, opt, 2, seed=5)
    _train(model2, opt2, 2, seed=5)
    for a, b in zip(model.parameters(), model2.parameters()):
        assert torch.equal(a, b)                                # as if never interrupted


def test_a_chain_step_restores_a_fresh_optimizer_as_a_stepped_one(tmp_path):
    model, opt = _model_and_adamw(seed=0)
    ck = ld.DistributedCheckpointer(tmp_path / "run")
    for step in range(3):
        _train(model, opt, 2, seed=step)
        ck.save(step, {"model": model.state_dict(), "optim": opt.state_dict(), "epoch": step})
    _, fresh, state = _fresh_restore(ck.load)
    _, stepped = _model_and_adamw(seed=2)
    _train(_, stepped, 1)                          # moments exist: DCP loads in place
    target = {"model": _.state_dict(), "optim": stepped.state_dict(), "epoch": -1}
    assert ck.load(target) == 2
    stepped.load_state_dict(target["optim"])
    _assert_same_optimizer(fresh, stepped)
    assert fresh.state_dict()["state"][0]["step"] == 6 and state["epoch"] == 2


def test_a_container_that_holds_anything_loads_only_what_it_holds(tmp_path):
    model, opt = _model_and_adamw(seed=0)
    _train(model, opt, 1)
    ld.save({"model": model.state_dict(), "optim": opt.state_dict()}, tmp_path / "c")
    head = {"2.weight": torch.zeros(5, 64)}
    target = {"model": head}                       # a part of the model, no optimizer
    ld.load(target, tmp_path / "c")
    assert list(target) == ["model"] and list(head) == ["2.weight"]
    assert torch.equal(head["2.weight"], model[2].weight.detach())


def test_fill_adds_under_empty_containers_only():
    from torch.distributed.checkpoint.metadata import (BytesStorageMetadata, Metadata,
                                                       TensorProperties, TensorStorageMetadata)
    md = lambda n: TensorStorageMetadata(TensorProperties(torch.float32), torch.Size([n]), [])  # noqa: E731
    meta = Metadata(
        state_dict_metadata={"o.state.3.m": md(2), "o.state.3.n": BytesStorageMetadata(),
                             "o.param_groups": BytesStorageMetadata(), "m.w": md(4),
                             "m.b": md(4), "x.0.y": md(1), "top": md(3)},
        planner_data={"o.state.3.m": ("o", "state", "3", "m"), "o.state.3.n": ("o", "state", "3", "n"),
                      "o.param_groups": ("o", "param_groups"), "m.w": ("m", "w"),
                      "m.b": ("m", "b"), "x.0.y": ("x", 0, "y"), "top": ("top",)})
    state = {"o": {"state": {}, "param_groups": [{"params": [3]}]}, "m": {"w": torch.ones(4)},
             "x": []}
    added = fill_empty(state, meta)
    assert sorted(added) == ["o.state.3.m", "o.state.3.n", "x.0.y"]
    assert list(state["o"]["state"]) == [3]                    # the optimizer's int key
    assert state["o"]["state"][3]["m"].shape == (2,) and state["o"]["state"][3]["n"] is None
    assert list(state["m"]) == ["w"] and "top" not in state    # non-empty, and the top level
    assert state["x"][0]["y"].shape == (1,)
    # a str key that is no parameter's index stays a str
    state = {"o": {"state": {}, "param_groups": [{"params": [0]}]}}
    fill_empty(state, meta)
    assert list(state["o"]["state"]) == ["3"]


_FSDP_FRESH = """
import datetime, os, sys, torch, torch.distributed as dist
sys.path.insert(0, %r)
dist.init_process_group("gloo", init_method=%r, rank=0, world_size=1,
                        timeout=datetime.timedelta(seconds=60))
import lcckpt.distributed as ld
from lcckpt.errors import InvalidArgumentError
import _dist_worker as W
model = W.fsdp_model()
opt = torch.optim.Adam(model.parameters())
model(torch.randn(2, 16)).sum().backward()
opt.step()
ld.save({"model": model.state_dict(), "optim": opt.state_dict()}, %r)
model = W.fsdp_model()
fresh = torch.optim.Adam(model.parameters())
try:
    ld.load({"model": model.state_dict(), "optim": fresh.state_dict()}, %r)
except InvalidArgumentError as e:
    print("refused:", e)
dist.destroy_process_group()
sys.stdout.flush()
os._exit(0)     # FSDP2's groups outlive destroy_process_group (_dist_worker._rank_main)
"""


def test_a_sharded_fresh_optimizer_is_refused_with_what_to_do(tmp_path):
    d = str(tmp_path / "c")
    code = _FSDP_FRESH % (os.path.dirname(__file__), W.rendezvous(tmp_path), d, d)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=300, env=dict(os.environ, LCCKPT_THREADS="1"))
    assert out.returncode == 0, out.stderr[-3000:]
    line = out.stdout.strip().splitlines()[-1]
    assert line.startswith("refused:") and "DTensors" in line and "get_state_dict" in line, \
        json.dumps(out.stdout[-2000:])


def test_an_empty_state_loads_the_whole_checkpoint(tmp_path):
    """``{}``: every entry, values and the optimizer's int keys as saved; from one
    checkpoint and from a chain's step."""
    model, opt = _model_and_adamw(seed=0)
    _train(model, opt, 2)
    sched = torch.optim.lr_scheduler.StepLR(opt, 3)
    saved = {"model": model.state_dict(), "optim": opt.state_dict(), "sched": sched.state_dict(),
             "epoch": 3, "hist": [1.5, 2.5]}
    ld.save(saved, tmp_path / "c")
    whole = {}
    ld.load(whole, tmp_path / "c")
    assert sorted(whole) == sorted(saved) and whole["epoch"] == 3 and whole["hist"] == [1.5, 2.5]
    assert whole["sched"] == sched.state_dict()
    assert whole["optim"]["param_groups"] == opt.state_dict()["param_groups"]
    model2, opt2 = _model_and_adamw(seed=1)
    model2.load_state_dict(whole["model"])
    opt2.load_state_dict(whole["optim"])
    _assert_same_optimizer(opt2, opt)
    ck = ld.DistributedCheckpointer(tmp_path / "run")
    for step in range(2):
        _train(model, opt, 1, seed=step)
        ck.save(step, {"model": model.state_dict(), "optim": opt.state_dict()})
    whole, target = {}, {"model": model2.state_dict(), "optim": opt2.state_dict()}
    assert ck.load(whole) == ck.load(target) == 1
    assert sorted(whole["optim"]["state"]) == [0, 1, 2, 3]
    for k, v in target["model"].items():
        assert torch.equal(whole["model"][k], v)


@pytest.mark.slow
def test_two_ranks_restore_a_fresh_optimizer_cooperatively(tmp_path):
    """Each rank reads half and sends it on (the default restore); both end with the
    optimizer state a stepped optimizer gets in place."""
    W.spawn(W.fresh_optimizer_worker, (2, W.rendezvous(tmp_path), str(tmp_path)), 2,
            str(tmp_path))
    for rank in range(2):
        got = torch.load(tmp_path / f"fresh{rank}.pt")
        fresh, stepped = got["fresh"], got["stepped"]
        assert sorted(fresh["state"]) == [0, 1, 2, 3] and fresh["param_groups"][0]["lr"] == 1e-3
        for i, entry in stepped["state"].items():
            for k, v in entry.items():
                assert torch.equal(fresh["state"][i][k], v), (rank, i, k)
        assert fresh["state"][0]["step"] == 3


def test_objects_given_themselves_load_their_state(tmp_path):
    """DCP's ``Stateful``: a model and a fresh optimizer in the state are saved through their
    ``state_dict`` and loaded through their ``load_state_dict``, moments included."""
    model, opt = _model_and_adamw(seed=0)
    _train(model, opt, 2)
    ld.save({"model": model, "optim": opt}, tmp_path / "c")
    model2, opt2 = _model_and_adamw(seed=1)
    ld.load({"model": model2, "optim": opt2}, tmp_path / "c")
    _assert_same_optimizer(opt2, opt)
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), model2.parameters()))


_leaf = st.one_of(st.integers(-5, 5), st.text(max_size=3),
                  st.tuples(st.integers(1, 4), st.integers(1, 3)).map(
                      lambda s: torch.arange(s[0] * s[1], dtype=torch.float32).reshape(s)))
_tree = st.recursive(st.dictionaries(st.text("abc", min_size=1, max_size=2), _leaf,
                                     min_size=1, max_size=3),
                     lambda inner: st.dictionaries(st.text("xyz", min_size=1, max_size=2),
                                                   inner, min_size=1, max_size=3),
                     max_leaves=12)


def _emptied(saved, draw_bits):
    """A target shaped as ``saved``: tensors zeroed in place of their values, values
    None, and where ``draw_bits`` says so a sub-dict left empty."""
    out = {}
    for k, v in saved.items():
        if isinstance(v, dict):
            out[k] = {} if next(draw_bits) else _emptied(v, draw_bits)
        else:
            out[k] = torch.zeros_like(v) if isinstance(v, torch.Tensor) else None
    return out


@settings(max_examples=25, deadline=None)
@given(_tree, st.lists(st.booleans(), min_size=40, max_size=40))
def test_emptied_containers_load_back_whole(tmp_path_factory, saved, bits):
    """Whatever sub-dicts a target leaves empty, the load gives back the saved tree."""
    d = tmp_path_factory.mktemp("fill")
    ld.save(saved, d / "c")
    target = _emptied(saved, iter(bits + [False] * 100))
    ld.load(target, d / "c")
    assert_equal_state(target, saved)


@pytest.mark.parametrize("plain", [False, True])
def test_a_forged_size_cannot_make_a_load_allocate_past_the_limit(tmp_path, plain):
    """What a load adds is sized by the file's metadata alone: a tensor declared far larger
    than its stored chunk is held to ``max_bytes`` of the stored size, as a load's bytes are."""
    import pickle
    import torch.distributed.checkpoint as dcp
    from lcckpt.errors import ResourceLimitError
    saved = {"w": torch.ones(4, 4), "b": torch.arange(3.0)}
    if plain:
        dcp.save(saved, checkpoint_id=str(tmp_path / "c"), no_dist=True)
    else:
        ld.save(saved, tmp_path / "c")
    with open(tmp_path / "c" / ".metadata", "rb") as f:
        md = pickle.load(f)                          # the test's own file
    md.state_dict_metadata["w"].size = torch.Size([4096, 4096])   # 64 MiB, a 4x4 chunk
    with open(tmp_path / "c" / ".metadata", "wb") as f:
        pickle.dump(md, f)
    with pytest.raises(ResourceLimitError, match="entries a load adds to its state"):
        ld.load({}, tmp_path / "c", max_bytes=1 << 20)
    whole = {}
    ld.load(whole, tmp_path / "c", max_bytes=None)   # trusted: allowed, the gap zeros
    assert whole["w"].shape == (4096, 4096) and whole["w"][4:].abs().sum() == 0
    assert torch.equal(whole["w"][:4, :4], torch.ones(4, 4))
    md.state_dict_metadata["w"].size = torch.Size([1 << 20, 1 << 20])   # 4 TiB
    with open(tmp_path / "c" / ".metadata", "wb") as f:
        pickle.dump(md, f)
    with pytest.raises(ResourceLimitError, match="entries a load adds"):
        ld.load({}, tmp_path / "c")                  # the default limit


@pytest.mark.slow
def test_a_valid_constant_past_the_stored_size_rule_loads_whole(tmp_path):
    """208 MB of zeros store in a few KB; a whole load of that valid file must not be refused
    by a limit on expansion over the stored size (the memory left bounds it instead)."""
    import os
    ld.save({"z": torch.zeros(52_000_000)}, tmp_path / "c")
    stored = sum(os.path.getsize(tmp_path / "c" / n) for n in os.listdir(tmp_path / "c"))
    assert stored < 1 << 20
    whole = {}
    ld.load(whole, tmp_path / "c")
    assert whole["z"].shape == (52_000_000,) and not whole["z"].any()
