"""One victim per row: the lowest-scored free column (a scoring policy's one-token eviction for a batch)."""
