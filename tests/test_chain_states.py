"""A state machine of DeltaCheckpointer: saves, merges, retention, reopening and loads in
any order, checked against a model of what each step holds.

The model is what a step loaded the first time, right after its save (the writer's own
reconstruction, lossy where the defaults are lossy). Whatever happens afterwards — more
saves, ``merge`` of any step, ``keep_last`` deleting old files, the writer closed and
reopened — a step that is still on disk must load bit for bit as it did then; the newest
``keep_last`` steps are always on disk; tensors the chain stores exactly (integers, small
floats) load as saved.
"""

import shutil
import tempfile
import warnings

import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule
from helpers import same_bits

from lcckpt import DeltaCheckpointer


def _flat(obj, prefix=""):
    if isinstance(obj, dict):
        for k in sorted(obj):
            yield from _flat(obj[k], f"{prefix}/{k}")
    else:
        yield prefix, obj


def _same(a, b) -> bool:
    fa, fb = list(_flat(a)), list(_flat(b))
    if [k for k, _ in fa] != [k for k, _ in fb]:
        return False
    for (_, x), (_, y) in zip(fa, fb):
        if isinstance(x, torch.Tensor):
            if not (isinstance(y, torch.Tensor) and same_bits(x, y)):
                return False
        elif x != y:
            return False
    return True


class ChainMachine(RuleBasedStateMachine):
    def __init__(self):
        super().__init__()
        self.dir = tempfile.mkdtemp(prefix="lcckpt-states-")
        self.ck = None
        self.model: dict[int, dict] = {}      # step -> what it loaded right after its save
        self.saved: dict[int, dict] = {}      # step -> what was saved
        self.state: dict | None = None
        self.gen = torch.Generator().manual_seed(0)

    @initialize(keep_last=st.sampled_from([None, 1, 2, 3]),
                keyframe_every=st.sampled_from([None, 2, 3, 5]),
                seed=st.integers(0, 2**16))
    def open(self, keep_last, keyframe_every, seed):
        self.options = {"keep_last": keep_last, "keyframe_every": keyframe_every}
        self.ck = DeltaCheckpointer(self.dir, **self.options)
        self.gen.manual_seed(seed)
        self.state = {"w": torch.randn(5000, generator=self.gen),
                      "b": torch.randn(3, generator=self.gen),
                      "n": torch.tensor(0), "lr": 0.1}

    def _next(self) -> int:
        return max(self.model, default=-1) + 1

    @rule(scale=st.sampled_from([0.0, 1e-4, 1e-2, 1.0]),
          change=st.sampled_from(["none", "add", "remove", "resize"]))
    def save(self, scale, change):
        s = {k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in self.state.items()}
        s["w"] = s["w"] + scale * torch.randn(s["w"].shape, generator=self.gen)
        s["b"] = s["b"] + scale * torch.randn(s["b"].shape, generator=self.gen)
        s["n"] = s["n"] + 1
        if change == "add":
            s[f"x{self._next()}"] = torch.randn(2, generator=self.gen)
        elif change == "remove":
            extra = [k for k in s if k.startswith("x")]
            if extra:
                del s[extra[0]]
        elif change == "resize":
            s["w"] = torch.randn(5000 + (self._next() % 3) * 8, generator=self.gen)
        step = self._next()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)
            self.ck.save(step, s)
        self.state = s
        self.saved[step] = s
        self.model[step] = self.ck.load(step)

    @precondition(lambda self: self.model)
    @rule(data=st.data())
    def merge(self, data):
        steps = self.ck.steps()
        if steps:
            self.ck.merge(data.draw(st.sampled_from(steps)))

    @rule()
    def reopen(self):
        self.ck.close()
        self.ck = DeltaCheckpointer(self.dir, **self.options)

    @precondition(lambda self: self.model)
    @rule(data=st.data(), fresh=st.booleans())
    def load(self, data, fresh):
        steps = self.ck.steps()
        if not steps:
            return
        step = data.draw(st.sampled_from(steps))
        reader = DeltaCheckpointer(self.dir) if fresh else self.ck
        got = reader.load(step)
        assert _same(got, self.model[step]), step

    @invariant()
    def newest_steps_kept_and_exact_parts_exact(self):
        if self.ck is None or not self.model:
            return
        steps = self.ck.steps()
        newest = sorted(self.model)[-(self.options["keep_last"] or len(self.model)):]
        assert set(newest) <= set(steps), (newest, steps)
        last = max(self.model)
        got, saved = self.model[last], self.saved[last]
        assert got.keys() == saved.keys()
        for k, v in saved.items():
            if isinstance(v, torch.Tensor) and (v.numel() < 8 or not v.is_floating_point()):
                assert same_bits(got[k], v), k          # packed: exact delta or lossless
            elif not isinstance(v, torch.Tensor):
                assert got[k] == v

    def teardown(self):
        if self.ck is not None:
            self.ck.close()
        shutil.rmtree(self.dir, ignore_errors=True)


ChainMachine.TestCase.settings = settings(
    max_examples=40, stateful_step_count=15, deadline=None,
    suppress_health_check=[HealthCheck.too_slow])
test_chain_state_machine = ChainMachine.TestCase
