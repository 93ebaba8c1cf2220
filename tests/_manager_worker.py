"""A small training run under CheckpointManager, to be killed and resumed by test_manager.py.

Usage: _manager_worker.py DIR OUT STEPS MODE KILL
  MODE  "exact" (every checkpoint an exact keyframe) or "lossy" (the default delta chain)
  KILL  "none"; "at:N" (SIGKILL itself right after iteration N); "save:N" (SIGKILL itself
        while the background save of a checkpoint at or after iteration N is writing its
        file; from N on it checkpoints every iteration until then); "sigterm" (installs
        the SIGTERM handler and reports each iteration on stdout so the parent can signal
        it mid-run)
Writes OUT (a torch file: final model state, test accuracy and loss, resumed-from step) when
it finishes. Deterministic: one thread, seeded generators, so an uninterrupted run and a
resumed exact run give bit-identical weights.
"""

import os
import signal
import sys
import threading
import time

import torch
from sklearn.datasets import load_digits
from torch import nn
from torch.nn import functional as F

from lcckpt.training.manager import CheckpointManager

torch.set_num_threads(1)
BATCH = 32


def data():
    d = load_digits()
    x = torch.tensor(d.data, dtype=torch.float32) / 16.0
    y = torch.tensor(d.target, dtype=torch.long)
    g = torch.Generator().manual_seed(0)
    perm = torch.randperm(len(x), generator=g)
    x, y = x[perm], y[perm]
    return x[:1300], y[:1300], x[1300:], y[1300:]


def main(directory, out, steps, mode, kill):
    x_tr, y_tr, x_te, y_te = data()
    torch.manual_seed(1)
    model = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Dropout(0.1), nn.Linear(128, 10))
    opt = torch.optim.Adam(model.parameters(), lr=2e-3)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=100, gamma=0.7)
    shuffle = torch.Generator().manual_seed(2)
    # exact: every checkpoint a raw keyframe, and the loop waits for a busy writer, so that a
    # checkpoint every 20 iterations is durable by the time of a kill 20 iterations later
    opts = ({"keyframe_every": 1, "checkpointer_options": {"keyframe_coding": "raw"},
             "backpressure": "wait"} if mode == "exact" else {})
    mgr = CheckpointManager(directory, model, opt, every=20, scheduler=sched,
                            objects={"shuffle": shuffle}, extra={"epoch": 0, "pos": 0},
                            sigterm=(kill == "sigterm"), **opts)
    with mgr:
        start = mgr.restore()
        resumed_from = start
        start = start or 0
        order = torch.randperm(len(x_tr), generator=shuffle) if start == 0 else mgr.extra["order"]
        kill_at = int(kill.split(":")[1]) if ":" in kill else None
        for it in range(start, steps):
            pos = mgr.extra["pos"]
            if pos + BATCH > len(order):          # next epoch
                order = torch.randperm(len(x_tr), generator=shuffle)
                mgr.extra["epoch"] += 1
                pos = 0
            idx = order[pos:pos + BATCH]
            mgr.extra["pos"] = pos + BATCH
            mgr.extra["order"] = order
            model.train()
            loss = F.cross_entropy(model(x_tr[idx]), y_tr[idx])
            opt.zero_grad()
            loss.backward()
            opt.step()
            sched.step()
            took = mgr.step(loss)
            if kill == "sigterm":
                print(f"it {it + 1}", flush=True)
                time.sleep(0.005)
            if kill.startswith("at:") and it + 1 == kill_at:
                os.kill(os.getpid(), signal.SIGKILL)
            if kill.startswith("save:") and it + 1 >= kill_at:
                if not took:               # do not depend on the plan's timing: save now
                    mgr.checkpoint()
                kill_while_writing(directory, mgr)
            if kill.startswith("save:") and it + 2 == kill_at:
                mgr.wait()                 # every save so far durable; the next never will be
                hold_renames()
    model.eval()
    with torch.no_grad():
        logits = model(x_te)
    torch.save({"model": model.state_dict(), "resumed_from": resumed_from,
                "accuracy": float((logits.argmax(1) == y_te).float().mean()),
                "loss": float(F.cross_entropy(logits, y_te))}, out)


def hold_renames():
    """From now on a checkpoint's temp file is never renamed into place: the writing thread
    waits there, its file open on disk, until the kill. Without this the kill could land
    just after a small file's rename (the save done, nothing cut short)."""
    real = os.replace

    def held(src, dst, *args, **kwargs):
        if str(src).endswith(".lcckpt-tmp"):
            threading.Event().wait()
        return real(src, dst, *args, **kwargs)
    os.replace = held


def kill_while_writing(directory, mgr):
    """SIGKILL this process as soon as the save in flight has a temp file on disk."""
    while mgr.durable_step != mgr.last_checkpoint:
        if any(n.endswith(".lcckpt-tmp") for n in os.listdir(directory)):
            print(f"killed while writing step {mgr.last_checkpoint}", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)
    print(f"save of step {mgr.last_checkpoint} finished before a temp file was seen", flush=True)


if __name__ == "__main__":
    d, o, n, m, k = sys.argv[1:6]
    main(d, o, int(n), m, k)
