"""Will it fit: per-stage memory of a recipe, without allocating it.

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
  vocab        = with the vocabulary layers shared by every stage (``vocab_parallel``): what one VOCAB pass holds
                 while it runs, one at a time: the final hidden states received (h fp32 values per token), the
                 partial gradient of them it sends back (h fp32), and its logits shard and their gradient (2 x
                 ceil(vocab / stages) fp32 values per token). The head's weight is then not on the last stage: every
                 stage holds its shard (``plan.vocab_shard_params``) with the head's weights, versions, gradients and
                 optimizer state per parameter, and the last stage keeps no logits for the loss (2 h fp32 values per
                 token for the final norm).
A tensor held on several stages (a tied head, a block shared by several layers) counts on each: ``plan.param_names``.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..config.recipe import Recipe
from ..model.build import build_config, expert_stacks
from ..model.fused_loss import use_fused_loss
from ..optim import classify_parameters
from ..partition import partition_plan
from ..partition.plan import moe_shape
from ..schedules.actions import ActionType, BACKWARDS
from ..schedules.records import ONE_F_ONE_B, Schedule, get_schedule, pipelined
from ..schedules.simulator import Costs, simulate


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
    vocab: float = 0.0

    TERMS = ("weights", "grads", "optimizer", "ef", "casts", "activations", "recompute", "transfers", "vocab", "ef_copy",
             "reducer")

    @property
    def steady(self) -> float:
        """Between steps: what every action of the step holds at the schedule's peak of in-flight microbatches."""
        return (self.weights + self.grads + self.optimizer + self.ef + self.casts + self.activations + self.recompute
                + self.transfers + self.vocab)

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
    experts, k = moe_shape(config)
    moe_i = getattr(config, "moe_intermediate_size", None) or dense_i
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
                               bf16: bool = False, fused_loss: bool = False, vocab_parallel: bool = False) -> float:
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
    if last and vocab_parallel:  # the loss is computed in the VOCAB passes; the final norm's input and output stay
        total += 4 * 2 * h
    elif last:
        total += 4 * 3 * h if fused_loss else 4 * (config.vocab_size + 2 * h) + (2 * h if bf16 else 0)
    return total


def vocab_pass_bytes_per_token(config, num_stages: int) -> float:
    """What one VOCAB pass holds per token while it runs (module doc, ``vocab``): the hidden states received and the
    partial gradient sent back (h fp32 each), the logits shard and its gradient (ceil(vocab / stages) fp32 each)."""
    h = getattr(config, "hidden_size", None) or config.n_embd
    return 4.0 * (2 * h + 2 * -(-config.vocab_size // num_stages))


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
    no autocast op's: the versions hold them in bf16 themselves, ``model.build.expert_stacks``)."""
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
                layers_per_stage: list[int] | None = None, dp: int = 1,
                vocab_parallel: bool = False) -> tuple[object, list[StageMemory], object]:
    """(partition plan, per-stage memory, simulation result of the recipe's schedule); ``dp``: data-parallel
    replicas of each stage (the reducer's buckets exist only with more than one). With a virtual-stage schedule
    (several stages per rank) ``num_stages`` counts ranks, the plan splits the model into ranks x stages_per_rank
    stages, and the memory is per rank: the parameters of all its stages, and the activations of the in-flight
    (stage, microbatch) pairs at the rank's peak, each of its own stage's size. ``vocab_parallel``: the vocabulary layers
    shared by every stage (resolved: ``plan.vocab.resolve_vocab_parallel``), one shard per rank, its VOCAB passes in
    the schedule (their deeper warm-up counts in the in-flight microbatches)."""
    p = num_stages or recipe.pipeline.num_stages
    sched = planned_schedule(recipe.pipeline.schedule)
    v = sched.stages_per_rank
    model = model or meta_model(recipe)
    if layers_per_stage is None:
        layers_per_stage = recipe.pipeline.split if p == recipe.pipeline.num_stages and v == 1 else None
    plan = partition_plan(model, p * v, layers_per_stage, seq_len=recipe.data.seq_len, vocab_parallel=vocab_parallel)
    ranks = sched.stage_ranks(p)
    m, steps = sched.representative(p, recipe.pipeline.num_microbatches)
    m = _runnable_m(sched, p, m)
    extra = recipe.pipeline.extra_warmup if sched.extra_warmup_ok else 0
    try:
        sched.check(p, m, extra)
    except ValueError:
        extra = 0  # planning another stage count than the recipe's: plain warm-up
    scope = sched.reduce_scope(recipe.training.max_grad_norm)
    sim = simulate(sched.actions(p, m, steps, extra_warmup=extra, vocab_parallel=vocab_parallel), Costs(
        forward=[s.cost for s in plan.stages], backward=[2 * s.cost for s in plan.stages],
        vocab=3 * plan.vocab_cost * v), sched, reduce_scope=scope)
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
    fused = use_fused_loss(recipe.training.fused_loss, model) and not vocab_parallel
    head = f"{plan.anatomy.head}.weight"
    head_names = {n for n in sizes if plan.anatomy.head and n.startswith(plan.anatomy.head + ".")}
    shard = {n: -(-sizes[n] // p) for n in head_names} if vocab_parallel else {}  # per rank: one shard of each
    fused_head = fused_loss_bytes_per_microbatch(model) if fused else 0.0
    out = []
    for r in range(p):
        mine = [g for g, q in enumerate(ranks) if q == r]
        # a rank holding both names of a tied pair (V placement: the embedding's and the head's stage) holds one tensor
        held = [n for g in mine for n in per_stage_names[g]]
        held = [n for n in held if not any(n == copy and first in held for first, copy in plan.tied_pairs)]
        if vocab_parallel:  # the head's rows: a shard on every rank, none whole on the last stage's
            held = [n for n in held if n not in shard] + list(shard)
        size = lambda n: shard.get(n, sizes[n])
        n_params = sum(size(n) for n in held)
        versions = sched.weight_versions(r, p)
        if opt.name == "muon":
            opt_bytes = sum(size(n) * (4 if kinds.get(n) == "muon" else 8) for n in held)
        elif opt.name in ("adamw", "nadam"):
            opt_bytes = 8 * n_params
        else:
            opt_bytes = 4 * n_params
        inflight = sim.peak_inflight[r]
        per_microbatch = {g: tokens_mb * (activation_bytes_per_token(cfg, list(plan.stages[g].layers), g == last, ckpt,
                                                                     bf16, fused and g == last, vocab_parallel)
                                          + 4 * received_values_per_token(plan.anatomy, plan.stages[g].layers, g))
                          + (fused_head if g == last else 0.0) for g in mine}
        act = peak_in_flight([iv.action for iv in sim.timeline[r]], r, per_microbatch)
        layer_ids = [i for g in mine for i in plan.stages[g].layers]
        # bf16: the linear weights are held per version in bf16 (+ their fp32 master), except one also read uncast
        # on this stage (a tied head beside its embedding), which autocast casts for each microbatch in flight
        n16 = sum(size(n) for n in held if n in cast_names)
        weights = 4.0 * (n_params - n16) * versions + (4.0 + 2.0 * versions) * n16
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
                               reducer=4.0 * n_params if dp > 1 else 0.0,
                               vocab=tokens_mb * vocab_pass_bytes_per_token(cfg, p) if vocab_parallel else 0.0))
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
