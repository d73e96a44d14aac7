"""Every eviction policy with every storage format (issue 18): ``--set kv_format=...`` really runs.

Each (policy, format) pair builds a core on one tiny engine (shared weights), generates a short greedy
continuation with the matrix's "hard" parameters (so the policy evicts), and checks that the cache held
tokens in that format, that the policy evicted and that every logit is finite. ThinKV takes its formats
from ``precision`` (a uniform precision per format here); KIVI and ThinKV reject ``kv_format`` in one line.
"""
from __future__ import annotations

import math

import pytest
import torch

from plugins.formats import FORMATS
from trtkv.errors import TrtkvError
from trtkv.policies import POLICIES, make_policy
from trtkv.policies.thinkv import R, E, T, format_precision
from trtkv.runtime.observers import EngineObserver

from policy_matrix import MATRIX, one_thread  # noqa: F401  (fixture)

FIXED_FORMAT = {"kivi", "thinkv", "thinkv-tbq", "thinkv-tbe"}  # their format comes from bits= / precision=
HARD = {e["name"]: e["params"][1] for e in MATRIX}
ACT_WITHIN_GEN = {"snapkv": {"decode_every": 8}}  # compress during the short generation, not only at prefill
PROMPT = "The history of mathematics begins with counting, and"
GEN = 28
GEN_LONGER = {"thinkv": 64}  # segments of tau=16 tokens: anneals start after a few

class _Seen(EngineObserver):
    """Formats stored and finiteness of the logits, per generation."""

    def __init__(self):
        self.formats: set[str] = set()
        self.finite = True

    def on_prefill(self, req, logits, stats):
        self.finite &= bool(torch.isfinite(logits).all())

    def on_decode(self, reqs, logits, stats):
        self.finite &= bool(torch.isfinite(logits).all())
        for r in reqs:
            self.formats |= {f for f, n in r.ctx.stored_formats(0).items() if n}


@pytest.fixture(scope="module")
def tiny_engine(tiny_ckpt, engine_factory, load_engine):
    return load_engine(engine_factory(tiny_ckpt, "full"))


def _generate(engine, policy, gen: int = GEN) -> tuple[_Seen, dict]:
    from trtkv.runtime.request import Request
    from trtkv.runtime.sampling import SamplingParams, make_generator

    policy.resolve_formats("fp32")
    seen = _Seen()
    core = engine.make_core(policy=policy, observers=[seen])
    ids = engine.encode_prompt(PROMPT, chat=False)
    req = Request(1, PROMPT, ids, SamplingParams(max_tokens=gen, ignore_eos=True, chat=False), make_generator(0),
                  engine.arch.max_position_embeddings)
    core.prefill(req)
    while not req.finished:
        core.decode_step([req])
    return seen, core.finish(req).stats


def test_matrix_covers_every_policy():
    assert set(HARD) == set(POLICIES)


@pytest.mark.parametrize("fmt", sorted(FORMATS))
@pytest.mark.parametrize("name", sorted(set(POLICIES) - FIXED_FORMAT - {"full"}) + ["full", "thinkv"])
def test_policy_runs_with_format(tiny_engine, name, fmt):
    params = {**HARD[name], **ACT_WITHIN_GEN.get(name, {})}
    if name == "thinkv":
        params["precision"] = format_precision({c: fmt for c in (R, E, T)})
    else:
        params["kv_format"] = fmt
    seen, stats = _generate(tiny_engine, make_policy(name, params), GEN_LONGER.get(name, GEN))
    assert seen.finite, f"{name} with {fmt}: non-finite logits"
    assert seen.formats == {fmt}, f"{name} with {fmt} stored {seen.formats}"
    if name not in ("full", "arborkv"):  # arborkv evicts only off the active path of a search tree
        assert stats["evicted_tokens"] > 0, f"{name} with {fmt} never evicted"
    assert stats["kv_bytes"] > 0 and not math.isnan(stats["kv_bytes"])


@pytest.mark.parametrize("name,params", [("kivi", {"bits": 2, "kv_format": "fp16"}),
                                         ("kivi", {"bits": 4, "kv_format": "nvfp4"}),
                                         ("thinkv", {"kv_format": "int4"}),
                                         ("thinkv-tbe", {"kv_format": "nvfp4"}),
                                         ("thinkv-tbq", {"kv_format": "fp8"})])
def test_fixed_format_policies_say_so(name, params):
    with pytest.raises(TrtkvError) as e:
        make_policy(name, params)
    msg = str(e.value)
    assert "\n" not in msg and "kv_format" in msg and ("precision=" in msg or "bits=" in msg), msg


def test_thinkv_rejects_a_storage_format_other_than_the_engine_dtype():
    pol = make_policy("thinkv", {"kv_format": "fp16", "thought_schedule": "R"})
    with pytest.raises(TrtkvError, match="precision=R16E16T16"):
        pol.resolve_formats("fp32")
