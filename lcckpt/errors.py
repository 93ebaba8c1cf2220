"""The exceptions lcckpt raises.

One base, :class:`LcckptError`, so that ``except lcckpt.LcckptError`` catches every
failure of ours; subclasses say what kind of problem it is. Messages name what was
found and what to do about it.
"""


class LcckptError(Exception):
    """Base class of every error lcckpt raises on purpose."""


class CorruptDataError(LcckptError):
    """A blob or file is damaged: bad magic, bad header, offsets out of range, bad code."""


class TruncatedError(CorruptDataError):
    """A blob or file ends before the data its header promises."""


class ChecksumError(CorruptDataError):
    """Stored bytes do not match their recorded checksum."""


class UnsupportedVersionError(LcckptError):
    """The data was written by a format version this build cannot read."""


class BrokenChainError(LcckptError):
    """A delta checkpoint's base is missing, damaged or not the one it was made against."""


class UnsafeObjectError(LcckptError):
    """A value cannot be stored or loaded without running arbitrary code."""


class UnsupportedDtypeError(LcckptError, TypeError):
    """The array's dtype is not one this operation handles."""


class NonFiniteError(LcckptError, ValueError):
    """An array or delta to be coded lossily holds NaN or Inf, which no quantizer can bound."""


class InvalidArgumentError(LcckptError, ValueError):
    """An argument is out of its allowed range."""


class NotFoundError(LcckptError, FileNotFoundError):
    """A file or directory the call needs does not exist: a missing step, an empty or
    foreign checkpoint directory, a missing parent directory. Also a FileNotFoundError,
    so code written against the built-in exception keeps working."""


class StorageError(LcckptError, OSError):
    """Reading or writing failed in the operating system (permissions, a full disk);
    the message names the user's path, not a temp file."""


class ResourceLimitError(LcckptError):
    """Loading would take more memory or work than the caller allows (a decompression
    bomb, an oversized header); raise the limit only for input you trust."""


class ConcurrentWriteError(LcckptError):
    """Another writer (process, object or thread) is writing the same checkpoint
    directory; one writer at a time is allowed."""


class NotCopiedError(LcckptError, TypeError):
    """An object bound to this process (a checkpointer, a manager) was pickled or copied:
    make a new one from its directory where it is needed."""


class StateChangedError(LcckptError):
    """A tensor was changed in place, by something other than an optimizer's step, while
    a checkpoint was written from the live state (``CheckpointManager(...,
    background="overlap")``); that checkpoint was removed."""


class PeerRestoreError(LcckptError):
    """Under DDP, the writer's restore failed (``CheckpointManager.restore``, where the
    writer alone reads the checkpoint and sends it); raised on the other ranks with the
    writer's error, which the writer raises itself."""


class DistributedCheckpointError(LcckptError):
    """A distributed save or load failed on some rank; ``failures`` maps rank -> exception.

    torch.distributed.checkpoint reports such failures as a ``CheckpointException``, which
    derives from ``BaseException`` and so slips past ``except Exception``; this one does not.
    """

    def __init__(self, msg: str, failures: dict | None = None):
        super().__init__(msg)
        self.failures = dict(failures or {})


def proves_damage(e: BaseException) -> bool:
    """Whether a failed restore proves its file damaged (so setting it aside is right):
    corrupt data or a broken chain link, with no unreadable file, limit, newer format or
    exhausted memory (a decode that ran out of it is reported as the file's failure)
    anywhere in its causes."""
    seen, x = [], e
    while x is not None and len(seen) < 16:
        seen.append(x)
        x = x.__cause__
    if any(isinstance(x, (ResourceLimitError, UnsupportedVersionError, MemoryError)) or
           (isinstance(x, OSError) and not isinstance(x, FileNotFoundError))
           for x in seen):
        return False
    return isinstance(e, (CorruptDataError, BrokenChainError))
