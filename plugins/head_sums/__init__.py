"""A decode step's attention weights summed over query heads, from the logits and log-sum-exps (one pass)."""
