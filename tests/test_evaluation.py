"""The shipped perplexity metric against a hand computation."""
from __future__ import annotations

import math

import torch

from hf_asyncpp.evaluation import block_nll, evaluate_perplexity, load_metric, perplexity_from_sums
from test_partition import make_model


def test_metric_module_loads_offline_and_computes():
    m = load_metric("perplexity")
    res = m.compute(nll_sum=[2.0, 4.0], num_tokens=[1, 3])
    assert res["eval_loss"] == 1.5 and math.isclose(res["perplexity"], math.exp(1.5))


def test_perplexity_equals_a_direct_computation():
    model = make_model("llama_untied").eval()
    blocks = torch.randint(0, 128, (5, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        logp = torch.log_softmax(model(blocks).logits.double(), dim=-1)
    nll = -logp[:, :-1].gather(-1, blocks[:, 1:, None]).sum().item()
    n = 5 * 11
    res = evaluate_perplexity(model, blocks, batch_size=2)
    assert res["num_tokens"] == n
    assert math.isclose(res["eval_loss"], nll / n, rel_tol=1e-5)
    assert math.isclose(res["eval_ppl"], math.exp(nll / n), rel_tol=1e-5)
    with torch.no_grad():
        single = model(blocks[:1], labels=blocks[:1]).loss.item()
    assert math.isclose(evaluate_perplexity(model, blocks[:1])["eval_ppl"], math.exp(single), rel_tol=1e-5)
    sums, counts = block_nll(model, blocks)
    assert len(sums) == 5 and counts == [11] * 5
    assert math.isclose(sum(sums), nll, rel_tol=1e-5)
