"""LazyEviction's tracking update for a batch: the compiled CPU kernel leaves the torch reference's tables exactly,
over drawn rows, dead columns and activations (values against a threshold, some exactly at it); the reference equals
the policy's one-request ``track``; bad input is one error."""
from __future__ import annotations

import pytest
import torch

from plugins.cpu_kernels.ops import mri_track_cpu
from plugins.mri_track.reference import mri_track_ref
from trtkv.policies.lazyeviction import created_at, track
from cpu_marks import needs_kernels


def drawn(layers: int, R: int, cap: int, b: int, n: int, seed: int):
    """Tables with history, ``b`` distinct rows with ``n`` distinct positions each (some dead), activations."""
    g = torch.Generator().manual_seed(seed)
    ts = torch.randint(-50, 50, (layers, R, cap), generator=g, dtype=torch.int32)
    mri = torch.randint(0, 40, (layers, R, cap), generator=g, dtype=torch.int32)
    rows = torch.randperm(R, generator=g)[:b]
    positions = torch.stack([torch.randperm(cap, generator=g)[:n] for _ in range(b)])
    positions[torch.rand(b, n, generator=g) < 0.2] = -1
    values = drawn_values((b, n), g)
    prompt = torch.randint(1, cap, (b,), generator=g)
    step = torch.randint(cap, 2 * cap, (b,), generator=g)
    return ts, mri, rows, positions, values, prompt, step


HEADS, ALPHA = 9.0, 0.05


def drawn_values(shape, g: torch.Generator) -> torch.Tensor:
    """Head sums over ``HEADS`` query heads: most above ``ALPHA`` on average, some exactly at it."""
    values = torch.rand(shape, generator=g) * (HEADS * ALPHA / 0.7)
    values[torch.rand(shape, generator=g) < 0.1] = HEADS * ALPHA
    return values


def test_reference_is_the_policys_track_per_request():
    ts, mri, rows, positions, values, prompt, step = drawn(3, 6, 40, 4, 12, seed=1)
    act = values / HEADS >= ALPHA
    want_ts, want_mri = ts.clone(), mri.clone()
    for i in range(4):  # the one-request update of trtkv/policies/lazyeviction.py, in absolute TS
        held = positions[i] >= 0
        pos = positions[i][held]
        created = created_at(pos, int(prompt[i]))
        r = int(rows[i])
        new_ts, new_mri = track(int(step[i]), want_ts[1, r, pos] + created, want_mri[1, r, pos], act[i][held])
        want_ts[1, r, pos], want_mri[1, r, pos] = (new_ts - created).to(torch.int32), new_mri.to(torch.int32)
    mri_track_ref(ts, mri, 1, rows, positions, [values], HEADS, ALPHA, prompt, step)
    assert torch.equal(ts, want_ts) and torch.equal(mri, want_mri)


@needs_kernels
@pytest.mark.parametrize("shape", [(1, 1), (5, 7), (256, 320)])  # the last: a batch of 256 at a 256-token budget
@pytest.mark.parametrize("layer", [0, 2])
def test_kernel_matches_the_reference(shape, layer):
    b, n = shape
    ts, mri, rows, positions, values, prompt, step = drawn(3, b + 3, n + 40, b, n, seed=b + n + layer)
    want_ts, want_mri = ts.clone(), mri.clone()
    mri_track_ref(want_ts, want_mri, layer, rows, positions, [values], HEADS, ALPHA, prompt, step)
    got_ts, got_mri = ts.clone(), mri.clone()
    mri_track_cpu(got_ts, got_mri, layer, rows, positions, [values], HEADS, ALPHA, prompt, step)
    assert torch.equal(got_ts, want_ts) and torch.equal(got_mri, want_mri)
    op_ts, op_mri = ts.clone(), mri.clone()
    torch.ops.trtkv.mri_track(op_ts, op_mri, layer, rows, positions, [values], HEADS, ALPHA, prompt, step)
    assert torch.equal(op_ts, want_ts) and torch.equal(op_mri, want_mri)


@needs_kernels
def test_bad_input_is_one_error():
    ts, mri, rows, positions, values, prompt, step = drawn(2, 4, 8, 3, 4, seed=0)
    values[:] = 1.0
    bad = positions.clone()
    bad[1, 0] = 8
    with pytest.raises(RuntimeError, match="past the table's width"):
        mri_track_cpu(ts, mri, 0, rows, bad, [values], 1.0, ALPHA, prompt, step)
    with pytest.raises(RuntimeError, match="a layer out of the table"):
        mri_track_cpu(ts, mri, 2, rows, positions, [values], 1.0, ALPHA, prompt, step)
    with pytest.raises(RuntimeError, match="int32"):
        mri_track_cpu(ts.float(), mri, 0, rows, positions, [values], 1.0, ALPHA, prompt, step)
    with pytest.raises(RuntimeError, match="one values tensor per layer"):
        mri_track_cpu(ts, mri, 0, rows, positions, [values, values], 1.0, ALPHA, prompt, step)
    with pytest.raises(RuntimeError, match="fp32"):
        mri_track_cpu(ts, mri, 0, rows, positions, [values.double()], 1.0, ALPHA, prompt, step)


@needs_kernels
def test_stacked_layers_are_each_layers_call():
    """Positions and activations ``[L, b, n]`` update layers ``layer..layer+L-1`` as one call per layer would."""
    ts, mri, rows, _, _, prompt, step = drawn(4, 9, 60, 6, 10, seed=7)
    g = torch.Generator().manual_seed(3)
    positions = torch.stack([torch.stack([torch.randperm(60, generator=g)[:10] for _ in range(6)]) for _ in range(3)])
    positions[torch.rand(3, 6, 10, generator=g) < 0.2] = -1
    values = [drawn_values((6, 10), g) for _ in range(3)]
    want_ts, want_mri = ts.clone(), mri.clone()
    for i in range(3):
        mri_track_ref(want_ts, want_mri, 1 + i, rows, positions[i], [values[i]], HEADS, ALPHA, prompt, step)
    for run in (mri_track_ref, mri_track_cpu, torch.ops.trtkv.mri_track):
        got_ts, got_mri = ts.clone(), mri.clone()
        run(got_ts, got_mri, 1, rows, positions, values, HEADS, ALPHA, prompt, step)
        assert torch.equal(got_ts, want_ts) and torch.equal(got_mri, want_mri)
    with pytest.raises(RuntimeError, match="a layer out of the table"):
        mri_track_cpu(ts.clone(), mri.clone(), 2, rows, positions, values, HEADS, ALPHA, prompt, step)
