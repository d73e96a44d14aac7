"""LazyEviction's per-step tracking (activation timestamps and recurrence intervals) for a batch in one layer."""
