"""ArborKV's pure rules (spec §3.2, §3.3, §3.5, §3.8): MSVE fusion, TAE keep counts, token-extractive keep
sets, and the offline logistic fit of θ. No runtime objects: the policy (``arborkv.py``) feeds them."""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

PLACEHOLDER_THETA = (3.0, 1.0, 2.0, -2.0)  # (v, u, a, bias): spec §3.2 [REC], not a paper value


def msve_score(theta, v: float, u: float, a: float) -> float:
    """``s = clip(σ(θ_v v + θ_u u + θ_a a + θ_0), 0, 1)``."""
    tv, tu, ta = theta[:3]
    t0 = theta[3] if len(theta) > 3 else 0.0
    x = tv * v + tu * u + ta * a + t0
    return float(min(1.0, max(0.0, 1.0 / (1.0 + math.exp(-x)))))


@dataclass(frozen=True)
class TAEParams:
    alpha: float = 1.0
    gamma: float = 2.0
    eta: float = 0.5
    lambda_delta: float = 0.5
    lambda_depth: float = 0.0
    r_min: float = 0.05
    k_min: int = 16
    l_tail: int = 8


def tae_weight(p: TAEParams, s: float, depth: int, dist: int, on_path: bool) -> float:
    """Eq. 2's pre-clip weight ``z = α η^[off] s^γ e^{-λ_d d} e^{-λ_Δ Δ}`` (also the Pressure priority)."""
    return p.alpha * (1.0 if on_path else p.eta) * s ** p.gamma * math.exp(-p.lambda_depth * depth) \
        * math.exp(-p.lambda_delta * dist)


def tae_keep(p: TAEParams, n: int, s: float, depth: int, dist: int, on_path: bool) -> int:
    """Eq. 3: ``k = min(n, max(K_min, |T|, floor(clip(z, r_min, 1) n)))``."""
    r = min(1.0, max(p.r_min, tae_weight(p, s, depth, dist, on_path)))
    return min(n, max(p.k_min, min(p.l_tail, n), math.floor(r * n)))


def extractive_keep(resident: list[int], n: int, k: int, acc: np.ndarray, l_tail: int, sinks: set[int],
                    intra: str = "full") -> list[int]:
    """Algorithm 1: the offsets to keep of a block whose resident offsets are ``resident`` (ascending),
    ``k`` of them: its last ``l_tail`` offsets, then heavy hitters by accumulated attention ``acc`` (ties: the
    later offset), plus sinks. ``intra="tail_only"`` keeps the last k resident offsets (Table 7's row)."""
    res = sorted(resident)
    k = min(k, n, len(res))
    if k <= 0:
        keep: list[int] = []
    elif k <= l_tail or intra == "tail_only":
        keep = res[len(res) - k:]
    else:
        tail = [o for o in res if o >= n - min(l_tail, n)]
        m = k - len(tail)
        cand = [o for o in res if o not in set(tail) and o not in sinks]
        if intra == "tail_sinks":
            heavy = cand[len(cand) - m:] if m > 0 else []
        else:
            heavy = sorted(cand, key=lambda o: (-float(acc[o]) if o < len(acc) else 0.0, -o))[:max(m, 0)]
        keep = sorted(set(tail) | set(heavy))
    return sorted(set(keep) | (sinks & set(res)))


def fit_theta(features: np.ndarray, targets: np.ndarray, l2: float = 1e-3, bias: bool = True,
              steps: int = 200) -> tuple[float, ...]:
    """§3.8: fit ``σ(θᵀφ + θ_0)`` to leave-one-out accuracy drops ``y ∈ [0, 1]`` with binary cross-entropy,
    an L2 penalty and L-BFGS; ``features [N, 3]`` are (v, u, a) at Boundary time. Returns (θ_v, θ_u, θ_a, θ_0)."""
    import torch

    x = torch.as_tensor(np.asarray(features, np.float64))
    y = torch.as_tensor(np.asarray(targets, np.float64)).clamp(0, 1)
    w = torch.zeros(x.shape[1] + 1, dtype=torch.float64, requires_grad=True)
    opt = torch.optim.LBFGS([w], max_iter=steps, line_search_fn="strong_wolfe")

    def closure():
        opt.zero_grad()
        logits = x @ w[:-1] + (w[-1] if bias else 0.0)
        loss = torch.nn.functional.binary_cross_entropy_with_logits(logits, y) + l2 * (w[:-1] ** 2).sum()
        loss.backward()
        return loss

    opt.step(closure)
    out = w.detach().tolist()
    return tuple(out[:-1]) + ((out[-1],) if bias else (0.0,))
