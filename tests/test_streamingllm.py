"""StreamingLLM holds at most its budget, and once the window is full its page count stops growing
because evicted slots are reused in place."""
from __future__ import annotations

import pytest

from trtkv.api import SamplingParams
from trtkv.policies.streamingllm import StreamingLLMPolicy

pytestmark = pytest.mark.model


class Recorder(StreamingLLMPolicy):
    """StreamingLLM that records live tokens and pages after every step (test-only subclass)."""

    trace: list = []

    def on_decode_step_end(self, req, stats):
        super().on_decode_step_end(req, stats)
        table = req.seq.layers[0]
        pages = sum(len(p) for p in table.pages.values())
        Recorder.trace.append((req.num_live(0), pages, [t.live for t in req.seq.layers]))


def test_budget_64_over_512_tokens(engine_factory, load_engine):
    eng = load_engine(engine_factory("smollm2-135m", "streamingllm", budget=64))
    eng.core.policy = eng.scheduler.core.policy = Recorder(budget=64, kv_format="fp32")
    Recorder.trace = []
    res = eng.generate("Tell me a very long story about a dragon and a knight.",
                       SamplingParams(max_tokens=512, ignore_eos=True))[0]
    assert res.stats["generated_tokens"] == 512
    live = [t[0] for t in Recorder.trace]
    pages = [t[1] for t in Recorder.trace]
    assert max(live) <= 64
    assert all(len(set(per_layer)) == 1 for _, _, per_layer in Recorder.trace)  # every layer holds the same count
    assert max(pages) <= 64 // 8 + 1
    full_at = live.index(64)
    assert len(set(pages[full_at + 8:])) == 1  # flat once the window is full: slots are reused in place
    assert res.stats["kv_bytes"] < res.stats["kv_bytes_full"] / 4
    assert eng.core.cache.pages_in_use() == 0
