"""The held columns of a batch's position-map rows in every layer, ascending (one scan a row, no copy)."""
