"""Perplexity and the evaluation helpers against hand computations."""
from __future__ import annotations

import math

import pytest
import torch

from hf_asyncpp.eval.perplexity import block_nll, evaluate_model_dir, evaluate_perplexity, perplexity_from_sums
from support import make_config, make_model


def test_perplexity_from_sums():
    res = perplexity_from_sums(torch.tensor([10.0, 20.0]), [5, 10])
    assert res == {"eval_loss": 2.0, "eval_perplexity": math.exp(2.0), "num_tokens": 15}
    assert perplexity_from_sums([1e6], [1])["eval_perplexity"] == math.inf
    with pytest.raises(ValueError, match="2 NLL sums but 1 token counts"):
        perplexity_from_sums([1.0, 2.0], [3])
    with pytest.raises(ValueError, match="perplexity of 0 tokens"):
        perplexity_from_sums([1.0], [0])


def test_perplexity_equals_a_direct_computation():
    model = make_model("llama_untied").eval()
    blocks = torch.randint(0, 128, (5, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        logp = torch.log_softmax(model(blocks).logits.double(), dim=-1)
    per_block = -logp[:, :-1].gather(-1, blocks[:, 1:, None]).squeeze(-1).sum(dim=1)  # (5,)
    nll, n = per_block.sum().item(), 5 * 11
    res = evaluate_perplexity(model, blocks, batch_size=2)
    assert res["num_tokens"] == n
    assert math.isclose(res["eval_loss"], nll / n, rel_tol=1e-6)
    assert math.isclose(res["eval_perplexity"], math.exp(nll / n), rel_tol=1e-6)
    sums, counts = block_nll(model, blocks, batch_size=3)
    assert counts == [11] * 5
    torch.testing.assert_close(torch.tensor(sums, dtype=torch.float64), per_block, rtol=1e-6, atol=1e-6)
    with torch.no_grad():
        single = model(blocks[:1], labels=blocks[:1]).loss.item()  # HF's own shifted loss
    assert math.isclose(evaluate_perplexity(model, blocks[:1])["eval_perplexity"], math.exp(single), rel_tol=1e-6)


def test_forward_only_in_eval_mode_and_mode_restored():
    from transformers import AutoModelForCausalLM

    cfg = make_config("gpt2")
    cfg.resid_pdrop = cfg.embd_pdrop = cfg.attn_pdrop = 0.5  # dropout would make training-mode results random
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg).train()
    blocks = torch.randint(0, 128, (3, 10), generator=torch.Generator().manual_seed(2))
    a = evaluate_perplexity(model, blocks)
    assert model.training and all(p.grad is None for p in model.parameters())
    model.eval()
    with torch.no_grad():
        ref = model(blocks, labels=blocks)  # mean over all predicted tokens of equal-length blocks
    assert math.isclose(a["eval_loss"], ref.loss.item(), rel_tol=1e-6)
    assert evaluate_perplexity(model.train(), blocks) == a


def test_evaluate_model_dir_matches_the_in_memory_model(tmp_path):
    from hf_asyncpp.model.export import export_from_model

    model = make_model("qwen3_moe").eval()
    blocks = torch.randint(0, 128, (4, 16), generator=torch.Generator().manual_seed(3))
    out = export_from_model(model, tmp_path / "m")
    assert evaluate_model_dir(out, blocks, batch_size=3) == evaluate_perplexity(model, blocks, batch_size=3)
