"""k-means token selection (spec §4.4, §9 item 13): the reference always, the Triton path when it can run."""
from __future__ import annotations

import os

import pytest
import torch

import plugins.ops  # noqa: F401  (registers torch.ops.trtkv.kmeans_select)
from plugins.kmeans_select.reference import kmeans_select_ref

triton_only = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1" and not torch.cuda.is_available(),
    reason="Triton kernels need CUDA or TRITON_INTERPRET=1 (set before Python starts)",
)
I32 = dict(dtype=torch.int32)


def clusters(K, per, F, seed, spread=50.0):
    """``K`` tight, far-apart blobs of ``per`` rows each, each blob a run in time (the temporal
    locality that the evenly-spaced init relies on; from a shuffled order Lloyd's algorithm may
    settle in a local optimum with two seeds in one blob). Returns rows and labels."""
    g = torch.Generator().manual_seed(seed)
    centers = torch.randn(K, F, generator=g) * spread
    labels = torch.arange(K)[torch.randperm(K, generator=g)].repeat_interleave(per)
    return centers[labels] + 0.1 * torch.randn(K * per, F, generator=g), labels


def padded(rows, M):
    """Stack jobs into ``[J, M, F]`` with garbage (NaN) padding, which must be ignored."""
    out = torch.full((len(rows), M, rows[0].shape[1]), float("nan"))
    for j, r in enumerate(rows):
        out[j, : len(r)] = r
    return out, torch.tensor([len(r) for r in rows], **I32)


def check_contract(keep, counts, k_keep):
    assert keep.dtype == torch.int64 and keep.shape == (len(counts), int(k_keep.max()))
    for row, m, k in zip(keep.tolist(), counts.tolist(), k_keep.tolist()):
        n = min(m, k)
        assert all(i == -1 for i in row[n:])
        sel = row[:n]
        assert sel == sorted(set(sel)) and all(0 <= i < m for i in sel)


@pytest.mark.parametrize("K,per", [(4, 8), (7, 5), (16, 8)])
def test_one_per_well_separated_cluster(K, per):
    x, labels = clusters(K, per, F=24, seed=K)
    # ragged run lengths and a second init pattern: seeds still land one per run
    x, labels = x[torch.arange(K * per) != 1], labels[torch.arange(K * per) != 1]
    keys, counts = padded([x], M=K * per + 3)
    keep = kmeans_select_ref(keys, counts, torch.tensor([K], **I32), 10)
    check_contract(keep, counts, torch.tensor([K]))
    assert sorted(labels[keep[0]].tolist()) == list(range(K))


def test_exact_count_with_duplicate_rows():
    """All-identical rows: every centroid coincides, clusters collapse, the top-up restores K."""
    keys = torch.ones(2, 20, 8)
    keys[1, :10] = 0.0
    counts, k_keep = torch.tensor([20, 20], **I32), torch.tensor([6, 5], **I32)
    keep = kmeans_select_ref(keys, counts, k_keep, 10)
    check_contract(keep, counts, k_keep)
    assert (keep[0] >= 0).sum() == 6 and (keep[1] >= 0).sum() == 5


def test_batch_mixed_jobs_and_determinism():
    g = torch.Generator().manual_seed(0)
    rows = [torch.randn(m, 16, generator=g) for m in (40, 9, 30, 1, 0)]
    keys, counts = padded(rows, M=48)
    k_keep = torch.tensor([8, 12, 30, 4, 3], **I32)
    keep = kmeans_select_ref(keys, counts, k_keep, 10)
    check_contract(keep, counts, k_keep)
    assert torch.equal(keep, kmeans_select_ref(keys.clone(), counts, k_keep, 10))
    # each job is independent of its batch mates
    solo = kmeans_select_ref(keys[:1], counts[:1], k_keep[:1], 10)
    assert torch.equal(solo[0], keep[0, :8])


def test_m_le_k_is_noop():
    keys, counts = padded([torch.randn(5, 4), torch.randn(3, 4)], M=8)
    keep = kmeans_select_ref(keys, counts, torch.tensor([5, 6], **I32), 10)
    assert keep.tolist() == [[0, 1, 2, 3, 4, -1], [0, 1, 2, -1, -1, -1]]


def test_init_evenly_spaced_with_zero_iters():
    """With no Lloyd step the clusters are the Voronoi cells of rows floor(i*m/K); on a line each
    init row is its own cell's nearest member."""
    x = torch.arange(12.0)[:, None]
    keep = kmeans_select_ref(x[None], torch.tensor([12], **I32), torch.tensor([4], **I32), 0)
    assert keep.tolist() == [[0, 3, 6, 9]]


def test_representative_is_nearest_member():
    # two tight pairs and an outlier-rich third cluster; the pick is the member nearest each mean
    x = torch.tensor([[0.0], [0.2], [10.0], [10.1], [20.0], [21.0], [25.0]])
    keep = kmeans_select_ref(x[None], torch.tensor([7], **I32), torch.tensor([3], **I32), 10)
    assert keep.tolist() == [[0, 2, 5]] or keep.tolist() == [[1, 2, 5]]
    assert keep[0, 2] == 5  # mean of {20, 21, 25} is 22: 21 is nearest


def test_op_matches_reference():
    x, _ = clusters(5, 6, F=8, seed=1)
    keys, counts = padded([x, x[:7]], M=30)
    k_keep = torch.tensor([5, 3], **I32)
    assert torch.equal(torch.ops.trtkv.kmeans_select(keys, counts, k_keep, 10), kmeans_select_ref(keys, counts, k_keep, 10))


@triton_only
@pytest.mark.parametrize("F", [8, 40, 130])
def test_triton_matches_reference(F):
    from plugins.kmeans_select.triton_kernel import kmeans_select_triton

    g = torch.Generator().manual_seed(F)
    x, _ = clusters(6, 9, F=F, seed=F)
    rows = [x, torch.randn(33, F, generator=g), torch.randn(20, F, generator=g), torch.randn(2, F, generator=g)]
    keys, counts = padded(rows, M=64)
    k_keep = torch.tensor([6, 16, 19, 4], **I32)
    dev = "cuda" if torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1" else "cpu"
    got = kmeans_select_triton(keys.to(dev), counts.to(dev), k_keep.to(dev), 10).cpu()
    assert torch.equal(got, kmeans_select_ref(keys, counts, k_keep, 10))


@triton_only
def test_triton_assign_ties_pick_lowest_cluster():
    from plugins.kmeans_select.triton_kernel import assign_triton

    dev = "cuda" if torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1" else "cpu"
    x = torch.zeros(1, 3, 4, device=dev)
    c = torch.zeros(1, 20, 4, device=dev)  # every centroid equidistant, across two cluster tiles
    c[0, :3] = 5.0
    a = assign_triton(x, c, torch.tensor([3], device=dev, **I32), torch.tensor([20], device=dev, **I32))
    assert a.tolist() == [[3, 3, 3]]


def _cpu_kernel():
    from plugins.cpu_kernels import cpu_kernels_available, kmeans_select_cpu

    if not cpu_kernels_available():
        pytest.skip("the C++ CPU kernels could not be built here")
    return kmeans_select_cpu


@pytest.mark.parametrize("F,iters", [(1, 10), (8, 0), (40, 1), (130, 10), (192, 10)])
def test_cpu_kernel_matches_reference(F, iters):
    """Ragged jobs, NaN padding, no-op and K=0 jobs, clustered and unclustered rows; F=192 random rows with
    K = M/2 are mostly 2-member clusters, whose representative is decided by rounding (fp64 ranking)."""
    kmeans_select_cpu = _cpu_kernel()
    g = torch.Generator().manual_seed(F + iters)
    x, _ = clusters(6, 9, F=F, seed=F)
    rows = [x, torch.randn(33, F, generator=g), torch.randn(64, F, generator=g), torch.randn(2, F, generator=g),
            torch.randn(10, F, generator=g), torch.randn(1, F, generator=g)]
    keys, counts = padded(rows, M=64)
    k_keep = torch.tensor([6, 16, 32, 4, 0, 3], **I32)
    got = kmeans_select_cpu(keys, counts, k_keep, iters)
    check_contract(got, counts, k_keep)
    assert torch.equal(got, kmeans_select_ref(keys, counts, k_keep, iters))


def test_cpu_kernel_matches_reference_at_thinkv_shapes():
    """Anneal shapes of SmolLM2 (F = 3 KV heads x 64): 128-token segments to 64, 64 to 32, ..., many jobs
    (the parallel path)."""
    kmeans_select_cpu = _cpu_kernel()
    g = torch.Generator().manual_seed(7)
    for M, K in [(128, 64), (64, 32), (16, 8)]:
        keys = torch.randn(48, M, 192, generator=g)
        counts = torch.randint(K, M + 1, (48,), generator=g, dtype=torch.int32)
        k_keep = torch.full((48,), K, **I32)
        assert torch.equal(kmeans_select_cpu(keys, counts, k_keep, 10), kmeans_select_ref(keys, counts, k_keep, 10))


def test_cpu_kernel_ties_and_duplicates():
    kmeans_select_cpu = _cpu_kernel()
    keys = torch.ones(2, 20, 8)
    keys[1, :10] = 0.0
    counts, k_keep = torch.tensor([20, 20], **I32), torch.tensor([6, 5], **I32)
    assert torch.equal(kmeans_select_cpu(keys, counts, k_keep, 10), kmeans_select_ref(keys, counts, k_keep, 10))
    x = torch.arange(12.0)[:, None]
    assert kmeans_select_cpu(x[None], torch.tensor([12], **I32), torch.tensor([4], **I32), 0).tolist() == [[0, 3, 6, 9]]


def test_op_dispatches_to_cpu_kernel(monkeypatch):
    _cpu_kernel()
    import plugins.cpu_kernels.ops as cpu_ops

    calls = []
    real = cpu_ops.kmeans_select_cpu
    monkeypatch.setattr(cpu_ops, "kmeans_select_cpu", lambda *a: calls.append(1) or real(*a))
    monkeypatch.delenv("TRTKV_KERNELS", raising=False)
    keys, counts = padded([torch.randn(9, 4)], M=9)
    torch.ops.trtkv.kmeans_select(keys, counts, torch.tensor([3], **I32), 10)
    assert calls == [1]
