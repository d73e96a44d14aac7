"""The decode engine: prefill and batched decode over trtkv's paged cache, driven by a policy.

Per decode step and layer (ThinKV's order, spec §3.4): project QKV with RoPE at the true absolute
position, append to the residual buffer (or write through), flush a full buffer as one quantized
group, let the policy act (``before_attention``), then attend over pages + buffer.
"""
from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Sequence

import numpy as np
import torch

from plugins import backend as plugin_backend
from trtkv.cache.manager import CacheConfig, KVCacheManager, fp16_bytes_per_token
from trtkv.cache.budget import useful_pages
from trtkv.cache.flush import FlushPlan
from trtkv.cache.tiers import tier_stats
from trtkv.cache.write_plan import WritePlan
from trtkv.distributed.group import HeadShards
from trtkv.models.decoder import DecoderModel
from trtkv.policies.base import KVPolicy, StatsRequest, StepBatch, StepStats
from trtkv.runtime.attention import attach_queries, decode_attention, resolve_positions
from trtkv.runtime.context import RequestContext
from trtkv.runtime.device_step import DeviceStep, fill_statistics, plan_step
from trtkv.runtime.prefill import prefill_packed
from trtkv.runtime.observers import EngineObserver, PhaseClock, merge_stats_requests
from trtkv.runtime.request import GenerationResult, IncrementalDetokenizer, Request
from trtkv.runtime.sampling import sample_next
from trtkv.runtime.staging import HostStaging


# CPU: a decode layer whose attention reads at least this many live (token, KV head) pairs runs on all intra-op
# threads; below it, on one (waking the OpenMP pool costs more than it saves). The CPU kernel's own serial threshold
# (SERIAL_SLOT_HEADS): a budget-256 batch of 16 (~12k pairs) is 1.8x faster per call on 2 threads than on
# one. Measured: docs/benchmarks.md.
PARALLEL_ATTENTION_SLOTS = 4096


@dataclasses.dataclass
class DecodeStep:
    """What one decode step carries from ``begin_decode`` through each ``decode_layer`` to ``end_decode``."""
    reqs: list[Request]
    ctxs: list[RequestContext]
    seqs: list
    positions: list[int]
    classes: list
    sreqs: list[StatsRequest | None]
    ids: torch.Tensor
    cos: torch.Tensor
    sin: torch.Tensor
    stats: list[StepStats]
    forced_req: StatsRequest | None
    forced: list[StepStats] | None
    batch: dict | None = None  # the policy's statistics in batch form (layer -> BatchLayerStats), when it takes them
    write_cls: tuple | None = None  # the (format, thought) every request writes this step, None when they differ
    wants: tuple | None = None  # (weights, sparsity, queries) flags per request when no request names its layers
    threads: int = 1  # the caller's intra-op threads (decode_layer narrows them for the small ops)
    attn_slots: int = 0  # live (token, KV head) pairs the step's attention reads, per layer (layer 0's)
    plan: WritePlan | None = None  # every layer's write-through slots, allocated when layer 0 writes
    buffer_plan: torch.Tensor | None = None  # every layer's residual-buffer slots, recorded when layer 0 appends
    acts: bool = True  # the policy's before_attention_batch does something this step (asked once, after its begin)
    deferred: list | None = None  # batch form: layers whose positions are read at the step's end (resolve_positions)
    flush_all: tuple[list, list] | None = None  # the write classes and segments of a flush of every request
    flush_plan: FlushPlan | None = None  # every layer's pages for that flush, taken when layer 0 flushes
    # nothing done between two layers' buffer appends and flushes touches another layer's (the policy does nothing
    # before attention, or only evicts in place in the layer it is given): both may be planned for every layer
    layers_apart: bool = True


class EngineCore:
    """One model, one policy, one KV cache. Tools watch it through ``observers`` (see runtime/observers.py)."""

    def __init__(self, model: DecoderModel, policy: KVPolicy, cache_cfg: CacheConfig, eos_ids: list[int],
                 decode_text, kv_amax=None, observers: Sequence[EngineObserver] = (),
                 shards: HeadShards | None = None, graph: bool = False):
        """``shards`` (tensor parallelism): this rank's KV heads of the model's; ``model`` then computes this
        rank's slice and ``cache_cfg`` holds its heads (trtkv/models/sharding.py). ``graph`` (``--runtime
        graph``): steady decode steps run as one compiled device program (trtkv/runtime/device_step.py)."""
        self.model = model
        self.shards = shards
        self.arch = model.arch
        self.policy = policy
        policy.bind_model(self.arch)
        self.cache = KVCacheManager(cache_cfg, kv_amax, policy.pool_formats(), policy.drops_tokens(),
                                    useful_pages(policy, cache_cfg, self.arch.max_position_embeddings))
        self.staging = HostStaging(self.cache)  # host tiers (T1/T2) -> device, per layer (runtime/staging.py)
        self.eos_ids = set(eos_ids)
        self.decode_text = decode_text  # ids -> str
        self.device = model.model.embed_tokens.weight.device
        self.dtype = model.model.embed_tokens.weight.dtype
        self.sm_scale = 1.0 / math.sqrt(self.arch.head_dim)
        self.g = cache_cfg.residual_group
        self.steps_total = 0
        self.next_fork_id = 1 << 40  # ids of forked requests (runtime/forking.py), apart from the API's
        # CPU only: run the per-layer small ops (cache writes, decode attention) on one thread
        self.small_ops_threads = 1 if self.device.type == "cpu" else 0
        self.observers: tuple[EngineObserver, ...] = ()
        self._forced: dict[str, StatsRequest | None] = {"decode": None}
        self.clock: PhaseClock | None = None  # an observer's decode-step profile clock (trtkv bench --profile)
        self.device_step = DeviceStep(model, self.arch.num_hidden_layers, self.sm_scale) if graph else None
        self._observers_watch_layers = False
        for o in observers:
            self.attach(o)

    def attach(self, observer: EngineObserver) -> None:
        """Start notifying ``observer`` (tests and tools watching a live engine; see runtime/observers.py)."""
        self._set_observers((*self.observers, observer))

    def detach(self, observer: EngineObserver) -> None:
        self._set_observers(tuple(o for o in self.observers if o is not observer))

    def _set_observers(self, observers: tuple[EngineObserver, ...]) -> None:
        clocks = [c for c in (o.phase_clock() for o in observers) if c is not None]
        if len(clocks) > 1:
            raise ValueError("at most one observer may profile the decode step")
        self.observers = observers
        self._observers_watch_layers = any(type(o).before_attention is not EngineObserver.before_attention
                                           for o in observers)
        # observers' attention statistics are forced at decode steps only (prefill hands them the policy's)
        self._forced = {"decode": merge_stats_requests([o.stats_request("decode") for o in observers])}
        self.clock = self.cache.clock = clocks[0] if clocks else None

    # --- prefill ----------------------------------------------------------------------------
    def begin_prefill(self, req: Request) -> tuple[RequestContext, StatsRequest]:
        """The request's cache sequence and context, the policy's ``begin``, its prefill statistics request."""
        seq = self.cache.add_sequence(req.req_id)
        ctx = self.new_context(req.req_id, req.prompt_len, seq)
        req.ctx = ctx
        self.policy.begin(ctx)
        return ctx, self.policy.stats_request(ctx, "prefill") or StatsRequest()

    def new_context(self, req_id: int, prompt_len: int, seq) -> RequestContext:
        """The request API over ``seq`` (a request's, or a fork's, cache sequence)."""
        return RequestContext(req_id, prompt_len, self.cache, seq, self.arch.num_hidden_layers,
                              self.arch.num_attention_heads, self.shards)

    def sample(self, logits: torch.Tensor, params, gens, contexts) -> list[int]:
        """``sample_next`` of the batch; under tensor parallelism rank 0's draws, so every rank decodes alike."""
        toks = sample_next(logits, params, gens, contexts)
        return toks if self.shards is None else self.shards.agree(toks)

    def end_prefill(self, req: Request, logits: torch.Tensor, stats: StepStats) -> None:
        """After the prompt is in the cache: observers, the first sampled token, the policy's prefill end."""
        self.end_prefill_many([req], logits, [stats])

    def end_prefill_many(self, reqs: list[Request], logits: torch.Tensor, stats: list[StepStats]) -> None:
        """``end_prefill`` of prompts prefilled together (``logits[i]``: ``reqs[i]``'s last row), the policy's prefill
        end in one call for them all (its cuts of the prompts at once)."""
        for i, req in enumerate(reqs):
            req.last_logits = logits[i]  # what a fork of this request samples its first token from
            for o in self.observers:
                o.on_prefill(req, logits[i:i + 1], stats[i])
            tok = self.sample(logits[i:i + 1], [req.params], [req.generator], [req.prompt_ids])[0]
            req.t_first = time.perf_counter()
            req.ctx.step = 0
            self._append_token(req, tok)
        self.policy.on_prefill_end_batch([req.ctx for req in reqs], stats)
        for req in reqs:
            req.peak_live_tokens = max(req.peak_live_tokens, req.ctx.num_live(0))

    def prefill(self, req: Request) -> None:
        """``req``'s prompt into the cache and its first token sampled."""
        prefill_packed(self, [req])

    # whether ``prefill_many`` runs its prompts as one pass (a runtime that prefills its own way says no: the
    # scheduler then prefills one request at a time)
    packs_prefill = True

    def prefill_many(self, reqs: list[Request]) -> None:
        """Several prompts in one packed pass (runtime/prefill.py); on an exception the caller ``unprefill``s
        each of ``reqs`` (none has sampled a token yet)."""
        prefill_packed(self, reqs)

    def store_prompt(self, seq, layer, k, v, positions, cls, seg) -> None:
        """One prompt's K/V of ``layer``: whole quantization groups written, the tail flushed or buffered."""
        g = self.g
        if g == 1:
            self.cache.write(seq, layer, k, v, positions, cls, seg)
            return
        T = len(positions)
        full = T - T % g
        if full:
            self.cache.write_groups(seq, layer, k[:full].float(), v[:full].float(), positions[:full], cls, seg, g)
        if full < T:
            if self.policy.flush_prompt_tail():
                self.cache.write(seq, layer, k[full:].float(), v[full:].float(), positions[full:], cls, seg)
            else:
                self.cache.buffer_append(layer, [seq] * (T - full), k[full:], v[full:], positions[full:])

    # --- decode -----------------------------------------------------------------------------
    @torch.inference_mode()
    def decode_step(self, reqs: list[Request]) -> None:
        """One batched decode step: the dense layers and the attention of this core's own model. ``clk``
        (``trtkv bench --profile``, else None) is told where model, attention, kv_write and policy work begin
        and end; with no profiler each site is one ``is None``."""
        with plugin_backend.pinned_mode():
            self._decode_step(reqs)

    def _decode_step(self, reqs: list[Request]) -> None:
        clk = self.clock
        step = self.begin_decode(reqs)
        try:
            logits = self._graph_step(step) if self.device_step is not None else None
            if logits is not None:
                self.end_decode(step, logits)
                return
            if clk is not None:
                clk.switch("model")
            x = self.model.embed(step.ids)
            for layer in range(self.arch.num_hidden_layers):
                if clk is not None:
                    clk.switch("model")
                q, k, v = self.model.qkv(layer, x, step.cos, step.sin)
                out = self.decode_layer(step, layer, q, k, v)
                if clk is not None:
                    clk.switch("model")
                x = self.model.finish_layer(layer, x, out)
            logits = self.model.logits(x)
            if clk is not None:
                clk.switch("bookkeeping")
        except BaseException:  # e.g. a full pool (OutOfKVMemory): the scheduler undoes the step and reruns it
            self.abort_decode(step)
            raise
        self.end_decode(step, logits)

    def _graph_step(self, step: DecodeStep) -> torch.Tensor | None:
        """The step as the compiled device program (trtkv/runtime/device_step.py): its logits, the policy's
        statistics filled in; None (nothing done) when the host plan does not cover it: then it runs eagerly."""
        clk, L = self.clock, self.arch.num_hidden_layers
        wants = [step.wants if step.wants is not None else self._wants(step.sreqs, layer) for layer in range(L)]
        plan = None
        want = tuple(any(w[0]) or any(w[1]) for w in wants)  # layers whose statistics the policy reads
        queries = tuple(any(w[2]) for w in wants)
        if ((step.write_cls is not None if self.g == 1 else not any(want) and not any(queries))
                and not self.cache.has_tiers and self.shards is None and step.forced is None
                and not self._observers_watch_layers and not step.acts):
            plan = plan_step(self.cache, step.seqs, step.positions, step.write_cls, step.ids, step.cos, step.sin,
                             want, queries, self.device_step.memo)
        if plan is None:
            self.device_step.counts["eager"] += 1
            return None
        if clk is not None:
            clk.switch("model")
        logits, layer_logits, layer_queries = self.device_step.run(plan)
        if clk is not None:
            clk.switch("policy")
        fill_statistics(step, plan, wants, layer_logits, layer_queries, self.cache.cfg.num_kv_heads,
                        self.policy.batch_weights)
        return logits

    def abort_decode(self, step: DecodeStep) -> None:
        """Release what ``begin_decode`` staged when a step fails part-way."""
        self.staging.end_step()
        if self.clock is not None:
            self.clock.stop()

    # The three phases below let a caller run the dense layers itself, e.g. once over several cores that share
    # one model's weights (``trtkv.eval.lockstep``); everything the cache and policy do stays in this core.
    def begin_decode(self, reqs: list[Request]) -> DecodeStep:
        clk = self.clock
        if clk is not None:
            clk.start()
            clk.switch("policy")
        ctxs = [r.ctx for r in reqs]
        self.policy.on_decode_step_begin_batch(ctxs)
        classes = self.policy.write_classes(ctxs)
        sreqs = self.policy.stats_requests(ctxs, "decode")
        if clk is not None:
            clk.switch("bookkeeping")
        positions = [c.position for c in ctxs]
        cos, sin = self.model.rotary.cos_sin_at(np.fromiter(positions, np.int64, len(positions)), self.dtype)
        fs = self._forced["decode"]
        step = DecodeStep(reqs=reqs, ctxs=ctxs, seqs=[c.seq for c in ctxs], positions=positions, classes=classes,
                          sreqs=sreqs, ids=torch.from_numpy(np.fromiter((r.generated[-1] for r in reqs), np.int64,
                                                                        len(reqs))).to(self.device),
                          cos=cos, sin=sin, stats=[StepStats(step=c.step) for c in ctxs], forced_req=fs,
                          forced=[StepStats(step=c.step) for c in ctxs] if fs is not None else None,
                          acts=self.policy.acts_before_attention(ctxs))
        step.layers_apart = not step.acts or (self.policy.acts_in_own_layer
                                               and self.cache.evictions_stay_in_layer(step.seqs))
        first = classes[0][:2] if classes else None
        step.write_cls = first if all(cl[:2] == first for cl in classes) else None
        if not any(sr is not None and sr.layers is not None for sr in sreqs):  # the same flags in every layer
            step.wants = self._wants(sreqs, 0)
            if self._batch_form(step):
                step.batch = StepBatch(top=max(positions, default=-1))
                for i, st in enumerate(step.stats):
                    st.batch, st.row = step.batch, i
                if not step.acts:  # (nothing changes a layer's slots after its attention)
                    step.deferred = []
        if self.small_ops_threads:  # only CPU narrows threads (decode_layer), so only CPU needs the size
            step.threads = torch.get_num_threads()
            step.attn_slots = int(self.cache.num_live_many(step.seqs, 0).sum()) * self.arch.num_key_value_heads
        self.staging.begin_step(step.seqs)
        return step

    def decode_layer(self, step: DecodeStep, layer: int, q: torch.Tensor, k: torch.Tensor,
                     v: torch.Tensor) -> torch.Tensor:
        """Write this layer's new K/V, let the policy act, attend; returns the attention output."""
        if self.clock is not None:
            self.clock.switch("bookkeeping")
        threads = step.threads
        # writes, eviction and short decode attention are small ops: OpenMP fan-out costs more than it gains on
        # CPU. A long batch's layer keeps every core: its attention splits sequences x heads x pages, and its
        # flushes and anneals (k-means, key reads) are batch-sized too; ops below their grain stay serial.
        narrow = self.small_ops_threads and step.attn_slots < PARALLEL_ATTENTION_SLOTS
        if narrow:
            torch.set_num_threads(self.small_ops_threads)
        try:
            return self._decode_layer(step, layer, q, k, v, narrow)
        finally:
            if narrow:
                torch.set_num_threads(threads)

    def _decode_layer(self, step: DecodeStep, layer: int, q: torch.Tensor, k: torch.Tensor,
                      v: torch.Tensor, narrow: bool) -> torch.Tensor:
        pol, cache, seqs, positions, classes, clk = (self.policy, self.cache, step.seqs, step.positions,
                                                     step.classes, self.clock)
        if self.g == 1:
            if step.write_cls is not None:
                # every layer's slots at once when nothing the policy does between two layers' writes changes another
                # layer's tables (trtkv/cache/write_plan.py; host tiers change only at a policy's events and
                # before_attention, and staging reads them without touching the device's tables)
                if layer == 0 and step.plan is None and not step.acts:
                    step.plan = cache.plan_write_through(seqs, positions, step.write_cls)
                if step.plan is not None:
                    cache.write_planned(step.plan, layer, k, v)
                else:
                    cache.write_through(layer, seqs, k, v, positions, step.write_cls)
            else:
                for i, s in enumerate(seqs):
                    cache.write(s, layer, k[i:i + 1], v[i:i + 1], [positions[i]], classes[i][:2], classes[i][2])
        else:
            if layer == 0 and step.buffer_plan is None and step.layers_apart:
                # every layer's buffer slots at once when no buffer fills up this step (no flush: nothing between
                # two layers' appends reads another layer's buffer)
                step.buffer_plan = cache.plan_buffer_append(seqs, positions)
            if step.buffer_plan is not None:
                cache.buffer_append_planned(step.buffer_plan, layer, k, v)
                full = []
            else:
                cache.buffer_append(layer, seqs, k, v, positions)
                full = np.flatnonzero(cache.buffered_many(seqs, layer) >= self.g).tolist()
            if full:  # the batch's buffers fill on the same step: one batched flush, on every thread
                if narrow:
                    torch.set_num_threads(step.threads)
                try:
                    if len(full) == len(seqs):  # (every request, every layer: the step's lists, made once)
                        if step.flush_all is None:
                            step.flush_all = ([c[:2] for c in classes], [c[2] for c in classes])
                        if layer == 0 and step.layers_apart:  # (see plan_flush)
                            step.flush_plan = cache.plan_flush(seqs, step.flush_all[0], charge_each_layer=step.acts)
                        cache.flush_many(layer, seqs, *step.flush_all, plan=step.flush_plan)
                    else:
                        cache.flush_many(layer, [seqs[i] for i in full], [classes[i][:2] for i in full],
                                         [classes[i][2] for i in full])
                finally:
                    if narrow:
                        torch.set_num_threads(self.small_ops_threads)
        if step.acts:  # (a step where the policy does nothing before attention: no call a layer)
            if clk is not None:
                clk.switch("policy")
            pol.before_attention_batch(step.ctxs, layer)
            if clk is not None:
                clk.switch("bookkeeping")
        for o in self.observers:
            o.before_attention(step.reqs, layer)
        fs = step.forced_req
        want_w, want_s, want_q, any_want = step.wants if step.wants is not None else self._wants(step.sreqs, layer)
        force = step.forced is not None and (fs.layers is None or layer in fs.layers)
        staged = self.staging.sources(layer, self.arch.num_hidden_layers)
        out, lstats = decode_attention(cache, layer, seqs, q, self.sm_scale,
                                       [True] * len(seqs) if force else want_w,
                                       [True] * len(seqs) if force and fs.sparsity else want_s, staged, clk,
                                       batch_form=step.batch is not None, shards=self.shards,
                                       batch_weights=self.policy.batch_weights, deferred=step.deferred,
                                       staged_positions=self.staging.positions if staged else None)
        if staged is not None:
            self.staging.release(layer)
        if step.batch is not None:
            step.batch[layer] = lstats
            return out
        if not (any_want or force):
            return out
        if self.shards is not None and any(want_q):
            q = self.shards.gather(q, 1)
        for i, ls in enumerate(lstats):
            if ls is not None:
                if want_w[i] or want_s[i]:  # a policy sees only the layers it asked for, forced or not
                    step.stats[i].layers[layer] = ls
                if force:
                    step.forced[i].layers[layer] = ls
        if any(want_q):  # the step's post-RoPE query (Expected Attention's, AMS's query statistics)
            attach_queries(step.stats, layer, q, want_q)
        return out

    def _batch_form(self, step: DecodeStep) -> bool:
        """Whether this step's statistics go to the policy in batch form: it takes them so, every request asks for
        the weights alone in every layer, nothing is buffered (g = 1) and no observer forces statistics."""
        want_w, want_s, want_q, _ = step.wants
        return (self.policy.batch_stats and self.g == 1 and step.forced_req is None and all(want_w)
                and not any(want_s) and not any(want_q))

    @staticmethod
    def _wants(sreqs: list[StatsRequest | None], layer: int) -> tuple[list[bool], list[bool], list[bool], bool]:
        """Which requests asked for attention weights, sparsity and the query in ``layer``, and whether any did."""
        def flags(sr: StatsRequest | None) -> tuple[bool, bool, bool]:
            on = sr is not None and (sr.layers is None or layer in sr.layers)
            return (bool(sr.weights), bool(sr.sparsity), bool(sr.queries)) if on else (False, False, False)

        first = sreqs[0] if sreqs else None
        if all(sr is first for sr in sreqs):  # (one shared request, the usual step: its flags once)
            w, sp, q = flags(first)
            return [w] * len(sreqs), [sp] * len(sreqs), [q] * len(sreqs), w or sp or q
        want_w, want_s, want_q = (list(f) for f in zip(*map(flags, sreqs)))
        return want_w, want_s, want_q, any(want_w) or any(want_s) or any(want_q)

    def end_decode(self, step: DecodeStep, logits: torch.Tensor) -> None:
        """Observers, sampling (or the forced token), the policy's end-of-step hook."""
        if self.clock is not None:
            self.clock.switch("bookkeeping")
        if step.deferred:
            resolve_positions(self.cache, step.batch, step.deferred)
        self.staging.end_step()
        self._end_decode(step.reqs, logits, step.stats, step.forced)

    def _end_decode(self, reqs: list[Request], logits: torch.Tensor, stats: list[StepStats],
                    forced: list[StepStats] | None) -> None:
        """After a decode step's forward (this core's, a lockstep one, or an exported graph's)."""
        pol, clk = self.policy, self.clock
        ctxs = [r.ctx for r in reqs]
        for o in self.observers:
            o.on_decode(reqs, logits, forced if forced is not None else stats)
        params = [r.params for r in reqs]
        contexts = ([r.prompt_ids + r.generated if p.repetition_penalty != 1.0 else [] for r, p in zip(reqs, params)]
                    if any(p.repetition_penalty != 1.0 for p in params) else None)  # (only a penalty reads them)
        toks = self.sample(logits, params, [r.generator for r in reqs], contexts)
        self.steps_total += 1
        seqs = [c.seq for c in ctxs]
        attended = self.cache.num_live_many(seqs, 0).tolist()  # what this step attended
        for i, (r, c, tok, n) in enumerate(zip(reqs, ctxs, toks, attended)):
            r.set_step_logits(logits, i)
            r.decode_steps += 1
            c.step += 1
            self._append_token(r, tok)
            if n > r.peak_live_tokens:
                r.peak_live_tokens = n
        if clk is not None:
            clk.switch("policy")
        pol.on_decode_step_end_batch(ctxs, stats)  # one call: a policy may batch its evictions over requests
        if clk is not None:
            clk.switch("bookkeeping")
        for r, n in zip(reqs, self.cache.num_live_many(seqs, 0).tolist()):
            if n > r.peak_live_tokens:
                r.peak_live_tokens = n
        if self.cache.has_tiers:
            self.cache.tiers.note_peaks_many(seqs)
        for o in self.observers:
            o.on_step_end(reqs)
        if clk is not None:
            clk.stop()

    # --- tokens, stop conditions, results ---------------------------------------------------
    def _append_token(self, req: Request, tok: int) -> None:
        if req.forced_tokens is not None and len(req.generated) < len(req.forced_tokens):
            tok = req.forced_tokens[len(req.generated)]  # teacher forcing: the trace's token, not the sampled one
        req.generated.append(tok)
        p = req.params
        if tok in self.eos_ids and not p.ignore_eos:
            req.generated.pop()  # EOS is not part of the text
            req.finish_reason = "stop"
        else:
            if req.detok is None:
                req.detok = IncrementalDetokenizer(self.decode_text)
            for s in p.stop:  # (only stop strings need the text every step)
                at = req.text.find(s, max(0, req.emitted_chars - len(s)))
                if at >= 0:
                    req.cut_text(at)
                    req.finish_reason = "stop"
                    break
        if req.finish_reason is None and len(req.generated) >= req.max_new:
            req.finish_reason = "length"

    def abort(self, req: Request, message: str) -> GenerationResult:
        """Fail ``req`` with one line: free whatever its prefill or decode got to hold, give it an error result."""
        req.finish_reason = "error"
        req.error = message
        if req.ctx is not None and req.req_id in self.cache.seqs:
            return self.finish(req)
        if req.req_id in self.cache.seqs:
            self.cache.free_sequence(req.req_id)
        req.t_end = time.perf_counter()
        req.result = GenerationResult(req.text, list(req.generated), "error", {}, req.prompt)
        return req.result

    def unprefill(self, req: Request) -> None:
        """Take back a prefill that failed part-way (its pages, its policy state) so it can run again."""
        if req.ctx is not None:
            self.policy.end(req.ctx)
            req.ctx = None
        if req.req_id in self.cache.seqs:
            self.cache.free_sequence(req.req_id)

    def undo_step(self, reqs: list[Request]) -> None:
        """Take back what a failed decode step wrote for ``reqs`` (the token at their current position, in
        whichever layers got it, paged or buffered) so the step can run again. Evictions the policy made in
        the failed step stay made; its step hooks run again."""
        for r in reqs:
            seq, pos = r.ctx.seq, r.ctx.position
            for layer in range(self.arch.num_hidden_layers):
                self.cache.rollback(seq, layer, pos)

    def finish(self, req: Request) -> GenerationResult:
        """Collect stats, run the policy's finish hook and free the request's pages at once."""
        return self.finish_many([req])[0]

    def finish_many(self, reqs: list[Request]) -> list[GenerationResult]:
        """``finish`` of several requests (a batch finishing together); their pages go back in one pass
        (``KVCacheManager.free_sequences``)."""
        done = []
        try:
            for r in reqs:
                done.append(r)
                self._finish_one(r)
        finally:  # (an observer that raised still frees its request, as those before it; the rest stay as they are)
            self.cache.free_sequences([r.req_id for r in done if r.req_id in self.cache.seqs])
        return [r.result for r in reqs]

    def _finish_one(self, req: Request) -> GenerationResult:
        req.t_end = time.perf_counter()
        seq = req.ctx.seq
        tokens_held = req.prompt_len + len(req.generated)
        elapsed = (req.t_end - req.t_first) if req.t_first else 0.0
        stats = {
            "prompt_tokens": req.prompt_len,
            "generated_tokens": len(req.generated),
            "kv_bytes": self.cache.seq_bytes(seq),
            # (this rank's heads under tensor parallelism, as kv_bytes)
            "kv_bytes_full": tokens_held * fp16_bytes_per_token(self.arch.num_hidden_layers,
                                                                self.cache.cfg.num_kv_heads, self.arch.head_dim),
            "peak_kv_bytes": seq.peak_bytes,
            "tokens_per_s": (req.decode_steps / elapsed) if elapsed > 0 else 0.0,
            "live_tokens": req.ctx.num_live(0),
            "peak_live_tokens": req.peak_live_tokens,
            "pages": sum(len(p) for p in seq.layers[0].pages.values()),
            "evicted_tokens": seq.evicted_tokens // max(1, self.arch.num_hidden_layers),
            "time_to_first_token_s": (req.t_first - req.t_submit) if req.t_first else None,
        }
        # per-tier bytes and tokens, transfers (cache/tiers.py; asking a cache without host tiers makes none)
        L = self.arch.num_hidden_layers
        stats.update(self.cache.tiers.stats(seq) if self.cache.has_tiers else tier_stats(seq, L))
        if seq.fork_mode is not None:  # pages shared with other live sequences (counted once per engine)

            stats["kv_bytes_shared"] = self.cache.shared_bytes(seq)
            stats["sample_index"] = req.sample_index
        stats.update(self.policy.extra_stats(req.ctx))
        req.result = GenerationResult(req.text, list(req.generated), req.finish_reason or "cancelled", stats,
                                      req.prompt)
        try:
            for o in self.observers:
                o.on_finish(req, req.result)
        finally:
            self.policy.end(req.ctx)
        return req.result
