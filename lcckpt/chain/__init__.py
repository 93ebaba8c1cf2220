"""Delta chains (docs/chain.md): :class:`.checkpointer.DeltaCheckpointer`, the links
between its files, the writer lock and the restore targets (:mod:`.policy`)."""
