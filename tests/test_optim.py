"""Muon against torch.optim.Muon/AdamW, the batched expert path, NS accounting, grouping, and the EF identity."""
from __future__ import annotations

import copy
import io

import pytest
import torch

from hf_asyncpp.config.optimizer import OptimizerConfig
from hf_asyncpp.optim import (Muon, apply_delay_correction, auto_lambda, build_optimizer, classify_parameters,
                              install_error_feedback, zeropower_via_newtonschulz)
from hf_asyncpp.optim.ef import learned_lambda
from hf_asyncpp.optim.muon import adamw_update, adjusted_lr, muon_update
from support import DIMS


def _grads(shape, n, seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(shape, generator=g, dtype=dtype) for _ in range(n)]


def _rel(a, b):
    return float((a - b).norm() / b.norm())


# ---------------------------------------------------------------- Muon numerics


@pytest.mark.parametrize("nesterov", [True, False])
@pytest.mark.parametrize("adjust", ["original", "match_rms_adamw"])
@pytest.mark.parametrize("shape", [(16, 24), (24, 16)])
def test_muon_matches_torch_muon(adjust, shape, nesterov):
    torch.manual_seed(0)
    w0 = torch.randn(shape)
    ours, ref = torch.nn.Parameter(w0.clone()), torch.nn.Parameter(w0.clone())
    kw = dict(lr=0.02, weight_decay=0.1, momentum=0.95, nesterov=nesterov)
    opt = Muon([dict(params=[ours], use_muon=True, ns_steps=5, adjust_lr=adjust, **kw)])
    tref = torch.optim.Muon([ref], adjust_lr_fn=adjust, **kw)
    for g in _grads(shape, 10):
        ours.grad, ref.grad = g.clone(), g.clone()
        opt.step()
        tref.step()
    assert _rel(ref.data, w0) > 0.01  # it did move (10^4 times the tolerance below)
    assert _rel(ours.data, ref.data) <= 1e-6
    torch.testing.assert_close(ours.data, ref.data, rtol=1e-6, atol=1e-7)
    assert opt.ns_calls[id(ours)] == 10  # Newton-Schulz ran at every step


def test_adamw_side_matches_torch_adamw():
    """The hybrid's AdamW groups (with and without decay) are torch.optim.AdamW; its Muon group is torch.optim.Muon."""
    torch.manual_seed(0)
    shapes = {"m": (12, 8), "e": (20, 8), "b": (8,)}
    ours = {k: torch.nn.Parameter(torch.randn(s)) for k, s in shapes.items()}
    ref = {k: torch.nn.Parameter(v.data.clone()) for k, v in ours.items()}
    adam = dict(use_muon=False, lr=0.01, betas=(0.9, 0.95), eps=1e-8)
    opt = Muon([dict(params=[ours["m"]], use_muon=True, lr=0.02, momentum=0.95, nesterov=True, weight_decay=0.1,
                     adjust_lr="match_rms_adamw"),
                dict(params=[ours["e"]], weight_decay=0.1, **adam),
                dict(params=[ours["b"]], weight_decay=0.0, **adam)])
    r_muon = torch.optim.Muon([ref["m"]], lr=0.02, momentum=0.95, nesterov=True, weight_decay=0.1, adjust_lr_fn="match_rms_adamw")
    r_adam = torch.optim.AdamW([dict(params=[ref["e"]], weight_decay=0.1), dict(params=[ref["b"]], weight_decay=0.0)],
                               lr=0.01, betas=(0.9, 0.95), eps=1e-8, foreach=False)
    for t in range(10):
        for k, s in shapes.items():
            g = torch.randn(s)
            ours[k].grad, ref[k].grad = g.clone(), g.clone()
        opt.step()
        r_muon.step()
        r_adam.step()
    for k in shapes:
        assert _rel(ours[k].data, ref[k].data) <= 1e-6, k
    assert set(opt.state[ours["e"]]) == {"step", "exp_avg", "exp_avg_sq"}  # torch.optim.AdamW's state layout


def test_newton_schulz_orthogonalizes_and_is_transpose_equivariant():
    g = torch.randn(12, 20, dtype=torch.float64)
    x = zeropower_via_newtonschulz(g, dtype=torch.float64)
    s = torch.linalg.svdvals(x)
    assert s.min() > 0.5 and s.max() < 1.3  # NS5 lands near 1, not exactly 1
    torch.testing.assert_close(zeropower_via_newtonschulz(g.T.contiguous(), dtype=torch.float64), x.T, rtol=1e-12, atol=1e-12)
    assert zeropower_via_newtonschulz(g).dtype == torch.bfloat16  # torch.optim.Muon's precision by default
    with pytest.raises(ValueError, match="matrix or a stack"):
        zeropower_via_newtonschulz(torch.randn(2, 3, 4, 5))


def test_batched_expert_orthogonalization_equals_a_loop():
    g = torch.randn(6, 12, 20)
    for dtype, tol in ((torch.bfloat16, 1e-2), (torch.float64, 1e-12)):
        batched = zeropower_via_newtonschulz(g.to(dtype), dtype=dtype)
        looped = torch.stack([zeropower_via_newtonschulz(g[e].to(dtype), dtype=dtype) for e in range(6)])
        torch.testing.assert_close(batched.double(), looped.double(), rtol=0, atol=tol)
    tall = torch.randn(3, 20, 12, dtype=torch.float64)  # (E, in, out) storage, as GPT-OSS
    torch.testing.assert_close(zeropower_via_newtonschulz(tall, dtype=torch.float64),
                               torch.stack([zeropower_via_newtonschulz(t, dtype=torch.float64) for t in tall]))
    # a 3-D parameter is updated per expert exactly like its 2-D slices (momentum, Nesterov, wd, lr scale)
    p3 = torch.nn.Parameter(torch.randn(3, 8, 10, dtype=torch.float64))
    p2 = [torch.nn.Parameter(p3.data[e].clone()) for e in range(3)]
    kw = dict(use_muon=True, lr=0.01, weight_decay=0.1, momentum=0.9, nesterov=True, ns_steps=5, adjust_lr="original",
              ns_dtype="float64")
    o3, o2 = Muon([dict(params=[p3], **kw)]), Muon([dict(params=p2, **kw)])
    for g in _grads((3, 8, 10), 3, dtype=torch.float64):
        p3.grad = g.clone()
        for e, q in enumerate(p2):
            q.grad = g[e].clone()
        o3.step()
        o2.step()
    torch.testing.assert_close(p3.data, torch.stack([q.data for q in p2]), rtol=1e-10, atol=1e-12)
    assert o3.ns_calls[id(p3)] == 9  # 3 steps x 3 experts


@pytest.mark.parametrize("adjust", ["original", "match_rms_adamw"])
def test_split_fused_experts_equal_torch_muon_on_each_projection(adjust):
    """A ``split_rows = 2`` group on a fused (E, 2I, H) gate_up stack = torch.optim.Muon on each expert's gate (I, H)
    and up (I, H) matrix separately (momentum, Nesterov, weight decay, the lr scale of an (I, H) matrix)."""
    torch.manual_seed(0)
    E, I, H = 3, 6, 10
    w0 = torch.randn(E, 2 * I, H)
    fused = torch.nn.Parameter(w0.clone())
    parts = [torch.nn.Parameter(w0[e, j * I:(j + 1) * I].clone()) for e in range(E) for j in range(2)]
    kw = dict(lr=0.02, weight_decay=0.1, momentum=0.95, nesterov=True)
    opt = Muon([dict(params=[fused], use_muon=True, adjust_lr=adjust, split_rows=2, **kw)])
    ref = torch.optim.Muon(parts, adjust_lr_fn=adjust, **kw)
    joint = Muon([dict(params=[torch.nn.Parameter(w0.clone())], use_muon=True, adjust_lr=adjust, **kw)])
    for g in _grads((E, 2 * I, H), 6):
        g[:, :I] *= 5  # the gate's gradient larger than the up projection's
        fused.grad = g.clone()
        joint.param_groups[0]["params"][0].grad = g.clone()
        for k, q in enumerate(parts):
            q.grad = g[k // 2, (k % 2) * I:(k % 2 + 1) * I].clone()
        opt.step()
        ref.step()
        joint.step()
    expect = torch.stack([torch.cat([parts[2 * e].data, parts[2 * e + 1].data]) for e in range(E)])
    assert _rel(expect, w0) > 0.01
    assert _rel(fused.data, expect) <= 1e-6
    assert _rel(joint.param_groups[0]["params"][0].data, expect) > 100 * 1e-6  # orthogonalized fused: another update
    assert opt.ns_calls[id(fused)] == 6 * E * 2  # 6 steps x (experts x 2 projections)
    with pytest.raises(ValueError, match="split_rows 2 does not divide"):
        Muon([dict(params=[torch.nn.Parameter(torch.randn(2, 5, 4))], use_muon=True, split_rows=2)])


def test_build_splits_fused_gate_up_only_in_the_gate_then_up_layout():
    mix = _tiny("mixtral")
    logs = []
    opt = build_optimizer(mix, OptimizerConfig(name="muon"), log=logs.append)
    names = {id(p): n for n, p in mix.named_parameters()}
    split = next(g for g in opt.param_groups if g["name"] == "muon_split")
    assert split["split_rows"] == 2 and sorted(names[id(p)] for p in split["params"]) == sorted(
        n for n in names.values() if n.endswith("experts.gate_up_proj"))
    muon = next(g for g in opt.param_groups if g["name"] == "muon")
    assert not any(names[id(p)].endswith("gate_up_proj") for p in muon["params"])
    assert "muon_split" not in [g["name"] for g in build_optimizer(mix, OptimizerConfig(name="muon", muon_split_fused=False),
                                                                  log=lambda *_: None).param_groups]
    oss, logs = _tiny("gpt_oss"), []  # (E, H, 2I), gate and up interleaved: not split, and said so
    opt = build_optimizer(oss, OptimizerConfig(name="muon"), log=logs.append)
    assert "muon_split" not in [g["name"] for g in opt.param_groups] and any("orthogonalized fused" in m for m in logs)


def test_muon_rejects_bad_groups():
    with pytest.raises(ValueError, match="use_muon"):
        Muon([dict(params=[torch.nn.Parameter(torch.randn(2, 2))])])
    with pytest.raises(ValueError, match="2-D matrices or 3-D"):
        Muon([dict(params=[torch.nn.Parameter(torch.randn(4))], use_muon=True)])
    with pytest.raises(ValueError, match=r"unknown keys \['betas'\]"):
        Muon([dict(params=[torch.nn.Parameter(torch.randn(2, 2))], use_muon=True, betas=(0.9, 0.9))])
    with pytest.raises(ValueError, match="adjust_lr"):
        Muon([dict(params=[torch.nn.Parameter(torch.randn(2, 2))], use_muon=True, adjust_lr="spectral")])


# ---------------------------------------------------------------- grouping


def _tiny(arch, **over):
    from transformers import AutoConfig, AutoModelForCausalLM

    base = dict(**DIMS, num_hidden_layers=2, vocab_size=128)
    extra = {"mixtral": dict(num_local_experts=4, num_experts_per_tok=2),
             "gpt2": dict(n_embd=32, n_layer=2, n_head=4, n_positions=64, vocab_size=128, bos_token_id=0, eos_token_id=0),
             "qwen2_moe": dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=32),
             "gpt_oss": dict(num_local_experts=4, num_experts_per_tok=2, head_dim=8, sliding_window=16,
                             layer_types=["sliding_attention", "full_attention"]),
             "deepseek_v3": dict(n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, first_k_dense_replace=1,
                                 n_group=1, topk_group=1, kv_lora_rank=16, q_lora_rank=16, qk_rope_head_dim=8,
                                 qk_nope_head_dim=8, v_head_dim=8, n_shared_experts=1)}
    kw = extra["gpt2"] if arch == "gpt2" else {**base, **extra.get(arch, {})}
    return AutoModelForCausalLM.from_config(AutoConfig.for_model(arch, **{**kw, **over}))


def _expect(kinds, muon=(), adamw=(), no_decay=()):
    for names, kind in ((muon, "muon"), (adamw, "adamw"), (no_decay, "adamw_no_decay")):
        for n in names:
            assert kinds[n] == kind, (n, kinds[n], kind)


def test_grouping_llama_and_gpt2():
    model = _tiny("llama")
    kinds = classify_parameters(model)
    assert set(kinds) == {n for n, _ in model.named_parameters()}
    _expect(kinds,
            muon=[f"model.layers.{i}.{m}.weight" for i in (0, 1) for m in
                  ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
                   "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")],  # gate_proj is a plain matrix, not a router
            adamw=["model.embed_tokens.weight", "lm_head.weight"],
            no_decay=["model.norm.weight", "model.layers.0.input_layernorm.weight", "model.layers.1.post_attention_layernorm.weight"])
    assert sum(k == "muon" for k in kinds.values()) == 14
    g = classify_parameters(_tiny("gpt2"))
    _expect(g, muon=[f"transformer.h.{i}.{m}.weight" for i in (0, 1) for m in ("attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj")],
            adamw=["transformer.wte.weight", "transformer.wpe.weight"],
            no_decay=["transformer.h.0.attn.c_attn.bias", "transformer.h.1.ln_1.weight", "transformer.ln_f.bias"])
    assert sum(k == "muon" for k in g.values()) == 8


def test_grouping_moe_models():
    moe = classify_parameters(_tiny("mixtral"))
    _expect(moe, muon=["model.layers.0.mlp.experts.gate_up_proj", "model.layers.1.mlp.experts.down_proj",
                       "model.layers.0.self_attn.q_proj.weight"],
            adamw=["model.layers.0.mlp.gate.weight", "model.layers.1.mlp.gate.weight"])  # MixtralTopKRouter
    q = classify_parameters(_tiny("qwen2_moe"))
    _expect(q, muon=["model.layers.0.mlp.shared_expert.up_proj.weight", "model.layers.0.mlp.experts.gate_up_proj"],
            adamw=["model.layers.0.mlp.shared_expert_gate.weight", "model.layers.0.mlp.gate.weight"],
            no_decay=["model.layers.0.self_attn.q_proj.bias"])
    oss = classify_parameters(_tiny("gpt_oss"))
    _expect(oss, muon=["model.layers.0.mlp.experts.gate_up_proj", "model.layers.0.mlp.experts.down_proj"],
            adamw=["model.layers.0.mlp.router.weight"],
            no_decay=["model.layers.0.mlp.router.bias", "model.layers.0.mlp.experts.gate_up_proj_bias",  # 2-D (E, 2I) biases
                      "model.layers.0.mlp.experts.down_proj_bias", "model.layers.0.self_attn.sinks"])
    ds = classify_parameters(_tiny("deepseek_v3"))
    _expect(ds, muon=["model.layers.0.mlp.gate_proj.weight", "model.layers.1.mlp.experts.gate_up_proj",
                      "model.layers.1.mlp.shared_experts.up_proj.weight", "model.layers.1.self_attn.kv_b_proj.weight"],
            adamw=["model.layers.1.mlp.gate.weight"])  # DeepseekV3TopkRouter


def test_build_muon_logs_groups_and_groups_a_pipeline_stage():
    model = _tiny("mixtral")
    logs = []
    cfg = OptimizerConfig(name="muon", learning_rate=0.02, adamw_lr=3e-3, weight_decay=0.1, adamw_weight_decay=0.05)
    opt = build_optimizer(model, cfg, log=logs.append)
    assert isinstance(opt, Muon)
    by_name = {g["name"]: g for g in opt.param_groups}
    assert set(by_name) == {"muon", "muon_split", "adamw", "adamw_no_decay"}  # muon_split: the fused gate_up stacks
    assert by_name["muon"]["use_muon"] and by_name["muon"]["lr"] == 0.02 and by_name["muon"]["weight_decay"] == 0.1
    assert by_name["adamw"]["lr"] == 3e-3 and by_name["adamw"]["weight_decay"] == 0.05
    assert by_name["adamw_no_decay"]["weight_decay"] == 0.0 and by_name["adamw_no_decay"]["lr"] == 3e-3
    kinds = classify_parameters(model)
    names = {id(p): n for n, p in model.named_parameters()}
    for g in opt.param_groups:
        assert {kinds[names[id(p)]] for p in g["params"]} == {g["name"].removesuffix("_split")}
    n_muon = len(by_name["muon"]["params"])
    assert any(f"group muon: {n_muon} tensors" in m for m in logs) and len(logs) == 4
    # a pipeline stage (original names, the HF modules themselves in plain containers) classifies the same way
    stage = torch.nn.Module()
    stage.model = torch.nn.Module()
    stage.model.layers = torch.nn.ModuleDict({"1": model.model.layers[1]})
    stage.model.norm, stage.lm_head = model.model.norm, model.lm_head
    sk = classify_parameters(stage)
    assert sk["lm_head.weight"] == "adamw" and sk["model.layers.1.mlp.gate.weight"] == "adamw"
    assert sk["model.layers.1.mlp.experts.gate_up_proj"] == "muon" and sk["model.norm.weight"] == "adamw_no_decay"
    assert all(sk[n] == kinds[n] for n in sk)


def test_router_fallback_and_unrecognized_layouts():
    class MoE(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.gate = torch.nn.Linear(8, 4, bias=False)  # a plain Linear router
            self.experts = torch.nn.ModuleList(torch.nn.Linear(8, 8) for _ in range(4))
            self.gate_proj = torch.nn.Linear(8, 8)

    net = torch.nn.Module()
    net.layers = torch.nn.ModuleList([MoE()])
    k = classify_parameters(net)
    assert k["layers.0.gate.weight"] == "adamw" and k["layers.0.gate_proj.weight"] == "muon"
    assert k["layers.0.experts.1.weight"] == "muon" and k["layers.0.experts.1.bias"] == "adamw_no_decay"
    with pytest.raises(ValueError, match="no matrix inside a decoder layer"):
        build_optimizer(torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)), OptimizerConfig(name="muon"), log=lambda *_: None)
    head_only = torch.nn.Module()  # a pipeline stage holding only the norm and the head
    head_only.norm, head_only.lm_head = torch.nn.LayerNorm(8), torch.nn.Linear(8, 16, bias=False)
    logs = []
    opt = build_optimizer(head_only, OptimizerConfig(name="muon"), log=logs.append)
    assert [g["name"] for g in opt.param_groups] == ["adamw", "adamw_no_decay"] and "AdamW side only" in logs[0]


@pytest.mark.parametrize("name", ["adamw", "nadam", "sgd"])
def test_build_other_optimizers(name):
    model = _tiny("llama")
    cfg = OptimizerConfig(name=name, learning_rate=1e-3, weight_decay=0.1, adamw_lr=5.0, adamw_weight_decay=0.7,
                          adam_beta1=0.8, adam_beta2=0.97, momentum=0.9, nesterov=True)
    logs = []
    opt = build_optimizer(model, cfg, log=logs.append)
    cls = {"adamw": torch.optim.AdamW, "nadam": torch.optim.NAdam, "sgd": torch.optim.SGD}[name]
    assert type(opt) is cls and len(logs) == 2
    decay, no_decay = opt.param_groups
    assert (decay["name"], decay["weight_decay"], no_decay["name"], no_decay["weight_decay"]) == ("decay", 0.1, "no_decay", 0.0)
    assert all(g["lr"] == 1e-3 for g in opt.param_groups)  # adamw_lr/adamw_weight_decay are Muon's AdamW side only
    kinds = classify_parameters(model)
    names = {id(p): n for n, p in model.named_parameters()}
    assert {kinds[names[id(p)]] for p in no_decay["params"]} == {"adamw_no_decay"}
    assert len(decay["params"]) + len(no_decay["params"]) == len(list(model.parameters()))
    if name == "nadam":
        assert decay["betas"] == (0.8, 0.97) and decay["decoupled_weight_decay"]  # adam_beta1, as AdamW's
    elif name == "sgd":
        assert decay["momentum"] == 0.9 and decay["nesterov"]
    else:
        assert decay["betas"] == (0.8, 0.97)
    if name != "sgd":  # adam_beta1 unset: NAdam's constant high momentum 0.99, AdamW's usual 0.9
        unset = build_optimizer(model, OptimizerConfig(name=name, adam_beta2=0.97), log=lambda *_: None)
        assert unset.param_groups[0]["betas"] == ({"nadam": 0.99, "adamw": 0.9}[name], 0.97)


@pytest.mark.parametrize("beta1", [None, 0.9])
def test_nadam_has_the_constant_high_momentum_of_the_related_work(beta1):
    """Against NAdam written out by hand with a constant mu = beta1 = 0.99 (Dozat's Nesterov-Adam, as Ajanthan et
    al. use it): x -= lr [mu m_t / (1 - mu^(t+1)) + (1 - mu) g_t / (1 - mu^t)] / (sqrt(v_t / (1 - b2^t)) + eps),
    decoupled weight decay first. torch's default momentum_decay would be far from it."""
    torch.manual_seed(0)
    w = torch.nn.Parameter(torch.randn(6, 4, dtype=torch.float64))
    model = torch.nn.Module()
    model.lm_head = torch.nn.Linear(4, 6, bias=False)  # one decay-group matrix
    model.lm_head.weight = w
    cfg = OptimizerConfig(name="nadam", learning_rate=0.01, weight_decay=0.1, adam_beta1=beta1, adam_beta2=0.95,
                          adam_epsilon=1e-8)
    opt = build_optimizer(model, cfg, log=lambda *_: None)
    mu = beta1 or 0.99  # unset: Ajanthan et al.'s 0.99; else adam_beta1, constant from the first step
    x, m, v, b2, lr = w.detach().clone(), torch.zeros_like(w), torch.zeros_like(w), 0.95, 0.01
    for t, g in enumerate(_grads((6, 4), 8, seed=3, dtype=torch.float64), start=1):
        w.grad = g.clone()
        opt.step()
        x *= 1 - lr * 0.1
        m = mu * m + (1 - mu) * g
        v = b2 * v + (1 - b2) * g * g
        x -= lr * (mu * m / (1 - mu ** (t + 1)) + (1 - mu) * g / (1 - mu ** t)) / ((v / (1 - b2 ** t)).sqrt() + 1e-8)
        # torch keeps the step count in float32, so its mu_t is 0.99 to ~1e-7 (the default psi: 0.495 at step 1)
        torch.testing.assert_close(w.detach(), x, rtol=1e-6, atol=1e-9)
    assert opt.param_groups[0]["momentum_decay"] == 1000.0


def _train(model, opt, sched, steps, seed):
    g = torch.Generator().manual_seed(seed)
    losses = []
    for _ in range(steps):
        ids = torch.randint(0, 128, (2, 8), generator=g)
        loss = model(ids, labels=ids).loss
        loss.backward()
        opt.step()
        sched.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def test_muon_runs_ns_on_every_matrix_every_step_and_lambda_lr_scales_both_sides():
    model = _tiny("mixtral")
    opt = build_optimizer(model, OptimizerConfig(name="muon", learning_rate=0.02, adamw_lr=0.004), log=lambda *_: None)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda k: 0.5**k)
    _train(model, opt, sched, 3, seed=0)
    muon = [p for g in opt.param_groups if g["use_muon"] for p in g["params"]]
    kinds = classify_parameters(model)
    assert len(muon) == sum(k == "muon" for k in kinds.values())
    blocks = {id(p): g["split_rows"] for g in opt.param_groups if g["use_muon"] for p in g["params"]}
    assert set(blocks.values()) == {1, 2}  # fused gate_up stacks: two matrices per expert
    assert all(opt.ns_calls[id(p)] == 3 * (p.shape[0] if p.dim() == 3 else 1) * blocks[id(p)] for p in muon)
    lrs = {g["name"]: g["lr"] for g in opt.param_groups}
    assert lrs == pytest.approx({"muon": 0.02 / 8, "muon_split": 0.02 / 8, "adamw": 0.004 / 8, "adamw_no_decay": 0.004 / 8})


def test_hybrid_state_dict_round_trip():
    torch.manual_seed(0)
    model = _tiny("llama")
    twin = copy.deepcopy(model)
    cfg = OptimizerConfig(name="muon", learning_rate=0.02, adamw_lr=3e-3, delay_correction="error_feedback")

    def make(m):
        opt = apply_delay_correction(build_optimizer(m, cfg, log=lambda *_: None), cfg)
        return opt, torch.optim.lr_scheduler.LambdaLR(opt, lambda k: 1.0 / (k + 1))

    opt, sched = make(model)
    straight = _train(model, opt, sched, 3, seed=1) + _train(model, opt, sched, 3, seed=2)
    o1, s1 = make(twin)
    first = _train(twin, o1, s1, 3, seed=1)
    buf = io.BytesIO()
    torch.save({"model": twin.state_dict(), "opt": o1.state_dict(), "sched": s1.state_dict()}, buf)
    buf.seek(0)
    saved = torch.load(buf, weights_only=True)
    fresh = _tiny("llama")
    fresh.load_state_dict(saved["model"])
    o2, s2 = make(fresh)
    o2.load_state_dict(saved["opt"])
    s2.load_state_dict(saved["sched"])
    assert len(o2.error_feedback["prev"]) == len(list(fresh.parameters()))
    assert "momentum_buffer" in o2.state[fresh.model.layers[0].mlp.up_proj.weight]
    assert first + _train(fresh, o2, s2, 3, seed=2) == straight


# ---------------------------------------------------------------- error feedback


def _make(name, p):
    if name == "muon":
        return Muon([dict(params=[p], use_muon=True, lr=0.02, momentum=0.9, nesterov=True, weight_decay=0.1, ns_steps=5,
                          adjust_lr="original", ns_dtype="float64")])
    if name == "adamw":
        return torch.optim.AdamW([p], lr=0.01, weight_decay=0.1)
    return torch.optim.SGD([p], lr=0.05, momentum=0.9, weight_decay=0.01)


@pytest.mark.parametrize("name", ["adamw", "muon", "sgd"])
@pytest.mark.parametrize("lam", [1.0, 0.5, "auto"])
def test_error_feedback_identity(name, lam):
    """x[t+1] - x[t] = -u[t] - lam (u[t] - u[t-1]) (lam = 1: -2u[t] + u[t-1]); the first step is plain.

    u[t] comes from an un-wrapped twin optimizer with its own state, put at x[t] and fed the same gradient:
    this also proves the correction leaves the wrapped optimizer's state alone.
    """
    torch.manual_seed(0)
    w = torch.nn.Parameter(torch.randn(12, 10, dtype=torch.float64))
    twin = torch.nn.Parameter(w.data.clone())
    opt = apply_delay_correction(_make(name, w), OptimizerConfig(delay_correction="error_feedback", ef_lambda=lam))
    twin_opt = _make(name, twin)
    u_prev, weights = None, []
    for t, g in enumerate(_grads((12, 10), 6, seed=1, dtype=torch.float64)):
        twin.data.copy_(w.data)
        twin.grad, w.grad = g.clone(), g.clone()
        twin_opt.step()
        u = w.data - twin.data
        x_before = w.data.clone()
        opt.step()
        weight = lam
        if lam == "auto" and u_prev is not None:  # clip(cos(u[t], u[t-1]), 0, 1), computed here independently
            weight = min(1.0, max(0.0, float((u * u_prev).sum() / (u.norm() * u_prev.norm()))))
            weights.append(weight)
        expected = -u if u_prev is None else -u - weight * (u - u_prev)
        torch.testing.assert_close(w.data - x_before, expected, rtol=1e-9, atol=1e-12)
        if u_prev is not None and lam == 1.0:
            torch.testing.assert_close(w.data - x_before, -2 * u + u_prev, rtol=1e-9, atol=1e-12)
        assert u.abs().max() > 1e-4  # a real update
        u_prev = u
    torch.testing.assert_close(opt.error_feedback["prev"][w], u_prev, rtol=1e-12, atol=0)  # keeps u[t]
    if lam == "auto":
        assert len(weights) == 5 and any(0.0 < x < 0.999 for x in weights)  # the cosine really varies the weight


def test_auto_lambda_trusts_agreeing_updates_only():
    u = torch.randn(6, 5)
    assert float(auto_lambda(u, 2 * u)) == pytest.approx(1.0)  # same direction: the full one-step extrapolation
    assert float(auto_lambda(u, -u)) == 0.0  # an oscillation: no extrapolation (lam = 1 would triple the step)
    assert float(auto_lambda(u, torch.zeros_like(u))) == 0.0  # nothing to compare with
    v = torch.randn(6, 5)
    v -= (v * u).sum() / (u * u).sum() * u  # orthogonal to u ...
    assert float(auto_lambda(u, u + v)) == pytest.approx(float(u.norm() / (u + v).norm()), rel=1e-5)  # ... cos(u, u+v)
    with pytest.raises(ValueError, match="ef_lambda: 'often' is not allowed; a number >= 0, 'auto' or 'learned'"):
        install_error_feedback(torch.optim.SGD([torch.nn.Parameter(u)], lr=0.1), "often")


def test_error_feedback_install_rules():
    p = torch.nn.Parameter(torch.randn(3, 3))
    opt = torch.optim.SGD([p], lr=0.1)
    assert apply_delay_correction(opt, OptimizerConfig()) is opt and not hasattr(opt, "error_feedback")
    assert apply_delay_correction(opt, OptimizerConfig(delay_correction="error_feedback")) is opt
    with pytest.raises(ValueError, match="already installed"):
        install_error_feedback(opt)
    # a parameter without a gradient this step is not corrected and keeps its buffer
    q = torch.nn.Parameter(torch.ones(2))
    o = install_error_feedback(torch.optim.SGD([p, q], lr=0.1))
    p.grad, q.grad = torch.ones(3, 3), torch.ones(2)
    o.step()
    kept = o.error_feedback["prev"][q].clone()
    q.grad = None
    before = q.data.clone()
    p.grad = torch.ones(3, 3)
    o.step()
    assert torch.equal(q.data, before) and torch.equal(o.error_feedback["prev"][q], kept)


def test_error_feedback_state_round_trip():
    torch.manual_seed(0)
    a = torch.nn.Parameter(torch.randn(5, 4))
    b = torch.nn.Parameter(a.data.clone())
    oa, ob = install_error_feedback(torch.optim.AdamW([a], lr=0.1), 0.7), install_error_feedback(torch.optim.AdamW([b], lr=0.1), 0.7)
    gs = _grads((5, 4), 6, seed=2)
    for g in gs[:3]:
        a.grad = g.clone()
        oa.step()
    sd = copy.deepcopy(oa.state_dict())
    assert set(sd["error_feedback"]) == {"lam", "prev", "t"} and list(sd["error_feedback"]["prev"]) == [0]
    b.data.copy_(a.data)
    ob.load_state_dict(sd)
    assert "error_feedback" in sd  # the caller's dict is left as it was
    assert torch.equal(ob.error_feedback["prev"][b], oa.error_feedback["prev"][a])
    for g in gs[3:]:
        a.grad, b.grad = g.clone(), g.clone()
        oa.step()
        ob.step()
    assert torch.equal(a.data, b.data)
    # a state dict without EF buffers (e.g. from a run without the correction) clears them: the next step is plain
    sd.pop("error_feedback")
    ob.load_state_dict(sd)
    assert ob.error_feedback["prev"] == {}


def _learned_by_hand(gs, lr, rate, start=0, factors=None):
    """SGD + EF with the learned lambda written out: lam <- clip(lam + rate f[t] cos(g[t], d[t-2]), 0, 3) over both
    tensors together (one group), then x <- x - u - lam (u - u_prev), with u = lr f[t] g[t]; ``factors`` f: the lr
    schedule's factor per step (default 1), which scales lambda's step too (``follow_lr``)."""
    x = [torch.zeros(3, 3, dtype=torch.float64), torch.zeros(2, dtype=torch.float64)]
    lam, prev, diffs, lams, xs = 1.0, None, {}, [], []
    for t, g in enumerate(gs):
        f = factors[t] if factors is not None else 1.0
        if t - 2 in diffs:
            d = diffs[t - 2]
            dot = sum(float((a * b).sum()) for a, b in zip(g, d))
            cos = dot / (sum(float((a * a).sum()) for a in g) ** 0.5 * sum(float((b * b).sum()) for b in d) ** 0.5)
            lam = min(max(lam + rate * f * cos, 0.0), 3.0)
        u = [lr * f * a for a in g]
        x = [a - b for a, b in zip(x, u)]
        if prev is not None and t >= start:
            d = [a - b for a, b in zip(u, prev)]
            x = [a - lam * b for a, b in zip(x, d)]
            diffs[t] = d
        prev = u
        lams.append(lam)
        xs.append([a.clone() for a in x])
    return xs, lams


def test_learned_lambda_follows_the_hypergradient_by_hand():
    """``ef_lambda: learned`` is the rule written out (gradients with a drift, so lambda moves), its lambda is
    logged through ``learned_lambda``, and a state dict taken mid-run continues exactly (lambda, d buffers, step)."""
    gen = torch.Generator().manual_seed(5)
    drift = [torch.randn(3, 3, generator=gen, dtype=torch.float64), torch.randn(2, generator=gen, dtype=torch.float64)]
    gs = [[dr * (1 + 0.3 * t) + 0.5 * torch.randn(dr.shape, generator=gen, dtype=torch.float64) for dr in drift]
          for t in range(10)]
    xs, lams = _learned_by_hand(gs, 0.1, 0.4)
    assert max(abs(v - 1.0) for v in lams) > 0.1  # the rule moved lambda: the comparison sees the updates

    def make():
        a, b = torch.nn.Parameter(torch.zeros(3, 3, dtype=torch.float64)), torch.nn.Parameter(torch.zeros(2, dtype=torch.float64))
        return [a, b], install_error_feedback(torch.optim.SGD([a, b], lr=0.1), "learned", rate=0.4)

    params, opt = make()
    for t, g in enumerate(gs):
        for p, gi in zip(params, g):
            p.grad = gi.clone()
        opt.step()
        assert learned_lambda(opt) == pytest.approx(lams[t], abs=1e-12)
        for p, h in zip(params, xs[t]):
            torch.testing.assert_close(p.data, h, rtol=0, atol=1e-12)
        if t == 4:
            sd = copy.deepcopy(opt.state_dict())
            saved = [p.data.clone() for p in params]
    params2, opt2 = make()
    for p, w in zip(params2, saved):
        p.data.copy_(w)
    opt2.load_state_dict(sd)
    for g in gs[5:]:
        for p, gi in zip(params2, g):
            p.grad = gi.clone()
        opt2.step()
    for p, q in zip(params, params2):
        assert torch.equal(p.data, q.data)
    assert learned_lambda(opt2) == learned_lambda(opt)


def test_learned_lambda_step_follows_the_lr_schedule():
    """``ef_lambda_schedule: lr``: lambda's step is ``ef_lambda_lr`` times the lr schedule's factor at that step (an
    LR scheduler's lr / initial_lr), as written out by hand; the constant rule on the same run ends elsewhere."""
    gen = torch.Generator().manual_seed(7)
    drift = [torch.randn(3, 3, generator=gen, dtype=torch.float64), torch.randn(2, generator=gen, dtype=torch.float64)]
    gs = [[dr * (1 + 0.3 * t) + 0.5 * torch.randn(dr.shape, generator=gen, dtype=torch.float64) for dr in drift]
          for t in range(10)]
    factors = [min(1.0, (t + 1) / 3) * (1 - 0.08 * t) for t in range(10)]  # a warm-up, then a decay
    xs, lams = _learned_by_hand(gs, 0.1, 0.4, factors=factors)
    _, constant = _learned_by_hand(gs, 0.1, 0.4, factors=None)
    assert abs(lams[-1] - constant[-1]) > 0.05  # the factor changed lambda's path: the comparison can see it

    a, b = torch.nn.Parameter(torch.zeros(3, 3, dtype=torch.float64)), torch.nn.Parameter(torch.zeros(2, dtype=torch.float64))
    opt = apply_delay_correction(torch.optim.SGD([a, b], lr=0.1),
                                 OptimizerConfig(delay_correction="error_feedback", ef_lambda="learned",
                                                 ef_lambda_lr=0.4, ef_lambda_schedule="lr"))
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda t: factors[t] if t < len(factors) else 1.0)
    for t, g in enumerate(gs):
        a.grad, b.grad = g[0].clone(), g[1].clone()
        opt.step()
        sched.step()
        assert learned_lambda(opt) == pytest.approx(lams[t], abs=1e-12)
        torch.testing.assert_close(a.data, xs[t][0], rtol=0, atol=1e-12)
        torch.testing.assert_close(b.data, xs[t][1], rtol=0, atol=1e-12)


def test_fused_adamw_is_torchs_fused_kernel_and_steps_as_the_default():
    """``optimizer.fused: true`` builds torch's fused AdamW (one kernel; transformers' adamw_torch_fused): four steps
    land where the default per-tensor AdamW lands, within float32 rounding."""
    model = _tiny("llama")
    ref = copy.deepcopy(model)
    opt = build_optimizer(model, OptimizerConfig(name="adamw", learning_rate=0.01, fused=True), log=lambda *a: None)
    plain = build_optimizer(ref, OptimizerConfig(name="adamw", learning_rate=0.01), log=lambda *a: None)
    assert opt.defaults["fused"] is True and not plain.defaults["fused"]
    g = torch.Generator().manual_seed(0)
    for _ in range(4):
        for p, q in zip(model.parameters(), ref.parameters()):
            p.grad = torch.randn(p.shape, generator=g)
            q.grad = p.grad.clone()
        opt.step()
        plain.step()
    for (n, p), q in zip(model.named_parameters(), ref.parameters()):
        assert _rel(p.data, q.data) <= 1e-6, n


def test_error_feedback_starts_with_the_delay():
    """delay_start_step K: EF's first K steps are plain (synchronous steps need no correction); the first delayed
    step extrapolates from the last synchronous update."""
    gen = torch.Generator().manual_seed(2)
    gs = [[torch.randn(3, 3, generator=gen, dtype=torch.float64), torch.randn(2, generator=gen, dtype=torch.float64)]
          for _ in range(6)]
    xs, _ = _learned_by_hand(gs, 0.1, 0.0, start=3)  # rate 0: lambda stays 1, the fixed rule
    a, b = torch.nn.Parameter(torch.zeros(3, 3, dtype=torch.float64)), torch.nn.Parameter(torch.zeros(2, dtype=torch.float64))
    opt = apply_delay_correction(torch.optim.SGD([a, b], lr=0.1),
                                 OptimizerConfig(delay_correction="error_feedback", delay_start_step=3))
    for t, g in enumerate(gs):
        a.grad, b.grad = g[0].clone(), g[1].clone()
        opt.step()
        torch.testing.assert_close(a.data, xs[t][0], rtol=0, atol=1e-12)
        torch.testing.assert_close(b.data, xs[t][1], rtol=0, atol=1e-12)


def test_recipe_values_reach_muon_and_adamw_as_torch_reads_them():
    """Every optimizer field of a recipe reaches the optimizer ``build_optimizer`` makes: a llama built with
    non-default values (no Nesterov, momentum 0.9, 3 Newton-Schulz steps, the original lr adjustment, its own AdamW
    lr, decay and betas; Newton-Schulz in bfloat16, as torch's) steps exactly as torch.optim.Muon and
    torch.optim.AdamW built with those values by hand.
    (The runtime tests build their reference with the same builder, so they cannot see a value dropped here.)"""
    cfg = OptimizerConfig(name="muon", learning_rate=0.03, weight_decay=0.05, momentum=0.9, nesterov=False, ns_steps=3,
                          adjust_lr="original", ns_dtype="bfloat16", adamw_lr=0.004, adamw_weight_decay=0.02,
                          adam_beta1=0.8, adam_beta2=0.9, adam_epsilon=1e-6)
    model = _tiny("llama")
    ref = copy.deepcopy(model)
    opt = build_optimizer(model, cfg, log=lambda *a: None)
    kinds, theirs = classify_parameters(ref), dict(ref.named_parameters())
    muon = [p for n, p in theirs.items() if kinds[n] == "muon"]
    assert muon and len(muon) == sum(len(g["params"]) for g in opt.param_groups if g["use_muon"])
    refs = [torch.optim.Muon(muon, lr=0.03, weight_decay=0.05, momentum=0.9, nesterov=False, ns_steps=3,
                             adjust_lr_fn="original"),
            torch.optim.AdamW([dict(params=[p for n, p in theirs.items() if kinds[n] == "adamw"], weight_decay=0.02),
                               dict(params=[p for n, p in theirs.items() if kinds[n] == "adamw_no_decay"], weight_decay=0.0)],
                              lr=0.004, betas=(0.8, 0.9), eps=1e-6, foreach=False)]
    g = torch.Generator().manual_seed(0)
    for _ in range(4):
        for (n, p), q in zip(model.named_parameters(), ref.parameters()):
            p.grad = torch.randn(p.shape, generator=g)
            q.grad = p.grad.clone()
        opt.step()
        for r in refs:
            r.step()
    for (n, p), q in zip(model.named_parameters(), ref.parameters()):
        assert _rel(p.data, q.data) <= 1e-6, n


def test_the_batched_step_equals_the_per_matrix_reference():
    """One Muon group of many same-shape matrices (and a second shape, and a split fused projection) stepped as
    stacks equals ``muon_update`` applied matrix by matrix; the AdamW side (torch's fused kernel) equals
    ``adamw_update`` tensor by tensor; within bf16 (Newton-Schulz) and float32 rounding."""
    torch.manual_seed(0)
    shapes = [(16, 8)] * 5 + [(8, 24)] * 3 + [(3, 8, 6)]
    ours = [torch.nn.Parameter(torch.randn(s)) for s in shapes]
    fused = torch.nn.Parameter(torch.randn(12, 6))  # split_rows=2: two 6 x 6 blocks
    side = [torch.nn.Parameter(torch.randn(s)) for s in ((7,), (5, 3))]
    ref = [p.detach().clone() for p in ours + [fused] + side]
    hp = dict(lr=0.02, momentum=0.95, nesterov=True, weight_decay=0.1, adjust_lr="match_rms_adamw")
    opt = Muon([dict(params=ours, use_muon=True, **hp), dict(params=[fused], use_muon=True, split_rows=2, **hp),
                dict(params=side, use_muon=False, lr=0.01, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)])
    bufs, states = [torch.zeros_like(r) for r in ref[:-2]], [{} for _ in side]
    for _ in range(4):
        grads = [torch.randn_like(r) for r in ref]
        for p, g in zip(ours + [fused] + side, grads):
            p.grad = g.clone()
        opt.step()
        for i, (r, g) in enumerate(zip(ref[:-2], grads[:-2])):
            k = 2 if i == len(ours) else 1
            u = muon_update(g, bufs[i], momentum=0.95, nesterov=True, ns_steps=5, split_rows=k)
            r.mul_(1 - 0.02 * 0.1).add_(u.float(), alpha=-adjusted_lr(0.02, (r.shape[-2] // k, r.shape[-1]), "match_rms_adamw"))
        for r, g, s in zip(ref[-2:], grads[-2:], states):
            adamw_update(r, g, s, lr=0.01, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    for p, r in zip(ours + [fused], ref[:-2]):
        assert _rel(p.data, r) <= 1e-6
    for p, r in zip(side, ref[-2:]):
        torch.testing.assert_close(p.data, r, rtol=1e-6, atol=1e-7)
    assert all(s["step"].device == p.device for p in side for s in [opt.state[p]])  # the fused kernel's counters
