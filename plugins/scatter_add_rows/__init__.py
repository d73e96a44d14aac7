"""Per-position score accumulation for a batch of requests in every layer (a scorer's table, policies/score_rows.py)."""
