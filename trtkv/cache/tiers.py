"""Tiered KV memory: where each cached token lives (tiered-memory spec §2.5, §4.1).

    T0 device   the device page pools attention reads directly (``KVCacheManager``)
    T1 host     host page pools, the token's own storage format, bytes copied verbatim
    T2 host-q   host page pools in a compressed format (re-encoded; lossy, never restored)
    T3 evicted  gone

Every token of a request is in exactly one tier per layer. The host tiers are a second, host-resident
``KVCacheManager`` composed with growing host pools (pinned memory on CUDA; ``PoolSet(growable=True)``: host
pools start small and double when full, their bytes capped here with undo), so pages, slots,
key-scale groups and byte accounting work exactly as on the device. Moves copy codes verbatim when the
format is kept (T0 <-> T1: attention over the moved token is unchanged, Proposition 1) and re-encode through
the ``kv_write`` plugin otherwise. Policies
ask for moves through the request API (``PolicyRequest.place``); the cache setting ``demote`` turns any
policy's evictions into moves to T1/T2 (``tier_for_demote``).
"""
from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass

import numpy as np
import torch

from trtkv.cache.pool_set import PoolSet
from trtkv.cache.sequence import SeqKV
from trtkv.cache.tier_copy import CacheLike, encode_copy, raw_copy, raw_copy_flat
from trtkv.cache.tier_names import (DEFAULT_HOST_FORMAT, TIER_DEVICE, TIER_EVICTED, TIER_HOST,  # noqa: F401
                                     TIER_HOST_Q, TIER_NAMES, parse_demote, parse_host_format, parse_tier)
from trtkv.errors import OutOfKVMemory

@dataclass
class SeqTiers:
    """One request's host-tier record and transfer counters."""

    host: SeqKV
    orig_fmt: list[dict[int, tuple[str, int]]]  # per layer: T2 position -> (device format, thought class)
    version: int  # bumped on every host-tier change (``staging_bytes`` recounts when it moved)
    evicted_from_host: int = 0  # summed over layers
    transfer_bytes: int = 0  # D2H (demotions) + H2D (promotions, staging) bytes
    move_bytes: int = 0  # of which: event moves (demotions, promotions, re-encodes)
    move_seconds: float = 0.0  # time spent copying KV between tiers (events + staging)
    peak_host_bytes: int = 0
    peak_device_bytes: int = 0  # device pages + staging this request needs, at its peak
    staging: tuple[int, int, int] = (-1, -1, 0)  # (sum of versions, host bytes) -> staging bytes, last computed


class TierStore:
    """Placement, moves and per-tier accounting for one device cache (``KVCacheManager.tiers``)."""

    def __init__(self, dev: CacheLike):
        self.dev = dev
        cfg = dev.cfg
        host_cfg = dataclasses.replace(cfg, device="cpu", residual_group=1, eviction="inplace", max_pages=None)
        pin = str(cfg.device).startswith("cuda") and torch.cuda.is_available()
        # a cache of the device cache's own kind over growing host pools (this module never imports the manager)
        self.host = type(dev)(host_cfg, dev.kv_amax, pools=PoolSet(host_cfg, dev.kv_amax, growable=True, pin=pin))
        self.cap = getattr(cfg, "host_kv_memory", None)
        self.demote, self.demote_fmt = parse_demote(getattr(cfg, "demote", "none"))
        self.seqs: dict[int, SeqTiers] = {}
        self.transfer_bytes_total = 0
        self.records = 0  # bumped when a request's record appears or goes (staging's batch of host records)
        self.layer_versions = np.zeros(cfg.num_layers, np.int64)  # bumped with any request's version[layer]

    # --- records ------------------------------------------------------------------------------
    def record(self, seq: SeqKV) -> SeqTiers:
        st = self.seqs.get(seq.seq_id)
        if st is None:
            L = self.dev.cfg.num_layers
            st = SeqTiers(self.host.add_sequence(seq.seq_id), [{} for _ in range(L)], 0)
            self.seqs[seq.seq_id] = st
            self.records += 1
        return st

    def free(self, seq_id: int) -> None:
        st = self.seqs.pop(seq_id, None)
        if st is not None:
            self.host.free_sequence(seq_id)
            self.records += 1

    # --- queries ------------------------------------------------------------------------------
    def host_positions(self, seq: SeqKV, layer: int) -> np.ndarray:
        st = self.seqs.get(seq.seq_id)
        return np.empty(0, np.int64) if st is None else self.host.live_positions(st.host, layer)

    def host_positions_flat(self, seqs: list[SeqKV], layer: int) -> tuple[np.ndarray, np.ndarray]:
        """``host_positions`` of each of ``seqs`` concatenated, each ascending: ``(positions, counts)``."""
        recs = self.host_records(seqs)
        have = [i for i, r in enumerate(recs) if r is not None]
        counts = np.zeros(len(seqs), np.int64)
        if not have:
            return np.empty(0, np.int64), counts
        n = len(have)
        positions, counts[have] = self.host.live_positions_in_flat([recs[i] for i in have], layer,
                                                                   np.zeros(n, np.int64),
                                                                   np.full(n, np.iinfo(np.int64).max))
        return positions, counts

    def host_records(self, seqs: list[SeqKV]) -> list[SeqKV | None]:
        """Each request's host-tier record (a request of the host cache), None where it has none."""
        return [st.host if st is not None else None for st in map(self.seqs.get, (s.seq_id for s in seqs))]

    def host_bytes(self, seq: SeqKV) -> int:
        st = self.seqs.get(seq.seq_id)
        return 0 if st is None else st.host.kv_bytes

    def host_bytes_total(self) -> int:
        return sum(st.host.kv_bytes for st in self.seqs.values())

    def tier_of(self, seq: SeqKV, layer: int, positions) -> np.ndarray:
        """Tier code per position (T3 for positions neither tier holds, the residual buffer counts as T0)."""
        pos = np.asarray(positions, dtype=np.int64).reshape(-1)
        out = np.full(len(pos), TIER_EVICTED, np.int8)
        st = self.seqs.get(seq.seq_id)
        if st is not None and len(pos):
            host = self.host.held_flat(layer, np.full(len(pos), st.host.row, np.int64), pos)
            out[host] = TIER_HOST
            if st.orig_fmt[layer]:
                out[host & np.isin(pos, np.fromiter(st.orig_fmt[layer], np.int64))] = TIER_HOST_Q
        dev = self.dev.held_flat(layer, np.full(len(pos), seq.row, np.int64), pos)
        buf = seq.buffered_positions(layer)
        if len(buf):
            dev |= np.isin(pos, np.asarray(buf, np.int64))
        out[dev] = TIER_DEVICE
        return out

    def staging_bytes(self, seq: SeqKV) -> int:
        """Device bytes of the two one-layer staging buffers this request needs (its largest layer's host
        pages, double-buffered so layer l+1 can be copied while layer l computes)."""
        st = self.seqs.get(seq.seq_id)
        return 0 if st is None else self._staging_of(st)

    def _staging_of(self, st: SeqTiers) -> int:
        key = (st.version, st.host.kv_bytes)  # (the host pages change only with these)
        if st.staging[:2] == key:
            return st.staging[2]
        per_layer = 0
        for layer, table in enumerate(st.host.layers):
            b = sum(len(pages) * self.host.pools[layer][fmt].page_bytes
                    for (fmt, _), pages in table.pages.items())
            per_layer = max(per_layer, b)
        st.staging = (*key, 2 * per_layer)
        return 2 * per_layer

    def stats(self, seq: SeqKV) -> dict[str, int | float]:
        """The per-tier numbers of one request (``generate --json`` stats keys)."""
        return tier_stats(seq, self.dev.cfg.num_layers, self.seqs.get(seq.seq_id), self.staging_bytes(seq))

    def note_peaks(self, seq: SeqKV) -> None:
        self.note_peaks_many([seq])

    def note_peaks_many(self, seqs: list[SeqKV]) -> None:
        """Each request's host bytes and device bytes with its staging, where they are past its peaks (once a
        decode step, for the batch)."""
        recs = list(map(self.seqs.get, (seq.seq_id for seq in seqs)))
        moved = [st for st in recs if st is not None and st.staging[:2] != (st.version, st.host.kv_bytes)]
        if len(moved) > 1:  # (after an event: their sizes from the host's block tables, not its page lists)
            per_layer = self.host.page_bytes_layers([st.host for st in moved])
            for st, b in zip(moved, per_layer.max(0, initial=0).tolist()):
                st.staging = (st.version, st.host.kv_bytes, 2 * b)
        for seq, st in zip(seqs, recs):
            if st is not None:
                st.peak_host_bytes = max(st.peak_host_bytes, st.host.kv_bytes)
                st.peak_device_bytes = max(st.peak_device_bytes, seq.kv_bytes + self._staging_of(st))

    # --- moves --------------------------------------------------------------------------------
    def place(self, seq: SeqKV, layer: int, positions, tier: int, fmt: str | None = None) -> int:
        """Move paged ``positions`` of one layer into ``tier`` (T2 in ``fmt``); returns how many moved.
        Residual-buffer tokens and positions no tier holds are skipped; a T2 token asked into T1 stays T2
        (its original values are gone, spec §2.5)."""
        pos = [int(p) for p in np.asarray(positions, dtype=np.int64).reshape(-1)]
        if not pos:
            return 0
        dev_loc = seq.layers[layer].loc
        on_dev = [p for p in pos if p in dev_loc]
        st = self.seqs.get(seq.seq_id)
        on_host = [p for p in pos if st is not None and p in st.host.layers[layer].loc]
        if tier == TIER_EVICTED:
            n = self.dev.evict(seq, layer, on_dev) if on_dev else 0
            return n + (self._drop_host(seq, layer, on_host) if on_host else 0)
        if tier == TIER_DEVICE:
            return self._promote(seq, layer, on_host) if on_host else 0
        n = self._demote(seq, layer, on_dev, fmt if tier == TIER_HOST_Q else None) if on_dev else 0
        if on_host and tier == TIER_HOST_Q:  # T1 -> T2 (or T2 in another format): re-encode on the host
            st = self.seqs[seq.seq_id]
            redo = [p for p in on_host if st.host.layers[layer].loc[p][0] != fmt]
            if redo:
                n += self._host_reencode(seq, layer, redo, fmt)
        return n

    def place_many(self, layer: int, jobs: list[tuple[SeqKV, np.ndarray]], tier: int, fmt: str | None = None
                   ) -> list[int]:
        """``place`` of each ``(request, positions)`` job (distinct requests) in one layer (``place_layers``)."""
        return self._place_layers(jobs, (layer,), tier, fmt).tolist()

    def place_layers(self, jobs: list[tuple[SeqKV, np.ndarray]], tier: int, fmt: str | None = None) -> np.ndarray:
        """``place_many`` of the same jobs in every layer, layer after layer (tiers chosen per token): each job's
        count summed over the layers."""
        return self._place_layers(jobs, range(self.dev.cfg.num_layers), tier, fmt)

    def _place_layers(self, jobs: list[tuple[SeqKV, np.ndarray]], layers, tier: int, fmt: str | None) -> np.ndarray:
        """In each layer the T0 <-> T1 copies of every job in one gather and scatter a format, device and host
        evictions in one pass each; the jobs' positions are read and counted as one array for all the layers, and
        each request's transfer counters updated once. Which tier holds each token ends the same as moving the jobs
        one at a time; the pages a promotion lands in may differ (every job's evictions come before the
        promotions). A host cap, T2 tokens or key-scale groups: job by job."""
        seqs = [seq for seq, _ in jobs]
        records = [self.seqs.get(seq.seq_id) for seq in seqs]
        if (self.cap is not None or tier == TIER_HOST_Q or len({id(s) for s in seqs}) < len(seqs)
                or any(p.group_specs for layer in layers for p in self.dev.pools[layer].values())
                or any(st is not None and any(st.orig_fmt[layer] for layer in layers) for st in records)):
            counts = np.zeros(len(jobs), np.int64)
            for layer in layers:  # (layer by layer, each layer's jobs in turn: a host cap fails at the same move)
                counts += [self.place(seq, layer, pos, tier, fmt) for seq, pos in jobs]
            return counts
        pos = [np.asarray(p, np.int64).reshape(-1) for _, p in jobs]
        lens = np.fromiter(map(len, pos), np.int64, len(pos))
        flat = np.concatenate(pos) if pos else np.empty(0, np.int64)
        job = np.repeat(np.arange(len(jobs)), lens)
        dev_rows = np.repeat(self.dev.rows(seqs), lens)
        host_rows = np.repeat(np.fromiter((-1 if st is None else st.host.row for st in records), np.int64,
                                          len(records)), lens)
        hosted = host_rows >= 0
        counts, dropped = np.zeros(len(jobs), np.int64), np.zeros(len(jobs), np.int64)
        moved, seconds = np.zeros(len(jobs), np.int64), np.zeros(len(jobs))
        changed = np.zeros(len(jobs), np.int64)  # layers whose host tier each job changed
        # the device's evictions (and a demotion's frees) of every layer in one pass after the loop, each job's a
        # row of [layers, jobs, m] (layers share nothing: a later layer's copies read only its own slots)
        dev_victims = None
        if tier != TIER_DEVICE and not any(s.fork_mode is not None for s in seqs) and \
                len(np.unique(job * (int(flat.max(initial=0)) + 1) + flat)) == len(flat):  # (distinct in each job)
            dev_victims = np.full((len(layers), len(jobs), int(lens.max(initial=0))), -1, np.int64)
            rank = np.arange(len(flat)) - np.repeat(np.cumsum(lens) - lens, lens)
        last = None  # (movers, their device records, their host records) of the last layer that moved any
        for li, layer in enumerate(layers):
            on_host = np.zeros(len(flat), bool)
            if tier != TIER_HOST and hosted.any():  # (a demotion reads the device alone)
                on_host[hosted] = self.host.held_flat(layer, host_rows[hosted], flat[hosted])
            if tier == TIER_EVICTED:
                on_dev = self.dev.held_flat(layer, dev_rows, flat)
                if dev_victims is not None:
                    dev_victims[li, job[on_dev], rank[on_dev]] = flat[on_dev]
                else:
                    n, at = _per_job(job, on_dev, len(jobs))
                    if len(at):
                        counts[at] += self.dev.evict_flat(layer, [seqs[j] for j in at], flat[on_dev], n[at])
                n, at = _per_job(job, on_host, len(jobs))
                if len(at):  # T3 from the host tier
                    self.host.evict_flat(layer, [records[j].host for j in at], flat[on_host], n[at], counted=False)
                    counts[at] += n[at]
                    dropped[at] += n[at]
                    changed[at] += 1
                    self.layer_versions[layer] += 1
                continue
            src = on_host if tier == TIER_DEVICE else self.dev.held_flat(layer, dev_rows, flat)
            n, movers = _per_job(job, src, len(jobs))
            if not len(movers):
                continue
            t0 = time.perf_counter()
            moving, k = flat[src], n[movers]
            if last is None or not np.array_equal(movers, last[0]):  # (the same movers' lists as the last layer's:
                devs = [seqs[j] for j in movers]  # no Python pass over them, and the caches' row lookups hit)
                hosts = [records[j].host if tier == TIER_DEVICE else self.record(seqs[j]).host for j in movers]
                last = (movers, devs, hosts)
            devs, hosts = last[1], last[2]
            if tier == TIER_DEVICE:  # T1 -> T0: copied back, the host copies freed
                moved[movers] += raw_copy_flat(self.host, hosts, self.dev, devs, layer, moving, k)
                self.host.evict_flat(layer, hosts, moving, k, counted=False)
                counts[movers] += k
            else:  # T0 -> T1: copied verbatim, the device slots freed (a move, not an eviction)
                moved[movers] += raw_copy_flat(self.dev, devs, self.host, hosts, layer, moving, k)
                if dev_victims is not None:
                    dev_victims[li, job[src], rank[src]] = moving
                else:
                    counts[movers] += self.dev.evict_flat(layer, devs, moving, k, counted=False)
            seconds[movers] += (time.perf_counter() - t0) * k / max(1, int(k.sum()))
            changed[movers] += 1
            self.layer_versions[layer] += 1
        if dev_victims is not None and (dev_victims >= 0).any():
            counts += self.dev.evict_rows_layers(np.asarray(list(layers), np.int64), seqs, dev_victims,
                                                 counted=tier == TIER_EVICTED)
        for j in np.flatnonzero(changed).tolist():  # each request's counters once, for every layer
            st = self.seqs[seqs[j].seq_id]
            st.version += int(changed[j])
            if dropped[j]:
                st.evicted_from_host += int(dropped[j])
                self.dev.count_evicted(seqs[j], int(dropped[j]))
            if moved[j]:
                self._moved(st, int(moved[j]), float(seconds[j]))
        return counts

    def demote_evicted(self, seq: SeqKV, layer: int, positions) -> int:
        """The ``demote`` cache setting: a policy's eviction becomes a move to T1/T2."""
        return self.place(seq, layer, positions, TIER_HOST_Q if self.demote_fmt else TIER_HOST, self.demote_fmt)

    def _demote(self, seq: SeqKV, layer: int, positions: list[int], fmt: str | None) -> int:
        import time

        t0 = time.perf_counter()
        st = self.record(seq)
        before = st.host.kv_bytes
        loc = seq.layers[layer].loc
        raw = [p for p in positions if fmt is None or loc[p][0] == fmt]
        enc = [p for p in positions if not (fmt is None or loc[p][0] == fmt)]
        moved = 0
        if raw:
            moved += raw_copy(self.dev, seq, self.host, st.host, layer, raw)
        if enc:
            classes = {p: (loc[p][0], int(self.dev.pools[layer][loc[p][0]].page_class[loc[p][1]])) for p in enc}
            moved += encode_copy(self.dev, seq, self.host, st.host, layer, enc, lambda p: fmt)
            st.orig_fmt[layer].update(classes)
        self._check_cap(seq, layer, positions, before)
        # frees the device slots (metadata; compacts in compact mode): a move, not an eviction
        n = self.dev.evict(seq, layer, positions, counted=False)
        self._changed(st, layer)
        self._moved(st, moved, time.perf_counter() - t0)
        return n

    def _promote(self, seq: SeqKV, layer: int, positions: list[int]) -> int:
        import time

        t0 = time.perf_counter()
        st = self.seqs[seq.seq_id]
        orig = st.orig_fmt[layer]
        raw = [p for p in positions if p not in orig]
        enc = [p for p in positions if p in orig]
        moved = 0
        if raw:
            moved += raw_copy(self.host, st.host, self.dev, seq, layer, raw)
        if enc:  # T2 -> T0: dequantized values re-encoded in the token's device format (lossy, spec §2.5)
            moved += encode_copy(self.host, st.host, self.dev, seq, layer, enc, lambda p: orig[p][0],
                                  thought=lambda p: orig[p][1])
            for p in enc:
                del orig[p]
        self._free_host(st, layer, positions)
        self._changed(st, layer)
        self._moved(st, moved, time.perf_counter() - t0)
        return len(positions)

    def _host_reencode(self, seq: SeqKV, layer: int, positions: list[int], fmt: str) -> int:
        st = self.seqs[seq.seq_id]
        orig = st.orig_fmt[layer]
        hloc = st.host.layers[layer].loc
        before = st.host.kv_bytes
        for p in positions:
            if p not in orig:
                f, page, _ = hloc[p]
                orig[p] = (f, int(self.host.pools[layer][f].page_class[page]))
        tmp = self.host.add_sequence(-(10 ** 9) - seq.seq_id)  # staging record for the re-encoded copies
        try:
            encode_copy(self.host, st.host, self.host, tmp, layer, positions, lambda p: fmt)
            self._free_host(st, layer, positions)
            raw_copy(self.host, tmp, self.host, st.host, layer, positions)
        finally:
            self.host.free_sequence(tmp.seq_id)
        self._check_cap(seq, layer, [], before)
        self._changed(st, layer)
        return len(positions)

    def _drop_host(self, seq: SeqKV, layer: int, positions: list[int]) -> int:
        st = self.seqs[seq.seq_id]
        for p in positions:
            st.orig_fmt[layer].pop(p, None)
        self._free_host(st, layer, positions)
        st.evicted_from_host += len(positions)
        self.dev.count_evicted(seq, len(positions))
        return len(positions)

    def _free_host(self, st: SeqTiers, layer: int, positions: list[int]) -> None:
        self.host.evict(st.host, layer, positions, counted=False)
        self._changed(st, layer)

    def _check_cap(self, seq: SeqKV, layer: int, positions: list[int], before: int) -> None:
        """Host-memory exhaustion: undo the host copies just made and fail with one clear line."""
        if self.cap is None or self.host_bytes_total() <= self.cap:
            return
        st = self.seqs[seq.seq_id]
        total = self.host_bytes_total()
        if positions:
            for p in positions:
                st.orig_fmt[layer].pop(p, None)
            self.host.evict(st.host, layer, positions)
        raise OutOfKVMemory(f"host KV memory is full ({total:,} of {self.cap:,} bytes "
                            f"with this move); raise --host-kv-memory, lower the batch size or evict more "
                            f"(e.g. --set evict_ratio=... or demote=none)", seq_id=seq.seq_id)

    def _changed(self, st: SeqTiers, layer: int) -> None:
        st.version += 1
        self.layer_versions[layer] += 1

    def _moved(self, st: SeqTiers, nbytes: int, seconds: float) -> None:
        """Transfer counters after a move of ``nbytes`` that took ``seconds`` (its versions are the caller's)."""
        st.transfer_bytes += nbytes
        st.move_bytes += nbytes
        st.move_seconds += seconds
        self.transfer_bytes_total += nbytes
        st.peak_host_bytes = max(st.peak_host_bytes, st.host.kv_bytes)

    def add_staged(self, seq_ids: list[int], nbytes: np.ndarray, seconds: np.ndarray) -> None:
        """A step's staging of requests ``seq_ids``: bytes copied to the device and the time it took, each."""
        for sid, nb, sec in zip(seq_ids, nbytes.tolist(), seconds.tolist()):
            st = self.seqs.get(sid)
            if st is not None and (nb or sec):
                st.transfer_bytes += nb
                st.move_seconds += sec
                self.transfer_bytes_total += nb

    # --- invariants (tests) -------------------------------------------------------------------
    def check(self, seq: SeqKV) -> None:
        """Assert the tiers partition the held positions and every byte counter equals a recount."""
        st = self.seqs.get(seq.seq_id)
        assert self.dev.recount_bytes(seq) == seq.kv_bytes, "device byte counter drifted"
        if st is None:
            return
        assert self.host.recount_bytes(st.host) == st.host.kv_bytes, "host byte counter drifted"
        for layer in range(self.dev.cfg.num_layers):
            dev = set(seq.layers[layer].loc) | set(seq.buffered_positions(layer))
            host = set(st.host.layers[layer].loc)
            assert not dev & host, f"layer {layer}: positions in two tiers: {sorted(dev & host)[:5]}"
            assert set(st.orig_fmt[layer]) <= host, "T2 record of a position the host does not hold"


def tier_stats(seq: SeqKV, num_layers: int, st: SeqTiers | None = None, staging: int = 0) -> dict[str, int | float]:
    """A request's per-tier numbers (``generate --json`` stats keys) from its host-tier record ``st`` (None: all
    of it is on the device; a cache that never made host tiers reports these without making them)."""
    L = num_layers
    dev_tokens = sum(t.live for t in seq.layers) + sum(seq.buffered(i) for i in range(L))
    host_tokens = sum(t.live for t in st.host.layers) if st else 0
    q_tokens = sum(len(d) for d in st.orig_fmt) if st else 0
    return {
        "kv_bytes_device": seq.kv_bytes + staging,
        "kv_bytes_staging": staging,
        "kv_bytes_host": st.host.kv_bytes if st else 0,
        "peak_kv_bytes_device": max(st.peak_device_bytes if st else 0, seq.peak_bytes),
        "peak_kv_bytes_host": st.peak_host_bytes if st else 0,
        "tokens_device": dev_tokens // L,
        "tokens_host": host_tokens // L,
        "tokens_host_compressed": q_tokens // L,
        "transfer_bytes": st.transfer_bytes if st else 0,
        "kv_move_s": round(st.move_seconds, 6) if st else 0.0,
    }


def _per_job(job: np.ndarray, mask: np.ndarray, n_jobs: int) -> tuple[np.ndarray, np.ndarray]:
    """How many of each job's positions ``mask`` marks (``job[i]``: position ``i``'s job), and the jobs with any."""
    n = np.bincount(job[mask], minlength=n_jobs)
    return n, np.flatnonzero(n)


__all__ = ["TierStore", "SeqTiers", "tier_stats", "parse_demote", "parse_host_format", "parse_tier",
           "TIER_DEVICE", "TIER_HOST", "TIER_HOST_Q", "TIER_EVICTED",
           "TIER_NAMES", "DEFAULT_HOST_FORMAT"]
