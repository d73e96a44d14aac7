"""RequestContext: the runtime's implementation of the policy request API (``trtkv.policies.request``).

It is the only object that holds both a request's cache state and its policy state; policies receive it
typed as :class:`~trtkv.policies.request.PolicyRequest` and never reach the cache through it.
"""
from __future__ import annotations

from collections import Counter
from typing import Any

import numpy as np
import torch

from trtkv.cache.index_ops import split_counts
from trtkv.cache.manager import KVCacheManager, SeqKV
from trtkv.distributed.group import HeadShards


class RequestContext:
    def __init__(self, req_id: int, prompt_len: int, cache: KVCacheManager, seq: SeqKV, num_layers: int,
                 num_q_heads: int | None = None, shards: HeadShards | None = None):
        """``shards`` (tensor parallelism): the cache holds this rank's KV heads; reads give every head."""
        self.req_id = req_id
        self.prompt_len = prompt_len
        self.step = -1  # decode index of the token being processed (-1 during prefill)
        self._cache = cache
        self._seq = seq
        self._num_layers = num_layers
        self._num_q_heads = num_q_heads or cache.cfg.num_kv_heads
        self._shards = shards
        self.state: Any = None  # the policy's per-request State, owned by the policy base
        self.tree: Any = None  # the search tree this request is a node of (runtime/tree.py), else None
        self._seqs_of: tuple[list | None, list[SeqKV]] = (None, [])  # num_live_many's last batch

    # --- geometry -----------------------------------------------------------------------------
    @property
    def num_layers(self) -> int:
        return self._num_layers

    @property
    def num_kv_heads(self) -> int:
        return self._cache.cfg.num_kv_heads if self._shards is None else self._shards.num_kv_heads

    @property
    def num_q_heads(self) -> int:
        return self._num_q_heads

    @property
    def head_dim(self) -> int:
        return self._cache.cfg.head_dim

    @property
    def position(self) -> int:
        """Absolute position of the token processed in the current step."""
        return self.prompt_len + max(self.step, 0)

    @property
    def eviction_mode(self) -> str:
        return self._cache.cfg.eviction

    # --- what is held --------------------------------------------------------------------------
    def live_positions(self, layer: int) -> np.ndarray:
        return self._cache.live_positions(self._seq, layer)

    def live_positions_in(self, layer: int, lo: int, hi: int) -> np.ndarray:
        return self._cache.live_positions_in(self._seq, layer, lo, hi)

    def buffered_positions(self, layer: int) -> np.ndarray:
        return np.asarray(self._seq.buffered_positions(layer), dtype=np.int64)

    def all_positions(self, layer: int) -> np.ndarray:
        paged, buf = self.live_positions(layer), self.buffered_positions(layer)
        return np.sort(np.concatenate([paged, buf])) if len(buf) else paged

    def num_paged(self, layer: int) -> int:
        return self._seq.layers[layer].live

    def num_buffered(self, layer: int) -> int:
        return self._seq.buffered(layer)

    def num_live(self, layer: int) -> int:
        return self._seq.layers[layer].live + self._seq.buffered(layer)

    def stored_formats(self, layer: int) -> Counter:
        return Counter(fmt for fmt, _, _ in self._seq.layers[layer].loc.values())

    # --- reads and actions --------------------------------------------------------------------
    def kv(self, layer: int, positions) -> tuple[torch.Tensor, torch.Tensor]:
        k, v = self.kv_local(layer, positions)
        if self._shards is None:
            return k, v
        kv = self._shards.gather(torch.stack([k, v]), 2)  # one collective for both
        return kv[0], kv[1]

    def kv_rows(self, layer: int, reqs: list["RequestContext"], positions: np.ndarray
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """``kv`` of paged ``positions[i]`` of ``reqs[i]`` (requests of this one's batch, ``[k, n]``) in one read:
        ``k, v [k, n, H, D]``."""
        k_n = positions.shape
        k, v = self._cache.gather_kv_flat(layer, self._seqs(reqs), positions.reshape(-1), np.full(k_n[0], k_n[1]))
        k, v = k.view(*k_n, *k.shape[1:]), v.view(*k_n, *v.shape[1:])
        if self._shards is None:
            return k, v
        kv = self._shards.gather(torch.stack([k, v]), 3)  # one collective for both
        return kv[0], kv[1]

    def keys_rows(self, layer: int, reqs: list["RequestContext"], positions: np.ndarray) -> torch.Tensor:
        """``kv_rows``' keys alone (no value is read)."""
        k_n = positions.shape
        k = self._cache.gather_keys_flat(layer, self._seqs(reqs), positions.reshape(-1), np.full(k_n[0], k_n[1]))
        k = k.view(*k_n, *k.shape[1:])
        return k if self._shards is None else self._shards.gather(k, 2)  # (the KV heads)

    def kv_local(self, layer: int, positions) -> tuple[torch.Tensor, torch.Tensor]:
        """``kv`` of the heads this rank's cache holds (all of them without tensor parallelism): what the runtime
        attends over (ArborKV's rehydration), where a policy reads ``kv``."""
        positions = np.asarray(positions, dtype=np.int64)
        seq = self._seq
        buf = seq.buffered_positions(layer)
        if not buf:
            return self._cache.gather_kv(seq, layer, positions)
        in_buf = np.isin(positions, buf)
        k, v = self._cache.gather_kv(seq, layer, positions[~in_buf])
        slot = {p: i for i, p in enumerate(buf)}
        bi = torch.tensor([slot[int(p)] for p in positions[in_buf]], dtype=torch.long, device=seq.buf_k.device)
        out_k = torch.empty(len(positions), *k.shape[1:], dtype=torch.float32, device=k.device)
        out_v = torch.empty_like(out_k)
        m = torch.from_numpy(in_buf).to(k.device)
        out_k[~m], out_v[~m] = k, v
        out_k[m] = seq.buf_k[layer, bi].float().to(k.device)
        out_v[m] = seq.buf_v[layer, bi].float().to(k.device)
        return out_k, out_v

    def keys(self, layer: int, positions) -> torch.Tensor:
        k = self.kv_local(layer, positions)[0]
        return k if self._shards is None else self._shards.gather(k, 1)

    def keys_padded(self, layer: int, jobs: list[tuple["RequestContext", Any]], rows: int) -> torch.Tensor:
        """``keys`` of several requests of this one's batch (same cache) as one ``[J, rows, H, D]`` tensor: job
        ``j``'s positions in its first rows, zeros after (a batch's selection takes them as one array). One read
        per format for every paged job; a job touching the residual buffer reads through ``kv``."""
        positions = [np.asarray(p, dtype=np.int64).reshape(-1) for _, p in jobs]
        counts = np.fromiter(map(len, positions), np.int64, len(positions))
        flat = np.concatenate(positions) if positions else np.empty(0, np.int64)
        return self.keys_padded_flat(layer, [req for req, _ in jobs], flat, counts, rows)

    def keys_padded_flat(self, layer: int, reqs: list["RequestContext"], positions: np.ndarray, counts: np.ndarray,
                         rows: int) -> torch.Tensor:
        """``keys_padded`` with the jobs' positions concatenated: ``counts[j]`` of ``positions`` are job ``j``'s, of
        ``reqs[j]``."""
        if (counts > rows).any():
            raise ValueError(f"keys_padded: a job of more than {rows} positions")
        seqs = self._seqs(reqs)
        lone = []
        hit = np.flatnonzero(self._cache.buffered_any(layer, seqs, positions, counts))  # (most steps: none)
        if len(hit):
            starts = np.cumsum(counts) - counts
            lone = [(j, reqs[j], positions[starts[j]:starts[j] + counts[j]]) for j in hit.tolist()]
        paged = np.ones(len(reqs), bool)
        paged[[j for j, _, _ in lone]] = False
        if lone:
            keep = np.repeat(paged, counts)
            flat = self._cache.gather_keys_flat(layer, [s for s, p in zip(seqs, paged.tolist()) if p],
                                                positions[keep], counts[paged])
        else:
            flat = self._cache.gather_keys_flat(layer, seqs, positions, counts)
        out = _padded(flat, counts, rows, paged if lone else None)
        for j, req, mine in lone:
            out[j, :len(mine)] = req.kv_local(layer, mine)[0]
        return out if self._shards is None else self._shards.gather(out, 2)  # one collective for every job

    def keys_padded_layers(self, layers: np.ndarray, reqs: list["RequestContext"], which: np.ndarray,
                           positions: np.ndarray, counts: np.ndarray, rows: int) -> list[torch.Tensor]:
        """``keys_padded_flat`` of jobs in several layers, job ``j`` of ``reqs[which[j]]`` in ``layers[j]`` (the jobs of
        a layer together; ``reqs`` distinct, so a round's jobs in 32 layers read 32 times fewer records): one
        ``[jobs, rows, H, D]`` tensor for each layer's run of jobs, every layer's positions looked up at once."""
        if (counts > rows).any():
            raise ValueError(f"keys_padded: a job of more than {rows} positions")
        cuts = np.flatnonzero(np.r_[True, layers[1:] != layers[:-1]]).tolist() + [len(layers)]
        runs = list(zip(cuts[:-1], cuts[1:]))
        seqs = self._seqs(reqs)
        oldest = self._cache.oldest_buffered_many(seqs, layers, which)
        if self._shards is not None or (positions >= np.repeat(oldest, counts)).any():  # (a buffered token or a
            # shard's heads: layer by layer)
            ends = np.r_[0, np.cumsum(counts)]
            return [self.keys_padded_flat(int(layers[a]), [reqs[j] for j in which[a:b].tolist()],
                                          positions[ends[a]:ends[b]], counts[a:b], rows) for a, b in runs]
        flats = self._cache.gather_keys_layers(layers, seqs, positions, counts, runs, which)
        return [_padded(flat, counts[a:b], rows) for flat, (a, b) in zip(flats, runs)]

    def _bookkeeping(self, run, *args):
        """``run(*args)`` timed as the cache's bookkeeping: the policy decided, executing it is the cache's work
        (``trtkv bench --profile``)."""
        clk = self._cache.clock
        prev = clk.switch("bookkeeping") if clk is not None else None
        try:
            return run(*args)
        finally:
            if clk is not None:
                clk.switch(prev)

    def evict(self, layer: int, positions) -> int:
        if self._cache.cfg.demote != "none":  # demote instead of drop: the victims stay attended from host
            return self._bookkeeping(self._cache.tiers.demote_evicted, self._seq, layer, positions)
        return self._bookkeeping(self._cache.evict, self._seq, layer, positions)

    def evict_many(self, layer: int, jobs: list[tuple["RequestContext", Any]]) -> list[int]:
        """``evict`` of several requests of this one's batch in one layer, in one pass over the batch."""
        if any(req._cache is not self._cache for req, _ in jobs):
            raise ValueError("evict_many: every request must share this request's cache")
        if self._cache.cfg.demote != "none":
            return [req.evict(layer, positions) for req, positions in jobs]
        return self._bookkeeping(self._cache.evict_many, layer, [(req._seq, positions) for req, positions in jobs])

    def evict_flat(self, layer: int, reqs: list["RequestContext"], positions: np.ndarray, lens: np.ndarray
                   ) -> list[int]:
        """``evict_many`` with the victims concatenated: ``lens[i]`` of ``positions`` are the ``i``-th job's, of
        ``reqs[i]`` (requests of this one's batch, a request may repeat)."""
        if self._cache.cfg.demote != "none":
            return self.evict_many(layer, list(zip(reqs, split_counts(positions, lens))))
        if any(req._cache is not self._cache for req in reqs):
            raise ValueError("evict_flat: every request must share this request's cache")
        return self._bookkeeping(self._cache.evict_flat, layer, [req._seq for req in reqs],
                                 np.asarray(positions, np.int64), np.asarray(lens, np.int64))

    def evict_each(self, layer: int, reqs: list["RequestContext"], positions: np.ndarray) -> None:
        """One position (-1: none) of each of ``reqs`` (distinct) in one layer: ``evict_many``'s array path."""
        seqs = self._seqs(reqs)
        cfg = self._cache.cfg
        if cfg.demote != "none" or cfg.eviction == "compact" or any(s.fork_mode is not None for s in seqs):
            self.evict_many(layer, [(r, [p]) for r, p in zip(reqs, positions.tolist()) if p >= 0])
            return
        self._bookkeeping(self._cache.evict_one_each, layer, seqs, positions)

    def evict_each_layers(self, layers: np.ndarray, reqs: list["RequestContext"], positions: np.ndarray) -> None:
        """``evict_each`` in each of ``layers`` (ascending): ``positions [len(layers), len(reqs)]``, all layers in one
        pass where the cache allows."""
        seqs = self._seqs(reqs)
        cfg = self._cache.cfg
        if cfg.demote != "none" or cfg.eviction == "compact" or any(s.fork_mode is not None for s in seqs):
            for layer, victims in zip(layers.tolist(), positions):
                self.evict_each(layer, reqs, victims)
            return
        self._bookkeeping(self._cache.evict_one_each_layers, layers, seqs, positions)

    def evict_rows_layers(self, reqs: list["RequestContext"], positions: np.ndarray) -> None:
        """``m`` positions of each of ``reqs`` (distinct, of this one's batch) in every layer: ``positions [layers,
        len(reqs), m]`` (distinct within a request; -1: none) — an event's victims, every layer's in one pass where
        the cache allows, else ``evict_flat`` a layer."""
        seqs = self._seqs(reqs)
        if self._cache.cfg.demote != "none" or any(s.fork_mode is not None for s in seqs):
            for layer, victims in enumerate(positions):
                self.evict_flat(layer, reqs, victims[victims >= 0], (victims >= 0).sum(1))
            return
        self._bookkeeping(self._cache.evict_rows_layers, np.arange(len(positions)), seqs, positions)

    def num_live_many(self, layer: int, reqs: list["RequestContext"]) -> np.ndarray:
        return self._cache.num_live_many(self._seqs(reqs), layer)

    def num_live_layers(self, reqs: list["RequestContext"]) -> np.ndarray:
        """``num_live_many`` of every layer: ``[L, len(reqs)]``."""
        return self._cache.num_live_layers(self._seqs(reqs))

    def num_paged_layers(self, reqs: list["RequestContext"]) -> np.ndarray:
        """``num_paged_many`` of every layer: ``[L, len(reqs)]``."""
        return self._cache.num_paged_layers(self._seqs(reqs))

    def num_paged_many(self, layer: int, reqs: list["RequestContext"]) -> np.ndarray:
        return self._cache.num_paged_many(self._seqs(reqs), layer)

    def num_buffered_many(self, layer: int, reqs: list["RequestContext"]) -> np.ndarray:
        return self._cache.buffered_many(self._seqs(reqs), layer)

    def live_positions_each(self, layer: int, reqs: list["RequestContext"], which: np.ndarray, n: int) -> np.ndarray:
        seqs = self._seqs(reqs)
        return self._cache.live_positions_rows([seqs[i] for i in which.tolist()], layer, n)

    def live_positions_in_many(self, layer: int, reqs: list["RequestContext"], lo: np.ndarray, hi: np.ndarray
                               ) -> list[np.ndarray]:
        """``live_positions_in`` of each ``(reqs[i], lo[i], hi[i])`` of this one's batch (a request may repeat)."""
        if any(req._cache is not self._cache for req in reqs):
            raise ValueError("live_positions_in_many: every request must share this request's cache")
        return self._cache.live_positions_in_many([req._seq for req in reqs], layer, lo, hi)

    def live_positions_in_flat(self, layer: int, reqs: list["RequestContext"], lo: np.ndarray, hi: np.ndarray
                               ) -> tuple[np.ndarray, np.ndarray]:
        """``live_positions_in_many`` concatenated: ``(positions, counts)``, ``counts[i]`` of them ``reqs[i]``'s."""
        if any(req._cache is not self._cache for req in reqs):
            raise ValueError("live_positions_in_flat: every request must share this request's cache")
        return self._cache.live_positions_in_flat([req._seq for req in reqs], layer, lo, hi)

    def live_positions_in_flat_layers(self, reqs: list["RequestContext"], lo: np.ndarray, hi: np.ndarray
                                      ) -> tuple[np.ndarray, np.ndarray]:
        """``live_positions_in_flat`` of every layer at once: ``(positions, counts [layers, len(reqs)])``."""
        if any(req._cache is not self._cache for req in reqs):
            raise ValueError("live_positions_in_flat_layers: every request must share this request's cache")
        return self._cache.live_positions_in_flat_layers([req._seq for req in reqs], lo, hi)

    def reads_ahead(self, reqs: list["RequestContext"]) -> np.ndarray:
        """For a policy that acts in each layer before its attention: from which position on each of ``reqs``
        may still change in a layer before that layer's turn this step (its buffers' flushes, its new token). The
        live positions under it and their keys read the same in every layer from the step's first layer on, so
        that layer may read them for all. -1 each where the cache's evictions reach across layers."""
        seqs = self._seqs(reqs)
        if not self._cache.evictions_stay_in_layer(seqs):
            return np.full(len(reqs), -1, np.int64)
        return np.minimum(self._cache.oldest_buffered_many(seqs), np.fromiter((r.position for r in reqs), np.int64,
                                                                               len(reqs)))

    def live_positions_layers(self, reqs: list["RequestContext"], n: int) -> np.ndarray:
        return self._cache.live_positions_rows_layers(self._seqs(reqs), n)

    def _seqs(self, reqs: list["RequestContext"]) -> list[SeqKV]:
        """The cache records of ``reqs``, remembered for the same list (a step's layers pass the same one)."""
        last, seqs = self._seqs_of
        if last is not reqs or len(seqs) != len(reqs):
            if any(req._cache is not self._cache for req in reqs):
                raise ValueError("every request must share this request's cache")
            seqs = [req._seq for req in reqs]
            self._seqs_of = (reqs, seqs)
        return seqs

    def evict_all_layers(self, positions) -> int:
        return sum(self.evict(layer, positions) for layer in range(self._num_layers))

    # --- tiers (trtkv/cache/tiers.py) -----------------------------------------------------------
    def host_positions(self, layer: int) -> np.ndarray:
        if not self._cache.has_tiers:
            return np.empty(0, np.int64)
        return self._cache.tiers.host_positions(self._seq, layer)

    def num_host(self, layer: int) -> int:
        return len(self.host_positions(layer))

    def attended_positions(self, layer: int) -> np.ndarray:
        host = self.host_positions(layer)
        dev = self.all_positions(layer)
        return np.sort(np.concatenate([dev, host])) if len(host) else dev

    def attended_positions_flat(self, layer: int, reqs: list["RequestContext"]) -> tuple[np.ndarray, np.ndarray]:
        """``attended_positions`` of each of ``reqs`` (this one's batch) concatenated, each ascending: ``(positions,
        counts)``, one read of the device's and the host tier's position maps for all of them."""
        seqs = self._seqs(reqs)
        n = len(seqs)
        parts = [self._cache.live_positions_in_flat(seqs, layer, np.zeros(n, np.int64),
                                                    np.full(n, np.iinfo(np.int64).max))]
        buffered = self._cache.buffered_many(seqs, layer)
        if buffered.any():
            parts.append((np.concatenate([req.buffered_positions(layer) for req in reqs]), buffered))
        if self._cache.has_tiers:
            parts.append(self._cache.tiers.host_positions_flat(seqs, layer))
        if len(parts) == 1:
            return parts[0]
        positions = np.concatenate([p for p, _ in parts])
        owner = np.concatenate([np.repeat(np.arange(n), c) for _, c in parts])
        return positions[np.lexsort((positions, owner))], sum(c for _, c in parts)

    def on_device_flat(self, layer: int, reqs: list["RequestContext"], positions: np.ndarray,
                       counts: np.ndarray) -> np.ndarray:
        """Whether each of ``positions`` (``counts[i]`` of them ``reqs[i]``'s) is on the device in ``layer`` (paged
        there or buffered: ``tier_of``'s T0), one read for all of them."""
        seqs = self._seqs(reqs)
        owner = np.repeat(np.arange(len(seqs)), counts)
        return self._cache.held_flat(layer, self._cache.rows(seqs)[owner], positions) | \
            self.buffered_flat(layer, reqs, positions, counts)

    def buffered_flat(self, layer: int, reqs: list["RequestContext"], positions: np.ndarray,
                      counts: np.ndarray) -> np.ndarray:
        """Whether each of ``positions`` (``counts[i]`` of them ``reqs[i]``'s) is in its request's residual buffer in
        ``layer``: one ``isin`` over positions keyed by their request."""
        buffered = np.flatnonzero(self._cache.buffered_many(self._seqs(reqs), layer)).tolist()
        if not buffered:
            return np.zeros(len(positions), bool)
        mine = [np.asarray(reqs[i].buffered_positions(layer), np.int64) for i in buffered]
        # (the key's stride past every position on either side, so no request's keys reach the next one's)
        top = max(int(positions.max(initial=0)), *(int(b.max(initial=0)) for b in mine)) + 1
        owner = np.repeat(np.arange(len(reqs)), counts)
        held = np.concatenate([b + i * top for i, b in zip(buffered, mine)])
        return np.isin(owner * top + positions, held)

    def tier_of(self, layer: int, positions) -> np.ndarray:
        return self._cache.tiers.tier_of(self._seq, layer, positions)

    def place(self, layer: int | None, positions, tier: str) -> int:
        from trtkv.cache.tier_names import parse_tier

        code, fmt = parse_tier(tier)
        layers = range(self._num_layers) if layer is None else (layer,)
        return sum(self._cache.tiers.place(self._seq, i, positions, code, fmt) for i in layers)

    def place_many(self, layer: int | None, jobs: list[tuple["RequestContext", Any]], tier: str) -> list[int]:
        from trtkv.cache.tier_names import parse_tier

        code, fmt = parse_tier(tier)
        seqs = self._seqs([req for req, _ in jobs])
        items = [(seq, np.asarray(positions, np.int64)) for seq, (_, positions) in zip(seqs, jobs)]
        if layer is None:
            return self._cache.tiers.place_layers(items, code, fmt).tolist()
        return self._cache.tiers.place_many(layer, items, code, fmt)

    # --- runtime side (not part of the policy API) -------------------------------------------
    @property
    def seq(self) -> SeqKV:
        """The cache's record of this request (runtime, bench and eval use it; policies must not)."""
        return self._seq

    @property
    def kv_bytes(self) -> int:
        """Device KV bytes: pages, plus the host tiers' staging buffers when the request has host tokens."""
        staging = self._cache.tiers.staging_bytes(self._seq) if self._cache.has_tiers else 0
        return self._seq.kv_bytes + staging


def _padded(flat: torch.Tensor, counts: np.ndarray, rows: int, paged: np.ndarray | None = None) -> torch.Tensor:
    """``flat`` (the ``paged`` jobs' keys concatenated, ``counts[j]`` of them job ``j``'s) as ``[jobs, rows, H, D]``,
    job ``j``'s in its first rows, zeros after; the jobs not ``paged`` all zeros (their caller fills them)."""
    if paged is None and (counts == rows).all():  # every job full (the common case): the read is the stack
        return flat.view(len(counts), rows, *flat.shape[1:])
    out = flat.new_zeros((len(counts), rows, *flat.shape[1:]))
    jobs_at = np.arange(len(counts)) if paged is None else np.flatnonzero(paged)
    sizes = counts[jobs_at]
    starts = np.repeat(jobs_at * rows - (np.cumsum(sizes) - sizes), sizes)
    out.view(-1, *flat.shape[1:])[torch.from_numpy(starts + np.arange(int(sizes.sum()))).to(flat.device)] = flat
    return out
