"""Host-tier staging: bring a layer's T1/T2 pages to the device so ``paged_attention`` can read them.

Per decode step and layer, the batch's host pages of every format are copied into a device staging pool
(two of them, one layer each: layer l+1 is copied while layer l computes) and attended with the same
``paged_attention`` plugin as the device pages; ``decode_attention`` merges all partials by log-sum-exp.

CUDA (tiered-memory spec §2.6 "stream", §4.5): host pools are pinned; the copy of layer l+1 is issued on a
separate copy stream as soon as layer l's staging is handed to attention; the compute stream waits on that
copy's event before reading it, and a buffer is rewritten only after the attention that read it (two layers
earlier) has finished (an event recorded by ``release``). The host-side gather goes through a pinned scratch
buffer per parity, reused only after its previous H2D copy completed. The policy matrix's tiered cases pass
on an H200; the copy/compute overlap is not measured.

CPU: the host and the device are one memory, so by default nothing is copied: the attention kernel reads the
host pools where they are, through block tables of the batch's rows (at 32 layers × 256 requests ~4 ms a step
less bookkeeping, attention unchanged). A layer's batch tables and their positions are kept from step to step
while its host tier and the batch stay the same (tiers change only at a policy's events).
``HostStaging(cache, copy=True)`` stages through the copy path synchronously instead, so the CUDA path's
indexing, block tables and merge stay tested without a GPU.

A policy may move tokens between tiers after a layer was prefetched (``before_attention``); every stage
records the host tiers' per-layer versions and is redone synchronously when they changed.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np
import torch

from trtkv.cache.manager import KVCacheManager, SeqKV
from trtkv.runtime.attention import source_positions


def _batch_table(b: int, at: np.ndarray, table: np.ndarray) -> np.ndarray:
    """``[b, P]`` int32 block tables of the whole batch: the host records' rows ``table`` at batch rows ``at``,
    -1 elsewhere (requests without host pages)."""
    out = np.full((b, table.shape[1]), -1, np.int32)
    out[at] = table
    return out


class StagedPool:
    """The slice of one host pool copied to the device: what ``paged_attention`` and the statistics read
    of a ``PagePool`` (fields, key-scale groups, validity words, slot positions)."""

    def __init__(self, fmt, B: int, H: int, D: int, fields, group_fields, k_group, valid, slot_pos):
        self.fmt, self.B, self.H, self.D = fmt, B, H, D
        self.fields, self.group_fields, self.k_group = fields, group_fields, k_group
        self._valid = valid
        self.slot_pos = slot_pos
        self.group_specs = fmt.group_fields(H, D)

    def valid_bits(self) -> torch.Tensor:
        return self._valid


@dataclass
class _Stage:
    sources: list  # [(StagedPool, block_table, LayerScales)]
    versions: tuple
    nbytes: np.ndarray  # bytes staged per request (batch order)
    total: int = 0  # their sum
    event: object = None  # CUDA: the copy-done event the compute stream waits on
    seconds: float = 0.0  # staging time not yet accounted (a stage kept for later steps costs them nothing)
    positions: tuple | None = None  # source_positions of the sources, once a statistic asked


class _Buffer:
    """One parity's staging tensors per format, grown (never shrunk) to the largest layer seen."""

    def __init__(self):
        self.dev: dict[str, list[torch.Tensor]] = {}
        self.scratch: dict[str, list[torch.Tensor]] = {}  # CUDA: pinned host gather buffers
        self.copy_done = None  # CUDA: event of this parity's last H2D (scratch reusable after it)
        self.attn_done = None  # CUDA: event after the attention that last read this parity
        self.issued: dict[str, list[torch.Tensor]] = {}  # CUDA: tensors the copy stream has written before

    def tensors(self, key: str, like: list[torch.Tensor], n: int, device, pinned: bool) -> list[torch.Tensor]:
        cur = self.dev.get(key)
        if cur is None or cur[0].shape[0] < n or len(cur) != len(like):
            cap = max(n, 2 * cur[0].shape[0] if cur else n)
            self.dev[key] = [torch.empty(cap, *t.shape[1:], dtype=t.dtype, device=device) for t in like]
            if pinned:
                self.scratch[key] = [torch.empty(cap, *t.shape[1:], dtype=t.dtype, pin_memory=True) for t in like]
        return self.dev[key]

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for ts in self.dev.values() for t in ts)


class HostStaging:
    """Stages the host tiers of a batch layer by layer (double-buffered; prefetches the next layer)."""

    def __init__(self, cache: KVCacheManager, copy: bool | None = None):
        self.cache = cache
        self.device = torch.device(cache.cfg.device)
        self.cuda = self.device.type == "cuda" and torch.cuda.is_available()
        self.copy = self.cuda or bool(copy)  # (a GPU kernel cannot read the host pools: CUDA always copies)
        self.copy_stream = torch.cuda.Stream(self.device) if self.cuda else None
        self.buffers = (_Buffer(), _Buffer())
        self.pending: dict[int, _Stage] = {}
        self.batch: list[SeqKV] = []
        self.stepping = False  # some layer of this step staged
        self.copy_seconds = 0.0  # CPU: wall time of the copies; CUDA: host-side issue time (see copy_events)
        self.copy_events: list[tuple] = []  # CUDA: (start, end) timing events on the copy stream
        self.bytes_staged = 0
        self.step_bytes = np.zeros(0, np.int64)  # this step's staged bytes per request of the batch
        self.step_seconds = np.zeros(0)  # CPU: this step's copy time per request (each layer's, shared by bytes)
        self._records: tuple | None = None  # (TierStore.records, host records, their batch rows) of the batch
        self._batch_ids: tuple[int, ...] = ()  # the previous step's requests (kept stages are that batch's)
        self._kept: dict[int, tuple[tuple, _Stage]] = {}  # CPU, no copy: layer -> (versions, stage) of earlier steps
        self._current: _Stage | None = None  # the stage acquire handed out last

    def _host_batch(self) -> tuple[list, np.ndarray]:
        """The batch's host-tier records (requests of the host cache) and their rows in the batch: looked up again
        only when the batch changed or a record appeared or went (a policy may demote in ``before_attention``)."""
        tiers = self.cache.tiers
        if self._records is None or self._records[0] != tiers.records:
            recs = tiers.host_records(self.batch)
            rows = np.fromiter((i for i, r in enumerate(recs) if r is not None), np.int64)
            self._records = (tiers.records, [recs[i] for i in rows.tolist()], rows)
        return self._records[1], self._records[2]

    def staging_bytes(self) -> int:
        """Device bytes the staging pools hold now (both parities)."""
        return sum(b.nbytes() for b in self.buffers)

    # --- the per-layer protocol used by EngineCore.decode_step -------------------------------------
    def begin_step(self, seqs: list[SeqKV]) -> None:
        if self.cache.has_tiers:
            ids = tuple(s.seq_id for s in seqs)
            if ids != self._batch_ids:
                self._batch_ids, self._records = ids, None
                self._kept.clear()
        self.batch = list(seqs)
        self.pending.clear()
        self.stepping = False
        self.step_bytes = np.zeros(len(seqs), np.int64)
        self.step_seconds = np.zeros(len(seqs))

    def sources(self, layer: int, num_layers: int) -> list | None:
        """The engine's per-layer call: None while no request of the batch has a host-tier record (checked per
        layer: a policy may demote in ``before_attention``, and those tokens are attended at once)."""
        if not self.cache.has_tiers or not len(self._host_batch()[1]):
            return None
        self.stepping = True
        return self.acquire(layer, num_layers)

    def acquire(self, layer: int, num_layers: int) -> list:
        """The staged sources of ``layer`` (prefetched or staged now), and the prefetch of ``layer + 1``."""
        stage = self.pending.pop(layer, None)
        if stage is None or stage.versions != self._versions(layer):
            stage = self._stage(layer)
        if self.cuda and stage.event is not None:
            torch.cuda.current_stream(self.device).wait_event(stage.event)
        self._account(stage)
        self._current = stage
        if layer + 1 < num_layers:
            self.pending[layer + 1] = self._stage(layer + 1)
        return stage.sources

    def positions(self) -> tuple[list[np.ndarray], np.ndarray]:
        """``source_positions`` of the sources ``acquire`` handed out last (the statistics' columns), kept with
        the stage while it is kept."""
        stage = self._current
        if stage.positions is None:
            stage.positions = source_positions([(pool, bt) for pool, bt, _ in stage.sources], len(self.batch))
        return stage.positions

    def release(self, layer: int) -> None:
        """Attention of ``layer`` is enqueued: its buffer may be rewritten once that attention finishes."""
        if self.cuda:
            ev = torch.cuda.Event()
            ev.record(torch.cuda.current_stream(self.device))
            self.buffers[layer % 2].attn_done = ev

    def end_step(self) -> None:
        if not self.stepping:
            return
        self.stepping = False
        self.pending.clear()
        if self.cuda:  # host pools may be written after the step (tier events): no copy may be in flight
            self.copy_stream.synchronize()
        seconds = self.step_seconds
        if self.cuda and self.copy_events:  # copy-stream time, attributed by bytes staged
            torch.cuda.current_stream(self.device).synchronize()
            step_s = sum(a.elapsed_time(b) for a, b in self.copy_events) / 1e3
            self.copy_seconds += step_s
            self.copy_events.clear()
            total = int(self.step_bytes.sum())
            seconds = step_s * self.step_bytes / total if total else np.zeros(len(self.batch))
        self.cache.tiers.add_staged([s.seq_id for s in self.batch], self.step_bytes, seconds)

    # --- staging -----------------------------------------------------------------------------------
    def _versions(self, layer: int) -> tuple[int, int]:
        tiers = self.cache.tiers
        return tiers.records, int(tiers.layer_versions[layer])

    def _stage(self, layer: int) -> _Stage:
        if self.copy:
            return self._staged(layer)
        # the kernel reads the host pools in place: the batch tables stay right until the layer's host tier changes
        key = self._versions(layer)  # (another batch cleared them)
        kept = self._kept.get(layer)
        if kept is not None and kept[0] == key:
            return kept[1]
        stage = self._staged(layer)
        self._kept[layer] = (key, stage)
        return stage

    def _staged(self, layer: int) -> _Stage:
        tiers = self.cache.tiers
        host = tiers.host
        buf = self.buffers[layer % 2]
        t0 = time.perf_counter()
        b = len(self.batch)
        sources, nbytes = [], np.zeros(b, np.int64)
        stream_ctx = None
        if self.cuda:
            if buf.copy_done is not None:
                buf.copy_done.synchronize()  # the pinned scratch of this parity is free again
            stream_ctx = torch.cuda.stream(self.copy_stream)
            if buf.attn_done is not None:
                self.copy_stream.wait_event(buf.attn_done)  # do not overwrite what layer l-2 still reads
            start = torch.cuda.Event(enable_timing=True)
            start.record(self.copy_stream)
        records, at = self._host_batch()
        for hpool, host_bt in host.block_tables(layer, records) if records else ():
            fmt = hpool.fmt.name
            table = host_bt.numpy()
            held = table >= 0
            nbytes[at] += held.sum(1) * hpool.page_bytes
            if not self.copy:  # the kernel reads the host pool itself: the batch's rows of its tables
                sources.append((hpool, torch.from_numpy(_batch_table(b, at, table)), host.layer_scales(layer, fmt)))
                continue
            flat = table[held]  # the batch's host pages, request by request, each in its table order
            n = len(flat)
            idx = torch.from_numpy(flat.astype(np.int64))
            like = [*hpool.fields, hpool.k_group[:, None]]
            dst = buf.tensors(fmt, like, n, self.device, self.cuda)
            if self.cuda:
                if dst is not buf.issued.get(fmt):  # fresh tensors (allocated on the compute stream, possibly
                    self.copy_stream.wait_stream(torch.cuda.current_stream(self.device))  # reusing its blocks)
                    buf.issued[fmt] = dst
                scratch = buf.scratch[fmt]
                for src, sc in zip(like, scratch):
                    torch.index_select(src, 0, idx, out=sc[:n])
                with stream_ctx:
                    for sc, d in zip(scratch, dst):
                        d[:n].copy_(sc[:n], non_blocking=True)
                # small, copied synchronously on the compute stream (allocated there, so no record_stream):
                # the host arena may be written by a demotion before an asynchronous copy would have landed
                groups = [g.to(self.device) for g in hpool.group_fields]
                valid = torch.from_numpy(hpool.valid[flat]).to(self.device)
            else:  # CPU with copy=True: a real copy into the separate staging pool
                for src, d in zip(like, dst):
                    torch.index_select(src, 0, idx, out=d[:n])
                groups = [g.clone() for g in hpool.group_fields]  # the key-scale arena, as the kernel indexes it
                valid = torch.from_numpy(hpool.valid[flat].copy())
            fields = [d[:n] for d in dst[:-1]]
            k_group = dst[-1][:n, 0]
            mine = np.full(table.shape, -1, np.int32)  # the staged pool's pages, in flat's order
            mine[held] = np.arange(n, dtype=np.int32)
            staged_table = _batch_table(b, at, mine)
            staged = StagedPool(hpool.fmt, hpool.B, hpool.H, hpool.D, fields, groups, k_group, valid,
                                hpool.slot_pos[flat])
            sources.append((staged, torch.from_numpy(staged_table).to(self.device), host.layer_scales(layer, fmt)))
        stage = _Stage(sources, self._versions(layer), nbytes=nbytes, total=int(nbytes.sum()))
        if self.cuda:
            end = torch.cuda.Event(enable_timing=True)
            end.record(self.copy_stream)
            self.copy_events.append((start, end))
            stage.event = end
            buf.copy_done = end
        stage.seconds = time.perf_counter() - t0
        return stage

    def _account(self, stage: _Stage) -> None:
        total = stage.total
        self.bytes_staged += total
        if not self.cuda:
            self.copy_seconds += stage.seconds
        if total:
            self.step_bytes += stage.nbytes
            if not self.cuda and stage.seconds:
                self.step_seconds += stage.seconds * stage.nbytes / total
        stage.seconds = 0.0
