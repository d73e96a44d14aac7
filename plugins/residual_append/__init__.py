"""A decode step's new K/V rows into the residual arena (the quantizing policies' full-precision tail)."""
