"""The decode step's rotary rows come from a table (``Rotary.cos_sin_at``): bit for bit what ``cos_sin`` computes
for the same positions — every scaling kind and dtype, positions drawn across the table's growth."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from trtkv.models.rope import Rotary

LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 8192}


@pytest.mark.parametrize("head_dim,theta,scaling", [(16, 10000.0, None), (64, 1e6, {"rope_type": "linear", "factor": 4.0}),
                                                    (128, 500000.0, LLAMA3)], ids=["default", "linear", "llama3"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_table_rows_equal_computed_ones(head_dim, theta, scaling, dtype):
    rot = Rotary(head_dim, theta, scaling)
    rng = np.random.default_rng(0)
    for top in (7, 1500, 5000, 40000):  # the table grows past its first 1,024 rows, then doubles or jumps
        positions = rng.integers(0, top, 257)
        cos, sin = rot.cos_sin_at(positions, dtype)
        ref_cos, ref_sin = rot.cos_sin(torch.from_numpy(positions), dtype)
        assert cos.dtype == dtype and torch.equal(cos, ref_cos) and torch.equal(sin, ref_sin)
    assert rot.cos_sin_at(np.zeros(0, np.int64), dtype)[0].shape == (0, head_dim)
