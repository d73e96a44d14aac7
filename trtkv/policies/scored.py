"""``ScorerPolicy``: the shared base of every "score the tokens, keep the best, evict the rest" policy.

A subclass names its :class:`~trtkv.policies.scorers.Scorer` and its knobs; the base owns the rest, once:

* **cadence** (:class:`Cadence`): an eviction event every ``every`` decode steps, the last ``observe`` steps
  before each event (and the prefill, when it cuts the prompt) feeding the scorer's evidence;
* **protection**: the first ``n_sink`` tokens, the ``recent`` most recent ones and the residual buffer
  (not evictable until flushed) are never candidates;
* **selection**: each layer holding more than its target keeps its top-scored candidates (ties: the newer
  token) and evicts the rest; with ``hard_cap`` the target leaves room for the tokens written before the
  next event, so no step ever attends more than the budget.

H2O, TOVA, SnapKV, R-KV, LazyEviction, random and PyramidKV are such subclasses; AMS wraps a scorer with
its own selection instead (``trtkv/policies/ams.py``).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from plugins import ops as plugin_ops
from trtkv.policies.base import KVPolicy, StatsRequest, StepBatch, every_row
from trtkv.policies.scorers import Scorer, head_mean
from trtkv.policies.scoring import lowest, sorted_member, top_keep


@dataclass(frozen=True)
class Cadence:
    """Eviction events at decode steps ``t % every == 0`` (``t`` 1-based); steps ``t`` with
    ``(-t) % every < observe`` are the evidence window before an event (``observe >= every``: every step)."""

    every: int
    observe: int = 1

    def is_event(self, t: int) -> bool:
        return self.every > 0 and t % self.every == 0

    def observing(self, t: int) -> bool:
        return self.every > 0 and (-t) % self.every < self.observe


@dataclass
class ScoredState:
    memo: Any = None  # the scorer's per-request evidence
    events: int = 0  # eviction events that evicted in at least one layer


@dataclass
class ScorerPolicy(KVPolicy):
    """Base of the scoring policies; see the module docstring. Subclasses implement ``make_scorer`` and
    ``cadence`` and may override ``protected``, ``layer_budget``, ``keep`` and the flags below."""

    State = ScoredState
    hard_cap = False  # target = budget - cadence.every (room for the next tokens) instead of budget
    evict_protected_when_short = False  # hard caps: evict protected tokens (lowest score) if candidates run out
    cut_prompt = True  # run an event right after prefill when the prompt exceeds the target
    # keep() keeps the k best scores, ties to the newer token: a one-token cut then takes the first minimum
    # directly (here and for a whole batch, ``lone_victims``). A policy whose keep() differs sets False.
    keeps_best_scores = True
    # a step's due events may run together (``events``); a policy that changes how one event runs (``event``,
    # ``evict_layer``, ``keep``) sets False and gets one ``event`` per request, in request order.
    batched_events = True

    def __post_init__(self) -> None:
        self._scorer: Scorer = self.make_scorer()

    # --- what subclasses provide ---------------------------------------------------------------
    def make_scorer(self) -> Scorer:
        raise TypeError(f"{type(self).__name__} must define make_scorer()")

    @property
    def cadence(self) -> Cadence:
        raise TypeError(f"{type(self).__name__} must define cadence")

    @property
    def n_sink(self) -> int:
        return 0

    @property
    def recent(self) -> int:
        return 0

    def layer_budget(self, req, layer: int) -> int:
        return self.budget

    # --- derived --------------------------------------------------------------------------------
    @property
    def scorer(self) -> Scorer:
        return self._scorer

    def bind_model(self, arch) -> None:
        self.scorer.bind_model(arch)

    def target(self, req, layer: int) -> int:
        return self.layer_budget(req, layer) - (self.cadence.every if self.hard_cap else 0)

    def max_live_tokens(self, prompt_len: int, max_tokens: int) -> int:
        """Hard cap: the budget (or the uncut prompt); soft: budget + one cadence of growth; plus the buffer."""
        total, g = prompt_len + max_tokens, self.residual_group()
        peak = self.max_layer_budget()
        if self.hard_cap:
            return min(total, max(prompt_len, peak)) + g - 1
        if self.cut_prompt:
            return max(prompt_len, min(total, peak + self.cadence.every)) + g - 1
        return min(total, max(prompt_len, peak) + self.cadence.every) + g - 1

    def max_layer_budget(self) -> int:
        return self.budget

    def _prompt_is_cut(self, req) -> bool:
        return self.cut_prompt and req.prompt_len > min(self.target(req, layer) for layer in range(req.num_layers))

    # --- hooks ----------------------------------------------------------------------------------
    def on_request_init(self, req) -> None:
        req.state.memo = self.scorer.new_memo()

    def stats_request(self, req, phase: str) -> StatsRequest | None:
        if phase == "prefill":
            return self.scorer.stats_request(req, phase, self._prompt_is_cut(req))
        return self.scorer.stats_request(req, phase, self.cadence.observing(req.step + 1))

    def stats_requests(self, reqs, phase: str) -> list[StatsRequest | None]:
        """``stats_request`` of each, the cadence read once (a property that builds it: 256 a step add up)."""
        if phase == "prefill" or type(self).stats_request is not ScorerPolicy.stats_request:
            return super().stats_requests(reqs, phase)
        observing, ask = self.cadence.observing, self.scorer.stats_request
        return [ask(r, phase, observing(r.step + 1)) for r in reqs]

    def on_prefill_end(self, req, stats) -> None:
        self.scorer.observe(req, req.state.memo, stats, "prefill")
        if self._prompt_is_cut(req):
            self.event(req)

    def on_prefill_end_batch(self, reqs, stats) -> None:
        """Every prompt observed, then the cut ones' events together (``events_rows``, as at a decode step whose
        statistics are not in batch form): a request's observation and cut touch no other request's."""
        if (type(self).on_prefill_end is not ScorerPolicy.on_prefill_end
                or not (self.batched_events and self.keeps_best_scores and self.scorer.batches
                        and self.scorer.rows_any_step)):
            return super().on_prefill_end_batch(reqs, stats)
        for req, st in zip(reqs, stats):
            self.scorer.observe(req, req.state.memo, st, "prefill")
        due = [req for req in reqs if self._prompt_is_cut(req)]
        if len(due) > 1:
            self.events_rows(due)
        elif due:
            self.event(due[0])

    def on_decode_step_end(self, req, stats) -> None:
        self.scorer.observe(req, req.state.memo, stats, "decode")
        if self.cadence.is_event(req.step):
            self.event(req, stats)

    @property
    def batch_stats(self) -> bool:
        """Statistics in batch form when the scorer takes them so (its events run together when they may,
        else request by request)."""
        return self.scorer.batches

    @property
    def batch_weights(self) -> bool:
        return self.scorer.batch_weights

    def on_request_finish(self, req) -> None:
        self.scorer.release(req.state.memo)

    def on_decode_step_end_batch(self, reqs, stats) -> None:
        """Every request observes its step, then the requests whose cadence fires have their events together
        (``events``, or ``events_rows`` for statistics in batch form); with ``batched_events`` False, request by
        request."""
        is_event = self.cadence.is_event
        if stats and stats[0].batch is not None:
            rows = np.fromiter((st.row for st in stats), np.int64, len(stats))
            self.scorer.observe_batch(reqs, [r.state.memo for r in reqs], stats[0].batch, rows)
            due = [i for i, r in enumerate(reqs) if is_event(r.step)]
            if due and self.batched_events and self.keeps_best_scores:
                self.events_rows([reqs[i] for i in due], stats[0].batch, rows[due])
            elif due:
                self.events_each([reqs[i] for i in due])
            return
        if not (self.batched_events and self.keeps_best_scores):  # lone_victims assumes keep's best-score rule
            return super().on_decode_step_end_batch(reqs, stats)
        due = []
        observe = self.scorer.observe
        for req, st in zip(reqs, stats):
            observe(req, req.state.memo, st, "decode")
            if is_event(req.step):
                due.append((req, st))
        if len(due) > 1 and self.scorer.batches and self.scorer.rows_any_step:
            self.events_rows([req for req, _ in due])
        elif len(due) > 1:
            self.events(due)
        elif due:
            self.event(*due[0])

    def events_each(self, due: list) -> None:
        """The events of ``due`` at one step, for a policy whose events run one by one (``batched_events``
        False): ``event`` of each in request order. A policy may override this to run them together."""
        for req in due:
            self.event(req)  # (the positions attention saw are not split per request here)

    # --- one event ------------------------------------------------------------------------------
    def event(self, req, stats=None) -> None:
        """Cut every layer to its target. ``stats``: this step's attention statistics, whose positions are
        the layers' held tokens when nothing is buffered or on a host tier (saves reading them again)."""
        acted = False
        layers = stats.layers if stats is not None else {}
        for layer in range(req.num_layers):
            ls = layers.get(layer)
            acted |= self.evict_layer(req, layer, self.target(req, layer), None if ls is None else ls.positions)
        req.state.events += int(acted)
        self.scorer.reset(req.state.memo)

    def events(self, due: list) -> None:
        """``event`` of several ``(request, stats)`` at one step, layer by layer. In each layer the requests
        cut by one token with nothing buffered (a full cache's step) get their victims from array operations
        over the batch (``lone_victims``) and are evicted in one ``evict_many``;
        any other request goes through ``evict_layer`` at its turn. So each layer's evictions run in request
        order, as one event after another would run them (the cache's pools are per layer), on the same victims."""
        acted = [False] * len(due)
        for layer in range(due[0][0].num_layers):
            over = []  # (request, positions attention saw) of the requests over their target in this layer
            for i, (req, st) in enumerate(due):
                if req.num_live(layer) > self.target(req, layer):
                    acted[i] = True
                    ls = st.layers.get(layer)
                    over.append((req, None if ls is None else ls.positions))
            run = []  # one-victim evictions not yet executed
            for (req, attended), victim in zip(over, self.lone_victims(layer, over)):
                if victim is not None:
                    run.append((req, victim))
                    continue
                if run:
                    req.evict_many(layer, run)
                    run = []
                self.evict_layer(req, layer, self.target(req, layer), attended)
            if run:
                run[0][0].evict_many(layer, run)
        for (req, _), a in zip(due, acted):
            req.state.events += int(a)
            self.scorer.reset(req.state.memo)

    def events_rows(self, due: list, batch: dict | None = None, rows: np.ndarray | None = None) -> None:
        """``events`` of ``due`` by array operations over the batch. In each layer the requests one token over
        their target with nothing buffered have their victims chosen together — held positions (what this
        step's statistics in batch form saw, ``rows[i]`` being ``due[i]``'s row of them, when they saw exactly
        the held tokens; else the cache's), protected ones masked, the scorer's ``score_rows`` argmin'd (the
        first minimum: ties to the older token, as ``evict_layer`` chooses); the others go through
        ``evict_layer``. The chosen victims are evicted by one ``evict_each`` in a layer that has others, else by
        one ``evict_each_layers`` for all such layers after the last (layers share no state)."""
        first = due[0]
        position = np.fromiter((r.position for r in due), np.int64, len(due))
        handle = self.scorer.batch_rows(due, [r.state.memo for r in due])
        same = type(self).layer_budget is ScorerPolicy.layer_budget  # one target for every request
        stacked = same and self._lone_events_layers(due, batch, rows, position, handle)
        acted = np.full(len(due), stacked)
        later_layers, later = [], []  # layers whose only evictions are one victim a request: all at the end
        for layer in () if stacked else range(first.num_layers):
            live = first.num_live_many(layer, due)
            target = np.full(len(due), self.target(first, layer), np.int64) if same else \
                np.fromiter((self.target(r, layer) for r in due), np.int64, len(due))
            over = np.flatnonzero(live > target)
            if not len(over):
                continue
            acted[over] = True
            bs = batch.get(layer) if batch is not None else None
            done = np.zeros(len(due), bool)
            victims = None
            if bs is not None or batch is None:
                seen = bs.counts[rows[over]] if bs is not None else first.num_paged_many(layer, due)[over]
                lone = over[(live[over] == target[over] + 1) & (seen == live[over])]
                for n in np.unique(live[lone]).tolist():  # one stack per held count
                    at = lone[live[lone] == n]
                    held = np.sort(bs.positions[rows[at]], axis=1)[:, -n:] if bs is not None else \
                        first.live_positions_each(layer, due, at, n)
                    prot = self.protected_rows_at(position[at], held)
                    scores = self.scorer.score_rows(layer, handle[at], held, ~prot).float()
                    scores = scores.masked_fill(torch.from_numpy(prot).to(scores.device), float("inf"))
                    best = torch.argmin(scores, dim=1)
                    low = scores.gather(1, best[:, None])[:, 0]
                    ok = (~torch.isinf(low)).cpu().numpy()  # (no candidate, or only infinite scores: evict_layer)
                    best = best.cpu().numpy()
                    if ok.any():
                        if victims is None:
                            victims = np.full(len(due), -1, np.int64)
                        victims[at[ok]] = held[np.flatnonzero(ok), best[ok]]
                        done[at[ok]] = True
            rest = over[~done[over]].tolist()
            if victims is not None and rest:  # the one-victim requests first, then the others, in this layer
                first.evict_each(layer, due, victims)  # (the same list every layer: rows looked up once)
            elif victims is not None:  # (layers share no state: evicting them later changes nothing in between)
                later_layers.append(layer)
                later.append(victims)
            for i in rest:
                self.evict_layer(due[i], layer, int(target[i]))
        if later:
            first.evict_each_layers(np.asarray(later_layers, np.int64), due, np.stack(later))
        for r, a in zip(due, acted.tolist()):
            r.state.events += int(a)
            self.scorer.reset(r.state.memo)

    def _lone_events_layers(self, due: list, batch: dict | None, rows: np.ndarray | None, position: np.ndarray,
                            handle: np.ndarray) -> bool:
        """``events_rows``'s steady state in one pass over every layer: when every due request is one token over
        its target in every layer with nothing buffered (and the statistics in batch form, if any, saw exactly
        its held tokens, every layer's of one width), the victims are chosen on one ``[L, k, n]`` stack — the
        same sort, protection, scores and first minimum as layer by layer — and evicted by one
        ``evict_each_layers``. False (nothing done) otherwise, or when some row has no finite candidate
        (``evict_layer``'s own path)."""
        first, L, k = due[0], due[0].num_layers, len(due)
        live = first.num_live_layers(due)
        n = int(live[0, 0])
        if not (live == n).all() or any(self.target(first, layer) != n - 1 for layer in range(L)):
            return False
        if batch is None:  # held positions from the cache
            if (first.num_paged_layers(due) != n).any():
                return False
            held = first.live_positions_layers(due, n)
        else:
            stats = [batch.get(layer) for layer in range(L)]
            if any(bs is None for bs in stats) or len({bs.positions.shape for bs in stats}) != 1:
                return False
            counts = batch.counts_layers() if isinstance(batch, StepBatch) else None
            if (counts[:, rows] != n).any() if counts is not None else \
                    any((bs.counts[rows] != n).any() for bs in stats):
                return False
            stacked = batch.positions_layers() if isinstance(batch, StepBatch) else None
            if stacked is None:
                stacked = np.stack([bs.positions for bs in stats])
            cols = stacked if every_row(rows, len(stats[0].counts)) else stacked[:, rows]
            victims = self._victims_in_columns(position, handle, cols)
            if victims is not None:
                if (victims < 0).any():
                    return False
                first.evict_each_layers(np.arange(L), due, victims)
                return True
            held = np.sort(cols, axis=2)[:, :, -n:]
        victims = self._shared_victims(handle, held)
        if victims is None:
            prot = self.protected_rows_at(np.tile(position, L), held.reshape(L * k, n)).reshape(L, k, n)
            victims = _lowest_victims(self.scorer.score_rows_layers(handle, held, ~prot), held, prot)
        if (victims < 0).any():
            return False
        first.evict_each_layers(np.arange(L), due, victims)
        return True

    def _shared_victims(self, handle: np.ndarray, held: np.ndarray) -> np.ndarray | None:
        """``_lone_events_layers``'s victims ``[L, k]`` when the scorer scores every row alike
        (``shared_scores_layers``) and protection is by column alone (this class's sinks and recent window): one
        first minimum a layer, each row's victim its held position at that column (-1 everywhere: no finite
        candidate). None otherwise."""
        if type(self).protected_rows_at is not ScorerPolicy.protected_rows_at:
            return None
        L, k, n = held.shape
        free = ~self.protected_rows_at(np.zeros(1, np.int64), np.zeros((1, n), np.int64))[0]
        scores = self.scorer.shared_scores_layers(handle, L, free)
        if scores is None:
            return None
        best = torch.argmin(scores, dim=1)  # (NaN is the minimum, ties to the older column: lowest_victim's rule)
        if torch.isinf(scores.gather(1, best[:, None])).any():
            return np.full((L, k), -1, np.int64)
        return held[np.arange(L), :, best.numpy()]

    def _victims_in_columns(self, position: np.ndarray, handle: np.ndarray, cols: np.ndarray) -> np.ndarray | None:
        """The one-victim choice on the statistics' own columns ``cols [L, k, c]`` (positions in slot order, -1 dead)
        of the ``k`` requests whose next tokens are at ``position [k]``, without sorting them: the lowest score,
        ties — and NaN, argmin's minimum — to the oldest position, as the first minimum over ascending positions
        takes it. ``[L, k]`` victims (-1: no finite candidate), or None when the policy's protection needs ranks or
        the scorer has no column form (``score_cols_layers``). Protection by a bound on positions and a scorer that
        picks from its own table (``lowest_cols_layers``): one pass, no scores or mask."""
        L, k, c = cols.shape
        bound = self.protected_bound_at(position)
        victims = None if bound is None else self.scorer.lowest_cols_layers(handle, cols, bound)
        if victims is not None:
            return victims
        prot = self.protected_cols_at(np.tile(position, L), cols.reshape(L * k, c))
        scores = self.scorer.score_cols_layers(handle, cols) if prot is not None else None
        if scores is None:
            return None
        return _lowest_victims(scores, cols, prot.reshape(L, k, c))

    def protected_bound_at(self, positions: np.ndarray) -> np.ndarray | None:
        """A policy whose ``protected_cols_at`` protects exactly the held positions at or past a bound per request
        (no ranks; H2O's recent window): those bounds ``[k]`` for requests whose next tokens are at ``positions
        [k]``. None here (sinks and the recent window are ranks)."""
        return None

    def protected_cols_at(self, positions: np.ndarray, cols: np.ndarray) -> np.ndarray | None:
        """``protected_rows_at`` over held positions in any order (``cols``, -1 dead columns), when it needs no
        ranks; else None. Without sinks or a recent window nothing is protected."""
        return None if self.n_sink or self.recent else np.zeros(cols.shape, bool)

    def protected_rows_at(self, positions: np.ndarray, held: np.ndarray) -> np.ndarray:
        """``protected_rows`` of requests whose next token is at ``positions``: sinks and the recent window as
        columns."""
        mask = np.zeros(held.shape, bool)
        mask[:, :self.n_sink] = True
        if self.recent:
            mask[:, max(0, held.shape[1] - self.recent):] = True
        return mask

    def lone_victims(self, layer: int, over: list) -> list[np.ndarray | None]:
        """Per ``(request, attended)`` over its target: the position ``[1]`` ``evict_layer`` would evict when
        its cut is one token (target = held - 1) and nothing is buffered; else None. Requests holding as many
        tokens are sorted, protected and argmin'd as one stack."""
        out: list[np.ndarray | None] = [None] * len(over)
        groups: dict[int, list[tuple[int, np.ndarray]]] = {}
        for j, (req, att) in enumerate(over):
            n = req.num_live(layer)
            if req.num_buffered(layer) or self.target(req, layer) != n - 1:
                continue
            # the paged positions, as evict_layer reads them: what attention saw unless a host tier adds some
            paged = att if att is not None and len(att) == n else req.live_positions(layer)
            groups.setdefault(n, []).append((j, paged))
        for group in groups.values():
            rows = [j for j, _ in group]
            reqs = [over[j][0] for j in rows]
            held = np.sort(np.stack([p for _, p in group]), axis=1)
            free = ~self.protected_rows(reqs, layer, held)
            cands = [h[f] for h, f in zip(held, free)]
            ok = [k for k, c in enumerate(cands) if len(c)]  # no candidate: evict_layer's own path
            scores = [head_mean(self.scorer.score(reqs[k], layer, cands[k], reqs[k].state.memo)) for k in ok]
            for k, at in zip(ok, first_minima(scores)):
                out[rows[k]] = cands[k][at:at + 1]
        return out

    def protected_rows(self, reqs: list, layer: int, held: np.ndarray) -> np.ndarray:
        """``protected`` of several requests as a mask over ``held [B, n]`` (rows ascending, nothing buffered).
        A policy that overrides ``protected`` overrides ``protected_rows_at`` too."""
        return self.protected_rows_at(np.fromiter((r.position for r in reqs), np.int64, len(reqs)), held)

    def protected(self, req, layer: int, held: np.ndarray) -> np.ndarray:
        """Positions never evicted at this event: sinks, the recent window and the residual buffer (any
        order, duplicates allowed)."""
        parts = [held[: self.n_sink], held[max(0, len(held) - self.recent):] if self.recent else held[:0]]
        if req.num_buffered(layer):
            parts.append(req.buffered_positions(layer))
        return np.concatenate(parts)

    def evict_layer(self, req, layer: int, target: int, attended: np.ndarray | None = None) -> bool:
        """Cut one layer to ``target`` tokens; True when it held more. ``attended``: the positions this step's
        attention covered in this layer (any order), when known."""
        n_live = req.num_live(layer)
        if n_live <= target:
            return False
        if attended is not None and n_live == len(attended) == req.num_paged(layer):
            paged = np.sort(attended)  # nothing buffered, nothing on a host tier: what attention saw is paged
        else:
            paged = req.live_positions(layer)
        held = req.all_positions(layer) if req.num_buffered(layer) else paged
        is_prot = sorted_member(paged, np.sort(self.protected(req, layer, held)))
        cand = paged[~is_prot]
        n_keep = target - (n_live - len(cand))
        if n_keep < len(cand):
            scores = head_mean(self.scorer.score(req, layer, cand, req.state.memo))
            if n_keep == len(cand) - 1 and self.keeps_best_scores:
                # one victim (a full cache, one token a step): the first minimum of the ascending candidates,
                # i.e. the lowest score, ties to the older token — what top_keep leaves out (NaN included)
                at = first_minima([scores])[0]
                req.evict(layer, cand[at:at + 1])
            else:
                keep = self.keep(req, layer, cand, scores, n_keep)
                req.evict(layer, cand[~sorted_member(cand, np.sort(keep))])
        if n_keep < 0 and self.evict_protected_when_short:
            rest = paged[is_prot]
            req.evict(layer, lowest(rest, head_mean(self.scorer.score(req, layer, rest, req.state.memo)), -n_keep))
        return True

    def keep(self, req, layer: int, cand: np.ndarray, scores, k: int) -> np.ndarray:
        """The candidates to keep: the ``k`` best by score, ties to the newer token."""
        return top_keep(cand, scores, k)

    def extra_stats(self, req) -> dict[str, Any]:
        return {"eviction_events": req.state.events}



def first_minima(scores: list) -> list[int]:
    """The index of the first minimum of each 1-D score vector (NaN counts as the minimum, as ``argmin``
    does); vectors of one length and kind in one ``argmin`` over their stack."""
    if len(scores) > 1 and len({(type(s), s.dtype, s.shape) for s in scores}) == 1:
        if isinstance(scores[0], torch.Tensor):
            return torch.argmin(torch.stack(scores), dim=1).tolist()
        return np.argmin(np.stack(scores), axis=1).tolist()
    return [int(torch.argmin(s)) if isinstance(s, torch.Tensor) else int(np.argmin(s)) for s in scores]


def _lowest_victims(scores: torch.Tensor, cols: np.ndarray, blocked: np.ndarray) -> np.ndarray:
    """Each ``[L, k]`` row's lowest-scored free column's position (``scores``, ``cols``, ``blocked``: ``[L, k, c]``;
    ties and NaN to the oldest position, as the first minimum over ascending positions takes it): one
    ``lowest_victim`` pass instead of a mask, an argmin and a gather over the stack. -1: no finite candidate."""
    L, k, c = cols.shape
    pos = torch.from_numpy(cols.reshape(L * k, c)).to(scores.device)
    prot = torch.from_numpy(blocked.reshape(L * k, c)).to(scores.device)
    return plugin_ops.lowest_victim(scores.reshape(L * k, c), pos, prot).reshape(L, k).cpu().numpy()
