"""lcckpt: small, fault-tolerant deep-learning checkpoints.

The public API is re-exported here; nothing else lives in this module.
"""

from .errors import (
    BrokenChainError, ChecksumError, CorruptDataError, InvalidArgumentError, LcckptError,
    NonFiniteError, TruncatedError, UnsafeObjectError, UnsupportedDtypeError,
    UnsupportedVersionError, NotFoundError, StorageError, ResourceLimitError,
    ConcurrentWriteError, StateChangedError, PeerRestoreError, NotCopiedError,
)

__version__ = "0.1.0"

from .codec.config import CodecConfig
from .codec.tensor import EncodeStats, decode, encode
from .codec.delta import DeltaDecoder, DeltaEncoder
from .format.serialization import read_metadata, register_codec, register_section_codec, save
from .interop.follow import load
from .format.safetensors_io import load_safetensors, save_safetensors
from .interop.convert import convert
from .interop.reader import Reader, open  # noqa: A001  (lcckpt.open, like safetensors.safe_open)
from .chain.checkpointer import DeltaCheckpointer
from .chain.warm import warmup
from .chain.policy import DEFAULT_POLICY, RolePolicy
from .training.manager import CheckpointManager
from . import schedule

# What ``from lcckpt import *`` gives: not ``open``, which would shadow the builtin.
__all__ = [
    "BrokenChainError", "ChecksumError", "ConcurrentWriteError", "CorruptDataError",
    "InvalidArgumentError", "LcckptError", "NonFiniteError", "NotCopiedError", "NotFoundError",
    "PeerRestoreError", "ResourceLimitError", "StateChangedError", "StorageError",
    "TruncatedError", "UnsafeObjectError", "UnsupportedDtypeError", "UnsupportedVersionError",
    "CheckpointManager", "CodecConfig", "DEFAULT_POLICY", "DeltaCheckpointer", "DeltaDecoder",
    "DeltaEncoder", "EncodeStats", "Reader", "RolePolicy", "convert", "decode", "encode",
    "load", "load_safetensors", "read_metadata", "register_codec", "register_section_codec",
    "save", "save_safetensors", "schedule", "warmup",
]
