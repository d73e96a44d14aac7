"""The tensor-parallel group a process belongs to, and the collectives trtkv runs over it.

Every rank runs the same program (SPMD, as ``torchrun`` launches it): the same requests, the same policy
decisions, the same step order; each rank's model holds a slice of the weights and its cache a slice of the KV
heads. The collectives are the only places ranks meet, so each one is a verb here: ``all_reduce`` (row-parallel
projections), ``gather`` (KV heads for the policies' statistics and key reads, vocabulary slices of the logits),
``broadcast_tokens`` (rank 0's sampled tokens) and ``broadcast_object`` (a server's new requests). A failed
collective (a rank died, or did not answer within the timeout) raises :class:`RankLost`, one line that the CLI
prints before it exits non-zero.
"""
from __future__ import annotations

import datetime
import os
import re
from dataclasses import dataclass

import torch
import torch.distributed as dist

from trtkv.errors import TrtkvError

DEFAULT_TIMEOUT_S = 60.0  # a collective that waits longer ends the group (TRTKV_TP_TIMEOUT overrides)


class RankLost(TrtkvError):
    """A collective failed: another rank of the tensor-parallel group died or stopped answering."""


@dataclass(frozen=True)
class RankInfo:
    """Where this process stands in its group: torchrun's environment variables, or trtkv's launcher's."""
    rank: int
    size: int
    master_addr: str
    master_port: int

    @classmethod
    def from_env(cls) -> "RankInfo | None":
        if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
            return None
        try:
            return cls(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]),
                       os.environ.get("MASTER_ADDR", "127.0.0.1"), int(os.environ.get("MASTER_PORT", "29500")))
        except ValueError:
            raise TrtkvError("RANK, WORLD_SIZE and MASTER_PORT must be integers") from None


def timeout_s() -> float:
    raw = os.environ.get("TRTKV_TP_TIMEOUT", "")
    try:
        t = float(raw) if raw else DEFAULT_TIMEOUT_S
    except ValueError:
        raise TrtkvError(f"TRTKV_TP_TIMEOUT={raw!r} is not a number of seconds") from None
    if t <= 0:
        raise TrtkvError(f"TRTKV_TP_TIMEOUT must be positive, not {raw}")
    return t


class TensorParallelGroup:
    """This process's rank in a group of ``size`` (``torch.distributed``'s default process group)."""

    def __init__(self, rank: int, size: int, device: str = "cpu"):
        self.rank, self.size = rank, size
        self.device = device
        self.lost = False  # a collective failed: the backend's threads may still wait on the dead peer

    @property
    def is_leader(self) -> bool:
        """Rank 0: the one that prints, writes results and serves."""
        return self.rank == 0

    # --- collectives ----------------------------------------------------------------------------
    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        """Sum of every rank's ``t``, in place (a row-parallel projection's partial products)."""
        self._run(dist.all_reduce, t)
        return t

    def gather(self, t: torch.Tensor, dim: int) -> torch.Tensor:
        """Every rank's ``t`` (same shape everywhere) concatenated along ``dim`` in rank order."""
        t = t.contiguous()
        parts = [torch.empty_like(t) for _ in range(self.size)]
        self._run(dist.all_gather, parts, t)
        return torch.cat(parts, dim=dim)

    def broadcast_tokens(self, tokens: list[int]) -> list[int]:
        """Rank 0's sampled tokens on every rank (sampling happens once; unseeded requests draw differently)."""
        t = torch.tensor(tokens, dtype=torch.int64, device=self.device)  # (NCCL moves device tensors only)
        self._run(dist.broadcast, t, 0)
        return t.tolist()

    def broadcast_object(self, obj=None):
        """Rank 0's ``obj`` (picklable) on every rank."""
        box = [obj]
        self._run(dist.broadcast_object_list, box, 0)
        return box[0]

    def _run(self, op, *args):
        try:
            return op(*args)
        except (RuntimeError, dist.DistError) as e:  # gloo: the peer closed its connection, or the timeout
            self.lost = True
            raise RankLost(f"tensor-parallel rank lost (this is rank {self.rank} of {self.size}): "
                           f"{_first_line(e)}") from None

    def close(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()


def _first_line(e: BaseException) -> str:
    """The first line of a backend error, without gloo's ``[file.cc:123]`` source location."""
    first = (str(e).strip().splitlines() or [type(e).__name__])[0]
    return re.sub(r"^\[[^\]]*:\d+\]\s*", "", first)[:160]


_GROUP: TensorParallelGroup | None = None


def current_group() -> TensorParallelGroup | None:
    """The process's group, once :func:`join_group` made one."""
    return _GROUP


def join_group(info: RankInfo, device: str = "cpu") -> TensorParallelGroup:
    """Join (or return the already joined) group: gloo on CPU, NCCL on CUDA, the collective timeout of
    ``TRTKV_TP_TIMEOUT``."""
    global _GROUP
    if _GROUP is not None:
        if _GROUP.size != info.size:
            raise TrtkvError(f"this process is rank {_GROUP.rank} of a group of {_GROUP.size}, not {info.size}")
        return _GROUP
    backend = "nccl" if device.startswith("cuda") else "gloo"
    if backend == "gloo" and not dist.is_gloo_available():
        raise TrtkvError("tensor parallelism on CPU needs torch.distributed's gloo backend, which this torch lacks")
    if device.startswith("cuda"):
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", info.rank)))
    try:
        dist.init_process_group(backend, init_method=f"tcp://{info.master_addr}:{info.master_port}",
                                rank=info.rank, world_size=info.size,
                                timeout=datetime.timedelta(seconds=timeout_s()))
    except (RuntimeError, dist.DistError, ValueError) as e:
        raise RankLost(f"could not form the tensor-parallel group of {info.size}: {_first_line(e)}") from None
    _GROUP = TensorParallelGroup(info.rank, info.size, device)
    return _GROUP


def group_for(tp: int, device: str = "cpu") -> TensorParallelGroup | None:
    """The group a ``tp``-rank engine runs in (None for one rank): the one this process joined, or the one its
    environment names (``torchrun``, or the ranks the ``trtkv`` command started)."""
    if tp == 1:
        return None
    group = current_group()
    if group is None:
        info = RankInfo.from_env()
        if info is None:
            raise TrtkvError(f"--tp {tp}: this process is not one of {tp} ranks; run it through the `trtkv` command "
                             f"(it starts the ranks) or `torchrun --nproc-per-node {tp}`")
        group = join_group(info, device)
    if group.size != tp:
        raise TrtkvError(f"the engine runs on {tp} tensor-parallel ranks but this group has {group.size}")
    return group


@dataclass(frozen=True)
class HeadShards:
    """The runtime's view of tensor parallelism: this rank's cache holds a slice of the model's ``num_kv_heads``
    (all of them when ``sharded`` is false). Whatever a policy reads across heads (attention
    statistics, keys) is gathered here, once per read, so every rank decides the same."""
    group: TensorParallelGroup
    sharded: bool
    num_kv_heads: int

    def gather(self, t: torch.Tensor, dim: int) -> torch.Tensor:
        """Every rank's heads of ``t`` along ``dim`` (``t`` itself when each rank holds every head)."""
        return self.group.gather(t, dim) if self.sharded else t

    def agree(self, tokens: list[int]) -> list[int]:
        """Rank 0's sampled tokens."""
        return self.group.broadcast_tokens(tokens)
