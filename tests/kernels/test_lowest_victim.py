"""The lowest-scored free column per row: the compiled CPU kernel returns the torch reference's victims exactly,
over drawn rows with ties, NaNs, infinities, protected and empty columns, in any column order."""
from __future__ import annotations

import pytest
import torch

import plugins.ops as plugin_ops
from plugins.cpu_kernels.ops import lowest_victim_cpu
from plugins.lowest_victim.reference import lowest_victim_ref
from cpu_marks import needs_kernels

INF, NAN = float("inf"), float("nan")


def drawn(M: int, c: int, seed: int):
    """Rows of a stack as a policy builds them: shuffled positions with dead (-1) columns, scores drawn from a few
    values (ties), some NaN and infinite, a protected share."""
    g = torch.Generator().manual_seed(seed)
    positions = torch.stack([torch.randperm(4 * c, generator=g)[:c] for _ in range(M)])
    positions[torch.rand(M, c, generator=g) < 0.15] = -1
    scores = torch.randint(0, 6, (M, c), generator=g).float() / 4
    special = torch.rand(M, c, generator=g)
    scores[special < 0.03] = NAN
    scores[(special >= 0.03) & (special < 0.06)] = INF
    scores[(special >= 0.06) & (special < 0.08)] = -INF
    blocked = torch.rand(M, c, generator=g) < 0.3
    blocked[: M // 8] = True  # rows with no free column
    return scores, positions, blocked


def oracle(scores, positions, blocked) -> list[int]:
    """The contract in plain Python: the first minimum over the free columns in ascending position order."""
    out = []
    for s, p, b in zip(scores.tolist(), positions.tolist(), blocked.tolist()):
        free = sorted((pos, v) for v, pos, blk in zip(s, p, b) if pos >= 0 and not blk)
        nans = [pos for pos, v in free if v != v]
        if nans:
            out.append(nans[0])
            continue
        best = min(free, key=lambda t: t[1], default=None)
        out.append(-1 if best is None or abs(best[1]) == INF else best[0])
    return out


@pytest.mark.parametrize("M,c", [(1, 1), (7, 5), (64, 40), (300, 97)])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_reference_is_the_first_minimum_over_positions(M, c, seed):
    scores, positions, blocked = drawn(M, c, seed)
    assert lowest_victim_ref(scores, positions, blocked).tolist() == oracle(scores, positions, blocked)


@needs_kernels
@pytest.mark.parametrize("M,c", [(1, 1), (7, 5), (64, 40), (300, 97), (8192, 72)])  # the last: 32 layers x 256
@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernel_matches_the_reference(M, c, seed, dtype):
    scores, positions, blocked = drawn(M, c, seed)
    scores = scores.to(dtype)
    got = lowest_victim_cpu(scores, positions, blocked)
    assert got.dtype == torch.int64 and got.shape == (M,)
    assert torch.equal(got, lowest_victim_ref(scores, positions, blocked))
    assert torch.equal(plugin_ops.lowest_victim(scores, positions, blocked), got)
    assert torch.equal(torch.ops.trtkv.lowest_victim(scores, positions, blocked), got)


@needs_kernels
def test_hand_cases():
    s = torch.tensor([[1.0, 0.5, 0.5, 2.0],  # tie: the older of positions 9 and 3
                      [NAN, 0.0, NAN, 1.0],  # NaN is the lowest; the older NaN
                      [INF, INF, 5.0, 1.0],  # the finite minimum is protected: inf left -> none
                      [0.0, 0.0, 0.0, 0.0]])  # every column dead or protected
    p = torch.tensor([[5, 9, 3, 1], [8, 2, 6, 0], [1, 2, 3, 4], [-1, -1, 7, -1]])
    b = torch.tensor([[False] * 4, [False] * 4, [False, False, True, True], [False, False, True, False]])
    want = [3, 6, -1, -1]
    assert lowest_victim_cpu(s, p, b).tolist() == want
    assert lowest_victim_ref(s, p, b).tolist() == want


@needs_kernels
def test_shape_errors_are_one_line():
    with pytest.raises(RuntimeError, match="one shape"):
        lowest_victim_cpu(torch.zeros(2, 3), torch.zeros(2, 4, dtype=torch.int64), torch.zeros(2, 3, dtype=torch.bool))
