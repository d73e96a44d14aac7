"""The sampler's categorical draw (``trtkv.runtime.sampling.draw``, inverse CDF): frequencies follow the
probabilities, cut tokens are never drawn (the rounding edge included), a seed repeats its draws, and
``sample_next``'s filters still shape what is drawn."""
from __future__ import annotations

import torch

from trtkv.runtime.sampling import SamplingParams, draw, make_generator, sample_next


def test_frequencies_follow_the_probabilities():
    probs = torch.tensor([0.5, 0.0, 0.2, 0.2, 0.1, 0.0])
    g = make_generator(0)
    n = 20000
    counts = torch.bincount(torch.tensor([draw(probs, g) for _ in range(n)]), minlength=len(probs)).double()
    assert counts[1] == 0 and counts[5] == 0  # zero probability: never drawn
    expected = probs.double() * n
    live = expected > 0
    chi2 = (((counts - expected)[live] ** 2) / expected[live]).sum().item()
    assert chi2 < 16.3  # chi-square, 3 degrees of freedom, p = 0.001


def test_rounding_edge_draws_the_last_live_token(monkeypatch):
    probs = torch.tensor([0.3, 0.7, 0.0, 0.0])
    monkeypatch.setattr(torch, "rand", lambda *a, **k: torch.ones(1, dtype=torch.float64))  # u * total == total
    assert draw(probs, make_generator(0)) == 1


def test_seeded_draws_repeat_and_filters_apply():
    logits = torch.randn(3, 1000, generator=torch.Generator().manual_seed(1)) * 3
    params = [SamplingParams(temperature=0.8, seed=5), SamplingParams(temperature=1.0, top_k=1),
              SamplingParams(temperature=1.0, top_p=0.05)]
    runs = [[sample_next(logits, params, [make_generator(s) for s in (5, 6, 7)]) for _ in range(1)]
            for _ in range(2)]
    assert runs[0] == runs[1]
    first = runs[0][0]
    assert first[1] == int(logits[1].argmax())  # top-k 1 leaves only the best token
    top = torch.sort(logits[2].softmax(-1), descending=True)
    kept = int((top.values.cumsum(0) < 0.05).sum()) + 1  # the smallest prefix reaching 5%
    assert first[2] in top.indices[:kept].tolist()


def _params(rng: torch.Generator) -> SamplingParams:
    pick = lambda *xs: xs[int(torch.randint(len(xs), (1,), generator=rng))]  # noqa: E731
    return SamplingParams(temperature=pick(0.0, 0.3, 0.7, 1.0, 1.7), top_k=pick(0, 0, 1, 5, 40, 2000),
                          top_p=pick(1.0, 1.0, 0.05, 0.5, 0.9, 0.999), repetition_penalty=pick(1.0, 1.0, 1.3, 0.8))


def test_the_batch_draws_what_each_row_draws_alone():
    """``sample_next`` filters and draws a batch's rows together; row by row it equals ``sample_row`` (the
    per-row reference) for drawn parameter mixes (greedy and sampled rows, top-k, top-p, penalties), logits
    with ties and -inf, and generators that advance over several steps. The two consume the same uniform
    numbers, so the tokens are equal, not just alike."""
    from trtkv.runtime.sampling import sample_row

    rng = torch.Generator().manual_seed(0)
    for trial in range(40):
        b, V = int(torch.randint(1, 9, (1,), generator=rng)), int(torch.randint(2, 3000, (1,), generator=rng))
        params = [_params(rng) for _ in range(b)]
        contexts = [torch.randint(V, (int(torch.randint(0, 30, (1,), generator=rng)),), generator=rng).tolist()
                    for _ in range(b)]
        g_batch = [make_generator(100 * trial + i) for i in range(b)]
        g_rows = [make_generator(100 * trial + i) for i in range(b)]
        for _ in range(3):
            logits = torch.randn(b, V, generator=rng) * 4
            logits[:, : V // 3] = torch.round(logits[:, : V // 3])  # ties
            if trial % 4 == 0:
                logits[0, V // 2:] = float("-inf")
            got = sample_next(logits, params, g_batch, contexts)
            want = [sample_row(logits[i], params[i], g_rows[i], contexts[i]) for i in range(b)]
            assert got == want, (trial, params)
