"""Lightning's checkpoint files written by lcckpt: ``Trainer(plugins=[LcckptCheckpointIO()])``.

Lightning writes every checkpoint (``ModelCheckpoint``'s top-k and ``last.ckpt``,
``trainer.save_checkpoint``) through the trainer's ``CheckpointIO`` and reads it back the
same way for ``trainer.fit(ckpt_path=...)``. This one writes with :func:`lcckpt.save`
(no pickle, checksummed, written atomically; with ``compress=True``, the default, every
tensor is coded bit-exactly, 1.2x smaller in fp32 and 1.5x in bf16) and reads with
:func:`lcckpt.load`, which also reads Lightning's own ``torch.save`` checkpoints with the
weights-only unpickler: a run can switch to it and resume from its old checkpoints.

Two things differ from Lightning's files:

* ``hyper_parameters`` is stored as a plain ``dict`` (Lightning keeps an ``AttributeDict``,
  a ``dict`` subclass only pickle stores); a value that lcckpt does not store (an
  ``nn.Module`` passed to ``save_hyperparameters``) is refused by name at the save.
* ``LightningModule.load_from_checkpoint`` calls ``torch.load`` itself, not the trainer's
  ``CheckpointIO``, so it cannot read these files: :func:`load_module` does its work for
  the common case (the module built from its saved hyperparameters, its
  ``on_load_checkpoint`` hook called, then its weights loaded).

Paths may be fsspec URLs, as with Lightning's own ``CheckpointIO``: a local path is written
atomically (a temporary file renamed over it), a URL through ``fsspec``'s file object.
"""

from __future__ import annotations

import os
from typing import Any

from lightning.fabric.plugins.io.checkpoint_io import CheckpointIO
from lightning.fabric.utilities.cloud_io import get_filesystem
from lightning.fabric.utilities.data import AttributeDict

from ..errors import InvalidArgumentError
from ..format.serialization import load, save

__all__ = ["LcckptCheckpointIO", "load_module"]

HPARAMS = "hyper_parameters"


class LcckptCheckpointIO(CheckpointIO):
    """A Lightning ``CheckpointIO`` that saves with :func:`lcckpt.save` and loads with
    :func:`lcckpt.load` (see the module's notes). ``compress``: code tensors bit-exactly
    (smaller files, a little more time); ``False`` stores their bytes as they are."""

    def __init__(self, compress: bool = True):
        if type(compress) is not bool:
            raise InvalidArgumentError(f"compress must be True or False, got {compress!r}")
        self.compress = compress

    def save_checkpoint(self, checkpoint: dict[str, Any], path, storage_options=None) -> None:
        if storage_options is not None:
            raise TypeError(f"{type(self).__name__} takes no storage_options (got "
                            f"{storage_options!r}): the file is written whole, as it is")
        state = dict(checkpoint)
        if isinstance(state.get(HPARAMS), AttributeDict):
            state[HPARAMS] = dict(state[HPARAMS])
        path, fs = str(path), get_filesystem(path)
        if _local(fs):
            os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
            save(state, path, compress=self.compress)
            return
        fs.makedirs(os.path.dirname(path), exist_ok=True)
        with fs.open(path, "wb") as f:
            save(state, f, compress=self.compress)

    def load_checkpoint(self, path, map_location=None, weights_only=None) -> dict[str, Any]:
        """The checkpoint at ``path`` (an lcckpt file, or a Lightning ``torch.save``
        checkpoint read weights-only; ``weights_only=False`` is refused for those, as
        :func:`lcckpt.load` refuses it). ``FileNotFoundError`` if there is none."""
        path, fs = str(path), get_filesystem(path)
        if not fs.exists(path):
            raise FileNotFoundError(f"Checkpoint file not found: {path}")
        kw = {} if weights_only is None else {"weights_only": weights_only}
        if _local(fs):
            return load(path, map_location=map_location, **kw)
        with fs.open(path, "rb") as f:
            return load(f, map_location=map_location, **kw)

    def remove_checkpoint(self, path) -> None:
        fs = get_filesystem(path)
        if fs.exists(str(path)):
            fs.rm(str(path), recursive=True)


def _local(fs) -> bool:
    return "file" in (fs.protocol if isinstance(fs.protocol, tuple) else (fs.protocol,))


def load_module(cls, path, map_location=None, strict: bool = True, **kwargs):
    """``cls.load_from_checkpoint(path, ...)`` for a checkpoint of this plugin (or any file
    :func:`lcckpt.load` reads): ``cls`` built from the saved ``hyper_parameters`` updated
    by ``kwargs``, its ``on_load_checkpoint(checkpoint)`` called, its ``state_dict``
    loaded (``strict`` as in ``load_state_dict``); in eval mode, on the CPU unless
    ``map_location`` says otherwise. (Lightning's own also handles a datamodule's
    hyperparameters and a module saved under another name; this does not.)"""
    checkpoint = load(path, map_location="cpu" if map_location is None else map_location)
    if not isinstance(checkpoint, dict) or "state_dict" not in checkpoint:
        raise InvalidArgumentError(f"{path} holds no Lightning checkpoint (no 'state_dict')")
    model = cls(**{**dict(checkpoint.get(HPARAMS) or {}), **kwargs})
    model.on_load_checkpoint(checkpoint)
    model.load_state_dict(checkpoint["state_dict"], strict=strict)
    return model.eval()
