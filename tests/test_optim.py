"""Muon against torch.optim.Muon, the batched expert path, NS accounting, grouping, and the EF identity."""
from __future__ import annotations

import copy

import pytest
import torch

from hf_asyncpp.config import OptimizerConfig
from hf_asyncpp.optim import Muon, build_optimizer, classify_parameters, install_error_feedback, zeropower_via_newtonschulz


def _grads(shape, n, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(shape, generator=g) for _ in range(n)]


@pytest.mark.parametrize("adjust", ["original", "match_rms_adamw"])
@pytest.mark.parametrize("shape", [(16, 24), (24, 16)])
def test_muon_matches_torch_muon(adjust, shape):
    torch.manual_seed(0)
    w0 = torch.randn(shape)
    ours, ref = torch.nn.Parameter(w0.clone()), torch.nn.Parameter(w0.clone())
    kw = dict(lr=0.02, weight_decay=0.1, momentum=0.95, nesterov=True)
    opt = Muon([dict(params=[ours], use_muon=True, ns_steps=5, adjust_lr=adjust, **kw)])
    tref = torch.optim.Muon([ref], adjust_lr_fn=adjust, **kw)
    for g in _grads(shape, 10):
        ours.grad, ref.grad = g.clone(), g.clone()
        opt.step()
        tref.step()
    torch.testing.assert_close(ours.data, ref.data, rtol=1e-6, atol=1e-7)
    assert opt.ns_calls[id(ours)] == 10  # Newton-Schulz ran at every step


def test_batched_expert_orthogonalization_equals_a_loop():
    g = torch.randn(6, 12, 20)
    batched = zeropower_via_newtonschulz(g)
    looped = torch.stack([zeropower_via_newtonschulz(g[e]) for e in range(6)])
    torch.testing.assert_close(batched.float(), looped.float(), rtol=0, atol=1e-2)  # bf16: same math, ~1 ulp
    exact = zeropower_via_newtonschulz(g.double(), dtype=torch.float64)
    exact_loop = torch.stack([zeropower_via_newtonschulz(g[e].double(), dtype=torch.float64) for e in range(6)])
    torch.testing.assert_close(exact, exact_loop, rtol=1e-10, atol=1e-12)
    # and it does orthogonalize: singular values near 1 (NS5 lands in roughly [0.5, 1.5])
    s = torch.linalg.svdvals(exact)
    assert s.min() > 0.4 and s.max() < 1.6
    # a 3-D parameter is updated per expert exactly like its 2-D slices
    p3 = torch.nn.Parameter(torch.randn(3, 8, 10))
    p2 = [torch.nn.Parameter(p3.data[e].clone()) for e in range(3)]
    kw = dict(use_muon=True, lr=0.01, weight_decay=0.0, momentum=0.9, nesterov=True, ns_steps=5, adjust_lr="original",
              ns_dtype="float64")
    o3, o2 = Muon([dict(params=[p3], **kw)]), Muon([dict(params=p2, **kw)])
    p3.data = p3.data.double()
    for q in p2:
        q.data = q.data.double()
    for g in _grads((3, 8, 10), 3):
        p3.grad = g.double()
        for e, q in enumerate(p2):
            q.grad = g[e].double()
        o3.step()
        o2.step()
    torch.testing.assert_close(p3.data, torch.stack([q.data for q in p2]), rtol=1e-10, atol=1e-12)
    assert o3.ns_calls[id(p3)] == 9  # 3 steps x 3 experts


def _tiny(arch):
    from transformers import AutoConfig, AutoModelForCausalLM

    base = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                vocab_size=128, max_position_embeddings=64)
    extra = {"mixtral": dict(num_local_experts=4, num_experts_per_tok=2),
             "gpt2": dict(n_embd=32, n_layer=2, n_head=4, n_positions=64, vocab_size=128, bos_token_id=0, eos_token_id=0),
             "qwen2_moe": dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=32)}
    kw = extra["gpt2"] if arch == "gpt2" else {**base, **extra.get(arch, {})}
    return AutoModelForCausalLM.from_config(AutoConfig.for_model(arch, **kw))


def test_hybrid_grouping():
    kinds = classify_parameters(_tiny("llama"))
    assert kinds["model.layers.0.mlp.gate_proj.weight"] == "muon"
    assert kinds["model.layers.1.self_attn.q_proj.weight"] == "muon"
    assert kinds["model.embed_tokens.weight"] == "adamw" and kinds["lm_head.weight"] == "adamw"
    assert kinds["model.norm.weight"] == "adamw_no_decay" and kinds["model.layers.0.input_layernorm.weight"] == "adamw_no_decay"
    moe = classify_parameters(_tiny("mixtral"))
    assert moe["model.layers.0.mlp.gate.weight"] == "adamw"  # the router
    assert moe["model.layers.0.mlp.experts.gate_up_proj"] == "muon"  # 3-D experts, batched NS
    q = classify_parameters(_tiny("qwen2_moe"))
    assert q["model.layers.0.mlp.shared_expert_gate.weight"] == "adamw" and q["model.layers.0.mlp.gate.weight"] == "adamw"
    assert q["model.layers.0.mlp.shared_expert.up_proj.weight"] == "muon"
    g = classify_parameters(_tiny("gpt2"))
    assert g["transformer.h.0.attn.c_attn.weight"] == "muon" and g["transformer.h.0.attn.c_attn.bias"] == "adamw_no_decay"
    assert g["transformer.wte.weight"] == "adamw" and g["transformer.wpe.weight"] == "adamw"
    logs = []
    opt = build_optimizer(_tiny("mixtral"), OptimizerConfig(name="muon"), log=logs.append)
    assert isinstance(opt, Muon) and any("muon" in m and "tensors" in m for m in logs)


def test_muon_runs_ns_on_every_matrix_every_step():
    model = _tiny("mixtral")
    opt = build_optimizer(model, OptimizerConfig(name="muon"), log=lambda *_: None)
    ids = torch.randint(0, 128, (2, 8))
    for _ in range(3):
        model(ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad()
    muon = [p for g in opt.param_groups if g["use_muon"] for p in g["params"]]
    assert muon and all(opt.ns_calls[id(p)] == 3 * (p.shape[0] if p.dim() == 3 else 1) for p in muon)


@pytest.mark.parametrize("name", ["adamw", "muon", "sgd"])
@pytest.mark.parametrize("lam", [1.0, 0.5])
def test_error_feedback_identity(name, lam):
    """x[t+1] - x[t] = -u[t] - lam (u[t] - u[t-1]), u from an un-wrapped twin fed the same gradients at the same points."""
    torch.manual_seed(0)
    w = torch.nn.Parameter(torch.randn(12, 10))

    def make(p):
        if name == "muon":
            return Muon([dict(params=[p], use_muon=True, lr=0.02, momentum=0.9, nesterov=True, weight_decay=0.1, ns_steps=5,
                              adjust_lr="original", ns_dtype="float64")])
        if name == "adamw":
            return torch.optim.AdamW([p], lr=0.01, weight_decay=0.1)
        return torch.optim.SGD([p], lr=0.05, momentum=0.9)

    w.data = w.data.double()
    opt = make(w)
    install_error_feedback(opt, lam)
    u_prev = None
    for t, g in enumerate(_grads((12, 10), 6, seed=1)):
        twin = torch.nn.Parameter(w.data.clone())
        twin_opt = make(twin)
        twin_opt.load_state_dict({"state": {0: copy.deepcopy(opt.state[w])}, "param_groups": opt.state_dict()["param_groups"]})
        twin.grad = g.double().clone()
        twin_opt.step()
        u = w.data - twin.data
        x_before = w.data.clone()
        w.grad = g.double().clone()
        opt.step()
        expected = -u if u_prev is None else -u - lam * (u - u_prev)
        torch.testing.assert_close(w.data - x_before, expected, rtol=1e-9, atol=1e-12)
        u_prev = u


def test_error_feedback_state_round_trip():
    torch.manual_seed(0)
    a = torch.nn.Parameter(torch.randn(5, 4))
    b = torch.nn.Parameter(a.data.clone())
    oa, ob = torch.optim.AdamW([a], lr=0.1), torch.optim.AdamW([b], lr=0.1)
    install_error_feedback(oa)
    install_error_feedback(ob)
    gs = _grads((5, 4), 6, seed=2)
    for g in gs[:3]:
        a.grad = g.clone()
        oa.step()
    sd = copy.deepcopy(oa.state_dict())
    assert "error_feedback" in sd and len(sd["error_feedback"]["prev"]) == 1
    b.data.copy_(a.data)
    ob.load_state_dict(sd)
    for g in gs[3:]:
        a.grad, b.grad = g.clone(), g.clone()
        oa.step()
        ob.step()
    assert torch.equal(a.data, b.data)
    sched = torch.optim.lr_scheduler.LambdaLR(oa, lambda k: 0.5)  # still a torch Optimizer
    sched.step()
