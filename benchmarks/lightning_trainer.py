"""A PyTorch Lightning run kept by lcckpt.training.lightning: bytes of Lightning's own
checkpoint files against lcckpt's exact files (LcckptCheckpointIO) and the chain
(ChainCallback), and every chain step's held-out accuracy and loss beside the true
model's; then the same run with the chain behind ModelCheckpoint's files
(``LcckptCheckpointIO(chain=...)``), its bytes; Lightning's files of the first run
imported as such a chain (``import_checkpoints(..., replace=True)``), their bytes after;
then once more keeping one file
(``save_top_k=1``, a keyframe every --keyframe-every checkpoints), the disk that files and
chain take at most and at the end, against one of Lightning's files. Needs the `lightning`
extra and scikit-learn.

An MLP (64 -> 512 -> 512 -> 10, AdamW) trains on scikit-learn's digits (1,347 train and
450 held-out images) from scratch for --steps steps, a checkpoint every --every steps,
each kept (``save_top_k=-1``) in Lightning's torch.save format, beside the chain (the
second run's batches come in another order).

    python benchmarks/lightning_trainer.py [--steps 400] [--every 10] [--keyframe-every 10]
                                           [--json out.json]
"""

import argparse
import json
import os
import sys
import tempfile
import warnings

import torch

import lightning as L
from lightning.pytorch.callbacks import Callback, ModelCheckpoint

import lcckpt
from lcckpt.bench.manager import _data
from lcckpt.training.lightning import ChainCallback, LcckptCheckpointIO, import_checkpoints


class MLP(L.LightningModule):
    def __init__(self, width: int = 512, lr: float = 1e-3):
        super().__init__()
        self.save_hyperparameters()
        self.net = torch.nn.Sequential(torch.nn.Linear(64, width), torch.nn.ReLU(),
                                       torch.nn.Linear(width, width), torch.nn.ReLU(),
                                       torch.nn.Linear(width, 10))

    def training_step(self, batch, _):
        x, y = batch
        return torch.nn.functional.cross_entropy(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=self.hparams.lr)


def _score(net, x, y) -> tuple[float, float]:
    with torch.no_grad():
        out = net(x)
    return (100.0 * (out.argmax(1) == y).float().mean().item(),
            torch.nn.functional.cross_entropy(out, y).item())


def _size(d: str) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for f in os.listdir(d))


class _Disk(Callback):
    """The most bytes that ``dirs`` held together after any training batch."""

    def __init__(self, *dirs: str):
        self.dirs, self.most = dirs, 0

    def on_train_batch_end(self, *args) -> None:
        self.most = max(self.most, sum(_size(d) for d in self.dirs if os.path.isdir(d)))


def _keep_one(d: str, loader, steps: int, every: int, keyframe_every: int) -> dict:
    """The run kept as ``save_top_k=1`` with the chain behind the one file: its disk."""
    L.seed_everything(0, verbose=False)
    io = LcckptCheckpointIO(chain=f"{d}/one-chain", keyframe_every=keyframe_every)
    disk = _Disk(f"{d}/one", f"{d}/one-chain")
    L.Trainer(max_steps=steps, accelerator="cpu", devices=1, logger=False,
              enable_progress_bar=False, enable_model_summary=False, plugins=[io],
              callbacks=[ModelCheckpoint(dirpath=f"{d}/one", every_n_train_steps=every,
                                         save_top_k=1), disk],
              default_root_dir=d).fit(MLP(), loader)
    io.teardown()
    end = _size(f"{d}/one") + _size(f"{d}/one-chain")
    return {"one_most_bytes": max(disk.most, end), "one_end_bytes": end,
            "one_chain_steps": len(lcckpt.DeltaCheckpointer(f"{d}/one-chain").steps())}


def run(steps: int = 400, every: int = 10, keyframe_every: int = 10) -> dict:
    x, y = _data()
    g = torch.Generator().manual_seed(0)
    perm = torch.randperm(len(y), generator=g)
    test, train = perm[:450], perm[450:]
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x[train], y[train]),
                                         batch_size=64, shuffle=True, generator=g)
    with tempfile.TemporaryDirectory() as d:
        L.seed_everything(0, verbose=False)
        model = MLP()
        own = ModelCheckpoint(dirpath=f"{d}/files", every_n_train_steps=every, save_top_k=-1)
        chain = ChainCallback(f"{d}/chain")
        trainer = L.Trainer(max_steps=steps, accelerator="cpu", devices=1, logger=False,
                            enable_progress_bar=False, enable_model_summary=False,
                            callbacks=[own, chain], default_root_dir=d)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            trainer.fit(model, loader)
        io = LcckptCheckpointIO()
        rows, exact_bytes = [], 0
        net = MLP().net
        for name in sorted(os.listdir(f"{d}/files"),
                           key=lambda n: int(n.split("step=")[1][:-5])):
            true = torch.load(f"{d}/files/{name}", weights_only=False)
            io.save_checkpoint(true, f"{d}/exact.ckpt")
            exact_bytes += os.path.getsize(f"{d}/exact.ckpt")
            step = true["global_step"]
            restored = lcckpt.DeltaCheckpointer(f"{d}/chain").load(step)
            scores = []
            for sd in (true["state_dict"], restored["state_dict"]):
                net.load_state_dict({k.removeprefix("net."): v for k, v in sd.items()})
                scores.append(_score(net, x[test], y[test]))
            rows.append({"step": step, "true_acc": scores[0][0], "restored_acc": scores[1][0],
                         "true_loss": scores[0][1], "restored_loss": scores[1][1]})
        files, chain_bytes = _size(f"{d}/files"), _size(f"{d}/chain")
        # Lightning's files once more, imported as a chain and rewritten as the plugin's
        import_checkpoints([os.path.join(f"{d}/files", n) for n in os.listdir(f"{d}/files")],
                           f"{d}/imported", replace=True)
        imported_bytes = _size(f"{d}/files") + _size(f"{d}/imported")
        # the same run once more, the chain behind ModelCheckpoint's files (chain=...)
        L.seed_everything(0, verbose=False)
        behind = LcckptCheckpointIO(chain=f"{d}/behind-chain")
        L.Trainer(max_steps=steps, accelerator="cpu", devices=1, logger=False,
                  enable_progress_bar=False, enable_model_summary=False, plugins=[behind],
                  callbacks=[ModelCheckpoint(dirpath=f"{d}/behind", every_n_train_steps=every,
                                             save_top_k=-1)],
                  default_root_dir=d).fit(MLP(), loader)
        behind_bytes = _size(f"{d}/behind") + _size(f"{d}/behind-chain")
        one = _keep_one(d, loader, steps, every, keyframe_every)
    worst_drop = max(r["true_acc"] - r["restored_acc"] for r in rows)
    changes = [r["restored_loss"] / r["true_loss"] - 1 for r in rows]
    return {"steps": steps, "every": every, "checkpoints": len(rows),
            "lightning_bytes": files, "lcckpt_exact_bytes": exact_bytes,
            "chain_bytes": chain_bytes, "exact_ratio": files / exact_bytes,
            "behind_bytes": behind_bytes, "behind_ratio": files / behind_bytes,
            "imported_bytes": imported_bytes, "imported_ratio": files / imported_bytes,
            "chain_ratio": files / chain_bytes, "worst_acc_drop": worst_drop,
            "worst_loss_rise": max(changes), "worst_loss_change": max(map(abs, changes)),
            "lightning_file_bytes": files // len(rows), **one, "per_step": rows}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=400)
    ap.add_argument("--every", type=int, default=10)
    ap.add_argument("--keyframe-every", type=int, default=10)
    ap.add_argument("--json", metavar="PATH")
    a = ap.parse_args(argv)
    r = run(a.steps, a.every, a.keyframe_every)
    print(f"{r['checkpoints']} checkpoints: Lightning's files {r['lightning_bytes']:,} bytes; "
          f"lcckpt exact files {r['lcckpt_exact_bytes']:,} ({r['exact_ratio']:.2f}x smaller); "
          f"chain {r['chain_bytes']:,} ({r['chain_ratio']:.1f}x smaller); files of "
          f"LcckptCheckpointIO(chain=...) and their chain {r['behind_bytes']:,} "
          f"({r['behind_ratio']:.1f}x smaller)")
    print(f"chain restores: worst accuracy drop {r['worst_acc_drop']:.2f} points; held-out "
          f"loss worst rise {100 * r['worst_loss_rise']:+.2f}%, worst change either way "
          f"{100 * r['worst_loss_change']:.2f}% (450 held-out digits)")
    print(f"Lightning's files imported as a chain and rewritten (import_checkpoints(..., "
          f"replace=True)): files and chain {r['imported_bytes']:,} bytes "
          f"({r['imported_ratio']:.1f}x smaller)")
    print(f"save_top_k=1, chain behind the file (keyframe_every={a.keyframe_every}): files and "
          f"chain {r['one_most_bytes']:,} bytes at most, {r['one_end_bytes']:,} at the end "
          f"({r['one_chain_steps']} chain steps); one Lightning file {r['lightning_file_bytes']:,}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(r, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
