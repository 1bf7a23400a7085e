"""The planner's expert-parallel terms against transformers' own expert parallelism (``AllToAllEP``, the
implementation ``DistributedConfig(ep_implementation="all_to_all")`` installs) on 2 gloo ranks: the bytes its
all-to-alls send to the other rank (``plan.memory.all_to_all_bytes``), and what its backward keeps beyond the
experts' forward without expert parallelism (the combined fp32 outputs the routing weights multiply,
``plan.memory._layer_values_per_token``). A tiny Qwen3-MoE experts module, bf16 stacks under autocast (as the
weight versions hold them), the grouped GEMM, a routing spread evenly over the experts; under a minute (two spawned processes)."""
import pytest

from dist_utils import run_distributed

HIDDEN, EXPERTS, TOP_K, TOKENS = 64, 8, 2, 256


def _saved_activation_bytes(module, run):
    """(output, bytes of the tensors autograd saves for the backward, parameters left out: they are weights)."""
    import torch

    params = {q.data_ptr() for q in module.parameters()}
    seen = {}

    def pack(t):
        if t.data_ptr() not in params:
            seen[(t.data_ptr(), t.dtype, tuple(t.shape))] = t.numel() * t.element_size()
        return t
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = run()
    return out, sum(seen.values())


def _experts_with_and_without_ep(rank, world):
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from transformers import Qwen3MoeConfig
    from transformers.distributed.expert_parallel import AllToAllEP
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

    torch.manual_seed(0)
    config = Qwen3MoeConfig(hidden_size=HIDDEN, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
                            head_dim=16, num_experts=EXPERTS, num_experts_per_tok=TOP_K, moe_intermediate_size=32)
    config._experts_implementation = "grouped_mm"  # transformers' default in a built model
    experts = Qwen3MoeSparseMoeBlock(config).experts
    with torch.no_grad():
        for q in experts.parameters():
            q.normal_(0, 0.1)
            q.data = q.data.to(torch.bfloat16)
    # token t's k experts are t k .. t k + k - 1 (mod E): every expert, and so every rank, gets the same rows
    index = (torch.arange(TOKENS * TOP_K).reshape(TOKENS, TOP_K) % EXPERTS)
    weights = torch.rand(TOKENS, TOP_K).requires_grad_()  # the router's: their gradient is needed
    hidden = torch.randn(TOKENS, HIDDEN).requires_grad_()  # the norm's fp32 output under autocast
    with torch.autocast("cpu", dtype=torch.bfloat16):
        _, plain = _saved_activation_bytes(experts, lambda: experts(hidden, index, weights))

    # expert parallelism as transformers applies it: whole experts per rank (dim-0 slices), the local count, the
    # dispatch and the combine through AllToAllEP
    mesh = init_device_mesh("cpu", (world, 1), mesh_dim_names=("ep", "tp"))
    local = EXPERTS // world
    with torch.no_grad():
        for name in ("gate_up_proj", "down_proj"):
            stack = getattr(experts, name)
            setattr(experts, name, torch.nn.Parameter(stack[rank * local:(rank + 1) * local].clone()))
    experts.num_experts, experts._is_expert_parallel = local, True
    ep = AllToAllEP(experts, mesh["ep"], mesh["tp"])
    _, _, _, state = ep._dispatch_tokens(hidden.detach(), index, weights.detach())
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out, sharded = _saved_activation_bytes(experts, lambda: ep(hidden, index, weights))
    out.float().sum().backward()
    sent_rows = sum(n for r, n in enumerate(state.send_sizes) if r != rank)
    return {"plain": plain, "sharded": sharded, "sent_rows": sent_rows, "recv_rows": sum(state.recv_sizes),
            "dtype_bytes": hidden.element_size(), "grad_ok": bool(torch.isfinite(hidden.grad).all())}


def test_transformers_expert_parallelism_sends_and_keeps_what_the_planner_counts():
    from hf_asyncpp.plan.memory import _layer_values_per_token, all_to_all_bytes
    from hf_asyncpp.config.recipe import recipe_from_dict
    from hf_asyncpp.plan.memory import meta_model

    config = meta_model(recipe_from_dict({"model": {"config": {
        "model_type": "qwen3_moe", "hidden_size": HIDDEN, "intermediate_size": 128, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "num_experts": EXPERTS,
        "num_experts_per_tok": TOP_K, "moe_intermediate_size": 32, "vocab_size": 256}}})).config
    ranks = run_distributed(_experts_with_and_without_ep, 2)
    for r in ranks:
        assert r["grad_ok"] and r["recv_rows"] == TOKENS * TOP_K  # ep x its tokens for 1 / ep of the experts
        # dispatch + combine of the rows bound for the other rank, fp32
        assert 2 * r["sent_rows"] * HIDDEN * r["dtype_bytes"] == all_to_all_bytes(config, [0], TOKENS, 2)
        # kept beyond the unsharded experts': the planner's EP difference, 2 k h bytes per token (the combined fp32
        # outputs, 4 k h, in place of the grouped GEMM's weighted bf16 output, 2 k h), within the index tensors
        # the dispatch adds
        (fp32_ep, bf16_ep), (fp32_one, bf16_one) = (_layer_values_per_token(config, True, ep)[0] for ep in (2, 1))
        planned = 4 * (fp32_ep - fp32_one) + 2 * (bf16_ep - bf16_one)
        assert planned == 2 * TOP_K * HIDDEN
        measured = (r["sharded"] - r["plain"]) / TOKENS
        assert measured == pytest.approx(planned, rel=0.15), (measured, planned)
