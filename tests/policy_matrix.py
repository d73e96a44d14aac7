"""The shared policy test matrix and the probes the policy tests use.

``MATRIX`` has one entry per registered policy: ``{"name": ..., "params": [easy, hard]}``, parameter sets
for the tiny 2-layer random Llama (``tiny_ckpt``), whose raw prompts are ~10-20 tokens and whose test
generations are ~100 tokens. "easy" keeps a budget above the prompt; "hard" squeezes it (and exercises
cadences, prefill cuts, in-place vs compact eviction). Adding a policy is one line here.

Optional keys of an entry: ``"smol"`` — parameters for the SmolLM2 checks (default: ``{"budget": 64}``
when the policy takes a budget, else ``{}``); ``"cadence"`` — parameters that make a periodic policy act
within the 300-token SmolLM2 coherence run.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from trtkv.runtime.observers import EngineObserver

MATRIX: list[dict] = [
    {"name": "full", "params": [{}, {"kv_format": "fp16"}], "smol": {}},
    {"name": "streamingllm", "params": [{"budget": 48}, {"budget": 20}]},
    {"name": "h2o", "params": [{"budget": 48}, {"budget": 24, "recent_ratio": 0.25, "evict_every": 4,
                                                      "prefill_queries": 8}]},
    {"name": "snapkv", "params": [{"budget": 48, "window_size": 8, "decode_every": 16},
                                  {"budget": 16, "window_size": 8}],
     "smol": {"budget": 64, "window_size": 16, "decode_every": 16}, "cadence": {"decode_every": 32}},
    {"name": "tova", "params": [{"budget": 48}, {"budget": 20, "evict_every": 3}]},
    {"name": "rkv", "params": [{"budget": 48, "buffer": 16},
                               {"budget": 24, "buffer": 8, "window_size": 4, "compaction": False}],
     "smol": {"budget": 64, "buffer": 16}},
    {"name": "kivi", "params": [{"bits": 4}, {"bits": 2}], "smol": {}},
    {"name": "lazyeviction", "params": [{"budget": 48, "window": 8}, {"budget": 24, "window": 4, "alpha": 1e-3}],
     "smol": {"budget": 64, "window": 16}},
    {"name": "ams", "params": [{"budget": 48, "interval": 16, "hs": 12, "window": 8},
                               {"budget": 24, "interval": 8, "hs": 8, "window": 4, "l_min": 4, "l_max": 16,
                                "scorer": "expected_attention"}],
     "smol": {"budget": 64, "interval": 16, "hs": 16, "window": 8}, "cadence": {"interval": 64}},
    {"name": "thinkv", "params": [{"budget": 48, "tau": 16, "group": 16, "retention": "8,4", "thought_schedule": "RTER"},
                                  {"budget": 24, "tau": 16, "group": 16, "retention": "4", "thought_schedule": "TRET",
                                   "precision": "R8E4T2"}],
     "smol": {"budget": 32, "tau": 32, "group": 16, "retention": "16,8,4", "thought_schedule": "RRTE"}},
    {"name": "thinkv-tbq", "params": [{"thought_schedule": "RTE"}, {"precision": "R4oE4oT2o", "thought_schedule": "TTR"}],
     "smol": {"thought_schedule": "RRTE"}},
    {"name": "random", "params": [{"budget": 48}, {"budget": 20, "evict_every": 3, "n_sink": 4, "seed": 7}]},
    {"name": "pyramidkv", "params": [{"budget": 48, "window_size": 8, "decode_every": 16},
                                     {"budget": 16, "window_size": 4, "beta": 4, "decode_every": 8}],
     "smol": {"budget": 64, "window_size": 16, "decode_every": 16}, "cadence": {"decode_every": 32}},
    {"name": "thinkv-tbe", "params": [{"budget": 48, "tau": 16, "group": 16, "retention": "8,4", "thought_schedule": "RTER"},
                                      {"budget": 24, "tau": 16, "group": 16, "retention": "4", "thought_schedule": "T"}],
     "smol": {"budget": 32, "tau": 32, "group": 16, "retention": "16,8,4", "thought_schedule": "RRTE"}},
    {"name": "tiered", "params": [{"beta": 0.5, "evict_ratio": 0.0, "interval": 8, "sinks": 2, "window": 8},
                                  {"beta": 0.3, "evict_ratio": 0.1, "interval": 4, "sinks": 1, "window": 4,
                                   "host_format": "int4"}],
     "smol": {"beta": 0.3, "evict_ratio": 0.05, "interval": 16, "window": 32}, "cadence": {"interval": 64}},
    # outside a search tree arborkv keeps everything (a chain is all active path); tree behaviour: test_arborkv.py
    {"name": "arborkv", "params": [{}, {"kv_ratio": 0.1, "k_min": 4, "l_tail": 2, "boundary_mode": "eager"}],
     "smol": {}},
]

LEVELS = ("easy", "hard")


def cases() -> list[tuple[str, str, dict]]:
    """``(policy, level, params)`` for every matrix entry and level."""
    return [(e["name"], LEVELS[i], p) for e in MATRIX for i, p in enumerate(e["params"])]


def smol_params(entry: dict) -> dict:
    from trtkv.policies import POLICIES, policy_fields

    if "smol" in entry:
        return dict(entry["smol"])
    return {"budget": 64} if "budget" in policy_fields(POLICIES[entry["name"]]) else {}


def evicts(name: str, params: dict) -> bool:
    """Does this configuration bound the cache (a budget is set, or the policy's default one)?"""
    from trtkv.policies import make_policy

    return make_policy(name, params).budget is not None


def full_precision(name: str, params: dict) -> bool:
    from trtkv.policies import make_policy

    pol = make_policy(name, params)
    pol.resolve_formats("fp32")  # the tiny test model runs in fp32
    return pol.formats() <= {"fp32"} and getattr(pol, "host_format", "none") == "none"  # T2 is lossy


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """Policy tests run their tiny tensors on one intra-op thread: on the shared 2-core machine, two OpenMP
    threads under load make each small op ~40x slower (barrier spinning). Import this into a test module."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


# --- probes ----------------------------------------------------------------------------------------
class Probe(EngineObserver):
    """Watches an engine for one generation (attached to its core; detached on exit): per decode step and
    layer the positions attended (paged + buffered), per request the context (to check its state after
    finish), and the logits of every step (prefill's included)."""

    def __init__(self, engine, record_sets: bool = False, record_logits: bool = False):
        self.engine, self.record_sets, self.record_logits = engine, record_sets, record_logits
        self.peak: dict[int, int] = {}  # req_id -> max over steps and layers of tokens attended
        self.sets: dict[int, list[list[set[int]]]] = {}  # req_id -> per decode step -> per layer
        self.logits: dict[int, list[torch.Tensor]] = {}
        self.ctxs = []

    def __enter__(self) -> "Probe":
        self.engine.core.attach(self)
        return self

    def __exit__(self, *exc) -> None:
        self.engine.core.detach(self)

    def before_attention(self, reqs, layer):
        for r in reqs:
            req = r.ctx
            self.peak[req.req_id] = max(self.peak.get(req.req_id, 0), req.num_live(layer))
            if self.record_sets:
                steps = self.sets.setdefault(req.req_id, [])
                if layer == 0:
                    steps.append([])
                steps[-1].append(set(req.attended_positions(layer).tolist()))  # host tiers included

    def on_prefill(self, req, logits, stats):
        self.ctxs.append(req.ctx)
        if self.record_logits:
            self.logits.setdefault(req.req_id, []).append(logits[0].clone())

    def on_decode(self, reqs, logits, stats):
        if self.record_logits:
            for i, r in enumerate(reqs):
                self.logits[r.req_id].append(logits[i].clone())


# --- dense masked reference ------------------------------------------------------------------------
@torch.inference_mode()
def masked_reference_logits(engine, prompt_ids: list[int], generated: list[int],
                            live_sets: list[list[set[int]]]) -> torch.Tensor:
    """Logits of a dense full-precision re-run in which decode step ``s`` attends, in each layer, exactly the
    positions ``live_sets[s][layer]`` (what the compressed cache held). RoPE uses true positions, so this is
    "FullKV with an attention mask hiding the evicted tokens" (LazyEviction spec §8.13, AMS spec §7.14)."""
    core = engine.core
    model, arch = core.model, core.arch
    dtype, dev = core.dtype, core.device
    T = len(prompt_ids)
    cos, sin = model.rotary.cos_sin(torch.arange(T, device=dev), dtype)
    x = model.embed(torch.tensor(prompt_ids, device=dev))
    K, V = [], []
    for layer in range(arch.num_hidden_layers):
        q, k, v = model.qkv(layer, x, cos, sin)
        attn = F.scaled_dot_product_attention(q.transpose(0, 1)[None], k.transpose(0, 1)[None],
                                              v.transpose(0, 1)[None], is_causal=True, scale=core.sm_scale,
                                              enable_gqa=True)[0].transpose(0, 1)
        K.append(k)
        V.append(v)
        x = model.finish_layer(layer, x, attn)
    out = [model.logits(x[-1:])[0]]
    H, Hq = arch.num_key_value_heads, arch.num_attention_heads
    for s, tok in enumerate(generated[: len(live_sets)]):
        pos = T + s
        x = model.embed(torch.tensor([tok], device=dev))
        cos, sin = model.rotary.cos_sin(torch.tensor([pos], device=dev), dtype)
        for layer in range(arch.num_hidden_layers):
            q, k, v = model.qkv(layer, x, cos, sin)
            K[layer] = torch.cat([K[layer], k])
            V[layer] = torch.cat([V[layer], v])
            live = torch.tensor(sorted(live_sets[s][layer]), device=dev)
            kk, vv = K[layer][live].float(), V[layer][live].float()  # [n, H, D]
            qf = q[0].float().view(H, Hq // H, -1)
            logits = torch.einsum("hgd,nhd->hgn", qf, kk) * core.sm_scale
            p = torch.softmax(logits, -1)
            o = torch.einsum("hgn,nhd->hgd", p, vv).reshape(1, Hq, -1)
            x = model.finish_layer(layer, x, o)
        out.append(model.logits(x)[0])
    return torch.stack(out)


def coherent(text: str) -> tuple[bool, str]:
    """Basic coherence of generated English: mostly printable, mostly word-like tokens, no single word
    dominating or repeated back to back. (A small model's sentence-level loops pass: SmolLM2-135M loops
    even with the full cache.) Returns (ok, reason)."""
    if not text.strip():
        return False, "empty"
    printable = sum(ch.isprintable() or ch in "\n\t" for ch in text) / len(text)
    words = text.split()
    if len(words) < 30:
        return False, f"only {len(words)} words"
    wordlike = sum(any(c.isalpha() for c in w) for w in words) / len(words)
    distinct = len(set(words)) / len(words)
    top_share = max(words.count(w) for w in set(words)) / len(words)
    run, longest = 1, 1
    for a, b in zip(words, words[1:]):
        run = run + 1 if a == b else 1
        longest = max(longest, run)
    ok = printable > 0.97 and wordlike > 0.6 and distinct > 0.1 and top_share < 0.2 and longest <= 4
    return ok, (f"printable={printable:.2f} wordlike={wordlike:.2f} distinct={distinct:.2f} top={top_share:.2f} "
                f"longest_run={longest}")


__all__ = ["one_thread", "MATRIX", "LEVELS", "cases", "smol_params", "evicts", "full_precision", "Probe",
           "masked_reference_logits", "coherent"]
