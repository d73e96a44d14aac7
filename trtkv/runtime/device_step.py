"""The decode step as a device program (``--runtime graph``): a host plan, then one compiled function.

A steady decode step splits in two, as vLLM's and SGLang's do:

1. **Host plan** (``plan_step``), from host state only: every layer's write slots at once
   (``KVCacheManager.plan_write_through``) or, under a quantized format's residual groups, every layer's buffer
   slot (``ResidualArena.plan_append``); each layer's block tables, validity words and scales; the step's token
   ids and RoPE angles; which layers' attention logits the policy reads after the step.
2. **Device program** (``DeviceStep``): embed -> every layer (q/k/v + RoPE, ``trtkv::kv_write`` into the
   planned slots or ``trtkv::residual_append`` into the buffers, ``trtkv::paged_attention`` per format merged by
   log-sum-exp, ``trtkv::buffer_attention`` merged in, o_proj + MLP) -> logits: a pure function of the plan's
   tensors, compiled once with ``torch.compile(fullgraph=True)`` (zero graph breaks: nothing in it reads a
   tensor on the host) and replayed every step. Batch size and block-table width are dynamic dimensions, so one
   compiled program serves every step of a batch of 2 or more (and one more serves batch 1). On CUDA the program
   replays CUDA graphs (``cuda_graphs``): one a batch size and ``TABLE_BUCKET_PAGES``-page bucket of table widths.

Policies decide between steps, as in the eager runtime: the logits the program returns for the layers a
policy asked about become its statistics (``layer_statistics``, the eager path's own function). A step the
plan does not cover runs eagerly, the oracle: a step whose policy acts between layers (ThinKV's anneals), that
flushes a residual group or asks statistics while tokens are buffered, host tiers, a write class that differs
across the batch, observers that force statistics or watch layers, tensor parallelism.
``DeviceStep.counts`` says how many steps ran each way.
"""
from __future__ import annotations

import dataclasses
import itertools
import os

import numpy as np
import torch

from plugins import ops as plugin_ops
from plugins.paged_attention.reference import merge_partials
from trtkv.cache.manager import KVCacheManager
from trtkv.cache.write_plan import WritePlan
from trtkv.errors import TrtkvError
from trtkv.runtime.attention import attach_queries, layer_statistics, source_positions


@dataclasses.dataclass
class StepPlan:
    """Everything the device program of one step reads, made on the host (``plan_step``)."""
    ids: torch.Tensor  # [b] the tokens to feed
    cos: torch.Tensor  # [b, D] RoPE of their positions
    sin: torch.Tensor
    write: WritePlan | None  # write-through: pages, slots [layers, b]
    writes: list[tuple] | None  # per layer: the written pool's (slot fields, group fields, k_group, code, scales)
    buffer: tuple | None  # residual buffers: (arena k, arena v, flat indices [layers, b], rows [b], fill [layers, b])
    sources: list[list[tuple]]  # per layer, per format: (fields, groups, k_group, valid, table, code, scales)
    tables: list[list[tuple]]  # per layer: (pool, block table) as attended (the statistics' positions)
    want: tuple[bool, ...]  # per layer: return its attention logits and log-sum-exps
    queries: tuple[bool, ...]  # per layer: return its post-RoPE queries
    constants: tuple  # per layer: the format codes and scales of what it writes and attends

    def key(self) -> tuple:
        """What a compiled program is specialized on: everything but a dynamic size or a tensor's data. The
        program's guards check its tensors' metadata only, so every constant it bakes in is in here."""
        return (self.ids.shape[0] == 1, self.buffer is not None, self.want, self.queries, self.constants)


def plan_step(cache: KVCacheManager, seqs: list, positions: list[int], write_cls: tuple | None, ids: torch.Tensor,
              cos: torch.Tensor, sin: torch.Tensor, want: tuple[bool, ...], queries: tuple[bool, ...],
              memo: PlanMemo) -> StepPlan | None:
    """The host plan of a step: a write-through step (every request writes ``write_cls``, format and thought)
    allocates and records its slots in every layer now; a buffered one records each request's token in every
    layer's residual buffer, or returns None (nothing done) when a buffer fills up this step (its flush runs
    eagerly) or a layer has no pages to attend. ``memo``: the layers' sources of the last plan."""
    b, L = len(seqs), cache.cfg.num_layers
    write = writes = buffer = None
    if cache.cfg.residual_group > 1:
        tables = [cache.block_tables(layer, seqs) for layer in range(L)]
        rows = cache.residual_rows(seqs)
        appended = None if not all(tables) else cache.residual.plan_append(rows, np.asarray(positions, np.int64))
        if appended is None:
            return None
        at, fill = (_on(cache.residual.k.device, a) for a in appended)
        _static_addresses([cache.residual.k, cache.residual.v])  # the program appends to them in place
        buffer = (cache.residual.k, cache.residual.v, at, _on(cache.residual.k.device, rows), fill)
        constants = []
    else:
        write = cache.plan_write_through(seqs, positions, write_cls, always=True)
        tables = [cache.block_tables(layer, seqs) for layer in range(L)]
        writes, constants = zip(*(memo.written(cache, layer, write_cls[0]) for layer in range(L)))
        constants = list(constants)
    sources = []
    for layer, raw in enumerate(tables):
        tables[layer], srcs, consts = memo.attended(cache, layer, raw, want[layer], b)
        sources.append(srcs)
        constants.append(consts)
    if write is not None:  # (a size-1 dimension's stride varies with how the plan was made: a guard would recompile)
        write = dataclasses.replace(write, pages=_standard_strides(write.pages), slots=_standard_strides(write.slots))
    if b > 1:
        for t in (ids, cos, sin) + ((buffer[3],) if buffer is not None else ()):
            torch._dynamo.mark_dynamic(t, 0)
        for t in (write.pages, write.slots) if write is not None else (buffer[2], buffer[4]):
            torch._dynamo.mark_dynamic(t, 1)
    return StepPlan(ids, cos, sin, write, writes, buffer, sources, tables, want, queries, tuple(constants))


class PlanMemo:
    """Each layer's written pool and attended sources as the last plan had them, reused while the cache hands out
    the same block tables (most steps: they change at page boundaries) and the pools keep their storage (a pool
    that grows replaces its tensors)."""

    def __init__(self, num_layers: int) -> None:
        self._attended: list[tuple | None] = [None] * num_layers
        self._written: list[tuple | None] = [None] * num_layers

    def written(self, cache: KVCacheManager, layer: int, fmt: str) -> tuple[tuple, tuple]:
        """``(the program's write arguments, their constants)`` of the layer's ``fmt`` pool."""
        pool = cache.pool(layer, fmt)
        m = self._written[layer]
        if m is None or m[0] is not pool or not _same_storage(pool, m[1]):
            sc = cache.layer_scales(layer, pool.fmt.name)
            entry = (pool.fields, pool.group_fields, pool.k_group, pool.fmt.code, sc.k, sc.v)
            _static_addresses(pool.fields, pool.group_fields, [pool.k_group])
            m = self._written[layer] = (pool, entry, (pool.fmt.code, sc.k, sc.v))
        return m[1], m[2]

    def attended(self, cache: KVCacheManager, layer: int, raw: list[tuple], want: bool, b: int
                 ) -> tuple[list[tuple], list[tuple], tuple]:
        """``(tables as attended, the program's sources, their constants)`` of the layer's block tables ``raw``
        (``cache.block_tables``): without statistics, a layer's other formats follow as empty tables."""
        m = self._attended[layer]
        if m is not None and m[0] is raw and m[1] == want and m[2] == b and \
                all(_same_storage(p, src) for (p, _), src in zip(m[3], m[4])):
            return m[3], m[4], m[5]
        tabs = [(p, _dynamic_table(bt, b)) for p, bt in (raw if want else _every_format(cache, layer, raw, b))]
        srcs, consts = [], []
        for p, bt in tabs:
            s = cache.layer_scales(layer, p.fmt.name)
            srcs.append((p.fields, p.group_fields, p.k_group, p.valid_bits(), bt, p.fmt.code, s.k, s.v))
            _static_addresses(p.fields, p.group_fields, [p.k_group, p.valid_bits()])
            consts.append((p.fmt.code, s.k, s.v))
        self._attended[layer] = (raw, want, b, tabs, srcs, tuple(consts))
        return tabs, srcs, tuple(consts)


def _static_addresses(*groups: list[torch.Tensor]) -> None:
    """Under CUDA graphs, a pool's tensors are the program's static inputs: a graph writes and reads them where
    they are (a mutated input that is not static would turn the graphs off, any other would be copied each
    replay). Not guarded: a new cache's pools (the bench makes a core per run) re-record the graphs, they do not
    recompile the program."""
    for group in groups:
        for t in group:
            if cuda_graphs(t.device):
                torch._dynamo.mark_static_address(t, guard=False)


def _same_storage(pool, entry: tuple) -> bool:
    """``entry`` (a write or source tuple) still holds ``pool``'s tensors."""
    return entry[0] is pool.fields and entry[1] is pool.group_fields and entry[2] is pool.k_group and \
        (len(entry) < 8 or entry[3] is pool.valid_bits())


def _every_format(cache: KVCacheManager, layer: int, tables: list[tuple], b: int) -> list[tuple]:
    """``tables`` followed by an empty table (-1) of each of the layer's other pools: a batch whose requests hold
    no page of some format replays the program of the batches that do (a format's attention over no page adds
    exp(-inf) = 0 terms last in the log-sum-exp merge, which change no bit of it)."""
    have = {p.fmt.name for p, _ in tables}
    return tables + [(p, torch.full((b, 2), -1, dtype=torch.int32, device=p.device))
                     for name, p in cache.pools[layer].items() if name not in have]


def _standard_strides(t: torch.Tensor) -> torch.Tensor:
    """``t`` (contiguous) with the row-major strides of its shape, size-1 dimensions included."""
    return t.reshape(-1).view(t.shape) if t.is_contiguous() else t.contiguous()


def _on(device: torch.device, a: np.ndarray) -> torch.Tensor:
    t = torch.from_numpy(np.ascontiguousarray(a))
    return t if device.type == "cpu" else t.to(device)


# CUDA graphs: block tables padded to a multiple of this many pages, so a batch's graph is recorded once a bucket
# of widths rather than at every page boundary (-1 entries hold no page: dead columns to the kernel and the
# statistics alike)
TABLE_BUCKET_PAGES = 32


def cuda_graphs(device: torch.device) -> bool:
    """Whether programs on ``device`` replay CUDA graphs (inductor's ``triton.cudagraphs``): on CUDA unless
    ``TRTKV_CUDA_GRAPHS=0``."""
    return device.type == "cuda" and os.environ.get("TRTKV_CUDA_GRAPHS", "1") != "0"


def _dynamic_table(bt: torch.Tensor, b: int) -> torch.Tensor:
    """A block table whose width (and, above one request, height) the compiled program takes as a dynamic size:
    a width of one page is padded to two (-1: no page), as a size of 1 would be specialized; under CUDA graphs,
    to the next multiple of ``TABLE_BUCKET_PAGES``."""
    width = max(2, -(-bt.shape[1] // TABLE_BUCKET_PAGES) * TABLE_BUCKET_PAGES) if cuda_graphs(bt.device) else 2
    if bt.shape[1] < width:
        bt = torch.cat([bt, bt.new_full((b, width - bt.shape[1]), -1)], 1)
    torch._dynamo.mark_dynamic(bt, 1)
    if b > 1:
        torch._dynamo.mark_dynamic(bt, 0)
    return bt


def device_program(model, num_layers: int, sm_scale: float, ids, cos, sin, pages, slots, writes, buffer, sources,
                   want, queries):
    """One decode step on the device: ``(logits [b, vocab], [(attention logits, lse) of each wanted layer],
    [q of each layer whose queries are wanted])``."""
    x = model.embed(ids)
    ops = plugin_ops.program_ops(x)
    stats, qs = [], []
    for layer in range(num_layers):
        q, k, v = model.qkv(layer, x, cos, sin)
        if queries[layer]:
            qs.append(q.float())
        if buffer is None:
            fields, groups, k_group, code, scale_k, scale_v = writes[layer]
            ops.kv_write(k, v, fields, groups, k_group, pages[layer], slots[layer], -1, code, scale_k, scale_v)
        else:
            ops.residual_append(buffer[0], buffer[1], buffer[2][layer], k, v)
        parts, logits = [], []
        for fields, groups, k_group, valid, table, code, scale_k, scale_v in sources[layer]:
            o, lse, lg = ops.paged_attention(q, fields, groups, k_group, valid, table, code, sm_scale, scale_k,
                                             scale_v, want[layer])
            parts.append((o, lse))
            logits.append(lg)
        out, lse = merge_partials(parts)
        if buffer is not None:  # the buffered tokens merged into the pages' partial, in place
            out, lse = out.contiguous(), lse.contiguous()
            ops.buffer_attention(q, buffer[0], buffer[1], buffer[3], layer, buffer[4][layer], sm_scale, out, lse)
        if want[layer]:
            stats.append((logits[0] if len(logits) == 1 else torch.cat(logits, -1), lse))
        x = model.finish_layer(layer, x, out)
    return model.logits(x), stats, qs


_serial = itertools.count()


# the guards a program drops: on constants and list lengths (the plan's key holds every constant and format a
# program bakes in) and on the model (it owns its programs); together ~1 ms a step at SmolLM2's 30 layers
_DROPPED_GUARDS = frozenset({"CONSTANT_MATCH", "SEQUENCE_LENGTH", "CLOSURE_MATCH", "TYPE_MATCH", "MODULE_MATCH",
                             "BUILTIN_MATCH", "CLASS_MATCH", "NOT_PRESENT_IN_GENERIC_DICT",
                             "EMPTY_NN_MODULE_HOOKS_DICT"})


def _input_guards(entries) -> list[bool]:
    """Which guards a program keeps: its input tensors' metadata, their aliasing, the relations among their dynamic
    sizes and the global state; not those ``_DROPPED_GUARDS`` names nor the model's tensors' metadata."""
    return [e.guard_type not in _DROPPED_GUARDS and not (e.guard_type == "TENSOR_MATCH" and e.name.startswith("_model"))
            for e in entries]


class DeviceStep:
    """The compiled device programs of a model, one per ``StepPlan.key`` (shared by every core on the model: the
    bench and eval make a core per run), and how many of this core's steps ran in them (``graph``) or eagerly
    (``eager``). ``compile=False`` runs the same program uncompiled (eager's arithmetic exactly)."""

    def __init__(self, model, num_layers: int, sm_scale: float, compile: bool = True) -> None:
        self._model = model
        self._num_layers = num_layers
        self._sm_scale = sm_scale
        self._compile = compile
        self._graphs = cuda_graphs(model.model.embed_tokens.weight.device)
        if self._graphs:  # the kernels' persistent buffers, allocated before any graph's private memory pool
            plugin_ops.reserve_graph_state(model.model.embed_tokens.weight.device)
        plugin_ops.load_program_ops(model.model.embed_tokens.weight)
        # the model owns its programs (they close over it): cores come and go, the programs stay compiled
        self._programs: dict[tuple, object] = model.__dict__.setdefault("_device_programs", {}) if compile else {}
        self.counts = {"graph": 0, "eager": 0}
        self.memo = PlanMemo(num_layers)

    def program(self, key: tuple):
        """The compiled program for plans of ``key`` (compiled on its first call)."""
        key = (key, self._num_layers, self._sm_scale)
        fn = self._programs.get(key)
        if fn is None:
            def step(*args, _model=self._model, _n=self._num_layers, _scale=self._sm_scale):
                return device_program(_model, _n, _scale, *args)

            # a code object of its own: dynamo keeps compiled entries per code object (a process may run many
            # engines, each with its own model: sharing one would exhaust its recompile limit)
            step.__code__ = step.__code__.replace(co_name=f"device_step_{next(_serial)}")
            # cpp_wrapper: inductor's C++ launcher calls the kernels and ops without a Python frame between them;
            # on CUDA the program replays a CUDA graph per batch size and table bucket instead
            launch = {"triton.cudagraphs": True} if self._graphs else {"cpp_wrapper": True}
            fn = torch.compile(step, fullgraph=True, dynamic=False, options={
                **launch, "guard_filter_fn": _input_guards}) if self._compile else step
            self._programs[key] = fn
        return fn

    def run(self, plan: StepPlan) -> tuple[torch.Tensor, list[tuple[torch.Tensor, torch.Tensor]], list[torch.Tensor]]:
        fn = self.program(plan.key())
        try:
            write = plan.write
            if self._graphs and self._compile:  # the last step's outputs are consumed: its graph's memory is free
                torch.compiler.cudagraph_mark_step_begin()
            out = fn(plan.ids, plan.cos, plan.sin, None if write is None else write.pages,
                     None if write is None else write.slots, plan.writes, plan.buffer, plan.sources, plan.want,
                     plan.queries)
        except torch._dynamo.exc.TorchDynamoException as e:
            first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise TrtkvError(f"torch.compile of the decode step failed ({first[:200]}); run with --runtime torch") \
                from None
        self.counts["graph"] += 1
        return out


def fill_statistics(step, plan: StepPlan, wants: list[tuple], layer_logits: list, layer_queries: list,
                    num_kv_heads: int, batch_weights: bool = True) -> None:
    """Give a decode step (``EngineCore``'s ``DecodeStep``) the statistics its policy asked for from the program's
    outputs, as the eager layers would have: ``wants[layer]`` is ``(weights, sparsity, queries, any)`` flags per
    request; ``batch_weights``: the policy's (``KVPolicy.batch_weights``)."""
    found, found_q = iter(layer_logits), iter(layer_queries)
    for layer, (want_w, want_s, want_q, _) in enumerate(wants):
        if plan.want[layer]:
            lg, lse = next(found)
            positions, counts = source_positions(plan.tables[layer], len(step.seqs))
            ls = layer_statistics(lg, lse, np.concatenate(positions, axis=1), num_kv_heads, want_w, want_s,
                                  step.batch is not None, batch_weights=batch_weights, counts=counts)
            if step.batch is not None:
                step.batch[layer] = ls
                continue
            for i, st in enumerate(ls):
                if st is not None:
                    step.stats[i].layers[layer] = st
        if plan.queries[layer]:  # the step's post-RoPE query (Expected Attention's query statistics)
            attach_queries(step.stats, layer, next(found_q), want_q)
