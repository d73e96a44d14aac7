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
    victims: list[tuple[list, np.ndarray, np.ndarray, np.ndarray]] = []  # (reqs, who, positions, lens) a batch
    left = None  # (the last round's jobs as who << 32 | lo, sorted; each one's tokens left)
    for jobs in rounds:
        code = jobs.who << 32 | jobs.lo
        if left is not None:  # a later round: its jobs were the last round's; none over its target, none to run
            at = np.searchsorted(left[0], code).clip(max=len(left[0]) - 1)
            if (left[0][at] == code).all() and (left[1][at] <= jobs.target).all():
                continue
        order = np.argsort(code)
        left = (code[order], _anneal_round(layer, jobs, victims, kmeans_iters)[order])
    if victims:
        every = [r for rs, _, _, _ in victims for r in rs]
        every[0].evict_flat(layer, every, np.concatenate([p for _, _, p, _ in victims]),
                            np.concatenate([n for _, _, _, n in victims]))


def _anneal_round(layer: int, jobs: AnnealRound, victims: list, kmeans_iters: int) -> np.ndarray:
    """One round of anneals of several requests: their k-means jobs run in one call per job shape (a request's padded
    rows and clusters: its jobs' largest), on arrays over the round's jobs. Each job's members are its segment's live
    tokens less the ``victims`` of the step's earlier rounds (not evicted yet); its victims join them. Returns each
    job's tokens left."""
    first = jobs.reqs[0]
    members, counts = first.live_positions_in_flat(layer, jobs.reqs, jobs.lo, jobs.hi)  # one read for the round
    if victims:
        members, counts = _less_victims(members, counts, jobs.who, victims)
    go = np.flatnonzero(counts > jobs.target)
    left = counts.copy()
    if not len(go):
        return left
    owner = jobs.owner[go]  # (ascending: a request's jobs are together)
    starts = np.flatnonzero(np.r_[True, owner[1:] != owner[:-1]])
    rows_of = np.maximum.reduceat(counts[go], starts)  # per request with a job: its shape
    clusters_of = np.maximum.reduceat(jobs.target[go], starts)
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
        reqs = [jobs.reqs[j] for j in sel.tolist()]
        keys = first.keys_padded_flat(layer, reqs, mine, lens, m)
        feats = keys.reshape(len(keys), m, -1)  # (zero rows pad the segments that are not full)
        keep = torch.ops.trtkv.kmeans_select(feats, torch.from_numpy(lens.astype(np.int32)).to(feats.device),
                                             torch.from_numpy(jobs.target[sel].astype(np.int32)).to(feats.device),
                                             kmeans_iters).cpu().numpy()
        # the victims: each job's members the k-means did not keep, in member order
        held = np.arange(m) < lens[:, None]
        victim = held.copy()
        ji, col = np.nonzero(keep >= 0)
        victim[ji, keep[ji, col]] = False
        gone = victim.sum(1)
        victims.append((reqs, jobs.who[sel], mine[victim[held]], gone))
        left[sel] -= gone
    return left


def _less_victims(members: np.ndarray, counts: np.ndarray, who: np.ndarray, victims: list
                  ) -> tuple[np.ndarray, np.ndarray]:
    """``(members, counts)`` (job ``j``'s ``counts[j]`` positions, of the request at place ``who[j]`` in the step)
    without the positions in ``victims`` (each ``(reqs, who, positions, lens)``) of the same requests."""
    top = int(max(members.max(initial=0), *(p.max(initial=0) for _, _, p, _ in victims))) + 1
    gone = np.concatenate([np.repeat(w, n) * top + p for _, w, p, n in victims])
    job = np.repeat(np.arange(len(counts)), counts)
    keep = ~np.isin(who[job] * top + members, gone)
    return members[keep], np.bincount(job[keep], minlength=len(counts))
