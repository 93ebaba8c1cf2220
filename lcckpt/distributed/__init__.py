"""Balanced, compressed checkpoints on torch.distributed.checkpoint (DCP).

Every data-parallel rank holds the same replicated state; here each rank compresses and writes
a balanced share of it (large tensors cut into row ranges), and sharded state (DTensor,
FSDP2) is written by its owners, all through DCP's own save protocol, metadata and
resharding. Import it explicitly (``import lcckpt.distributed``): it imports
``torch.distributed``.
"""

from .api import DistributedCheckpointer, async_save, load, save
from .partition import Assignment, History, Item, Piece, partition
from .planner import BalancedSavePlanner, SafeLoadPlanner
from .storage import CompressedReader, CompressedWriter, LcckptStorageInfo
from .groups import release_captured_default_group

release_captured_default_group()    # DCP's import may have captured the default group

__all__ = [
    "Assignment", "BalancedSavePlanner", "CompressedReader", "CompressedWriter",
    "DistributedCheckpointer", "History", "Item", "LcckptStorageInfo", "Piece",
    "SafeLoadPlanner", "async_save", "load", "partition", "save",
]
