"""``trtkv search``: run the tree search over a task's problems with one engine; one record per problem."""
from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from trtkv.errors import TrtkvError
from trtkv.search.config import SearchConfig
from trtkv.search.driver import run_search
from trtkv.search.report import summarize
from trtkv.search.tasks import get_task


def load_oracle(path: Path | None) -> dict[str, int]:
    """Per-problem peak cached tokens of a full-cache search (``budget_basis=oracle_peak``)."""
    if path is None:
        return {}
    f = path / "results.json" if path.is_dir() else path
    try:
        doc = json.loads(f.read_text())
        return {r["problem"]: int(r["peak_cached_tokens"]) for r in doc["records"]}
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise TrtkvError(f"cannot read the oracle search results {f} ({type(e).__name__}: {e})") from None


def run_search_task(engine, task_name: str, cfg: SearchConfig, limit: int | None = None, data: str | None = None,
                    oracle: Path | None = None, progress=None, shard: tuple[int, int] = (0, 1)) -> dict[str, Any]:
    task = get_task(task_name)
    cfg.validate()
    if limit is not None and limit <= 0:
        raise TrtkvError(f"--limit must be positive, got {limit}")
    problems = task.problems(limit, data, cfg.seed)[shard[0]::shard[1]]
    peaks = load_oracle(oracle)
    core = engine.make_core()
    encode = lambda text: engine.encode_prompt(text, cfg.chat)  # noqa: E731
    records = []
    t0 = time.perf_counter()
    for i, p in enumerate(problems):
        rec = run_search(core, encode, task, p, cfg, peaks.get(p.id))
        records.append(rec)
        if progress:
            progress(i + 1, len(problems), rec)
    return {"kind": "trtkv-search", "version": 1, "task": task_name, "engine": str(engine.path),
            "policy": engine.manifest.policy.name, "policy_params": engine.policy.params(),
            "config": vars(cfg), "wall_s": time.perf_counter() - t0, "summary": summarize(records),
            "records": records}
