"""The planner under expert parallelism (``pipeline.expert_parallel``): the expert state per GPU divided by the
expert-parallel size and the rest unchanged, the all-to-all bytes against a count of the rows a routing sends, the
all-to-alls in the simulated step, the layout search that shards experts where whole ones do not fit, and the field
checked against the model and the replicas. Meta models only: no weights are allocated, nothing is run."""
import dataclasses

import pytest
import torch

from hf_asyncpp.cli.plan import main
from hf_asyncpp.config.recipe import recipe_from_dict, save_recipe
from hf_asyncpp.errors import RecipeError
from hf_asyncpp.plan.memory import all_to_all_bytes, expert_parameters, meta_model, plan_memory
from hf_asyncpp.plan.search import evaluate_plan, search_plans
from hf_asyncpp.schedules.actions import Action, ActionType
from hf_asyncpp.schedules.simulator import Costs

HIDDEN, EXPERTS, TOP_K = 64, 8, 2
MOE = {"model_type": "qwen3_moe", "hidden_size": HIDDEN, "intermediate_size": 128, "num_hidden_layers": 4,
       "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "num_experts": EXPERTS,
       "num_experts_per_tok": TOP_K, "moe_intermediate_size": 96, "vocab_size": 256, "max_position_embeddings": 64,
       "tie_word_embeddings": False}
DENSE = {"model_type": "llama", "hidden_size": HIDDEN, "intermediate_size": 128, "num_hidden_layers": 4,
         "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 256, "max_position_embeddings": 64}


def make_recipe(config=MOE, **pipeline):
    return recipe_from_dict({
        "model": {"config": dict(config)}, "data": {"seq_len": 32},
        "pipeline": {"schedule": "2bw", "num_stages": 2, "num_microbatches": 4, "microbatch_size": 2, **pipeline},
        "optimizer": {"name": "muon", "delay_correction": "error_feedback"},
        "training": {"bf16": True, "max_grad_norm": 1.0}})


def with_ep(recipe, ep: int, **training):
    return dataclasses.replace(recipe, pipeline=dataclasses.replace(recipe.pipeline, expert_parallel=ep),
                               training=dataclasses.replace(recipe.training, **training))


def test_expert_state_per_gpu_is_divided_by_the_expert_parallel_size():
    """Each GPU holds 1/ep of the experts' weights (fp32 master + a bf16 copy per 2BW version), gradients (2BW's two
    sets), Muon momentum, EF buffer and EF's clone; the dense state is unchanged. The reducer's buckets hold an expert
    shard's gradients only where other replicas hold the same shard (ep < replicas)."""
    recipe = make_recipe()
    model = meta_model(recipe)
    experts = expert_parameters(model)
    # independently: the experts modules' fused stacks, every layer's two; not the routers (one row per expert too)
    assert experts == {n for n, _ in model.named_parameters() if ".mlp.experts." in n}
    assert all(n.endswith(("gate_up_proj", "down_proj")) for n in experts)
    expert_sizes = {n: q.numel() for n, q in model.named_parameters() if n in experts}
    base = plan_memory(recipe, 2, model, dp=4)[1]
    # bytes per expert parameter held: weights fp32 + 2 bf16 versions, 2 gradient sets, momentum, EF, EF's clone
    per_param = {"weights": 4 + 2 * 2, "grads": 4 * 2, "optimizer": 4, "ef": 4, "ef_copy": 4}
    for ep in (2, 4):
        sharded = plan_memory(with_ep(recipe, ep), 2, model, dp=4)[1]
        for stage, (one, many) in enumerate(zip(base, sharded)):
            first, last = map(int, one.layers.split("-"))
            held = sum(size for n, size in expert_sizes.items() if first <= int(n.split(".")[2]) <= last)
            assert held > 0 and many.expert_params == one.expert_params == held
            assert many.params_per_gpu == one.params - held + held / ep
            for term, b in per_param.items():
                assert getattr(one, term) - getattr(many, term) == pytest.approx(b * held * (1 - 1 / ep)), (ep, term)
            assert many.casts == one.casts and many.transfers == one.transfers
            # replicas 4: at ep 2 each shard is on 2 replicas and reduced; at ep 4 on one, not reduced
            shard_reduced = held / ep if 4 // ep > 1 else 0.0
            assert many.reducer == pytest.approx(4 * (one.params - held + shard_reduced))
            assert one.all_to_all == 0 and many.all_to_all > 0
        # ZeRO-1 shards the dense part's optimizer and EF state over the 4 replicas; an expert shard's stays whole
        zero = dataclasses.replace(recipe, optimizer=dataclasses.replace(recipe.optimizer, shard_across_replicas=True))
        for one, many in zip(sharded, plan_memory(with_ep(zero, ep), 2, model, dp=4)[1]):
            shard = many.expert_params / ep
            assert many.optimizer == pytest.approx(4 * shard + (one.optimizer - 4 * shard) / 4)
            assert many.ef == pytest.approx(4 * shard + (one.ef - 4 * shard) / 4)


def test_the_all_to_all_bytes_are_the_rows_a_routing_sends_to_other_ranks():
    """Rank 0 of 4 routes T tokens, each to k experts spread evenly (token t picks experts t k .. t k + k - 1 modulo
    E); the rows whose expert lives on another rank (whole experts per rank, contiguous) cross the link in the
    dispatch, and their outputs cross back in the combine: fp32, h values a row, per MoE layer and pass."""
    config = meta_model(make_recipe()).config
    tokens, ep = 64, 4
    experts = torch.arange(tokens * TOP_K).reshape(tokens, TOP_K) % EXPERTS
    owner = experts // (EXPERTS // ep)
    rows_out = int((owner != 0).sum())  # rank 0 keeps the rows of its own experts
    hand = 2 * rows_out * HIDDEN * 4  # dispatch + combine
    assert rows_out == tokens * TOP_K * 3 // 4
    assert all_to_all_bytes(config, [0], tokens, ep) == hand
    assert all_to_all_bytes(config, [0, 1, 2], tokens, ep) == 3 * hand  # per MoE layer
    assert all_to_all_bytes(config, [0, 1], tokens, 1) == 0.0
    # a model whose odd layers only are MoE layers: the dense ones send nothing
    sparse = meta_model(make_recipe({**MOE, "decoder_sparse_step": 2})).config
    assert all_to_all_bytes(sparse, [0], tokens, ep) == 0.0
    assert all_to_all_bytes(sparse, [0, 1, 2, 3], tokens, ep) == 2 * hand


def test_the_all_to_alls_lengthen_f_b_and_i_and_the_replay_of_a_checkpointed_forward():
    costs = Costs(forward=1.0, backward=2.0, all_to_all=0.25)
    of = lambda c, kind: c.of(Action(kind, 0, 0, 0), 0)
    assert [of(costs, k) for k in (ActionType.F, ActionType.B, ActionType.I, ActionType.W)] == [1.25, 2.25, 1.25, 1.0]
    replayed = costs.checkpointed()  # the backward replays the forward, its all-to-alls included
    assert of(replayed, ActionType.B) == 2.0 + 1.25 + 0.25
    assert of(replayed, ActionType.W) == 1.0 + 1.25


def test_a_plan_s_step_carries_its_stages_all_to_alls_at_the_link_speed():
    """The evaluated plan's per-stage all-to-all seconds are the stage's bytes at the link speed; the expert GEMMs'
    FLOPs per rank are those of the plan without expert parallelism."""
    recipe = make_recipe()
    model = meta_model(recipe)
    link = 1e9
    one = evaluate_plan(recipe, model, 2, 2, 4, 2, None, 1e12, 1e12, link, expert_parallel=1, checkpointed=False)
    two = evaluate_plan(recipe, model, 2, 2, 4, 2, None, 1e12, 1e12, link, expert_parallel=2, checkpointed=False)
    tokens = 2 * 32
    assert two.layers_per_stage == one.layers_per_stage
    starts = [0, two.layers_per_stage[0]]
    layers = [list(range(s, s + n)) for s, n in zip(starts, two.layers_per_stage)]
    per_layer = 2 * tokens * TOP_K * HIDDEN * 4 * (2 - 1) / 2
    assert two.costs.all_to_all == pytest.approx([len(ids) * per_layer / link for ids in layers])
    assert all_to_all_bytes(model.config, layers[0], tokens, 2) == len(layers[0]) * per_layer
    assert two.costs.forward == one.costs.forward and one.costs.all_to_all == 0.0
    # each replica holds its own experts (ep = replicas): only the dense gradients are all-reduced
    assert all(a < b for a, b in zip(two.costs.reduce, one.costs.reduce))


def test_the_search_shards_the_experts_where_whole_ones_do_not_fit():
    """A cap between the sharded and the whole expert state: every layout with whole experts (ep 1) is over memory,
    and the best plan shards them and fits; at a free link and a generous cap the best keeps its activations. Two
    layers on 4 GPUs: 2 stages x 2 replicas is the one layout, so only sharding can make it fit."""
    recipe = make_recipe({**MOE, "num_hidden_layers": 2})
    model = meta_model(recipe)
    every = search_plans(recipe, 4, cap=1e12, flops_per_s=1e9, link_bytes_per_s=1e15, model=model)
    assert {c.expert_parallel for c in every} == {1, 2} and {c.checkpointed for c in every} == {False, True}
    assert not every[0].checkpointed
    whole = min(c.memory for c in every if c.expert_parallel == 1 and c.runnable)
    sharded = min(c.memory for c in every if c.expert_parallel > 1 and c.runnable)
    assert sharded < whole
    cap = (sharded + whole) / 2 / 0.9
    cands = search_plans(recipe, 4, cap=cap, flops_per_s=1e9, link_bytes_per_s=1e15, model=model)
    best = cands[0]
    assert best.feasible and best.expert_parallel > 1 and best.memory <= 0.9 * cap
    assert not any(c.feasible for c in cands if c.expert_parallel == 1)
    assert best.dp % best.expert_parallel == 0 and f"--pipeline.expert_parallel={best.expert_parallel}" in best.overrides()


def test_expert_parallel_is_checked_against_the_model_and_the_replicas(tmp_path, capsys):
    dense = make_recipe(DENSE, expert_parallel=2)
    with pytest.raises(RecipeError, match=r"^pipeline.expert_parallel: 2 shards the experts .* \(llama\) has none; "
                                          r"set pipeline.expert_parallel: 1"):
        plan_memory(dense, 2, dp=2)
    moe = make_recipe()
    with pytest.raises(RecipeError, match=r"^pipeline.expert_parallel: 2 does not divide the 3 data-parallel replica"):
        plan_memory(with_ep(moe, 2), 2, dp=3)
    with pytest.raises(RecipeError, match=r"^pipeline.expert_parallel: 3 does not divide the model's 8 experts"):
        plan_memory(with_ep(moe, 3), 2, dp=3)
    # the command: one error line naming the field
    path = tmp_path / "dense.yaml"
    save_recipe(dense, path)
    assert main([str(path), "--top", "0", "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: pipeline.expert_parallel: 2") and "\n" not in err


def test_plan_prints_the_all_to_alls_and_what_dropping_checkpointing_gains(tmp_path, capsys):
    path = tmp_path / "moe.yaml"
    save_recipe(make_recipe(expert_parallel=2), path)
    assert main([str(path), "--top", "3", "--out", str(tmp_path)]) == 0  # 4 GPUs: 2 stages x expert_parallel 2
    out = capsys.readouterr().out
    assert "experts sharded over 2 of them" in out and "expert all-to-alls (2 ranks)" in out
    assert "without activation checkpointing the fastest layout that fits" in out
