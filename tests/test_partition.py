"""Partitioned stages compute exactly what the unpartitioned model computes: loss, logits, every gradient."""
from __future__ import annotations

import gc
import weakref

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from hf_asyncpp.model.build import CAUSAL_SDPA, use_mask_free_attention
from hf_asyncpp.partition import (PartitionError, VERIFIED_MODEL_TYPES, merge_state_dicts, partition_model,
                                  partition_plan, run_stages, tied_parameters)
from support import ARCHS, BASE, MODEL_TYPE, MOE_AUX, make_config, make_model


def chain(stages, ids, labels=None):
    return run_stages(stages, ids, labels)


IDS = torch.randint(0, 128, (2, 24), generator=torch.Generator().manual_seed(1))


def test_archs_cover_the_verified_set():
    assert {MODEL_TYPE.get(a, a) for a in ARCHS} == VERIFIED_MODEL_TYPES


def check_sendable(act):
    """What crosses a stage boundary: float tensors needing grad, or integer tensors without."""
    for t in act if isinstance(act, tuple) else (act,):
        assert torch.is_tensor(t)
        assert t.requires_grad if t.is_floating_point() else (not t.requires_grad and t.dtype == torch.int64)


@pytest.mark.parametrize("arch", list(ARCHS))
def test_stages_equal_the_model(arch):
    model = make_model(arch)
    ref = model(IDS, labels=IDS)
    ref.loss.backward()
    ref_grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    with torch.no_grad():
        ref_logits = model(IDS).logits
    if ARCHS[arch].get("router_aux_loss_coef"):
        assert ref.aux_loss is not None and ref.aux_loss > 0  # the aux loss is part of what we compare
    original = {n for n, _ in model.named_parameters()}
    tied = model.get_input_embeddings().weight is model.get_output_embeddings().weight
    assert tied == ARCHS[arch].get("tie_word_embeddings", tied)  # both kinds, dense and MoE, are in ARCHS
    for p in (1, 2, 3, 4):
        model.zero_grad(set_to_none=True)
        stages = partition_model(model, p)
        plan = partition_plan(model, p)
        assert [s.layer_ids for s in stages] == [list(x.layers) for x in plan.stages]
        acts = [IDS]
        for s in stages[:-1]:
            acts.append(s(acts[-1]))
            check_sendable(acts[-1])
        loss = stages[-1](acts[-1], labels=IDS)
        torch.testing.assert_close(loss, ref.loss, rtol=1e-5, atol=1e-6, msg=f"{arch} p={p} loss")
        loss.backward()
        grads: dict[str, torch.Tensor] = {}
        for s, stage in enumerate(stages):
            names = [n for n, _ in stage.named_parameters()]
            assert sorted(names) == sorted(plan.param_names[s]), f"{arch} p={p} stage {s} names != plan"
            for n, prm in stage.named_parameters():
                assert n not in grads, f"{n} in two stages"
                assert plan.stage_of(n) == s
                grads[n] = prm.grad
        pairs = tied_parameters(stages)
        assert len(pairs) == (1 if tied and p > 1 else 0)
        for first, last in pairs:
            grads[first] = grads[first] + grads.pop(last)
        assert set(grads) == original, f"{arch} p={p}: stage parameters != model parameters"
        for n, g in ref_grads.items():
            torch.testing.assert_close(grads[n], g, rtol=1e-5, atol=1e-6, msg=f"{arch} p={p} grad {n}")
        with torch.no_grad():
            torch.testing.assert_close(chain(stages, IDS), ref_logits, rtol=1e-5, atol=1e-6, msg=f"{arch} p={p} logits")
        # merged stage state dicts load strictly into a fresh model, which then computes the same logits
        fresh = make_model(arch).eval()
        with torch.no_grad():
            for prm in fresh.parameters():
                prm.add_(1.0)
        fresh.load_state_dict(merge_state_dicts([s.state_dict() for s in stages], pairs), strict=True)
        with torch.no_grad():
            torch.testing.assert_close(fresh(IDS).logits, ref_logits, rtol=1e-5, atol=1e-6)


def send_like_the_runtime(stages, ids, labels):
    """Run stages as separate processes would: detached activations, per-stage backward with received gradients."""
    inputs, outputs = [None] * len(stages), [None] * len(stages)
    x = ids
    for s, stage in enumerate(stages):
        if s > 0:
            x = tuple(t.detach().requires_grad_(t.is_floating_point()) for t in (x if isinstance(x, tuple) else (x,)))
            inputs[s] = x
            x = x if len(x) > 1 else x[0]
        x = stage(x, labels=labels) if s == len(stages) - 1 else stage(x)
        outputs[s] = x
    loss = outputs[-1]
    loss.backward()
    for s in range(len(stages) - 2, -1, -1):
        out = outputs[s] if isinstance(outputs[s], tuple) else (outputs[s],)
        received = [t.grad if t.grad is not None else torch.zeros_like(t) for t in inputs[s + 1] if t.is_floating_point()]
        floats = [t for t in out if t.is_floating_point()]
        torch.autograd.backward(floats, received)
    return loss


@pytest.mark.parametrize("arch", ["mixtral", "qwen2_moe", "llama"])
def test_runtime_style_backward_through_the_tuple(arch):
    model = make_model(arch)
    ref = model(IDS, labels=IDS)
    ref.loss.backward()
    want = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    stages = partition_model(model, 4)
    routers = [m for s in stages for m, _ in s._routers]
    assert bool(routers) == (arch != "llama")
    hooks = [len(m._forward_hooks) for m in routers]
    loss = send_like_the_runtime(stages, IDS, IDS)
    torch.testing.assert_close(loss, ref.loss, rtol=1e-5, atol=1e-6)
    got = {n: p.grad for s in stages for n, p in s.named_parameters()}
    for first, last in tied_parameters(stages):
        got[first] = got[first] + got.pop(last)
    for n, g in want.items():
        torch.testing.assert_close(got[n], g, rtol=1e-5, atol=1e-6, msg=n)
    assert [len(m._forward_hooks) for m in routers] == hooks  # our capture hooks live only during a forward


def test_router_statistics_are_small_and_pooled():
    model = make_model("mixtral")
    ref = model(IDS, labels=IDS)
    stages = partition_model(model, 2)
    h, prob_sum, counts = stages[0](IDS)
    assert prob_sum.shape == (4,) and counts.tolist()[-1] == 2 * IDS.numel()  # 2 MoE layers x B*T rows so far
    assert counts[:-1].sum() == 2 * 2 * IDS.numel()  # top-2 of each row
    torch.testing.assert_close(stages[1]((h, prob_sum, counts), labels=IDS), ref.loss, rtol=1e-5, atol=1e-6)
    # statistics of stage 1's routers only (a per-stage aux loss) are not what transformers computes
    local = stages[1]((h, *stages[1]._aux.zeros(h.device)), labels=IDS)
    assert not torch.allclose(local, ref.loss, rtol=1e-5, atol=1e-6)


def test_tied_embeddings_have_two_copies_and_re_tie():
    model = make_model("llama")
    stages = partition_model(model, 2)
    assert tied_parameters(stages) == [("model.embed_tokens.weight", "lm_head.weight")]
    first, last = stages[0].get_parameter("model.embed_tokens.weight"), stages[1].get_parameter("lm_head.weight")
    assert first is not last and torch.equal(first, last)
    with torch.no_grad():
        last.add_(1.0)  # drifted copy: merging with the pairs takes the first stage's tensor for both names
    merged = merge_state_dicts([s.state_dict() for s in stages], tied_parameters(stages))
    assert merged["lm_head.weight"] is merged["model.embed_tokens.weight"]
    assert tied_parameters(partition_model(make_model("llama_untied"), 2)) == []
    assert tied_parameters(partition_model(model, 1)) == []
    with pytest.raises(PartitionError, match="in two stage state dicts"):
        merge_state_dicts([stages[0].state_dict(), stages[0].state_dict()])


def test_plan_balances_cost_and_names_owners():
    from transformers import AutoConfig

    model = make_model("llama_untied")
    plan = partition_plan(model, 2)
    assert sum(len(s.layers) for s in plan.stages) == 4
    assert plan.stage_of("model.embed_tokens.weight") == 0 and plan.stage_of("lm_head.weight") == 1
    assert plan.stage_of(f"model.layers.{plan.stages[1].layers.start}.mlp.up_proj.weight") == 1
    assert sum(s.params for s in plan.stages) == sum(p.numel() for p in model.parameters())
    with pytest.raises(KeyError, match="not a parameter"):
        plan.stage_of("model.layers.9.mlp.up_proj.weight")
    text = str(plan)
    assert text.splitlines()[0].split() == ["stage", "layers", "params", "GFLOP/token", "share"] and "+norm+head" in text
    # a tied plan counts the head copy on the last stage; from a config, nothing is allocated
    tied = partition_plan(make_config("llama"), 2)
    assert tied.tied and tied.stage_of("lm_head.weight") == 1 and "lm_head.weight" in tied.param_names[1]
    # a big vocabulary makes the last stage expensive: the balancer gives it fewer layers
    big_vocab = AutoConfig.for_model("llama", **{**BASE, "vocab_size": 20000, "num_hidden_layers": 8})
    sizes = [len(s.layers) for s in partition_plan(big_vocab, 2).stages]
    assert sizes[1] < sizes[0], sizes
    assert [len(s.layers) for s in partition_plan(big_vocab, 2, [2, 6]).stages] == [2, 6]


def test_bad_splits_are_clear_errors():
    model = make_model("llama")
    with pytest.raises(PartitionError, match=r"num_stages: 5 stages for 4 decoder layers; use at most 4"):
        partition_model(model, 5)
    with pytest.raises(PartitionError, match=r"num_stages: 0 must be an integer >= 1"):
        partition_plan(model, 0)
    for bad in ([1, 2], [1, 1, 2], [5, -1], [2.0, 2], [4, 0], [0, 4]):
        with pytest.raises(PartitionError, match=r"layers_per_stage: .* must have 2 positive integers summing to the 4 "
                                                 r"decoder layers \(it has \d entries summing to \d\)"):
            partition_model(model, 2, bad)
    with pytest.raises(PartitionError, match="cannot find the decoder layers"):
        partition_plan(torch.nn.Sequential(torch.nn.Linear(2, 2)), 1)
    with pytest.raises(ValueError, match="labels go to the last stage only"):
        partition_model(model, 2)[0](IDS, labels=IDS)


def test_formerly_refused_models_split_exactly_and_what_cannot_is_named():
    """Bloom's embedding layernorm, Falcon's ALiBi and MiniCPM3's scalings are the model's own code on every stage."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from hf_asyncpp.partition import check_partition

    torch.manual_seed(0)
    bloom = AutoModelForCausalLM.from_config(AutoConfig.for_model("bloom", hidden_size=32, n_layer=2, n_head=4, vocab_size=128))
    falcon = AutoModelForCausalLM.from_config(AutoConfig.for_model("falcon", hidden_size=32, num_hidden_layers=2,
                                                                   num_attention_heads=4, vocab_size=128, alibi=True))
    cfg = AutoConfig.for_model("minicpm3", **{**BASE, "num_key_value_heads": 4, "kv_lora_rank": 16, "q_lora_rank": 16,
                                              "qk_rope_head_dim": 8, "qk_nope_head_dim": 8, "v_head_dim": 8})
    minicpm = AutoModelForCausalLM.from_config(cfg)
    for model in (bloom, falcon, minicpm):
        check_partition(model, partition_model(model, 2, check=False))
    # a weight held by the module that also holds the layers cannot go to one stage: refused, naming it
    odd = make_model("llama_untied")
    odd.model.register_parameter("scale", torch.nn.Parameter(torch.ones(1)))
    with pytest.raises(PartitionError, match=r"LlamaForCausalLM: parameter model.scale sits directly on LlamaModel"):
        partition_model(odd, 2)


class _SkipOverLayers:
    """A Llama body that hands a tensor computed from its embeddings to every layer (which ignore it) and, when
    ``reread``, adds it to the last layer's output: a side input read again after the layers (Inkling-2-Loop's
    ``block_states`` at few layers)."""

    reread = True

    def forward(self, input_ids=None, **kwargs):
        from transformers.modeling_outputs import BaseModelOutputWithPast

        h = self.embed_tokens(input_ids)
        skip = 2.0 * h
        rope = self.rotary_emb(h, torch.arange(h.shape[1], device=h.device)[None])
        for layer in self.layers:
            h = layer(h, position_embeddings=rope, skip=skip)
        return BaseModelOutputWithPast(last_hidden_state=self.norm(h + skip if self.reread else h))


@pytest.mark.parametrize("reread", [True, False])
def test_a_side_input_read_after_the_layers_is_refused(reread):
    """The stages carry a side input only to the layers that take it; the last stage's own copy of it would be built
    from stand-ins (zeros), so a model that reads it after the layers is refused, naming it. The same model without
    that read splits exactly: the guard refuses the read, not side inputs."""
    from transformers.models.llama.modeling_llama import LlamaModel

    from hf_asyncpp.partition.sweep import compare

    model = make_model("llama_untied").eval()
    model.model.__class__ = type("SkipOverLayersModel", (_SkipOverLayers, LlamaModel), {"reread": reread})
    if reread:
        with pytest.raises(PartitionError, match=r"model.layers.0 receives 'skip', which the model computes before the "
                                                 r"decoder layers and reads again after the last one \(in model\)"):
            partition_model(model, 2, check=False)
        return
    ref = model(IDS, labels=IDS)
    ref.loss.backward()
    want = {n: (p.grad.clone() if p.grad is not None else None) for n, p in model.named_parameters()}
    assert compare(model, 2, IDS, ref.loss.detach(), want) is None


@pytest.mark.parametrize("arch", ["llama", "gemma2", "gemma3_text", "mixtral", "gpt2"])
def test_meta_stages_materialize(arch):
    """Plan and build on meta, ``to_empty`` each stage, load the real weights: the real model's loss and buffers."""
    from transformers import AutoModelForCausalLM

    real = make_model(arch)
    with torch.device("meta"):
        meta = AutoModelForCausalLM.from_config(real.config)
    stages = partition_model(meta, 2, [1, 3])
    assert all(p.is_meta for s in stages for p in s.parameters())
    real_stages = partition_model(real, 2, [1, 3])
    for s, rs in zip(stages, real_stages):
        s.to_empty(device="cpu")
        s.load_state_dict(rs.state_dict(), strict=True)
        want = dict(rs.named_buffers())
        for n, b in s.named_buffers():  # non-persistent buffers (rotary, embedding scale) recomputed, not garbage
            torch.testing.assert_close(b, want[n], rtol=0, atol=0, msg=n)
    torch.testing.assert_close(chain(stages, IDS, IDS), real(IDS, labels=IDS).loss, rtol=1e-5, atol=1e-6)
    stages[1].init_weights()  # training from scratch: finite, freshly drawn weights
    assert all(torch.isfinite(p).all() for p in stages[1].parameters())


@pytest.mark.parametrize("arch", ["gemma3_text", "qwen2", "gpt2"])  # MoE routing is data-dependent: no meta kernels
def test_each_stage_on_its_own_device(arch):
    """A stage moved alone (here to meta, standing in for another device) keeps nothing on the old one."""
    model = make_model(arch)
    stages = partition_model(model, 3)
    a = stages[0](IDS)
    stages[1].to("meta")
    a = stages[1](tuple(t.to("meta") for t in a) if isinstance(a, tuple) else a.to("meta"))
    assert all(t.is_meta for t in (a if isinstance(a, tuple) else (a,)))
    stages[2].to("meta")
    loss = stages[2](a, labels=IDS.to("meta"))
    assert loss.is_meta and loss.shape == ()


def test_stages_do_not_keep_the_model_alive():
    model = make_model("mixtral")
    stages = partition_model(model, 2, [1, 3])
    mine, other = weakref.ref(stages[0].get_submodule("model.layers.0")), weakref.ref(model.model.layers[3])
    whole = weakref.ref(model)
    keep = stages[0]
    del model, stages
    gc.collect()
    assert whole() is None and other() is None and mine() is not None
    assert isinstance(keep(IDS), tuple)


def test_ten_billion_parameter_plan_on_meta():
    from transformers import AutoConfig

    cfg = AutoConfig.for_model("llama", hidden_size=4096, intermediate_size=14336, num_hidden_layers=40, num_attention_heads=32,
                               num_key_value_heads=8, vocab_size=128256)
    plan = partition_plan(cfg, 8)
    assert 9e9 < sum(s.params for s in plan.stages) < 11e9
    costs = [s.cost for s in plan.stages]
    one_layer = costs[1] / len(plan.stages[1].layers)
    assert max(costs) - sum(costs) / 8 <= one_layer  # within a layer of perfect balance
    assert len(plan.stages[-1].layers) < len(plan.stages[0].layers)  # the 128k-vocabulary head weighs 2+ layers


def test_measured_costs_balance_by_time():
    """Timing one-layer stages: a head far heavier than a layer (vocab 32000, hidden 32) gets a stage of its own."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    from hf_asyncpp.partition import PartitionError
    from hf_asyncpp.plan.costs import measure_costs

    torch.manual_seed(0)
    cfg = LlamaConfig(**{**BASE, "vocab_size": 32000})
    c = measure_costs(AutoModelForCausalLM.from_config(cfg), seq_len=32, microbatch_size=4, repeats=2)
    assert len(c.layers) == 4 and all(t > 0 for t in c.layers)
    assert c.last > 3 * max(c.layers)  # 32000 x 32 logits and their softmax dwarf a 32-wide layer
    assert c.balance(2) == [3, 1] and c.balance(4) == [1, 1, 1, 1]
    secs = c.stage_seconds([3, 1])
    assert secs[0] == pytest.approx(sum(c.layers[:3]) + c.first) and secs[1] == pytest.approx(c.layers[3] + c.last)
    with pytest.raises(PartitionError, match="at least 3 decoder layers"):
        measure_costs(AutoModelForCausalLM.from_config(LlamaConfig(**{**cfg.to_dict(), "num_hidden_layers": 2})), 32, 4)


def test_measured_split_backward_feeds_the_simulator():
    """``split_backward``: F, B, I and W of every layer, timed apart; ``stage_costs`` gives the simulator a split's
    per-stage costs, the first stage with no I (the executor runs its whole backward at W), and ZB-H1 runs on them."""
    import json

    from transformers import LlamaConfig

    from hf_asyncpp.plan.costs import MeasuredCosts, measure_costs
    from hf_asyncpp.plan.costs import PASSES
    from hf_asyncpp.schedules import schedule_actions, simulate

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(LlamaConfig(**{**BASE, "num_hidden_layers": 5}))
    c = measure_costs(model, seq_len=32, microbatch_size=2, repeats=1, split_backward=True)
    assert set(c.passes) == set(PASSES)
    for name, t in c.passes.items():
        assert len(t.layers) == 5 and all(x > 0 for x in t.layers) and t.first >= 0 and t.last >= 0, name
    assert c.passes["backward_input"].first == c.passes["backward_weight"].first == 0.0
    split = c.balance(2, 4)
    assert sum(split) == 5 and min(split) >= 1
    costs = c.stage_costs(split)
    assert costs.backward_input[0] == 0.0 and costs.backward_weight[0] == costs.backward[0]
    assert costs.backward_input[1] > 0 and costs.backward_weight[1] > 0
    f, i = c.passes["forward"], c.passes["backward_input"]
    assert costs.forward == pytest.approx([sum(f.layers[:split[0]]) + f.first, sum(f.layers[split[0]:]) + f.last])
    assert costs.backward_input[1] == pytest.approx(sum(i.layers[split[0]:]) + i.last)
    zb = simulate(schedule_actions("zbh1", 2, 4, 2), costs, "zbh1")
    busy_last = sum(iv.end - iv.start for iv in zb.timeline[1])
    assert busy_last == pytest.approx(8 * (costs.forward[1] + costs.backward_input[1] + costs.backward_weight[1]))
    assert MeasuredCosts.from_dict(json.loads(json.dumps(c.to_dict()))) == c
    with pytest.raises(ValueError, match="does not split 5 layers"):
        c.stage_costs([2, 2])
    with pytest.raises(ValueError, match="split_backward=True"):
        MeasuredCosts(c.layers, c.first, c.last).stage_costs(split)


def test_the_timed_split_backward_computes_the_whole_backwards_weight_gradients():
    """What ``measure_costs`` times as I then W is the whole backward's work: the same weight gradients on a middle
    stage and on the (tied) head's stage (a W that computed nothing would time as free)."""
    from hf_asyncpp.plan.costs import _roots, _stage_input, _time_split_backward

    stages = partition_model(make_model("llama"), 4, [1] * 4, seq_len=IDS.shape[1])
    with torch.no_grad():
        received = {1: stages[0](IDS)}
        received[3] = stages[2](stages[1](received[1]))
    for s, x in received.items():
        st = stages[s]
        run = (lambda inp: st(inp, labels=IDS)) if s == 3 else st
        torch.manual_seed(1)  # the same random output gradient for both backwards
        inp, _ = _stage_input(x, s)
        torch.autograd.backward(*_roots(run(inp)))
        whole = {n: q.grad.clone() for n, q in st.named_parameters()}
        for q in st.parameters():
            q.grad = None
        torch.manual_seed(1)
        seconds = _time_split_backward(run, x, s, list(st.parameters()), torch.device("cpu"))
        assert all(t > 0 for t in seconds)
        for n, q in st.named_parameters():
            assert torch.allclose(q.grad, whole[n], atol=1e-6), (s, n)


def test_a_non_switch_aux_loss_is_the_models_own_over_all_layers():
    """Doge's product-key router loss is not the Switch loss of pooled sums: stages send the router logits so far and
    the last stage calls the model's own load_balancing_loss_func on all of them (loss and gradients exact)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from hf_asyncpp.partition.moe_aux import GatheredAux

    cfg = AutoConfig.for_model("doge", **{**BASE, "num_key_value_heads": 4}, is_moe=True, num_experts=16,
                               num_experts_per_tok=2, **MOE_AUX)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg).float().eval()
    ref = model(IDS, labels=IDS)
    assert float(ref.aux_loss.detach()) > 0
    ref.loss.backward()
    want = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    stages = partition_model(model, 3, check=False)
    assert isinstance(stages[0]._aux, GatheredAux)
    sent = stages[0](IDS)
    assert len(sent) == 1 + len(stages[0].layer_ids)  # the hidden state, then one router-logits tensor per layer so far
    loss = send_like_the_runtime(stages, IDS, IDS)
    torch.testing.assert_close(loss, ref.loss, rtol=1e-5, atol=1e-6)
    with torch.no_grad():  # the aux loss of the last stage's layers alone is not the model's
        h = stages[1](stages[0](IDS))[0]
        local = stages[2]((h, *stages[2]._aux.zeros(IDS.device)), labels=IDS)
    assert not torch.allclose(local, ref.loss, rtol=1e-5, atol=1e-6)
    got = {n: p.grad for s in stages for n, p in s.named_parameters()}
    for first, last in tied_parameters(stages):
        got[first] = got[first] + got.pop(last)
    for n, g in want.items():
        torch.testing.assert_close(got[n], g, rtol=1e-5, atol=1e-6, msg=n)


def test_a_block_shared_by_layers_is_one_copy_per_stage():
    """Zamba runs one transformer block in every hybrid layer: a later stage holds one copy of it, however many of its
    layers run it, and the copies' gradients summed are the model's."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from hf_asyncpp.partition import shared_tensors
    from hf_asyncpp.partition.sweep import compare

    cfg = AutoConfig.for_model("zamba", hidden_size=32, intermediate_size=64, num_hidden_layers=6, num_attention_heads=4,
                               num_key_value_heads=4, vocab_size=128, mamba_d_state=8,
                               layers_block_type=["hybrid", "linear_attention", "hybrid"] * 2)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg).float().eval()
    ref = model(IDS, labels=IDS)
    ref.loss.backward()
    want = {n: (p.grad.clone() if p.grad is not None else None) for n, p in model.named_parameters()}
    assert compare(model, 2, IDS, ref.loss.detach(), want) is None
    stages = partition_model(model, 2, layers_per_stage=[3, 3], check=False)
    block = [n for n, _ in model.model.layers[0].shared_transf.named_parameters()]
    assert [n for n, _ in stages[1].named_parameters() if "shared_transf" in n] == [f"model.layers.3.shared_transf.{n}" for n in block]
    shared = dict((names[0], (holders, names)) for holders, names in shared_tensors(stages))
    assert shared["model.layers.0.shared_transf.self_attn.q_proj.weight"] == (
        (0, 1), ["model.layers.0.shared_transf.self_attn.q_proj.weight", "model.layers.3.shared_transf.self_attn.q_proj.weight"])
    layers = stages[1]._shell.model.layers
    assert layers[3].shared_transf.self_attn.q_proj.weight is layers[5].shared_transf.self_attn.q_proj.weight


def test_stand_ins_follow_the_input_shape():
    """A stage's stand-in for a module another stage holds computes its output shape once per input signature:
    later calls at that shape skip the meta forward, a new batch or sequence length gets its own shape."""
    model = make_model("llama").eval()
    stages = partition_model(model, 3)
    embed = stages[1].get_submodule("model.embed_tokens")  # the middle stage's stand-in (stage 0 holds the embedding)
    assert not any(True for _ in embed.parameters())
    for shape in ((2, 24), (2, 24), (3, 7), (1, 24)):
        ids = torch.randint(0, 128, shape, generator=torch.Generator().manual_seed(sum(shape)))
        with torch.no_grad():
            torch.testing.assert_close(chain(stages, ids, ids), model(ids, labels=ids).loss, rtol=1e-5, atol=1e-6)
            assert embed(ids).shape == (*shape, 32) and not embed(ids).any()
    assert len(embed._output_shapes) == 3  # (2, 24), (3, 7), (1, 24): computed once each


def test_mask_free_attention_is_the_masked_attention_bit_for_bit():
    """``model.build`` runs plain causal SDPA under a name with no mask function (no mask built, no packed-sequence
    probe: a host sync per forward on a GPU): the same loss and gradients, bit for bit; a model whose attention needs
    its own mask (a sliding window) or an attention the recipe names keeps what it has; the exported config does not
    carry the name."""
    cases = {"llama": {}, "qwen3_moe": dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, head_dim=8),
             "mistral": dict(sliding_window=8)}
    for model_type, extra in cases.items():
        cfg = AutoConfig.for_model(model_type, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, intermediate_size=64, vocab_size=100, **extra)
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(cfg)
        ids = torch.randint(0, 100, (2, 16))
        masked = model(ids, labels=ids, use_cache=False).loss
        masked.backward()
        grads = [p.grad.clone() for p in model.parameters()]
        model.zero_grad()
        switched = use_mask_free_attention(model)
        assert switched == (model_type != "mistral"), model_type
        free = model(ids, labels=ids, use_cache=False).loss
        free.backward()
        assert torch.equal(masked, free), model_type
        assert all(torch.equal(a, p.grad) for a, p in zip(grads, model.parameters())), model_type
        assert CAUSAL_SDPA not in model.config.to_json_string()
    eager = AutoModelForCausalLM.from_config(AutoConfig.for_model("llama", hidden_size=32, num_hidden_layers=1,
                                                                  num_attention_heads=4, intermediate_size=64,
                                                                  vocab_size=100), attn_implementation="eager")
    assert not use_mask_free_attention(eager) and eager.config._attn_implementation == "eager"
