"""The paged cache under random write / evict / reuse / free sequences (hypothesis).

Invariants after every operation: no two live tokens share a slot; validity bits, live counts and the
position map agree; no page is both free and held, or held twice; key-scale arena refcounts equal the
live slots pointing at them; the running byte counter equals a recount; freeing everything leaks
nothing. Plus: reuse-before-allocate, attention over quantized pages equals dense attention over the
dequantized live tokens, and compaction changes no attention output.
"""
from __future__ import annotations

import math
from unittest.mock import patch

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, assume, example, given, settings
from hypothesis import strategies as st

import plugins  # noqa: F401
from block_table_checks import check_block_tables
from trtkv.cache import reads
from trtkv.cache.block_table import BlockTable
from trtkv.cache.eviction import evict_private
from trtkv.cache.fresh_pages import DEPTH, FreshPages
from trtkv.cache.leaving_pages import LeavingPages
from trtkv.cache.manager import CacheConfig, KVCacheManager
from trtkv.cache.reuse import ReusableSlots
from trtkv.errors import OutOfKVMemory
from trtkv.runtime.attention import decode_attention

H, D, L = 2, 16, 2
CLASSES = [("fp32", 0), ("fp32", 1), ("nvfp4", 2), ("int2", 0)]


def make_cache(eviction="inplace", block=4, g=4, max_pages=64):
    return KVCacheManager(CacheConfig(num_layers=L, num_kv_heads=H, head_dim=D, block_size=block, residual_group=g,
                                      residual_dtype=torch.float32, eviction=eviction, max_pages=max_pages))


def check_invariants(cache: KVCacheManager) -> None:
    for layer in range(L):
        held: dict[tuple[str, int], int] = {}
        for seq in cache.seqs.values():
            table = seq.layers[layer]
            for (fmt, _), pages in table.pages.items():
                for p in pages:
                    assert (fmt, p) not in held, "page held twice"
                    held[(fmt, p)] = seq.seq_id
            slots = {}
            for pos, (fmt, p, s) in table.loc.items():
                assert (fmt, p, s) not in slots, "two live tokens share a slot"
                slots[(fmt, p, s)] = pos
                assert held.get((fmt, p)) == seq.seq_id, "live token on a page its request does not hold"
                pool = cache.pools[layer][fmt]
                assert pool.slot_pos[p, s] == pos and pool.valid[p] >> s & 1, "slot state disagrees with loc"
            for (fmt, _), entries in table.reusable.items():
                for _, p, _ in entries:
                    assert held.get((fmt, p)) == seq.seq_id, "reusable slot on a page its table does not hold"
        for fmt, pool in cache.pools[layer].items():
            refs = np.zeros_like(pool.group_ref)
            for p in range(pool.capacity):
                bits = int(pool.valid[p])
                assert bin(bits).count("1") == pool.live[p]
                if (fmt, p) in held:
                    assert not pool.is_free(p), "page both free and held"
                else:
                    assert pool.is_free(p) and bits == 0, "page leaked"
                for s in range(pool.B):
                    if bits >> s & 1 and pool.group_specs:
                        refs[int(pool.k_group[p, s])] += 1
                    if p < pool.fresh and not bits >> s & 1:  # (a free slot of a handed-out page)
                        assert pool.slot_pos[p, s] == -1 and pool.slot_seg[p, s] == -1, "a free slot keeps a token"
            assert pool.in_use == sum(1 for f, _ in held if f == fmt)
            if pool.group_specs:
                assert np.array_equal(refs, pool.group_ref), "arena refcounts disagree with live slots"
    for seq in cache.seqs.values():
        assert cache.seq_bytes(seq) == cache.recount_bytes(seq), "byte accounting drifted"


op = st.one_of(
    st.tuples(st.just("add")),
    st.tuples(st.just("write"), st.integers(0, 3), st.integers(0, 3), st.integers(1, 4)),
    st.tuples(st.just("evict"), st.integers(0, 3), st.integers(0, 1), st.lists(st.integers(0, 200), max_size=8)),
    st.tuples(st.just("free"), st.integers(0, 3)),
)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops=st.lists(op, min_size=1, max_size=40), eviction=st.sampled_from(["inplace", "compact"]))
def test_random_write_evict_reuse(ops, eviction):
    cache = make_cache(eviction)
    next_pos: dict[int, int] = {}
    gen = torch.Generator().manual_seed(0)
    for o in ops:
        ids = sorted(cache.seqs)
        if o[0] == "add" or not ids:
            sid = len(next_pos)
            cache.add_sequence(sid)
            next_pos[sid] = 0
        elif o[0] == "write":
            seq = cache.seqs[ids[o[1] % len(ids)]]
            cls = CLASSES[o[2]]
            n = o[3]
            pos = list(range(next_pos[seq.seq_id], next_pos[seq.seq_id] + n))
            next_pos[seq.seq_id] += n
            for layer in range(L):
                k = torch.randn(n, H, D, generator=gen)
                cache.write(seq, layer, k, torch.randn(n, H, D, generator=gen), pos, cls)
        elif o[0] == "evict":
            seq = cache.seqs[ids[o[1] % len(ids)]]
            cache.evict(seq, o[2], [p % max(1, next_pos[seq.seq_id]) for p in o[3]])
        else:
            cache.free_sequence(ids[o[1] % len(ids)])
        check_invariants(cache)
    for sid in list(cache.seqs):
        cache.free_sequence(sid)
    assert cache.pages_in_use() == 0
    for pools in cache.pools:
        for pool in pools.values():
            assert pool.groups_in_use == 0 and not pool.group_ref.any()


def test_reuse_before_allocate():
    """§9.15: with n freed slots of class c, writing n class-c tokens takes no new page; another class
    never lands in them."""
    cache = make_cache(block=4)
    seq = cache.add_sequence(0)
    for start in range(0, 12, 4):
        cache.write(seq, 0, torch.randn(4, H, D), torch.randn(4, H, D), list(range(start, start + 4)), ("fp32", 0))
    cache.evict(seq, 0, [1, 2, 5])
    before = cache.pools[0]["fp32"].in_use
    cache.write(seq, 0, torch.randn(1, H, D), torch.randn(1, H, D), [100], ("fp32", 1))  # other class: new page
    assert cache.pools[0]["fp32"].in_use == before + 1
    cache.write(seq, 0, torch.randn(3, H, D), torch.randn(3, H, D), [12, 13, 14], ("fp32", 0))
    assert cache.pools[0]["fp32"].in_use == before + 1
    assert {seq.layers[0].loc[p][1:] for p in (12, 13, 14)} <= {seq.layers[0].loc[p][1:] for p in (12, 13, 14)}
    assert all(seq.layers[0].loc[p][1] != seq.layers[0].loc[100][1] for p in (12, 13, 14))


def test_released_page_reallocated_ignores_stale_reuse_entries():
    """A page emptied by eviction returns to the pool with its freed slots still listed for reuse; when the
    request gets that page back for another class of the same format, those stale entries must not place
    tokens of the first class in it (regression: ThinKV R4E4T4 wrote into a live slot)."""
    other = ("fp32", 1)
    cache = make_cache(block=4)
    seq = cache.add_sequence(0)
    x = lambda n: torch.randn(n, H, D)  # noqa: E731
    cache.write(seq, 0, x(4), x(4), [0, 1, 2, 3], ("fp32", 0))
    cache.write(seq, 0, x(1), x(1), [4], ("fp32", 0))  # the class's open page is now another page
    page0 = seq.layers[0].loc[0][1]
    cache.evict(seq, 0, [0, 1, 2, 3])  # page0 empty: released, its slots stay in the reuse heap
    cache.write(seq, 0, x(1), x(1), [5], other)  # takes page0 back (lowest free page), slot 0
    assert seq.layers[0].loc[5][1] == page0
    cache.write(seq, 0, x(1), x(1), [6], ("fp32", 0))  # must not land in page0
    cache.write(seq, 0, x(3), x(3), [7, 8, 9], other)  # page0's tail slots 1..3
    check_invariants(cache)
    assert seq.layers[0].loc[6][1] != page0
    cache.free_sequence(0)
    assert cache.pages_in_use() == 0


def dense_attention(q, k, v, sm_scale):
    b, Hq, _ = q.shape
    G = Hq // H
    out = []
    for i in range(b):
        kk = k[i].repeat_interleave(G, 1).transpose(0, 1)  # [Hq, n, D]
        vv = v[i].repeat_interleave(G, 1).transpose(0, 1)
        w = torch.softmax((q[i][:, None, :] @ kk.transpose(1, 2)).squeeze(1) * sm_scale, -1)
        out.append((w[:, None, :] @ vv).squeeze(1))
    return torch.stack(out)


@pytest.mark.parametrize("fmt", ["fp32", "fp8", "nvfp4", "ternary", "int4", "int2", "nvfp4o"])
@pytest.mark.parametrize("eviction", ["inplace", "compact"])
def test_attention_equals_dense_over_dequantized_live_tokens(fmt, eviction):
    torch.manual_seed(1)
    cache = make_cache(eviction, block=8, g=16)
    seqs = [cache.add_sequence(i) for i in range(2)]
    for seq, n in zip(seqs, (40, 23)):
        for start in range(0, n, 16):
            pos = list(range(start, min(n, start + 16)))
            cache.write(seq, 0, torch.randn(len(pos), H, D) * 3, torch.randn(len(pos), H, D), pos, (fmt, 0))
    cache.evict(seqs[0], 0, [0, 5, 6, 7, 17, 30, 31])
    cache.evict(seqs[1], 0, list(range(8, 16)))
    q = torch.randn(2, 4, D)
    out, _ = decode_attention(cache, 0, seqs, q, 1 / math.sqrt(D), [False, False], [False, False])
    ks, vs = zip(*[cache.gather_kv(s, 0, cache.live_positions(s, 0)) for s in seqs])
    ref = torch.stack([dense_attention(q[i:i + 1], ks[i][None], vs[i][None], 1 / math.sqrt(D))[0] for i in range(2)])
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


def test_evicted_slots_contribute_nothing():
    torch.manual_seed(2)
    cache = make_cache(block=8, g=16)
    seq = cache.add_sequence(0)
    cache.write(seq, 0, torch.randn(16, H, D), torch.randn(16, H, D), list(range(16)), ("nvfp4", 0))
    cache.evict(seq, 0, [3, 4, 9])
    q = torch.randn(1, 4, D)
    a, _ = decode_attention(cache, 0, [seq], q, 0.25, [False], [False])
    pool = cache.pools[0]["nvfp4"]
    garbage = torch.Generator().manual_seed(3)
    for t in pool.fields:  # scribble over every dead slot's codes and value scales
        for p in range(pool.capacity):
            for s in range(pool.B):
                if not int(pool.valid[p]) >> s & 1:
                    t[p, s] = torch.randint(0, 255, t[p, s].shape, dtype=torch.uint8, generator=garbage)
    b, _ = decode_attention(cache, 0, [seq], q, 0.25, [False], [False])
    torch.testing.assert_close(a, b, rtol=0, atol=0)


def _state(cache: KVCacheManager):
    """Everything eviction touches, comparable across two caches."""
    def used(pool, a):  # pages past ``fresh`` were never handed out: preallocated, uninitialised
        return a[:pool.fresh].tolist()

    pools = {(layer, fmt): (used(pool, pool.valid), used(pool, pool.live), used(pool, pool.slot_pos),
                            used(pool, pool.slot_seg),
                            sorted(pool.free), pool.in_use, pool.fresh, pool.group_ref.tolist(), list(pool.group_free))
             for layer, pools in enumerate(cache.pools) for fmt, pool in pools.items()}
    seqs = {sid: (s.kv_bytes, [(dict(t.loc), {c: list(p) for c, p in t.pages.items()},
                                {c: sorted(h) for c, h in t.reusable.items()}, dict(t.open_page), t.live)
                               for t in s.layers])
            for sid, s in cache.seqs.items()}
    return pools, seqs


def add_everywhere(caches: list[KVCacheManager], next_pos: dict[int, int]) -> None:
    """A new request, the same in every cache of a side-by-side comparison."""
    sid = len(next_pos)
    for c in caches:
        c.add_sequence(sid)
    next_pos[sid] = 0


def write_everywhere(caches: list[KVCacheManager], next_pos: dict[int, int], sid: int, n: int, cls) -> None:
    """The request's next ``n`` tokens (the same random K/V) written in every layer of every cache."""
    pos = list(range(next_pos[sid], next_pos[sid] + n))
    next_pos[sid] += n
    gen = torch.Generator().manual_seed(len(pos) + pos[0])
    k, v = torch.randn(n, H, D, generator=gen), torch.randn(n, H, D, generator=gen)
    for c in caches:
        for layer in range(L):
            c.write(c.seqs[sid], layer, k, v, pos, cls)


def apply_op(caches: list[KVCacheManager], next_pos: dict[int, int], o, evict=None, classes=CLASSES) -> None:
    """One drawn op on side-by-side caches: add, write (of ``classes[o[2]]``) and free happen in every cache; an
    eviction is ``evict(sid, layer, victims)`` (what each test compares), skipped when None. The last request
    stays."""
    ids = sorted(caches[0].seqs)
    if o[0] == "add" or not ids:
        add_everywhere(caches, next_pos)
    elif o[0] == "write":
        write_everywhere(caches, next_pos, ids[o[1] % len(ids)], o[3], classes[o[2]])
    elif o[0] == "evict":
        if evict is not None:
            sid = ids[o[1] % len(ids)]
            evict(sid, o[2], [p % max(1, next_pos[sid]) for p in o[3]])
    elif len(ids) > 1:
        for c in caches:
            c.free_sequence(ids[o[1] % len(ids)])


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops=st.lists(op, min_size=1, max_size=30))
def test_batched_eviction_matches_one_by_one(ops):
    """``evict_private`` (array operations over the victims) leaves exactly the state of evicting them one at
    a time (``_evict_each``): slots, pages, reuse heaps, key-scale arena (free order included), bytes."""
    caches = [make_cache(), make_cache()]
    next_pos: dict[int, int] = {}

    def evict(sid, layer, victims):
        a = evict_private(caches[0].pools[layer], caches[0].columns, layer, caches[0].seqs[sid], victims)
        assert a == caches[1]._evict_each(caches[1].seqs[sid], layer, victims)

    for o in ops:
        apply_op(caches, next_pos, o, evict)
        assert _state(caches[0]) == _state(caches[1])
    check_invariants(caches[0])


def test_residual_arena_grows_and_appends_in_order():
    """Residual buffers are rows of one arena: growing it keeps every live request's buffer (contents kept),
    a request listed several times fills consecutive slots, and attention reads them like per-request buffers."""
    cache = make_cache(g=4)
    seqs = [cache.add_sequence(i) for i in range(3)]
    k = torch.randn(3, H, D)
    cache.buffer_append(0, seqs, k, -k, [5, 6, 7])
    more = [cache.add_sequence(i) for i in range(3, 12)]  # past the arena's 8 initial rows
    assert cache.residual.k.shape[0] >= 12 and len({s.residual.row for s in seqs + more}) == 12
    for i, s in enumerate(seqs):
        assert s.buf_k.data_ptr() == cache.residual.k[s.residual.row].data_ptr()
        assert torch.equal(s.buf_k[0, 0], k[i]) and torch.equal(s.buf_v[0, 0], -k[i]) and s.buffered_positions(0) == [5 + i]
    tail = torch.randn(3, H, D)
    cache.buffer_append(1, [more[0]] * 3, tail, tail, [0, 1, 2])
    assert torch.equal(more[0].buf_k[1, :3], tail) and more[0].buffered_positions(1) == [0, 1, 2]
    row = more[1].residual.row
    cache.free_sequence(more[1].seq_id)
    again = cache.add_sequence(99)
    assert again.residual.row == row and not again.buf_k.any()  # a reused row starts zeroed


def test_gather_kv_many_equals_one_read_per_request_across_formats():
    """One read per format for several requests (a batch's anneals) returns what each request's own read
    returns, row for row, whatever mix of formats and holes they hold."""
    torch.manual_seed(5)
    cache = make_cache("inplace", block=8, g=16)
    seqs = [cache.add_sequence(i) for i in range(3)]
    for i, seq in enumerate(seqs):
        for start, fmt in zip(range(0, 48, 16), ("nvfp4", "int2", "fp32")):
            pos = list(range(start, start + 16))
            cache.write(seq, 1, torch.randn(16, H, D) * (i + 1), torch.randn(16, H, D), pos, (fmt, 0))
    cache.evict(seqs[1], 1, [3, 4, 20, 40])
    rng = np.random.default_rng(0)
    items = [(s, rng.permutation(cache.live_positions(s, 1))[: 5 + 7 * i]) for i, s in enumerate(seqs)]
    items.append((seqs[0], np.empty(0, np.int64)))
    many = cache.gather_kv_many(1, items)
    for (seq, pos), (k, v) in zip(items, many):
        k1, v1 = cache.gather_kv(seq, 1, pos)
        assert k.shape == (len(pos), H, D)
        assert torch.equal(k, k1) and torch.equal(v, v1)
    for (seq, pos), (k, v) in zip(items, cache.gather_kv_many(1, items, keys_only=True)):  # the keys alone
        assert v is None and torch.equal(k, cache.gather_kv(seq, 1, pos)[0])


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops=st.lists(op, min_size=1, max_size=30), eviction=st.sampled_from(["inplace", "compact"]),
       picks=st.lists(st.tuples(st.integers(0, 3), st.integers(0, 2 ** 32)), min_size=2, max_size=5))
def test_slot_lookup_names_the_slots_holding_the_positions(ops, eviction, picks):
    """gather's batched lookup (one array read of the position maps for several requests) names, row for row,
    slots whose pool records hold exactly the asked positions, whatever writes, evictions, reuse and
    compaction left."""
    cache = make_cache(eviction)
    next_pos: dict[int, int] = {}
    for o in ops:
        apply_op([cache], next_pos, o, lambda sid, layer, victims: cache.evict(cache.seqs[sid], layer, victims))
    ids = sorted(cache.seqs)
    rng = np.random.default_rng(picks[0][1])
    for layer in range(L):
        items = []
        for i, seed in picks:
            seq = cache.seqs[ids[i % len(ids)]]
            live = cache.live_positions(seq, layer)
            items.append((seq, rng.permutation(live)[: seed % (len(live) + 1)]))
        asked = np.concatenate([np.asarray(p, np.int64) for _, p in items])
        if not len(asked):
            continue
        table_rows = np.repeat([seq.row for seq, _ in items], [len(p) for _, p in items]).astype(np.int64)
        got = reads._slots_by_lookup(cache.pools[layer], cache.columns, layer, table_rows, asked)
        seen = np.zeros(len(asked), bool)
        for fmt, (rows, flat) in got.items():
            rows = np.arange(len(asked)) if rows is None else rows
            assert np.array_equal(cache.pools[layer][fmt].slot_pos.reshape(-1)[flat], asked[rows])
            seen[rows] = True
        assert seen.all()


def test_flush_group_marks_equal_slot_by_slot_marks():
    """mark_written's array path (a flush group) leaves the pool as the per-slot loop does."""
    a, b = make_cache(block=8).pool(0, "fp32"), make_cache(block=8).pool(0, "fp32")
    for pool in (a, b):
        pool.alloc_page(0), pool.alloc_page(0)
    pages, slots = [0] * 5 + [1] * 6, [0, 2, 3, 6, 7, 1, 2, 3, 4, 5, 0]
    a.mark_written(pages, slots, list(range(100, 111)), seg=4)
    for p, s, pos in zip(pages, slots, range(100, 111)):
        b.mark_written([p], [s], [pos], seg=4)
    for name in ("valid", "live", "hwm"):
        assert np.array_equal(getattr(a, name)[:2], getattr(b, name)[:2]), name
    assert np.array_equal(a.slot_pos[:2], b.slot_pos[:2]) and np.array_equal(a.slot_seg[:2], b.slot_seg[:2])
    with pytest.raises(AssertionError, match="live slot"):
        a.mark_written([0] * 8, list(range(8)), list(range(8)))


WT_CLASSES = [("fp32", 0), ("fp32", 1), ("fp16", 0)]  # write-through formats (one token per write)
_step = st.tuples(st.just("write"), st.integers(0, 3), st.integers(0, 2), st.integers(0, 3))
wt_op = st.one_of(st.tuples(st.just("add")), _step, _step, _step, _step,  # mostly decode steps
                  st.tuples(st.just("evict"), st.integers(0, 3), st.integers(0, 1),
                            st.lists(st.integers(0, 200), min_size=1, max_size=3)),
                  st.tuples(st.just("evict_each"), st.integers(0, 1), st.lists(st.integers(-1, 200), min_size=4,
                                                                                max_size=4)),
                  st.tuples(st.just("evict_each"), st.integers(0, 1), st.lists(st.integers(-1, 200), min_size=4,
                                                                                max_size=4)),
                  st.tuples(st.just("evict_layers"), st.lists(st.integers(-1, 200), min_size=5, max_size=5)),
                  st.tuples(st.just("evict_rows"), st.lists(st.integers(-1, 200), min_size=7, max_size=7)),
                  st.tuples(st.just("free"), st.integers(0, 3)))


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops=st.lists(wt_op, min_size=20, max_size=40), cls_i=st.integers(0, len(WT_CLASSES) - 1))
def test_batched_write_through_matches_one_write_per_request(ops, cls_i):
    """``write_through`` (one slot per request for the batch, one slot mark for the batch) leaves exactly
    the state of writing each request's token with ``write`` (``alloc_slots(.., 1)``): slots chosen, reusable
    slots, open pages, stored values. ``evict_many`` of one victim per request (array operations) leaves the
    state of evicting each in turn. A third cache takes each step's
    slots for every layer at once (``plan_write_through``, layer by layer where it does not apply) and evicts one
    victim a request in every layer at once (``evict_one_each_layers``), or three (``evict_rows_layers``, an
    event's): the same."""
    caches = [make_cache(g=1, max_pages=256) for _ in range(3)]  # (16 requests never fill the pools)
    next_pos: dict[int, int] = {}
    for o in ops:
        ids = sorted(caches[0].seqs)
        if o[0] == "add" and len(ids) >= 16:
            continue
        if o[0] == "add" or not ids:
            add_everywhere(caches, next_pos)
        elif o[0] == "write":  # one decode step: a token for every request, in one class
            cls = WT_CLASSES[cls_i] if o[2] else WT_CLASSES[(cls_i + 1) % len(WT_CLASSES)]  # mostly one class
            pos = [next_pos[sid] for sid in ids]
            for sid in ids:
                next_pos[sid] += 1
            gen = torch.Generator().manual_seed(sum(pos) + o[3])
            k, v = torch.randn(len(ids), H, D, generator=gen), torch.randn(len(ids), H, D, generator=gen)
            planned = [caches[2].seqs[s] for s in ids]
            plan = caches[2].plan_write_through(planned, pos, cls)
            for layer in range(L):
                caches[0].write_through(layer, [caches[0].seqs[s] for s in ids], k, v, pos, cls)
                for i, sid in enumerate(ids):
                    caches[1].write(caches[1].seqs[sid], layer, k[i:i + 1], v[i:i + 1], [pos[i]], cls)
                if plan is not None:
                    caches[2].write_planned(plan, layer, k, v)
                else:
                    caches[2].write_through(layer, planned, k, v, pos, cls)
        elif o[0] == "evict":
            sid = ids[o[1] % len(ids)]
            for c in caches:
                c.evict(c.seqs[sid], o[2], [p % max(1, next_pos[sid]) for p in o[3]])
        elif o[0] == "evict_each":  # a window's or a scorer's step: at most one victim per request, one layer
            victims = [[] if v < 0 else [v % max(1, next_pos[sid])] for sid, v in zip(ids, o[2] * len(ids))]
            assert caches[0].evict_many(o[1], [(caches[0].seqs[sid], p) for sid, p in zip(ids, victims)]) == \
                [caches[1].evict(caches[1].seqs[sid], o[1], p) for sid, p in zip(ids, victims)] == \
                caches[2].evict_many(o[1], [(caches[2].seqs[sid], p) for sid, p in zip(ids, victims)])
        elif o[0] == "evict_layers":  # one victim a request (or none) in every layer, all layers in one call
            victims = np.array([[-1 if v < 0 else v % max(1, next_pos[sid]) for sid, v in zip(ids, o[1][layer:] * len(ids))]
                                for layer in range(L)], np.int64)
            for layer in range(L):
                caches[0].evict_many(layer, [(caches[0].seqs[sid], [] if p < 0 else [p])
                                             for sid, p in zip(ids, victims[layer].tolist())])
                for sid, p in zip(ids, victims[layer].tolist()):
                    caches[1].evict(caches[1].seqs[sid], layer, [] if p < 0 else [p])
            caches[2].evict_one_each_layers(np.arange(L), [caches[2].seqs[sid] for sid in ids], victims)
        elif o[0] == "evict_rows":  # up to three victims a request (distinct) in every layer, in one call
            drawn = o[1] * (3 * L * len(ids))
            victims = np.full((L, len(ids), 3), -1, np.int64)
            for layer, i, k in np.ndindex(victims.shape):
                v = drawn[(layer * len(ids) + i) * 3 + k]
                v = -1 if v < 0 else v % max(1, next_pos[ids[i]])
                victims[layer, i, k] = -1 if v in victims[layer, i] else v
            for layer in range(L):
                caches[0].evict_many(layer, [(caches[0].seqs[sid], [p for p in vs if p >= 0])
                                             for sid, vs in zip(ids, victims[layer].tolist())])
                for sid, vs in zip(ids, victims[layer].tolist()):
                    caches[1].evict(caches[1].seqs[sid], layer, [p for p in vs if p >= 0])
            caches[2].evict_rows_layers(np.arange(L), [caches[2].seqs[sid] for sid in ids], victims)
        else:
            for c in caches:
                c.free_sequence(ids[o[1] % len(ids)])
        for other_cache in caches[1:]:
            assert _state(caches[0]) == _state(other_cache)
            assert caches[0].evictions_total == other_cache.evictions_total
            for layer in range(L):
                for fmt, pool in caches[0].pools[layer].items():
                    other = other_cache.pools[layer][fmt]
                    for a, b in zip(pool.fields, other.fields):
                        assert torch.equal(a[:pool.fresh], b[:pool.fresh])
        check_block_tables(caches[0])
        check_block_tables(caches[2])
    check_invariants(caches[0])


def test_write_plan_takes_every_layers_slots_at_once_and_reuses_evicted_slots():
    """Every step is planned for every layer at once (page boundaries included), the same as ``write_through``
    layer by layer — before and after evictions leave reusable slots in some layers (taken oldest page first)."""
    caches = [make_cache(g=1), make_cache(g=1)]
    cls = WT_CLASSES[0]
    for c in caches:
        for sid in range(3):
            c.add_sequence(sid)
    for step in range(14):  # page boundaries (blocks of 4), then evicted slots to take back
        if step == 9:
            oldest = caches[1].seqs[2].layers[L - 1].locate(3)  # (an earlier page than position 5's)
            for c in caches:
                c.evict(c.seqs[2], L - 1, [3, 5])  # two slots of one request in the last layer
                c.evict(c.seqs[0], 0, [6])
        k, v = torch.randn(3, H, D), torch.randn(3, H, D)
        pos = [step] * 3
        plan = caches[1].plan_write_through([caches[1].seqs[s] for s in range(3)], pos, cls)
        assert plan is not None and tuple(plan.pages.shape) == (L, 3)
        for layer in range(L):
            caches[0].write_through(layer, [caches[0].seqs[s] for s in range(3)], k, v, pos, cls)
            caches[1].write_planned(plan, layer, k, v)
        assert _state(caches[0]) == _state(caches[1])
        if step == 9:  # the evicted slots were written again
            assert caches[1].seqs[2].layers[L - 1].locate(9) == oldest
            assert not caches[1].seqs[2].layers[0].reusable and caches[1].seqs[2].layers[L - 1].reusable
    assert not any(t.reusable for s in caches[1].seqs.values() for t in s.layers)


@pytest.mark.parametrize("free_at", [None, 40])
def test_page_boundaries_pages_wait_in_the_columns_and_join_the_lists_when_read(free_at):
    """Planned steps leave a page boundary's pages waiting in the columns (``FreshPages``), past the queue's depth
    (a row whose queue is full takes its pages in first); read only at the end (or at a request's finish), the
    tables hold what ``write_through`` layer by layer gives them: pages, order, bytes and peaks, block tables."""
    caches = [make_cache(g=1, max_pages=512), make_cache(g=1, max_pages=512)]
    cls = WT_CLASSES[0]
    for c in caches:
        for sid in range(3):
            c.add_sequence(sid)
    waited = False
    for step in range(4 * (DEPTH + 3)):  # more boundaries than a row's queue holds (blocks of 4)
        ids = sorted(caches[0].seqs)
        k, v = torch.randn(len(ids), H, D), torch.randn(len(ids), H, D)
        pos = [step] * len(ids)
        plan = caches[1].plan_write_through([caches[1].seqs[s] for s in ids], pos, cls)
        for layer in range(L):
            caches[0].write_through(layer, [caches[0].seqs[s] for s in ids], k, v, pos, cls)
            caches[1].write_planned(plan, layer, k, v)
        waited |= caches[1].columns.fresh.waiting(0, caches[1].seqs[ids[0]].row)
        if step == free_at:
            for c in caches:
                c.free_sequence(1)
    assert waited
    check_block_tables(caches[1])  # (before anything reads the lists)
    for sid in caches[0].seqs:
        assert (caches[0].seqs[sid].kv_bytes, caches[0].seqs[sid].peak_bytes) == \
            (caches[1].seqs[sid].kv_bytes, caches[1].seqs[sid].peak_bytes)
    assert _state(caches[0]) == _state(caches[1])
    for pool0, pool1 in zip(caches[0].pools[0].values(), caches[1].pools[0].values()):
        assert pool0.free_pages == pool1.free_pages


def assert_same_bytes(a: KVCacheManager, b: KVCacheManager) -> None:
    """The codes, key groups and key-scale arenas handed out so far are byte-identical in the two caches."""
    for layer in range(L):
        for fmt, pool in a.pools[layer].items():
            other = b.pools[layer][fmt]
            for x, y in zip([*pool.fields, pool.k_group], [*other.fields, other.k_group]):
                assert torch.equal(x[:pool.fresh], y[:pool.fresh])
            for x, y in zip(pool.group_fields, other.group_fields):
                assert torch.equal(x[:pool.group_fresh], y[:pool.group_fresh])


def _ranked_state(cache: KVCacheManager):
    """``_state`` with each reuse-heap entry's page age replaced by its rank among its table's pages."""
    pools, seqs = _state(cache)
    for sid, s in cache.seqs.items():
        for li, t in enumerate(s.layers):
            rank = {no: r for r, no in enumerate(sorted(t.page_seq.values()))}
            loc, pages, heaps, open_page, live = seqs[sid][1][li]
            heaps = {c: sorted((rank.get(no, -1), p, sl) for no, p, sl in h) for c, h in heaps.items()}
            seqs[sid][1][li] = (loc, pages, heaps, open_page, live)
    return pools, seqs


FLUSH_CLASSES = [("nvfp4", 0), ("nvfp4", 1), ("fp32", 0), ("int2", 0)]
_fstep = st.tuples(st.just("step"), st.lists(st.integers(0, 3), min_size=4, max_size=4))
flush_op = st.one_of(st.tuples(st.just("add")), _fstep, _fstep, _fstep, _fstep, _fstep, _fstep,
                     st.tuples(st.just("evict"), st.integers(0, 3), st.integers(0, 1),
                               st.lists(st.integers(0, 200), min_size=1, max_size=12)),
                     st.tuples(st.just("free"), st.integers(0, 3)))


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops=st.lists(flush_op, min_size=20, max_size=60), block=st.sampled_from([2, 4, 8]), uniform=st.booleans())
def test_batched_flush_matches_one_write_per_request(ops, block, uniform):
    """``flush_many`` (the batch's full buffers of one layer: fresh pages taken in one call, one kernel call per
    format, one slot mark) leaves exactly the state of writing each request's group with ``write`` in batch
    order: slots (reused, open-page tails, fresh pages), key-scale groups, stored codes, bytes, and the batch's
    cached block tables (fresh pages appended in place) equal tables built anew. Page ages
    (``page_seq``, the reuse order) are compared as ranks within each table: the batched path numbers one
    format's pages before the next format's, which orders no table differently. ``uniform``: every request of a
    step in one class (a KIVI or ThinKV batch: whole fresh pages flushed by array operations, waiting in
    ``FreshPages`` while no thought class but 0 was seen)."""
    g = 4
    # pages for the worst case (30 requests x 30 steps x one page per `block` tokens), so no pool runs out
    batched, each = make_cache(block=block, g=g, max_pages=512), make_cache(block=block, g=g, max_pages=512)
    next_pos: dict[int, int] = {}
    tokens: dict[int, list] = {}  # per request, its buffered (k, v) rows: what ``each`` writes at a flush
    for o in ops:
        ids = sorted(batched.seqs)
        if o[0] == "add" or not ids:
            add_everywhere([batched, each], next_pos)
            tokens[len(next_pos) - 1] = []
        elif o[0] == "step":  # one decode token per request; full buffers flush, each in its request's class
            pos = [next_pos[sid] for sid in ids]
            for sid in ids:
                next_pos[sid] += 1
            gen = torch.Generator().manual_seed(sum(pos) + len(ids))
            k, v = torch.randn(len(ids), H, D, generator=gen) * 3, torch.randn(len(ids), H, D, generator=gen)
            classes = [FLUSH_CLASSES[o[1][0]]] * len(ids) if uniform else \
                [FLUSH_CLASSES[o[1][i % 4]] for i in range(len(ids))]
            for i, sid in enumerate(ids):
                tokens[sid].append((k[i], v[i]))
            for layer in range(L):
                seqs = [batched.seqs[sid] for sid in ids]
                batched.buffer_append(layer, seqs, k, v, pos)
                full = [i for i, s in enumerate(seqs) if s.buffered(layer) >= g]
                batched.flush_many(layer, [seqs[i] for i in full], [classes[i] for i in full], [7 + i for i in full])
                for i in full:
                    group = tokens[ids[i]][-g:]
                    each.write(each.seqs[ids[i]], layer, torch.stack([t[0] for t in group]),
                               torch.stack([t[1] for t in group]), list(range(pos[i] - g + 1, pos[i] + 1)),
                               classes[i], 7 + i)
        elif o[0] == "evict":
            sid = ids[o[1] % len(ids)]
            for c in (batched, each):
                c.evict(c.seqs[sid], o[2], [p % max(1, next_pos[sid]) for p in o[3]])
        else:
            for c in (batched, each):
                c.free_sequence(ids[o[1] % len(ids)])
        assert _ranked_state(batched) == _ranked_state(each)
        check_block_tables(batched)
        assert_same_bytes(batched, each)
    check_invariants(batched)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops=st.lists(op, min_size=1, max_size=30), jobs=st.lists(st.tuples(st.integers(0, 3), st.lists(
    st.integers(0, 200), min_size=0, max_size=40)), min_size=1, max_size=5),
       eviction=st.sampled_from(["inplace", "compact"]))
@example(ops=[("add",), ("add",), ("write", 0, 2, 4), ("write", 1, 2, 2)],  # a request's groups freed at its last job
         jobs=[(0, [0]), (0, [0, 3]), (1, [0, 1]), (0, [0, 1, 2])], eviction="inplace")
def test_evict_many_matches_one_request_at_a_time(ops, jobs, eviction):
    """``evict_many`` (a batch's anneal: one key-group read and one validity update per format, a request
    possibly listed twice; compaction of every request hit in one gather a format) and ``evict_flat`` (the same
    jobs concatenated) leave exactly the state of evicting each job in turn, and return each job's count."""
    caches = [make_cache(eviction), make_cache(eviction), make_cache(eviction)]
    next_pos: dict[int, int] = {}
    for o in ops:
        apply_op(caches, next_pos, o)
    ids = sorted(caches[0].seqs)
    if not ids:
        add_everywhere(caches, next_pos)
        ids = sorted(caches[0].seqs)
    picked = [(ids[i % len(ids)], [p % max(1, next_pos[ids[i % len(ids)]]) for p in victims]) for i, victims in jobs]
    picked = [(sid, list(dict.fromkeys(v))) for sid, v in picked]
    for c in caches:  # the batch's block tables read now follow the eviction in place (pages leaving their lists)
        check_block_tables(c)
    got = caches[0].evict_many(1, [(caches[0].seqs[sid], v) for sid, v in picked])
    want = [caches[1].evict(caches[1].seqs[sid], 1, v) for sid, v in picked]
    flat = caches[2].evict_flat(1, [caches[2].seqs[sid] for sid, _ in picked],
                                np.array([p for _, v in picked for p in v], np.int64),
                                np.array([len(v) for _, v in picked], np.int64))
    assert got == want and flat == want
    assert _state(caches[0]) == _state(caches[1]) == _state(caches[2])
    check_invariants(caches[2])
    for c in caches:
        check_block_tables(c)
    check_invariants(caches[0])
    for sid in ids:  # the codes moved with their tokens (compaction)
        live = caches[1].live_positions(caches[1].seqs[sid], 1)
        for x, y, z in zip(*(c.gather_kv(c.seqs[sid], 1, live) for c in caches)):
            assert torch.equal(x, y) and torch.equal(x, z)
    for sid in ids:  # a segment's members: live positions in a range, short or wider than what is held
        seq, live = caches[0].seqs[sid], caches[0].live_positions(caches[0].seqs[sid], 1)
        ranges = ((0, 5), (3, 40), (-2, 1000), (30, 10), (next_pos[sid] - 7, next_pos[sid] + 3))
        for lo, hi in ranges:
            want_in = live[(live >= lo) & (live < hi)]
            assert np.array_equal(caches[0].live_positions_in(seq, 1, lo, hi), want_in)
    # every request's ranges in one read (a ThinKV anneal's segments): what each range alone gives
    jobs = [(caches[0].seqs[sid], lo, hi) for sid in ids for lo, hi in ((0, 5), (3, 40), (-2, 1000), (30, 10))]
    many = caches[0].live_positions_in_many([s for s, _, _ in jobs], 1, np.array([lo for _, lo, _ in jobs]),
                                            np.array([hi for _, _, hi in jobs]))
    for (seq, lo, hi), got in zip(jobs, many, strict=True):
        assert np.array_equal(got, caches[0].live_positions_in(seq, 1, lo, hi))


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(lengths=st.lists(st.integers(6, 40), min_size=2, max_size=5), cls=st.integers(0, len(CLASSES) - 1),
       victims=st.lists(st.lists(st.integers(0, 39), min_size=2, max_size=30), min_size=5, max_size=5))
def test_evict_flat_compacting_distinct_requests_matches_one_at_a_time(lengths, cls, victims):
    """A compacting cache's ``evict_flat`` and ``evict_many`` of distinct requests (an AMS or R-KV event's layer:
    one eviction and one compaction of every request hit) leave the state of evicting and compacting each request
    in turn."""
    caches = [make_cache("compact"), make_cache("compact"), make_cache("compact")]
    next_pos: dict[int, int] = {}
    for n in lengths:
        add_everywhere(caches, next_pos)
        write_everywhere(caches, next_pos, len(next_pos) - 1, n, CLASSES[cls])
    picked = [(sid, sorted({p % n for p in v})) for sid, (n, v) in enumerate(zip(lengths, victims))]
    assume(sum(len(v) for _, v in picked) >= 8 and max(len(v) for _, v in picked) > 1)
    flat = caches[0].evict_flat(1, [caches[0].seqs[sid] for sid, _ in picked],
                                np.array([p for _, v in picked for p in v], np.int64),
                                np.array([len(v) for _, v in picked], np.int64))
    want = [caches[1].evict(caches[1].seqs[sid], 1, v) for sid, v in picked]
    many = caches[2].evict_many(1, [(caches[2].seqs[sid], v) for sid, v in picked])
    assert flat == want and many == want
    assert _state(caches[0]) == _state(caches[1]) == _state(caches[2])
    for c in caches:
        check_invariants(c)
        check_block_tables(c)
    for sid, _ in picked:  # the codes moved with their tokens
        live = caches[1].live_positions(caches[1].seqs[sid], 1)
        assert np.array_equal(caches[0].live_positions(caches[0].seqs[sid], 1), live)
        for x, y, z in zip(*(c.gather_kv(c.seqs[sid], 1, live) for c in caches)):
            assert torch.equal(x, y) and torch.equal(x, z)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops=st.lists(op, min_size=1, max_size=30), picks=st.lists(st.integers(-1, 200), min_size=6, max_size=6),
       eviction=st.sampled_from(["inplace", "compact"]))
def test_evicting_every_layers_victims_at_once_matches_each_layer_in_turn(ops, picks, eviction):
    """``evict_rows_layers`` (an event's victims, two a request (-1: none), every layer at once where the slot state
    is stacked; a compacting cache layer by layer) leaves the state of evicting each layer's in turn."""
    caches = [make_cache(eviction), make_cache(eviction)]
    next_pos: dict[int, int] = {}
    for o in ops:
        apply_op(caches, next_pos, o)
    if not caches[0].seqs:
        add_everywhere(caches, next_pos)
    ids = sorted(caches[0].seqs)
    victims = np.full((L, len(ids), 2), -1, np.int64)
    for layer, i, k in np.ndindex(victims.shape):
        v = picks[(layer * 7 + i * 3 + k) % len(picks)]
        v = -1 if v < 0 else (v + layer) % max(1, next_pos[ids[i]])
        victims[layer, i, k] = -1 if v in victims[layer, i] else v
    for layer in range(L):
        caches[0].evict_many(layer, [(caches[0].seqs[s], [p for p in vs if p >= 0])
                                     for s, vs in zip(ids, victims[layer].tolist())])
    caches[1].evict_rows_layers(np.arange(L), [caches[1].seqs[s] for s in ids], victims)
    assert _state(caches[0]) == _state(caches[1])
    assert caches[0].evictions_total == caches[1].evictions_total
    check_invariants(caches[1])
    check_block_tables(caches[1])


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(n_rows=st.integers(1, 6), data=st.data())
def test_dropping_pages_of_many_rows_matches_each_in_turn(n_rows, data):
    """An event's emptied pages leave every row's reusable slots at once (``ReusableSlots.drop_pages_each``) as
    ``drop_page`` of each row in turn does, rows partly taken back (a head past 0) among them; later pushes and
    takes agree too."""
    cls, n_pages = ("fp32", 0), 12
    each, batch = ReusableSlots(2, n_rows), ReusableSlots(2, n_rows)
    orders = np.asarray(data.draw(st.permutations(range(n_pages))), np.int64)
    free = lambda layers, p, s: np.ones(len(p), bool)  # noqa: E731
    slot = st.tuples(st.integers(0, n_pages - 1), st.integers(0, 3))
    for r in (each, batch):
        r.note_orders(1, "fp32", np.arange(n_pages), orders)
    for row in range(n_rows):
        held = data.draw(st.lists(slot, unique=True, max_size=20))
        taken = data.draw(st.integers(0, 4))
        for r in (each, batch):
            if held:
                r.push(1, np.full(len(held), row), cls, np.array([p for p, _ in held]), np.array([s for _, s in held]))
            r.take(1, row, cls, taken, free)
    rows = np.asarray(data.draw(st.lists(st.integers(0, n_rows - 1), unique=True, max_size=n_rows)), np.int64)
    if data.draw(st.booleans()):  # any pages, a page dropped by several rows among them
        gone = [data.draw(st.lists(st.integers(0, n_pages - 1), unique=True, min_size=1, max_size=4)) for _ in rows]
    else:  # each page by one row at most (an eviction's: a table's pages are its own)
        pool = data.draw(st.permutations(range(n_pages)))
        cuts = sorted(data.draw(st.lists(st.integers(0, n_pages), min_size=len(rows), max_size=len(rows))))
        gone = [pool[a:b] for a, b in zip([0] + cuts[:-1], cuts)]
        rows, gone = rows[[i for i, g in enumerate(gone) if g]], [g for g in gone if g]
    for row, pages in zip(rows.tolist(), gone):
        each.drop_page(1, row, cls, pages)
    batch.drop_pages_each(1, rows, cls, np.array([p for ps in gone for p in ps], np.int64),
                          np.array([len(ps) for ps in gone], np.int64))
    assert [each.entries(1, r) for r in range(n_rows)] == [batch.entries(1, r) for r in range(n_rows)]
    more = data.draw(st.lists(slot, max_size=6, unique=True))
    for r in (each, batch):
        if more:
            r.push(1, np.zeros(len(more), np.int64), cls, np.array([p for p, _ in more]), np.array([s for _, s in more]))
    assert each.take(1, 0, cls, 5, free) == batch.take(1, 0, cls, 5, free)
    assert [each.entries(1, r) for r in range(n_rows)] == [batch.entries(1, r) for r in range(n_rows)]


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(lens=st.lists(st.integers(1, 30), min_size=2, max_size=5), classes=st.sampled_from([1, 2]), data=st.data())
def test_compaction_of_many_requests_matches_each_in_turn(lens, classes, data):
    """Compact-mode ``evict_many`` gathers every hit request's survivors of a format in one pass
    (``compaction.compact_many``; with one class a table, ``compact_rows`` from the batch's block tables): the same
    state, codes, freed pages and block tables as evicting and compacting each in turn, for requests whose pages
    interleave in the pool."""
    caches = [make_cache("compact", g=1), make_cache("compact", g=1)]
    gen = torch.Generator().manual_seed(0)
    for sid in range(len(lens)):
        for c in caches:
            c.add_sequence(sid)
    for t in range(max(lens)):  # token by token across the requests: their pages interleave
        for sid, n in enumerate(lens):
            if t < n:
                k, v = torch.randn(2, 1, H, D, generator=gen)
                for c in caches:
                    for layer in range(L):
                        c.write(c.seqs[sid], layer, k, v, [t], ("fp32", t % classes))
    seqs = [caches[0].seqs[sid] for sid in range(len(lens))]
    caches[0].block_tables(1, seqs)  # (the batch's tables, read before the event as a decode step does)
    victims = [data.draw(st.lists(st.integers(0, n - 1), unique=True, max_size=n)) for n in lens]
    got = caches[0].evict_many(1, [(caches[0].seqs[sid], v) for sid, v in enumerate(victims)])
    want = [caches[1].evict(caches[1].seqs[sid], 1, v) for sid, v in enumerate(victims)]
    assert got == want
    check_block_tables(caches[0])
    assert _state(caches[0]) == _state(caches[1])
    check_invariants(caches[0])
    for sid in range(len(lens)):
        live = caches[1].live_positions(caches[1].seqs[sid], 1)
        for x, y in zip(*(c.gather_kv(c.seqs[sid], 1, live) for c in caches)):
            assert torch.equal(x, y)


def test_block_tables_follow_a_page_joining_the_middle_of_its_format():
    """A batch's page boundary appends each request's new page to the cached block tables in place, except where
    the page joins a class listed before another class of its format (then it lands mid-row: rewritten)."""
    cache = make_cache(g=1)
    for sid in range(3):
        cache.add_sequence(sid)
    seqs = [cache.seqs[s] for s in sorted(cache.seqs)]
    k = v = torch.ones(len(seqs), H, D)
    pos = 0
    for cls, n in ((("fp32", 0), 4), (("fp32", 1), 4), (("fp32", 0), 6), (("fp32", 1), 6)):
        for _ in range(n):  # a page of class 0, one of class 1, then class 0 again across a page boundary
            cache.write_through(0, seqs, k, v, [pos] * len(seqs), cls)
            pos += 1
            check_block_tables(cache)
    (_, bt), = cache.block_tables(0, seqs)
    assert bt[0].tolist() == [p for c in (("fp32", 0), ("fp32", 1)) for p in seqs[0].layers[0].pages[c]]


def test_block_tables_of_a_layer_survive_another_layers_page_change():
    """A layer whose page lists did not change hands back the tables it built (the same tensors) while another
    layer's lists change; its own change is seen."""
    cache = make_cache(g=1)
    for sid in range(3):
        cache.add_sequence(sid)
    seqs = [cache.seqs[s] for s in sorted(cache.seqs)]
    k = v = torch.ones(len(seqs), H, D)
    for pos in range(5):  # two pages each
        for layer in range(L):
            cache.write_through(layer, seqs, k, v, [pos] * len(seqs), ("fp32", 0))
    before = [cache.block_tables(layer, seqs) for layer in range(L)]
    cache.evict_many(1, [(s, [0, 1, 2, 3]) for s in seqs])  # layer 1's first pages go
    assert all(a is b for (_, a), (_, b) in zip(cache.block_tables(0, seqs), before[0]))
    (_, bt), = cache.block_tables(1, seqs)
    assert bt.tolist() != before[1][0][1].tolist()
    check_block_tables(cache)


@pytest.mark.parametrize("classes", [1, 2])
def test_block_tables_drop_an_events_emptied_pages_in_place(classes):
    """Eviction events emptying pages of every request (of one or two classes) leave block tables that drop those
    pages in place, two events between reads included, without rewriting any row from its lists, equal to tables
    built anew; a row that also changed in a way not recorded is rewritten."""
    cache = make_cache(g=1)
    for sid in range(4):
        cache.add_sequence(sid)
    seqs = [cache.seqs[s] for s in sorted(cache.seqs)]
    k = v = torch.ones(len(seqs), H, D)
    for pos in range(24):  # six pages each, alternating classes in fours when there are two
        cls = ("fp32", (pos // 4) % classes)
        for layer in range(L):
            cache.write_through(layer, seqs, k, v, [pos] * len(seqs), cls)
    for layer in range(L):
        cache.block_tables(layer, seqs)
    victims = [[0, 1, 2, 3, 8, 9, 10, 11, 13], [4, 5, 6, 7], [], [16, 17, 18, 19, 20, 21, 22, 23, 0]]
    cache.evict_many(1, [(s, v) for s, v in zip(seqs, victims)])
    cache.evict_many(1, [(s, v) for s, v in zip(seqs[:3], [[20, 21, 22, 23], [12, 13, 14, 15], [8, 9, 10, 11]])])
    cache.evict(seqs[3], 1, [4, 5, 6, 7])  # row 3 changes again, one by one: another page goes, unrecorded
    rewritten = []
    original = BlockTable.catch_up_each
    with patch.object(BlockTable, "catch_up_each", lambda tabs: (rewritten.extend(tabs), original(tabs))):
        (_, bt), = cache.block_tables(1, seqs)
    assert rewritten == [seqs[3].layers[1]]
    assert ((bt >= 0).sum(1) < 6).all()  # (every row lost pages)
    check_block_tables(cache)


@pytest.mark.parametrize("depth", [1, 2])
def test_block_tables_follow_a_compacting_event_and_a_page_boundary_in_place(depth):
    """A compacting event (pages it emptied leave; the compaction reads the batch's block tables, then cuts pages)
    and the next step's page boundary come between two reads of the batch's block tables: the cut and the boundary,
    applied in place when the columns keep two changes a row (a row with one in place either way), else rewritten
    from the lists; equal to tables built anew."""
    with patch("trtkv.cache.page_changes.DEPTH", depth):
        cache = make_cache("compact", g=1)
    for sid in range(4):
        cache.add_sequence(sid)
    seqs = [cache.seqs[s] for s in sorted(cache.seqs)]
    k = v = torch.ones(len(seqs), H, D)
    for pos in range(24):  # six full pages each
        for layer in range(L):
            cache.write_through(layer, seqs, k, v, [pos] * len(seqs), ("fp32", 0))
    for layer in range(L):
        cache.block_tables(layer, seqs)
    # rows 0 and 1 empty a page and cut one more; row 2 keeps everything; row 3 empties none and cuts two
    victims = [[0, 1, 2, 3, 5, 9, 13, 17], [4, 5, 6, 7, 10, 14, 18, 22], [], [1, 2, 3, 4, 6, 7, 8, 9]]
    cache.evict_many(1, [(s, v) for s, v in zip(seqs, victims) if v])
    for layer in range(L):  # 16 or 24 tokens in full pages: the next write opens a page everywhere
        cache.write_through(layer, seqs, k, v, [24] * len(seqs), ("fp32", 0))
    rewritten = []
    original = BlockTable.catch_up_each
    with patch.object(BlockTable, "catch_up_each", lambda tabs: (rewritten.extend(tabs), original(tabs))):
        (_, bt), = cache.block_tables(1, seqs)
    assert rewritten == ([] if depth == 2 else [seqs[0].layers[1], seqs[1].layers[1], seqs[3].layers[1]])
    assert (bt >= 0).sum(1).tolist() == [5, 5, 7, 5]
    check_block_tables(cache)


def test_block_tables_follow_a_flushed_page_joining_the_middle_of_its_format():
    """The same for a batch's flush into fresh whole pages (one group a page)."""
    g = 4
    cache = make_cache(block=g, g=g)
    for sid in range(3):
        cache.add_sequence(sid)
    seqs = [cache.seqs[s] for s in sorted(cache.seqs)]
    pos = 0
    for cls in (("nvfp4", 0), ("nvfp4", 1), ("nvfp4", 0), ("nvfp4", 1)):
        for _ in range(g):
            k = torch.randn(len(seqs), H, D, generator=torch.Generator().manual_seed(pos))
            cache.buffer_append(0, seqs, k, k, [pos] * len(seqs))
            pos += 1
        cache.flush_many(0, seqs, [cls] * len(seqs), [-1] * len(seqs))
        check_block_tables(cache)
    (_, bt), = cache.block_tables(0, seqs)
    assert bt[0].tolist() == [p for c in (("nvfp4", 0), ("nvfp4", 1)) for p in seqs[0].layers[0].pages[c]]


many_op = st.one_of(st.tuples(st.just("add")),
                    st.tuples(st.just("alloc"), st.integers(0, len(WT_CLASSES) - 1),
                              st.lists(st.integers(0, 11), min_size=6, max_size=6)),
                    st.tuples(st.just("alloc"), st.integers(0, len(WT_CLASSES) - 1),
                              st.lists(st.integers(0, 11), min_size=6, max_size=6)),
                    st.tuples(st.just("evict"), st.integers(0, 5), st.integers(0, 1),
                              st.lists(st.integers(0, 200), min_size=1, max_size=6)),
                    st.tuples(st.just("free"), st.integers(0, 5)))


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops=st.lists(many_op, min_size=5, max_size=30), full=st.booleans(), queue=st.booleans())
def test_alloc_slots_each_matches_alloc_slots_in_turn(ops, full, queue):
    """``alloc_slots_each`` (several slots for each request of a batch, new pages in one pool call: a host tier's
    moves) hands out the slots and leaves the state of each request's ``alloc_slots`` in turn: reusable slots
    first, open tails, new pages in request order; page order, open pages, bytes, block tables — whether the new
    pages wait in ``FreshPages`` (``queue``) or join the tables' lists at once (a prompt's). A small pool
    (``full``) sends the batch back to table by table."""
    caches = [make_cache(g=1, max_pages=12 if full else 256) for _ in range(2)]
    next_pos: dict[int, int] = {}
    for o in ops:
        ids = sorted(caches[0].seqs)
        if o[0] == "add" and len(ids) >= 6:
            continue
        if o[0] == "add" or not ids:
            add_everywhere(caches, next_pos)
            continue
        if o[0] == "alloc":
            cls, layer = WT_CLASSES[o[1]], o[1] % L
            counts = np.array(o[2][:len(ids)], np.int64)
            pos = {sid: list(range(next_pos[sid], next_pos[sid] + n)) for sid, n in zip(ids, counts.tolist())}
            got = []
            try:
                for sid, n in zip(ids, counts.tolist()):
                    got.append(caches[0].alloc_slots(caches[0].seqs[sid], layer, cls, n))
            except OutOfKVMemory:
                with pytest.raises(OutOfKVMemory):
                    caches[1].alloc_slots_each([caches[1].seqs[s] for s in ids], layer, cls, counts, queue)
                return  # (a full pool mid-batch: both raise; the states may differ only past this point)
            pages, slots = caches[1].alloc_slots_each([caches[1].seqs[s] for s in ids], layer, cls, counts, queue)
            assert pages.tolist() == np.concatenate([p for p, _ in got]).tolist()
            assert slots.tolist() == np.concatenate([s for _, s in got]).tolist()
            for c in caches:  # the tokens land in the slots (both caches the same)
                at = 0
                for sid, n in zip(ids, counts.tolist()):
                    c.record_written(c.seqs[sid], layer, c.pool(layer, cls[0]), cls[0], pages[at:at + n],
                                     slots[at:at + n], pos[sid])
                    at += n
            for sid, n in zip(ids, counts.tolist()):
                next_pos[sid] += n
        elif o[0] == "evict":
            sid = ids[o[1] % len(ids)]
            for c in caches:
                c.evict(c.seqs[sid], o[2], [p % max(1, next_pos[sid]) for p in o[3]])
        elif len(ids) > 1:
            for c in caches:
                c.free_sequence(ids[o[1] % len(ids)])
        assert _state(caches[0]) == _state(caches[1])
        check_block_tables(caches[1])
    check_invariants(caches[1])


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops=st.lists(st.one_of(
    st.tuples(st.just("add")),
    st.tuples(st.just("write"), st.integers(0, 3), st.integers(0, len(WT_CLASSES) - 1), st.integers(1, 4)),
    st.tuples(st.just("evict"), st.integers(0, 3), st.integers(0, 1), st.lists(st.integers(0, 200), max_size=8)),
    st.tuples(st.just("free"), st.integers(0, 3)),
    st.tuples(st.just("prompts"), st.integers(0, len(WT_CLASSES) - 1), st.lists(st.integers(0, 20), min_size=1,
                                                                                 max_size=5))), min_size=1, max_size=25))
def test_prompts_write_many_matches_one_write_a_request(ops):
    """``write_many`` (a packed prefill's prompts of one write-through class: slots for every request at once, one
    kernel call) leaves exactly the state of ``write`` request after request: slots (reused after evictions,
    open-page tails, fresh pages in request order), stored codes, bytes and block tables read in place."""
    batched, each = make_cache(g=1, max_pages=512), make_cache(g=1, max_pages=512)
    next_pos: dict[int, int] = {}
    for o in ops:
        ids = sorted(batched.seqs)
        if o[0] != "prompts" or not ids:
            apply_op([batched, each], next_pos, o, classes=WT_CLASSES,
                     evict=lambda sid, layer, victims: [c.evict(c.seqs[sid], layer, victims) for c in (batched, each)])
            continue
        cls = WT_CLASSES[o[1]]
        jobs = [(sid, n) for sid, n in zip(ids, o[2]) if n]
        if not jobs:
            continue
        counts = np.array([n for _, n in jobs], np.int64)
        pos = [list(range(next_pos[sid], next_pos[sid] + n)) for sid, n in jobs]
        gen = torch.Generator().manual_seed(int(counts.sum()) + len(ids))
        k, v = torch.randn(int(counts.sum()), H, D, generator=gen), torch.randn(int(counts.sum()), H, D, generator=gen)
        for layer in range(L):
            batched.write_many(layer, [batched.seqs[sid] for sid, _ in jobs], k, v, counts, np.concatenate(pos), cls,
                               np.full(int(counts.sum()), -1, np.int32))
            at = 0
            for (sid, n), p in zip(jobs, pos):
                each.write(each.seqs[sid], layer, k[at:at + n], v[at:at + n], p, cls)
                at += n
        for sid, n in jobs:
            next_pos[sid] += n
        assert _state(batched) == _state(each)
        assert_same_bytes(batched, each)
        check_block_tables(batched)
    check_invariants(batched)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops=st.lists(st.one_of(op, st.tuples(st.just("prompt"), st.integers(0, 3), st.integers(0, 3),
                                            st.integers(1, 6)),
                              st.tuples(st.just("prompts"), st.integers(0, 3), st.lists(st.integers(0, 3), min_size=1,
                                                                                         max_size=5))),
                    min_size=1, max_size=30),
       block=st.sampled_from([2, 4, 8]))
def test_prompt_groups_write_matches_one_write_per_group(ops, block):
    """``write_groups`` (a quantized prompt's groups: slots and key-scale groups at once, one kernel call) and
    ``write_many`` with groups (several requests' prompts at once, a packed prefill's) leave exactly the state of
    ``write`` group after group, request after request: slots (reused after evictions, open-page tails, fresh
    pages), key-scale groups, stored codes, bytes and block tables."""
    g = 4
    batched, each = make_cache(block=block, g=g, max_pages=512), make_cache(block=block, g=g, max_pages=512)
    next_pos: dict[int, int] = {}
    for o in ops:
        ids = sorted(batched.seqs)
        if o[0] not in ("prompt", "prompts") or not ids:
            apply_op([batched, each], next_pos, o,
                     evict=lambda sid, layer, victims: [c.evict(c.seqs[sid], layer, victims) for c in (batched, each)])
            continue
        cls = CLASSES[o[2] if o[0] == "prompt" else o[1]]
        jobs = [(ids[o[1] % len(ids)], o[3] * g)] if o[0] == "prompt" else [
            (sid, n * g) for sid, n in zip(ids, o[2]) if n]
        if not jobs:
            continue
        pos = [list(range(next_pos[sid], next_pos[sid] + n)) for sid, n in jobs]
        for sid, n in jobs:
            next_pos[sid] += n
        total = sum(n for _, n in jobs)
        gen = torch.Generator().manual_seed(total + pos[0][0])
        k, v = torch.randn(total, H, D, generator=gen) * 3, torch.randn(total, H, D, generator=gen)
        for layer in range(L):
            if o[0] == "prompt":
                batched.write_groups(batched.seqs[jobs[0][0]], layer, k, v, pos[0], cls, 5, g)
            else:
                batched.write_many(layer, [batched.seqs[sid] for sid, _ in jobs], k, v,
                                   np.array([n for _, n in jobs], np.int64), np.concatenate(pos), cls,
                                   np.full(total, 5, np.int32), g)
            at = 0
            for (sid, n), p in zip(jobs, pos):
                for s in range(0, n, g):
                    each.write(each.seqs[sid], layer, k[at + s:at + s + g], v[at + s:at + s + g], p[s:s + g], cls, 5)
                at += n
        assert _state(batched) == _state(each)
        assert_same_bytes(batched, each)
        check_block_tables(batched)
    check_invariants(batched)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops=st.lists(st.one_of(op, st.tuples(st.just("finish"), st.lists(st.integers(0, 7), min_size=1, max_size=4))),
                    min_size=1, max_size=30))
def test_freeing_many_requests_at_once_matches_each_in_turn(ops):
    """``free_sequences`` (a batch finishing together: one call per layer and format) leaves exactly the state of
    ``free_sequence`` of each in turn — pages, the free heap, key-scale groups and their free order (so later
    writes get the same ids, which the ops after it check), reuse heaps and bytes."""
    batched, each = make_cache(max_pages=256), make_cache(max_pages=256)
    next_pos: dict[int, int] = {}
    warm = [("add",)] * 4 + [("write", i, i, 4) for i in range(4)] + [("write", i, 3 - i, 3) for i in range(4)]
    for o in warm + ops:
        ids = sorted(batched.seqs)
        if o[0] != "finish" or len(ids) < 2:
            apply_op([batched, each], next_pos, o,
                     evict=lambda sid, layer, victims: [c.evict(c.seqs[sid], layer, victims) for c in (batched, each)])
        else:
            gone = list(dict.fromkeys(ids[i % len(ids)] for i in o[1]))[:len(ids) - 1]  # (one request stays)
            batched.free_sequences(gone)
            for sid in gone:
                each.free_sequence(sid)
        assert _state(batched) == _state(each)
        assert_same_bytes(batched, each)
    check_invariants(batched)


WAITING_CLASSES = [("nvfp4", 0), ("nvfp4", 1), ("fp32", 0)]


def _flushing_caches(g: int) -> list[KVCacheManager]:
    """Two like caches of five requests, flushing groups of ``g`` tokens into pages of ``g`` slots."""
    caches = [make_cache(block=g, g=g, max_pages=512) for _ in range(2)]
    for c in caches:
        for sid in range(5):
            c.add_sequence(sid)
    return caches


def _append_and_flush(caches: list[KVCacheManager], pos: int, g: int, gen: torch.Generator) -> None:
    """One drawn token at ``pos`` for every request in every layer of each cache; at a group's end the batch's flush,
    in one class a group (``WAITING_CLASSES`` in turn: whole fresh pages, waiting for their tables)."""
    k, v = torch.randn(5, H, D, generator=gen), torch.randn(5, H, D, generator=gen)
    for c in caches:
        seqs = [c.seqs[s] for s in sorted(c.seqs)]
        for layer in range(L):
            c.buffer_append(layer, seqs, k, v, [pos] * 5)
            if pos % g == g - 1:
                c.flush_many(layer, seqs, [WAITING_CLASSES[(pos // g) % 3]] * 5, [7] * 5)


def test_catching_up_tables_with_pages_of_several_classes_waiting_matches_each_table_alone():
    """A batch's flushes in changing classes leave pages of several classes waiting for a table; ``catch_up_each``
    (grouped by array operations) gives every table the lists, list order and pages that each table taking its own
    waiting pages gives."""
    g = 4
    caches = _flushing_caches(g)
    gen = torch.Generator().manual_seed(0)
    for pos in range(10 * g):
        _append_and_flush(caches, pos, g, gen)
    joined = []
    original = BlockTable._join_waiting_each
    with patch.object(BlockTable, "_join_waiting_each", lambda tabs, *a: (joined.extend(tabs), original(tabs, *a))):
        BlockTable.catch_up_each([caches[0].seqs[s].layers[1] for s in range(5)])
    assert joined  # (tables with pages of several classes waiting)
    for s in range(5):
        caches[1].seqs[s].layers[1].take_waiting_pages()
        assert list(caches[0].seqs[s].layers[1].pages.items()) == list(caches[1].seqs[s].layers[1].pages.items())
    check_block_tables(caches[0])


def test_releasing_pages_still_waiting_matches_releasing_them_after_each_table_took_its_pages():
    """An event that empties pages a batch's flush gave (still waiting to join their tables' lists) and pages
    already in the lists: each table ends with the lists, list order, bytes, pool pages and block tables that
    taking its waiting pages first and then releasing gives (``FreshPages.drop`` leaves the emptied entries so a
    table's classes keep their order)."""
    g = 4
    caches = _flushing_caches(g)
    gen = torch.Generator().manual_seed(1)
    rng = np.random.default_rng(1)
    dropped = []
    original = FreshPages.drop
    for pos in range(12 * g):
        _append_and_flush(caches, pos, g, gen)
        if pos == 5 * g:  # some tables take their pages in (later pages wait)
            for s in (0, 2):
                caches[0].seqs[s].layers[1].take_waiting_pages()
        if pos % (3 * g) == 3 * g - 1:  # an event: whole groups of some requests evicted in one layer
            jobs = [(s, np.arange(pos + 1 - 2 * g, pos + 1 - g)) for s in range(5) if rng.random() < 0.8]
            seq_ids = [s for s, _ in jobs]
            flat_positions = np.concatenate([p for _, p in jobs])
            lens = np.array([len(p) for _, p in jobs])
            for i, c in enumerate(caches):
                if i == 1:  # the reference: every table takes its waiting pages before the event
                    for s in seq_ids:
                        c.seqs[s].layers[1].take_waiting_pages()
                seen = dropped if i == 0 else []
                with patch.object(FreshPages, "drop", lambda self, *a, seen=seen: seen.append(original(self, *a)) or
                                  seen[-1]):
                    c.evict_flat(1, [c.seqs[s] for s in seq_ids], flat_positions, lens)
    assert any(d.any() for d in dropped) and any((~d).any() for d in dropped)  # (waiting and listed pages released)
    _assert_same_lists_bytes_and_pools(*caches)
    check_block_tables(caches[0])


def _assert_same_lists_bytes_and_pools(a: KVCacheManager, b: KVCacheManager) -> None:
    """Every table's lists in the same order, every request's bytes (and ``a``'s recounted), every pool's free pages."""
    for s in sorted(a.seqs):
        for layer in range(L):
            assert list(a.seqs[s].layers[layer].pages.items()) == list(b.seqs[s].layers[layer].pages.items())
        assert a.seqs[s].kv_bytes == b.seqs[s].kv_bytes == a.recount_bytes(a.seqs[s])
    for layer in range(L):
        for fmt, pool in a.pools[layer].items():
            assert sorted(pool.free) == sorted(b.pools[layer][fmt].free)


@pytest.mark.parametrize("depth", [2, 16])
def test_pages_an_event_released_leave_the_lists_when_read_as_if_released_at_once(depth):
    """Events emptying whole pages of a write-through batch (pages in their tables' lists) leave the pages waiting to
    leave the lists (``LeavingPages``; past a row's room, depth 2, the table drops its own at once) while later page
    boundaries hand the freed pages back to the same tables: each table ends with the lists, list order, bytes, pool
    pages and block tables that reading every table right after each event gives."""
    with patch("trtkv.cache.leaving_pages.DEPTH", depth):
        caches = [make_cache(g=1, max_pages=512) for _ in range(2)]
        for c in caches:
            for sid in range(5):
                c.add_sequence(sid)
        gen = torch.Generator().manual_seed(2)
        fits, released, came_back = [], set(), False
        original = LeavingPages.fits
        for pos in range(64):
            k, v = torch.randn(5, H, D, generator=gen), torch.randn(5, H, D, generator=gen)
            for c in caches:
                seqs = [c.seqs[s] for s in sorted(c.seqs)]
                for layer in range(L):
                    c.write_through(layer, seqs, k, v, [pos] * 5, ("fp32", 0))
            if pos == 30:  # every table takes its waiting pages in: the pages the events empty are in the lists
                for c in caches:
                    for s in range(5):
                        c.seqs[s].layers[1].take_waiting_pages()
            if pos > 30 and pos % 8 == 7:  # an event: an old page of four requests emptied in one layer
                ids = [s for s in range(5) if s != (pos // 8) % 5]
                first = 4 * (pos // 8 - 3)
                flat = np.concatenate([np.arange(first, first + 4)] * len(ids))
                before = {s: set(caches[1].seqs[s].layers[1].pages[("fp32", 0)]) for s in ids}
                for i, c in enumerate(caches):
                    with patch.object(LeavingPages, "fits", lambda self, *a: fits.append(original(self, *a)) or fits[-1]):
                        c.evict_flat(1, [c.seqs[s] for s in ids], flat, np.full(len(ids), 4))
                    if i == 1:  # the reference: every table reads its lists at once
                        for s in ids:
                            gone = before[s] - set(c.seqs[s].layers[1].pages[("fp32", 0)])
                            released |= {(s, p) for p in gone}
            else:
                came_back |= any(p in caches[1].seqs[s].layers[1].pages[("fp32", 0)] for s, p in released)
        assert came_back  # (a page that left came back as a fresh page of the same table)
        assert all(f.all() for f in fits) == (depth == 16)  # (depth 2: some table dropped its pages at once)
        _assert_same_lists_bytes_and_pools(*caches)
        for c in caches:
            check_block_tables(c)
            check_invariants(c)
