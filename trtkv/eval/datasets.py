"""Typed loaders for the offline evaluation sets and reasoning traces.

The data is not fetched at run time: it lives in a shared data directory next to
the checkout (or wherever ``--data``/``TRTKV_DATA_DIR`` points), and a fresh clone
still has small packaged subsets in ``trtkv/data`` so tests and smoke runs work.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

ENV_VAR = "TRTKV_DATA_DIR"
PACKAGE_DATA_DIR = Path(__file__).resolve().parent.parent / "data"
REPO_ROOT = PACKAGE_DATA_DIR.parent.parent
SIBLING_DATA_DIR = REPO_ROOT.parent / "shared" / "data"

# task -> (file name in a full data dir, file name of the packaged subset or None)
TASK_FILES: dict[str, tuple[str, str | None]] = {
    "gsm8k": ("gsm8k_test.jsonl", None),
    "math500": ("math500_test.jsonl", None),
    "aime24": ("aime24_test.jsonl", None),
    "aime25": ("aime25_test.jsonl", None),
    "calibration": ("calibration_prompts.jsonl", "calibration_prompts.jsonl"),
    "traces": ("r1distill_traces_thought_anchors.jsonl", "traces_small.jsonl"),
    "traces_areal": ("r1distill_traces_areal_pr1340.jsonl", None),
}
PROBLEM_TASKS = ("gsm8k", "math500", "aime24", "aime25", "calibration")
TRACE_TASKS = ("traces", "traces_areal")


class DataFileNotFoundError(FileNotFoundError):
    """Raised with one message that says what was looked for and how to fix it."""


@dataclass(frozen=True)
class Problem:
    """One benchmark question.

    ``answer`` is the dataset's field verbatim (for gsm8k the whole worked solution
    ending in ``#### N``); grade against ``answers.reference_answer(problem, task)``.
    """

    id: str
    question: str
    answer: str
    source: str


@dataclass(frozen=True)
class Trace:
    """A recorded reasoning rollout: ``prompt + completion`` is the exact token text."""

    id: str
    model: str
    prompt: str
    completion: str
    question: str
    gt_answer: str | None


def _check_task(task: str) -> tuple[str, str | None]:
    if task not in TASK_FILES:
        raise ValueError(f"unknown task {task!r}; expected one of {', '.join(TASK_FILES)}")
    return TASK_FILES[task]


def resolve_data_file(task: str, path: str | os.PathLike | None = None) -> Path:
    """Find the file for ``task``.

    An explicit path or ``TRTKV_DATA_DIR`` is authoritative (a typo must not silently
    fall back to a tiny subset); the sibling shared dir and the packaged subset are
    fallbacks for the default, unconfigured case.
    """
    name, packaged = _check_task(task)
    hint = f"pass --data FILE or set {ENV_VAR} to a directory containing {name}"
    if path is not None:
        p = Path(path).expanduser()
        cand = p / name if p.is_dir() else p
        if cand.is_file():
            return cand
        raise DataFileNotFoundError(
            f"data file for task {task!r} not found: {cand} (explicit path); {hint}")
    env = os.environ.get(ENV_VAR)
    if env:
        cand = Path(env).expanduser() / name
        if cand.is_file():
            return cand
        raise DataFileNotFoundError(
            f"data file for task {task!r} not found: {cand} (from {ENV_VAR}={env}); {hint}")
    tried = [SIBLING_DATA_DIR / name]
    if packaged:
        tried.append(PACKAGE_DATA_DIR / packaged)
    for cand in tried:
        if cand.is_file():
            return cand
    raise DataFileNotFoundError(
        f"data file for task {task!r} not found; looked for "
        f"{' and '.join(str(c) for c in tried)}; {hint}")


def _read_jsonl(path: Path, limit: int | None) -> Iterator[dict]:
    with open(path, encoding="utf-8") as f:
        n = 0
        for line in f:
            if not line.strip():
                continue
            if limit is not None and n >= limit:
                return
            n += 1
            yield json.loads(line)


def _problem(task: str, i: int, r: dict) -> Problem:
    if task == "gsm8k":
        return Problem(f"gsm8k-{i}", r["question"], r["answer"], "gsm8k")
    if task == "math500":
        return Problem(r["unique_id"], r["problem"], r["answer"], "math500")
    if task in ("aime24", "aime25"):
        return Problem(f"{task}-{r['id']}", r["problem"], str(r["answer"]), task)
    return Problem(r["id"], r["question"], str(r["answer"]), r.get("source", task))


def _trace(r: dict) -> Trace:
    if "reasoning" in r:  # thought-anchors layout (and the packaged subset)
        return Trace(r["id"], r["model"], r["prompt"], r["reasoning"], r["question"],
                     r.get("gt_answer"))
    rid = f"{r['run']}/{r['task_id']}/{r['sample_idx']}"
    return Trace(rid, r["model"], r["prompt"], r["completion"], r["question"],
                 r.get("gt_answer"))


def load_problems(task: str, path: str | os.PathLike | None = None,
                  limit: int | None = None) -> list[Problem]:
    if task not in PROBLEM_TASKS:
        raise ValueError(f"{task!r} is not a problem set; expected one of {PROBLEM_TASKS}")
    f = resolve_data_file(task, path)
    return [_problem(task, i, r) for i, r in enumerate(_read_jsonl(f, limit))]


def load_traces(path: str | os.PathLike | None = None, limit: int | None = None,
                task: str = "traces") -> list[Trace]:
    """Load traces; ``task="traces_areal"`` selects the AReaL rollouts by default name.

    Either layout is recognised per record, so ``path`` may point at any of the files.
    """
    if task not in TRACE_TASKS:
        raise ValueError(f"{task!r} is not a trace set; expected one of {TRACE_TASKS}")
    return [_trace(r) for r in _read_jsonl(resolve_data_file(task, path), limit)]


def load_task(task: str, path: str | os.PathLike | None = None,
              limit: int | None = None) -> list[Problem] | list[Trace]:
    if task in TRACE_TASKS:
        return load_traces(path, limit, task=task)
    return load_problems(task, path, limit)
