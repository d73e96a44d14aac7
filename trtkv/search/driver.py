"""The tree-search controller (ToT style, best-first with backtracking) over ``runtime/tree.py``.

Each expansion takes the best expandable node (highest value; ties: deeper, then older), generates one
child block, scores it with the task and raises the policy's Boundary event. A child that scores below
another open node makes the next expansion switch branch (a backtrack: the active leaf moves to another
subtree). Limits: ``branching`` children per node, ``depth`` blocks, ``expansions`` blocks in all. The
answer is the best leaf's (highest value among blocks that state an answer; the best block otherwise).
Every page is freed on the way out, whatever happens (errors, Ctrl-C).
"""
from __future__ import annotations

import time
from typing import Any

from trtkv.runtime.tree import SearchTree
from trtkv.search.config import SearchConfig
from trtkv.search.tasks import SearchProblem, SearchTask


def run_search(core, encode, task: SearchTask, problem: SearchProblem, cfg: SearchConfig,
               oracle_peak_tokens: int | None = None, on_tree=None) -> dict[str, Any]:
    """Search one problem on ``core`` (its own cache); returns its record (see ``search/report.py``).
    ``on_tree(tree)`` (tests, tools) sees the finished tree before its pages are freed."""
    cfg.validate()
    ids = encode(problem.prompt)
    tree = SearchTree(core, problem.prompt, ids, cfg.temperature, cfg.top_p, cfg.seed, cfg.node_tokens,
                      len(ids) + cfg.max_tokens, oracle_peak_tokens)
    t0 = time.perf_counter()
    try:
        root = tree.start()
        root.task_state = task.root_state(problem)
        root.value = 1.0
        scored: dict[int, Any] = {}
        solved = False
        while len(tree.nodes) - 1 < cfg.expansions and not solved:
            open_nodes = [n for n in tree.nodes.values() if n.closed and not n.terminal and n.depth < cfg.depth
                          and len(n.children) < cfg.branching and not (n.node_id in scored and
                                                                       scored[n.node_id].answer is not None)]
            if not open_nodes:
                break
            q = max(open_nodes, key=lambda n: (n.value, n.depth, -n.node_id))
            child = tree.expand(q.node_id)
            sc = task.score(problem, q.task_state, child.text, child.token_probs,
                            child.terminal or child.depth >= cfg.depth)
            child.value, child.task_state = float(sc.value), sc.state
            child.terminal = child.terminal or sc.answer is not None
            scored[child.node_id] = sc
            tree.boundary(child.node_id)
            solved = cfg.stop_on_solution and task.solved(problem, sc)
        leaves = [(i, s) for i, s in scored.items() if s.answer is not None]
        pool = leaves or list(scored.items())
        best_id, best = max(pool, key=lambda x: (x[1].value, tree.nodes[x[0]].depth, -x[0])) if pool else (0, None)
        answer = best.answer if best is not None else None
        record = {
            "problem": problem.id,
            "correct": bool(task.grade(problem, answer)) if answer is not None else False,
            "answer": answer,
            "best_node": best_id,
            "nodes": len(tree.nodes),
            "expansions": len(tree.nodes) - 1,
            "max_depth": max(n.depth for n in tree.nodes.values()),
            "generated_tokens": sum(n.n for n in tree.nodes.values() if n.node_id),
            "prompt_tokens": len(ids),
            "decode_steps": tree.steps,
            "branch_switches": sum(1 for n in tree.nodes.values() if n.parent is not None and n.node_id > 1
                                   and n.parent != n.node_id - 1),
            "peak_cached_tokens": tree.peak_cached_tokens,
            "peak_pages": tree.peak_pages,
            "peak_kv_bytes": tree.peak_kv_bytes,
            "rehydrations": tree.rehydration_count,
            "rehydration_s": tree.rehydration_s,
            "converted_tokens": tree.conversions,
            "policy_s": tree.policy_s,
            **core.policy.tree_stats(tree),
        }
        if on_tree is not None:
            on_tree(tree)
        timeline = [(p.step, p.cached_tokens, p.kv_bytes, p.event) for p in tree.timeline]
    finally:
        tree.close()
    record["latency_s"] = time.perf_counter() - t0
    record["policy_time_share"] = record["policy_s"] / record["latency_s"] if record["latency_s"] > 0 else 0.0
    record["timeline"] = timeline
    record["live_pages_after"] = core.cache.pages_in_use()
    return record
