"""A batch's cached block tables (``trtkv/cache/reads.py``) across requests that finish and rows that new requests
take: a row read before its request was freed, or never read, is taken as read empty when it last held no pages, so
the pages recorded since (a new request's, a host tier's first moves) apply in place; the tables always equal
tables built anew."""
from __future__ import annotations

from unittest.mock import patch

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import plugins  # noqa: F401
from block_table_checks import check_block_tables
from trtkv.cache.block_table import BlockTable
from trtkv.cache.manager import CacheConfig, KVCacheManager

H, D, L = 2, 8, 2


def _cache() -> KVCacheManager:
    return KVCacheManager(CacheConfig(num_layers=L, num_kv_heads=H, head_dim=D, block_size=4, residual_group=1,
                                      residual_dtype=torch.float32, max_pages=256))


def _step(cache: KVCacheManager, seqs: list, pos: dict[int, int], cls=("fp32", 0)) -> None:
    """One token for each of ``seqs`` in every layer, through the batch's write-through."""
    k = v = torch.ones(len(seqs), H, D)
    for layer in range(L):
        cache.write_through(layer, seqs, k, v, [pos[s.seq_id] for s in seqs], cls)
    for s in seqs:
        pos[s.seq_id] += 1


op = st.one_of(
    st.tuples(st.just("add")),
    st.tuples(st.just("free"), st.integers(0, 7)),
    st.tuples(st.just("step"), st.integers(1, 6), st.integers(0, 1)),
    st.tuples(st.just("evict"), st.integers(0, 7), st.integers(0, L - 1), st.integers(0, 40)),
    st.tuples(st.just("read"), st.integers(0, 2)),
)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops=st.lists(op, min_size=1, max_size=40))
def test_cached_tables_follow_requests_that_finish_and_rows_taken_again(ops):
    cache, pos, next_id = _cache(), {}, 0
    for o in ops:
        ids = sorted(cache.seqs)
        if o[0] == "add" or not ids:
            cache.add_sequence(next_id)
            pos[next_id], next_id = 0, next_id + 1
        elif o[0] == "free" and len(ids) > 1:
            cache.free_sequence(ids[o[1] % len(ids)])
        elif o[0] == "step":
            for _ in range(o[1]):
                _step(cache, [cache.seqs[s] for s in ids], pos, ("fp32", o[2]))
        elif o[0] == "evict":
            seq = cache.seqs[ids[o[1] % len(ids)]]
            if pos[seq.seq_id]:
                cache.evict(seq, o[2], [o[3] % pos[seq.seq_id]])
        elif o[0] == "read":
            seqs = [cache.seqs[s] for s in ids]
            check_block_tables(cache, [seqs, seqs[::-1], seqs[1::2] or seqs][o[1]])
    check_block_tables(cache, [cache.seqs[s] for s in sorted(cache.seqs)])


def test_a_row_taken_again_is_read_from_its_recorded_pages_not_rewritten():
    """A finished request's row, taken by a new request whose pages came by the batch's write-through (recorded
    changes), and rows never read before: the next read applies their pages in place, rewriting no table."""
    cache, pos = _cache(), {}
    for sid in range(3):
        cache.add_sequence(sid)
        pos[sid] = 0
    seqs = [cache.seqs[s] for s in range(3)]
    for _ in range(6):
        _step(cache, seqs, pos)
    check_block_tables(cache, seqs)
    cache.free_sequence(1)
    for sid in (3, 4):  # 3 takes row 1 again; 4 a row never read
        cache.add_sequence(sid)
        pos[sid] = 0
    seqs = [cache.seqs[s] for s in (0, 2, 3, 4)]
    _step(cache, seqs[2:], pos)  # the new requests' first pages, recorded
    _step(cache, seqs, pos)
    rewritten = []
    original = BlockTable.catch_up_each
    with patch.object(BlockTable, "catch_up_each", lambda tabs: (rewritten.extend(tabs), original(tabs))):
        tables = [cache.block_tables(layer, seqs) for layer in range(L)]
    assert rewritten == []
    assert [(bt >= 0).sum(1).tolist() for (_, bt), in tables] == [[2, 2, 1, 1]] * L
    check_block_tables(cache, seqs)
