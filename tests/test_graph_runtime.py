"""``--runtime graph`` (issue 39): a steady decode step as a host plan plus one compiled device program
(trtkv/runtime/device_step.py). Every policy of the matrix gives the eager runtime's greedy tokens; the program
compiles with ``fullgraph=True`` (a graph break is an error) and reads no tensor on the host."""
from __future__ import annotations

import pytest
from policy_matrix import cases

from trtkv.api import Engine, SamplingParams

PROMPTS = ["The quick brown fox jumps over the lazy dog.", "Once upon a time, in a land far away,"]


def _generate(path, runtime: str, batch: int, tokens: int = 64):
    eng = Engine.load(path, runtime=runtime)
    res = eng.generate(PROMPTS[:batch], SamplingParams(max_tokens=tokens, ignore_eos=True, chat=False))
    return [r.token_ids for r in res], eng


@pytest.mark.parametrize("policy,level,params", cases(), ids=[f"{p}-{lv}" for p, lv, _ in cases()])
def test_graph_gives_eager_tokens(tiny_ckpt, engine_factory, policy, level, params):
    path = engine_factory(tiny_ckpt, policy, **params)
    batch = 1 if level == "easy" else 2
    eager, _ = _generate(path, "torch", batch)
    graph, eng = _generate(path, "graph", batch)
    print(policy, level, eng.core.device_step.counts)
    assert graph == eager
