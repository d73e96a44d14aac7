"""Expected Attention's score (spec ams.md §2.10): model the next queries as a Gaussian fitted to the
recently buffered pre-RoPE queries, average RoPE over the next ``n_future`` positions, and score each key
by its expected softmax weight times ``‖v‖``. Used by AMS (its ``ea_*`` settings); it needs the recorded
queries of the event's window (``Evidence.queries``) and the model's RoPE (``bind_model``)."""
from __future__ import annotations

import math

import torch

from trtkv.policies.scorers.base import Scorer

EA_SINK_SLOTS = 4


def rope_average(inv_freq: torch.Tensor, p0: int, n_future: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Mean cos/sin ``[D]`` (half-split layout) of RoPE over positions ``p0 .. p0+n_future-1``."""
    p = torch.arange(p0, p0 + n_future, dtype=torch.float64, device=inv_freq.device)
    ang = p[:, None] * inv_freq.double()[None, :]
    c, s = ang.cos().mean(0), ang.sin().mean(0)
    return torch.cat([c, c]).float(), torch.cat([s, s]).float()


def rope_matrix(cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """``R`` with ``R x = x*cos + rotate_half(x)*sin`` for ``[D]`` cos/sin."""
    D = cos.numel()
    h = D // 2
    rh = torch.zeros(D, D, device=cos.device)
    rh[:h, h:] = -torch.eye(h, device=cos.device)
    rh[h:, :h] = torch.eye(h, device=cos.device)
    return torch.diag(cos) + torch.diag(sin) @ rh


def ea_log_expectation(mu: torch.Tensor, cov: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """``log E[exp(q·k/√d)]`` for Gaussian ``q ~ N(mu [A, D], cov [A, D, D])`` and keys ``[T, A, D]`` -> ``[A, T]``:
    ``mu·k/√d + kᵀ cov k / (2d)``."""
    D = mu.shape[-1]
    return (torch.einsum("ad,tad->at", mu, keys) / math.sqrt(D)
            + torch.einsum("tad,ade,tae->at", keys, cov, keys) / (2 * D))


def expected_attention_scores(q_pre: torch.Tensor, inv_freq: torch.Tensor, p0: int, n_future: int,
                              keys: torch.Tensor, values: torch.Tensor, epsilon: float = 0.01,
                              sink_slots: int = EA_SINK_SLOTS) -> torch.Tensor:
    """Expected Attention (spec §2.10): pre-RoPE queries ``[n, Hq, D]`` -> scores ``[H, T]`` for post-RoPE keys
    and values ``[T, H, D]``. Slots ``< sink_slots`` get the maximum."""
    n, Hq, D = q_pre.shape
    T, H, _ = keys.shape
    q = q_pre.double()
    mu = q.mean(0)  # [Hq, D]
    qc = q - mu
    cov = torch.einsum("nad,nae->ade", qc, qc) / max(n, 1)  # population covariance
    cos, sin = rope_average(inv_freq, p0, n_future)
    R = rope_matrix(cos, sin).double().to(q.device)
    mu_r = mu @ R.T
    cov_r = R @ cov @ R.T
    k = keys.double().to(q.device)
    G = Hq // H
    kq = k.repeat_interleave(G, dim=1)  # [T, Hq, D]
    z = ea_log_expectation(mu_r, cov_r, kq)
    s = min(sink_slots, T)
    p = torch.zeros_like(z)
    if T > s:
        p[:, s:] = torch.softmax(z[:, s:], -1)
    g = (p.view(H, G, T).mean(1) + epsilon) * values.double().to(q.device).norm(dim=-1).T
    if s:
        g[:, :s] = g.max()
    return g.float()


def unrotate(q: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor) -> torch.Tensor:
    """Undo RoPE: post-RoPE ``q [n, Hq, D]`` at ``positions [n]`` -> pre-RoPE (default/linear/llama3 scaling)."""
    from trtkv.models.rope import apply_rotary

    ang = positions.to(q.device, torch.float32)[:, None] * inv_freq[None, :]
    emb = torch.cat([ang, ang], dim=-1)
    return apply_rotary(q, emb.cos(), -emb.sin())


class ExpectedAttentionScorer(Scorer):
    evidence_suffices = True
    name = "expected_attention"

    def __init__(self, n_future: int = 512, epsilon: float = 0.01, drop: int = 4, n_buf: int = 256):
        self.n_future, self.epsilon, self.drop, self.n_buf = n_future, epsilon, drop, n_buf
        self.inv_freq: torch.Tensor | None = None

    @classmethod
    def for_ams(cls, ams):
        return cls(ams.ea_n_future, ams.ea_epsilon, ams.ea_drop, ams.n_buf)

    def bind_model(self, arch) -> None:
        from trtkv.models.rope import inverse_frequencies

        self.inv_freq = inverse_frequencies(arch.head_dim, arch.rope_theta, arch.rope_scaling)[0]

    def score(self, req, layer, positions, memo, ev=None):
        if self.inv_freq is None:
            raise RuntimeError("scorer expected_attention needs the model's RoPE (the engine calls bind_model)")
        if ev is None or not ev.queries:
            raise RuntimeError("scorer expected_attention needs the recorded queries of the window (Evidence)")
        rec = ev.queries[-self.n_buf:] if self.n_buf else ev.queries[-1:]
        entries = rec[self.drop:] if len(rec) > self.drop else rec
        q_pos = torch.tensor([p for p, _ in entries])
        q = torch.stack([x for _, x in entries]).float()  # [n, Hq, D] post-RoPE
        inv = self.inv_freq.to(q.device)
        keys = ev.keys if ev.keys is not None else req.keys(layer, positions)
        values = ev.values if ev.values is not None else req.kv(layer, positions)[1]
        return expected_attention_scores(unrotate(q, q_pos, inv), inv, req.position, self.n_future, keys, values,
                                         self.epsilon)
