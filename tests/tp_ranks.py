"""Run a function on every rank of a tensor-parallel group of processes (torch.multiprocessing, gloo), the way
``torchrun`` would start them: each rank gets RANK / WORLD_SIZE / MASTER_* and returns its value."""
from __future__ import annotations

import os
import socket
import traceback

import torch.multiprocessing as mp


def _entry(rank: int, size: int, port: int, fn, args, queue) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(size), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    import torch

    torch.set_num_threads(1)
    try:
        queue.put((rank, fn(*args), None))
    except BaseException:  # noqa: BLE001 (the parent reports it)
        queue.put((rank, None, traceback.format_exc()))


def run_ranks(fn, size: int, *args, timeout_s: float = 900) -> list:
    """``[fn(*args) on rank 0, ..., on rank size-1]``; a rank's exception fails the call with its traceback."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=_entry, args=(r, size, port, fn, args, queue)) for r in range(size)]
    for p in procs:
        p.start()
    try:
        got = [queue.get(timeout=timeout_s) for _ in procs]
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    errors = [f"rank {r}:\n{err}" for r, _, err in got if err]
    if errors:
        raise AssertionError("\n".join(errors))
    return [v for _, v, _ in sorted(got, key=lambda t: t[0])]
