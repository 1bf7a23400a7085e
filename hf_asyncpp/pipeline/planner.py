"""Will it fit, and how fast: per-stage memory and simulated step time of a recipe, without allocating it.

Memory per stage (bytes), one term each, as ``PipelineEngine.memory_report`` measures them (``bench/memory.py``):
  weights      = params x 4 x versions     (fp32; 2 for 2BW, p - s at stage s for PipeDream, else 1). With
                 training.bf16 the linear weights and the expert stacks are held per version in bf16 beside their
                 fp32 master (``versions.py``): 4 + 2 x versions B each, the rest 4 x versions.
  gradients    = params x 4 x (2 for 2BW: one step accumulating while the previous waits for its update)
  optimizer    = AdamW 8 B/param; Muon 4 B/param (momentum) on its matrices, AdamW on the rest
  EF buffer    = params x 4 when optimizer.delay_correction is error_feedback
  (ZeRO-1, optimizer.shard_across_replicas: the optimizer state, the EF buffer and its clone at STEP / dp)
  casts        = with training.bf16, what autocast still casts per microbatch: only a linear weight also read uncast on
                 its stage (a head tied to the embedding on one stage), 2 B x in-flight microbatches (each keeps its
                 own: the cast cache lives for one autocast region and the linear's backward keeps the copy); the
                 other linear weights and the mixture-of-experts stacks (3-D) are the versions' bf16 copies
                 (weights).
  activations  = in-flight microbatches (from the schedule simulator) x microbatch activation bytes. fp32: a decoder
                 layer keeps about (10 h + 2 kv + 4 I) values per token (I: the MLP width), a MoE layer
                 (10 h + 4 kv + 2 k h + 4 k I + E) (k experts per token of width I, E experts: each expert's input
                 and weighted output, k h, and its MLP, 4 k I). bf16 (autocast): the residual stream and the norms
                 stay fp32, the matmuls' inputs are bf16: a dense layer keeps 4 h fp32 + (7 h + 2 kv + 4 I) bf16
                 values, a MoE layer (5 h + kv + E + 10 k) fp32 + (7 h + 3 kv + 2 k h + 4 k I) bf16 (its experts
                 run in bf16: transformers casts the grouped GEMM's input to the stacks' dtype, which the versions
                 hold in bf16; 10 k: the routing's indices and weights; measured with the grouped GEMM, the default,
                 within 3%; the eager per-expert loop keeps about 14% more). The k h terms were measured per source
                 line at moe-10b's shapes on CPU and on an H100 (the same there; a 2-expert model hides them:
                 2 k h = 4 h). The last
                 stage keeps (vocab + 2 h) fp32 values per token for the loss (the logits are upcast) and h bf16
                 (calibrated against the executor's saved-tensor accounting, transformers 5.23, CPU autocast);
                 with the fused loss (``training.fused_loss``) 3 h fp32 values instead (the 2 h as before, and the
                 hidden states' gradient, computed in the forward, in place of the logits and the h bf16) and, per
                 microbatch, the head's fp32 gradient (vocab x h);
                 a stage after the first adds what it receives besides the hidden state (per-layer embeddings,
                 carried layer outputs: ``received_values_per_token``). With ``training.gradient_checkpointing``
                 a layer keeps only its input (h fp32 values per token: the residual stream), the rotary tables once,
                 plus one layer's full set and casts (``recompute``), once, while the backward recomputes it.
  transfers    = fp32 boundary tensors (h values per token; the residual stream is fp32 under autocast): the outputs
                 each in-flight microbatch keeps for its send and backward, the received output gradient, one
                 prefetched receive of each kind (``executor._receive``), the input gradient on its way back.
  at STEP      = + EF's clone of every parameter with a gradient (``optim/ef.py``: ``transient``); with data
                 parallelism + the reducer's concatenated buckets (``reducer.py``: the flat buckets hold a copy of
                 every gradient from REDUCE until the all-reduce completes, 25 MB each). ``steady`` is without
                 them, ``total`` (the peak) with them.
A tensor held on several stages (a tied head, a block shared by several layers) counts on each: ``plan.param_names``.
Step time: the schedule simulator with forward cost = stage FLOPs / sustained FLOP/s, backward = 2 x forward
(``flops_costs``), or the per-stage F, B, I, W and optimizer step timed on a device (``MeasuredCosts.stage_costs``,
``plan --measure``); the bubble in two parts that sum to it (``schedules.simulator.split_bubble``): imbalance, the idle
only unequal stages cause, and fill/drain, the schedule's own warm-up, cool-down and dependency waits. The
virtual-stage schedules (interleaved 1F1B, ZBV, DualPipeV; planner only) run on the model split into ranks x
stages_per_rank stages, each costed by its own layers (``virtual_costs``), and their memory is per rank: the
parameters of its stages, and the activations of its in-flight (stage, microbatch) pairs (``peak_in_flight``).

``search_plans``: for a number of GPUs, every stage count p dividing it (the rest data parallel), the FLOPs-balanced
split and, where p divides the layers, the even one, and every microbatch size dividing the recipe's at the same
global batch (so m = batch / (microbatch size x data-parallel degree)); each simulated in steady state with the
data-parallel all-reduce and the activation transfers costed at a stated link bandwidth, ranked by tokens/s among
those that fit in memory and that the schedule accepts. A 32-layer model on 16 stages has one 3-layer stage (the
head's stage gets 1) and a 2BW bubble of 31%; on 8 stages x 2 replicas every stage has 4 layers.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from ..config.recipe import Recipe
from ..model.build import build_config
from ..model.fused_loss import use_fused_loss
from ..optim import classify_parameters
from ..partition import partition_plan
from ..schedules.records import BACKWARDS, ONE_F_ONE_B, ActionType, Schedule, get_schedule, pipelined
from ..schedules.simulator import BubbleSplit, Costs, simulate, split_bubble
from .versions import expert_stacks


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
    casts: float = 0.0
    transfers: float = 0.0
    recompute: float = 0.0
    ef_copy: float = 0.0
    reducer: float = 0.0

    TERMS = ("weights", "grads", "optimizer", "ef", "casts", "activations", "recompute", "transfers", "ef_copy", "reducer")

    @property
    def steady(self) -> float:
        """Between steps: what every action of the step holds at the schedule's peak of in-flight microbatches."""
        return (self.weights + self.grads + self.optimizer + self.ef + self.casts + self.activations + self.recompute
                + self.transfers)

    @property
    def total(self) -> float:
        """The peak: the steady state plus what STEP (EF's clone) and REDUCE (the concatenated buckets) add."""
        return self.steady + self.ef_copy + self.reducer


def planned_schedule(name: str) -> Schedule:
    """The record a recipe's schedule is planned with: its own, or 1F1B's memory and timing for ``schedule: none``
    (one process holds what one 1F1B stage of the whole model would)."""
    return get_schedule(name) if pipelined(name) else ONE_F_ONE_B


def meta_model(recipe: Recipe):
    from transformers import AutoModelForCausalLM  # heavy: only when planning from a recipe

    config = build_config(recipe.model)
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config)


def _layer_values_per_token(config, bf16: bool = False) -> list[tuple[float, float]]:
    """(fp32, bf16) values per token each decoder layer keeps for its backward (see the module doc)."""
    h = getattr(config, "hidden_size", None) or config.n_embd
    heads = getattr(config, "num_attention_heads", None) or config.n_head
    head_dim = getattr(config, "head_dim", None) or h // heads
    kv = (getattr(config, "num_key_value_heads", None) or heads) * head_dim
    dense_i = getattr(config, "intermediate_size", None) or getattr(config, "n_inner", None) or 4 * h
    experts = getattr(config, "num_experts", None) or getattr(config, "num_local_experts", None) or getattr(config, "n_routed_experts", None)
    moe_i = getattr(config, "moe_intermediate_size", None) or dense_i
    k = getattr(config, "num_experts_per_tok", 1) or 1
    first_dense = getattr(config, "first_k_dense_replace", 0) or 0
    n = getattr(config, "num_hidden_layers", None) or config.n_layer
    step = getattr(config, "decoder_sparse_step", 1) or 1
    mlp_only = set(getattr(config, "mlp_only_layers", None) or [])
    moe = [bool(experts) and i >= first_dense and i not in mlp_only and (i + 1) % step == 0 for i in range(n)]
    shared = getattr(config, "shared_expert_intermediate_size", 0) or 0
    out = []
    for i in range(n):
        if not moe[i]:
            out.append((4 * h, 7 * h + 2 * kv + 4 * dense_i) if bf16 else (10 * h + 2 * kv + 4 * dense_i, 0))
        elif bf16:  # the experts in bf16 (the versions hold the stacks in bf16, so transformers' grouped GEMM casts
            # its input to them): the GEMMs' inputs (k h, k I) and outputs weighted (k h); the routing's indices and
            # weights, about 10 fp32 values per chosen expert (measured: tests/test_memory_plan.py)
            out.append((5 * h + kv + experts + 10 * k, 7 * h + 3 * kv + 2 * k * h + 4 * k * moe_i + 4 * shared))
        else:
            out.append((10 * h + 4 * kv + 2 * k * h + 4 * k * moe_i + 4 * shared + experts, 0))
    return out


def activation_bytes_per_token(config, layer_ids: list[int], last: bool, checkpointed: bool = False,
                               bf16: bool = False, fused_loss: bool = False) -> float:
    """Bytes per token one in-flight microbatch keeps on a stage. With activation checkpointing a layer keeps only
    its input (the fp32 hidden state, h values) and the stage the rotary tables once; the head and loss are not
    checkpointed. ``fused_loss``: the last stage keeps the hidden states' fp32 gradient in place of the logits (plus
    :func:`fused_loss_bytes_per_microbatch`)."""
    h = getattr(config, "hidden_size", None) or config.n_embd
    heads = getattr(config, "num_attention_heads", None) or config.n_head
    head_dim = getattr(config, "head_dim", None) or h // heads
    per_layer = _layer_values_per_token(config, bf16)
    if checkpointed:
        total = 4.0 * (h * len(layer_ids) + (2 * head_dim if layer_ids else 0))
    else:
        total = float(sum(4 * per_layer[i][0] + 2 * per_layer[i][1] for i in layer_ids))
    if last:
        total += 4 * 3 * h if fused_loss else 4 * (config.vocab_size + 2 * h) + (2 * h if bf16 else 0)
    return total


def fused_loss_bytes_per_microbatch(model) -> float:
    """What the fused loss keeps per in-flight microbatch whatever its tokens: the head's weight (and bias)
    gradient, fp32, computed in the forward and scaled in the backward (``model/fused_loss.py``)."""
    head = model.get_output_embeddings()
    return 4.0 * sum(q.numel() for q in head.parameters())


def activation_values_per_token(config, layer_ids: list[int], last: bool, checkpointed: bool = False) -> float:
    """fp32 values per token one in-flight microbatch keeps on a stage (``activation_bytes_per_token`` / 4)."""
    return activation_bytes_per_token(config, layer_ids, last, checkpointed) / 4


def recompute_bytes_per_token(config, layer_ids: list[int], bf16: bool = False) -> float:
    """With activation checkpointing: the one layer whose activations the backward holds at a time (recomputed)."""
    per_layer = _layer_values_per_token(config, bf16)
    return float(max((4 * per_layer[i][0] + 2 * per_layer[i][1] for i in layer_ids), default=0))


def linear_weights(model) -> set[str]:
    """Names of the weights autocast casts to bf16 for a matmul: every ``nn.Linear``'s (the experts' 3-D stacks are
    no autocast op's: the versions hold them in bf16 themselves, ``versions.expert_stacks``)."""
    return {f"{name}.{t}" for name, mod in model.named_modules(remove_duplicate=False)
            if isinstance(mod, torch.nn.Linear) for t in ("weight", "bias") if getattr(mod, t, None) is not None}


def received_values_per_token(anatomy, layers: range, stage: int) -> float:
    """Values per token a stage receives besides the hidden state and keeps for its backward: side inputs its layers
    or later ones use (per-layer embeddings) and outputs carried from the previous layer (``anatomy.extra_values``)."""
    if stage == 0:
        return 0.0
    n_side = len(anatomy.side)
    side = sum(v for g, v in zip(anatomy.side, anatomy.extra_values[:n_side]) if max(j for j, _ in g) >= layers.start)
    return float(side + sum(anatomy.extra_values[n_side:]))


def plan_memory(recipe: Recipe, num_stages: int | None = None, model=None,
                layers_per_stage: list[int] | None = None, dp: int = 1) -> tuple[object, list[StageMemory], object]:
    """(partition plan, per-stage memory, simulation result of the recipe's schedule); ``dp``: data-parallel
    replicas of each stage (the reducer's buckets exist only with more than one). With a virtual-stage schedule
    (several stages per rank) ``num_stages`` counts ranks, the plan splits the model into ranks x stages_per_rank
    stages, and the memory is per rank: the parameters of all its stages, and the activations of the in-flight
    (stage, microbatch) pairs at the rank's peak, each of its own stage's size."""
    p = num_stages or recipe.pipeline.num_stages
    sched = planned_schedule(recipe.pipeline.schedule)
    v = sched.stages_per_rank
    model = model or meta_model(recipe)
    if layers_per_stage is None:
        layers_per_stage = recipe.pipeline.split if p == recipe.pipeline.num_stages and v == 1 else None
    plan = partition_plan(model, p * v, layers_per_stage, seq_len=recipe.data.seq_len)
    ranks = sched.stage_ranks(p)
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
    bf16, ckpt = recipe.training.bf16, recipe.training.gradient_checkpointing
    tokens_mb = recipe.pipeline.microbatch_size * recipe.data.seq_len
    cfg = model.config
    h = getattr(cfg, "hidden_size", None) or cfg.n_embd
    cast_names = (linear_weights(model) | expert_stacks(model)) if bf16 else set()
    last = len(plan.stages) - 1
    fused = use_fused_loss(recipe.training.fused_loss, model)
    fused_head = fused_loss_bytes_per_microbatch(model) if fused else 0.0
    out = []
    for r in range(p):
        mine = [g for g, q in enumerate(ranks) if q == r]
        # a rank holding both names of a tied pair (V placement: the embedding's and the head's stage) holds one tensor
        held = [n for g in mine for n in per_stage_names[g]]
        held = [n for n in held if not any(n == copy and first in held for first, copy in plan.tied_pairs)]
        n_params = sum(sizes[n] for n in held)
        versions = sched.weight_versions(r, p)
        if opt.name == "muon":
            opt_bytes = sum(sizes[n] * (4 if kinds.get(n) == "muon" else 8) for n in held)
        elif opt.name in ("adamw", "nadam"):
            opt_bytes = 8 * n_params
        else:
            opt_bytes = 4 * n_params
        inflight = sim.peak_inflight[r]
        per_microbatch = {g: tokens_mb * (activation_bytes_per_token(cfg, list(plan.stages[g].layers), g == last, ckpt,
                                                                     bf16, fused and g == last)
                                          + 4 * received_values_per_token(plan.anatomy, plan.stages[g].layers, g))
                          + (fused_head if g == last else 0.0) for g in mine}
        act = peak_in_flight([iv.action for iv in sim.timeline[r]], r, per_microbatch)
        layer_ids = [i for g in mine for i in plan.stages[g].layers]
        # bf16: the linear weights are held per version in bf16 (+ their fp32 master), except one also read uncast
        # on this stage (a tied head beside its embedding), which autocast casts for each microbatch in flight
        n16 = sum(sizes[n] for n in held if n in cast_names)
        weights = 4.0 * (n_params - n16) * versions + (4.0 + 2.0 * versions) * n16
        head = f"{plan.anatomy.head}.weight"
        # (the fused loss keeps no cast for the backward: the weight's gradient is computed in the forward)
        casts = inflight * 2.0 * sizes[head] if bf16 and not fused and tied_here(plan, ranks, r) and head in sizes else 0.0
        recompute = tokens_mb * recompute_bytes_per_token(cfg, layer_ids, bf16) if ckpt else 0.0
        # fp32 boundary tensors: outputs kept per in-flight microbatch + the received output gradient + one
        # prefetched receive of each kind + the input gradient on its way back (a stage next to one on the same
        # rank hands over in memory)
        boundary = 4.0 * tokens_mb * h
        sends = any(g < last and ranks[g + 1] != r for g in mine)
        receives = any(g > 0 and ranks[g - 1] != r for g in mine)
        transfers = boundary * ((inflight + 2 if sends else 0) + (2 if receives else 0))
        ef = 4.0 * n_params if opt.delay_correction == "error_feedback" else 0.0
        if opt.shard_across_replicas and dp > 1:  # ZeRO-1: a replica keeps (and steps) about 1/dp of the tensors
            opt_bytes, ef = opt_bytes / dp, ef / dp
        layers = ",".join(f"{plan.stages[g].layers.start}-{plan.stages[g].layers.stop - 1}" for g in mine)
        out.append(StageMemory(r, layers, n_params, weights, 4.0 * n_params * sched.grad_sets, float(opt_bytes), ef,
                               act, inflight, casts=casts, transfers=transfers, recompute=recompute, ef_copy=ef,
                               reducer=4.0 * n_params if dp > 1 else 0.0))
    return plan, out, sim


def peak_in_flight(actions, rank: int, per_microbatch: dict[int, float]) -> float:
    """The most activation memory a rank holds at once, walking its actions in order: a forward at stage g adds
    ``per_microbatch[g]``, the B or W that completes its backward frees it (with one stage per rank: the peak of
    in-flight microbatches times one microbatch's)."""
    held = peak = 0.0
    for a in actions:
        g = rank if a.stage is None else a.stage
        if a.type == ActionType.F:
            held += per_microbatch[g]
            peak = max(peak, held)
        elif a.type in BACKWARDS:
            held -= per_microbatch[g]
    return peak


def tied_here(plan, ranks: list[int], rank: int) -> bool:
    """Whether an output head sharing the embedding's weight runs on the embedding's rank (one stage, or V placement:
    the first and the last stage on rank 0): its weight is read uncast by the lookup and cast by autocast for the
    head in each microbatch."""
    return bool(plan.tied) and ranks[0] == ranks[-1] == rank


DELAYED_STEP_WORTH = {("muon", "none"): 0.92, ("muon", "error_feedback"): 1.0,
                      ("adamw", "none"): 0.75, ("adamw", "error_feedback"): 0.88}
"""What a 2BW step (a gradient one step old) is worth in synchronous steps, by (optimizer, delay correction): the
synchronous steps that reach the delayed arm's final loss over the delayed arm's steps, read off the paper-regime
study's ladders of synchronous runs, each seed on its own (docs/benchmarks/quality.md, "effective steps (R4)": 20
tokens per parameter, 3 seeds, ``python -m bench.paper_regime``; Muon + EF reached the synchronous loss itself: 1.0).
A measured property of small dense runs, not a law: the planner names it wherever it uses it."""
STEP_WORTH_SOURCE = "the paper-regime study, docs/benchmarks/quality.md"


def step_worth(schedule: Schedule, optimizer) -> float | None:
    """A step of ``schedule`` in synchronous steps for ``optimizer`` (the recipe's section): 1 for a synchronous
    schedule, ``DELAYED_STEP_WORTH`` for 2BW, None where nothing was measured (another optimizer, PipeDream)."""
    if schedule.synchronous:
        return 1.0
    if schedule.name != "2bw":
        return None
    return DELAYED_STEP_WORTH.get((optimizer.name, optimizer.delay_correction))


PLANNED_SCHEDULES = ("2bw", "1f1b", "zbh1", "gpipe", "interleaved1f1b", "zbv", "dualpipev")
"""The schedules the plan compares, each simulated on the same model's costs (the virtual-stage ones, several stages
per rank, on a finer split of it: ``virtual_costs``) where it fits (``why_not_planned``)."""
PLANNED_STEPS = 8
"""Steps of the window each planned schedule is simulated over (a flushed schedule pays its fill and drain each)."""


def flops_costs(plan, recipe: Recipe, flops_per_s: float) -> Costs:
    """Per-stage costs from the partition's FLOPs: forward = FLOPs / ``flops_per_s``, backward = 2 x forward; ZB-H1's
    I and W half a backward each, the split the zero-bubble paper measured (``MeasuredCosts.stage_costs`` times
    them all instead)."""
    tokens_mb = recipe.pipeline.microbatch_size * recipe.data.seq_len
    fwd = [s.cost * tokens_mb / flops_per_s for s in plan.stages]
    return Costs(forward=fwd, backward=[2 * f for f in fwd])


def schedule_memory(recipe: Recipe, schedule: str, num_stages: int, model=None, dp: int = 1) -> list[StageMemory]:
    """``plan_memory`` of ``recipe`` run with ``schedule`` instead of its own (per rank for a virtual-stage one)."""
    r = dataclasses.replace(recipe, pipeline=dataclasses.replace(recipe.pipeline, schedule=schedule))
    return plan_memory(r, num_stages, model, dp=dp)[1]


def planned_microbatches(recipe: Recipe, num_stages: int) -> int:
    """The microbatches per step every planned schedule is compared at: the recipe's, at least one per rank."""
    return max(recipe.pipeline.num_microbatches, num_stages)


def why_not_planned(sched: Schedule, num_layers: int, num_stages: int, num_microbatches: int) -> str | None:
    """Why ``sched`` cannot run a model of ``num_layers`` layers on ``num_stages`` ranks at ``num_microbatches``
    per step (None: it can): each of its ranks x stages_per_rank stages needs a layer, and the schedule's own
    constraints (interleaved: m a multiple of its rounds; DualPipeV: m >= 2p)."""
    stages = num_stages * sched.stages_per_rank
    if stages > num_layers:
        return f"needs {stages} stages of at least one layer; the model has {num_layers} layers"
    try:
        sched.check(num_stages, num_microbatches)
    except ValueError as e:
        return str(e)
    return None


def virtual_costs(sched: Schedule, recipe: Recipe, num_stages: int, model=None, flops_per_s: float | None = None,
                  measured=None) -> Costs:
    """The simulator's costs for a schedule whose ranks hold several stages: the model split into num_stages x
    stages_per_rank stages, each costed by its own layers -- ``measured`` per-layer seconds (``MeasuredCosts``,
    the split balanced by them), else the FLOPs of the balanced ``partition_plan`` of ``model`` at
    ``flops_per_s`` -- and the optimizer step per rank, the sum of its stages' (``Costs.per_rank``)."""
    stages = num_stages * sched.stages_per_rank
    if measured is not None:
        costs = measured.stage_costs(measured.balance(stages, planned_microbatches(recipe, num_stages)))
    elif model is not None and flops_per_s is not None:
        costs = flops_costs(partition_plan(model, stages, seq_len=recipe.data.seq_len), recipe, flops_per_s)
    else:
        raise ValueError("virtual_costs needs measured per-layer costs, or a model and flops_per_s")
    return costs.per_rank(sched.stage_ranks(num_stages))


def simulate_schedules(plan, recipe: Recipe, num_stages: int, flops_per_s: float | None = None,
                       costs: Costs | None = None, model=None, measured=None) -> dict[str, object]:
    """``PLANNED_SCHEDULES`` over ``PLANNED_STEPS`` steps on the same model's costs: ``costs`` (e.g. measured per
    stage, ``MeasuredCosts.stage_costs``) or the plan's FLOPs at ``flops_per_s`` (``flops_costs``). The virtual-stage
    schedules run where they fit (``why_not_planned``) and their costs can be had (``virtual_costs``: ``measured``, or
    ``model`` with ``flops_per_s``); the others are left out. Each result's bubble comes split into fill/drain and
    imbalance (``SimResult.fill_drain``, ``SimResult.imbalance``); ``peak_inflight`` per rank."""
    if costs is None:
        if flops_per_s is None:
            raise ValueError("simulate_schedules needs costs or flops_per_s")
        costs = flops_costs(plan, recipe, flops_per_s)
    m = planned_microbatches(recipe, num_stages)
    res = {}
    for name in PLANNED_SCHEDULES:
        sched = get_schedule(name)
        if sched.stages_per_rank == 1:
            res[name] = simulate(sched.actions(num_stages, m, PLANNED_STEPS), costs, sched)
        elif (measured is not None or model is not None) and why_not_planned(sched, plan.num_layers, num_stages, m) is None:
            finer = virtual_costs(sched, recipe, num_stages, model, flops_per_s, measured)
            res[name] = simulate(sched.actions(num_stages, m, PLANNED_STEPS), finer, sched)
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


# ---------------------------------------------------------------------------- search


@dataclass
class Candidate:
    """One way to run the recipe on the GPUs given, simulated."""

    num_stages: int
    dp: int
    num_microbatches: int
    microbatch_size: int
    layers_per_stage: list[int]
    step_s: float
    """Steady-state seconds per step (``nan`` where the schedule does not accept (p, m))."""
    bubble: float
    memory: float
    """Bytes on the fullest GPU."""
    fits: bool
    runnable: bool
    tokens_per_s: float
    costs: Costs | None = None
    """What it was simulated with (None where it could not run)."""
    imbalance: float = float("nan")
    """The bubble's part due to unequal stages (``split_bubble``); the rest is fill/drain and dependency waits."""

    @property
    def feasible(self) -> bool:
        return self.fits and self.runnable

    def overrides(self) -> str:
        return (f"--pipeline.num_stages={self.num_stages} --pipeline.num_microbatches={self.num_microbatches} "
                f"--pipeline.microbatch_size={self.microbatch_size} "
                f"--pipeline.layers_per_stage=[{','.join(map(str, self.layers_per_stage))}]")


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def steady_state(sched, p: int, m: int, costs: Costs, scope: str, extra: int = 0, **sim) -> tuple[float, BubbleSplit]:
    """(seconds per step, bubble split into fill/drain and imbalance) in steady state: the difference of a 4-step
    and a 2-step window, so the fill and drain of a window (paid once per drain point, not per step) do not count
    against an asynchronous schedule. ``sim``: further ``simulate`` options (``reduce_on_compute_stream``, ``nccl``)."""
    short = simulate(sched.actions(p, m, 2, extra_warmup=extra), costs, sched, reduce_scope=scope, **sim)
    long = simulate(sched.actions(p, m, 4, extra_warmup=extra), costs, sched, reduce_scope=scope, **sim)
    step = (long.makespan - short.makespan) / 2
    busy = [b_long - b_short for b_long, b_short in zip(long.busy, short.busy)]
    return step, split_bubble(busy, 2 * step)


def steady_step_time(sched, p: int, m: int, costs: Costs, scope: str, extra: int = 0, **sim) -> tuple[float, float]:
    """(seconds per step, bubble) in steady state (``steady_state`` without the bubble's split)."""
    step, bubble = steady_state(sched, p, m, costs, scope, extra, **sim)
    return step, bubble.total


def evaluate_plan(recipe: Recipe, model, p: int, dp: int, m: int, mbs: int, split: list[int] | None, cap: float,
                  flops_per_s: float, link_bytes_per_s: float) -> Candidate:
    """Memory and steady-state speed of one (stages, replicas, microbatches, microbatch size, split)."""
    rp = dataclasses.replace(recipe.pipeline, num_stages=p, num_microbatches=m, microbatch_size=mbs,
                             layers_per_stage=split, extra_warmup=0)
    r = dataclasses.replace(recipe, pipeline=rp)
    sched = planned_schedule(rp.schedule)
    plan, mem, _ = plan_memory(r, p, model, split, dp=dp)
    sizes = [len(st.layers) for st in plan.stages]
    worst = max(x.total for x in mem)
    tokens_mb = mbs * recipe.data.seq_len
    try:
        sched.check(p, m)
    except ValueError:
        return Candidate(p, dp, m, mbs, sizes, float("nan"), float("nan"), worst, worst <= 0.9 * cap, False, 0.0)
    fwd = [st.cost * tokens_mb / flops_per_s for st in plan.stages]
    # ring all-reduce of the fp32 gradients among the dp replicas of a stage; activations of a microbatch between stages
    reduce = [2 * (dp - 1) / dp * 4 * x.params / link_bytes_per_s for x in mem]
    h = getattr(model.config, "hidden_size", None) or model.config.n_embd
    comm = tokens_mb * h * 4 / link_bytes_per_s  # the boundary tensor is the fp32 residual stream, bf16 or not
    costs = Costs(forward=fwd, backward=[2 * f for f in fwd], reduce=reduce, comm=comm)
    step, bubble = steady_state(sched, p, m, costs, sched.reduce_scope(recipe.training.max_grad_norm))
    tokens = m * tokens_mb * dp
    return Candidate(p, dp, m, mbs, sizes, step, bubble.total, worst, worst <= 0.9 * cap, True, tokens / step, costs,
                     imbalance=bubble.imbalance)


def reduction_stall(recipe: Recipe, c: Candidate) -> float:
    """Seconds per step the plan loses waiting for gradient reductions: its step time against the same plan with
    free reductions. 2BW hides a reduction behind m - p + 1 forward/backward pairs of stage 0; a synchronous
    schedule behind nothing (its STEP follows the step's last backward)."""
    sched = planned_schedule(recipe.pipeline.schedule)
    free = dataclasses.replace(c.costs, reduce=0.0)
    step, _ = steady_step_time(sched, c.num_stages, c.num_microbatches, free, sched.reduce_scope(recipe.training.max_grad_norm))
    return max(0.0, round(c.step_s - step, 9))  # float noise of the two simulations is no stall


def search_plans(recipe: Recipe, gpus: int, cap: float, flops_per_s: float, link_bytes_per_s: float,
                 model=None) -> list[Candidate]:
    """Every plan for ``gpus`` GPUs at the recipe's global batch, best first: feasible ones (fits in 90% of
    ``cap``, schedule accepts m) by simulated tokens/s, then the rest by tokens/s.

    The global batch (sequences per step) is the recipe's ``num_microbatches x microbatch_size`` times the
    data-parallel degree the recipe implies on these GPUs (``gpus / num_stages``), so every candidate trains the same
    model on the same batches; only how the work is laid out changes.
    """
    model = model or meta_model(recipe)
    rp = recipe.pipeline
    L = model.config.num_hidden_layers
    batch = rp.num_microbatches * rp.microbatch_size * max(1, gpus // rp.num_stages)
    out = []
    for p in _divisors(gpus):
        if p < 2 or p > L:
            continue
        dp = gpus // p
        splits = [None] + ([[L // p] * p] if L % p == 0 else [])
        for mbs in _divisors(rp.microbatch_size):
            if batch % (mbs * dp):
                continue
            m = batch // (mbs * dp)
            seen = set()
            for split in splits:
                c = evaluate_plan(recipe, model, p, dp, m, mbs, split, cap, flops_per_s, link_bytes_per_s)
                if tuple(c.layers_per_stage) not in seen:
                    seen.add(tuple(c.layers_per_stage))
                    out.append(c)
    # ties (to 6 digits: float noise of the simulation) go to the larger microbatch, whose kernels run faster
    return sorted(out, key=lambda c: (not c.feasible, -float(f"{c.tokens_per_s:.6g}"), -c.microbatch_size))
