"""Per-tensor error targets by role: what a checkpoint's tensors need to restore well.

A target bounds ``||u - ũ||₂``, the L2 error of a restored tensor, by a share of its
*movement* since the chain's keyframe (``relative_to="movement"``, the default:
lcckpt/codec/movement.py) or of its own norm (``"norm"``). Movement is what training changed:
a fine-tune moves a pretrained encoder by about 1% of its norm, so a share of the norm
would let the error swallow the fine-tune, while a share of the movement keeps it, and
for a model trained from scratch, which moves by its own size, the two agree. Weights
are held to 0.007 of their movement. Their restored error is steered orthogonal to their
optimizer's first moment where the state holds one (lcckpt/chain/moments.py): with the
least-squares restore step, late in a run from scratch, when the movement since the
keyframe is about the tensor's size and the loss is small, 0.005 let the held-out loss
of a restore drift by up to 1.04% (a digits CNN) and 0.01 by up to 3%; steered, 0.007
by 0.65% and 0.01 by 0.70% (docs/chain.md, docs/algorithm.md §7b). Early in a chain the
movement is an update or two, and a share of it held each early delta to that share of
itself (at 0.003, a digits CNN's weights took 18 bits an element in its first delta, 10
in its third), where the restores moved the loss by hundredths of a percent. Every
tensor's error may therefore also reach ``update`` (0.05) of the update its delta sends,
``||u - ũ_prev||₂``: the first delta of a digits CNN from scratch costs a quarter of what
it did, a MiniLM fine-tune's 7.9 MB instead of 30 MB, with the same worst accuracy drop
(docs/chain.md). Once the movement passes 7 updates, 0.007 of it rules.

A model's weights decide the accuracy of a restored model; an optimizer's first moment
(SGD's ``momentum_buffer``, Adam's ``exp_avg``) is renewed within a few dozen steps after
a resume, so a coarse copy costs little (the digits CNN's runs resumed ten times from
copies at 0.8 end where uninterrupted ones do; a short AdamW fine-tune resumed once ends
up to a few percent of held-out loss above, 0.3 narrows that at more bytes: docs/chain.md,
"Resuming an AdamW fine-tune"; bf16/fp16 ones are held to
:data:`LOW_PRECISION_FIRST_MOMENT`); a second moment (``exp_avg_sq``) scales every
step and changes slowly; the quantizer never restores it below a quarter of its value.
:class:`RolePolicy` maps a key path (``obj["model"]["fc1.weight"]``,
``obj["optim"]["state"][4]["exp_avg"]``) to the relative L2 target of its role; it is
what ``DeltaCheckpointer(directory)`` uses by default. It knows nothing of coding: the chain hands the target to the quantizer.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

from ..errors import InvalidArgumentError

__all__ = ["RolePolicy", "DEFAULT_POLICY", "RESUMABLE", "LOW_PRECISION_FIRST_MOMENT",
           "low_precision_target", "role_of"]

# A first moment stored in bf16/fp16 is held to at most this share of its movement,
# whatever the policy's: a run whose weights live in that precision moves a weight only
# where the update reaches half an ulp, and the momentum carries the rest. Resumed ten
# times from copies at 0.8, a bf16 MiniLM fine-tune ended 8.8 points below the
# uninterrupted run (mean of 5 seeds); at 0.3, 1.1 points above it (docs/chain.md).
LOW_PRECISION_FIRST_MOMENT = 0.3

_FIRST = re.compile(r'\["(momentum_buffer|exp_avg|momentum|mu)"\]$')
_SECOND = re.compile(r'\["(exp_avg_sq|max_exp_avg_sq|square_avg|sum|acc_delta|exp_inf)"\]$')


def low_precision_target(target, key_path: str) -> float | None:
    """The movement share a bf16/fp16 tensor at ``key_path`` is held to at most under
    ``target`` (a first moment's :data:`LOW_PRECISION_FIRST_MOMENT`), None: the target's."""
    if getattr(target, "relative_to", None) == "movement" and role_of(key_path) == "first_moment":
        return LOW_PRECISION_FIRST_MOMENT
    return None


def role_of(key_path: str) -> str:
    """"first_moment", "second_moment" or "weight" (everything else) for a key path."""
    if _FIRST.search(key_path):
        return "first_moment"
    if _SECOND.search(key_path):
        return "second_moment"
    return "weight"


@dataclass(frozen=True)
class RolePolicy:
    """L2 targets by role, per tensor: ``||u - ũ||₂ <= t·||u - k||₂`` with ``k`` the
    tensor at the chain's keyframe (``relative_to="movement"``), or ``<= t·||u||₂``
    (``relative_to="norm"``). With movement, ``update``: whatever the role, the error may
    also reach this share of the update the delta sends (0: the movement alone)."""

    weight: float = 0.007
    first_moment: float = 0.8
    second_moment: float = 0.1
    relative_to: str = "movement"
    update: float = 0.05

    def __post_init__(self):
        for name in ("weight", "first_moment", "second_moment", "update"):
            t = getattr(self, name)
            if isinstance(t, bool) or not isinstance(t, (int, float)) or not math.isfinite(t) \
                    or not 0 <= t < 1:
                raise InvalidArgumentError(f"{name} target must be in [0, 1), got {t!r}")
        if self.relative_to not in ("movement", "norm"):
            raise InvalidArgumentError(
                f"relative_to must be 'movement' or 'norm', got {self.relative_to!r}")

    def __call__(self, key_path: str) -> float:
        return getattr(self, role_of(key_path))

    def describe(self) -> dict:
        return {"weight": self.weight, "first_moment": self.first_moment,
                "second_moment": self.second_moment, "relative_to": self.relative_to,
                "update": self.update}


DEFAULT_POLICY = RolePolicy()

# For a chain that a run resumes from, with nothing exact beside it. Resumed from a chain
# whose first moments were held to 0.8 of their movement, an AdamW fine-tune ended
# 0.95-6.18% of held-out loss above the uninterrupted run; at 0.3, 0.12-2.84%, for 6% more
# bytes (docs/chain.md, "Resuming an AdamW fine-tune").
RESUMABLE = RolePolicy(first_moment=0.3)
