"""Forking a running request: a child that shares every token the parent has written (by page reference,
see ``trtkv/cache/forks.py``) and samples its own next token from the parent's newest logits.

A request always holds the KV of ``(prompt_ids + generated)[:ctx.position]`` and one *pending* token (the
newest sample, written at the next step). The child takes those written ids as its context and replaces
the pending token by a fresh sample from the same logits with its own generator; so a greedy child repeats
the parent's pending token and continues exactly like the same prompt run alone.
"""
from __future__ import annotations

import time

import torch

from trtkv.runtime.core import EngineCore
from trtkv.runtime.request import Request
from trtkv.runtime.sampling import SamplingParams, make_generator


def written_ids(req: Request) -> list[int]:
    """Token ids whose KV the request holds (its context for a fork)."""
    return (req.prompt_ids + req.generated)[: req.ctx.position if req.generated else req.prompt_len]


def fork_request(core: EngineCore, parent: Request, params: SamplingParams, generator: torch.Generator,
                 mode: str = "cow", first_token: int | None = None) -> Request:
    """A new running request sharing ``parent``'s cache; ``mode`` "cow" (independent samples) or "tree"
    (a search tree whose evictions act on the shared node, see cache/forks.py)."""
    if parent.last_logits is None:
        raise RuntimeError("fork needs a prefilled request")
    ctx_ids = written_ids(parent)
    rid = core.next_fork_id
    core.next_fork_id += 1
    child = Request(rid, parent.prompt, ctx_ids, params, generator, core.arch.max_position_embeddings)
    child.events = parent.events.__class__() if parent.events is not None else None
    seq = core.cache.fork(parent.ctx.seq, rid, mode)
    ctx = core.new_context(rid, len(ctx_ids), seq)
    ctx.tree = parent.ctx.tree
    child.ctx = ctx
    core.policy.fork(parent.ctx, ctx)
    child.last_logits = parent.last_logits
    if first_token is None:
        ctxt = [ctx_ids] if params.repetition_penalty != 1.0 else None
        first_token = core.sample(parent.last_logits[None], [params], [generator], ctxt)[0]
    child.t_first = time.perf_counter()
    ctx.step = 0
    core._append_token(child, first_token)
    child.peak_live_tokens = ctx.num_live(0)
    return child


def spawn_samples(core: EngineCore, req: Request) -> list[Request]:
    """``SamplingParams(n=K)``: after ``req``'s prefill, fork its K-1 sibling samples (sample i seeded
    ``seed + i`` when a seed is given). They share the prompt's pages; each samples its own first token."""
    import dataclasses

    n = req.params.n
    if n <= 1 or req.forks:
        return []
    for i in range(1, n):
        seed = None if req.params.seed is None else req.params.seed + i
        params = dataclasses.replace(req.params, seed=seed, n=1)
        child = fork_request(core, req, params, make_generator(seed, req.generator.device), mode="cow")
        child.sample_index = i
        child.prompt_ids = req.prompt_ids  # same prompt (the fork point is right after prefill)
        req.forks.append(child)
    return list(req.forks)
