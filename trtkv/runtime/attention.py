"""Decode attention of a batch over the paged cache (one plugin call per format) plus residual buffers,
merged by log-sum-exp; and the statistics policies ask for (weights, sparsity)."""
from __future__ import annotations

import math

import numpy as np
import torch

from plugins.buffer_attention.reference import dense_partial
from plugins.paged_attention.reference import PagedFormat, merge_partials
from plugins import ops as plugin_ops  # the ops' entry points; see plugins/ops.py
from trtkv.cache.manager import KVCacheManager, SeqKV
from trtkv.cache.pool import PagePool
from trtkv.distributed.group import HeadShards
from trtkv.policies.base import BatchLayerStats, LayerStats, StepBatch, StepQueries

LN_ONE_PERCENT = math.log(0.01)


def buffer_partial(cache: KVCacheManager, seqs: list[SeqKV], layer: int, q: torch.Tensor, sm_scale: float,
                   want_positions: bool = True):
    """Attention of ``q [b, Hq, D]`` over each request's residual buffer: (out, lse, logits [b,Hq,g], pos);
    ``pos`` (the buffered positions, -1 padded) is None unless ``want_positions``."""
    arena, rows = cache.residual, cache.residual_rows(seqs)
    idx = torch.from_numpy(rows).to(arena.k.device)
    kb, vb = arena.k[idx, layer], arena.v[idx, layer]  # [b, g, H, D]
    g = kb.shape[1]
    counts = arena.counts_of(layer, rows)
    out, lse, logits = dense_partial(q, kb, vb, counts, sm_scale)
    if not want_positions:
        return out, lse, logits, None
    pos = arena.pos[rows, layer].copy()
    pos[np.arange(g) >= arena.fill[rows, layer][:, None]] = -1
    return out, lse, logits, pos


def row_stats(logits: torch.Tensor, lse: torch.Tensor, num_kv_heads: int) -> tuple[torch.Tensor, torch.Tensor, float]:
    """From scaled logits ``[Hq, n]`` (-inf dead): softmax weights, per-KV-head sparsity, ThinKV sparsity.

    Sparsity is the fraction of live keys whose weight is under 1% of the row max (H2O's definition,
    computed in logit space). ThinKV's statistic max-pools the G query heads of each KV group, applies
    softmax, averages the groups' rows and then counts (spec §2.2).
    """
    weights, sparsity_heads, u = batch_row_stats(logits[None], lse[None], num_kv_heads)
    return weights[0], sparsity_heads[0], float(u[0])


def batch_row_stats(logits: torch.Tensor, lse: torch.Tensor, num_kv_heads: int, sparsity: bool = True
                    ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """:func:`row_stats` of a batch in one set of tensor operations: ``logits [b, Hq, n]``, ``lse [b, Hq]`` ->
    weights ``[b, Hq, n]``, sparsity per KV head ``[b, H]``, ThinKV sparsity ``[b]`` (both None unless
    ``sparsity``)."""
    weights = torch.exp(logits - _finite_lse(lse)[..., None])
    if not sparsity:
        return weights, None, None
    b, Hq, n = logits.shape
    live = torch.isfinite(logits[:, 0])  # [b, n]
    n_live = live.sum(-1, keepdim=True).clamp_min(1)
    pooled = logits.view(b, num_kv_heads, Hq // num_kv_heads, n).amax(2)  # [b, H, n]
    head_max = pooled.amax(-1, keepdim=True)
    below = (pooled < head_max + LN_ONE_PERCENT) & live[:, None]
    sparsity_heads = below.sum(-1).float() / n_live
    a = torch.nan_to_num(torch.softmax(pooled, -1), nan=0.0).mean(1)  # [b, n] averaged row over KV groups
    u = ((a < 0.01 * a.amax(-1, keepdim=True)) & live).sum(-1).float() / n_live[:, 0]
    return weights, sparsity_heads, u


def softmax_weights_(logits: torch.Tensor, lse: torch.Tensor) -> torch.Tensor:
    """:func:`batch_row_stats`'s weights, computed in place of ``logits [b, Hq, n]`` where that gives the same
    numbers (contiguous, of the log-sum-exps' dtype)."""
    if not logits.is_contiguous() or logits.dtype != torch.promote_types(logits.dtype, lse.dtype):
        return torch.exp(logits - _finite_lse(lse)[..., None])
    return logits.sub_(_finite_lse(lse)[..., None]).exp_()


def _finite_lse(lse: torch.Tensor) -> torch.Tensor:
    # a row with no live key has lse = -inf: subtract 0 there instead, so its weights are exp(-inf) = 0, not NaN
    # (one kernel; NaN stays NaN)
    return lse.nan_to_num(nan=math.nan, posinf=0.0, neginf=0.0)


def decode_attention(cache: KVCacheManager, layer: int, seqs: list[SeqKV], q: torch.Tensor, sm_scale: float,
                     want_stats: list[bool], want_sparsity: list[bool], staged: list | None = None,
                     clock=None, batch_form: bool = False, shards: HeadShards | None = None,
                     batch_weights: bool = True, deferred: list | None = None, staged_positions=None
                     ) -> tuple[torch.Tensor, list[LayerStats | None] | BatchLayerStats | None]:
    """``staged``: the host tiers' pages of this layer copied to the device (``runtime/staging.py``), as
    ``(pool, block_table, scales)``; attended by the same plugin and merged like another format.
    ``clock`` (``trtkv bench --profile``): kernels and merge are "attention", block tables and positions
    "bookkeeping", the statistics the policy asked for "policy". ``batch_form`` (every request wants the
    weights alone): the statistics come back as one ``BatchLayerStats`` instead of one ``LayerStats`` a
    request (``batch_weights`` False: the policy reads the weights' sums over heads, in either form, and the
    batch form carries those alone). ``shards`` (tensor parallelism): the
    statistics cover every rank's heads (one gather of the logits and log-sum-exps), so every rank's policy sees
    what one rank would. ``deferred`` (batch form): when the layer has one device source, its positions and counts
    are not read here but left None and ``(layer, pool, block table, staged)`` appended, for ``resolve_positions`` to
    read every layer's at once before anyone looks (the caller guarantees nothing changes the layer's slots in
    between); ``staged``: the staged sources' positions and counts, read now (their pages go when the layer ends).
    ``staged_positions``: returns ``source_positions`` of ``staged`` (the staging keeps them while its host tier
    stays the same); None: read here."""
    lap = clock.switch if clock is not None else _no_clock
    parts, logit_parts = [], []
    any_stats = any(want_stats) or any(want_sparsity)
    run = None if any_stats else cache.dense_run(layer, seqs)
    sources = [(pool, bt, cache.layer_scales(layer, pool.fmt.name))
               for pool, bt in cache.block_tables(layer, seqs) if bt.shape[1]]  # (all pages moved to host)
    sources += list(staged or ())
    if sources:
        valid = [pool.valid_bits() for pool, _, _ in sources]
        lap("attention")
        parts, logit_parts = plugin_ops.paged_attention_formats(
            q, [PagedFormat(pool.fields, pool.group_fields, pool.k_group, bits, bt, pool.fmt.code, sc.k, sc.v)
                for (pool, bt, sc), bits in zip(sources, valid)], sm_scale, any_stats, dense_run=run)
        lap("bookkeeping")
    held = cache.buffered_many(seqs, layer) if cache.cfg.residual_group > 1 else None  # (each row's buffered tokens)
    buffered = held is not None and bool(held.any())
    own = len(sources) - len(staged or ())
    later = any_stats and batch_form and deferred is not None and shards is None and own == 1 and not buffered
    more = None
    if any_stats and staged:
        more = staged_positions() if staged_positions is not None else source_positions(
            [(pool, bt) for pool, bt, _ in staged], len(seqs))
    if later:
        deferred.append((layer, sources[0][0], sources[0][1], more))
        logit_parts = [(lg, None) for lg in logit_parts]
    elif any_stats:
        positions, counts = source_positions([(pool, bt) for pool, bt, _ in sources[:own]], len(seqs))
        if more is not None:
            positions, counts = positions + more[0], counts + more[1]
        if len(logit_parts) < len(positions):  # one launch's logits hold every source's columns, side by side
            positions = [np.concatenate(positions, axis=1)]
        logit_parts = list(zip(logit_parts, positions))
    if buffered and any_stats:  # the statistics need the buffer's logits: the torch path
        lap("attention")
        o, lse, lg, pos = buffer_partial(cache, seqs, layer, q, sm_scale, any_stats)
        parts.append((o, lse))
        logit_parts.append((lg, pos))
        counts = counts + (pos >= 0).sum(1)
    lap("attention")
    out, lse = merge_partials(parts) if parts else _empty_partial(q)
    if buffered and not any_stats:  # one call: the buffers' attention merged into the pages' partial in place
        out, lse = out.contiguous(), lse.contiguous()
        arena = cache.residual
        rows = cache.residual_rows(seqs)
        rows_t, counts_t = (torch.from_numpy(a).to(q.device) for a in (rows, held))  # (on the CPU: no copy)
        plugin_ops.buffer_attention(q, arena.k, arena.v, rows_t, layer, counts_t,
                                    sm_scale, out, lse)
    lap("policy" if any_stats else "bookkeeping")
    stats: list[LayerStats | None] | BatchLayerStats = [None] * len(seqs)
    if any_stats:
        # (the kernels' logits are fresh tensors of this call: one source's are used as they are)
        logits = logit_parts[0][0] if len(logit_parts) == 1 else [lg for lg, _ in logit_parts]
        positions = None if later else np.concatenate([p for _, p in logit_parts], axis=1)
        stats = layer_statistics(logits, lse, positions, cache.cfg.num_kv_heads, want_stats, want_sparsity,
                                 batch_form, shards, batch_weights, None if later else counts)
    lap("bookkeeping")
    return out, stats


def source_positions(tables: list[tuple[PagePool, torch.Tensor]], b: int) -> tuple[list[np.ndarray], np.ndarray]:
    """The token position of every column a layer's attention logits have, per format's block table ``[b, P]``:
    ``[b, P * B]`` each, -1 where a slot or a table entry holds no token (``plugins/table_positions``); and each
    row's columns that hold a token, over all the tables ``[b]``."""
    positions, counts = [], np.zeros(b, np.int64)
    for pool, bt in tables:
        pos, n = plugin_ops.table_positions(torch.from_numpy(pool.slot_pos), bt.cpu())
        positions.append(pos.numpy().reshape(b, -1))
        counts += n.numpy()
    return positions, counts


def resolve_positions(cache: KVCacheManager, batch: StepBatch, deferred: list) -> None:
    """Fill in the positions and counts of the layers whose reads ``decode_attention`` deferred: one read for every
    layer when they are all there, of one format and width (``KVCacheManager.table_positions_layers``; the step's
    stack of positions then needs no copy), else one read a layer."""
    if not deferred:
        return
    layers = [layer for layer, _, _, _ in deferred]
    every = cache.table_positions_layers([(pool, bt) for _, pool, bt, _ in deferred]) \
        if layers == list(range(cache.cfg.num_layers)) else None
    for layer, pool, bt, staged in deferred:
        if every is not None:
            pos, n = every[0][layer], every[1][layer]
        else:
            (pos,), n = source_positions([(pool, bt)], bt.shape[0])
        bs = batch[layer]
        if staged is None:
            bs.positions, bs.counts = pos, n
        elif bs.blocks is not None:  # the device's columns, then the staged sources', as the logits have them
            bs.place_blocks([pos, *staged[0]], n + staged[1])
        else:
            bs.positions, bs.counts = np.concatenate([pos, *staged[0]], axis=1), n + staged[1]
    if every is not None and all(staged is None for _, _, _, staged in deferred):
        batch.stacked_positions(*every)
    deferred.clear()


def attach_queries(stats: list, layer: int, q: torch.Tensor, want_q: list[bool]) -> None:
    """Give the requests that asked for it (``want_q[i]``) the step's post-RoPE queries ``q [b, Hq, D]`` of ``layer``
    (Expected Attention's, AMS's query statistics): one ``StepQueries`` record for the step, shared by the batch's
    ``StepStats`` (each reads its row), so a layer costs one entry, not a view per request."""
    sq = stats[0].queries
    if sq is None:  # the step's first layer with queries
        sq = StepQueries()
        for i, st in enumerate(stats):
            st.queries, st.row = sq, i
    sq.layers[layer] = (q.float(), np.asarray(want_q, bool))


def layer_statistics(logits: torch.Tensor | list[torch.Tensor], lse: torch.Tensor, positions: np.ndarray,
                     num_kv_heads: int, want_stats: list[bool], want_sparsity: list[bool], batch_form: bool = False,
                     shards: HeadShards | None = None, batch_weights: bool = True, counts: np.ndarray | None = None
                     ) -> list[LayerStats | None] | BatchLayerStats:
    """A layer's statistics from its attention logits ``[b, Hq, n]`` (scaled, -inf where dead; taken over: the
    batch form computes its weights in place of them), log-sum-exps ``[b, Hq]`` and the columns' positions ``[b, n]``:
    one ``BatchLayerStats`` (``batch_form``: every request wants the weights alone) or one ``LayerStats`` for each
    request that asked (None for the others). ``batch_weights`` False (the policy reads the weights' sums over
    heads): both forms carry those sums from one kernel (``plugins/head_sums``), so the policy decides the same in
    either, and the batch form carries nothing else; True: no sums are computed. ``counts [b]``: each row's
    positions >= 0, when known (``source_positions`` counts them as it reads them). ``logits`` may come as a list of
    column blocks (a layer's sources, side by side): the batch form's head sums are then taken block by block (each
    column's sum is its own, so the same values) and the logits never joined."""
    if isinstance(logits, list) and not (batch_form and not batch_weights and shards is None):
        logits = torch.cat(logits, dim=-1)  # (the weights or a collective need the columns joined)
    blocks = logits if isinstance(logits, list) else [logits]
    lse_all = lse
    if shards is not None:  # one collective: the log-sum-exps ride as one more column
        both = shards.gather(torch.cat([logits, lse[..., None].to(logits.dtype)], -1), 1)
        logits, lse_all, num_kv_heads = both[..., :-1], both[..., -1], shards.num_kv_heads
        blocks = [logits]
    if batch_form:  # (every request asked for the weights alone: EngineCore._batch_form)
        # (logits as column blocks: their head sums block by block, each column's sum its own)
        sums = None if batch_weights else [plugin_ops.head_sums(lg, lse_all) for lg in blocks]
        if len(blocks) > 1 and positions is None:  # (the positions come at the step's end, block by block)
            return BatchLayerStats(positions=None, weights=None, counts=None, head_sums=None, heads=blocks[0].shape[1],
                                   blocks=[(None, s) for s in sums])
        sums = None if sums is None else sums[0] if len(sums) == 1 else torch.cat(sums, dim=-1)
        # in place of the logits nothing else reads; slot order kept (dead columns: -1, weight 0)
        w = softmax_weights_(logits, lse_all) if batch_weights else None
        if counts is None and positions is not None:
            counts = (positions >= 0).sum(1)
        return BatchLayerStats(positions=positions, weights=w, counts=counts, head_sums=sums, heads=blocks[0].shape[1])
    b = logits.shape[0]
    stats: list[LayerStats | None] = [None] * b
    want = [i for i in range(b) if want_stats[i] or want_sparsity[i]]
    rows = torch.tensor(want) if len(want) < b else None
    sparse = any(want_sparsity[i] for i in want)
    lg_w = logits if rows is None else logits[rows]
    lse_w = lse_all if rows is None else lse_all[rows]
    sums = None if batch_weights else plugin_ops.head_sums(lg_w, lse_w)
    w, sh, u = batch_row_stats(lg_w, lse_w, num_kv_heads, sparse)
    u = u.tolist() if sparse else [None] * len(want)
    pos_w, w, lg_w, sums, counts = live_first(positions if rows is None else positions[want], w, lg_w, sums,
                                              None if counts is None else counts if rows is None else counts[want])
    w_rows, lg_rows = live_views(w, counts), live_views(lg_w, counts)
    sum_rows = [None] * len(want) if sums is None else live_views(sums, counts)
    sh_rows = sh.unbind(0) if sparse else [None] * len(want)
    for j, i in enumerate(want):  # each request's live columns: views, no per-request gather
        stats[i] = LayerStats(positions=pos_w[j, :counts[j]], weights=w_rows[j], logits=lg_rows[j],
                              sparsity_heads=sh_rows[j], sparsity=u[j], head_sums=sum_rows[j])
    return stats


def live_first(positions: np.ndarray, weights: torch.Tensor, logits: torch.Tensor, sums: torch.Tensor | None,
               counts: np.ndarray | None = None):
    """Reorder a batch's columns so each row's live slots (position >= 0) come first, in slot order:
    ``positions [b, n]``, ``weights, logits [b, Hq, n]``, ``sums [b, n]`` (or None) -> the same reordered, and live
    counts ``[b]`` (given, or counted here). Row ``i``'s statistics are then the views ``[..., :counts[i]]`` (one
    gather for the batch)."""
    counts = ((positions >= 0).sum(1) if counts is None else counts).tolist()
    if min(counts, default=0) == positions.shape[1]:
        return positions, weights, logits, sums, counts
    order = np.argsort(positions < 0, axis=1, kind="stable")
    cols = torch.from_numpy(order).to(logits.device)
    idx = cols[:, None, :].expand(-1, logits.shape[1], -1)
    return (np.take_along_axis(positions, order, 1), weights.gather(2, idx), logits.gather(2, idx),
            None if sums is None else sums.gather(1, cols), counts)


def live_views(x: torch.Tensor, counts: list[int]) -> list[torch.Tensor]:
    """``x [b, ..., n]`` (live columns first) -> row ``i``'s ``[..., counts[i]]`` views, without a Python-level
    tensor index per row (each costs microseconds; a batch of 16 over 30 layers asks 480 a step)."""
    if not counts:
        return []
    top = max(counts)
    rows = x[..., :top].unbind(0)
    return [r if c == top else r.narrow(-1, 0, c) for r, c in zip(rows, counts)]


def _empty_partial(q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The partial of no tokens: out 0, lse -inf (every page moved off the device and none staged)."""
    b, Hq, D = q.shape
    return q.new_zeros((b, Hq, D), dtype=torch.float32), q.new_full((b, Hq), -math.inf, dtype=torch.float32)


def _no_clock(phase: str) -> str:
    return phase


def prefill_stats(q: torch.Tensor, k: torch.Tensor, window: int, sm_scale: float) -> LayerStats:
    """A prompt's statistics: weights of the last ``window`` queries over all prompt keys ``[w, Hq, T]``, and the
    sparsity statistics of the last query."""
    return prefill_stats_many(q[None], k[None], window, sm_scale)[0]


def prefill_stats_many(q: torch.Tensor, k: torch.Tensor, window: int, sm_scale: float) -> list[LayerStats]:
    """``prefill_stats`` of ``b`` prompts of one length at once: ``q [b, T, Hq, D]``, ``k [b, T, H, D]`` (one batched
    matmul and softmax; each prompt's numbers as alone)."""
    b, T, Hq, D = q.shape
    H = k.shape[2]
    w = min(window, T)
    g = Hq // H
    # one matmul per (prompt, KV head), [w * g, D] @ [D, T], as one bmm: each prompt's result is what it gets alone
    # (an einsum's own plan varies with the batch: different rounding for some shapes)
    qh = q[:, T - w:].float().reshape(b, w, H, g, D).permute(0, 2, 1, 3, 4).reshape(b * H, w * g, D)
    kh = k.float().permute(0, 2, 1, 3).reshape(b * H, T, D)
    logits = torch.bmm(qh, kh.transpose(1, 2)).view(b, H, w, g, T).permute(0, 2, 1, 3, 4) * sm_scale
    causal = torch.arange(T, device=q.device)[None, :] > torch.arange(T - w, T, device=q.device)[:, None]
    logits = logits.masked_fill(causal[None, :, None, None, :], -math.inf).reshape(b, w, Hq, T)
    weights = torch.softmax(logits, -1)
    last = logits[:, -1]
    _, sh, u = batch_row_stats(last, torch.logsumexp(last, -1), H)
    return [LayerStats(positions=np.arange(T), weights=weights[i], logits=last[i], sparsity_heads=sh[i],
                       sparsity=float(u[i])) for i in range(b)]
