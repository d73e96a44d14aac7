"""ThinKV's anneals of a decode step, batched over the requests in one layer: each job keeps ``target`` of a segment's
tokens, chosen by k-means over their post-RoPE keys (``torch.ops.trtkv.kmeans_select``).

A step's jobs come in rounds (``plan_rounds``): a segment annealed twice in a step (case 1, then case 2) is annealed
again in a later round, from the survivors of the one before. The rounds' victims are evicted together after the last
round: a later round reads its segments' tokens less the earlier rounds' victims — the same survivors the evictions
would leave, whose keys are still in the cache — and a round whose jobs are all at or under their targets already
does nothing, so it is not read at all.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch


@dataclass
class AnnealRound:
    """One round of a step's anneals: job ``j`` keeps ``target[j]`` of the tokens of ``reqs[j]``'s segment ``[lo[j],
    hi[j])``; ``owner[j]``: its request's place among the round's requests (a request's jobs are together);
    ``who[j]``: its request's place among the step's."""
    reqs: list
    owner: np.ndarray
    lo: np.ndarray
    hi: np.ndarray
    target: np.ndarray
    who: np.ndarray


def plan_rounds(reqs, tau: int) -> list[AnnealRound]:
    """The anneals of ``reqs`` (each request's ``state.ops``: ``(segment, target)``) as rounds of jobs, each segment at
    most once a round, a request's repeated segments in later rounds in the order its ops list them."""
    rounds, pending = [], [(i, req, list(req.state.ops)) for i, req in enumerate(reqs) if req.state.ops]
    while pending:
        jobs, later = [], []  # (owner, request, segment, target, place in the step)
        for owner, (i, req, ops) in enumerate(pending):
            seen, rest = set(), []
            for seg, target in ops:
                if seg.sid in seen:
                    rest.append((seg, target))
                else:
                    jobs.append((owner, req, seg, target, i))
                    seen.add(seg.sid)
            if rest:
                later.append((i, req, rest))
        rounds.append(AnnealRound(
            [job[1] for job in jobs], np.fromiter((job[0] for job in jobs), np.int64, len(jobs)),
            np.fromiter((req.prompt_len + seg.start for _, req, seg, _, _ in jobs), np.int64, len(jobs)),
            np.fromiter((req.prompt_len + seg.end(tau) for _, req, seg, _, _ in jobs), np.int64, len(jobs)),
            np.fromiter((job[3] for job in jobs), np.int64, len(jobs)),
            np.fromiter((job[4] for job in jobs), np.int64, len(jobs))))
        pending = later
    return rounds


def anneal_layer(layer: int, rounds: list[AnnealRound], kmeans_iters: int) -> None:
    """Run a step's ``rounds`` in ``layer``, then evict every round's victims in one pass."""
    if rounds:
        evict_victims(layer, select_victims(rounds, kmeans_iters, layer)[0])


def evict_victims(layer: int, victims: LayerVictims | None) -> None:
    """Evict one layer's victims (``select_victims``) in one pass."""
    if victims is not None:
        reqs, positions, lens = victims
        reqs[0].evict_flat(layer, reqs, positions, lens)


LayerVictims = tuple[list, np.ndarray, np.ndarray]  # (a job's request, each; victims concatenated; each one's count)


def select_victims(rounds: list[AnnealRound], kmeans_iters: int, layer: int | None = None
                   ) -> list[LayerVictims | None]:
    """The victims of a step's ``rounds`` in ``layer``, or in every layer at once (None: the caller guarantees that
    the jobs' tokens read the same in each layer now as at its turn, ``RequestContext.reads_ahead``): one read of
    the live positions and one k-means call per job shape for all of them. Each layer's victims are listed as
    selecting in that layer alone would list them, so evicting them leaves the same state."""
    first = rounds[0].reqs[0]
    span = 1 if layer is not None else first.num_layers
    width = max(int(r.who.max()) for r in rounds) + 1  # (a job's place in the step, layer by layer: l * width + who)
    chunks: list[list] = [[] for _ in range(span)]  # per layer: (order key, reqs, positions, gone)
    taken: list[tuple[np.ndarray, np.ndarray, np.ndarray]] = []  # (who, positions, gone): earlier rounds' victims
    left = None  # (the last round's jobs as who << 32 | lo, sorted; each one's tokens left)
    for number, jobs in enumerate(rounds):
        who = (np.arange(span)[:, None] * width + jobs.who).reshape(-1)
        code = who << 32 | np.tile(jobs.lo, span)
        if left is not None:  # a later round: its jobs were the last round's; none over its target, none to run
            at = np.searchsorted(left[0], code).clip(max=len(left[0]) - 1)
            if (left[0][at] == code).all() and (left[1][at] <= np.tile(jobs.target, span)).all():
                continue
        order = np.argsort(code)
        left = (code[order], _anneal_round(layer, span, number, jobs, who, chunks, taken, kmeans_iters)[order])
    out: list[LayerVictims | None] = []
    for mine in chunks:
        mine.sort(key=lambda c: c[0])
        out.append(([r for c in mine for r in c[1]], np.concatenate([c[2] for c in mine]),
                    np.concatenate([c[3] for c in mine])) if mine else None)
    return out


def _anneal_round(layer: int | None, span: int, number: int, jobs: AnnealRound, who: np.ndarray, chunks: list,
                  taken: list, kmeans_iters: int) -> np.ndarray:
    """One round of anneals of several requests in ``span`` layers (``layer``, or every one from 0): the jobs of each
    layer side by side (job ``l * J + j``: job ``j`` in layer ``l``, of step place ``who``), their k-means in one call
    per job shape (a request's padded rows and clusters: its jobs' largest), on arrays over the round's jobs. Each
    job's members are its segment's live tokens less the ``taken`` victims of the step's earlier rounds (not evicted
    yet); its victims join them and its layer's ``chunks``. Returns each job's tokens left."""
    first, n_jobs = jobs.reqs[0], len(jobs.reqs)
    if layer is not None:
        members, counts = first.live_positions_in_flat(layer, jobs.reqs, jobs.lo, jobs.hi)  # one read for the round
    else:
        members, counts = first.live_positions_in_flat_layers(jobs.reqs, jobs.lo, jobs.hi)
        counts = counts.reshape(-1)
    if taken:
        members, counts = _less_victims(members, counts, who, taken)
    target = np.tile(jobs.target, span)
    go = np.flatnonzero(counts > target)
    left = counts.copy()
    if not len(go):
        return left
    owners = int(jobs.owner.max()) + 1
    owner = (go // n_jobs) * owners + jobs.owner[go % n_jobs]  # (ascending: layer by layer, a request's jobs together)
    starts = np.flatnonzero(np.r_[True, owner[1:] != owner[:-1]])
    rows_of = np.maximum.reduceat(counts[go], starts)  # per request and layer with a job: its shape
    clusters_of = np.maximum.reduceat(target[go], starts)
    shape = rows_of * (int(clusters_of.max()) + 1) + clusters_of
    shape_of_job = np.repeat(shape, np.diff(np.r_[starts, len(go)]))
    _, first_at = np.unique(shape, return_index=True)
    for g in np.sort(first_at).tolist():  # requests batch only with requests of the same padded shape, so every
        # job's arithmetic is exactly what a call of its request alone would do (same tokens either way)
        sel = go[shape_of_job == shape[g]]
        m, lens = int(rows_of[g]), counts[sel]
        take = np.zeros(len(counts), bool)
        take[sel] = True
        mine = members[np.repeat(take, counts)]
        at_layer = sel // n_jobs
        cuts = np.flatnonzero(np.r_[True, at_layer[1:] != at_layer[:-1]]).tolist() + [len(sel)]
        parts = list(zip(cuts[:-1], cuts[1:]))  # (a layer's jobs together: ascending)
        which = sel % n_jobs
        reqs = [jobs.reqs[j] for j in which.tolist()]
        if layer is not None:
            keys = [first.keys_padded_flat(layer, reqs, mine, lens, m)]
        else:  # (every layer's positions looked up at once)
            keys = first.keys_padded_layers(at_layer, jobs.reqs, which, mine, lens, m)
        targets = torch.from_numpy(target[sel].astype(np.int32))
        keep = np.concatenate([_keep(k, lens[a:b], targets[a:b], m, kmeans_iters)
                               for k, (a, b) in zip(keys, parts)])  # (a call a layer: no copy of the keys)
        # the victims: each job's members the k-means did not keep, in member order
        held = np.arange(m) < lens[:, None]
        victim = held.copy()
        ji, col = np.nonzero(keep >= 0)
        victim[ji, keep[ji, col]] = False
        gone = victim.sum(1)
        lost = mine[victim[held]]
        lost_at = np.r_[0, np.cumsum(gone)]
        for a, b in parts:  # in its layer, a round's groups go in the order of their first request
            chunks[at_layer[a]].append(((number, int(jobs.owner[sel[a] % n_jobs])), reqs[a:b],
                                        lost[lost_at[a]:lost_at[b]], gone[a:b]))
        taken.append((who[sel], lost, gone))
        left[sel] -= gone
    return left


def _keep(keys: torch.Tensor, lens: np.ndarray, targets: torch.Tensor, m: int, kmeans_iters: int) -> np.ndarray:
    """The members k-means keeps of jobs of one shape, from their padded keys (zero rows pad the segments that are
    not full)."""
    feats = keys.reshape(len(keys), m, -1)
    return torch.ops.trtkv.kmeans_select(feats, torch.from_numpy(lens.astype(np.int32)).to(feats.device),
                                         targets.to(feats.device), kmeans_iters).cpu().numpy()


def _less_victims(members: np.ndarray, counts: np.ndarray, who: np.ndarray, taken: list
                  ) -> tuple[np.ndarray, np.ndarray]:
    """``(members, counts)`` (job ``j``'s ``counts[j]`` positions, of the request at place ``who[j]``) without the
    positions in ``taken`` (each ``(who, positions, lens)``) of the same places."""
    top = int(max(members.max(initial=0), *(p.max(initial=0) for _, p, _ in taken))) + 1
    gone = np.concatenate([np.repeat(w, n) * top + p for w, p, n in taken])
    job = np.repeat(np.arange(len(counts)), counts)
    keep = ~np.isin(who[job] * top + members, gone)
    return members[keep], np.bincount(job[keep], minlength=len(counts))
