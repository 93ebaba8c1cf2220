"""Make real torch.save checkpoints of a small transformer being fine-tuned, to try
``lcckpt bench --checkpoint`` and ``lcckpt convert`` on files like your own.

No download: a 4-layer ``torch.nn.TransformerEncoder`` (d_model 128, about 0.8M
parameters) is pre-trained on a toy task (is a token sequence's sum even?), then
fine-tuned with Adam on another (does token 7 occur?), and a full checkpoint (model,
optimizer, step) is written with torch.save every ``--every`` fine-tuning steps.

    python benchmarks/transformer_checkpoints.py OUT_DIR [--files 4] [--every 20]
    lcckpt bench --checkpoint OUT_DIR/ft-*.pt --json bench-out/transformer.json
"""

import argparse
import os
import sys

import torch
from torch import nn

VOCAB, LENGTH = 32, 24


class Classifier(nn.Module):
    def __init__(self, d=128, layers=4, heads=4):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, d)
        self.pos = nn.Parameter(torch.randn(LENGTH, d) * 0.02)
        layer = nn.TransformerEncoderLayer(d, heads, 4 * d, dropout=0.0, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.head = nn.Linear(d, 2)

    def forward(self, x):
        return self.head(self.encoder(self.embed(x) + self.pos).mean(1))


def _batch(task: str, n=64):
    x = torch.randint(0, VOCAB, (n, LENGTH))
    y = (x.sum(1) % 2) if task == "parity" else (x == 7).any(1).long()
    return x, y


def _train(net, opt, task, steps):
    for _ in range(steps):
        x, y = _batch(task)
        opt.zero_grad()
        nn.functional.cross_entropy(net(x), y).backward()
        opt.step()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out_dir")
    ap.add_argument("--files", type=int, default=4, help="fine-tuning checkpoints to write")
    ap.add_argument("--every", type=int, default=20, help="fine-tuning steps between them")
    ap.add_argument("--pretrain", type=int, default=100, help="pre-training steps")
    args = ap.parse_args(argv)
    torch.manual_seed(0)
    os.makedirs(args.out_dir, exist_ok=True)
    net = Classifier()
    print(f"{sum(p.numel() for p in net.parameters()):,} parameters; pre-training "
          f"{args.pretrain} steps", file=sys.stderr)
    _train(net, torch.optim.AdamW(net.parameters(), lr=3e-4), "parity", args.pretrain)
    opt = torch.optim.Adam(net.parameters(), lr=1e-4)
    for i in range(args.files):
        _train(net, opt, "has7", args.every)
        path = os.path.join(args.out_dir, f"ft-{(i + 1) * args.every:05d}.pt")
        torch.save({"model": net.state_dict(), "optimizer": opt.state_dict(),
                    "step": (i + 1) * args.every}, path)
        x, y = _batch("has7", 512)
        with torch.no_grad():
            acc = float((net(x).argmax(1) == y).float().mean())
        print(f"{path}: fine-tuning step {(i + 1) * args.every}, accuracy {acc:.3f}",
              file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
