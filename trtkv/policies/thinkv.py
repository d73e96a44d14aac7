"""ThinKV (thought-adaptive KV compression), per shared/specs/thinkv.md.

* Classification (§2): every ``tau`` decode steps the sparsity of the current query in the calibrated
  layers L* labels the next ``tau`` tokens Reasoning / Execution / Transition; the prompt is R.
* TBQ (§3): a flush group of ``group`` tokens is stored in the format of its thought type
  (default R4E4T2: NVFP4, NVFP4, ternary).
* TBE (§4): at the end of every T segment all earlier segments anneal one step down the retention
  schedule (case 1); over budget, the oldest segment of the least important type anneals (case 2).
  Survivors are chosen by k-means over post-RoPE keys (``torch.ops.trtkv.kmeans_select``).
* CT (§5): evictions only flip validity bits; the cache reuses freed slots for later tokens of the
  same thought type (pages are dedicated to one type).

* One thought type (paper §E.10, ``thought_types=1``): on a model whose attention shows no thought
  structure (its calibration found no tri-modal layer) every token is R, so there are no transitions and
  eviction happens only at the budget (case 2). The calibration says which applies; ``--set`` overrides.

* Precision (``precision=``): one storage format per thought type from the whole format library —
  ``R4E4T2`` (paper), ``R4aE4aT2a`` (asymmetric INT4/INT2), ``R4oE4oT2o`` (key-offset NVFP4/ternary),
  ``R8E4T2``, ``R16E16T16``, the long form ``R:int4,E:nvfp4,T:ternary``, or ``auto``: ``trtkv build``
  measures the candidates on calibration traces and writes its choice (trtkv.build.format_selection).
  ThinKV fixes its formats this way, so it rejects ``kv_format``.

Variants: ``thinkv`` (TBQ + TBE), ``thinkv-tbq`` (quantize only), ``thinkv-tbe`` (evict only, 16-bit).
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from trtkv.errors import TrtkvError
from trtkv.policies.base import KVPolicy, ReportColumn, StatsRequest
from trtkv.policies.thinkv_anneal import AnnealRound, anneal_layer, evict_victims, plan_rounds, select_victims

if TYPE_CHECKING:
    from trtkv.artifacts.calibration import CalibrationArtifact

T, E, R = 0, 1, 2  # thought codes (paper's pseudocode order)
IMPORTANCE = {T: 0, E: 1, R: 2}
LETTER = {"T": T, "E": E, "R": R}
NAME = {T: "T", E: "E", R: "R"}
# Precision grammar: one code per thought type. Digits are element bits; the suffix picks the variant.
CODE_TO_FORMAT = {"2": "ternary", "2o": "ternaryo", "2a": "int2", "4": "nvfp4", "4o": "nvfp4o", "4a": "int4",
                  "8": "fp8", "16": "fp16", "16b": "bf16", "32": "fp32"}
CODE_ALIASES = {"4i": "4a", "2i": "2a"}  # the paper's Table 10 spelling of INT4/INT2
FORMAT_TO_CODE = {f: c for c, f in CODE_TO_FORMAT.items()}
PRECISION_HELP = ("R, E and T once each with a format code (2 ternary, 2o ternaryo, 2a int2, 4 nvfp4, 4o nvfp4o, "
                  "4a int4, 8 fp8, 16 fp16, 16b bf16, 32 fp32), e.g. R4aE4aT2a; or format names, "
                  "e.g. R:int4,E:nvfp4,T:ternary; or auto (chosen by measurement at build time)")


def parse_precision(spec: str) -> dict[int, str]:
    """A precision string -> {thought code: storage format}.

    Compact form ``R4E4T2`` (the paper's): each of R, E, T once, in any order, followed by a code:
    the element bits (2, 4, 8, 16, 32) and a variant suffix — none (the paper's symmetric formats: ternary,
    NVFP4, FP8, FP16, FP32), ``o`` (key-offset nvfp4o/ternaryo), ``a`` (asymmetric INT4/INT2, KIVI's
    formats; ``i`` is accepted as an alias), ``b`` (16b: bf16). Long form ``R:int4,E:nvfp4,T:ternary``
    names the formats directly. Letters are case-insensitive. Anything else raises one ValueError line."""
    text = str(spec).strip()
    got: dict[int, str] = {}
    long_form = re.fullmatch(r"\s*[RETret]\s*:\s*\w+\s*(,\s*[RETret]\s*:\s*\w+\s*)*", text)
    if long_form:
        parts = [(a.strip().upper(), b.strip().lower()) for a, b in (p.split(":") for p in text.split(","))]
        if any(f not in FORMAT_TO_CODE for _, f in parts):
            bad = next(f for _, f in parts if f not in FORMAT_TO_CODE)
            raise ValueError(f"precision {spec!r}: unknown format {bad!r}; expected {PRECISION_HELP}")
    elif re.fullmatch(r"([RETret](?:\d+[oOaAiIbB]?))+", text):
        parts = []
        for t, c in re.findall(r"([RETret])(\d+[oOaAiIbB]?)", text):
            c = CODE_ALIASES.get(c.lower(), c.lower())
            if c not in CODE_TO_FORMAT:
                raise ValueError(f"precision {spec!r}: no format code {c!r}; expected {PRECISION_HELP}")
            parts.append((t.upper(), CODE_TO_FORMAT[c]))
    else:
        raise ValueError(f"precision {spec!r} is not valid; expected {PRECISION_HELP}")
    for t, f in parts:
        if LETTER[t] in got:
            raise ValueError(f"precision {spec!r} names {t} twice; expected {PRECISION_HELP}")
        got[LETTER[t]] = f
    if set(got) != {R, E, T}:
        missing = "".join(NAME[c] for c in (R, E, T) if c not in got)
        raise ValueError(f"precision {spec!r} has no format for {missing}; expected {PRECISION_HELP}")
    return got


def format_precision(formats: dict[int, str]) -> str:
    """The compact string of ``{thought: format}`` (``R4aE4aT2a``); inverse of :func:`parse_precision`."""
    return "".join(f"{NAME[c]}{FORMAT_TO_CODE[formats[c]]}" for c in (R, E, T))


@dataclass
class Segment:
    sid: int
    thought: int  # -1 until labelled
    start: int  # decode index of its first token (-1: the prompt)
    level: int = 0
    live: int = 0  # tokens in pages (identical in every layer)
    is_prefill: bool = False

    def end(self, tau: int) -> int:
        return self.start + tau


@dataclass
class ThinKVState:
    segments: list = field(default_factory=list)  # Segment records; [0] is the prompt
    ops: list = field(default_factory=list)  # this step's anneals: (segment, target live count)
    tokens: dict = field(default_factory=lambda: {R: 0, E: 0, T: 0})  # generated tokens per thought type
    evict_steps: int = 0
    overflows: int = 0
    anneals: int = 0  # case-1 (transition) anneal events
    labels: list = field(default_factory=list)
    sparsity: list = field(default_factory=list)
    buffered: int = 0  # residual-buffer fill after the last step
    live: int = 0  # the decode segments' live tokens, summed (each change of a segment's ``live`` changes it)


@dataclass
class ThinKVPolicy(KVPolicy):
    name = "thinkv"
    State = ThinKVState
    description = "ThinKV: thought-typed quantization (TBQ) + segment eviction with k-means (TBE), in-place reuse"
    budget: int | None = 1024  # k: live decode tokens per layer (prompt and residual buffer excluded)
    precision: str = "R4E4T2"  # formats per thought type (parse_precision), or "auto": measured at build time
    avg_bits: float | None = None  # precision=auto: budget of stored bits per element (None: the default's)
    tau: int = 128  # refresh interval = segment length
    group: int = 16  # g: residual buffer / quantization group
    retention: tuple[int, ...] = (64, 32, 16, 8, 4)
    tbq: bool = True
    tbe: bool = True
    anneal_triggering_t: bool = False
    budget_mode: str = "soft"  # "soft": overflow counted; "hard": evict minimum-level segments entirely
    kmeans_iters: int = 10
    thresholds: tuple[float, ...] = ()  # (theta_low, theta_high) from calibration
    thought_types: int | None = None  # 3 (R/E/T) or 1 (paper §E.10: all R); None: the calibration's (else 3)
    layers: tuple[int, ...] = ()  # L* from calibration
    thought_schedule: str = ""  # forced labels per segment, e.g. "RRTE..." (replay for synthetic weights, tests)
    stats_every_step: bool = False
    _formats: dict[int, str] = field(default_factory=dict, init=False, repr=False)

    def __post_init__(self) -> None:
        self._round_plan = None  # (requests, first one's ops, rounds): a step's anneal rounds (_anneal_rounds)
        self._victims_ahead = None  # (requests, each layer's victims): selected at the step's first layer
        if self.kv_format not in ("auto", "fp32", "fp16", "bf16"):  # build writes the engine dtype back
            self._fixed_format_error()
        if self.avg_bits is not None and not self.avg_bits > 0:
            raise ValueError(f"avg_bits must be positive, got {self.avg_bits}")
        self._formats = {} if not self.tbq or self.precision_is_auto() else parse_precision(self.precision)
        if self.tau <= 0 or self.group <= 0 or self.tau % self.group:
            raise ValueError(f"group ({self.group}) must divide tau ({self.tau})")
        if self.group < 2:
            raise ValueError("group must be >= 2 (a segment's label is known one step after it opens)")
        if not self.retention or any(r <= 0 for r in self.retention) or list(self.retention) != sorted(
                self.retention, reverse=True):
            raise ValueError("retention must be a decreasing list of positive token counts, e.g. 64,32,16,8,4")
        if self.budget_mode not in ("soft", "hard"):
            raise ValueError("budget_mode must be soft or hard")
        if self.thresholds and (len(self.thresholds) != 2 or not self.thresholds[0] < self.thresholds[1]):
            raise ValueError("thresholds must be two increasing values theta_low,theta_high")
        if self.thought_types not in (None, 1, 3):
            raise ValueError(f"thought_types must be 1 or 3, got {self.thought_types}")
        bad = set(self.thought_schedule.upper()) - set("RET")
        if bad:
            raise ValueError(f"thought_schedule may only contain R, E, T (got {''.join(sorted(bad))})")

    def params(self) -> dict[str, Any]:
        d = super().params()
        d.pop("_formats", None)
        return d

    def precision_is_auto(self) -> bool:
        """precision=auto: ``trtkv build`` measures candidate formats (trtkv.build.format_selection)."""
        return self.tbq and str(self.precision).strip().lower() == "auto"

    def needs_format_selection(self) -> bool:
        return self.precision_is_auto()

    def set_precision(self, precision: str) -> None:
        """Fix the formats (the builder's format selection writes its choice here)."""
        self._formats = parse_precision(precision)
        self.precision = format_precision(self._formats)

    # --- formats ----------------------------------------------------------------------------
    def _fixed_format_error(self) -> None:
        same = format_precision({c: self.kv_format for c in (R, E, T)}) if self.kv_format in FORMAT_TO_CODE else None
        raise ValueError(f"{self.name} stores each thought type in the format precision= names; kv_format="
                         f"{self.kv_format} is not accepted (use precision={same or 'R4aE4aT2a'})")

    def resolve_formats(self, model_dtype: str) -> None:
        if self.kv_format not in ("auto", model_dtype):
            try:
                self._fixed_format_error()
            except ValueError as e:
                raise TrtkvError(str(e)) from None
        super().resolve_formats(model_dtype)
        if not self.tbq:  # 16-bit storage for every type; keep the buffer so labels precede writes
            self._formats = {c: "fp16" for c in (R, E, T)}

    def formats(self) -> set[str]:
        if self.precision_is_auto():
            raise TrtkvError("precision=auto is resolved by `trtkv build` (it measures the formats); rebuild the "
                             "engine or set a precision such as R4E4T2")
        if self._all_reasoning():  # every segment is R: the other types' formats are never written
            return {self._formats[R]}
        return set(self._formats.values())

    def _all_reasoning(self) -> bool:
        """Every segment is labelled R: one thought type (paper §E.10) or no calibration, and no replayed
        schedule. Then the cache needs no pool (and admission reserves no pages) for E's and T's formats."""
        return not self.thought_schedule and not self._labels_by_sparsity()

    def residual_group(self) -> int:
        return self.group

    def flush_prompt_tail(self) -> bool:
        return True  # decode groups then align with segments (spec §3.4)

    def max_live_tokens(self, prompt_len: int, max_tokens: int) -> int:
        """Soft bound (spec §5.8): the prompt, max(k, min retention x segments), the open segment and a
        flush group; without TBE every token stays."""
        if not self.tbe or self.budget is None:
            return prompt_len + max_tokens
        segments = -(-max_tokens // self.tau)
        decode = max(self.budget, self.retention[-1] * segments) + self.tau + self.group
        return prompt_len + min(max_tokens, decode)

    def needs_calibration(self) -> bool:
        """Labels need calibrated layers and thresholds unless replayed, single-typed or given outright."""
        return not (self.thought_schedule or self.thought_types == 1 or (self.thresholds and self.layers))

    def load_calibration(self, artifact: CalibrationArtifact | None) -> None:
        """Take L*, thresholds and the thought-type count from the engine's calibration unless given."""
        if artifact is None:
            return
        if self.thought_types is None:
            self.thought_types = artifact.thought_types
        if not self.layers:
            self.layers = tuple(artifact.layers)
        if not self.thresholds:
            self.thresholds = tuple(artifact.thresholds)
            if not self.thresholds[0] < self.thresholds[1]:
                raise TrtkvError("calibration thresholds must satisfy theta_low < theta_high; recalibrate")

    @classmethod
    def report_columns(cls) -> tuple[ReportColumn, ...]:
        """avg bits: element bits over generated tokens (the paper's convention); stored bits: over the tokens
        held at the end; evictions/step: decode steps with an eviction event / decode steps."""
        return (ReportColumn("avg bits", "thinkv.avg_element_bits", ".2f"),
                ReportColumn("stored bits", "thinkv.avg_stored_bits", ".2f"),
                ReportColumn("R", "thinkv.thought_shares.R", ".0%"),
                ReportColumn("E", "thinkv.thought_shares.E", ".0%"),
                ReportColumn("T", "thinkv.thought_shares.T", ".0%"),
                ReportColumn("evictions/step", "thinkv.eviction_call_rate", ".4f"),
                ReportColumn("segments", "thinkv.segments", ".1f"),
                ReportColumn("overflows", "thinkv.budget_overflows", ".1f"))

    # --- per-request state ------------------------------------------------------------------
    def on_request_init(self, req) -> None:
        req.state.segments.append(Segment(0, R, -1, is_prefill=True))

    def _open(self, req) -> Segment:
        return req.state.segments[-1]

    def _label_forced(self, index: int) -> int | None:
        if not self.thought_schedule:
            return None
        return LETTER[self.thought_schedule[index % len(self.thought_schedule)].upper()]

    def classify(self, u: float) -> int:
        lo, hi = self.thresholds
        return T if u >= hi else (R if u >= lo else E)

    def write_class(self, req) -> tuple[str, int, int]:
        seg = self._open(req)
        thought = seg.thought if seg.thought >= 0 else R
        return self._formats[thought], thought, seg.sid

    def prefill_class(self, req) -> tuple[str, int, int]:
        return self._formats[R], R, 0

    def _labels_by_sparsity(self) -> bool:
        return bool(self.thresholds) and self.thought_types != 1 and not self.thought_schedule

    def stats_request(self, req, phase: str):
        if phase != "decode" or not self._labels_by_sparsity():
            return None
        if req.step % self.tau == 0 or self.stats_every_step:
            return StatsRequest(layers=self.layers or None, sparsity=True)
        return None

    def on_prefill_end(self, req, stats) -> None:
        req.state.segments[0].live = req.num_paged(0)
        req.state.buffered = req.num_buffered(0)

    # --- TBE decision (once per request and step, spec §4.6) --------------------------------
    def on_decode_step_begin_batch(self, reqs) -> None:
        """``on_decode_step_begin`` of each request, but a step that opens no segment and keeps a request within
        its budget (most steps) needs no decision: its ops stay empty (``on_decode_step_end`` emptied them)."""
        tau, group = self.tau, self.group
        budget = self.budget if self.tbe else None
        for req in reqs:
            st = req.state
            if req.step % tau and not st.ops and (
                    budget is None or st.live + (st.buffered + 1 if st.buffered + 1 >= group else 0) <= budget):
                continue
            self.on_decode_step_begin(req)

    def on_decode_step_begin(self, req) -> None:
        st, i = req.state, req.step
        segs: list[Segment] = st.segments
        ops: list[tuple[Segment, int]] = []
        if i % self.tau == 0:
            closed = segs[-1] if not segs[-1].is_prefill else None
            segs.append(Segment(len(segs), self._label_forced(len(segs) - 1) if self.thought_schedule else -1, i))
            if self.tbe and closed is not None and closed.thought == T:  # case 1: a transition just ended
                st.anneals += 1
                for seg in self._closed(req):
                    if seg is closed and not self.anneal_triggering_t:
                        continue
                    if seg.level < len(self.retention):
                        ops.append((seg, self._step_down(st, seg)))
        if self.tbe and self.budget is not None:
            will_flush = st.buffered + 1 >= self.group
            live_after = st.live + (st.buffered + 1 if will_flush else 0)
            while live_after > self.budget:  # case 2: least important type first, then oldest
                cands = [s for s in self._closed(req) if s.level < len(self.retention)]
                if not cands:
                    if self.budget_mode == "hard":
                        mins = [s for s in self._closed(req) if s.live > 0]
                        if mins:
                            seg = min(mins, key=lambda s: (IMPORTANCE[s.thought], s.start))
                            ops.append((seg, 0))
                            live_after -= seg.live
                            st.live -= seg.live
                            seg.live = 0
                            continue
                    st.overflows += 1
                    break
                kind = min({s.thought for s in cands}, key=IMPORTANCE.__getitem__)
                seg = min((s for s in cands if s.thought == kind), key=lambda s: s.start)
                before = seg.live
                ops.append((seg, self._step_down(st, seg)))
                live_after -= before - seg.live
        st.ops = [(seg, target) for seg, target in ops]
        if any(True for _ in ops):
            st.evict_steps += 1

    def _closed(self, req) -> list[Segment]:
        return [s for s in req.state.segments[:-1] if not s.is_prefill]

    def _step_down(self, st: ThinKVState, seg: Segment) -> int:
        target = min(seg.live, self.retention[min(seg.level, len(self.retention) - 1)])
        seg.level += 1
        st.live -= seg.live - target
        seg.live = target
        return target

    def before_attention(self, req, layer: int) -> None:
        anneal_layer(layer, self._anneal_rounds([req]), self.kmeans_iters)  # (a lone request: layer by layer)

    acts_in_own_layer = True  # (an anneal evicts its layer's victims)

    def acts_before_attention(self, reqs) -> bool:
        return any(req.state.ops for req in reqs)  # this step's anneals (on_decode_step_begin)

    def before_attention_batch(self, reqs, layer: int) -> None:
        """Apply this step's anneals in this layer (after its flush): k-means keeps ``target`` tokens
        (``trtkv/policies/thinkv_anneal.py``). When every job's tokens read the same in each layer at the step's
        first layer as at its own turn, the first layer selects every layer's victims at once; each layer still
        evicts its own before its attention."""
        rounds = self._anneal_rounds(reqs)
        ahead = self._victims_ahead
        if layer == 0:
            ahead = self._victims_ahead = self._select_ahead(reqs, rounds)
        if ahead is not None and ahead[0] is reqs:
            evict_victims(layer, ahead[1][layer])
        else:
            anneal_layer(layer, rounds, self.kmeans_iters)

    def _select_ahead(self, reqs, rounds: list[AnnealRound]) -> tuple[list, list] | None:
        """``(reqs, each layer's victims)`` selected now, when no job reaches a position that may change before
        a later layer's turn (``RequestContext.reads_ahead``); else None."""
        if not rounds or reqs[0].num_layers < 2:
            return None
        ahead = reqs[0].reads_ahead(reqs)
        if any((r.hi > ahead[r.who]).any() for r in rounds):
            return None
        return reqs, select_victims(rounds, self.kmeans_iters)

    def _anneal_rounds(self, reqs) -> list[AnnealRound]:
        """This step's anneals of ``reqs`` as rounds of jobs, worked out once a step: every layer passes the same list
        and the ops do not change during the step."""
        plan = self._round_plan
        if plan is not None and plan[0] is reqs and plan[1] is reqs[0].state.ops:
            return plan[2]
        rounds = plan_rounds(reqs, self.tau)
        self._round_plan = (reqs, reqs[0].state.ops, rounds) if reqs else None
        return rounds

    # --- after each step: label the open segment at refresh steps, account tokens -----------
    def on_decode_step_end_batch(self, reqs, stats) -> None:
        """``on_decode_step_end`` of each request, their buffers' fill read in one call."""
        if not reqs:
            return
        for req, s, buffered in zip(reqs, stats, reqs[0].num_buffered_many(0, reqs).tolist()):
            self._end_step(req, s, buffered)

    def on_decode_step_end(self, req, stats) -> None:
        self._end_step(req, stats, req.num_buffered(0))

    def _end_step(self, req, stats, buffered: int) -> None:
        st = req.state
        seg = self._open(req)
        i = stats.step
        if i % self.tau == 0:
            if seg.thought < 0:
                if self._labels_by_sparsity() and stats.layers:
                    u = float(np.mean([ls.sparsity for ls in stats.layers.values()]))
                    st.sparsity.append(u)
                    seg.thought = self.classify(u)
                else:
                    seg.thought = R  # one type, or no calibration: all R (no T, so no case-1 anneals)
            st.labels.append(NAME[seg.thought])
        st.tokens[seg.thought if seg.thought >= 0 else R] += 1
        st.buffered = buffered
        flushed_now = st.buffered == 0
        if flushed_now:
            seg.live += self.group
            if not seg.is_prefill:
                st.live += self.group
        st.ops = []
        self._round_plan = self._victims_ahead = None  # (the step's requests are not held past it)

    def extra_stats(self, req) -> dict[str, Any]:
        from plugins.formats import get_format

        st = req.state
        toks = st.tokens
        n = max(1, sum(toks.values()))
        bits = sum(get_format(self._formats[c]).element_bits * toks[c] for c in toks) / n
        held = req.stored_formats(0)
        n_held = sum(held.values())
        stored_bits = sum(get_format(f).element_bits * n for f, n in held.items()) / n_held if n_held else None
        steps = max(1, req.step)
        return {
            "thinkv": {
                "avg_element_bits": round(bits, 3),  # paper's convention, over generated tokens
                "avg_stored_bits": round(stored_bits, 3) if stored_bits is not None else None,  # live paged tokens
                "thought_shares": {NAME[c]: round(toks[c] / n, 4) for c in (R, E, T)},
                "thought_types": 1 if self.thought_types == 1 else 3,
                "labels": "".join(st.labels),
                "segments": len(st.segments) - 1,
                "eviction_steps": st.evict_steps,
                "eviction_call_rate": round(st.evict_steps / steps, 5),
                "transition_anneals": st.anneals,
                "budget_overflows": st.overflows,
                "live_decode_tokens": st.live,
            }
        }


@dataclass
class ThinKVTBQPolicy(ThinKVPolicy):
    name = "thinkv-tbq"
    description = "ThinKV ablation: thought-based quantization only (no eviction)"
    budget: int | None = None
    tbe: bool = False


@dataclass
class ThinKVTBEPolicy(ThinKVPolicy):
    name = "thinkv-tbe"
    description = "ThinKV ablation: thought-based eviction only (16-bit storage)"
    tbq: bool = False

