"""The quality benchmark's LoRA fine-tune: adapters start as the identity, only they train,
and the ExCP-style baseline pays nothing for the frozen weights."""

import torch
from torch import nn

from lcckpt.bench.excp import ExcpChain
from lcckpt.bench.finetune import LoRALinear


def _lora(seed=0):
    torch.manual_seed(seed)
    base = nn.Linear(12, 7)
    base.requires_grad_(False)
    return LoRALinear(base, r=3)


def test_adapters_start_as_the_base_layer_and_only_they_learn():
    layer = _lora()
    x = torch.randn(5, 12)
    assert torch.equal(layer(x), layer.base(x))        # lora_B is zeros
    assert layer.lora_A.abs().sum() > 0                 # and lora_A is not
    layer(x).square().sum().backward()
    assert layer.base.weight.grad is None
    assert layer.lora_A.grad.abs().sum() == 0           # through B = 0
    assert layer.lora_B.grad.abs().sum() > 0
    with torch.no_grad():
        layer.lora_B.fill_(0.1)
    assert not torch.allclose(layer(x), layer.base(x))  # the adapter acts once B moves


def _state(layer, opt):
    return {"model": {k: v.detach().clone() for k, v in layer.state_dict().items()},
            "optim": opt.state_dict()}


def test_excp_pays_for_a_frozen_weight_only_when_it_changes():
    layer = _lora(1)
    names = ["lora_A", "lora_B"]        # what the optimizer trains, in order
    opt = torch.optim.Adam([layer.lora_A, layer.lora_B], lr=1e-2)
    x = torch.randn(8, 12)

    def step():
        opt.zero_grad()
        layer(x).square().sum().backward()
        opt.step()

    step()
    chain = ExcpChain(names, alpha=5e-5, beta=2.0)
    chain.save(_state(layer, opt))      # the keyframe
    step()
    _, frozen = chain.save(_state(layer, opt))
    with torch.no_grad():
        layer.base.weight.add_(1.0)     # the "frozen" weight changes after all
    step()
    _, changed = chain.save(_state(layer, opt))
    assert changed - frozen >= layer.base.weight.numel() * 4
    assert frozen < layer.base.weight.numel() * 4
