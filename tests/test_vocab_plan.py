"""The planner with the vocabulary layers shared by every stage (``pipeline.vocab_parallel``): the split, the
simulated step and imbalance, the memory per stage, the decision of ``auto``, and the measured costs' split. Every
figure is the planner's own on the recipes' meta models (FLOPs, nothing allocated), computed here both ways so each
target is held against today's figure without the sharing."""
from __future__ import annotations

import pytest

from hf_asyncpp.config.recipe import load_recipe
from hf_asyncpp.errors import RecipeError
from hf_asyncpp.partition import partition_plan
from hf_asyncpp.plan.costs import MeasuredCosts, PassSeconds
from hf_asyncpp.plan.memory import meta_model, plan_memory
from hf_asyncpp.plan.search import (PLANNED_STEPS, evaluate_plan, flops_costs, planned_microbatches, run_costs,
                                    search_plans, steady_step_time)
from hf_asyncpp.plan.vocab import decide_vocab_parallel, resolve_vocab_parallel, why_not_vocab_parallel
from hf_asyncpp.schedules.records import get_schedule
from hf_asyncpp.schedules.simulator import simulate

TFLOPS = 300e12


PAPER_LAYOUT = ["--pipeline.layers_per_stage=null", "--pipeline.num_microbatches=64", "--pipeline.microbatch_size=2",
                "--training.gradient_checkpointing=true", "--pipeline.vocab_parallel=auto"]
"""moe-10b as the targets were set on it (8 x 2, 64 microbatches of 2 x 4096, checkpointed layers), the split left to
the FLOPs model both ways: the recipe itself now runs 1 x 4096 microbatches unchecked (its comment says why)."""


@pytest.fixture(scope="module")
def moe():
    """moe-10b with its split left to the planner (each way balanced on its own)."""
    recipe = load_recipe("recipes/moe-10b.yaml", PAPER_LAYOUT)
    return recipe, meta_model(recipe)


def imbalance(recipe, model, p: int, vocab: bool, schedule: str = "2bw") -> float:
    """The 2BW imbalance ``hf-asyncpp plan`` prints: the plan's FLOPs, activation checkpointing's replay, 8 steps."""
    plan = partition_plan(model, p, seq_len=recipe.data.seq_len, vocab_parallel=vocab)
    sched = get_schedule(schedule)
    costs = run_costs(flops_costs(plan, recipe, TFLOPS), recipe)
    m = planned_microbatches(recipe, p)
    return simulate(sched.actions(p, m, PLANNED_STEPS, vocab_parallel=vocab), costs, sched).imbalance


def test_sharing_the_vocabulary_layers_splits_moe_10b_evenly_and_removes_2bws_imbalance(moe):
    """moe-10b's head and loss weigh 1.6 layers: on the last stage the layers split [4,4,4,4,4,4,5,3] and 2BW loses 16%
    of each step to the imbalance (30% on 16 stages); shared by every stage the layers split evenly and it loses at
    most 3% (5% on 16 stages)."""
    recipe, model = moe
    for p, target, today in ((8, 0.03, 0.15), (16, 0.05, 0.28)):
        shared = partition_plan(model, p, seq_len=recipe.data.seq_len, vocab_parallel=True)
        assert [len(s.layers) for s in shared.stages] == [32 // p] * p
        assert shared.vocab_cost == pytest.approx(shared.head_cost / p) and shared.head_cost > 0
        assert imbalance(recipe, model, p, True) <= target
        assert imbalance(recipe, model, p, False) >= today
    whole = partition_plan(model, 8, seq_len=recipe.data.seq_len)
    assert [len(s.layers) for s in whole.stages] == [4, 4, 4, 4, 4, 4, 5, 3] and whole.vocab_cost == 0


def test_moe_10b_2bw_steps_faster_with_the_shared_vocabulary_layers(moe):
    """The decision table's step (``python -m bench.schedules``: FLOPs at 300 TFLOP/s, steady state): 2BW on 8 stages
    x 2 replicas at most 2.95 s per step with the vocabulary layers shared, against 3.36 without."""
    recipe, model = moe
    sched = get_schedule("2bw")
    steps = {}
    for vocab in (False, True):
        plan = partition_plan(model, 8, seq_len=recipe.data.seq_len, vocab_parallel=vocab)
        steps[vocab] = steady_step_time(sched, 8, 64, flops_costs(plan, recipe, TFLOPS),
                                        sched.reduce_scope(recipe.training.max_grad_norm), vocab_parallel=vocab)[0]
    assert steps[True] <= 2.95 < 3.3 <= steps[False]


def test_memory_counts_the_shard_on_every_stage_and_the_vocab_pass_buffers(moe):
    """Shared, the head's weight is on no stage whole: every stage holds a 1/p shard (weights, versions, gradients,
    optimizer state by the head's parameter count), the last stage keeps no logits, and each stage holds one VOCAB
    pass's buffers. The fullest stage is then stage 0 (the input embedding, 3.6 GB of its terms, and the deeper
    warm-up's activations): 12% above the mean stage on 8 stages, 26% on 16 (without the sharing 19% and 33%); the
    input embedding sharded too would bring 8 stages to 5% (not done: the embedding is not in this feature)."""
    recipe, model = moe
    head = model.get_output_embeddings().weight.numel()
    for p, dp, ratio, today in ((8, 2, 1.12, 1.18), (16, 1, 1.26, 1.33)):
        whole_plan, whole, _ = plan_memory(recipe, p, model, dp=dp, vocab_parallel=False)
        plan, shared, _ = plan_memory(recipe, p, model, dp=dp, vocab_parallel=True)
        assert sum(x.params for x in shared) == pytest.approx(sum(x.params for x in whole), abs=p)
        assert shared[-1].params == plan.stages[-1].params and plan.vocab_shard_params == -(-head // p)
        assert all(x.vocab > 0 for x in shared) and all(x.vocab == 0 for x in whole)
        assert shared[-1].activations < whole[-1].activations  # no logits kept for the loss
        totals = [x.total for x in shared]
        mean = sum(totals) / p
        assert max(totals) == totals[0] and max(totals) <= ratio * mean
        whole_totals = [x.total for x in whole]
        assert max(whole_totals) >= today * sum(whole_totals) / p


def test_smollm2_keeps_its_tied_head_on_the_last_stage():
    """smollm2-360m ties its head to the embedding: ``auto`` leaves it on the last stage (``true`` is refused with
    the field named) and 2BW on 4 stages loses no more than today's 1.5% to the imbalance."""
    recipe = load_recipe("recipes/smollm2-360m.yaml")
    model = meta_model(recipe)
    on, why = decide_vocab_parallel(recipe, model, 4)
    assert not on and "tied" in why
    with pytest.raises(RecipeError, match="pipeline.vocab_parallel: true, but LlamaForCausalLM: its output layer is tied"):
        resolve_vocab_parallel(load_recipe("recipes/smollm2-360m.yaml", ["--pipeline.vocab_parallel=true"]), model, 4)
    assert imbalance(recipe, model, 4, False) <= 0.015


def test_auto_shares_moe_10bs_vocabulary_layers_and_refuses_what_cannot(moe):
    """``auto`` on moe-10b: on, with the simulated figures; a schedule updating per microbatch, or one stage: off with
    the reason; ``false`` is off."""
    recipe, model = moe
    on, why = decide_vocab_parallel(recipe, model, 8)
    assert on and why.startswith("on: 2bw on 8 stages simulates") and "s/step" in why
    assert resolve_vocab_parallel(recipe, model, 8)[0]
    off = load_recipe("recipes/moe-10b.yaml", [*PAPER_LAYOUT, "--pipeline.vocab_parallel=false"])
    assert resolve_vocab_parallel(off, model, 8) == (False, "off: pipeline.vocab_parallel is false")
    for overrides, reason in ((["--pipeline.schedule=pipedream", "--pipeline.num_microbatches=1"],
                               "updates the weights per microbatch"),
                              (["--pipeline.num_stages=1"], "one stage holds")):
        other = load_recipe("recipes/moe-10b.yaml", [*PAPER_LAYOUT, *overrides])
        assert reason in why_not_vocab_parallel(other, model)


def test_a_small_head_is_not_worth_sharing():
    """A model whose head weighs little against its layers (cpu-tiny untied with a 32-token vocabulary) gains less
    than the margin: ``auto`` leaves it off, saying by how much (with its own 4096 it gains: on)."""
    recipe = load_recipe("recipes/cpu-tiny.yaml", ["--model.config.tie_word_embeddings=false",
                                                   "--model.config.vocab_size=32", "--pipeline.num_microbatches=8"])
    on, why = decide_vocab_parallel(recipe)
    assert not on and "not more than the 2% margin" in why, why
    recipe = load_recipe("recipes/cpu-tiny.yaml", ["--model.config.tie_word_embeddings=false",
                                                   "--pipeline.num_microbatches=8"])
    assert decide_vocab_parallel(recipe)[0]


def test_measured_costs_spread_the_head_over_every_stage():
    """``layers_per_stage: auto`` and ``plan --measure`` with the vocabulary layers shared: the measured head and loss
    (2 layers' worth here) leave the last stage, the 8 equal layers split evenly, and the simulator's costs carry
    1/p of the head's forward + backward as every stage's VOCAB."""
    layers = [1.0] * 8
    passes = {"forward": PassSeconds([1 / 3] * 8, 0.0, 2 / 3), "backward": PassSeconds([2 / 3] * 8, 0.0, 4 / 3)}
    c = MeasuredCosts(layers, 0.0, 2.0, passes=passes)
    assert c.balance(4)[-1] == 1 and c.balance(4, vocab_parallel=True) == [2, 2, 2, 2]
    assert c.stage_seconds([2, 2, 2, 2], vocab_parallel=True) == pytest.approx([2.5] * 4)
    costs = c.stage_costs([2, 2, 2, 2], vocab_parallel=True)
    assert costs.vocab == pytest.approx(0.5) and costs.forward == pytest.approx([2 / 3] * 4)
    assert c.stage_costs([2, 2, 2, 2]).forward[-1] == pytest.approx(2 / 3 + 2 / 3)


def test_the_layout_search_weighs_each_layout_both_ways(moe):
    """``search_plans`` with both modes lists each layout with the vocabulary layers on the last stage and shared, and
    the overrides say which (cpu-tiny untied, 4 GPUs); moe-10b's 8 stages x 2 replicas at the link speed, the VOCABs'
    broadcast and reduce costed: faster shared, on the even split."""
    tiny = load_recipe("recipes/cpu-tiny.yaml", ["--model.config.tie_word_embeddings=false"])
    cands = search_plans(tiny, 4, 80e9, TFLOPS, 25e9, None, (False, True))
    layouts = {(c.num_stages, c.microbatch_size) for c in cands}
    for layout in layouts:
        assert {c.vocab_parallel for c in cands if (c.num_stages, c.microbatch_size) == layout} == {False, True}
    assert all(f"--pipeline.vocab_parallel={str(c.vocab_parallel).lower()}" in c.overrides() for c in cands)
    recipe, model = moe
    whole, shared = (evaluate_plan(recipe, model, 8, 2, 64, 2, None, 80e9, TFLOPS, 25e9, vocab_parallel=vocab) for vocab in (False, True))
    assert shared.layers_per_stage == [4] * 8 and whole.layers_per_stage == [4, 4, 4, 4, 4, 4, 5, 3]
    assert shared.step_s < 0.95 * whole.step_s and shared.feasible


def test_auto_keeps_the_head_on_the_last_stage_where_the_deeper_warm_up_does_not_fit(moe):
    """``auto`` on a GPU asks the memory model too: moe-10b as its recipe runs it (1 x 4096 microbatches, no activation
    checkpointing) simulates faster shared, but the VOCAB passes' deeper warm-up needs 90.9 GB on stage 0 against
    68.4 GB with the head on the last stage: off on an 80 GB GPU, on where it fits (141 GB), on without a limit."""
    _, model = moe
    recipe = load_recipe("recipes/moe-10b.yaml", ["--pipeline.layers_per_stage=null"])
    assert not recipe.training.gradient_checkpointing and recipe.pipeline.microbatch_size == 1
    on, why = decide_vocab_parallel(recipe, model, device_bytes=80e9, replicas=2)
    assert not on and "would need 90.9 GB (without: 68.4 GB)" in why, why
    assert decide_vocab_parallel(recipe, model, device_bytes=141e9, replicas=2)[0]
    assert decide_vocab_parallel(recipe, model)[0]
    assert not resolve_vocab_parallel(recipe, model, device_bytes=80e9, replicas=2)[0]
