"""ArborKV (Chen et al., arXiv 2605.22106; spec ``shared/specs/arborkv.md``): value-guided, tree-aware
eviction for tree search, with lazy rehydration.

Blocks are the search tree's nodes (``trtkv search``; see ``policies/tree.py``). At a block's Boundary the
Multi-Signal Value Estimator fuses the controller's value ``v``, the boundary confidence ``u`` and the
attention the block received ``a`` into ``s = σ(θᵀφ + θ_0)``; Tree-Aware Eviction turns ``s``, depth and the
distance to the active leaf into a keep count per block; inside a block eviction is token-extractive
(last ``l_tail`` tokens + heavy hitters by accumulated attention + sinks), one token set for all layers.
The active root-to-leaf path is always complete (``protect=full``): at a Transition every path block with
evicted tokens is rebuilt by a prefill over its stored ids at their original positions (the runtime's
``tree.rehydrate``). The policy acts only at Boundary / Transition / Pressure events; an ordinary decode step
only accumulates attention and checks the budget.

Parameters (spec §4 defaults; the paper publishes none)
    kv_ratio        ρ: the global budget 𝓑 = floor(ρ · C_ref), one number for the whole tree
    budget_basis    C_ref: "capacity" (|prompt| + N_expand · T_node), "oracle_peak" (the full-cache search's
                    peak on the same problem, ``trtkv search --oracle``) or "absolute" (``kv_budget`` tokens)
    alpha gamma eta lambda_delta lambda_depth r_min k_min l_tail   TAE (Eq. 2-3)
    n_sink          global sink tokens (the root's first tokens; the root is pinned anyway)
    delta           Pressure margin δ (default min(T_node, 0.05 𝓑)); Pressure evicts down to 𝓑 − 2δ
    boundary_mode   "deferred" (default: a closing block stays whole while on the path) or "eager" (Alg. 2)
    rehydration     rebuild evicted path blocks at Transitions (off: evictions are final, an ablation)
    attn_layers     layers (evenly spaced) whose attention feeds A(t)
    attn_scope      "after_token" (H2O-style, default) or "after_block" (the paper's literal definition)
    intra           "full" (tail + heavy hitters + sinks), "tail_sinks", "tail_only" (Table 7 rows)
    offpath_format  beyond the paper: at each Transition re-store off-path blocks' resident tokens in this
                    format (e.g. ThinKV's "fp8" or "nvfp4"); rehydration brings them back to the base format
    theta           (θ_v, θ_u, θ_a, θ_0): the spec's uncalibrated placeholder (3, 1, 2, −2); fit your own with
                    ``arborkv_rules.fit_theta`` on leave-one-out drops (§3.8)
Outside a search (no tree) the policy keeps everything: a single chain is all active path (spec §8.2).
"""
from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass, field

import numpy as np

from trtkv.errors import TrtkvError
from trtkv.policies.arborkv_rules import (PLACEHOLDER_THETA, TAEParams, extractive_keep, msve_score, tae_keep,
                                          tae_weight)
from trtkv.policies.base import KVPolicy, StatsRequest

BASES = ("capacity", "oracle_peak", "absolute")


@dataclass
class ArborTreeState:
    """Per-search state (``tree.policy_state``); per-request State is not needed."""

    budget: int
    delta: int
    sinks: set[int]
    path: list[int] = field(default_factory=list)
    acc: dict[int, np.ndarray] = field(default_factory=dict)  # A(t) per block offset
    qcount: dict[int, int] = field(default_factory=dict)
    score: dict[int, float] = field(default_factory=dict)  # s_i
    features: dict[int, tuple[float, float, float]] = field(default_factory=dict)  # (v, u, a) at Boundary
    events: Counter = field(default_factory=Counter)
    evict_calls: int = 0
    violations: int = 0
    pressure_mark: int = -1  # M after the last Pressure (hysteresis)
    changed: bool = True  # the tree changed since the last Pressure


@dataclass
class ArborKVPolicy(KVPolicy):
    name = "arborkv"
    description = "tree-aware value-guided eviction with lazy rehydration for tree search (ArborKV)"
    kv_ratio: float = 0.25
    budget_basis: str = "capacity"
    kv_budget: int | None = None
    alpha: float = 1.0
    gamma: float = 2.0
    eta: float = 0.5
    lambda_delta: float = 0.5
    lambda_depth: float = 0.0
    r_min: float = 0.05
    k_min: int = 16
    l_tail: int = 8
    n_sink: int = 4
    delta: int | None = None
    boundary_mode: str = "deferred"
    rehydration: bool = True
    attn_layers: int = 4
    attn_scope: str = "after_token"
    intra: str = "full"
    theta: tuple[float, ...] = PLACEHOLDER_THETA
    allow_full_evict: bool = True
    offpath_format: str = "none"  # beyond the paper: re-store off-path blocks in a ThinKV format (fp8, nvfp4...)

    def __post_init__(self) -> None:
        if not 0.0 < self.kv_ratio <= 1.0:
            raise ValueError(f"kv_ratio must be in (0, 1]; got {self.kv_ratio}")
        if self.budget_basis not in BASES:
            raise ValueError(f"budget_basis must be one of {BASES}")
        if self.budget_basis == "absolute" and not self.kv_budget:
            raise ValueError("budget_basis=absolute needs kv_budget (tokens)")
        if self.boundary_mode not in ("deferred", "eager") or self.attn_scope not in ("after_token", "after_block"):
            raise ValueError("boundary_mode is deferred|eager and attn_scope is after_token|after_block")
        if self.intra not in ("full", "tail_sinks", "tail_only"):
            raise ValueError("intra must be full, tail_sinks or tail_only")
        if self.gamma <= 0 or not 0 < self.eta <= 1 or self.lambda_delta < 0 or not 0 <= self.r_min <= 1:
            raise ValueError("need gamma > 0, 0 < eta <= 1, lambda_delta >= 0, 0 <= r_min <= 1")
        if self.k_min < 0 or self.l_tail < 0 or self.n_sink < 0 or self.attn_layers < 1:
            raise ValueError("k_min, l_tail, n_sink must be >= 0 and attn_layers >= 1")
        if self.offpath_format != "none":
            from plugins.formats import FORMATS

            if self.offpath_format not in FORMATS:
                raise ValueError(f"offpath_format must be none or a KV format ({', '.join(sorted(FORMATS))})")
        if len(self.theta) not in (3, 4):
            raise ValueError("theta is (v, u, a) or (v, u, a, bias)")

    def pool_formats(self) -> set[str]:
        """Off-path blocks are re-stored in ``offpath_format``: the cache needs a pool for it too."""
        return self.formats() | ({self.offpath_format} if self.offpath_format != "none" else set())

    def drops_tokens(self) -> bool:
        return True  # tree-wide evictions of off-path blocks

    @property
    def tae(self) -> TAEParams:
        return TAEParams(self.alpha, self.gamma, self.eta, self.lambda_delta, self.lambda_depth, self.r_min,
                         self.k_min, self.l_tail)

    def _layers(self, num_layers: int) -> tuple[int, ...]:
        n = min(self.attn_layers, num_layers)
        return tuple(sorted({round(i * (num_layers - 1) / max(n - 1, 1)) for i in range(n)}))

    # --- per-request hooks (the active leaf) --------------------------------------------------
    def stats_request(self, req, phase: str):
        if phase != "decode" or req.tree is None:
            return None
        return StatsRequest(layers=self._layers(req.num_layers), weights=True)

    def on_decode_step_end(self, req, stats) -> None:
        tree = req.tree
        if tree is None or not isinstance(tree.policy_state, ArborTreeState):
            return
        st: ArborTreeState = tree.policy_state
        self._accumulate(tree, st, stats)
        self._maybe_pressure(tree, st)

    def _accumulate(self, tree, st: ArborTreeState, stats) -> None:
        """A(t) += attention of this step's query, summed over the layer slice and all query heads."""
        path = st.path or tree.path()
        starts = np.array([tree.nodes[i].start for i in path])
        leaf = path[-1]
        for i in path:
            st.qcount[i] = st.qcount.get(i, 0) + 1
        for ls in stats.layers.values():
            if ls.weights is None or not len(ls.positions):
                continue
            pos = np.asarray(ls.positions)
            w = ls.weights.sum(0).detach().cpu().numpy()
            qpos = int(pos.max())
            keep = pos != qpos if self.attn_scope == "after_token" else pos < tree.nodes[leaf].start
            pos, w = pos[keep], w[keep]
            idx = np.searchsorted(starts, pos, side="right") - 1
            for j, node_id in enumerate(path):
                sel = idx == j
                if not sel.any():
                    continue
                off = pos[sel] - starts[j]
                arr = st.acc.get(node_id)
                need = int(off.max()) + 1
                if arr is None or len(arr) < need:
                    grown = np.zeros(max(need, tree.nodes[node_id].n), np.float64)
                    if arr is not None:
                        grown[: len(arr)] = arr
                    st.acc[node_id] = arr = grown
                np.add.at(arr, off, w[sel])

    def _attention_feature(self, tree, st: ArborTreeState, node_id: int) -> float:
        """a_i: the average share of one query's attention mass (per layer and head) falling on the block."""
        q = st.qcount.get(node_id, 0)
        arr = st.acc.get(node_id)
        if not q or arr is None:
            return 0.0
        heads = tree.nodes[node_id].req.num_q_heads
        layers = len(self._layers(tree.nodes[node_id].req.num_layers))
        return float(min(1.0, max(0.0, arr.sum() / (layers * heads * q))))

    # --- tree events ----------------------------------------------------------------------------
    def on_tree_begin(self, tree) -> None:
        root = tree.nodes[0]
        if self.budget_basis == "capacity":
            ref, what = tree.capacity_tokens, "capacity (prompt + expansions x node_tokens)"
        elif self.budget_basis == "oracle_peak":
            if not tree.oracle_peak_tokens:
                raise TrtkvError("arborkv budget_basis=oracle_peak needs the full-cache search's results: "
                                 "pass --oracle DIR of a full-policy trtkv search on the same problems")
            ref, what = tree.oracle_peak_tokens, "the full-cache peak"
        else:
            ref, what = int(self.kv_budget / self.kv_ratio), "kv_budget"
        budget = int(math.floor(self.kv_ratio * ref)) if self.budget_basis != "absolute" else int(self.kv_budget)
        if budget < root.n:
            raise TrtkvError(f"arborkv: the KV budget of {budget} tokens (kv_ratio {self.kv_ratio} x {what} {ref}) "
                             f"is below the root prompt's {root.n} tokens; raise kv_ratio or the search size")
        delta = self.delta if self.delta is not None else max(1, min(tree.node_tokens, int(0.05 * budget)))
        tree.policy_state = ArborTreeState(budget, delta, set(range(min(self.n_sink, root.n))), path=[0])

    def on_boundary(self, tree, node_id: int) -> None:
        st: ArborTreeState = tree.policy_state
        node = tree.nodes[node_id]
        v = float(min(1.0, max(0.0, node.value)))
        phi = (v, float(node.confidence), self._attention_feature(tree, st, node_id))
        st.features[node_id] = phi
        st.score[node_id] = msve_score(self.theta, *phi)
        st.events["boundary"] += 1
        if self.boundary_mode == "eager" or node_id not in st.path:
            on_path = node_id in st.path
            self._evict(tree, st, node_id, self._target(tree, st, node_id, on_path))
        st.changed = True
        self._maybe_pressure(tree, st)

    def on_transition(self, tree, leaf_id: int) -> None:
        st: ArborTreeState = tree.policy_state
        st.events["transition"] += 1
        st.path = tree.path()
        on = set(st.path)
        for j in self._off_path(tree, on):
            k_new = self._target(tree, st, j, False)
            if k_new < len(tree.resident(j)):
                self._evict(tree, st, j, k_new)
        if self.offpath_format != "none":  # quantize what stays off the path (ThinKV's formats)
            for j in self._off_path(tree, on):
                tree.store_as(j, self.offpath_format)
        path_blocks = [i for i in st.path if tree.nodes[i].closed and i != leaf_id]
        need = sum(tree.nodes[i].n - len(tree.resident(i)) for i in path_blocks)
        if tree.cached_tokens() + need >= st.budget - st.delta:
            self._pressure(tree, st, reserve=need)
        if self.rehydration:
            for i in path_blocks:  # root to leaf: every ancestor is complete when a block is rebuilt
                if len(tree.resident(i)) < tree.nodes[i].n or self.offpath_format != "none":
                    tree.rehydrate(i)  # (also brings re-stored blocks back to the base format)
        st.changed = True

    def tree_stats(self, tree) -> dict:
        st = tree.policy_state
        if not isinstance(st, ArborTreeState):
            return {}
        return {"budget_tokens": st.budget, "budget_violations": st.violations,
                "pressure_events": st.events["pressure"], "boundary_events": st.events["boundary"],
                "transition_events": st.events["transition"], "policy_evictions": st.evict_calls}

    # --- rules ----------------------------------------------------------------------------------
    def _off_path(self, tree, on: set[int]) -> list[int]:
        return [i for i, n in tree.nodes.items() if i not in on and n.closed and n.parent is not None]

    def _target(self, tree, st: ArborTreeState, j: int, on_path: bool) -> int:
        node = tree.nodes[j]
        return tae_keep(self.tae, node.n, st.score.get(j, 0.5), node.depth, tree.distance(j), on_path)

    def _priority(self, tree, st: ArborTreeState, j: int) -> tuple:
        z = tae_weight(self.tae, st.score.get(j, 0.5), tree.nodes[j].depth, tree.distance(j), False)
        return (z, -tree.distance(j), j)

    def _evict(self, tree, st: ArborTreeState, j: int, k: int) -> int:
        """Evict(j, k) (Algorithm 1) through block j's request; returns the tokens it freed."""
        node = tree.nodes[j]
        res = tree.resident(j)
        if k >= len(res):
            return 0
        sinks = {p - node.start for p in st.sinks if node.start <= p < node.start + node.n}
        acc = st.acc.get(j, np.zeros(node.n))
        keep = set(extractive_keep(res, node.n, max(k, 0), acc, self.l_tail, sinks, self.intra))
        drop = [node.start + o for o in res if o not in keep]
        if drop:
            node.req.evict_all_layers(drop)
            st.evict_calls += 1
        return len(drop)

    def _maybe_pressure(self, tree, st: ArborTreeState) -> None:
        m = tree.cached_tokens()
        if m >= st.budget - st.delta and (st.changed or m >= st.pressure_mark + st.delta):
            self._pressure(tree, st)

    def _pressure(self, tree, st: ArborTreeState, reserve: int = 0) -> None:
        st.events["pressure"] += 1
        off = self._off_path(tree, set(st.path or tree.path()))
        for j in off:
            t = self._target(tree, st, j, False)
            if t < len(tree.resident(j)):
                self._evict(tree, st, j, t)
        target = st.budget - 2 * st.delta
        excess = tree.cached_tokens() + reserve - target
        order = sorted(off, key=lambda j: self._priority(tree, st, j))
        for j in order:
            if excess <= 0:
                break
            kj = len(tree.resident(j))
            dec = min(excess, kj - self.k_min)
            if dec > 0:
                excess -= self._evict(tree, st, j, kj - dec)
        if excess > 0 and self.allow_full_evict:
            for j in order:
                if excess <= 0:
                    break
                excess -= self._evict(tree, st, j, 0)
        if excess > 0:
            st.violations += 1  # the active path alone exceeds the target; it is never evicted
        st.pressure_mark = tree.cached_tokens()
        st.changed = False
