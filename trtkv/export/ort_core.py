"""``OrtEngineCore``: the engine core with ONNX Runtime executing the exported step graphs.

Everything around the forward stays the PyTorch runtime's own: the scheduler, the policy hooks (in the same
order), the sampler, the cache manager's allocation, eviction and accounting. Per decode step the host
reserves the slots of the step's write unit (``trtkv.cache.pending``) and runs the policy's
``before_attention`` for every layer, then runs ``decode_step.onnx`` with the pools, the validity words
(reserved slots cleared: the graph attends the write unit from its own records), the block tables and the
residual buffer; then it stores the returned records of the chosen format into the reserved slots, appends
to the buffer, and builds the attention statistics a policy asked for from the graph's attention logits.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from trtkv.cache.pending import PendingWrite, pending_bits, reserve, store
from trtkv.errors import TrtkvError
from trtkv.export.layout import from_boundary, to_boundary
from trtkv.export.ort_session import StepSessions
from trtkv.policies.base import LayerStats, StepStats
from trtkv.runtime.attention import row_stats
from trtkv.runtime.core import EngineCore
from trtkv.runtime.request import Request


@dataclass
class DecodePlan:
    """One decode step up to the graph run: the batch, its writes reserved, the graph's inputs."""

    reqs: list[Request]
    ctxs: list
    seqs: list
    classes: list
    sreqs: list
    positions: list[int]
    buffered: list[int]  # each request's buffer fill before the step
    units: list[list[list[int]]]  # [layer][request]: the positions of the step's write unit
    pending: list[list[tuple[int, PendingWrite]]]  # [layer]: (request, reserved write)
    feeds: dict = field(default_factory=dict)
    tables: list = field(default_factory=list)  # [layer]: (pool, block table, validity words) per format fed
    want: list = field(default_factory=list)  # [layer][request]: the policy asked for statistics
    force: list = field(default_factory=list)  # [layer]: an observer forces statistics
    stat_layers: list[int] = field(default_factory=list)
    outputs: list[str] = field(default_factory=list)


class OrtEngineCore(EngineCore):
    def __init__(self, *args, sessions: StepSessions, **kwargs):
        super().__init__(*args, **kwargs)
        self.sessions = sessions
        self.layout = sessions.manifest.kv
        if tuple(sorted(self.policy.formats())) != self.layout.formats or self.g != self.layout.group:
            raise TrtkvError(f"the ONNX export in {sessions.dir} stores {', '.join(self.layout.formats)} "
                             f"(group {self.layout.group}); this core's policy needs "
                             f"{', '.join(sorted(self.policy.formats()))} (group {self.g}); re-export")

    def _set_observers(self, observers) -> None:
        if any(o.phase_clock() is not None for o in observers):
            raise TrtkvError("profiling splits the PyTorch runtime's decode step into phases; ONNX Runtime runs "
                             "the step as one graph: profile with --runtime torch")
        super()._set_observers(observers)

    # --- prefill ----------------------------------------------------------------------------
    packs_prefill = False  # the exported prefill graph takes one prompt

    @torch.inference_mode()
    def prefill(self, req: Request) -> None:
        self._begin_prefill_graph(req)
        out = self.sessions.run_prefill(req.prompt_ids)
        self._store_prefill(req, out)
        self.end_prefill(req, torch.from_numpy(out["logits"]), StepStats(step=-1))

    def _begin_prefill_graph(self, req: Request):
        ctx, sreq = self.begin_prefill(req)
        if sreq.weights or sreq.sparsity or sreq.prefill_window:
            raise TrtkvError(f"policy {self.policy.name!r} reads prefill attention statistics, which the ONNX "
                             "prefill graph does not return; run it with --runtime torch")
        return ctx

    def _store_prefill(self, req: Request, out: dict) -> None:
        """Store the prompt's records (groups of g, the last one partial) and buffer its tail when the policy
        keeps the tail in the residual buffer."""
        ctx = req.ctx
        fmt, thought, seg = self.policy.prefill_class(ctx)
        T, g = req.prompt_len, self.g
        positions = list(range(T))
        for layer in range(self.arch.num_hidden_layers):
            slot, group = self._records(out, layer, fmt)
            if g == 1:
                store(reserve(self.cache, ctx.seq, layer, (fmt, thought), positions, seg),
                      [r[:, 0] for r in slot], [])
                continue
            full = T - T % g
            for i in range(full // g):
                w = reserve(self.cache, ctx.seq, layer, (fmt, thought), positions[i * g:(i + 1) * g], seg)
                store(w, [r[i] for r in slot], [r[i] for r in group])
            if full < T:
                if self.policy.flush_prompt_tail():
                    w = reserve(self.cache, ctx.seq, layer, (fmt, thought), positions[full:], seg)
                    store(w, [r[full // g, :T - full] for r in slot], [r[full // g] for r in group])
                else:
                    k, v = torch.from_numpy(out["k"][layer, full:]), torch.from_numpy(out["v"][layer, full:])
                    self.cache.buffer_append(layer, [ctx.seq] * (T - full), k, v, positions[full:])

    def _records(self, out: dict, layer: int, fmt: str) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """A layer's write records in ``fmt``: slot records ``[rows, g, ...]``, group records ``[rows, ...]``
        (host dtypes: bfloat16 back from its int16 bit patterns)."""
        p = f"l{layer}.{fmt}.write."
        return ([from_boundary(out[p + f.name], f.dtype) for f in self.layout.slot_fields(fmt)],
                [from_boundary(out[p + f.name], f.dtype) for f in self.layout.group_fields(fmt)])

    # --- decode -----------------------------------------------------------------------------
    @torch.inference_mode()
    def decode_step(self, reqs: list[Request]) -> None:
        plan = self._plan_decode(reqs)
        out = self.sessions.run_decode(plan.feeds, plan.outputs)
        for layer in range(self.layout.num_layers):
            self._store_layer(out, layer, plan)
        stats, forced = self._graph_stats(out, plan)
        self._end_decode(reqs, torch.from_numpy(out["logits"]), stats, forced)

    def _plan_decode(self, reqs: list[Request]) -> "DecodePlan":
        """Everything up to the graph run: the policy's step hooks, each layer's write reserved and the policy's
        ``before_attention`` (layer by layer, as in torch), the graph's inputs and the outputs to fetch."""
        pol, cache, lay = self.policy, self.cache, self.layout
        ctxs = [r.ctx for r in reqs]
        seqs = [c.seq for c in ctxs]
        pol.on_decode_step_begin_batch(ctxs)
        classes = [pol.write_class(c) for c in ctxs]
        sreqs = pol.stats_requests(ctxs, "decode")
        if any(sr is not None and sr.queries for sr in sreqs):
            raise TrtkvError(f"policy {pol.name!r} reads decode queries, which the ONNX graph does not return; "
                             "run it with --runtime torch")
        positions = [c.position for c in ctxs]
        buffered = [s.buffered(0) for s in seqs]
        # each layer's write unit per request: the token, or the buffer with the token appended (a flush group
        # when full); the graph attends it after the pages
        units = [[list(s.buffered_positions(layer)) + [positions[i]] if self.g > 1 else [positions[i]]
                  for i, s in enumerate(seqs)] for layer in range(lay.num_layers)]
        same_class = all(cl[:2] == classes[0][:2] for cl in classes)
        pending: list[list[tuple[int, PendingWrite]]] = []
        for layer in range(lay.num_layers):  # the step's writes, then the policy, layer by layer (as in torch)
            writes = []
            for i, s in enumerate(seqs):
                if self.g == 1:
                    seg = -1 if same_class else classes[i][2]
                    writes.append((i, reserve(cache, s, layer, classes[i][:2], [positions[i]], seg)))
                elif buffered[i] + 1 >= self.g:
                    writes.append((i, reserve(cache, s, layer, classes[i][:2], units[layer][i], classes[i][2])))
            pending.append(writes)
            pol.before_attention_batch(ctxs, layer)
            for o in self.observers:
                o.before_attention(reqs, layer)
        plan = DecodePlan(reqs, ctxs, seqs, classes, sreqs, positions, buffered, units, pending)
        plan.feeds, plan.tables = self._feeds(reqs, classes, positions, buffered, pending)
        fs = self._forced["decode"]
        plan.want = [[bool(sr and (sr.weights or sr.sparsity) and (sr.layers is None or layer in sr.layers))
                      for sr in sreqs] for layer in range(lay.num_layers)]
        plan.force = [fs is not None and (fs.layers is None or layer in fs.layers) for layer in range(lay.num_layers)]
        plan.stat_layers = [layer for layer in range(lay.num_layers) if plan.force[layer] or any(plan.want[layer])]
        names = ["logits"] + (["k_new", "v_new"] if self.g > 1 else [])
        names += [s.name for layer in range(lay.num_layers) for f in lay.formats
                  for s in lay.write_outputs(layer, f, "batch")]
        plan.outputs = names + [f"l{layer}.attn_logits" for layer in plan.stat_layers]
        return plan

    def _graph_stats(self, out: dict, plan: "DecodePlan") -> tuple[list[StepStats], list[StepStats] | None]:
        """The attention statistics the policy (and observers) asked for, from the graph's attention logits."""
        reqs, ctxs = plan.reqs, plan.ctxs
        fs = self._forced["decode"]
        stats = [StepStats(step=c.step) for c in ctxs]
        forced = [StepStats(step=c.step) for c in ctxs] if fs is not None else None
        for layer in plan.stat_layers:
            for i in range(len(reqs)):
                if not (plan.want[layer][i] or plan.force[layer]):
                    continue
                ls = self._layer_stats(out[f"l{layer}.attn_logits"][i], plan.tables[layer], i, plan.units[layer][i])
                if plan.want[layer][i]:
                    stats[i].layers[layer] = ls
                if plan.force[layer]:
                    forced[i].layers[layer] = ls
        return stats, forced

    def _feeds(self, reqs, classes, positions, buffered, pending):
        """The decode graph's inputs; also, per layer, the ``(format, block table, slot positions)`` fed."""
        lay, cache = self.layout, self.cache
        seqs = [r.ctx.seq for r in reqs]
        feeds = {"input_ids": np.asarray([r.generated[-1] for r in reqs], np.int64),
                 "positions": np.asarray(positions, np.int64)}
        if len(lay.formats) > 1:
            feeds["write_format"] = np.asarray([lay.formats.index(cl[0]) for cl in classes], np.int64)
        if self.g > 1:
            feeds["buffer_k"] = to_boundary(torch.stack([s.buf_k for s in seqs], 1))
            feeds["buffer_v"] = to_boundary(torch.stack([s.buf_v for s in seqs], 1))
            feeds["buffer_len"] = np.asarray(buffered, np.int64)
        tables = []
        for layer in range(lay.num_layers):
            words = pending_bits([w for _, w in pending[layer]])
            bts = {pool.fmt.name: bt.cpu().numpy() for pool, bt in cache.block_tables(layer, seqs)}
            fed = []
            for fmt in lay.formats:
                pool, p = cache.pool(layer, fmt), f"l{layer}.{fmt}."
                # the pools are preallocated (most of them untouched address space): feed the pages handed out
                # so far (page 0 at least: padded block-table entries read it) and the groups handed out
                n, ng = max(pool.fresh, 1), max(pool.group_fresh, 1)
                for f, t in zip(lay.slot_fields(fmt), pool.fields):
                    feeds[p + f.name] = to_boundary(t[:n])
                for f, t in zip(lay.group_fields(fmt), pool.group_fields):
                    feeds[p + f.name] = to_boundary(t[:ng])
                if pool.group_specs:
                    feeds[p + "k_group"] = pool.k_group[:n].numpy()
                valid = words.get(id(pool), pool.valid)[:n]
                bt = bts.get(fmt)
                if bt is None or bt.shape[1] == 0:
                    bt = np.full((len(seqs), 1), -1, np.int32)  # no page of this format: one padded entry
                feeds[p + "valid"] = valid
                feeds[p + "block_table"] = np.ascontiguousarray(bt, np.int32)
                fed.append((pool, bt, valid))
            tables.append(fed)
        return feeds, tables

    def _store_layer(self, out: dict, layer: int, plan: "DecodePlan") -> None:
        """Store one layer's reserved writes from the chosen format's records; append the tokens that did not
        complete a flush group to the residual buffer."""
        seqs = plan.seqs
        writes = plan.pending[layer]
        for i, w in writes:
            slot, group = self._records(out, layer, w.pool.fmt.name)
            n = len(w.pages)
            store(w, [r[i, :n] for r in slot], [r[i] for r in group])
            if self.g > 1:
                self.cache.discard_buffered(seqs[i], layer)  # the group went to pages
        if self.g > 1:
            flushed = {i for i, _ in writes}
            for i, s in enumerate(seqs):
                if i not in flushed:
                    self.cache.buffer_append(layer, [s], torch.from_numpy(out["k_new"][layer, i:i + 1]),
                                             torch.from_numpy(out["v_new"][layer, i:i + 1]), [plan.positions[i]])

    def _layer_stats(self, logits: np.ndarray, fed, i: int, unit: list[int]) -> LayerStats:
        """Attention statistics of request ``i`` in one layer from the graph's logits ``[Hq, keys]``: the keys
        are each format's fed pages (live slots only), then the write unit (``self.g`` wide, -1 padded)."""
        B = self.layout.block_size
        pos = []
        for pool, bt, valid in fed:
            row = bt[i]
            pages = np.maximum(row, 0)
            live = ((valid[pages][:, None] >> np.arange(B)) & 1).astype(bool) & (row >= 0)[:, None]
            pos.append(np.where(live, pool.slot_pos[pages], -1).reshape(-1))
        tail = np.full(self.g, -1, np.int64)
        tail[:len(unit)] = unit
        positions = np.concatenate(pos + [tail])
        keep = positions >= 0
        lg = torch.from_numpy(logits[:, keep].copy())
        w, sh, u = row_stats(lg, torch.logsumexp(lg, -1), self.layout.num_kv_heads)
        return LayerStats(positions=positions[keep], weights=w, logits=lg, sparsity_heads=sh, sparsity=u)
