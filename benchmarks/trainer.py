"""A Hugging Face Trainer fine-tune kept by lcckpt.training.hf.ChainCallback: bytes against
the Trainer's own checkpoints, every restored step's held-out accuracy, save times; see
lcckpt/bench/trainer.py. Needs the `.[finetune,hf]` extras.

    python benchmarks/trainer.py [--steps 60] [--save-steps 5] [--lr 5e-5] [--json out.json]
        [--background | --replace] [--resume STEP ...] [--first-moment T]

--resume: the run resumed from those chain steps and from exact copies of them, and
where each resumed run ends against the uninterrupted one.
"""

import sys

from lcckpt.bench.trainer import main

if __name__ == "__main__":
    sys.exit(main())
