"""A batch's per-position values read from a score table in every layer at once (scatter_add_rows's mirror)."""
