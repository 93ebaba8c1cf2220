"""Below everything: the thread pool, CRCs, the wire reader and writer, bulk memory,
durable file writes and the text table. Knows nothing of tensors or files' contents."""
