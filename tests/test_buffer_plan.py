"""A decode step that records every layer's residual-buffer slots at layer 0 (``KVCacheManager.plan_buffer_append``)
keeps what appending layer by layer keeps: the same tokens, the same positions attended at every step and layer,
and the same buffers and pages, for requests of different lengths (so some steps fill a buffer and flush, which
plan nothing, and the others append through the plan)."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from policy_matrix import Probe, one_thread

from trtkv.api import SamplingParams
from trtkv.cache.config import CacheConfig
from trtkv.cache.manager import KVCacheManager
from trtkv.cache.residual import ResidualArena

assert one_thread  # autouse: one intra-op thread for this module

PROMPTS = ["The quick brown fox jumps over the lazy dog.", "Numbers: 1, 2, 3", "A",
           "Once upon a time, in a land far away, there lived a wise old king."]
PARAMS = [SamplingParams(max_tokens=n, ignore_eos=True, chat=False) for n in (70, 45, 60, 52)]


def _run(eng, prompts=PROMPTS, params=PARAMS):
    with Probe(eng, record_sets=True) as probe:
        res = eng.generate(prompts, params)
    stats = [{k: r.stats[k] for k in ("evicted_tokens", "eviction_events", "kv_bytes", "peak_kv_bytes", "pages")
              if k in r.stats}
             for r in res]
    return [r.token_ids for r in res], [probe.sets[i] for i in sorted(probe.sets)], stats


@pytest.mark.parametrize("policy,settings", [("kivi", {}), ("thinkv", {"budget": 48}), ("full", {"kv_format": "int4"})])
def test_planned_buffer_appends_equal_layer_by_layer(engine_factory, load_engine, tiny_ckpt, monkeypatch, policy,
                                                     settings):
    eng = load_engine(engine_factory(tiny_ckpt, policy, **settings))
    assert eng.core.g > 1  # (the format buffers tokens)
    plan, planned = KVCacheManager.plan_buffer_append, []

    def spy(self, seqs, positions):
        at = plan(self, seqs, positions)
        planned.append(at is not None)
        return at

    monkeypatch.setattr(KVCacheManager, "plan_buffer_append", spy)
    got = _run(eng)
    assert any(planned) and not all(planned)  # planned steps, and steps whose buffers fill (layer by layer)
    monkeypatch.setattr(KVCacheManager, "plan_buffer_append", lambda self, seqs, positions: None)
    assert got == _run(eng)


@pytest.mark.parametrize("policy,settings", [("kivi", {}), ("thinkv", {"budget": 32, "tau": 16})])
def test_planned_flushes_equal_layer_by_layer(engine_factory, load_engine, tiny_ckpt, monkeypatch, policy, settings):
    """A step whose buffers all fill takes every layer's fresh pages when layer 0 flushes (``plan_flush``): the same
    tokens, positions attended, evictions and peak bytes as each layer taking its own, and each request's bytes and peak
    once a step's last layer flushed (ThinKV's anneals release bytes between flushes). (One prompt length, so the
    batch's buffers fill together; sampled, so the requests differ; they end at different steps.)"""
    eng = load_engine(engine_factory(tiny_ckpt, policy, **settings))
    # a prompt of whole groups and pages: no open page after prefill, so the flushes take fresh pages
    whole = eng.core.g * eng.core.cache.cfg.block_size
    prompt = next(p for p in ("word " * k for k in range(1, 200)) if len(eng.encode_prompt(p, False)) % whole == 0)
    prompts = [prompt] * 4
    params = [SamplingParams(max_tokens=n, ignore_eos=True, chat=False, temperature=0.8, seed=i)
              for i, n in enumerate((70, 45, 60, 52))]
    plan, planned = KVCacheManager.plan_flush, []

    def spy(self, seqs, classes, charge_each_layer=False):
        got = plan(self, seqs, classes, charge_each_layer)
        planned.append((0 if got is None else len(got.pages), charge_each_layer))
        return got

    flush, charged = KVCacheManager.flush_many, []

    def record(self, layer, seqs, *args, **kwargs):  # each request's bytes and peak once a step's layers flushed
        flush(self, layer, seqs, *args, **kwargs)
        if layer == self.cfg.num_layers - 1:
            charged.append([(s.account.bytes, s.account.peak) for s in seqs])

    monkeypatch.setattr(KVCacheManager, "plan_flush", spy)
    monkeypatch.setattr(KVCacheManager, "flush_many", record)
    got = _run(eng, prompts, params), list(charged)
    assert max(n for n, _ in planned) == eng.core.arch.num_hidden_layers  # (steps whose every layer's were planned)
    # ThinKV: flushes on anneal steps planned too, each layer charged at its flush (its anneal releases between)
    assert any(n and each for n, each in planned) == (policy == "thinkv")
    monkeypatch.setattr(KVCacheManager, "plan_flush", lambda self, seqs, classes, charge_each_layer=False: None)
    charged.clear()
    assert got == (_run(eng, prompts, params), charged)


def test_buffer_membership_of_jobs_equals_a_set_per_job():
    """``ResidualArena.holds_any``: per job, whether the row's buffer in the layer holds any of its positions (stale
    entries past a buffer's fill are not held), as a set per job says; rows may repeat across jobs."""
    rng = np.random.default_rng(0)
    arena = ResidualArena(CacheConfig(num_layers=3, num_kv_heads=1, head_dim=2, block_size=4, residual_group=4,
                                      residual_dtype=torch.float32), rows=6)
    arena.pos[:] = rng.integers(0, 30, arena.pos.shape)
    arena.fill[:] = rng.integers(0, 5, arena.fill.shape)
    for layer in range(3):
        rows = rng.integers(0, 6, 9)
        counts = rng.integers(0, 5, 9)
        positions = rng.integers(0, 30, int(counts.sum()))
        starts = np.cumsum(counts) - counts
        want = [bool(set(arena.pos[r, layer, :arena.fill[r, layer]].tolist()) &
                     set(positions[s:s + c].tolist())) for r, s, c in zip(rows, starts, counts)]
        assert arena.holds_any(layer, rows, positions, counts).tolist() == want
    # positions older than every buffered one, but one: only that job holds one
    arena.pos[:] = np.arange(10, 14)
    arena.fill[:] = 4
    rows, counts = np.array([0, 1, 2]), np.array([3, 2, 3])
    positions = np.array([1, 2, 9, 3, 4, 5, 10, 6])
    assert arena.holds_any(0, rows, positions, counts).tolist() == [False, False, True]


def test_oldest_buffered_position_of_each_row_over_layers():
    """``ResidualArena.oldest_rows``: the least position a row buffers in any layer (or in one given layer), stale
    entries past a buffer's fill not counted; int64 max where nothing is buffered."""
    arena = ResidualArena(CacheConfig(num_layers=2, num_kv_heads=1, head_dim=2, block_size=4, residual_group=4,
                                      residual_dtype=torch.float32), rows=3)
    arena.pos[:] = [[[9, 3, 8, 1], [7, 6, 2, 0]], [[4, 5, 6, 7], [1, 2, 3, 4]], [[0, 0, 0, 0], [0, 0, 0, 0]]]
    arena.fill[:] = [[3, 2], [0, 4], [0, 0]]
    assert arena.oldest_rows(np.array([0, 1, 2, 0])).tolist() == [3, 1, np.iinfo(np.int64).max, 3]
    assert arena.oldest_rows(np.array([0, 0, 1, 1]), np.array([0, 1, 0, 1])).tolist() == [
        3, 6, np.iinfo(np.int64).max, 1]


@pytest.mark.parametrize("settings", [{}, {"kv_format": "int4"}])
def test_tiered_steps_planned_equal_layer_by_layer(engine_factory, load_engine, tiny_ckpt, monkeypatch, settings):
    """With host tiers, a decode step's write slots (or buffer slots) are planned at layer 0 too: the same tokens,
    attended positions and stats as planning nothing (tiers change only at the policy's events, and staging reads
    them without touching the device's tables)."""
    eng = load_engine(engine_factory(tiny_ckpt, "tiered", budget=24, interval=8, window=8, **settings))
    planner = "plan_buffer_append" if eng.core.g > 1 else "plan_write_through"
    plan, planned = getattr(KVCacheManager, planner), []

    def spy(self, *args):
        at = plan(self, *args)
        planned.append(at is not None)
        return at

    monkeypatch.setattr(KVCacheManager, planner, spy)
    got = _tiered_run(eng)
    assert eng.core.cache.has_tiers and any(planned) and any(st["tokens_host"] for st in got[2])  # (tokens moved)
    monkeypatch.setattr(KVCacheManager, planner, lambda self, *args: None)
    assert got == _tiered_run(eng)


def _tiered_run(eng):
    with Probe(eng, record_sets=True) as probe:
        res = eng.generate(PROMPTS, PARAMS)
    stats = [{k: v for k, v in r.stats.items() if not k.endswith("_s")} for r in res]  # (not the wall times)
    return [r.token_ids for r in res], [probe.sets[i] for i in sorted(probe.sets)], stats
