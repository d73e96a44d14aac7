"""Python API: ``Engine.load(path)``, ``engine.generate(prompts, SamplingParams(...))``, ``engine.stream(...)``,
and a thread-safe ``submit`` with a background scheduler loop for servers (continuous batching)."""
from __future__ import annotations

import json
import os
import queue
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

import plugins  # noqa: F401  (registers torch.ops.trtkv.*)
from trtkv.artifacts.engine_dir import read_manifest, verify_quantized_weights, verify_weights
from trtkv.artifacts.manifest import EngineManifest
from trtkv.cache.manager import CacheConfig
from trtkv.distributed.group import HeadShards, RankLost, group_for
from trtkv.errors import TrtkvError
from trtkv.models.config import ModelArch
from trtkv.models.cpu_dtype import cpu_compute_dtype
from trtkv.models.loader import build_model, parse_dtype
from trtkv.policies import make_policy
from trtkv.runtime.core import EngineCore
from trtkv.runtime.request import GenerationResult, Request, StreamEvent
from trtkv.runtime.sampling import SamplingParams, make_generator
from trtkv.runtime.scheduler import Scheduler
from trtkv.runtime.server_turns import RequestSpec, Tick, drain
from trtkv.tokenizer import load_tokenizer

# what executes the model steps (docs/deploy.md for onnxruntime; trtkv/runtime/device_step.py for graph)
RUNTIMES = ("torch", "torch-compile", "graph", "onnxruntime")
# the rest are fixed when the engine is built
LOAD_TIME_CACHE_SETTINGS = ("max_batch", "max_pages", "kv_memory", "kv_memory_fraction", "demote", "host_kv_memory")

__all__ = ["Engine", "SamplingParams", "GenerationResult", "StreamEvent", "RequestHandle"]


class RequestHandle:
    """Iterate for ``StreamEvent``s of one submitted request (blocks until the next tokens)."""

    def __init__(self, req: Request, on_cancel=None):
        self._req = req
        self._on_cancel = on_cancel  # the engine's, when a cancel must wait for its loop (tensor parallelism)

    @property
    def request_id(self) -> int:
        return self._req.req_id

    def __iter__(self) -> Iterator[StreamEvent]:
        while True:
            ev = self._req.events.get()
            yield ev
            if ev.finished:
                return

    def cancel(self) -> None:
        if self._on_cancel is not None:
            self._on_cancel(self._req)
        else:
            self._req.cancelled = True

    def result(self) -> GenerationResult:
        for ev in self:
            if ev.finished:
                if ev.error:
                    raise TrtkvError(ev.error)
                return ev.result
        raise TrtkvError("request ended without a result")


def _quantized_dense(path: Path, manifest: EngineManifest, model):
    """The quantized decoder over ``model`` (``--weights int8|int4``): the engine's stored codes, checked against
    the manifest; synthetic weights are drawn at load, so they are quantized then."""
    from trtkv.models.quantized_weights import load_quantized, quantize, quantized_decoder

    mm = manifest.model
    fmt, group = mm.weights, mm.group_size
    if mm.synthetic:
        return quantized_decoder(model, fmt, f"synthetic:{mm.synthetic_seed}:{group}",
                                 lambda: quantize(model, fmt, group))
    f = verify_quantized_weights(path, manifest)
    return quantized_decoder(model, fmt, mm.quantized_sha256, lambda: load_quantized(f, model, fmt, group))


class Engine:
    def __init__(self, path: Path, manifest: EngineManifest, model, tokenizer, policy, cache_cfg: CacheConfig,
                 max_batch: int, kv_amax=None, runtime: str = "torch", onnx_dir: str | Path | None = None,
                 pack_weights: bool | None = None, shard=None):
        """``shard`` (tensor parallelism): ``(plan, group)``, ``model`` being this rank's slice of the model
        (trtkv/models/sharding.py)."""
        self.path = path
        self.manifest = manifest
        self.model = model
        self.tokenizer = tokenizer
        self.policy = policy
        self.arch: ModelArch = manifest.model.arch if shard is not None else model.arch
        self.eos_ids = list(self.arch.eos_token_id) + (
            [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else [])
        self.cache_cfg = cache_cfg
        self.kv_amax = kv_amax
        self.runtime = runtime
        # the model the cores run: torch-compile compiles its dense layer pieces (trtkv/models/compiled.py);
        # torch on CPU multiplies oneDNN-packed copies of the weights (trtkv/models/packed.py)
        self._dense = model
        if manifest.model.weights != "dense":
            self._dense = _quantized_dense(path, manifest, model)
        elif runtime == "torch-compile":
            from trtkv.models.compiled import CompiledDecoder

            self._dense = CompiledDecoder(model)
        elif runtime == "torch":
            from trtkv.models.packed import packed_decoder, packing_available

            if pack_weights is None:
                pack_weights = os.environ.get("TRTKV_PLAIN_WEIGHTS", "") in ("", "0")
            if pack_weights and packing_available(model):
                self._dense = packed_decoder(model)
        self.shards: HeadShards | None = None
        self.group = None if shard is None else shard[1]  # the tensor-parallel group (trtkv/distributed)
        self.failure: str | None = None  # why the background loop stopped for good (a rank was lost)
        if shard is not None:
            from trtkv.models.sharding import TensorParallelDecoder

            plan, group = shard
            self._dense = TensorParallelDecoder(self._dense, self.arch, plan, group)
            self.shards = HeadShards(group, plan.heads_sharded, self.arch.num_key_value_heads)
        self.core = EngineCore(self._dense, policy, cache_cfg, self.eos_ids, tokenizer.decode, kv_amax,
                               shards=self.shards, graph=runtime == "graph")
        self._sessions = None
        if runtime == "onnxruntime":  # the ONNX export of this engine, run by ONNX Runtime (trtkv/export)
            from trtkv.export import require_onnx

            require_onnx()
            from trtkv.export.ort_session import open_sessions

            self._sessions = open_sessions(self, onnx_dir)
            self.core = self.make_core()
        self.scheduler = Scheduler(self.core, max_batch)
        self._next_id = 0
        self._lock = threading.RLock()  # one thread drives the model at a time
        self._inbox: queue.Queue[Request] = queue.Queue()
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self._wake = threading.Event()
        self._cancels: queue.Queue[int] = queue.Queue()  # tensor parallelism: cancels the loop applies
        self.requests_total = 0

    @property
    def tp(self) -> int:
        """Tensor-parallel ranks this engine runs on."""
        return 1 if self.group is None else self.group.size

    # --- loading ----------------------------------------------------------------------------
    @classmethod
    def load(cls, path: str | Path, device: str | None = None, verify: bool = True,
             policy_overrides: dict[str, Any] | None = None, cache_overrides: dict[str, Any] | None = None,
             model_cache: dict | None = None, runtime: str = "torch",
             onnx_dir: str | Path | None = None, pack_weights: bool | None = None, tp: int | None = None
             ) -> "Engine":
        """Load an engine directory. ``policy_overrides`` replace policy parameters; ``cache_overrides`` the
        load-time cache settings (``max_batch``, ``max_pages``, ``kv_memory``, ``kv_memory_fraction``...; sizes
        like ``"2GiB"`` work).
        ``model_cache`` (a dict the caller keeps) lets engines of identical weights, dtype and device share
        one model object (the bench and eval load many engines at once). ``runtime="onnxruntime"`` runs the
        steps from the engine's ONNX export in ``onnx_dir`` (default ``ENGINE/onnx``, exported there when
        missing or stale) with ONNX Runtime; the KV cache then lives in host memory (device ``cpu``).
        ``pack_weights`` (default: yes unless ``TRTKV_PLAIN_WEIGHTS=1``) runs the ``torch`` runtime's fp32 CPU
        projections on oneDNN-packed copies of the weights (trtkv/models/packed.py). ``tp`` (default: the
        engine's ``--tp``) runs the model on that many tensor-parallel ranks: every rank runs the same program
        (the ``trtkv`` command starts them; in a script, ``torchrun``) and holds a slice of the weights and of
        the KV heads (trtkv/models/sharding.py)."""
        if runtime not in RUNTIMES:
            raise TrtkvError(f"runtime {runtime!r} is not one of {', '.join(RUNTIMES)}")
        if runtime == "onnxruntime":
            device = "cpu"
        path = Path(path)
        m = read_manifest(path)
        if cache_overrides:
            fixed = sorted(set(cache_overrides) - set(LOAD_TIME_CACHE_SETTINGS))
            if fixed:
                raise TrtkvError(f"cache setting {fixed[0]!r} is fixed when the engine is built; rebuild it with "
                                 f"`trtkv build ... --set {fixed[0]}=...` (settable at load: "
                                 f"{', '.join(LOAD_TIME_CACHE_SETTINGS)})")
            m = m.replace(cache=m.cache.with_settings(cache_overrides))
        files = verify_weights(path, m) if verify else None
        mm = m.model
        tp = mm.tp if tp is None else tp
        if tp != 1 and (runtime != "torch" or mm.weights != "dense"):
            raise TrtkvError(f"--tp {tp} runs dense weights with --runtime torch (not {mm.weights} weights with "
                             f"--runtime {runtime}); use --tp 1 for that")
        arch, dtype = mm.arch, parse_dtype(mm.dtype)
        device = device or ("cuda" if torch.cuda.is_available() else "cpu")
        if device == "cpu":
            dtype = cpu_compute_dtype(dtype, runtime)  # fp32 unless the CPU multiplies bf16 natively
        if mm.weights != "dense" and (runtime not in ("torch", "graph") or device != "cpu"):
            raise TrtkvError(f"{path} has {mm.weights} weights, which run on CPU with --runtime torch or graph (not "
                             f"{runtime} on {device}); build a --weights dense engine for that")
        if files is None and not mm.synthetic:
            from trtkv.models.loader import weight_files

            files = weight_files(path / "weights")
        weights_id = ("synthetic", mm.synthetic_seed) if mm.synthetic else mm.weights_sha256
        group = group_for(tp, str(device))
        plan = None
        if group is not None:
            from trtkv.models.sharding import ShardPlan

            plan = ShardPlan.for_arch(arch, group.rank, group.size)
        key = (mm.alias, weights_id, str(dtype), str(device), json.dumps(mm.arch.to_dict(), sort_keys=True), plan)
        model = (model_cache or {}).get(key)
        if model is None:
            src = None if mm.synthetic else files
            if plan is None:
                model = build_model(arch, dtype, device, src, seed=mm.synthetic_seed or 0)
            else:  # this rank's slices only
                from trtkv.models.sharding import load_shard

                model = load_shard(arch, plan, dtype, device, src, seed=mm.synthetic_seed or 0)
            if model_cache is not None:
                model_cache[key] = model
        tokenizer = load_tokenizer(path / "tokenizer", arch)
        params = dict(m.policy.params)
        params.update(policy_overrides or {})
        policy = make_policy(m.policy.name, params)
        policy.resolve_formats({torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16"}[dtype])
        policy.load_calibration(m.calibration)
        c = m.cache
        cache_cfg = CacheConfig(
            num_layers=arch.num_hidden_layers, num_kv_heads=model.arch.num_key_value_heads, head_dim=arch.head_dim,
            block_size=c.block_size, residual_group=policy.residual_group(),
            residual_dtype=torch.float16 if dtype == torch.float32 else dtype, eviction=c.eviction,
            max_pages=c.max_pages, kv_memory=c.kv_memory, kv_memory_fraction=c.kv_memory_fraction,
            max_batch=c.max_batch, device=device, demote=c.demote, host_kv_memory=c.host_kv_memory,
        )
        kv_amax = m.kv_amax.to_dict() if m.kv_amax is not None else None
        return cls(path, m, model, tokenizer, policy, cache_cfg, c.max_batch, kv_amax, runtime, onnx_dir,
                   pack_weights, None if plan is None else (plan, group))

    def make_core(self, policy=None, observers=(), **cache_overrides) -> EngineCore:
        """A new core on this engine's model object (shared weights, its own KV cache): what a tool that
        watches or varies the engine (bench, eval, calibration) runs, instead of patching ``self.core``.
        ``policy`` defaults to this engine's; ``cache_overrides`` replace ``CacheConfig`` fields."""
        import dataclasses

        policy = policy if policy is not None else self.policy
        cfg = dataclasses.replace(self.cache_cfg, residual_group=policy.residual_group(), **cache_overrides)
        if self._sessions is not None:
            from trtkv.export.ort_core import OrtEngineCore

            return OrtEngineCore(self.model, policy, cfg, self.eos_ids, self.tokenizer.decode, self.kv_amax,
                                 observers, sessions=self._sessions)
        return EngineCore(self._dense, policy, cfg, self.eos_ids, self.tokenizer.decode, self.kv_amax, observers,
                          shards=self.shards, graph=self.runtime == "graph")

    @property
    def quantized_weight_bytes(self) -> int | None:
        """Bytes of the quantized codes and scales a decode step multiplies (``--weights int8|int4``); None for
        dense weights."""
        return None if self.manifest.model.weights == "dense" else self._dense.weight_bytes

    @property
    def info(self) -> dict[str, Any]:
        mm = self.manifest.model
        return {"path": str(self.path), "model": mm.alias, "architecture": mm.architecture,
                "dtype": mm.dtype, "weights": mm.weights, "policy": self.manifest.policy.name,
                "policy_params": self.policy.params(), "max_position_embeddings": self.arch.max_position_embeddings,
                "block_size": self.core.cache.cfg.block_size, "max_batch": self.scheduler.max_batch,
                "runtime": self.runtime}

    # --- requests ---------------------------------------------------------------------------
    def encode_prompt(self, prompt: str, chat: bool) -> list[int]:
        return self.tokenizer.encode_prompt(prompt, chat)

    def make_request(self, prompt: str, params: SamplingParams | None = None) -> Request:
        params = (params or SamplingParams()).validate(self.arch.max_position_embeddings)
        if not isinstance(prompt, str) or not prompt.strip():
            raise TrtkvError("the prompt is empty; pass some text")
        ids = self.encode_prompt(prompt, params.chat)
        limit = self.arch.max_position_embeddings
        if len(ids) >= limit:
            raise TrtkvError(f"the prompt has {len(ids)} tokens but the model has {limit} positions; shorten it")
        with self._lock:
            rid = self._next_id
            self._next_id += 1
        from trtkv.cache.admission import check_fits

        check_fits(self.core, len(ids), min(params.max_tokens, limit - len(ids)), params.n)  # never fits: refuse
        req = Request(rid, prompt, ids, params, make_generator(params.seed), limit)
        req.events = queue.Queue()
        return req

    def _emit(self, reqs: list[Request], done: list[Request]) -> None:
        done_ids = {r.req_id for r in done}
        for r in reqs:
            fin = r.req_id in done_ids
            delta, ids = r.take_pending()
            if delta or ids or fin:
                r.events.put(StreamEvent(delta, ids, fin, r.result if fin else None,
                                         error=r.error if fin else None))

    def _step(self, emit: bool = True) -> None:
        before = list(self.scheduler.running) + list(self.scheduler.waiting)
        try:
            done = self.scheduler.step()
        except RankLost:  # the group is gone: nothing more can run
            raise
        except TrtkvError as e:  # e.g. out of KV memory: fail the running requests, keep the engine alive
            done = self._fail_all(str(e), emit)
        if emit:
            self._emit(before, done)

    def _fail_all(self, msg: str, emit: bool = True) -> list[Request]:
        for r in self.scheduler.drop_running():
            self.core.abort(r, msg)
            if emit:
                r.events.put(StreamEvent("", [], True, r.result, error=msg))
        return []

    def generate(self, prompts: str | list[str], params: SamplingParams | list[SamplingParams] | None = None
                 ) -> list[GenerationResult]:
        """Generate for several prompts batched together; results in prompt order. With
        ``SamplingParams(n=K)`` a prompt has K consecutive results (``stats["sample_index"]`` 0..K-1): the K
        samples share the prompt's KV pages (prefilled once, forked)."""
        prompts = [prompts] if isinstance(prompts, str) else list(prompts)
        plist = params if isinstance(params, list) else [params] * len(prompts)
        reqs = [self.make_request(p, sp) for p, sp in zip(prompts, plist)]
        if self._thread is not None:
            handles = [self._enqueue(r) for r in reqs]
            out = []
            for r, h in zip(reqs, handles):
                out.append(h.result())
                out += [RequestHandle(c).result() for c in r.forks]
            return out
        with self._lock:
            for r in reqs:
                self.scheduler.add(r)
            while not all(r.result and all(c.result for c in r.forks) for r in reqs):
                self._step()
        for r in reqs:
            for x in [r, *r.forks]:
                if x.finish_reason == "error":
                    raise TrtkvError(x.error or "generation failed")
        return [x.result for r in reqs for x in (r, *r.forks)]

    def search(self, problem, config=None, task: str = "game24") -> dict[str, Any]:
        """Tree search (ToT, best-first with backtracking) on one problem with this engine's policy; returns
        the problem's record (answer, correct, peak cached tokens / pages / KV bytes, rehydrations...).
        ``problem``: a ``trtkv.search.SearchProblem``, or a string (game24: "4 9 10 13"; math: the question)."""
        from trtkv.search import SearchConfig, SearchProblem, get_task, run_search

        config = (config or SearchConfig()).validate()
        t = get_task(task)
        if isinstance(problem, str):
            problem = SearchProblem.from_text(task, problem)
        with self._lock:
            return run_search(self.make_core(), lambda text: self.encode_prompt(text, config.chat), t, problem,
                              config)

    def stream(self, prompt: str, params: SamplingParams | None = None) -> Iterator[StreamEvent]:
        req = self.make_request(prompt, params)
        if self._thread is not None:
            yield from self._enqueue(req)
            return
        with self._lock:
            self.scheduler.add(req)
            while True:
                self._step()
                while not req.events.empty():
                    ev = req.events.get()
                    yield ev
                    if ev.finished:
                        return

    # --- background loop (servers) ----------------------------------------------------------
    def start_background(self) -> None:
        if self._thread is not None:
            return
        self._stop.clear()
        self._thread = threading.Thread(target=self._loop, name="trtkv-engine", daemon=True)
        self._thread.start()

    def submit(self, prompt: str, params: SamplingParams | None = None) -> RequestHandle:
        req = self.make_request(prompt, params)
        self.start_background()
        return self._enqueue(req)

    def _enqueue(self, req: Request) -> RequestHandle:
        if self.failure is not None:
            raise TrtkvError(self.failure)
        self._inbox.put(req)
        self._wake.set()
        return RequestHandle(req, None if self.group is None else self._cancel_later)

    def _cancel_later(self, req: Request) -> None:
        self._cancels.put(req.req_id)
        self._wake.set()

    def _loop(self) -> None:
        try:
            while not self._stop.is_set():
                new = drain(self._inbox)
                if self.group is not None:  # every rank admits and cancels the same requests before the same step
                    cancels = drain(self._cancels)
                    self.group.broadcast_object(Tick([RequestSpec.of(r) for r in new], cancels))
                    self._apply_cancels(cancels)
                for r in new:
                    self.scheduler.add(r)
                    self.requests_total += 1
                if not self.scheduler.has_work:
                    self._wake.wait(0.05)
                    self._wake.clear()
                    continue
                with self._lock:
                    try:
                        self._step()
                    except RankLost:
                        raise
                    except Exception as e:  # never let one bad step kill the server's engine thread
                        if self.group is not None:  # the ranks may now disagree: stop rather than diverge
                            raise
                        self._fail_all(f"internal error: {type(e).__name__}: {e}")
            if self.group is not None:
                self.group.broadcast_object(Tick([], [], stop=True))
        except Exception as e:  # a lost rank (or a step that failed under tensor parallelism): the engine stops
            self.failure = str(e) if isinstance(e, RankLost) else f"internal error: {type(e).__name__}: {e}"
            with self._lock:
                self._fail_all(self.failure)
                for r in self.scheduler.drop_waiting():
                    r.events.put(StreamEvent("", [], True, None, error=self.failure))
                for r in drain(self._inbox):
                    r.events.put(StreamEvent("", [], True, None, error=self.failure))

    def _apply_cancels(self, ids: list[int]) -> None:
        if ids:
            wanted = set(ids)
            for r in (*self.scheduler.running, *self.scheduler.waiting):
                if r.req_id in wanted:
                    r.cancelled = True

    def follow(self) -> None:
        """Tensor-parallel ranks other than 0 under a server: admit, cancel and step what rank 0's background loop
        does, tick by tick, until it stops (returns) or the group breaks (``RankLost``)."""
        from trtkv.runtime.sampling import make_generator

        limit = self.arch.max_position_embeddings
        while True:
            tick: Tick = self.group.broadcast_object()
            if tick.stop:
                return
            self._apply_cancels(tick.cancels)
            for spec in tick.requests:
                self.scheduler.add(Request(spec.req_id, spec.prompt, spec.prompt_ids, spec.params,
                                           make_generator(spec.params.seed), limit))
            if self.scheduler.has_work:
                self._step(emit=False)

    def metrics(self) -> dict[str, Any]:
        cache = self.core.cache
        tiers = cache.tiers if cache.has_tiers else None
        return {"kv_bytes_in_use": sum(cache.seq_bytes(s) for s in list(cache.seqs.values())),
                "kv_bytes_device": sum(cache.seq_bytes(s) for s in list(cache.seqs.values()))
                + self.core.staging.staging_bytes(),
                "kv_bytes_host": tiers.host_bytes_total() if tiers is not None else 0,
                "tokens_host": sum(t.live for st in list(tiers.seqs.values()) for t in st.host.layers[:1])
                if tiers is not None else 0,
                "transfer_bytes_total": tiers.transfer_bytes_total if tiers is not None else 0,
                "live_requests": len(self.scheduler.running) + len(self.scheduler.waiting),
                "live_pages": cache.pages_in_use(), "evictions_total": cache.evictions_total,
                "requests_total": self.requests_total, "kv_pool_bytes": cache.pool_bytes()}

    def shutdown(self) -> None:
        """Stop the background loop (under tensor parallelism it tells the other ranks' ``follow`` to return)."""
        if self._thread is not None:
            self._stop.set()
            self._wake.set()
            self._thread.join(timeout=10)
            self._thread = None

