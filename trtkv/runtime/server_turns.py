"""What a tensor-parallel server's rank 0 tells the other ranks each turn of its engine loop (``Engine._loop``,
``Engine.follow``): the requests it admitted and the ids it cancelled, so every rank runs the same batches."""
from __future__ import annotations

import dataclasses
import queue

from trtkv.runtime.request import Request
from trtkv.runtime.sampling import SamplingParams


@dataclasses.dataclass(frozen=True)
class RequestSpec:
    """What another rank needs to run the same request: its id, prompt and sampling parameters."""
    req_id: int
    prompt: str
    prompt_ids: list[int]
    params: SamplingParams

    @classmethod
    def of(cls, req: Request) -> "RequestSpec":
        return cls(req.req_id, req.prompt, list(req.prompt_ids), req.params)


@dataclasses.dataclass(frozen=True)
class Tick:
    """One turn of a tensor-parallel server's loop, broadcast by rank 0: requests admitted, ids cancelled."""
    requests: list[RequestSpec]
    cancels: list[int]
    stop: bool = False


def drain(q: queue.Queue) -> list:
    out = []
    while True:
        try:
            out.append(q.get_nowait())
        except queue.Empty:
            return out
