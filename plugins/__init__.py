"""trtkv plugins: kernels registered as ``torch.ops.trtkv.*``.

Each plugin has a torch reference (runs anywhere, the oracle in tests) and, where it pays, a Triton
kernel used on CUDA (and under ``TRITON_INTERPRET=1`` in CPU tests). Importing this package
registers the ops.
"""
from . import ops  # noqa: F401
