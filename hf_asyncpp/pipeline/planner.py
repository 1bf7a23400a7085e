"""Will it fit, and how fast: per-stage memory and simulated step time of a recipe, without allocating it.

Memory per stage (bytes):
  weights      = params x 4 x versions     (fp32 masters; 2 for 2BW, p - s at stage s for PipeDream, else 1)
  gradients    = params x 4 x (2 for 2BW: one step accumulating while the previous waits for its update)
  optimizer    = AdamW 8 B/param; Muon 4 B/param (momentum) on its matrices, AdamW on the rest
  EF buffer    = params x 4 when optimizer.delay_correction is error_feedback
  activations  = in-flight microbatches (from the schedule simulator) x microbatch activation bytes, where a
                 decoder layer keeps about (10 h + 2 kv + 4 I_active) values per token (I_active: the MLP width,
                 top-k x expert width for MoE) and the last stage keeps one vocab-sized value per token for the loss
                 (both calibrated against the executor's saved-tensor accounting, ``PipelineEngine.memory_report``);
                 a stage after the first adds what it receives besides the hidden state (per-layer embeddings,
                 carried layer outputs: ``received_values_per_token``).
A tensor held on several stages (a tied head, a block shared by several layers) counts on each: ``plan.param_names``.
Step time: the schedule simulator with forward cost = stage FLOPs / sustained FLOP/s, backward = 2 x forward.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..config import Recipe
from ..modeling import build_config
from ..optim import classify_parameters
from ..partition import partition_plan
from .schedules import ONE_F_ONE_B, SCHEDULES, get_schedule
from .simulator import Costs, simulate


@dataclass
class StageMemory:
    stage: int
    layers: str
    params: int
    weights: float
    grads: float
    optimizer: float
    ef: float
    activations: float
    inflight: int

    @property
    def total(self) -> float:
        return self.weights + self.grads + self.optimizer + self.ef + self.activations


def meta_model(recipe: Recipe):
    from transformers import AutoModelForCausalLM  # heavy: only when planning from a recipe

    config = build_config(recipe.model)
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config)


def activation_values_per_token(config, layer_ids: list[int], last: bool) -> float:
    h = getattr(config, "hidden_size", None) or config.n_embd
    heads = getattr(config, "num_attention_heads", None) or config.n_head
    head_dim = getattr(config, "head_dim", None) or h // heads
    kv = (getattr(config, "num_key_value_heads", None) or heads) * head_dim
    dense_i = getattr(config, "intermediate_size", None) or getattr(config, "n_inner", None) or 4 * h
    experts = getattr(config, "num_experts", None) or getattr(config, "num_local_experts", None) or getattr(config, "n_routed_experts", None)
    moe_i = getattr(config, "moe_intermediate_size", None) or dense_i
    k = getattr(config, "num_experts_per_tok", 1) or 1
    first_dense = getattr(config, "first_k_dense_replace", 0) or 0
    total = 0.0
    for i in layer_ids:
        width = dense_i if (not experts or i < first_dense) else k * moe_i + (getattr(config, "shared_expert_intermediate_size", 0) or 0)
        total += 10 * h + 2 * kv + 4 * width + (experts or 0)
    if last:
        total += config.vocab_size + 2 * h
    return total


def received_values_per_token(anatomy, layers: range, stage: int) -> float:
    """Values per token a stage receives besides the hidden state and keeps for its backward: side inputs its layers
    or later ones use (per-layer embeddings) and outputs carried from the previous layer (``anatomy.extra_values``)."""
    if stage == 0:
        return 0.0
    n_side = len(anatomy.side)
    side = sum(v for g, v in zip(anatomy.side, anatomy.extra_values[:n_side]) if max(j for j, _ in g) >= layers.start)
    return float(side + sum(anatomy.extra_values[n_side:]))


def plan_memory(recipe: Recipe, num_stages: int | None = None, model=None) -> tuple[object, list[StageMemory], object]:
    """(partition plan, per-stage memory, simulation result of the recipe's schedule)."""
    p = num_stages or recipe.pipeline.num_stages
    sched = get_schedule(recipe.pipeline.schedule) if recipe.pipeline.schedule in SCHEDULES else ONE_F_ONE_B
    model = model or meta_model(recipe)
    layers_per_stage = recipe.pipeline.layers_per_stage if p == recipe.pipeline.num_stages else None
    plan = partition_plan(model, p, layers_per_stage, seq_len=recipe.data.seq_len)
    m, steps = sched.representative(p, recipe.pipeline.num_microbatches)
    m = _runnable_m(sched, p, m)
    extra = recipe.pipeline.extra_warmup if sched.extra_warmup_ok else 0
    try:
        sched.check(p, m, extra)
    except ValueError:
        extra = 0  # planning another stage count than the recipe's: plain warm-up
    scope = sched.reduce_scope(recipe.training.max_grad_norm)
    sim = simulate(sched.actions(p, m, steps, extra_warmup=extra), Costs(
        forward=[s.cost for s in plan.stages], backward=[2 * s.cost for s in plan.stages]), sched, reduce_scope=scope)
    kinds = classify_parameters(model)
    sizes = {n: q.numel() for n, q in model.named_parameters(remove_duplicate=False)}
    # the names each stage holds: its own, plus its copies of tensors an earlier stage holds (a tied head, a block
    # shared by several layers): a copy costs weights, gradients and optimizer state on its stage too
    per_stage_names = [list(names) for names in plan.param_names]
    for first, copy in plan.tied_pairs:
        kinds.setdefault(copy, "adamw" if copy == f"{plan.anatomy.head}.weight" else kinds.get(first, "adamw"))
    opt = recipe.optimizer
    act_bytes = 2 if recipe.training.bf16 else 4
    tokens_mb = recipe.pipeline.microbatch_size * recipe.data.seq_len
    out = []
    for s, st in enumerate(plan.stages):
        n_params = sum(sizes[n] for n in per_stage_names[s])
        versions = sched.weight_versions(s, p)
        if opt.name == "muon":
            opt_bytes = sum(sizes[n] * (4 if kinds.get(n) == "muon" else 8) for n in per_stage_names[s])
        elif opt.name in ("adamw", "nadam"):
            opt_bytes = 8 * n_params
        else:
            opt_bytes = 4 * n_params
        inflight = sim.peak_inflight[s]
        act = inflight * tokens_mb * act_bytes * (activation_values_per_token(model.config, list(st.layers), s == p - 1)
                                                  + received_values_per_token(plan.anatomy, st.layers, s))
        out.append(StageMemory(s, f"{st.layers.start}-{st.layers.stop - 1}", n_params, 4.0 * n_params * versions,
                               4.0 * n_params * sched.grad_sets, float(opt_bytes),
                               4.0 * n_params if opt.delay_correction == "error_feedback" else 0.0, act, inflight))
    return plan, out, sim


def simulate_schedules(plan, recipe: Recipe, num_stages: int, flops_per_s: float) -> dict[str, object]:
    """Step time and bubble of 2bw, 1f1b and gpipe for this partition (costs from the plan's FLOPs)."""
    tokens_mb = recipe.pipeline.microbatch_size * recipe.data.seq_len
    m = max(recipe.pipeline.num_microbatches, num_stages)
    fwd = [s.cost * tokens_mb / flops_per_s for s in plan.stages]
    costs = Costs(forward=fwd, backward=[2 * f for f in fwd])
    steps = 8
    res = {}
    for name in ("2bw", "1f1b", "gpipe"):
        sched = SCHEDULES[name]
        res[name] = simulate(sched.actions(num_stages, m, steps), costs, sched)
    return res


def _runnable_m(sched, p: int, m: int) -> int:
    """The smallest microbatch count >= m that the schedule accepts on p stages (2BW: m >= p)."""
    while True:
        try:
            sched.check(p, m)
            return m
        except ValueError:
            if sched.one_update_per_microbatch or m > 4 * p:
                raise
            m += 1
