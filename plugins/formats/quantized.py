"""Quantized formats (FP8, NVFP4, ternary, INT4/INT2). Registered on import of plugins.formats."""
