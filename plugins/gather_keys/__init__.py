"""Paged keys read back dequantized: the slots a selection asks for, decoded to fp32 in one pass."""
