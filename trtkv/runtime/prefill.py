"""Prefill: prompts through the model into their cache sequences, and each request's first token.

Several prompts run as one packed sequence (``[sum T, hidden]``): the dense layers are row-wise, so one pass
over every prompt's tokens replaces one pass per prompt (a serving batch's admissions in one set of weight
reads and kernel launches); attention stays causal within each prompt, one batched call when the prompts
have the same length. Each prompt's K/V is stored in its own sequence, in the class its policy gives it.
"""
from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F

from trtkv.policies.base import StatsRequest, StepStats
from trtkv.runtime.attention import prefill_stats, prefill_stats_many
from trtkv.runtime.request import Request


@torch.inference_mode()
def prefill_packed(core, reqs: list[Request]) -> None:
    """Prefill ``reqs`` (each begun here) in one pass; their first tokens are sampled only once every layer's
    K/V is stored, so an exception part-way leaves no request with a token (the caller ``unprefill``s them)."""
    begun = [core.begin_prefill(r) for r in reqs]
    lens = [r.prompt_len for r in reqs]
    ends = torch.tensor(lens).cumsum(0).tolist()
    starts = [e - n for e, n in zip(ends, lens)]
    dev = core.device
    ids = torch.tensor([t for r in reqs for t in r.prompt_ids], device=dev)
    positions = torch.cat([torch.arange(n, device=dev) for n in lens])
    model = core.model
    cos, sin = model.rotary.cos_sin(positions, core.dtype)
    x = model.embed(ids)
    classes = [core.policy.prefill_class(ctx) for ctx, _ in begun]
    pos_lists = {n: list(range(n)) for n in set(lens)}
    stats = [StepStats(step=-1) for _ in reqs]
    same_len = len(set(lens)) == 1
    windows = {max(sreq.prefill_window, 1) for _, sreq in begun}
    together = _stored_together(core, classes)
    g = core.g
    if together:  # every prompt's whole groups (g = 1: every token) in one write a layer; the tails prompt by prompt
        counts = np.asarray([n - n % g for n in lens], np.int64)
        flat_positions = np.concatenate([np.arange(n, dtype=np.int64) for n in counts.tolist()])
        segs = np.repeat(np.asarray([seg for _, _, seg in classes], np.int32), counts)
        rows = None if (counts == lens).all() else torch.from_numpy(
            np.concatenate([np.arange(s, s + n) for s, n in zip(starts, counts.tolist())])).to(dev)
    for layer in range(core.arch.num_hidden_layers):
        q, k, v = model.qkv(layer, x, cos, sin)
        attn = causal_attention(q, k, v, lens, core.sm_scale)
        if together:
            kw, vw = (k, v) if rows is None else (k[rows], v[rows])
            if g > 1:  # (quantized groups are encoded from fp32, as ``store_prompt`` does)
                kw, vw = kw.float(), vw.float()
            core.cache.write_many(layer, [ctx.seq for ctx, _ in begun], kw, vw, counts, flat_positions,
                                  classes[0][:2], segs, g)
        wants = [_wants_stats(sreq, layer) for _, sreq in begun]
        stats_together = len(reqs) > 1 and all(wants) and same_len and len(windows) == 1 and core.shards is None
        if stats_together:  # (one batched call: each prompt's numbers as alone)
            T = lens[0]
            for st, ls in zip(stats, prefill_stats_many(q.reshape(len(reqs), T, *q.shape[1:]),
                                                        k.reshape(len(reqs), T, *k.shape[1:]), next(iter(windows)),
                                                        core.sm_scale)):
                st.layers[layer] = ls
        for i, ((ctx, sreq), (fmt, thought, seg)) in enumerate(zip(begun, classes)):
            s, e = starts[i], ends[i]
            done = int(counts[i]) if together else 0  # (a tail shorter than a group: ``store_prompt`` buffers it)
            if done < e - s:
                core.store_prompt(ctx.seq, layer, k[s + done:e], v[s + done:e], pos_lists[lens[i]][done:],
                                  (fmt, thought), seg)
            if wants[i] and not stats_together:
                qs, ks = (q[s:e], k[s:e]) if core.shards is None else (core.shards.gather(q[s:e], 1),
                                                                      core.shards.gather(k[s:e], 1))
                stats[i].layers[layer] = prefill_stats(qs, ks, max(sreq.prefill_window, 1), core.sm_scale)
        x = model.finish_layer(layer, x, attn)
    logits = model.logits(x[torch.tensor(ends, device=dev) - 1])
    core.end_prefill_many(reqs, logits, stats)


def _stored_together(core, classes: list[tuple]) -> bool:
    """Whether the prompts' K/V of a layer go to the cache in one ``write_many``: several prompts of one class, in
    groups of g tokens, or in a write-through format (g = 1) without key-scale groups (else prompt by prompt,
    ``store_prompt``)."""
    fmt, thought = classes[0][:2]
    return (len(classes) > 1 and all(c[:2] == (fmt, thought) for c in classes)
            and (core.g > 1 or not core.cache.pool(0, fmt).group_specs))


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lens: list[int], sm_scale: float
                     ) -> torch.Tensor:
    """Causal attention within each of the packed prompts of ``lens``: ``q [sum T, Hq, D]``, ``k, v [sum T, H, D]``
    -> ``[sum T, Hq, D]``. Prompts of one length run as one batched call, others one call each."""
    if len(set(lens)) == 1:
        B, T = len(lens), lens[0]
        out = F.scaled_dot_product_attention(*(t.view(B, T, *t.shape[1:]).transpose(1, 2) for t in (q, k, v)),
                                             is_causal=True, scale=sm_scale, enable_gqa=True)
        return out.transpose(1, 2).reshape(q.shape)
    outs, s = [], 0
    for n in lens:
        outs.append(causal_attention(q[s:s + n], k[s:s + n], v[s:s + n], [n], sm_scale))
        s += n
    return torch.cat(outs)


def _wants_stats(sreq: StatsRequest, layer: int) -> bool:
    return bool(sreq.weights or sreq.sparsity or sreq.prefill_window) and (sreq.layers is None or layer in sreq.layers)
