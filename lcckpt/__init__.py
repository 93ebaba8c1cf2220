"""lcckpt: small, fault-tolerant deep-learning checkpoints.

The public API is re-exported here; nothing else lives in this module.
"""

from .errors import (
    BrokenChainError,
    ChecksumError,
    CorruptDataError,
    InvalidArgumentError,
    LcckptError,
    NonFiniteError,
    TruncatedError,
    UnsafeObjectError,
    UnsupportedDtypeError,
    UnsupportedVersionError,
    NotFoundError,
    StorageError,
    ResourceLimitError,
    ConcurrentWriteError,
)

__version__ = "0.1.0"

from .config import CodecConfig
from .codec import EncodeStats, decode, encode, warmup
from .delta import DeltaDecoder, DeltaEncoder
from .serialization import load, read_metadata, register_codec, register_section_codec, save
from .safetensors_io import load_safetensors, save_safetensors
from .convert import convert
from .reader import Reader, open  # noqa: A001  (lcckpt.open, like safetensors.safe_open)
from .chain import DeltaCheckpointer
from .policy import DEFAULT_POLICY, RolePolicy
from .manager import CheckpointManager
from . import schedule
