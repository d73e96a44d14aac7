"""Tiered KV memory (issue 15): host tiers T1/T2 in the cache, staging, the ``tiered`` policy, ``demote``.

Unit level (fast): attention with tokens split across tiers equals single-tier attention (same storage format,
Proposition 1's kernel half); random write/evict/demote/promote sequences keep every token in exactly one tier
with exact per-tier byte counts and no leaks (hypothesis). Engine level (tiny model): ``tiered`` with r = 0 and
every policy with ``demote=host`` give the greedy tokens of ``full``; errors are one clear line.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from policy_matrix import MATRIX, full_precision, one_thread

import plugins  # noqa: F401
from trtkv.api import SamplingParams
from trtkv.cache.manager import CacheConfig, KVCacheManager
from trtkv.cache.tier_names import TIER_DEVICE, TIER_EVICTED, TIER_HOST, TIER_HOST_Q, parse_demote, parse_tier
from trtkv.errors import TrtkvError
from trtkv.policies import make_policy
from trtkv.runtime.attention import decode_attention, layer_statistics
from trtkv.runtime.staging import HostStaging

assert one_thread
H, D, L, HQ = 2, 16, 2, 4
RAW = SamplingParams(max_tokens=120, ignore_eos=True, chat=False)
PROMPT = "Once upon a time, in a land far away, there lived a wise old king who loved puzzles and riddles."


def make_cache(block=4, g=1, **kw):
    return KVCacheManager(CacheConfig(num_layers=L, num_kv_heads=H, head_dim=D, block_size=block, residual_group=g,
                                      residual_dtype=torch.float32, initial_pages=2, max_pages=256, **kw))


def fill(cache, seq_id, n, fmt, gen, start=0):
    seq = cache.seqs.get(seq_id) or cache.add_sequence(seq_id)
    group = 16 if fmt in ("int4", "nvfp4") else n
    for layer in range(L):
        for s in range(0, n, group):
            m = min(group, n - s)
            k, v = torch.randn(m, H, D, generator=gen), torch.randn(m, H, D, generator=gen)
            cache.write(seq, layer, k, v, list(range(start + s, start + s + m)), (fmt, 0))
    return seq


def attend(cache, seqs, q, staging=None):
    outs = []
    for layer in range(L):
        staged = staging.sources(layer, L) if staging is not None else None
        out, _ = decode_attention(cache, layer, seqs, q, 0.25, [False] * len(seqs), [False] * len(seqs), staged)
        if staged is not None:
            staging.release(layer)
        outs.append(out)
    return torch.stack(outs)


# --- Proposition 1, kernel half -------------------------------------------------------------------
@pytest.mark.parametrize("copy", [False, True], ids=["host-pools-read", "staged-copy"])
@pytest.mark.parametrize("fmt", ["fp32", "int4", "nvfp4"])
def test_split_across_tiers_equals_single_tier(fmt, copy):
    """T1 keeps the storage format bit for bit: attention over device + staged host pages (LSE-merged) equals
    attention over the same tokens on the device alone, to float tolerance, for a batch of two — read where they
    lie (CPU's default) or through the staging copy (CUDA's path)."""
    gen = torch.Generator().manual_seed(0)
    cache = make_cache()
    seqs = [fill(cache, 0, 48, fmt, gen), fill(cache, 1, 32, fmt, gen)]
    q = torch.randn(2, HQ, D, generator=gen)
    ref = attend(cache, seqs, q)
    tiers = cache.tiers
    rng = np.random.default_rng(0)
    for seq, n in zip(seqs, (48, 32)):
        moved = rng.choice(n, size=n // 2, replace=False)
        for layer in range(L):
            assert tiers.place(seq, layer, moved, TIER_HOST) == len(moved)
        assert (tiers.tier_of(seq, 0, moved) == TIER_HOST).all()
        tiers.check(seq)
    staging = HostStaging(cache, copy=copy)
    staging.begin_step(seqs)
    got = attend(cache, seqs, q, staging)
    staging.end_step()
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)
    assert staging.bytes_staged > 0
    assert (staging.staging_bytes() > 0) == copy  # (no staging pool when the host pools are read in place)
    # promote everything back: the device copy is the original one, bit for bit
    for seq, n in zip(seqs, (48, 32)):
        for layer in range(L):
            tiers.place(seq, layer, tiers.host_positions(seq, layer), TIER_DEVICE)
        assert len(tiers.host_positions(seq, 0)) == 0
    torch.testing.assert_close(attend(cache, seqs, q), ref, rtol=1e-5, atol=1e-5)


def test_staging_kept_across_steps_follows_the_tiers():
    """One staging over several steps (CPU keeps a layer's batch tables and statistic positions while its host tier
    and the batch stay the same): every step attends exactly the tokens the tiers hold now — after tokens move either
    way between steps, after a move in one layer only, and after the batch changes."""
    gen = torch.Generator().manual_seed(3)
    cache = make_cache()
    seqs = [fill(cache, 0, 40, "fp32", gen), fill(cache, 1, 24, "fp32", gen)]
    q = torch.randn(2, HQ, D, generator=gen)
    ref = attend(cache, seqs, q)
    tiers, staging = cache.tiers, HostStaging(cache)
    rng = np.random.default_rng(3)

    def step(batch, qb=q):
        staging.begin_step(batch)
        outs = []
        for layer in range(L):
            staged = staging.sources(layer, L)
            out, stats = decode_attention(cache, layer, batch, qb, 0.25, [True] * len(batch),
                                          [False] * len(batch), staged,
                                          staged_positions=staging.positions if staged else None)
            for seq, ls in zip(batch, stats):  # the statistics' columns: every held token once, wherever it lies
                held = np.union1d(cache.live_positions(seq, layer), tiers.host_positions(seq, layer))
                assert np.array_equal(np.sort(ls.positions), held)
            outs.append(out)
        staging.end_step()
        return torch.stack(outs)

    moves = [(0, None, TIER_HOST), (1, None, TIER_HOST), (0, 1, TIER_DEVICE), (1, 0, TIER_HOST), (0, None, TIER_DEVICE)]
    for i, layer_only, tier in moves:
        torch.testing.assert_close(step(seqs), ref, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(step(seqs), ref, rtol=1e-5, atol=1e-5)  # (a step with the stages kept)
        seq = seqs[i]
        for layer in range(L) if layer_only is None else [layer_only]:
            pool = cache.live_positions(seq, layer) if tier == TIER_HOST else tiers.host_positions(seq, layer)
            if len(pool):
                tiers.place(seq, layer, rng.choice(pool, size=(len(pool) + 1) // 2, replace=False), tier)
    torch.testing.assert_close(step(seqs[::-1], q.flip(0)), ref.flip(1), rtol=1e-5, atol=1e-5)  # (other batches)
    torch.testing.assert_close(step(seqs[1:], q[1:]), ref[:, 1:], rtol=1e-5, atol=1e-5)


def test_statistics_of_column_blocks_equal_the_joined_logits():
    """A layer whose sources come as separate logits (device pages, staged host pages) gives the statistics of its
    joined logits in every form: the batch form's head sums are taken block by block, without joining."""
    gen = torch.Generator().manual_seed(5)
    blocks = [torch.randn(3, HQ, n, generator=gen) * 3 for n in (8, 5)]
    blocks[1][1, :, 2:] = -float("inf")  # dead columns
    joined = torch.cat(blocks, -1)
    lse = torch.logsumexp(joined, -1)
    pos = np.arange(13)[None].repeat(3, 0)
    pos[1, 10:] = -1
    args = (pos, H, [True] * 3, [False] * 3)
    one = layer_statistics([b.clone() for b in blocks], lse, *args, batch_form=True, batch_weights=False)
    ref = layer_statistics(joined.clone(), lse, *args, batch_form=True, batch_weights=False)
    assert one.weights is None and torch.equal(one.head_sums, ref.head_sums)
    assert np.array_equal(one.counts, ref.counts) and one.heads == ref.heads == HQ
    w = layer_statistics([b.clone() for b in blocks], lse, *args, batch_form=True)
    assert torch.equal(w.weights, layer_statistics(joined.clone(), lse, *args, batch_form=True).weights)
    rows = layer_statistics([b.clone() for b in blocks], lse, *args, batch_weights=False)
    for a, b in zip(rows, layer_statistics(joined.clone(), lse, *args, batch_weights=False)):
        assert torch.equal(a.head_sums, b.head_sums) and np.array_equal(a.positions, b.positions)


def test_compressed_tier_is_close_not_exact_and_smaller():
    gen = torch.Generator().manual_seed(1)
    cache = make_cache()
    seq = fill(cache, 0, 64, "fp32", gen)
    q = torch.randn(1, HQ, D, generator=gen)
    ref = attend(cache, [seq], q)
    for layer in range(L):
        cache.tiers.place(seq, layer, np.arange(64), TIER_HOST_Q, "int4")
    assert (cache.tiers.tier_of(seq, 0, np.arange(64)) == TIER_HOST_Q).all()
    got_copy = None
    for copy in (False, True):
        st_ = HostStaging(cache, copy=copy)
        st_.begin_step([seq])
        got = attend(cache, [seq], q, st_)
        assert not torch.equal(got, ref)
        assert (got - ref).abs().max() < 0.2
        assert got_copy is None or torch.equal(got, got_copy)  # the same pages read in place or copied
        got_copy = got
    assert cache.tiers.host_bytes(seq) < 64 * L * H * D * 2 * 4 / 4  # int4 codes: well under a quarter of fp32
    cache.tiers.check(seq)


# --- property test: one tier per token, exact bytes, no leaks --------------------------------------
op = st.one_of(
    st.tuples(st.just("write"), st.integers(0, 2), st.sampled_from(["fp32", "int4"]), st.integers(1, 20)),
    st.tuples(st.just("move"), st.integers(0, 2), st.sampled_from(["device", "host", "host-int4", "host-nvfp4",
                                                                   "evicted"]),
              st.lists(st.integers(0, 120), max_size=12), st.sampled_from([None, 0, 1])),
    st.tuples(st.just("evict"), st.integers(0, 2), st.lists(st.integers(0, 120), max_size=8)),
    st.tuples(st.just("free"), st.integers(0, 2)),
)


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops=st.lists(op, min_size=1, max_size=30), eviction=st.sampled_from(["inplace", "compact"]),
       demote=st.sampled_from(["none", "host", "host-int4"]))
def test_random_write_evict_demote_promote(ops, eviction, demote):
    from trtkv.runtime.context import RequestContext

    cache = make_cache(eviction=eviction, demote=demote)
    gen = torch.Generator().manual_seed(0)
    nxt: dict[int, int] = {}
    written: dict[int, set] = {}
    for o in ops:
        sid = o[1]
        if o[0] == "write":
            fmt, n = o[2], o[3]
            if fmt == "int4":
                n = 16
            fill(cache, sid, n, fmt, gen, start=nxt.get(sid, 0))
            written.setdefault(sid, set()).update(range(nxt.get(sid, 0), nxt.get(sid, 0) + n))
            nxt[sid] = nxt.get(sid, 0) + n
        elif sid in cache.seqs:
            seq = cache.seqs[sid]
            ctx = RequestContext(sid, 0, cache, seq, L, HQ)
            if o[0] == "move":
                ctx.place(o[4], o[3], o[2])
            elif o[0] == "evict":
                ctx.evict_all_layers(o[2])
            else:
                cache.free_sequence(sid)
                nxt.pop(sid, None)
                written.pop(sid, None)
        for s in cache.seqs.values():
            cache.tiers.check(s)  # exactly one tier per position, counters equal recounts
            for layer in range(L):
                pos = np.arange(nxt.get(s.seq_id, 0))
                tiers = cache.tiers.tier_of(s, layer, pos)
                n_dev, n_host = (tiers == TIER_DEVICE).sum(), np.isin(tiers, (TIER_HOST, TIER_HOST_Q)).sum()
                assert n_dev == s.layers[layer].live
                assert n_host == len(cache.tiers.host_positions(s, layer))
                if demote != "none":  # demotion never drops: every written token is still held somewhere
                    evicted = set(pos[tiers == TIER_EVICTED].tolist())
                    assert not evicted or o[0] == "move" or evicted <= written[s.seq_id]
    for sid in list(cache.seqs):
        cache.free_sequence(sid)
    host = cache.tiers.host
    assert cache.pages_in_use() == 0 and host.pages_in_use() == 0, "pages leaked"
    for mgr in (cache, host):
        for pools in mgr.pools:
            for pool in pools.values():
                assert pool.groups_in_use == 0, "key-scale groups leaked"
    assert not cache.tiers.seqs and not host.seqs


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(lens=st.lists(st.integers(1, 24), min_size=2, max_size=4), eviction=st.sampled_from(["inplace", "compact"]),
       data=st.data())
def test_place_many_matches_one_request_at_a_time(lens, eviction, data):
    """A batch's moves (``TierStore.place_many``: one copy a format for every request) leave every token in the
    tier, with the values and byte counts, that moving the requests one at a time gives; the batch's staging sizes
    (counted from block tables) are the page lists' sizes."""
    from trtkv.runtime.context import RequestContext

    caches = [make_cache(eviction=eviction), make_cache(eviction=eviction)]
    for c in caches:  # the requests' pages interleave
        gen = torch.Generator().manual_seed(0)
        for t in range(max(lens)):
            for sid, n in enumerate(lens):
                if t < n:
                    fill(c, sid, 1, "fp32", gen, start=t)
    for tier in data.draw(st.lists(st.sampled_from(["host", "device", "evicted"]), min_size=1, max_size=4)):
        picks = [data.draw(st.lists(st.integers(0, n - 1), unique=True, max_size=n)) for n in lens]
        layer = data.draw(st.sampled_from([None, 0, 1]))
        ctxs = [[RequestContext(sid, 0, c, c.seqs[sid], L, HQ) for sid in range(len(lens))] for c in caches]
        got = ctxs[0][0].place_many(layer, list(zip(ctxs[0], picks)), tier)
        want = [ctx.place(layer, p, tier) for ctx, p in zip(ctxs[1], picks)]
        assert got == want
        # the staging sizes and peaks: the batch's from the host's block tables, one by one from its page lists
        caches[0].tiers.note_peaks_many([caches[0].seqs[sid] for sid in range(len(lens))])
        for sid in range(len(lens)):
            caches[1].tiers.note_peaks(caches[1].seqs[sid])
        for sid, n in enumerate(lens):
            seqs = [c.seqs[sid] for c in caches]
            for lay in range(L):
                tiers = [c.tiers.tier_of(q, lay, np.arange(n)) for c, q in zip(caches, seqs)]
                assert np.array_equal(*tiers)
                dev = np.flatnonzero(tiers[0] == TIER_DEVICE)
                for x, y in zip(*(c.gather_kv(q, lay, dev) for c, q in zip(caches, seqs))):
                    assert torch.equal(x, y)
            got_stats, want_stats = ({k: v for k, v in c.tiers.stats(q).items() if k != "kv_move_s"}
                                     for c, q in zip(caches, seqs))
            assert got_stats == want_stats  # bytes held, moved and at their peaks
            assert seqs[0].evicted_tokens == seqs[1].evicted_tokens
            assert seqs[0].kv_bytes == seqs[1].kv_bytes
            caches[0].tiers.check(seqs[0])
    for c in caches:
        for sid in list(c.seqs):
            c.free_sequence(sid)
        assert c.pages_in_use() == 0 and c.tiers.host.pages_in_use() == 0


# --- parsing ----------------------------------------------------------------------------------------
def test_tier_and_demote_parsing():
    assert parse_demote("none") == (False, None)
    assert parse_demote("host") == (True, None)
    assert parse_demote("host-nvfp4") == (True, "nvfp4")
    assert parse_demote("host-compressed")[1] in ("int4", "nvfp4")
    assert parse_tier("host-int4") == (TIER_HOST_Q, "int4")
    for bad in ("gpu", "host-int3", "hostint4", "drop"):
        with pytest.raises(TrtkvError) as e:
            parse_demote(bad)
        assert "\n" not in str(e.value) and "demote" in str(e.value)
    with pytest.raises(TrtkvError, match="host_format"):
        make_policy("tiered", {"host_format": "int3"})
    with pytest.raises(TrtkvError, match="demote"):
        make_cache(demote="sideways")


# --- engine level (tiny random Llama) ------------------------------------------------------------
@pytest.fixture(scope="module")
def tiny(engine_factory, load_engine, tiny_ckpt):
    def get(name, **params):
        return load_engine(engine_factory(tiny_ckpt, name, **params))
    return get


@pytest.mark.parametrize("beta", [0.0, 0.3, 1.0])
def test_tiered_r0_equals_full_tiny(tiny, beta):
    ref = tiny("full").generate(PROMPT, RAW)[0]
    eng = tiny("tiered", beta=beta, evict_ratio=0.0, interval=8, sinks=2, window=8)
    res = eng.generate(PROMPT, RAW)[0]
    assert res.token_ids == ref.token_ids
    s = res.stats
    assert s["tokens_device"] + s["tokens_host"] == s["prompt_tokens"] + s["generated_tokens"] - 1  # last: unwritten
    if beta < 1.0:
        assert s["tokens_host"] > 0 and s["kv_bytes_host"] > 0 and s["transfer_bytes"] > 0
    assert s["tiered"]["evicted"] == 0
    assert eng.core.cache.pages_in_use() == 0 and eng.core.cache.tiers.host.pages_in_use() == 0


DEMOTABLE = [(e["name"], e["params"][1]) for e in MATRIX
             if e["name"] not in ("full", "tiered") and full_precision(e["name"], e["params"][1])]


@pytest.mark.parametrize("name,params", DEMOTABLE, ids=[n for n, _ in DEMOTABLE])
def test_demote_host_keeps_every_token_attended(tiny, name, params):
    """``demote=host`` turns every eviction into a move to T1 (exact): greedy tokens equal full's, while the
    device holds only what the policy keeps."""
    ref = tiny("full").generate(PROMPT, RAW)[0]
    plain = tiny(name, **params).generate(PROMPT, RAW)[0]
    eng = tiny(name, demote="host", **params)
    res = eng.generate(PROMPT, RAW)[0]
    assert res.token_ids == ref.token_ids
    assert res.stats["evicted_tokens"] == 0
    assert res.stats["kv_bytes"] == plain.stats["kv_bytes"]  # the device pages: exactly the policy's
    if plain.stats["evicted_tokens"]:
        assert res.stats["tokens_host"] > 0
    assert eng.core.cache.pages_in_use() == 0 and eng.core.cache.tiers.host.pages_in_use() == 0


def test_host_memory_exhaustion_is_one_line_and_engine_survives(tiny):
    eng = tiny("tiered", beta=0.0, evict_ratio=0.0, interval=4, sinks=1, window=4, host_kv_memory=2000)
    with pytest.raises(TrtkvError) as e:  # OutOfKVMemory inside the step; the API reports its line
        eng.generate(PROMPT, RAW)
    assert "host KV memory is full" in str(e.value) and "--host-kv-memory" in str(e.value)
    assert "\n" not in str(e.value)
    assert not eng.core.cache.seqs and eng.core.cache.tiers.host.pages_in_use() == 0
    ok = eng.generate(PROMPT, SamplingParams(max_tokens=5, ignore_eos=True, chat=False))[0]  # still serving
    assert len(ok.token_ids) == 5
    # background (server) path: an error response, and the next request is served
    h = eng.submit(PROMPT, RAW)
    with pytest.raises(TrtkvError, match="host KV memory"):
        h.result()
    assert len(eng.submit(PROMPT, SamplingParams(max_tokens=4, ignore_eos=True, chat=False)).result().token_ids) == 4
    eng.shutdown()


def test_device_cap_smaller_than_protected_set(tiny):
    eng = tiny("tiered", window=64, kv_memory="2KiB")
    with pytest.raises(TrtkvError) as e:
        eng.generate(PROMPT, RAW)
    assert "protected set" in str(e.value) and "\n" not in str(e.value)


def test_admission_by_device_bytes(tiny):
    """With a device cap, tiering (smaller device footprint) admits more requests at once: pools sized from
    the same kv_memory hold one full-cache request but three tiered ones."""
    from trtkv.cache.admission import device_bytes_needed
    from trtkv.cache.budget import page_cost, pages_needed
    from trtkv.runtime.scheduler import Scheduler

    full = tiny("full")
    tiered = tiny("tiered", beta=0.0, evict_ratio=0.0, interval=4, sinks=1, window=8)
    prompt = "Once upon a time, a king loved riddles."  # short next to the 120 new tokens tiering moves off
    P = len(full.encode_prompt(prompt, False))
    need_full = device_bytes_needed(full.policy, full.core.cache.cfg, P, 120)
    need_tiered = device_bytes_needed(tiered.policy, tiered.core.cache.cfg, P, 120)
    assert need_tiered < need_full / 3
    pages_full = max(pages_needed(full.policy, full.core.cache.cfg, P, 120).values())
    pages_tiered = max(pages_needed(tiered.policy, tiered.core.cache.cfg, P, 120).values())
    cap_pages = pages_full + pages_full // 2  # one full request, not two
    assert 3 * pages_tiered <= cap_pages
    counts = {}
    for name, eng in (("full", full), ("tiered", tiered)):
        cfg = eng.core.cache.cfg
        (fmt,) = eng.policy.pool_formats()
        cap = int(cap_pages * cfg.num_layers * page_cost(fmt, cfg, eng.policy.drops_tokens())) + 1
        core = eng.make_core(kv_memory=cap)
        assert core.cache.capacity_pages(fmt) == cap_pages
        sched = Scheduler(core, 8)
        reqs = [eng.make_request(prompt, RAW) for _ in range(3)]
        for r in reqs:
            sched.add(r)
        sched.step()
        counts[name] = len(sched.running)
        while sched.has_work:
            sched.step()
        assert all(r.finish_reason == "length" for r in reqs) and core.cache.pages_in_use() == 0
    assert counts == {"full": 1, "tiered": 3}


def test_cli_errors_one_line(tiny_ckpt, engine_factory, tmp_path):
    from click.testing import CliRunner

    from trtkv.cli import main

    path = engine_factory(tiny_ckpt, "tiered", window=64)
    r = CliRunner().invoke(main, ["generate", str(path), "--prompt", "hi", "--raw", "--kv-memory", "1KiB"])
    assert r.exit_code == 2 and r.output.count("trtkv: error:") == 1 and "protected set" in r.output
    r = CliRunner().invoke(main, ["generate", str(path), "--prompt", "hi", "--raw", "--demote", "disk"])
    assert r.exit_code == 2 and "demote" in r.output and "Traceback" not in r.output
    r = CliRunner().invoke(main, ["build", "--model", str(tiny_ckpt), "--policy", "h2o", "--budget", "24",
                                  "--set", "demote=host-int9", "--out", str(tmp_path / "e")])
    assert r.exit_code == 2 and "demote" in r.output
    r = CliRunner().invoke(main, ["generate", str(path), "--prompt", "hi", "--raw", "--json", "--max-tokens", "8"])
    assert r.exit_code == 0, r.output
    import json

    stats = json.loads(r.output.strip().splitlines()[-1])["stats"]
    for key in ("kv_bytes_device", "kv_bytes_host", "tokens_device", "tokens_host", "transfer_bytes"):
        assert key in stats


def test_tiered_batch_accumulation_equals_per_request(tiny, monkeypatch):
    """A decode step's scores accumulated for the whole batch (statistics in batch form) are the per-request
    sums, and the step's events move the batch's tokens together: the same tokens, tiers and counts for requests
    of different lengths as request by request, and the batch paths ran."""
    from trtkv.api import SamplingParams
    from trtkv.policies.tiered import TieredPolicy

    prompts = [PROMPT, "Numbers: 1, 2, 3", PROMPT + " And then?"]
    params = [SamplingParams(max_tokens=n, ignore_eos=True, chat=False) for n in (40, 28, 33)]
    eng = tiny("tiered", beta=0.4, evict_ratio=0.1, interval=8, sinks=2, window=8)
    calls = []
    orig = TieredPolicy._accumulate_batch

    def spy(self, reqs, batch, rows):
        calls.append(len(reqs))
        return orig(self, reqs, batch, rows)

    finish = TieredPolicy.on_request_finish
    scores = []  # each request's scores when it finished

    def keep_scores(self, req):
        scores.append(self.scores(req).copy())
        return finish(self, req)

    from trtkv.cache.tiers import TierStore

    together = []  # how many requests each batched move covered
    place_layers = TierStore._place_layers

    def spy_moves(self, jobs, layers, tier, fmt=None):
        together.append(len(jobs))
        return place_layers(self, jobs, layers, tier, fmt)

    monkeypatch.setattr(TieredPolicy, "_accumulate_batch", spy)
    monkeypatch.setattr(TieredPolicy, "on_request_finish", keep_scores)
    monkeypatch.setattr(TierStore, "_place_layers", spy_moves)
    got = [(r.token_ids, r.stats["tiered"], r.stats["tokens_host"]) for r in eng.generate(prompts, params)]
    assert max(together) >= 2  # the events' moves went to the cache for several requests at once
    got_scores, scores[:] = scores[:], []
    monkeypatch.setattr(TieredPolicy, "batch_stats", False)
    want = [(r.token_ids, r.stats["tiered"], r.stats["tokens_host"]) for r in eng.generate(prompts, params)]
    assert got == want and max(calls) == 3 and want[0][1]["evicted"] > 0
    assert len(scores) == 3 and all(np.array_equal(a, b) for a, b in zip(got_scores, scores))


def test_tiered_non_finite_layers_left_out_in_batch_as_one_by_one(tiny, monkeypatch):
    """Spec A4 in both accumulation paths: a layer whose sums are not finite in a request's row adds nothing to it
    (request 1: layer 1 on every step), and a request no layer counts for skips the step (request 2: every layer).
    The batch path leaves the same scores, counters and tokens as request by request."""
    from trtkv.api import SamplingParams
    from trtkv.policies.base import BatchLayerStats
    from trtkv.policies.tiered import TieredPolicy
    import trtkv.runtime.attention as attention

    prompts = [PROMPT, "Numbers: 1, 2, 3", PROMPT + " And then?"]
    params = [SamplingParams(max_tokens=n, ignore_eos=True, chat=False) for n in (30, 24, 27)]
    eng = tiny("tiered", beta=0.4, evict_ratio=0.1, interval=8, sinks=2, window=8)
    L = eng.core.arch.num_hidden_layers
    orig = attention.layer_statistics
    calls = [0]

    def poisoned(*args, **kwargs):
        out = orig(*args, **kwargs)
        layer = calls[0] % L
        calls[0] += 1
        rows = [2] + ([1] if layer == 1 else [])
        if isinstance(out, BatchLayerStats):
            for sums in [s for _, s in out.blocks] if out.blocks is not None else [out.head_sums]:
                sums[[r for r in rows if r < sums.shape[0]]] = float("nan")
        else:
            for r in rows:
                if r < len(out) and out[r] is not None:
                    out[r].head_sums[:] = float("inf")
        return out

    finish = TieredPolicy.on_request_finish
    scores = []

    def keep_scores(self, req):
        scores.append(self.scores(req).copy())
        return finish(self, req)

    monkeypatch.setattr(attention, "layer_statistics", poisoned)
    monkeypatch.setattr(TieredPolicy, "on_request_finish", keep_scores)
    got = [(r.token_ids, r.stats["tiered"]) for r in eng.generate(prompts, params)]
    got_scores, scores[:] = scores[:], []
    monkeypatch.setattr(TieredPolicy, "batch_stats", False)
    calls[0] = 0
    want = [(r.token_ids, r.stats["tiered"]) for r in eng.generate(prompts, params)]
    assert got == want
    assert want[2][1]["skipped_steps"] > 0 and want[0][1]["skipped_steps"] == want[1][1]["skipped_steps"] == 0
    assert len(scores) == 3 and all(np.array_equal(a, b) for a, b in zip(got_scores, scores))
    assert all(np.isfinite(s).all() and s.any() for s in scores)  # (no poisoned sum got in)


@pytest.mark.parametrize("settings", [{}, {"kv_format": "int4"}, {"evict_accounting": "cumulative"}])
def test_tiered_events_decided_for_the_batch_equal_each_request(engine_factory, load_engine, tiny_ckpt, monkeypatch,
                                                              settings):
    """``_decide_many`` (a batch's events by array operations) moves the same positions, in the same orders, and
    counts the same as ``_decide`` of each request in turn: requests of different lengths, buffered tokens of a
    quantized format (protected) and cumulative accounting included."""
    from trtkv.api import SamplingParams
    from trtkv.policies.tiered import TieredPolicy

    eng = load_engine(engine_factory(tiny_ckpt, "tiered", budget=24, beta=0.4, evict_ratio=0.2, interval=8, window=6,
                                     sinks=2, **settings))
    many, compared = TieredPolicy._decide_many, []

    def both(self, reqs, steps):
        fields = ("events", "evicted", "promoted", "demoted", "candidates_ever")
        before = [{f: getattr(r.state, f) for f in fields} for r in reqs]
        want = [self._decide(r, t) for r, t in zip(reqs, steps)]
        after = [{f: getattr(r.state, f) for f in fields} for r in reqs]
        for r, b in zip(reqs, before):
            r.state.__dict__.update(b)
        got = many(self, reqs, steps)
        assert [{f: getattr(r.state, f) for f in fields} for r in reqs] == after
        for g, w in zip(got, want):
            assert (g is None) == (w is None)
            if w is not None:
                assert all(np.array_equal(a, b) for a, b in zip(g, w))
        compared.append(sum(w is not None and len(w[2]) > 0 for w in want))
        return got

    monkeypatch.setattr(TieredPolicy, "_decide_many", both)
    prompts = [PROMPT, "Numbers: 1, 2, 3", PROMPT + " And then?"]
    params = [SamplingParams(max_tokens=n, ignore_eos=True, chat=False) for n in (40, 28, 33)]
    eng.generate(prompts, params)
    assert sum(compared) >= 3  # (events that moved tokens to the host, several requests at once)


def test_tiered_scores_conserve_mass_and_protect(tiny):
    """Spec §7: every decode step adds exactly 1 of score (softmax mass averaged over layers and heads);
    after every event the prompt, the sinks and the window are on the device, T3 only grows, and the device
    share of the surviving candidates is floor(beta * |U'|)."""
    from trtkv.runtime.observers import EngineObserver

    eng = tiny("tiered", beta=0.4, evict_ratio=0.1, interval=8, sinks=2, window=8)
    seen = []

    class Watch(EngineObserver):
        def on_step_end(self, reqs):
            ctx = reqs[0].ctx
            t = ctx.step - 1  # the step that just ended
            st = ctx.state
            assert abs(eng.core.policy.scores(ctx).sum() - (t + 1)) < 1e-6 * (t + 1) + 1e-9
            if t % 8 == 0:
                P, now = ctx.prompt_len, ctx.prompt_len + t
                prot = np.array([p for p in range(now + 1) if p < P + 2 or p > now - 8])
                assert (ctx.tier_of(0, prot) == TIER_DEVICE).all()
                held = ctx.attended_positions(0)
                assert set(held) == set(ctx.all_positions(0)) | set(ctx.host_positions(0))
                cand = held[~np.isin(held, prot)]
                on_dev = (ctx.tier_of(0, cand) == TIER_DEVICE).sum()
                assert on_dev == int(0.4 * len(cand))
                seen.append(st.evicted)

    w = Watch()
    eng.core.attach(w)
    try:
        eng.generate(PROMPT, RAW)
    finally:
        eng.core.detach(w)
    assert len(seen) > 10 and seen == sorted(seen) and seen[-1] > 0


def test_server_metrics_have_tier_gauges(tiny):
    from trtkv.serve.metrics import render

    eng = tiny("tiered", beta=0.0, evict_ratio=0.0, interval=4, sinks=1, window=4)
    eng.generate(PROMPT, SamplingParams(max_tokens=30, ignore_eos=True, chat=False))
    m = eng.metrics()
    assert m["transfer_bytes_total"] > 0 and m["kv_bytes_host"] == 0  # finished requests hold nothing
    text = render(m)
    for name in ("trtkv_kv_bytes_device", "trtkv_kv_bytes_host", "trtkv_tokens_host", "trtkv_kv_transfer_bytes_total"):
        assert name in text


def test_buffered_flat_keys_do_not_reach_the_next_request():
    """``buffered_flat`` keys a position by its request: a buffered position past every position asked about must
    not match the next request's (a stride taken from the asked positions alone would collide)."""
    from types import SimpleNamespace

    from trtkv.runtime.context import RequestContext

    bufs = [np.array([12]), np.array([], np.int64)]
    reqs = [SimpleNamespace(buffered_positions=lambda layer, b=b: b) for b in bufs]
    ctx = SimpleNamespace(_seqs=lambda rs: rs, _cache=SimpleNamespace(
        buffered_many=lambda seqs, layer: np.array([len(b) for b in bufs])))
    # request 0 asks about 3 and 6, request 1 about 5 and 1: with a stride of 7, request 1's 5 would key as 12
    positions, counts = np.array([3, 6, 5, 1]), np.array([2, 2])
    got = RequestContext.buffered_flat(ctx, 0, reqs, positions, counts)
    assert got.tolist() == [False, False, False, False]
    got = RequestContext.buffered_flat(ctx, 0, reqs, np.array([12, 6, 5, 1]), counts)
    assert got.tolist() == [True, False, False, False]
