"""The tree protocol: what a policy sees of a search tree (``trtkv search``), and the tree events.

A search tree's nodes are thought blocks; each node has its own request (a forked sequence holding the
root-to-node path, sharing its ancestors' pages). Policies still act only through the request API: a node's
``req`` is a :class:`~trtkv.policies.request.PolicyRequest`, and evicting through it removes the tokens from
the node's pages for every descendant that shares them (tree-wide eviction). The one action that is not an
eviction, rebuilding an evicted block, is asked of the tree (``rehydrate``), which the runtime executes.

Events (``KVPolicy`` hooks, no-ops by default), called by the runtime tree (``trtkv/runtime/tree.py``):
    on_tree_begin(tree)              the root (prompt) is prefilled and pinned
    on_transition(tree, leaf_id)     the active leaf changes: a new child is about to be generated
    on_boundary(tree, node_id)       a block closed and the controller set its value
    on_tree_end(tree)                the search is over (the tree frees every page after it)
Per-request hooks (``on_decode_step_end`` ...) still run on the active leaf's request; ``req.tree`` is the
tree there (None outside a search).
"""
from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

from trtkv.policies.request import PolicyRequest


@runtime_checkable
class TreeNodeView(Protocol):
    node_id: int
    parent: int | None
    depth: int
    start: int  # absolute position of the block's first token (siblings share it)
    token_ids: list[int]  # the block's tokens (kept forever: rehydration needs them)
    closed: bool
    value: float  # the controller's search value in [0, 1]
    confidence: float  # 1 - H(p)/log|V| of the next-token distribution after the block
    children: list[int]
    rehydrations: int

    @property
    def n(self) -> int: ...
    @property
    def req(self) -> PolicyRequest: ...


@runtime_checkable
class TreeView(Protocol):
    nodes: dict[int, Any]  # node id -> TreeNodeView
    active_leaf: int
    capacity_tokens: int  # |prompt| + N_expand * T_node: the largest tree the search may build
    oracle_peak_tokens: int | None  # the full-cache run's peak on the same instance, when given
    node_tokens: int  # T_node
    policy_state: Any  # the policy's per-tree state (set by its on_tree_begin)

    def path(self) -> list[int]:
        """Node ids from the root to the active leaf."""
    def distance(self, node_id: int) -> int:
        """Edges between ``node_id`` and the active leaf."""
    def cached_tokens(self) -> int:
        """Tokens the whole tree holds (one layer; a shared token counted once)."""
    def resident(self, node_id: int) -> list[int]:
        """Offsets (0..n-1) of the block's tokens still cached."""
    def store_as(self, node_id: int, fmt: str) -> int:
        """Re-store the block's resident tokens in KV format ``fmt`` (quantize instead of evicting); the
        tokens stay resident, their bytes shrink. Returns the tokens converted."""
    def rehydrate(self, node_id: int) -> None:
        """Rebuild the block's evicted tokens by a prefill over its stored ids at their original positions,
        the ancestors' pages as prefix (they must be complete); its descendants see the rebuilt tokens."""
