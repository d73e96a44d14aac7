"""AMS's query buffer: each request's decode queries since its last event, read back at the event.

A request logs one entry a step - the position it wrote, the step's ``StepQueries`` (the batch's queries of every
layer, shared) and its row there - not a query per layer. At an event ``EventQueries`` reads the logs of the
batch's due requests: when they all logged the same steps (a lockstep batch), a group's queries of a layer come
from each step's batch tensor by one row gather; otherwise request by request.
"""
from __future__ import annotations

import numpy as np
import torch

from trtkv.policies.base import StepQueries, StepStats


class QueryLog:
    """One request's buffered steps, oldest first: ``(position written, StepQueries, row)``."""

    def __init__(self) -> None:
        self.entries: list[tuple[int, StepQueries, int]] = []

    def add(self, written: int, stats: StepStats) -> None:
        if stats.queries is not None:
            self.entries.append((written, stats.queries, stats.row))

    def of(self, layer: int) -> list[tuple[int, torch.Tensor]]:
        """``(position, q [Hq, D])`` of every buffered step that gave this request ``layer``'s query."""
        out = []
        for pos, sq, row in self.entries:
            q = sq.of(layer, row)
            if q is not None:
                out.append((pos, q))
        return out


class EventQueries:
    """The buffered queries of an event's requests (``logs``, one per request), layer by layer."""

    def __init__(self, logs: list[QueryLog]):
        self.logs = logs
        first = logs[0].entries
        steps = [sq for _, sq, _ in first]
        self.aligned = all(len(log.entries) == len(steps) and all(e[1] is sq for e, sq in zip(log.entries, steps))
                           for log in logs)
        self.steps = steps if self.aligned else []
        if self.aligned and steps:
            self.rows = np.array([[row for _, _, row in log.entries] for log in logs], np.int64)  # [R, n]
            self.pos = np.array([[p for p, _, _ in log.entries] for log in logs], np.int64)  # [R, n]
        self._full: dict[int, bool] = {}

    def _every_step(self, layer: int) -> bool:
        """Aligned, and every request asked for ``layer`` at every buffered step (then a count is the log's)."""
        got = self._full.get(layer)
        if got is None:
            got = self.aligned and all(sq.wanted(layer, self.rows[:, j]) for j, sq in enumerate(self.steps))
            self._full[layer] = got
        return got

    def counts(self, layer: int) -> np.ndarray:
        """Buffered queries of ``layer`` per request ``[R]``."""
        if self._every_step(layer):
            return np.full(len(self.logs), len(self.steps), np.int64)
        return np.fromiter((len(log.of(layer)) for log in self.logs), np.int64, len(self.logs))

    def last(self, layer: int, idx: list[int], m: int) -> tuple[torch.Tensor, np.ndarray]:
        """The last ``m`` queries of ``layer`` of requests ``idx`` (each buffered at least ``m``): ``(q [k, m, Hq,
        D], positions [k, m])``."""
        if self._every_step(layer):
            n = len(self.steps)
            sel = np.asarray(idx, np.int64)
            cols = []
            for j in range(n - m, n):
                q = self.steps[j].layers[layer][0]
                rows = self.rows[sel, j]
                same = len(rows) == q.shape[0] and bool((rows == np.arange(len(rows))).all())
                cols.append(q if same else q[torch.from_numpy(rows).to(q.device)])
            return torch.stack(cols, 1), self.pos[sel, n - m:]
        recs = [self.logs[i].of(layer)[-m:] for i in idx]
        q = torch.stack([torch.stack([q for _, q in rec]) for rec in recs])
        return q, np.array([[p for p, _ in rec] for rec in recs], np.int64)
