"""Partitioned stages compute exactly what the unpartitioned model computes: loss, logits, every gradient."""
from __future__ import annotations

import pytest
import torch

from hf_asyncpp.partition import PartitionError, merge_state_dicts, partition_model, partition_plan, tied_parameters

BASE = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
            vocab_size=128, max_position_embeddings=64)
MOE_AUX = dict(output_router_logits=True, router_aux_loss_coef=0.05)
ARCHS = {
    "llama": dict(tie_word_embeddings=True),
    "llama_untied": dict(tie_word_embeddings=False),
    "mistral": dict(sliding_window=8),
    "qwen2": dict(use_sliding_window=True, sliding_window=8, max_window_layers=2),
    "qwen3": dict(head_dim=8, tie_word_embeddings=True),
    "gemma2": dict(head_dim=8, sliding_window=8, final_logit_softcapping=30.0, attn_logit_softcapping=50.0),
    "gemma3_text": dict(head_dim=8, sliding_window=8, sliding_window_pattern=2),
    "phi3": dict(pad_token_id=0, eos_token_id=1, bos_token_id=1),
    "gpt2": dict(n_embd=32, n_layer=4, n_head=4, n_positions=64, bos_token_id=0, eos_token_id=0, resid_pdrop=0.0,
                 embd_pdrop=0.0, attn_pdrop=0.0),
    "olmo2": dict(pad_token_id=0, eos_token_id=1, bos_token_id=1),
    "mixtral": dict(num_local_experts=4, num_experts_per_tok=2, **MOE_AUX),
    "qwen2_moe": dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=32, **MOE_AUX),
    "qwen3_moe": dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, head_dim=8, **MOE_AUX),
    "olmoe": dict(num_experts=4, num_experts_per_tok=2, bos_token_id=0, eos_token_id=0, pad_token_id=0, **MOE_AUX),
    "deepseek_v3": dict(num_key_value_heads=4, n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                        first_k_dense_replace=1, kv_lora_rank=16, q_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8,
                        v_head_dim=8, n_group=1, topk_group=1),
    "gpt_oss": dict(num_local_experts=4, num_experts_per_tok=2, sliding_window=8, head_dim=8, rope_scaling=None, **MOE_AUX),
}


def make_config(arch: str):
    from transformers import AutoConfig

    kw = {**BASE, **ARCHS[arch]}
    model_type = "llama" if arch == "llama_untied" else arch
    if arch == "gpt2":
        kw = {k: v for k, v in kw.items() if k in ARCHS["gpt2"] or k == "vocab_size"}
    return AutoConfig.for_model(model_type, **kw)


def make_model(arch: str):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(make_config(arch)).float()


def chain(stages, ids, labels=None):
    a = stages[0](ids) if len(stages) > 1 else None
    if len(stages) == 1:
        return stages[0](ids, labels=labels)
    for s in stages[1:-1]:
        a = s(a)
    return stages[-1](a, labels=labels)


@pytest.mark.parametrize("arch", list(ARCHS))
def test_stages_equal_the_model(arch):
    model = make_model(arch)
    ids = torch.randint(0, 128, (2, 24), generator=torch.Generator().manual_seed(1))
    ref = model(ids, labels=ids)
    ref.loss.backward()
    ref_grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    with torch.no_grad():
        ref_logits = model(ids).logits
    if ARCHS[arch].get("output_router_logits") and arch != "deepseek_v3":
        assert ref.aux_loss is not None and ref.aux_loss > 0  # the aux loss is part of what we compare
    original = {n for n, _ in model.named_parameters()}
    for p in (1, 2, 3, 4):
        model.zero_grad(set_to_none=True)
        stages = partition_model(model, p)
        loss = chain(stages, ids, ids)
        torch.testing.assert_close(loss, ref.loss, rtol=1e-5, atol=1e-6, msg=f"{arch} p={p} loss")
        loss.backward()
        grads: dict[str, torch.Tensor] = {}
        owners: dict[str, int] = {}
        for s, stage in enumerate(stages):
            for n, prm in stage.named_parameters():
                assert n not in owners, f"{n} in stages {owners[n]} and {s}"
                owners[n] = s
                grads[n] = prm.grad
        for first, last in tied_parameters(stages):
            grads[first] = grads[first] + grads.pop(last)
        assert set(grads) == original, f"{arch} p={p}: stage parameters != model parameters"
        for n, g in ref_grads.items():
            torch.testing.assert_close(grads[n], g, rtol=1e-5, atol=1e-6, msg=f"{arch} p={p} grad {n}")
        with torch.no_grad():
            torch.testing.assert_close(chain(stages, ids), ref_logits, rtol=1e-5, atol=1e-6, msg=f"{arch} p={p} logits")
        # merged stage state dicts load strictly into a fresh model
        fresh = make_model(arch)
        fresh.load_state_dict(merge_state_dicts([s.state_dict() for s in stages]), strict=True)


def test_tied_embeddings_have_two_copies_and_a_pair():
    model = make_model("llama")
    stages = partition_model(model, 2)
    assert tied_parameters(stages) == [("model.embed_tokens.weight", "lm_head.weight")]
    first, last = stages[0].get_parameter("model.embed_tokens.weight"), stages[1].get_parameter("lm_head.weight")
    assert first is not last and torch.equal(first, last)
    assert tied_parameters(partition_model(make_model("llama_untied"), 2)) == []


def test_plan_balances_cost_and_names_owners():
    model = make_model("llama_untied")
    plan = partition_plan(model, 2)
    assert sum(len(s.layers) for s in plan.stages) == 4
    assert plan.stage_of("model.embed_tokens.weight") == 0 and plan.stage_of("lm_head.weight") == 1
    assert plan.stage_of(f"model.layers.{plan.stages[1].layers.start}.mlp.up_proj.weight") == 1
    assert sum(s.params for s in plan.stages) == sum(p.numel() for p in model.parameters())
    text = plan.format()
    assert "stage" in text and "+norm+head" in text
    # a big vocabulary makes the last stage expensive: the balancer gives it fewer layers
    from transformers import AutoConfig

    big_vocab = AutoConfig.for_model("llama", **{**BASE, "vocab_size": 20000, "num_hidden_layers": 8})
    sizes = [len(s.layers) for s in partition_plan(big_vocab, 2).stages]
    assert sizes[1] < sizes[0], sizes


def test_bad_splits_are_clear_errors():
    model = make_model("llama")
    with pytest.raises(PartitionError, match=r"num_stages: 5 stages for 4 decoder layers; use at most 4"):
        partition_model(model, 5)
    with pytest.raises(PartitionError, match=r"layers_per_stage: \[1, 2\] must have 2 non-negative entries summing to the 4"):
        partition_model(model, 2, [1, 2])
    with pytest.raises(PartitionError, match="cannot find the decoder layers"):
        partition_plan(torch.nn.Sequential(torch.nn.Linear(2, 2)), 1)


def test_meta_device_plan_and_materialized_stage():
    from transformers import AutoModelForCausalLM

    cfg = make_config("mixtral")
    with torch.device("meta"):
        meta = AutoModelForCausalLM.from_config(cfg)
    plan = partition_plan(meta, 2, [1, 3])
    assert [len(s.layers) for s in plan.stages] == [1, 3]
    stages = partition_model(meta, 2, [1, 3])
    assert all(p.is_meta for p in stages[1].parameters())
    stage = stages[1].to_empty(device="cpu")
    assert not any(p.is_meta for p in stage.parameters())
