"""Start a command's tensor-parallel ranks: ``trtkv generate ENGINE --tp 2`` runs as rank 0 and starts ranks
1..N-1 as ``python -m trtkv`` with the same arguments and ``torchrun``'s environment variables (RANK, WORLD_SIZE,
LOCAL_RANK, MASTER_ADDR, MASTER_PORT), so a command started by ``torchrun`` and one started by trtkv run alike.
The other ranks' output goes to log files; when rank 0 exits it closes the group (a rank still waiting on a
collective then fails at once instead of at the timeout) and waits for them briefly before stopping them."""
from __future__ import annotations

import atexit
import os
import shutil
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

from trtkv.distributed.group import RankInfo, TensorParallelGroup, current_group, join_group
from trtkv.errors import TrtkvError

EXIT_GRACE_S = 10.0  # how long rank 0 waits at exit for the other ranks to finish the same program

_workers: list[subprocess.Popen] = []
_log_dir: Path | None = None


def threads_per_rank(size: int) -> int:
    """CPU threads each of ``size`` ranks on one machine takes (they would otherwise all take every core)."""
    return max(1, (os.cpu_count() or 1) // size)


def start_ranks(size: int, argv: list[str] | None = None) -> RankInfo:
    """Start ranks 1..size-1 of this process's command line (``argv``, default ``sys.argv[1:]``) on this
    machine; returns rank 0's place in the group (this process)."""
    global _log_dir
    with socket.socket() as s:  # a free port for the group's rendezvous
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    _log_dir = Path(tempfile.mkdtemp(prefix="trtkv-ranks-"))
    args = list(sys.argv[1:] if argv is None else argv)
    threads = str(threads_per_rank(size))
    for r in range(1, size):
        env = {**os.environ, "RANK": str(r), "WORLD_SIZE": str(size), "LOCAL_RANK": str(r),
               "LOCAL_WORLD_SIZE": str(size), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
               "OMP_NUM_THREADS": threads}
        with open(_log_dir / f"rank{r}.log", "wb") as log:
            _workers.append(subprocess.Popen([sys.executable, "-m", "trtkv", *args], env=env,
                                             stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT))
    atexit.register(stop_ranks)
    return RankInfo(0, size, "127.0.0.1", port)


def lost_rank() -> str | None:
    """A started rank that has exited, as ``"rank N exited with code C (log: PATH)"``; None while all run."""
    for r, p in enumerate(_workers, start=1):
        code = p.poll()
        if code is not None:
            return f"rank {r} exited with code {code} (log: {_log_dir / f'rank{r}.log'})"
    return None


def stop_ranks() -> None:
    """Close this process's group, give the started ranks ``EXIT_GRACE_S`` to finish, stop what is left. Their
    logs are removed when every rank ended cleanly."""
    group = current_group()
    if group is not None:
        group.close()
    clean = True
    for p in _workers:
        try:
            clean &= p.wait(timeout=EXIT_GRACE_S) == 0
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
            clean = False
    _workers.clear()
    if clean and _log_dir is not None:
        shutil.rmtree(_log_dir, ignore_errors=True)


def exit_process(code: int) -> None:
    """End this process with ``code``. A process whose group was lost runs its exit handlers (stopping the ranks
    it started), flushes and leaves without the interpreter's teardown: destroying gloo's state while a thread
    still waits on the dead peer aborts (``terminate called without an active exception``, exit -6)."""
    group = current_group()
    if group is None or not group.lost:
        sys.exit(code)
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(code)


def join_ranks(tp: int, device: str | None = None) -> TensorParallelGroup | None:
    """A command's ``tp`` ranks: started here when the environment names none (this process is rank 0), else
    joined (a rank trtkv or ``torchrun`` started). Ranks other than 0 print nothing to stdout. None for one rank."""
    if tp < 1:
        raise TrtkvError(f"--tp must be a positive number of ranks, got {tp}")
    if tp == 1:
        return None
    import torch

    info = RankInfo.from_env()
    if info is None:
        info = start_ranks(tp)
        torch.set_num_threads(threads_per_rank(tp))
    on_gpu = device.startswith("cuda") if device else torch.cuda.is_available()
    group = join_group(info, "cuda" if on_gpu else "cpu")
    if not group.is_leader:
        sys.stdout = open(os.devnull, "w")  # noqa: SIM115 (the process's stdout until it exits)
    return group


def rank_out(out: Path | None) -> Path | None:
    """Where this rank writes a command's ``--out``: rank 0 the given directory, the others a scratch one."""
    group = current_group()
    if out is None or group is None or group.is_leader:
        return out
    scratch = tempfile.mkdtemp(prefix=f"trtkv-rank{group.rank}-")
    atexit.register(shutil.rmtree, scratch, True)
    return Path(scratch)
