"""``trtkv eval``: fidelity of compressed caches against the full cache, and task accuracy.

Fidelity (``--task fidelity``) replays recorded reasoning traces teacher-forced: the prompt is prefilled,
then the trace's tokens are forced one by one through ``decode_step`` (``Request.forced_tokens``), through
every engine *and* through a full-cache reference on the same weights, in lockstep. Every step compares the
next-token distributions (KL(full ‖ engine), top-1 agreement) and, on a sample of layers, the attention rows
(recall of the full cache's top-k attended positions; an observer, ``StepRecorder``, forces the per-slot
weights whatever the policy asks for). Because the inputs are forced, an engine's errors do not compound: each
step measures what the compressed cache does to the *same* context.

The reference is a ``full`` engine the user names (``--reference``) or, by default, an ``EngineCore`` with
``FullPolicy`` built on the engine's own model object (no second copy of the weights).

Accuracy (``--task gsm8k|math500|aime24|aime25``) generates K samples per problem and grades the last
``\\boxed{}`` answer with math-verify (``trtkv.eval.answers``).
"""
from __future__ import annotations

import dataclasses
import json
import sys
from collections import Counter
from pathlib import Path
from typing import Any

import torch

from trtkv.errors import TrtkvError
from trtkv.policies.base import StatsRequest
from trtkv.runtime.observers import EngineObserver

ACCURACY_TASKS = ("gsm8k", "math500", "aime24", "aime25")
TASKS = ("fidelity",) + ACCURACY_TASKS
PROMPT_SUFFIX = "\nPlease reason step by step, and put your final answer within \\boxed{}."
REFERENCE_LABEL = "full (reference)"


# --- engines and references -------------------------------------------------------------------------
class StepRecorder(EngineObserver):
    """Keeps the latest logits (prefill or decode) and the forced per-slot attention weights of ``layers``."""

    def __init__(self, layers):
        self.layers = tuple(layers)
        self.logits: torch.Tensor | None = None
        self.stats: list = []

    def stats_request(self, phase):
        return StatsRequest(weights=True, layers=self.layers) if phase == "decode" and self.layers else None

    def on_prefill(self, req, logits, stats):
        self.logits = logits

    def on_decode(self, reqs, logits, stats):
        self.logits, self.stats = logits, stats


def model_key(engine) -> tuple:
    """Engines with equal keys run the same weights (same model, weights hash or synthetic seed, dtype)."""
    mm = engine.manifest.model
    weights = ("synthetic", mm.synthetic_seed) if mm.synthetic else mm.weights_sha256
    return (mm.alias, weights, str(engine.core.dtype), str(engine.core.device),
            json.dumps(mm.arch.to_dict(), sort_keys=True))


def reference_core(engine, observers=()):
    """A full-cache ``EngineCore`` on ``engine``'s model object, KV stored in the model's dtype."""
    from trtkv.policies.full import FullPolicy

    pol = FullPolicy()
    pol.resolve_formats({torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16"}[engine.core.dtype])
    return engine.make_core(policy=pol, observers=observers, max_pages=None, eviction="inplace", demote="none",
                            kv_memory=None, host_kv_memory=None)


def pick_layers(num_layers: int, spec: str | int | None) -> tuple[int, ...]:
    """``"all"``, a count of evenly spaced layers (``8``), a comma list (``0,5,12``), or ``"none"`` (no
    attention recall: the engines then compute no per-slot weights the policy did not ask for)."""
    if str(spec).strip().lower() in ("none", "0"):
        return ()
    if spec is None or str(spec).strip().lower() == "all":
        return tuple(range(num_layers))
    text = str(spec).strip()
    try:
        if "," in text:
            layers = tuple(sorted({int(x) for x in text.split(",") if x.strip()}))
            if any(not 0 <= x < num_layers for x in layers):
                raise ValueError
            return layers
        n = int(text)
    except ValueError:
        raise TrtkvError(f"--recall-layers {spec!r}: expected 'all', a count, or layer indices below "
                         f"{num_layers}") from None
    if n <= 0:
        raise TrtkvError("--recall-layers must be positive")
    if n >= num_layers:
        return tuple(range(num_layers))
    return tuple(sorted({round(i * (num_layers - 1) / (n - 1)) for i in range(n)})) if n > 1 else (num_layers // 2,)


def _describe(be) -> dict[str, Any]:
    e = be.engine
    return {"engine": be.label, "path": str(be.path), "model": e.manifest.model.alias,
            "policy": e.manifest.policy.name, "policy_params": e.policy.params(),
            "synthetic_weights": e.manifest.model.synthetic, "device": str(e.core.device),
            "dtype": str(e.core.dtype).replace("torch.", "")}


# --- fidelity -------------------------------------------------------------------------------------
@dataclasses.dataclass
class _Tally:
    """Per-engine running sums besides the ``FidelityAccumulator``."""

    nll: list[float] = dataclasses.field(default_factory=list)
    kv_frac: list[float] = dataclasses.field(default_factory=list)  # per step: KV bytes / fp16 full bytes
    kv_per_tok: list[float] = dataclasses.field(default_factory=list)  # per step: KV bytes / tokens held
    kv_vs_ref: list[float] = dataclasses.field(default_factory=list)  # per step: KV bytes / reference KV bytes
    kv_frac_end: list[float] = dataclasses.field(default_factory=list)
    peak_kv: list[int] = dataclasses.field(default_factory=list)
    live_end: list[int] = dataclasses.field(default_factory=list)
    evicted: list[int] = dataclasses.field(default_factory=list)
    host_end: list[int] = dataclasses.field(default_factory=list)  # host-tier KV bytes at the end (T1 + T2)
    transfer_per_step: list[float] = dataclasses.field(default_factory=list)  # KV bytes moved between tiers


def encode_trace(tokenizer, trace, max_tokens: int, limit: int) -> tuple[list[int], list[int]]:
    prompt = tokenizer.encode_prompt(trace.prompt, chat=False)
    forced = tokenizer.encode(trace.completion)[:max_tokens]
    forced = forced[: max(0, limit - len(prompt))]
    if not prompt or not forced:
        raise TrtkvError(f"trace {trace.id!r} tokenizes to an empty prompt or completion")
    return prompt, forced


def run_fidelity(engines: list, traces: list, max_tokens: int = 1024, reference=None,
                 recall_layers: str | int | None = 8, topk: int = 10, batch: int = 4,
                 progress: bool | None = None) -> list[dict[str, Any]]:
    """One record per engine (plus one per reference), in input order."""
    from trtkv.progress import progress_bar
    from trtkv.eval.fidelity import FidelityAccumulator

    if not traces:
        raise TrtkvError("no traces to replay (empty data file or --limit 0)")
    groups: dict[tuple, list] = {}
    for be in engines:
        groups.setdefault(model_key(be.engine), []).append(be)
    if reference is not None:
        rkey = model_key(reference.engine)
        for key, members in groups.items():
            if key != rkey:
                raise TrtkvError(f"--reference {reference.path} has other weights than {members[0].path}; a "
                                 "reference must be a full engine of the same model and dtype")
        if reference.engine.manifest.policy.name != "full":
            raise TrtkvError(f"--reference {reference.path} uses policy "
                             f"{reference.engine.manifest.policy.name!r}; it must be a full engine")
    total = 0
    enc_cache = {}
    for members in groups.values():
        e = members[0].engine
        enc = [encode_trace(e.tokenizer, t, max_tokens, e.arch.max_position_embeddings) for t in traces]
        enc_cache[id(members[0])] = enc
        total += sum(len(f) for _, f in enc)
    bar = progress_bar(total, "fidelity", "tok", progress)
    records: dict[str, dict] = {}
    try:
        for members in groups.values():
            enc = enc_cache[id(members[0])]
            layers = pick_layers(members[0].engine.arch.num_hidden_layers, recall_layers)
            recs = [StepRecorder(layers) for _ in range(len(members) + 1)]
            ref_core = reference.engine.make_core(observers=[recs[0]]) if reference is not None else \
                reference_core(members[0].engine, [recs[0]])
            cores = [ref_core] + [be.engine.make_core(observers=[rec]) for be, rec in zip(members, recs[1:])]
            accs = [FidelityAccumulator() for _ in members]
            tallies = [_Tally() for _ in cores]
            for start in range(0, len(enc), max(1, batch)):
                _replay_chunk(cores, recs, enc[start:start + batch], layers, topk, accs, tallies, bar)
            ref_label = str(reference.path) if reference is not None else "built-in full policy on the same weights"
            meta = {"traces": len(enc), "tokens": sum(len(f) for _, f in enc), "recall_layers": list(layers),
                    "topk": topk, "reference": ref_label}
            ref_rec = _describe(reference) if reference is not None else {
                **_describe(members[0]), "engine": REFERENCE_LABEL, "path": None, "policy": "full",
                "policy_params": ref_core.policy.params()}
            records.setdefault(REFERENCE_LABEL + repr(model_key(members[0].engine)), {
                **ref_rec, "engine": REFERENCE_LABEL if reference is None else ref_rec["engine"], "is_reference": True,
                "task": "fidelity", **meta, "mean_kl": 0.0, "p90_kl": 0.0, "top1_agreement": 1.0,
                "attn_recall": 1.0, "n_steps": None, **_tally_summary(tallies[0], tallies[0])})
            for be, acc, tl in zip(members, accs, tallies[1:]):
                records[be.label] = {**_describe(be), "is_reference": False, "task": "fidelity", **meta,
                                     **acc.summary(), **_tally_summary(tl, tallies[0])}
    finally:
        bar.close()
    from trtkv.eval.pareto import mark_frontier

    refs = [r for k, r in records.items() if r["is_reference"]]
    out = refs + [records[be.label] for be in engines]
    mark_frontier(out)
    return out


def _tally_summary(t: _Tally, ref: _Tally) -> dict[str, Any]:
    def mean(v):
        return sum(v) / len(v) if v else None

    return {"nll": mean(t.nll), "nll_reference": mean(ref.nll), "kv_fraction_fp16_mean": mean(t.kv_frac),
            "kv_fraction_fp16_end": mean(t.kv_frac_end), "kv_bytes_per_token_mean": mean(t.kv_per_tok),
            "kv_vs_reference_mean": mean(t.kv_vs_ref) if t.kv_vs_ref else 1.0, "peak_kv_bytes_mean": mean(t.peak_kv),
            "live_tokens_end_mean": mean(t.live_end),
            "evicted_tokens_mean": mean(t.evicted), "kv_bytes_host_end_mean": mean(t.host_end),
            "transfer_bytes_per_step_mean": mean(t.transfer_per_step)}


def _replay_chunk(cores, recs, enc, layers, topk, accs, tallies, bar) -> None:
    """Teacher-forced lockstep replay of a few traces (one batch) through the reference and every engine."""
    from trtkv.cache.manager import fp16_bytes_per_token
    from trtkv.eval.lockstep import lockstep_decode
    from trtkv.runtime.request import Request
    from trtkv.runtime.sampling import SamplingParams, make_generator

    arch = cores[0].arch
    c = cores[0].cache.cfg  # (this rank's heads under tensor parallelism, as the bytes measured)
    per_tok = fp16_bytes_per_token(c.num_layers, c.num_kv_heads, c.head_dim)
    limit = arch.max_position_embeddings
    reqs = []
    for ci in range(len(cores)):
        row = []
        for i, (prompt, forced) in enumerate(enc):
            params = SamplingParams(max_tokens=len(forced), ignore_eos=True, chat=False)
            r = Request(-(1 + i + ci * len(enc)), "", prompt, params, make_generator(0), limit)
            r.forced_tokens = forced
            row.append(r)
        reqs.append(row)
    try:
        for i in range(len(enc)):
            logits = []
            for ci, c in enumerate(cores):
                c.prefill(reqs[ci][i])
                logits.append(recs[ci].logits)
            _score(cores, [[reqs[ci][i]] for ci in range(len(cores))], logits, None, layers, topk, accs, tallies,
                   per_tok)
            bar.update(1)
        while True:
            idx = [i for i in range(len(enc)) if not reqs[0][i].finished]
            if not idx:
                break
            batches = [[reqs[ci][i] for i in idx] for ci in range(len(cores))]
            if all(c.model is cores[0].model for c in cores):  # one dense forward for all (eval/lockstep.py)
                lockstep_decode(cores, batches)
            else:
                for c, b in zip(cores, batches):
                    c.decode_step(b)
            logits = [rec.logits for rec in recs]
            stats = [rec.stats for rec in recs]
            _score(cores, [[reqs[ci][i] for i in idx] for ci in range(len(cores))], logits, stats, layers, topk,
                   accs, tallies, per_tok)
            bar.update(len(idx))
        for ci, c in enumerate(cores):
            for r in reqs[ci]:
                s = c.finish(r).stats
                tallies[ci].kv_frac_end.append(s["kv_bytes"] / s["kv_bytes_full"] if s["kv_bytes_full"] else 0.0)
                tallies[ci].peak_kv.append(s["peak_kv_bytes"])
                tallies[ci].live_end.append(s["live_tokens"])
                tallies[ci].evicted.append(s["evicted_tokens"])
                tallies[ci].host_end.append(s.get("kv_bytes_host", 0))
                tallies[ci].transfer_per_step.append(s.get("transfer_bytes", 0) / max(1, s["generated_tokens"]))
    finally:
        for ci, c in enumerate(cores):  # on error: free what is still held
            for r in reqs[ci]:
                if r.req_id in c.cache.seqs:
                    c.cache.free_sequence(r.req_id)


def compare_to_reference(lr, p_ref, ref_top, lp) -> tuple[torch.Tensor, torch.Tensor]:
    """KL(ref ‖ engine) and top-1 agreement per row from the shared reference log-probs ``lr`` (its ``exp``
    and ``argmax`` precomputed) and the engine's log-probs ``lp``: ``fidelity.kl_divergence`` and
    ``top1_agreement`` without recomputing the reference's side for every engine."""
    kl = torch.where(p_ref > 0, p_ref * (lr - lp), 0.0).sum(-1).clamp_min(0.0)
    return kl, (lp.argmax(-1) == ref_top).float()


def _score(cores, reqs, logits, stats, layers, topk, accs, tallies, per_tok) -> None:
    """Compare one step's rows of every engine (``reqs[ci]``, ``logits[ci] [b, V]``) to the reference's.

    The reference's log-softmax, probabilities and argmax are computed once per step and shared by every
    engine; each engine then costs one log-softmax (which also gives its NLL) and one fused reduction."""
    from trtkv.eval.fidelity import topk_attention_recall

    lr = torch.log_softmax(logits[0].float(), -1)
    p_ref = lr.exp()
    ref_top = lr.argmax(-1)
    targets = torch.tensor([r.generated[-1] for r in reqs[0]], device=lr.device)
    ref_bytes = [r.ctx.kv_bytes for r in reqs[0]]
    for ci in range(len(cores)):
        lp = lr if ci == 0 else torch.log_softmax(logits[ci].float(), -1)
        tallies[ci].nll.extend((-lp.gather(-1, targets[:, None])[:, 0]).tolist())
        for r, rb in zip(reqs[ci], ref_bytes):
            held = r.prompt_len + r.decode_steps
            tallies[ci].kv_frac.append(r.ctx.kv_bytes / (held * per_tok))
            tallies[ci].kv_per_tok.append(r.ctx.kv_bytes / held)
            if ci:
                tallies[ci].kv_vs_ref.append(r.ctx.kv_bytes / rb if rb else 0.0)
        if ci == 0:
            continue
        kl, agree = compare_to_reference(lr, p_ref, ref_top, lp)
        for j, r in enumerate(reqs[ci]):
            recall = None
            if stats is not None and layers:
                rows = []
                for layer in layers:
                    a, b = stats[0][j].layers.get(layer), stats[ci][j].layers.get(layer)
                    if a is None or b is None:
                        continue
                    n = int(max(a.positions.max(initial=0), b.positions.max(initial=0))) + 1
                    rows.append(topk_attention_recall(_dense(a, n), _dense(b, n), topk))
                recall = torch.cat(rows) if rows else None
            accs[ci - 1].update(kl=kl[j], agreement=agree[j], recall=recall)


def _dense(ls, n: int) -> torch.Tensor:
    """Per-slot weights ``[Hq, m]`` at their token positions, scattered into ``[Hq, n]`` (0 where absent)."""
    w = ls.weights.float()
    out = torch.zeros(w.shape[0], n, device=w.device)
    pos = torch.as_tensor(ls.positions, device=w.device, dtype=torch.long)
    out.index_add_(1, pos, w)
    return out


# --- accuracy -------------------------------------------------------------------------------------
def run_accuracy(engines: list, task: str, problems: list, samples: int = 1, max_tokens: int = 2048,
                 temperature: float = 0.0, top_p: float = 1.0, seed: int = 0, batch: int | None = None,
                 progress: bool | None = None) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Generate ``samples`` answers per problem with every engine and grade them; returns
    (one record per engine, one row per sample)."""
    from trtkv.progress import progress_bar
    from trtkv.eval.answers import extract_answer, is_correct, reference_answer
    from trtkv.runtime.sampling import SamplingParams

    if not problems:
        raise TrtkvError(f"no {task} problems to run (empty data file or --limit 0)")
    if samples <= 0:
        raise TrtkvError("--samples must be at least 1")
    bar = progress_bar(len(problems) * samples * len(engines), task, "sample", progress)
    records, rows = [], []
    try:
        for be in engines:
            e = be.engine
            size = batch or e.scheduler.max_batch
            mine = []
            per_chunk = max(1, size // samples)  # problems per batch; each one's K samples fork its prompt
            for start in range(0, len(problems), per_chunk):
                pis = list(range(start, min(start + per_chunk, len(problems))))
                prompts = [problems[pi].question + PROMPT_SUFFIX for pi in pis]
                # SamplingParams(n=K): the K samples share the prompt's pages; sample s is seeded seed+1000*pi+s
                params = [SamplingParams(max_tokens=max_tokens, temperature=temperature, top_p=top_p,
                                         seed=seed + 1000 * pi, chat=True, n=samples) for pi in pis]
                chunk = [(pi, s) for pi in pis for s in range(samples)]
                for (pi, s), res in zip(chunk, e.generate(prompts, params)):
                    p = problems[pi]
                    gold = reference_answer(p, task)
                    st = res.stats
                    mine.append({"engine": be.label, "problem": p.id, "sample": s, "reference": gold,
                                 "answer": extract_answer(res.text, task), "correct": is_correct(res.text, gold, task),
                                 "generated_tokens": st["generated_tokens"], "finish_reason": res.finish_reason,
                                 "kv_bytes": st["kv_bytes"], "peak_kv_bytes": st["peak_kv_bytes"],
                                 "kv_bytes_shared": st.get("kv_bytes_shared", 0),
                                 "kv_bytes_full": st["kv_bytes_full"], "tokens_per_s": st["tokens_per_s"],
                                 "text": res.text})
                bar.update(len(chunk))
            rows += mine
            records.append({**_describe(be), "task": task, "problems": len(problems), "samples": samples,
                            "temperature": temperature, "max_tokens": max_tokens,
                            **_accuracy_summary(mine, len(problems), samples)})
    finally:
        bar.close()
    return records, rows


def _accuracy_summary(rows: list[dict], n_problems: int, k: int) -> dict[str, Any]:
    by_problem: dict[str, list[dict]] = {}
    for r in rows:
        by_problem.setdefault(r["problem"], []).append(r)
    pass1 = sum(sum(r["correct"] for r in rs) / len(rs) for rs in by_problem.values()) / n_problems
    passk = sum(any(r["correct"] for r in rs) for rs in by_problem.values()) / n_problems
    maj = 0
    for rs in by_problem.values():
        votes = Counter(r["answer"] for r in rs if r["answer"])
        if votes:
            top = votes.most_common(1)[0][0]
            maj += next(r["correct"] for r in rs if r["answer"] == top)
    def mean(key):
        return sum(r[key] for r in rows) / len(rows)

    return {"pass@1": pass1, f"pass@{k}": passk, "accuracy": maj / n_problems,
            "accuracy_method": f"majority vote over {k} sample(s) (maj@{k}); equals pass@1 when k=1",
            "mean_generated_tokens": mean("generated_tokens"),
            "truncated_fraction": sum(r["finish_reason"] == "length" for r in rows) / len(rows),
            "no_answer_fraction": sum(not r["answer"] for r in rows) / len(rows),
            "kv_bytes_mean": mean("kv_bytes"), "peak_kv_bytes_mean": mean("peak_kv_bytes"),
            "peak_kv_bytes_max": max(r["peak_kv_bytes"] for r in rows),
            "kv_fraction_fp16_mean": sum(r["kv_bytes"] / r["kv_bytes_full"] for r in rows if r["kv_bytes_full"])
            / len(rows), "tokens_per_s_mean": mean("tokens_per_s")}


# --- output -------------------------------------------------------------------------------------
def write_eval(out: Path, doc: dict[str, Any], sample_rows: list[dict] | None = None) -> list[Path]:
    from trtkv.eval import plots

    out.mkdir(parents=True, exist_ok=True)
    written = [out / "results.json"]
    (out / "results.json").write_text(json.dumps(doc, indent=2, default=str) + "\n")
    if sample_rows is not None:
        with open(out / "samples.jsonl", "w") as f:
            for r in sample_rows:
                f.write(json.dumps(r) + "\n")
        written.append(out / "samples.jsonl")
    if doc["task"] == "fidelity":
        written.append(plots.fidelity_plot(doc["records"], out))
        written.append(plots.pareto_plot(doc["records"], out))
    else:
        written.append(plots.accuracy_plot(doc["records"], out))
    return written


def print_eval(doc: dict[str, Any], console=None) -> None:
    from rich.console import Console
    from rich.table import Table

    console = console or Console(width=None if sys.stdout.isatty() else 160)
    recs = doc["records"]
    def f(x, spec):
        return "–" if x is None else format(x, spec)

    if doc["task"] == "fidelity":
        r0 = recs[0]
        t = Table(title=f"trtkv eval fidelity — {r0['traces']} trace(s), {r0['tokens']} forced tokens, "
                        f"top-{r0['topk']} recall on layers {_short(r0['recall_layers'])}", title_justify="left")
        for col in ("engine", "policy", "mean KL", "p90 KL", "top-1 agree", "attn recall", "NLL", "KV B/token",
                    "KV vs fp16", "KV vs full", "frontier"):
            t.add_column(col, justify="left" if col in ("engine", "policy", "frontier") else "right",
                         no_wrap=col == "engine")
        for r in recs:
            t.add_row(r["engine"], r["policy"], f(r["mean_kl"], ".4f"), f(r["p90_kl"], ".4f"),
                      f(r["top1_agreement"], ".3f"), f(r["attn_recall"], ".3f"), f(r["nll"], ".3f"),
                      f(r.get("kv_bytes_per_token_mean"), ",.0f"), f(r["kv_fraction_fp16_mean"], ".1%"),
                      f(r["kv_vs_reference_mean"], ".1%"), _frontier_mark(r))
        console.print(t)
        console.print("[dim]KL(full ‖ engine) in nats per token; NLL of the trace's tokens; KV columns: bytes held "
                      "per token, per step / an uncompressed fp16 cache, and / the full-cache reference (mean over "
                      "steps); frontier: no engine of the run holds fewer bytes per token and agrees more on top-1 "
                      "(top-1) / has lower KL (KL).[/dim]")
    else:
        r0 = recs[0]
        k = r0["samples"]
        t = Table(title=f"trtkv eval {doc['task']} — {r0['problems']} problem(s) × {k} sample(s), "
                        f"T={r0['temperature']}, max {r0['max_tokens']} tokens", title_justify="left")
        cols = ["engine", "policy", "pass@1"] + ([f"pass@{k}"] if k > 1 else []) + [
            "accuracy", "mean gen len", "truncated", "peak KV/req MiB", "KV vs fp16"]
        for col in cols:
            t.add_column(col, justify="left" if col in ("engine", "policy") else "right", no_wrap=col == "engine")
        for r in recs:
            t.add_row(r["engine"], r["policy"], f(r["pass@1"], ".3f"), *([f(r[f"pass@{k}"], ".3f")] if k > 1 else []),
                      f(r["accuracy"], ".3f"), f(r["mean_generated_tokens"], ".0f"), f(r["truncated_fraction"], ".0%"),
                      f(r["peak_kv_bytes_mean"] / 2**20, ".2f"), f(r["kv_fraction_fp16_mean"], ".1%"))
        console.print(t)
        console.print(f"[dim]accuracy: {r0['accuracy_method']}; truncated: share of samples that hit max tokens."
                      "[/dim]")
    if any(r.get("synthetic_weights") for r in recs):
        console.print("[yellow]note:[/yellow] synthetic (random) weights: these numbers say nothing about a real "
                      "model's quality")


def _frontier_mark(r: dict[str, Any]) -> str:
    return "+".join(v for v, k in (("top-1", "on_frontier_top1"), ("KL", "on_frontier_kl")) if r.get(k))


def _short(layers: list[int]) -> str:
    return ",".join(map(str, layers)) if len(layers) <= 10 else f"{len(layers)} layers"
