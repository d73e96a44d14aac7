"""Sampling parameters and the sampler (greedy, temperature, top-k, top-p, repetition penalty, per-request seeds)."""
from __future__ import annotations

import os
from dataclasses import dataclass, field

import torch

from trtkv.errors import TrtkvError

MAX_TOKENS_LIMIT = 1 << 20
MAX_SAMPLES = 64


@dataclass
class SamplingParams:
    max_tokens: int = 256
    temperature: float = 0.0  # 0 = greedy
    top_k: int = 0  # 0 = off
    top_p: float = 1.0
    repetition_penalty: float = 1.0  # transformers' rule over prompt + generated ids; 1 = off
    seed: int | None = None
    stop: tuple[str, ...] = field(default_factory=tuple)
    chat: bool = True  # wrap the prompt in the model's chat template
    ignore_eos: bool = False
    n: int = 1  # samples per prompt; samples 2..n fork the first after prefill and share the prompt's pages

    def validate(self, max_positions: int | None = None) -> "SamplingParams":
        def bad(msg: str) -> TrtkvError:
            return TrtkvError(f"invalid sampling parameter: {msg}")

        if not isinstance(self.max_tokens, int) or isinstance(self.max_tokens, bool) or self.max_tokens <= 0:
            raise bad(f"max_tokens must be a positive integer, got {self.max_tokens!r}")
        limit = max_positions or MAX_TOKENS_LIMIT
        if self.max_tokens > limit:
            raise bad(f"max_tokens {self.max_tokens} exceeds the model's {limit} positions")
        if not (self.temperature >= 0.0) or self.temperature != self.temperature or self.temperature > 100:
            raise bad(f"temperature must be in [0, 100], got {self.temperature!r}")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise bad(f"top_k must be an integer >= 0, got {self.top_k!r}")
        if not (0.0 < self.top_p <= 1.0):
            raise bad(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not (0.0 < self.repetition_penalty <= 10.0):
            raise bad(f"repetition_penalty must be in (0, 10], got {self.repetition_penalty!r}")
        if self.seed is not None and (not isinstance(self.seed, int) or self.seed < 0 or self.seed >= 2**63):
            raise bad(f"seed must be a non-negative integer, got {self.seed!r}")
        if not isinstance(self.n, int) or isinstance(self.n, bool) or not 1 <= self.n <= MAX_SAMPLES:
            raise bad(f"n (samples per prompt) must be an integer in [1, {MAX_SAMPLES}], got {self.n!r}")
        if isinstance(self.stop, str):
            self.stop = (self.stop,)
        self.stop = tuple(self.stop)
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise bad("stop strings must be non-empty strings")
        return self

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def make_generator(seed: int | None, device: torch.device | str = "cpu") -> torch.Generator:
    g = torch.Generator(device=device)
    g.manual_seed(seed if seed is not None else int.from_bytes(os.urandom(8), "little") >> 1)
    return g


def penalize_repeats(row: torch.Tensor, seen: list[int], penalty: float) -> torch.Tensor:
    """transformers' ``RepetitionPenaltyLogitsProcessor`` on one row: the logit of every token already in
    the context is divided by ``penalty`` when positive and multiplied by it when negative."""
    ids = torch.tensor(seen, dtype=torch.long, device=row.device).unique()
    picked = row.gather(0, ids)
    return row.scatter(0, ids, torch.where(picked < 0, picked * penalty, picked / penalty))


def sample_next(logits: torch.Tensor, params: list[SamplingParams], gens: list[torch.Generator],
                contexts: list[list[int]] | None = None) -> list[int]:
    """One next token per row of ``logits [b, V]`` (fp32), the batch's rows filtered and drawn together (a few
    tensor operations, not a few per row). ``contexts`` (prompt + generated ids per row) is needed only by rows
    with a repetition penalty. Equal, row by row, to ``sample_row`` (tests/test_sampling.py): the same
    operations along each row, one uniform number from each sampled row's generator."""
    if all(p.greedy and p.repetition_penalty == 1.0 for p in params):
        return logits.argmax(-1).tolist()
    if len(params) == 1:  # one row: the row's own operations, without the batch's gathers
        return [sample_row(logits[0], params[0], gens[0], contexts[0] if contexts is not None else None)]
    pen = [i for i, p in enumerate(params) if p.repetition_penalty != 1.0 and contexts is not None and contexts[i]]
    if pen:
        logits = logits.clone()
        for i in pen:
            logits[i] = penalize_repeats(logits[i], contexts[i], params[i].repetition_penalty)
    out = logits.argmax(-1).tolist()
    sampled = [i for i, p in enumerate(params) if not p.greedy]
    if not sampled:
        return out
    ps = [params[i] for i in sampled]
    rows = torch.tensor(sampled, device=logits.device) if len(sampled) < len(params) else None
    scores = (logits if rows is None else logits[rows]) / torch.tensor(
        [p.temperature for p in ps], dtype=logits.dtype, device=logits.device)[:, None]
    if any(p.top_k > 0 for p in ps):
        ks = torch.tensor([min(p.top_k, scores.shape[1]) for p in ps], device=scores.device)
        top = torch.topk(scores, int(ks.max())).values
        kth = top.gather(1, (ks - 1).clamp_min(0)[:, None])
        scores = torch.where((ks[:, None] > 0) & (scores < kth), float("-inf"), scores)
    if any(p.top_p < 1.0 for p in ps):
        top_p = torch.tensor([p.top_p for p in ps], dtype=torch.float64, device=scores.device)[:, None]
        sorted_scores, idx = torch.sort(scores, dim=1, descending=False, stable=True)
        cum = sorted_scores.softmax(-1).cumsum(-1)
        drop = (cum <= (1 - top_p).to(cum.dtype)) & (top_p < 1.0)
        drop[:, -1] = False  # always keep the most likely token
        scores = scores.scatter(1, idx, sorted_scores.masked_fill(drop, float("-inf")))
    probs = scores.softmax(-1)
    cum = probs.to(torch.float64).cumsum(-1)
    # one uniform number a sampled row, from its own generator (wherever it lives), as ``draw`` takes it
    u = torch.cat([torch.rand(1, generator=gens[i], device=gens[i].device, dtype=torch.float64).to(cum.device)
                   for i in sampled])
    picks = torch.searchsorted(cum, (u[:, None] * cum[:, -1:]).contiguous(), right=True)[:, 0]
    picks = torch.where(picks >= cum.shape[1], _last_live(probs), picks)  # u * total rounded up to the total
    for i, tok in zip(sampled, picks.tolist()):
        out[i] = tok
    return out


def _last_live(probs: torch.Tensor) -> torch.Tensor:
    """Per row of ``probs [s, V]``, the last token with any probability (``draw``'s rounding edge)."""
    pos = torch.arange(probs.shape[1], device=probs.device).expand_as(probs)
    return torch.where(probs > 0, pos, -1).amax(1)


def sample_row(row: torch.Tensor, p: SamplingParams, g: torch.Generator, context: list[int] | None = None) -> int:
    """The reference for ``sample_next``: one row's next token, filters applied one after another, then
    ``draw``."""
    if p.repetition_penalty != 1.0 and context:
        row = penalize_repeats(row, context, p.repetition_penalty)
    if p.greedy:
        return int(row.argmax())
    scores = row / p.temperature
    if p.top_k > 0:
        kth = torch.topk(scores, min(p.top_k, scores.numel())).values[-1]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    if p.top_p < 1.0:
        sorted_scores, idx = torch.sort(scores, descending=False, stable=True)
        cum = sorted_scores.softmax(-1).cumsum(-1)
        drop = cum <= (1 - p.top_p)
        drop[-1] = False  # always keep the most likely token
        scores = scores.scatter(0, idx, sorted_scores.masked_fill(drop, float("-inf")))
    probs = scores.softmax(-1)
    if probs.device != g.device:  # a request's generator is made on the CPU (api.make_request)
        probs = probs.to(g.device)
    return draw(probs, g)


def draw(probs: torch.Tensor, g: torch.Generator) -> int:
    """One token from the distribution ``probs [V]`` by inverse CDF: one uniform number against the cumulative
    sum (float64, so a token's interval keeps its probability to ~1e-16). ``torch.multinomial`` draws an
    exponential per token instead: 1.5–2.5 ms a row over SmolLM2's 49,152 tokens on one CPU core against 0.1 ms
    (docs/benchmarks.md), which at batch 16 was a fifth of a sampled decode step. Zero-probability tokens
    (top-k / top-p cuts) have empty intervals and are never drawn."""
    cum = probs.to(torch.float64).cumsum(0)
    u = torch.rand(1, generator=g, device=g.device, dtype=torch.float64)
    i = int(torch.searchsorted(cum, u * cum[-1], right=True))
    if i >= cum.numel():  # u * total rounded up to the total: the last token that has any probability
        i = int(torch.nonzero(probs)[-1])
    return i
