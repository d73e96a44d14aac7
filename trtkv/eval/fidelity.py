"""Output- and attention-fidelity metrics of a compressed KV cache against full cache.

All functions work on the last dimension and keep the leading ones, so the same code
scores one decode step, a batch, or all heads at once. Everything is computed in fp32:
bf16/fp16 log-probs lose the small differences these metrics exist to measure.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

__all__ = ["kl_divergence", "top1_agreement", "topk_attention_recall", "FidelityAccumulator"]


def kl_divergence(logp_ref: torch.Tensor, logp_test: torch.Tensor) -> torch.Tensor:
    """KL(ref || test) per position, in nats, shape ``logp_ref.shape[:-1]``.

    Inputs are re-normalised with ``log_softmax`` (idempotent for true log-probs, so
    raw logits work too and fp16 rounding cannot make KL negative). Tokens the reference
    gives zero probability contribute 0; a token the reference can emit but the test
    has at -inf gives +inf, which is the true value.
    """
    if logp_ref.shape != logp_test.shape:
        raise ValueError(f"shape mismatch: {tuple(logp_ref.shape)} vs {tuple(logp_test.shape)}")
    lr = torch.log_softmax(logp_ref.float(), dim=-1)
    lt = torch.log_softmax(logp_test.float(), dim=-1)
    p = lr.exp()
    terms = torch.where(p > 0, p * (lr - lt), torch.zeros_like(p))
    return terms.sum(-1).clamp_min(0.0)


def top1_agreement(logits_ref: torch.Tensor, logits_test: torch.Tensor) -> torch.Tensor:
    """1.0 where greedy decoding would pick the same token, else 0.0, per position."""
    if logits_ref.shape != logits_test.shape:
        raise ValueError(f"shape mismatch: {tuple(logits_ref.shape)} vs {tuple(logits_test.shape)}")
    return (logits_ref.argmax(-1) == logits_test.argmax(-1)).float()


def topk_attention_recall(attn_ref: torch.Tensor, attn_test: torch.Tensor,
                          k: int = 10) -> torch.Tensor:
    """Per attention row: share of the reference's top-k keys still in the test's top-k.

    Rows index the same key positions; evicted keys are 0 in the test row and never count
    as attended, even when fewer than k keys survive. Zero-weight reference keys (masked
    positions in short rows) are not part of the reference set. Rows whose reference has
    no mass at all score 1.0 (nothing to recall).
    """
    if attn_ref.shape != attn_test.shape:
        raise ValueError(f"shape mismatch: {tuple(attn_ref.shape)} vs {tuple(attn_test.shape)}")
    ref, test = attn_ref.float(), attn_test.float()
    k = max(1, min(k, ref.shape[-1]))
    ref_val, ref_idx = ref.topk(k, dim=-1)
    test_val, test_idx = test.topk(k, dim=-1)
    in_test = torch.zeros_like(test, dtype=torch.bool).scatter_(-1, test_idx, test_val > 0)
    ref_live = ref_val > 0
    hits = (in_test.gather(-1, ref_idx) & ref_live).sum(-1).float()
    n_ref = ref_live.sum(-1).float()
    return torch.where(n_ref > 0, hits / n_ref.clamp_min(1.0), torch.ones_like(n_ref))


def _values(x) -> list[float]:
    if isinstance(x, torch.Tensor):
        return x.detach().float().reshape(-1).cpu().tolist()
    if isinstance(x, (int, float)):
        return [float(x)]
    return [float(v) for v in x]


@dataclass
class FidelityAccumulator:
    """Collects per-position values over a run; one ``update`` is one decode step.

    p90 KL is reported next to the mean because cache-eviction damage is bursty: a
    handful of positions after a bad eviction dominate, and the mean hides how often.
    """

    kl: list[float] = field(default_factory=list)
    agreement: list[float] = field(default_factory=list)
    recall: list[float] = field(default_factory=list)
    steps: int = 0

    def update(self, kl=None, agreement=None, recall=None) -> None:
        for dst, src in ((self.kl, kl), (self.agreement, agreement), (self.recall, recall)):
            if src is not None:
                dst.extend(_values(src))
        self.steps += 1

    def update_from(self, logits_ref: torch.Tensor, logits_test: torch.Tensor,
                    attn_ref: torch.Tensor | None = None, attn_test: torch.Tensor | None = None,
                    k: int = 10) -> None:
        recall = None
        if attn_ref is not None and attn_test is not None:
            recall = topk_attention_recall(attn_ref, attn_test, k)
        self.update(kl_divergence(logits_ref, logits_test),
                    top1_agreement(logits_ref, logits_test), recall)

    def merge(self, other: "FidelityAccumulator") -> "FidelityAccumulator":
        return FidelityAccumulator(self.kl + other.kl, self.agreement + other.agreement,
                                   self.recall + other.recall, self.steps + other.steps)

    @staticmethod
    def _mean(v: list[float]) -> float | None:
        return sum(v) / len(v) if v else None

    def summary(self) -> dict[str, float | int | None]:
        p90 = None
        if self.kl:
            p90 = torch.quantile(torch.tensor(self.kl, dtype=torch.float64), 0.9).item()
        return {
            "mean_kl": self._mean(self.kl),
            "p90_kl": p90,
            "top1_agreement": self._mean(self.agreement),
            "attn_recall": self._mean(self.recall),
            "n_steps": self.steps,
        }
