import math

import pytest
import torch

from trtkv.eval.fidelity import (
    FidelityAccumulator, kl_divergence, top1_agreement, topk_attention_recall)


def test_identical_inputs_are_perfect():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 5, 50, generator=g)
    attn = torch.softmax(torch.randn(4, 2, 64, generator=g), -1)
    assert torch.allclose(kl_divergence(logits.log_softmax(-1), logits.log_softmax(-1)),
                          torch.zeros(3, 5), atol=1e-6)
    assert torch.equal(top1_agreement(logits, logits), torch.ones(3, 5))
    assert torch.equal(topk_attention_recall(attn, attn, k=10), torch.ones(4, 2))


def test_kl_hand_computed():
    # p = (1/2, 1/2), q = (1/4, 3/4): KL = 1/2 ln 2 + 1/2 ln(2/3)
    lp = torch.tensor([[0.5, 0.5]]).log()
    lq = torch.tensor([[0.25, 0.75]]).log()
    want = 0.5 * math.log(2) + 0.5 * math.log(2 / 3)
    assert kl_divergence(lp, lq).item() == pytest.approx(want, abs=1e-6)
    # asymmetric: KL(q || p) differs
    assert kl_divergence(lq, lp).item() == pytest.approx(
        0.25 * math.log(0.5) + 0.75 * math.log(1.5), abs=1e-6)


def test_kl_zero_prob_and_low_precision():
    lp = torch.tensor([[0.0, -float("inf")]])       # p = (1, 0)
    lq = torch.tensor([[0.5, 0.5]]).log()
    assert kl_divergence(lp, lq).item() == pytest.approx(math.log(2), abs=1e-6)
    assert math.isinf(kl_divergence(lq, lp).item())  # test can't emit a ref token
    x = torch.randn(4, 1000).to(torch.bfloat16)
    k = kl_divergence(x, x)
    assert k.dtype == torch.float32 and (k >= 0).all() and k.max() < 1e-5
    with pytest.raises(ValueError):
        kl_divergence(torch.zeros(2, 3), torch.zeros(2, 4))


def test_top1_agreement_partial():
    ref = torch.tensor([[0.1, 2.0, 0.3], [1.0, 0.0, 0.0]])
    test = torch.tensor([[0.1, 2.0, 0.3], [0.0, 0.0, 1.0]])
    assert top1_agreement(ref, test).tolist() == [1.0, 0.0]


def test_recall_with_evicted_keys():
    ref = torch.tensor([0.30, 0.25, 0.20, 0.10, 0.05, 0.05, 0.05])
    # keys 1 and 3 evicted (0), the rest renormalised
    test = ref.clone()
    test[[1, 3]] = 0
    test = test / test.sum()
    # ref top-3 = {0,1,2}; test top-3 = {0,2, one of 4/5/6}: 2 of 3 recalled
    assert topk_attention_recall(ref, test, k=3).item() == pytest.approx(2 / 3)
    # only two keys survive: zero-weight keys never count as attended
    only2 = torch.zeros(7)
    only2[[0, 5]] = 0.5
    assert topk_attention_recall(ref, only2, k=3).item() == pytest.approx(1 / 3)
    # reference row shorter than k (masked positions are 0): recall over live keys only
    short = torch.tensor([0.6, 0.4, 0.0, 0.0])
    assert topk_attention_recall(short, short, k=10).item() == 1.0
    assert topk_attention_recall(short, torch.tensor([0.0, 1.0, 0.0, 0.0]), k=10).item() == 0.5


def test_accumulator_summary():
    acc = FidelityAccumulator()
    assert acc.summary()["mean_kl"] is None
    for i in range(10):
        acc.update(kl=torch.tensor([float(i)]), agreement=torch.tensor([1.0 if i < 8 else 0.0]),
                   recall=0.5)
    s = acc.summary()
    assert s["n_steps"] == 10
    assert s["mean_kl"] == pytest.approx(4.5)
    assert s["p90_kl"] == pytest.approx(8.1)  # linear interpolation over 0..9
    assert s["top1_agreement"] == pytest.approx(0.8)
    assert s["attn_recall"] == pytest.approx(0.5)
    logits = torch.randn(2, 16)
    attn = torch.softmax(torch.randn(2, 4, 32), -1)
    acc2 = FidelityAccumulator()
    acc2.update_from(logits, logits, attn, attn, k=5)
    m = acc.merge(acc2).summary()
    assert m["n_steps"] == 11 and m["attn_recall"] == pytest.approx((10 * 0.5 + 8) / 18)
