"""A search tree on the forking paged cache: nodes are thought blocks, each with its own forked request.

The root is the prompt (prefilled once). Expanding node q forks q's request (tree mode: the child shares
every page of the path) and decodes one block: up to ``node_tokens`` tokens, closed at a newline after some
text, or at EOS. Closing runs one more step on the block's last token, which writes its KV (every child
needs it) and gives the next-token distribution the children sample their first token from (and MSVE's
confidence). The tree implements :class:`trtkv.policies.tree.TreeView`, raises the policy's tree events,
executes rehydration, and records live KV after every step and event (the search plot).
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import torch

from trtkv.runtime.core import EngineCore
from trtkv.runtime.forking import fork_request
from trtkv.runtime.prefix_prefill import entropy_confidence, prefill_at, span_missing
from trtkv.runtime.request import Request
from trtkv.runtime.sampling import SamplingParams, make_generator


@dataclass
class TreeNode:
    node_id: int
    parent: int | None
    depth: int
    start: int
    token_ids: list[int] = field(default_factory=list)
    closed: bool = False
    terminal: bool = False  # ended at EOS (no children)
    value: float = 0.0
    confidence: float = 0.0
    children: list[int] = field(default_factory=list)
    rehydrations: int = 0
    text: str = ""
    token_probs: list[float] = field(default_factory=list)  # the model's probability of each sampled token
    task_state: Any = None  # the controller's (e.g. Game of 24's remaining numbers)
    request: Request | None = None

    @property
    def n(self) -> int:
        return len(self.token_ids)

    @property
    def req(self):
        return self.request.ctx

    @property
    def end(self) -> int:
        return self.start + self.n - 1


@dataclass
class LivePoint:
    step: int  # decode steps so far in this search
    cached_tokens: int
    kv_bytes: int
    event: str  # "decode" | "transition" | "boundary" | "rehydrate"


class SearchTree:
    def __init__(self, core: EngineCore, prompt: str, prompt_ids: list[int], temperature: float, top_p: float,
                 seed: int, node_tokens: int, capacity_tokens: int, oracle_peak_tokens: int | None = None):
        self.core = core
        self.prompt, self.prompt_ids = prompt, prompt_ids
        self.temperature, self.top_p, self.seed = temperature, top_p, seed
        self.node_tokens = node_tokens
        self.capacity_tokens = capacity_tokens
        self.oracle_peak_tokens = oracle_peak_tokens
        self.nodes: dict[int, TreeNode] = {}
        self.active_leaf = 0
        self.policy_state: Any = None
        self.steps = 0
        self.timeline: list[LivePoint] = []
        self.peak_cached_tokens = self.peak_kv_bytes = self.peak_pages = 0
        self.rehydration_count = 0
        self.rehydration_s = 0.0
        self.conversions = 0  # tokens re-stored in another format (store_as)
        self.policy_s = 0.0
        self._open = False

    # --- lifecycle ----------------------------------------------------------------------------
    def start(self) -> TreeNode:
        params = SamplingParams(max_tokens=1, temperature=self.temperature, top_p=self.top_p, seed=self.seed)
        rid = self.core.next_fork_id  # the root shares the id space of forks, apart from the API's
        self.core.next_fork_id += 1
        req = Request(rid, self.prompt, self.prompt_ids, params, make_generator(self.seed),
                      self.core.arch.max_position_embeddings)
        self._open = True
        self.core.prefill(req)
        req.ctx.tree = self
        root = TreeNode(0, None, 0, 0, list(self.prompt_ids), closed=True, request=req)
        root.confidence = entropy_confidence(req.last_logits)
        self.nodes[0] = root
        self._record("prefill")
        self._policy("on_tree_begin", self)
        return root

    def close(self) -> None:
        """Free every node's request (children and parents in any order: shared pages are refcounted)."""
        if not self._open:
            return
        try:
            self._policy("on_tree_end", self)
        finally:
            self._open = False
            for node in self.nodes.values():
                r = node.request
                if r is not None and r.ctx is not None and r.req_id in self.core.cache.seqs:
                    r.finish_reason = r.finish_reason or "stop"
                    self.core.finish(r)

    # --- TreeView -------------------------------------------------------------------------------
    def path(self, leaf: int | None = None) -> list[int]:
        out, i = [], self.active_leaf if leaf is None else leaf
        while i is not None:
            out.append(i)
            i = self.nodes[i].parent
        return out[::-1]

    def distance(self, node_id: int) -> int:
        a, b = node_id, self.active_leaf
        da, db = self.nodes[a].depth, self.nodes[b].depth
        steps = 0
        while da > db:
            a, da, steps = self.nodes[a].parent, da - 1, steps + 1
        while db > da:
            b, db, steps = self.nodes[b].parent, db - 1, steps + 1
        while a != b:
            a, b, steps = self.nodes[a].parent, self.nodes[b].parent, steps + 2
        return steps

    def cached_tokens(self) -> int:
        buffered = sum(s.buffered(0) for s in self.core.cache.seqs.values())
        return self.core.cache.live_slots(0) + buffered

    def resident(self, node_id: int) -> list[int]:
        node = self.nodes[node_id]
        held = node.req.all_positions(0)
        held = held[(held >= node.start) & (held < node.start + node.n)]
        return (held - node.start).tolist()

    def subtree(self, node_id: int) -> list[int]:
        out, todo = [], [node_id]
        while todo:
            i = todo.pop()
            out.append(i)
            todo.extend(self.nodes[i].children)
        return out

    def _sharers(self, node_id: int) -> list:
        return [self.nodes[i].req.seq for i in self.subtree(node_id)[1:]
                if self.nodes[i].request is not None and self.nodes[i].request.req_id in self.core.cache.seqs]

    def _stored_elsewhere(self, node_id: int, fmt: str) -> list[int]:
        """Positions of the block held (layer 0) in a format other than ``fmt``."""
        node = self.nodes[node_id]
        loc = node.req.seq.layers[0].loc
        return [p for p in range(node.start, node.start + node.n) if p in loc and loc[p][0] != fmt]

    def store_as(self, node_id: int, fmt: str) -> int:
        """Re-store the block's resident tokens in format ``fmt`` (e.g. ThinKV's fp8 / nvfp4): read them
        dequantized, evict them tree-wide, write them in ``fmt`` and share the new pages with the block's
        descendants. Returns the tokens converted. Rehydration restores the base format."""
        from plugins.formats import get_format

        node = self.nodes[node_id]
        ctx = node.req
        pos = self._stored_elsewhere(node_id, fmt)
        if not pos:
            return 0
        g = get_format(fmt).group_size
        step = g if g > 1 else len(pos)
        sharers = self._sharers(node_id)
        cache = self.core.cache
        for layer in range(self.core.arch.num_hidden_layers):
            k, v = ctx.kv_local(layer, pos)  # what this rank's cache holds, written back to it
            cache.evict(ctx.seq, layer, pos)
            for s in range(0, len(pos), step):
                cache.write(ctx.seq, layer, k[s:s + step], v[s:s + step], pos[s:s + step], (fmt, 0), -1)
            cache.share_written(ctx.seq, sharers, layer, pos)
        self.conversions += len(pos)
        self._record("store")
        return len(pos)

    def rehydrate(self, node_id: int) -> None:
        """Rebuild the block's evicted tokens (and those re-stored in another format) in the base format."""
        node = self.nodes[node_id]
        ctx = node.req
        cls = self.core.policy.prefill_class(ctx)
        other = self._stored_elsewhere(node_id, cls[0])
        if other:
            ctx.evict_all_layers(other)
        missing = span_missing(ctx, node.start, node.n)
        if not missing:
            return
        t0 = time.perf_counter()
        prefill_at(self.core, ctx, node.token_ids, node.start, missing, cls)
        sharers = self._sharers(node_id)
        for layer in range(self.core.arch.num_hidden_layers):
            self.core.cache.share_written(ctx.seq, sharers, layer, missing)
        node.rehydrations += 1
        self.rehydration_count += 1
        self.rehydration_s += time.perf_counter() - t0
        self._record("rehydrate")

    # --- expansion --------------------------------------------------------------------------
    def expand(self, parent_id: int, stop_at_newline: bool = True) -> TreeNode:
        """Generate one child block of ``parent_id`` (Transition, fork, decode to the block's end, close).
        The controller then sets ``value`` and calls :meth:`boundary`."""
        parent = self.nodes[parent_id]
        cid = len(self.nodes)
        node = TreeNode(cid, parent_id, parent.depth + 1, parent.start + parent.n)
        self.nodes[cid] = node
        parent.children.append(cid)
        self.active_leaf = cid
        self._policy("on_transition", self, cid)
        self._record("transition")
        seed = self.seed * 1_000_003 + cid
        params = SamplingParams(max_tokens=self.node_tokens + 2, temperature=self.temperature, top_p=self.top_p,
                                seed=seed, chat=False)
        req = fork_request(self.core, parent.request, params, make_generator(seed, self.core.device), mode="tree")
        req.ctx.tree = self
        node.request = req
        if req.generated:  # (empty when the first sample was EOS: a terminal block of no tokens)
            node.token_probs.append(_prob(parent.request.last_logits, req.generated[0]))
        while not req.finished and not self._block_done(req, stop_at_newline):
            self.core.decode_step([req])
            self.steps += 1
            if req.generated and not req.finished:
                node.token_probs.append(_prob(req.last_logits, req.generated[-1]))
            self._record("decode")
        n = len(req.generated)
        if req.finished and req.finish_reason == "stop":  # EOS: every token is written already
            node.terminal = True
        else:  # write the block's last token; its logits are p_i (children sample from them)
            self.core.decode_step([req])
            self.steps += 1
            self._record("decode")
        node.token_ids = list(req.generated[:n])
        node.text = self.core.decode_text(node.token_ids)
        node.confidence = entropy_confidence(req.last_logits)
        node.closed = True
        self.core.cache.seal(req.ctx.seq)  # a closed block writes no more tokens of its own
        return node

    def _block_done(self, req: Request, stop_at_newline: bool) -> bool:
        if len(req.generated) >= self.node_tokens:
            return True
        if not stop_at_newline:
            return False
        last = self.core.decode_text(req.generated[-1:])
        return "\n" in last and bool(self.core.decode_text(req.generated).strip())

    def boundary(self, node_id: int) -> None:
        self._policy("on_boundary", self, node_id)
        self._record("boundary")

    # --- bookkeeping ------------------------------------------------------------------------
    def _policy(self, hook: str, *args) -> None:
        t0 = time.perf_counter()
        getattr(self.core.policy, hook)(*args)
        self.policy_s += time.perf_counter() - t0

    def _record(self, event: str) -> None:
        cache = self.core.cache
        cached, kvb = self.cached_tokens(), cache.engine_bytes()
        pages = sum(p.in_use for p in cache.pools[0].values())
        self.peak_cached_tokens = max(self.peak_cached_tokens, cached)
        self.peak_kv_bytes = max(self.peak_kv_bytes, kvb)
        self.peak_pages = max(self.peak_pages, pages)
        self.timeline.append(LivePoint(self.steps, cached, kvb, event))


def _prob(logits: torch.Tensor, tok: int) -> float:
    return float(torch.softmax(logits.float(), -1)[tok])
