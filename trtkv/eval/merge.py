"""One fidelity table from several ``trtkv eval --task fidelity`` runs over the same traces.

A grid too large for one sitting (46 engines at 2,048 tokens on a 2-core CPU) runs in parts; every
engine is scored against the same full-cache reference on the same forced tokens, independently of the
other engines in its run, so parts that agree on traces, tokens, reference and settings join into one
table whose Pareto frontier is drawn over all of them. Parts that do not agree are refused, never averaged.
"""
from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from trtkv.errors import TrtkvError

SAME_CONFIG = ("task", "limit", "max_tokens", "recall_layers", "topk")  # what a part's config must share
SAME_REFERENCE = ("model", "dtype", "traces", "tokens")  # what its reference record must share
NLL_TOLERANCE = 1e-6  # relative: the same traces through the same reference give the same NLL


def read_run(path: Path) -> dict[str, Any]:
    """A run's ``results.json`` (the file, or the ``--out`` directory holding it)."""
    f = path / "results.json" if path.is_dir() else path
    try:
        doc = json.loads(f.read_text())
    except FileNotFoundError:
        raise TrtkvError(f"{f} does not exist; name a trtkv eval --out directory or its results.json") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise TrtkvError(f"{f} is not a trtkv eval results file ({type(e).__name__}: {e})") from None
    if not isinstance(doc, dict) or doc.get("kind") != "trtkv-eval" or not isinstance(doc.get("records"), list):
        raise TrtkvError(f"{f} is not a trtkv eval results file (no kind 'trtkv-eval' with records)")
    doc["_path"] = str(f)
    return doc


def _reference(doc: dict[str, Any]) -> dict[str, Any]:
    refs = [r for r in doc["records"] if r.get("is_reference")]
    if len(refs) != 1:
        raise TrtkvError(f"{doc['_path']} has {len(refs)} reference records; only single-model fidelity runs merge")
    return refs[0]


def merge_runs(docs: list[dict[str, Any]]) -> dict[str, Any]:
    """The merged document: the first run's reference record, every run's engine records (labels must be
    unique across runs), the frontier marked again over all of them, and where each part came from."""
    from trtkv.eval.pareto import mark_frontier

    if len(docs) < 2:
        raise TrtkvError("name at least two fidelity runs to merge")
    first, ref = docs[0], _reference(docs[0])
    for doc in docs:
        if doc.get("task") != "fidelity":
            raise TrtkvError(f"{doc['_path']} is a {doc.get('task')!r} run; only fidelity runs merge")
        for k in SAME_CONFIG:
            a, b = first["config"].get(k), doc["config"].get(k)
            if a != b:
                raise TrtkvError(f"{doc['_path']} ran with {k}={b!r} but {first['_path']} with {k}={a!r}; "
                                 "only runs over the same traces and settings merge")
        other = _reference(doc)
        for k in SAME_REFERENCE:
            if other.get(k) != ref.get(k):
                raise TrtkvError(f"{doc['_path']}'s reference has {k}={other.get(k)!r}, {first['_path']}'s "
                                 f"{ref.get(k)!r}; only runs against the same reference merge")
        a, b = ref.get("nll"), other.get("nll")
        if a is not None and b is not None and not math.isclose(a, b, rel_tol=NLL_TOLERANCE):
            raise TrtkvError(f"the references' NLL differ ({a:.6f} in {first['_path']}, {b:.6f} in {doc['_path']}): "
                             "not the same forced tokens; only runs over the same traces merge")
    records, seen = [dict(ref)], {}
    for doc in docs:
        for r in doc["records"]:
            if r.get("is_reference"):
                continue
            if r["engine"] in seen:
                raise TrtkvError(f"engine {r['engine']!r} is in both {seen[r['engine']]} and {doc['_path']}; "
                                 "drop one of them (labels are the engine directories' names)")
            seen[r["engine"]] = doc["_path"]
            records.append(dict(r))
    mark_frontier(records)
    parts = [{"path": d["_path"], "command": d.get("command"), "machine": d.get("machine"),
              "engines": sum(not r.get("is_reference") for r in d["records"])} for d in docs]
    return {"kind": "trtkv-eval", "version": 1, "task": "fidelity", "command": None, "merged_from": parts,
            "machine": first.get("machine"), "config": first["config"], "records": records}
