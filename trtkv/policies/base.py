"""The policy contract: lifecycle hooks mirroring TensorRT-LLM's KV-cache compression manager.

A policy *decides* (formats, which token positions to evict); the cache *executes*. Policies speak in
token positions, never pages, through the request API (:class:`~trtkv.policies.request.PolicyRequest`).
Each policy is a dataclass whose fields are its parameters, so it serialises into ``engine.json`` and takes
``--set key=value`` overrides. Per-request state is a typed ``State`` dataclass that the base creates at
``begin`` and drops at ``end``, so no policy frees state by hand and none leaks between requests.

Hooks, in the order the runtime calls them:
    begin(req) -> on_request_init(req)   once, before prefill (``req.state`` is a fresh ``State()``)
    on_prefill_end(req, stats)           after the prompt is in the cache and the first token sampled
                                         (called through on_prefill_end_batch(reqs, stats), once for the
                                         prompts prefilled together)
    on_decode_step_begin(req)            before each decode step's forward (room for the new token)
    before_attention(req, layer)         per layer, after the step's write/flush, before attention
                                         (called through before_attention_batch(reqs, layer), once per layer
                                         for the whole batch: override that to batch work across requests)
    on_decode_step_end(req, stats)       after each decode step (scores, cadence-driven eviction)
                                         (called through on_decode_step_end_batch(reqs, stats), once per
                                         step for the whole batch)
    end(req) -> on_request_finish(req)   last look; then ``req.state`` is dropped (the cache frees pages)

Engine-facing hooks (so the builder, the API and the bench know no policy by name):
    needs_calibration() / load_calibration(artifact)   calibration the policy consumes, if any
    report_columns()                                   the policy's statistics worth a column in the bench
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar, NamedTuple

import numpy as np
import torch

if TYPE_CHECKING:
    from trtkv.policies.request import PolicyRequest


@dataclass(frozen=True)
class StatsRequest:
    """What the attention plugin should emit this step (only what the policy will read). Immutable: a policy
    answers a whole batch with one shared request (``WEIGHTS``), and the runtime reads a batch of the same object
    once."""

    layers: tuple[int, ...] | None = None  # None = every layer
    weights: bool = False  # per-slot attention weights (per query head) with their token positions
    sparsity: bool = False  # per-KV-head sparsity and ThinKV's averaged-row sparsity
    prefill_window: int = 0  # prefill: weights of the last w prompt queries over the prompt
    queries: bool = False  # decode: the step's post-RoPE query ``[Hq, D]`` (StepStats.query)


WEIGHTS = StatsRequest(weights=True)  # a decode step's usual request: every layer's weights


@dataclass
class LayerStats:
    positions: np.ndarray  # [n] token positions of the attended keys (-1: dead slot)
    weights: torch.Tensor | None = None  # [Hq, n] softmax weights, 0 at dead slots; [w, Hq, P] at prefill
    logits: torch.Tensor | None = None  # [Hq, n] scaled logits, -inf at dead slots
    sparsity_heads: torch.Tensor | None = None  # [H] fraction of weights < 1% of the row max, per KV head
    sparsity: float | None = None  # ThinKV: max-pool G query heads, softmax, mean over KV heads, then fraction
    head_sums: torch.Tensor | None = None  # decode: [n] the weights summed over query heads (``batch_weights`` False)


class BatchLayerStats:
    """A decode step's attention weights of one layer for the whole batch (``KVPolicy.batch_stats``): row ``i``
    is the batch's request ``i``, its columns the kernel's slots in block-table order (no per-layer reorder).

    ``positions [b, n]``: positions of the attended keys, -1 for a dead or absent slot (anywhere); None only inside
    the step's forward, when the read is deferred to its end (runtime/attention.py, resolve_positions). ``weights
    [b, Hq, n]``: softmax weights, 0 at the dead slots (None: ``batch_weights`` False). ``counts [b]``: live columns
    of each row. ``head_sums [b, n]``: the weights summed over query heads, 0 at the dead slots (None:
    ``batch_weights`` True). ``heads``: Hq, the query heads summed. ``blocks``: the columns as the layer's sources
    gave them, ``[(positions, head_sums), ...]`` side by side (a device and staged host pages), for a reader that
    takes them block by block; ``positions`` and ``head_sums`` are then their join, made when first read."""

    __slots__ = ("_positions", "weights", "counts", "_head_sums", "heads", "blocks")

    def __init__(self, positions: np.ndarray | None, weights: torch.Tensor | None, counts: np.ndarray | None,
                 head_sums: torch.Tensor | None, heads: int, blocks: list | None = None) -> None:
        self._positions, self.weights, self.counts, self._head_sums, self.heads = (positions, weights, counts,
                                                                                   head_sums, heads)
        self.blocks = blocks

    @property
    def positions(self) -> np.ndarray | None:
        if self._positions is None and self.blocks is not None and self.blocks[0][0] is not None:
            self._positions = np.concatenate([p for p, _ in self.blocks], axis=1)
        return self._positions

    @positions.setter
    def positions(self, positions: np.ndarray | None) -> None:
        self._positions = positions

    @property
    def head_sums(self) -> torch.Tensor | None:
        if self._head_sums is None and self.blocks is not None:
            self._head_sums = torch.cat([s for _, s in self.blocks], dim=-1)
        return self._head_sums

    def place_blocks(self, positions: list[np.ndarray], counts: np.ndarray) -> None:
        """The blocks' positions (read at the step's end, one array a block) and the rows' live columns."""
        self.blocks = [(p, s) for p, (_, s) in zip(positions, self.blocks)]
        self.counts = counts


class StepBatch(dict):
    """A decode step's statistics in batch form, ``layer -> BatchLayerStats``, filled layer by layer. After the
    step, ``positions_layers()`` is every layer's positions stacked once for whoever reads them all. ``top``: no
    position in them is larger (the step's newest token; -1 unknown), so a score table grows to it without a
    pass over every layer's positions."""

    def __init__(self, top: int = -1) -> None:
        super().__init__()
        self.top = top

    def stacked_positions(self, positions: np.ndarray, counts: np.ndarray) -> None:
        """Every layer's positions ``[L, b, n]`` and counts ``[L, b]`` as one array each (their rows are the layers'
        own): what ``positions_layers`` and ``counts_layers`` return, with no stacking."""
        self._stacked, self._counts = positions, counts

    def counts_layers(self) -> np.ndarray | None:
        """``[L, b]`` counts of every layer, when ``stacked_positions`` gave them (else None)."""
        return self.__dict__.get("_counts")

    def positions_layers(self) -> np.ndarray | None:
        """``[L, b, n]`` positions of layers ``0..L-1`` (None unless every layer is here, all of one width)."""
        stacked = self.__dict__.get("_stacked")
        if stacked is None:
            layers = [self.get(layer) for layer in range(len(self))]
            ok = all(bs is not None for bs in layers) and len({bs.positions.shape for bs in layers}) == 1
            stacked = self._stacked = np.stack([bs.positions for bs in layers]) if ok and layers else False
        return None if stacked is False else stacked


def batch_blocks_of(batch: dict[int, BatchLayerStats], rows: np.ndarray
                    ) -> list[tuple[np.ndarray, list[tuple[np.ndarray, torch.Tensor]]]]:
    """``batch_rows_of``'s head sums, each layer's as ``(counts, [(positions, head sums), ...])``: its sources'
    column blocks (``BatchLayerStats.blocks``) when every row is asked for, in order, else one joined block."""
    if batch and every_row(rows, len(next(iter(batch.values())).counts)):
        return [(bs.counts, bs.blocks or [(bs.positions, bs.head_sums)]) for bs in batch.values()]
    return [(counts, [(p, s)]) for _, p, s, counts in batch_rows_of(batch, rows)]


def every_row(rows: np.ndarray, b: int) -> bool:
    """Whether ``rows`` are all ``b`` rows of a batch's statistics, in order (then no gather is needed)."""
    return len(rows) == b and bool((rows == np.arange(b)).all())


def positions_top(batch: dict[int, BatchLayerStats], positions: np.ndarray) -> int:
    """The largest of ``positions`` (some of ``batch``'s), or a bound on it the step knows (``StepBatch.top``)."""
    top = batch.top if isinstance(batch, StepBatch) else -1
    return top if top >= 0 else int(positions.max(initial=-1))


def batch_rows_of(batch: dict[int, BatchLayerStats], rows: np.ndarray, weights: bool = False
                  ) -> list[tuple[int, np.ndarray, torch.Tensor, np.ndarray]]:
    """Each layer's ``(layer, positions, head sums, counts)`` of ``rows`` of the batch, in that order (every row
    in order, the usual case: the arrays themselves, no gather); ``weights``: the per-head weights instead of their
    sums."""
    if not batch:
        return []
    if every_row(rows, len(next(iter(batch.values())).counts)):
        return [(layer, bs.positions, bs.weights if weights else bs.head_sums, bs.counts)
                for layer, bs in batch.items()]
    idx = torch.from_numpy(rows)
    out = []
    for layer, bs in batch.items():
        w = bs.weights if weights else bs.head_sums
        out.append((layer, bs.positions[rows], w[idx.to(w.device)], bs.counts[rows]))
    return out


@dataclass
class StepStats:
    step: int  # decode index i (token at position prompt_len + i); -1 for prefill
    layers: dict[int, LayerStats] = field(default_factory=dict)
    batch: dict[int, BatchLayerStats] | None = None  # batch-form statistics instead of ``layers`` (shared)
    row: int = -1  # this request's row in ``batch`` and ``queries``
    queries: StepQueries | None = None  # the step's queries (StatsRequest.queries; shared by the batch)

    def query(self, layer: int) -> torch.Tensor | None:
        """This request's post-RoPE query ``[Hq, D]`` of ``layer`` at this decode step, if it asked for it."""
        return None if self.queries is None else self.queries.of(layer, self.row)


@dataclass
class StepQueries:
    """A decode step's post-RoPE queries, one record for the whole batch (a policy keeps a reference, not a copy
    per request and layer): per layer the queries ``[b, Hq, D]`` and which rows asked for them."""

    layers: dict[int, tuple[torch.Tensor, np.ndarray]] = field(default_factory=dict)

    def of(self, layer: int, row: int) -> torch.Tensor | None:
        got = self.layers.get(layer)
        return None if got is None or not got[1][row] else got[0][row]

    def wanted(self, layer: int, rows: np.ndarray) -> bool:
        """Whether every one of ``rows`` asked for ``layer``'s query."""
        got = self.layers.get(layer)
        return got is not None and bool(got[1][rows].all())


class ReportColumn(NamedTuple):
    """One column of the bench's per-policy table: title, key in the flattened stats, format spec."""

    title: str
    key: str
    spec: str


@dataclass
class NoState:
    """The State of a policy that keeps nothing per request."""


@dataclass
class KVPolicy:
    """Base policy: full-cache behaviour. Subclasses override the hooks they need."""

    name: ClassVar[str] = ""
    description: ClassVar[str] = ""
    State: ClassVar[type] = NoState  # per-request state, created by ``begin`` and dropped by ``end``
    kv_format: str = "auto"  # storage format of every token ("auto": the model's dtype)
    budget: int | None = None  # token budget per layer (None: unbounded)

    # --- configuration ----------------------------------------------------------------------
    def params(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.init}

    def resolve_formats(self, model_dtype: str) -> None:
        """Replace "auto" by a concrete format once the engine's dtype is known."""
        if self.kv_format == "auto":
            self.kv_format = model_dtype

    def formats(self) -> set[str]:
        return {self.kv_format}

    def pool_formats(self) -> set[str]:
        """Every format this policy's requests may store: the cache sizes one pool per layer for each, once
        (``trtkv/cache/budget.py``). Default: ``formats()``."""
        return self.formats()

    def drops_tokens(self) -> bool:
        """May a request lose tokens it wrote (eviction, demotion, pruning)? Then a quantized format's flush
        groups can thin out to one live token each, and the cache gives its key-scale arenas one group per
        slot. Default: the footprint is below keep-everything for some request shape."""
        shapes = ((64, 1 << 14), (1 << 14, 64), (1 << 12, 1 << 12))
        return any(self.max_live_tokens(p, m) < p + m for p, m in shapes)

    def residual_group(self) -> int:
        """Tokens held in full precision before a flush: 16 when any format quantizes, else 1."""
        from plugins.formats import get_format

        return max(get_format(f).group_size for f in self.formats())

    def flush_prompt_tail(self) -> bool:
        """Quantize the prompt's last ``len % g`` tokens as a partial group (else they stay buffered)."""
        return False

    def stats_request(self, req: PolicyRequest, phase: str) -> StatsRequest | None:
        return None

    def stats_requests(self, reqs: list[PolicyRequest], phase: str) -> list[StatsRequest | None]:
        """``stats_request`` of each of a step's requests (a policy may answer for the batch at once)."""
        return [self.stats_request(r, phase) for r in reqs]

    def write_class(self, req: PolicyRequest) -> tuple[str, int, int]:
        """(format, thought class, segment id) of the next token / flush group of this request."""
        return self.kv_format, 0, -1

    def write_classes(self, reqs: list[PolicyRequest]) -> list[tuple[str, int, int]]:
        """``write_class`` of each of a decode step's requests (one tuple for all where it cannot differ)."""
        if type(self).write_class is KVPolicy.write_class:
            return [(self.kv_format, 0, -1)] * len(reqs)
        return [self.write_class(r) for r in reqs]

    def prefill_class(self, req: PolicyRequest) -> tuple[str, int, int]:
        return self.write_class(req)

    def cache_eviction_mode(self) -> str | None:
        """The cache eviction mode this policy requires ("inplace" or "compact"), or None for either.
        ``trtkv build`` writes it into the engine's cache section (and rejects a conflicting ``--set``)."""
        return None

    def bind_model(self, arch: Any) -> None:
        """Called once by the engine with the model architecture (``ModelArch``), for policies that need
        head geometry or RoPE (e.g. Expected Attention). Not a parameter: nothing is serialised."""

    def max_live_tokens(self, prompt_len: int, max_tokens: int) -> int:
        """Upper bound on tokens one request keeps per layer (admission control)."""
        total = prompt_len + max_tokens
        return total if self.budget is None else min(total, self.budget + 2 * self.residual_group())

    def kv_footprint(self, prompt_len: int, max_tokens: int) -> dict[str, int]:
        """Worst-case live tokens per layer in each storage format (admission reserves pages for these).
        A policy that writes one format has one entry; one that mixes formats bounds each."""
        bound = self.max_live_tokens(prompt_len, max_tokens)
        return {f: bound for f in self.formats()}

    def min_device_tokens(self, prompt_len: int, max_tokens: int) -> int | None:
        """Tokens per layer that must stay on the device whatever happens (a tiered policy's protected set);
        admission rejects a request whose minimum does not fit ``--kv-memory``, with a line naming it. Default
        None: no protected set apart from the footprint (``kv_footprint``, which admission checks anyway)."""
        return None

    # --- engine-facing hooks ----------------------------------------------------------------
    def needs_calibration(self) -> bool:
        """Does ``trtkv build`` have to calibrate (or load a calibration) for this configuration?"""
        return False

    def needs_format_selection(self) -> bool:
        """Does ``trtkv build`` have to measure candidate storage formats for this configuration
        (``trtkv.build.format_selection``)? A policy that says so also takes the choice through
        ``set_precision(precision)`` (ThinKV with ``precision=auto``)."""
        return False

    def load_calibration(self, artifact: Any) -> None:
        """Take what the policy needs from the engine's calibration artifact (None: there is none)."""

    @classmethod
    def report_columns(cls) -> tuple[ReportColumn, ...]:
        """Statistics of ``extra_stats`` (flattened keys) the bench prints in a per-policy table."""
        return ()

    # --- lifecycle --------------------------------------------------------------------------
    def begin(self, req: PolicyRequest) -> None:
        req.state = self.State()
        self.on_request_init(req)

    def fork(self, parent: PolicyRequest, child: PolicyRequest) -> None:
        """A child request forked from ``parent`` shares its tokens: it starts from a copy of its state."""
        import copy

        child.state = copy.deepcopy(parent.state)

    def end(self, req: PolicyRequest) -> None:
        try:
            self.on_request_finish(req)
        finally:
            req.state = None

    # --- hooks ------------------------------------------------------------------------------
    def on_request_init(self, req: PolicyRequest) -> None:
        pass

    def on_prefill_end(self, req: PolicyRequest, stats: StepStats) -> None:
        pass

    def on_prefill_end_batch(self, reqs: list[PolicyRequest], stats: list[StepStats]) -> None:
        """``on_prefill_end`` for the prompts prefilled together (the runtime's call, once a packed group). A policy
        that cuts each prompt by a token or so a layer overrides this to cut them all at once."""
        for req, st in zip(reqs, stats):
            self.on_prefill_end(req, st)

    def on_decode_step_begin(self, req: PolicyRequest) -> None:
        pass

    def on_decode_step_begin_batch(self, reqs: list[PolicyRequest]) -> None:
        """``on_decode_step_begin`` for every request of a decode step (the runtime's call, once a step). A policy
        that evicts a token or so per request each step overrides this to evict for the batch at once."""
        for req in reqs:
            self.on_decode_step_begin(req)

    # Whether the policy takes a decode step's attention weights in batch form (``StepStats.batch``) when every
    # request of the step asks for the weights alone in every layer (see ScorerPolicy).
    batch_stats = False
    # Whether it reads the per-head weights of that batch form; False: it reads only their sums over heads, which
    # then come from one kernel in either form (``head_sums``).
    batch_weights = True

    def before_attention(self, req: PolicyRequest, layer: int) -> None:
        pass

    def before_attention_batch(self, reqs: list[PolicyRequest], layer: int) -> None:
        """``before_attention`` for every request of a decode step (the runtime's call). A policy whose
        per-request work is a kernel call (ThinKV's k-means) overrides this to make one call for the batch."""
        if type(self).before_attention is KVPolicy.before_attention:
            return  # nothing to do for any request (most policies): no call per request and layer
        for req in reqs:
            self.before_attention(req, layer)

    # ``before_attention_batch`` only evicts, and only in the layer it is given: a step's buffer appends and flushes
    # of every layer may then be planned at its first layer (trtkv/cache/flush.py)
    acts_in_own_layer = False

    def acts_before_attention(self, reqs: list[PolicyRequest]) -> bool:
        """Whether ``before_attention_batch`` will do anything in this decode step (asked after the step's begin
        hooks): a step where it does not may run as one device program (``--runtime graph``). By default,
        whenever the policy has the hook."""
        return (type(self).before_attention is not KVPolicy.before_attention
                or type(self).before_attention_batch is not KVPolicy.before_attention_batch)

    def on_decode_step_end(self, req: PolicyRequest, stats: StepStats) -> None:
        pass

    def on_decode_step_end_batch(self, reqs: list[PolicyRequest], stats: list[StepStats]) -> None:
        """``on_decode_step_end`` for every request of a decode step (the runtime's call, once a step;
        ``stats[i]`` is ``reqs[i]``'s). A policy whose per-request work is small array operations (the scoring
        policies' one victim per layer) overrides this to do it for the batch at once."""
        for req, st in zip(reqs, stats):
            self.on_decode_step_end(req, st)

    def on_request_finish(self, req: PolicyRequest) -> None:
        pass

    # --- tree events (trtkv search; see policies/tree.py) ------------------------------------
    def on_tree_begin(self, tree: Any) -> None:
        pass

    def on_transition(self, tree: Any, leaf_id: int) -> None:
        pass

    def on_boundary(self, tree: Any, node_id: int) -> None:
        pass

    def on_tree_end(self, tree: Any) -> None:
        pass

    def tree_stats(self, tree: Any) -> dict[str, Any]:
        """Policy numbers for a search's per-problem record (rehydrations are counted by the tree)."""
        return {}

    def extra_stats(self, req: PolicyRequest) -> dict[str, Any]:
        """Policy-specific numbers for ``generate --json`` stats."""
        return {}
