"""One victim per row read from a score table: the lowest-scored unprotected held position (H2O's one-token eviction
for every layer and request of a step, its accumulated scores never copied out)."""
