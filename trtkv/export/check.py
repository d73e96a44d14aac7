"""``trtkv export --check``: the exported graphs against the PyTorch engine, step by step from one cache state.

**Lockstep.** One engine core runs the generation loop (scheduler, policy hooks, cache allocation, as
``--runtime onnxruntime`` does) and at every step runs *both* steps from the same state:

* the exported graph, by ONNX Runtime through Polygraphy's ``OnnxrtRunner``, on the step's feeds;
* the PyTorch step: the PyTorch runtime's own model pieces and decode attention (``decode_attention``, the
  ``paged_attention`` / buffer kernels the torch runtime calls) over the same pages, buffer and block tables.

The step's write unit (the new token, or the flush group it completes) is encoded by the graph; the cache
stores the graph's records (as the ONNX Runtime runtime does) *before* the PyTorch step attends, so both attend
identical KV, and the logits compare one step of computation: nothing compounds. The loop follows PyTorch's
greedy tokens and PyTorch's attention statistics (the policy's decisions).

Per step the check compares

* ``logits`` with Polygraphy's comparator (``--atol`` / ``--rtol``);
* the greedy token (ONNX Runtime's argmax against PyTorch's; a disagreement is a near tie when PyTorch's top-2
  gap is within the step's logits error, otherwise a mismatch);
* the write unit's records: the graph's against PyTorch's encoding of PyTorch's own K/V. Where they differ,
  PyTorch's encoder is run on the graph's K/V as well. When that reproduces the graph's records bit for bit and
  the two K/V differ by float rounding only (``INPUT_RTOL`` of the row, plus one unit in the last place of the
  residual buffer's dtype where a row was rounded to it), the difference is a **midpoint flip**: a quantizer
  input within float rounding of a rounding boundary (an E2M1 / E4M3 / integer midpoint, a bfloat16 / fp16 tie,
  a block scale's E4M3 step) lands on the other side of it, because the two runtimes sum in another order. Those
  are counted and reported, not failed. Anything else (a different encoding of equal inputs, K/V apart by more
  than rounding) is a real mismatch;
* the attention statistics the policy reads (positions attended, weights), when it asks for them.

The check passes when every step's logits are within tolerance and there is no real mismatch.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from plugins.formats import get_format
from plugins.formats.packing import unpack
from trtkv.export.layout import from_boundary, to_boundary
from trtkv.export.ort_core import DecodePlan, OrtEngineCore
from trtkv.export.torch_ops import kv_encode
from trtkv.policies.base import StepStats
from trtkv.runtime.attention import decode_attention
from trtkv.runtime.request import Request
from trtkv.runtime.sampling import SamplingParams
from trtkv.runtime.scheduler import Scheduler

CHECK_PROMPTS = ("Explain why the sky is blue, step by step.",
                 "Write a short story about a robot learning to paint.")
DEFAULT_STEPS = 48  # decode steps per prompt
# Logits tolerances the check passes at (an element passes within atol OR rtol). Both steps attend identical KV,
# so what remains is float rounding of one step (fp32 weights: ~1e-4 on SmolLM2's logits).
DEFAULT_ATOL = 1e-2
DEFAULT_RTOL = 1e-2
# Write-unit K/V of the two steps may differ by this much relative to the row's largest magnitude (fp32 rounding
# of one step is ~1e-6 of it; a quantization step of the coarsest format here is 1/8 to 1/2 of it)
INPUT_RTOL = 1e-4
MAX_LISTED = 8  # mismatches and near ties listed in the report
LOSSLESS = ("fp32",)  # formats that store the K/V as they are: their records differ exactly as the K/V do


@dataclass
class GraphCheck:
    """Polygraphy's comparison of one graph's ``logits`` over every step of the check."""

    graph: str
    output: str
    steps: int
    passed_steps: int
    max_abs: float
    max_rel: float

    @property
    def passed(self) -> bool:
        return self.steps > 0 and self.passed_steps == self.steps

    def line(self, atol: float, rtol: float) -> str:
        verdict = "PASS" if self.passed else "FAIL"
        return (f"{self.graph:<17} {self.output:<7} {self.passed_steps:>3}/{self.steps:<3} steps within tolerance  "
                f"max abs {self.max_abs:.3e}  max rel {self.max_rel:.3e}  {verdict} (atol {atol:g} or rtol {rtol:g})")


@dataclass
class Flips:
    """Midpoint flips: stored values that differ between the two steps only because an input sat within float
    rounding of a rounding boundary."""

    codes: int = 0  # element codes (4-/2-bit, E4M3, integer) and fp16 / bfloat16 elements (fp32 stores the K/V as is)
    scales: int = 0  # block scales, zero points and key offsets
    buffer: int = 0  # residual-buffer elements (the new token rounded to the buffer's dtype)
    units: int = 0  # write units (a token, a flush group, a prompt group) or buffer rows holding at least one

    @property
    def total(self) -> int:
        return self.codes + self.scales + self.buffer


@dataclass
class CheckReport:
    graphs: list[GraphCheck]
    flips: Flips
    mismatches: list[str]  # real mismatches (the first MAX_LISTED described)
    mismatch_count: int
    tokens: int  # greedy tokens compared (prefill's first token and every decode step's, per request)
    tokens_equal: int
    near_ties: list[str]  # token disagreements explained by a near tie
    write_units: int  # write units compared (tokens, flush groups, prompt groups)
    buffer_rows: int  # tokens appended to the residual buffer compared
    kv_max_diff: float  # largest |K/V difference| of the two steps / its row's magnitude, over everything compared
    stats_max_diff: float  # largest attention-weight difference where the policy read statistics

    @property
    def passed(self) -> bool:
        return all(g.passed for g in self.graphs) and self.mismatch_count == 0

    def lines(self, atol: float, rtol: float) -> list[str]:
        f = self.flips
        out = [g.line(atol, rtol) for g in self.graphs]
        out.append(f"greedy tokens     {self.tokens_equal}/{self.tokens} equal"
                   + (f" ({len(self.near_ties)} near ties)" if self.near_ties else ""))
        out.append(f"KV records        {self.write_units} write units, {self.buffer_rows} buffer rows (K/V apart by <= "
                   f"{self.kv_max_diff:.1e} of their row): {f.total} midpoint flips in {f.units} of them ({f.codes} "
                   f"codes, {f.scales} scales, {f.buffer} buffer elements), {self.mismatch_count} real mismatches")
        if self.stats_max_diff:
            out.append(f"attention stats   max weight difference {self.stats_max_diff:.1e}")
        out += [f"  near tie: {t}" for t in self.near_ties[:MAX_LISTED]]
        out += [f"  mismatch: {m}" for m in self.mismatches[:MAX_LISTED]]
        return out


class _Recorder:
    """What the lockstep core measured: logits per graph, flips, mismatches, token agreement."""

    def __init__(self):
        self.logits: dict[str, tuple[list[np.ndarray], list[np.ndarray]]] = {"prefill": ([], []),
                                                                             "decode_step": ([], [])}
        self.flips = Flips()
        self.mismatches: list[str] = []
        self.mismatch_count = 0
        self.tokens = self.tokens_equal = 0
        self.near_ties: list[str] = []
        self.write_units = self.buffer_rows = 0
        self.kv_max_diff = 0.0
        self.stats_max_diff = 0.0

    def mismatch(self, what: str) -> None:
        self.mismatch_count += 1
        if len(self.mismatches) < MAX_LISTED:
            self.mismatches.append(what)

    def step_logits(self, graph: str, where: str, ort: np.ndarray, ref: np.ndarray) -> None:
        self.logits[graph][0].append(np.array(ort, np.float32, copy=True))
        self.logits[graph][1].append(np.array(ref, np.float32, copy=True))
        for i in range(ref.shape[0]):
            self.tokens += 1
            a, b = int(ort[i].argmax()), int(ref[i].argmax())
            if a == b:
                self.tokens_equal += 1
                continue
            top2 = np.sort(ref[i])[-2:]
            gap, err = float(top2[1] - top2[0]), float(np.abs(ort[i] - ref[i]).max())
            note = f"{where} request {i}: ONNX Runtime {a}, PyTorch {b}, top-2 gap {gap:.2e}, logits error {err:.2e}"
            if gap <= 2 * err:
                self.near_ties.append(note)
            else:
                self.mismatch(note)


def _fields(fmt: str, H: int, D: int):
    f = get_format(fmt)
    return f.slot_fields(H, D), f.group_fields(H, D)


def _count_diff(a: np.ndarray, b: np.ndarray, packed_bits: int) -> int:
    """Differing stored elements of two records (sub-byte codes unpacked)."""
    if packed_bits:
        a, b = unpack(torch.from_numpy(a), packed_bits), unpack(torch.from_numpy(b), packed_bits)
        return int((a != b).sum())
    return int((a != b).sum())


def _input_gap(xt: torch.Tensor, xo: torch.Tensor, rounded: torch.dtype | None) -> tuple[bool, float]:
    """Whether two write units' K or V ``[..., H, D]`` differ by float rounding only, and the largest difference
    relative to its row's magnitude. ``rounded``: the dtype rows were rounded to (the residual buffer's), whose
    last-place unit is allowed on top."""
    diff = (xt - xo).abs()
    row = xt.abs().amax(-1, keepdim=True).clamp_min(1e-30)
    allowed = INPUT_RTOL * row
    if rounded is not None:  # one unit in the last place of |x| in that dtype, bounded above
        fi = torch.finfo(rounded)
        allowed = allowed + fi.eps * xt.abs() + fi.eps * fi.smallest_normal
    return bool((diff <= allowed).all()), float((diff / row).max()) if diff.numel() else 0.0


@dataclass
class UnitResult:
    """One write unit compared: midpoint flips (element codes, scale records), or a mismatch (a sentence)."""

    codes: int = 0
    scales: int = 0
    input_diff: float = 0.0  # largest |K/V difference| / row magnitude
    mismatch: str | None = None


def compare_unit(fmt: str, kt: torch.Tensor, vt: torch.Tensor, ko: torch.Tensor, vo: torch.Tensor, live: torch.Tensor,
                 graph_records: list[np.ndarray], scales: tuple[float, float],
                 rounded: torch.dtype | None = None) -> UnitResult:
    """One write unit ``[1, g, H, D]`` (``live [1, g]``): the graph's records (slot records ``[1, g, ...]``, group
    records ``[1, ...]``, boundary dtypes) against PyTorch's encoding of PyTorch's K/V ``kt, vt``; ``ko, vo`` are the
    graph's K/V. Equal records: nothing. Different ones are midpoint flips when PyTorch's encoder reproduces the
    graph's records from ``ko, vo`` and the two K/V differ by float rounding only (``rounded``: the dtype their
    rows were rounded to before encoding, whose last-place unit is allowed on top); otherwise a mismatch."""
    slot_specs, group_specs = _fields(fmt, *kt.shape[-2:])
    rows = live[0].nonzero().flatten().numpy()

    def stored(records):  # the live rows of the slot records, then the group records
        return ([np.asarray(r)[0][rows] for r in records[:len(slot_specs)]]
                + [np.asarray(r)[0] for r in records[len(slot_specs):]])

    live4 = live[0][:, None, None]
    ok_k, gap_k = _input_gap(torch.where(live4, kt[0], 0), torch.where(live4, ko[0], 0), rounded)
    ok_v, gap_v = _input_gap(torch.where(live4, vt[0], 0), torch.where(live4, vo[0], 0), rounded)
    out = UnitResult(input_diff=max(gap_k, gap_v))
    if not (ok_k and ok_v):
        out.mismatch = f"K/V differ by {out.input_diff:.1e} of their row (more than float rounding)"
        return out
    ours = stored([to_boundary(t) for t in kv_encode(fmt, kt, vt, live, *scales)])
    theirs = stored(graph_records)
    if all(np.array_equal(a, b) for a, b in zip(ours, theirs)):
        return out
    again = stored([to_boundary(t) for t in kv_encode(fmt, ko, vo, live, *scales)])
    if not all(np.array_equal(a, b) for a, b in zip(again, theirs)):
        bad = [f.name for f, a, b in zip(slot_specs + group_specs, again, theirs) if not np.array_equal(a, b)]
        out.mismatch = (f"the graph's {fmt} records ({', '.join(bad)}) differ from PyTorch's encoding of the graph's "
                        "own K/V")
        return out
    if fmt in LOSSLESS:  # the records are the K/V themselves: no rounding boundary, nothing flipped
        return out
    D = kt.shape[-1]
    for spec, a, b in zip(slot_specs + group_specs, ours, theirs):
        if spec.name in ("k", "v"):
            per = D // spec.shape[-1]
            out.codes += _count_diff(a, b, 8 // per if per > 1 else 0)
        else:
            out.scales += _count_diff(a, b, 0)
    return out


class LockstepCore(OrtEngineCore):
    """``OrtEngineCore`` that runs the graphs through Polygraphy runners and, at every step, the PyTorch step from
    the same state (module docstring). ``reference``: the PyTorch runtime's model (``Engine.core.model``)."""

    def __init__(self, *args, reference, recorder: _Recorder, runners: dict, **kwargs):
        super().__init__(*args, **kwargs)
        self.reference = reference
        self.rec = recorder
        self.runners = runners
        self.step_no = 0

    # --- prefill ----------------------------------------------------------------------------
    @torch.inference_mode()
    def prefill(self, req: Request) -> None:
        self._begin_prefill_graph(req)
        out = self.runners["prefill"].infer({"input_ids": np.asarray(req.prompt_ids, np.int64)})
        logits, ks, vs = self._torch_prefill(req.prompt_ids)
        self.rec.step_logits("prefill", f"prefill of request {req.req_id}", out["logits"], logits.float().numpy())
        self._check_prompt(req, out, ks, vs)
        self._store_prefill(req, out)
        self.end_prefill(req, logits, StepStats(step=-1))

    def _torch_prefill(self, ids: list[int]):
        """``EngineCore.prefill``'s computation (the cache writes aside): logits, and each layer's K/V."""
        model = self.reference
        T = len(ids)
        cos, sin = model.rotary.cos_sin(torch.arange(T, device=self.device), self.dtype)
        x = model.embed(torch.tensor(ids, device=self.device))
        ks, vs = [], []
        for layer in range(self.arch.num_hidden_layers):
            q, k, v = model.qkv(layer, x, cos, sin)
            attn = F.scaled_dot_product_attention(q.transpose(0, 1)[None], k.transpose(0, 1)[None],
                                                  v.transpose(0, 1)[None], is_causal=True, scale=self.sm_scale,
                                                  enable_gqa=True)[0].transpose(0, 1)
            ks.append(k)
            vs.append(v)
            x = model.finish_layer(layer, x, attn)
        return model.logits(x[-1:]), ks, vs

    def _check_prompt(self, req: Request, out: dict, ks, vs) -> None:
        """The prompt's stored records (and buffered tail) against PyTorch's encoding of PyTorch's K/V."""
        fmt = self.policy.prefill_class(req.ctx)[0]
        T, g = req.prompt_len, self.g
        G = (T + g - 1) // g
        full = T if g == 1 else (T - T % g if self.layout.buffers_prompt_tail else G * g)
        stored = full // g if g > 1 else T
        res = self.cache.cfg.residual_dtype
        for layer in range(self.arch.num_hidden_layers):
            kt, vt = ks[layer].float(), vs[layer].float()
            ko, vo = torch.from_numpy(out["k"][layer]), torch.from_numpy(out["v"][layer])
            pad = G * g - T if g > 1 else 0
            shape = (G, g) if g > 1 else (T, 1)

            def grouped(x):
                return torch.cat([x, x.new_zeros(pad, *x.shape[1:])]).reshape(*shape, *x.shape[1:])

            live = (torch.arange(shape[0] * shape[1]) < T).reshape(shape)
            recs = [out[f"l{layer}.{fmt}.write.{f.name}"] for fs in _fields(fmt, *kt.shape[1:]) for f in fs]
            for row in range(stored):
                self._check_unit(f"prefill of request {req.req_id}, layer {layer}, group {row}", fmt, layer,
                                 grouped(kt)[row:row + 1], grouped(vt)[row:row + 1], grouped(ko)[row:row + 1],
                                 grouped(vo)[row:row + 1], live[row:row + 1], [r[row:row + 1] for r in recs], None)
            if full < T:  # the tail went to the residual buffer
                self._check_buffer(f"prefill of request {req.req_id}, layer {layer} (buffered tail)",
                                   kt[full:], vt[full:], ko[full:], vo[full:], res)

    # --- decode -----------------------------------------------------------------------------
    @torch.inference_mode()
    def decode_step(self, reqs: list[Request]) -> None:
        plan = self._plan_decode(reqs)
        out = self.runners["decode_step"].infer(plan.feeds)
        logits, stats, forced = self._torch_decode(plan, out)
        where = f"decode step {self.step_no}"
        self.rec.step_logits("decode_step", where, out["logits"], logits.float().numpy())
        graph_stats, _ = self._graph_stats(out, plan)
        self._compare_stats(where, graph_stats, stats, plan)
        self.step_no += 1
        self._end_decode(reqs, logits, stats, forced)

    def _torch_decode(self, plan: DecodePlan, out: dict):
        """The PyTorch step (``EngineCore.decode_step`` after its writes and policy hooks, which the plan made)
        layer by layer: each layer's write unit is checked, the graph's records are stored, then PyTorch
        attends the same pages and buffer."""
        model, cache, seqs = self.reference, self.cache, plan.seqs
        positions = torch.tensor(plan.positions, device=self.device)
        cos, sin = model.rotary.cos_sin(positions, self.dtype)
        x = model.embed(torch.tensor([r.generated[-1] for r in plan.reqs], device=self.device))
        fs = self._forced["decode"]
        stats = [StepStats(step=c.step) for c in plan.ctxs]
        forced = [StepStats(step=c.step) for c in plan.ctxs] if fs is not None else None
        for layer in range(self.arch.num_hidden_layers):
            q, k, v = model.qkv(layer, x, cos, sin)
            self._check_writes(plan, out, layer, k.float(), v.float())
            self._store_layer(out, layer, plan)
            want_w = [bool(sr and sr.weights and (sr.layers is None or layer in sr.layers)) for sr in plan.sreqs]
            want_s = [bool(sr and sr.sparsity and (sr.layers is None or layer in sr.layers)) for sr in plan.sreqs]
            force = forced is not None and (fs.layers is None or layer in fs.layers)
            every = [True] * len(seqs)
            o, lstats = decode_attention(cache, layer, seqs, q, self.sm_scale, every if force else want_w,
                                         every if force and fs.sparsity else want_s)
            for i, ls in enumerate(lstats):
                if ls is not None:
                    if want_w[i] or want_s[i]:
                        stats[i].layers[layer] = ls
                    if force:
                        forced[i].layers[layer] = ls
            x = model.finish_layer(layer, x, o)
        return model.logits(x), stats, forced

    def _check_writes(self, plan: DecodePlan, out: dict, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """This layer's write units: the graph's records against PyTorch's encoding (``_check_unit``); tokens
        appended to the residual buffer against PyTorch's rounding of its own K/V."""
        ko, vo = torch.from_numpy(out["k_new"][layer]), torch.from_numpy(out["v_new"][layer])
        where = f"decode step {self.step_no}, layer {layer}, request"
        res = self.cache.cfg.residual_dtype
        written = set()
        for i, w in plan.pending[layer]:
            written.add(i)
            fmt = w.pool.fmt.name
            recs = [out[f"l{layer}.{fmt}.write.{f.name}"][i:i + 1] for fs in _fields(fmt, *k.shape[1:]) for f in fs]
            if self.g == 1:
                live = torch.ones(1, 1, dtype=torch.bool)
                self._check_unit(f"{where} {i}", fmt, layer, k[i][None, None], v[i][None, None],
                                 ko[i][None, None], vo[i][None, None], live, recs, None)
                continue
            n = plan.buffered[i]  # the group: the buffered rows (shared state), then the token in the buffer's dtype
            bk = from_boundary(plan.feeds["buffer_k"][layer, i, :n], res)
            bv = from_boundary(plan.feeds["buffer_v"][layer, i, :n], res)

            def group(rows, token):
                return torch.cat([rows, token[None].to(res)]).float()[None]

            live = (torch.arange(self.g) <= n)[None]
            gaps = [_input_gap(x[i:i + 1], y[i:i + 1], None)[1] for x, y in ((k, ko), (v, vo))]
            self.rec.kv_max_diff = max(self.rec.kv_max_diff, *gaps)
            self._check_unit(f"{where} {i} (flush)", fmt, layer, group(bk, k[i]), group(bv, v[i]), group(bk, ko[i]),
                             group(bv, vo[i]), live, recs, res)
        if self.g > 1:
            for i in range(len(plan.seqs)):
                if i not in written:
                    self._check_buffer(f"{where} {i} (buffer)", k[i:i + 1], v[i:i + 1], ko[i:i + 1],
                                       vo[i:i + 1], res)

    def _check_unit(self, where: str, fmt: str, layer: int, kt, vt, ko, vo, live, graph_records: list[np.ndarray],
                    rounded: torch.dtype | None) -> None:
        self.rec.write_units += 1
        sc = self.cache.layer_scales(layer, fmt)
        r = compare_unit(fmt, kt, vt, ko, vo, live, graph_records, (sc.k, sc.v), rounded)
        if rounded is None:  # (a flush group's new row is measured before rounding, by the caller)
            self.rec.kv_max_diff = max(self.rec.kv_max_diff, r.input_diff)
        if r.mismatch:
            self.rec.mismatch(f"{where}: {r.mismatch}")
        elif r.codes or r.scales:
            f = self.rec.flips
            f.units += 1
            f.codes += r.codes
            f.scales += r.scales

    def _check_buffer(self, where: str, kt, vt, ko, vo, res: torch.dtype) -> None:
        """Tokens appended to the residual buffer: PyTorch's rows and the graph's, rounded to the buffer's dtype."""
        self.rec.buffer_rows += kt.shape[0]
        ok_k, gap_k = _input_gap(kt.float(), ko.float(), None)
        ok_v, gap_v = _input_gap(vt.float(), vo.float(), None)
        self.rec.kv_max_diff = max(self.rec.kv_max_diff, gap_k, gap_v)
        if not (ok_k and ok_v):
            self.rec.mismatch(f"{where}: K/V differ by {max(gap_k, gap_v):.1e} of their row (more than float rounding)")
            return
        diff = sum(int((x.to(res) != y.to(res)).sum()) for x, y in ((kt, ko), (vt, vo)))
        if diff:
            f = self.rec.flips
            f.units += 1
            f.buffer += diff

    def _compare_stats(self, where: str, graph: list[StepStats], torch_stats: list[StepStats], plan) -> None:
        """Positions attended and attention weights the policy reads: the graph's against PyTorch's."""
        for i, (a, b) in enumerate(zip(graph, torch_stats)):
            for layer, lb in b.layers.items():
                la = a.layers.get(layer)
                if la is None or lb.weights is None:
                    continue
                pa, pb = np.asarray(la.positions), np.asarray(lb.positions)
                if sorted(pa.tolist()) != sorted(pb.tolist()):
                    self.rec.mismatch(f"{where}, layer {layer}, request {i}: the graph's statistics cover other "
                                      "positions than PyTorch's")
                    continue
                oa, ob = np.argsort(pa, kind="stable"), np.argsort(pb, kind="stable")
                wa, wb = la.weights.float().numpy()[:, oa], lb.weights.float().numpy()[:, ob]
                if wa.size:
                    self.rec.stats_max_diff = max(self.rec.stats_max_diff, float(np.abs(wa - wb).max()))


def _polygraphy_compare(rec: _Recorder, atol: float, rtol: float) -> list[GraphCheck]:
    """Polygraphy's comparator over the recorded steps: ONNX Runtime's logits against PyTorch's."""
    from polygraphy.comparator import Comparator, RunResults
    from polygraphy.logger import G_LOGGER

    try:  # polygraphy >= 0.50; CompareFunc.simple before
        from polygraphy.comparator import SimpleCompareFunc as simple_compare
    except ImportError:
        from polygraphy.comparator import CompareFunc

        simple_compare = CompareFunc.simple

    G_LOGGER.module_severity = G_LOGGER.CRITICAL
    out = []
    for graph, (ort_logits, torch_logits) in rec.logits.items():
        results = RunResults()
        results.add([{"logits": x} for x in ort_logits], runner_name=f"onnxrt:{graph}")
        results.add([{"logits": x} for x in torch_logits], runner_name=f"torch:{graph}")
        accuracy = Comparator.compare_accuracy(results, compare_func=simple_compare(atol=atol, rtol=rtol))
        max_abs = max_rel = 0.0
        passed = 0
        for acc in accuracy:  # one AccuracyResult per compare function: runner pair -> per-iteration results
            for iterations in acc.values():
                for it in iterations:
                    r = it["logits"]
                    passed += bool(r)
                    max_abs, max_rel = max(max_abs, float(r.max_absdiff)), max(max_rel, float(r.max_reldiff))
        out.append(GraphCheck(f"{graph}.onnx", "logits", len(ort_logits), passed, max_abs, max_rel))
    return out


def lockstep_check(engine, export_dir: Path, prompts=CHECK_PROMPTS, steps: int = DEFAULT_STEPS,
                   atol: float = DEFAULT_ATOL, rtol: float = DEFAULT_RTOL) -> CheckReport:
    """Run ``prompts`` (one batch, greedy, ``steps`` decode steps) in lockstep on ``engine`` (a torch-runtime
    ``Engine``) and the export in ``export_dir``; compare every step."""
    from polygraphy.backend.onnxrt import OnnxrtRunner

    from trtkv.export.ort_session import open_sessions

    sessions = open_sessions(engine, Path(export_dir))
    rec = _Recorder()
    runners = {"prefill": OnnxrtRunner(sessions.prefill, name="onnxrt:prefill"),
               "decode_step": OnnxrtRunner(sessions.decode, name="onnxrt:decode_step")}
    policy = engine.policy
    cfg = dataclasses.replace(engine.cache_cfg, residual_group=policy.residual_group())
    core = LockstepCore(engine.model, policy, cfg, engine.eos_ids, engine.tokenizer.decode, engine.kv_amax,
                        sessions=sessions, reference=engine.core.model, recorder=rec, runners=runners)
    params = SamplingParams(max_tokens=steps + 1, ignore_eos=True)
    for r in runners.values():
        r.activate()
    try:
        scheduler = Scheduler(core, len(prompts))
        for prompt in prompts:
            scheduler.add(engine.make_request(prompt, params))
        while scheduler.has_work:
            scheduler.step()
    finally:
        for r in runners.values():
            r.deactivate()
    return CheckReport(_polygraphy_compare(rec, atol, rtol), rec.flips, rec.mismatches, rec.mismatch_count,
                       rec.tokens, rec.tokens_equal, rec.near_ties, rec.write_units, rec.buffer_rows,
                       rec.kv_max_diff, rec.stats_max_diff)


def run_check(engine, export_dir, atol: float = DEFAULT_ATOL, rtol: float = DEFAULT_RTOL,
              steps: int = DEFAULT_STEPS, prompts=CHECK_PROMPTS, log=print) -> CheckReport:
    """Check the export in ``export_dir`` against ``engine`` (a loaded torch-runtime ``Engine``, with the policy
    parameters the export was made with) in lockstep; print the report's lines through ``log``."""
    torch.manual_seed(0)
    report = lockstep_check(engine, Path(export_dir), prompts, steps, atol, rtol)
    for line in report.lines(atol, rtol):
        log(line)
    return report
