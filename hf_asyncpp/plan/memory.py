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

Expert parallelism (``pipeline.expert_parallel`` = ep > 1): each GPU holds 1/ep of every MoE layer's experts
(``expert_parameters``: the fused stacks and per-expert biases; the router and the rest stay whole), so the expert
part of weights, versions, bf16 copies, gradients, optimizer and EF state, and EF's clone is divided by ep. ZeRO-1
shards only the replicated (dense) part over the replicas; the reducer's buckets hold the expert gradients only where
ep < replicas (reduced among the dp / ep replicas holding the same shard). Activations: a rank runs its experts on
about ep x its tokens / ep, so the expert inputs it keeps are those of the dense run; what differs is the routing
weights' product, applied on the token's own rank after the combine (transformers' ``AllToAllEP._combine_tokens``):
it keeps the combined expert outputs, k h fp32 values per token, where the grouped GEMM without EP keeps its bf16
output: 2 k h bytes more per token (measured with transformers' ``AllToAllEP`` on 2 ranks: 282 B against 256 at
k = 2, h = 64, the rest the dispatch's index tensors; ``tests/test_expert_parallel_memory.py``). ``all_to_all``: the buffers of the one all-to-all running at a time
(dispatch or combine, forward or backward: the same size), in and out, tokens x k x h each in the dtype of the
experts' input, fp32 (the norm's output; the grouped GEMM casts to bf16 after the dispatch and back before the
combine: ``all_to_all_values``).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..config.recipe import Recipe
from ..errors import RecipeError
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
    all_to_all: float = 0.0
    vocab: float = 0.0
    expert_params: int = 0
    """Of ``params``, the MoE layers' expert tensors (``expert_parameters``), whole; a GPU holds 1/expert_parallel."""
    expert_parallel: int = 1

    TERMS = ("weights", "grads", "optimizer", "ef", "casts", "activations", "recompute", "transfers", "all_to_all",
             "vocab", "ef_copy", "reducer")

    @property
    def params_per_gpu(self) -> float:
        """Parameters one GPU of the stage holds: the dense ones and its shard of the experts."""
        return self.params - self.expert_params + self.expert_params / self.expert_parallel

    @property
    def steady(self) -> float:
        """Between steps: what every action of the step holds at the schedule's peak of in-flight microbatches."""
        return (self.weights + self.grads + self.optimizer + self.ef + self.casts + self.activations + self.recompute
                + self.transfers + self.all_to_all + self.vocab)

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


def moe_layers(config) -> list[bool]:
    """Per decoder layer, whether it is a mixture-of-experts layer, by the families' config fields (DeepSeek's first
    dense layers, Qwen's ``decoder_sparse_step`` and ``mlp_only_layers``)."""
    experts, _ = moe_shape(config)
    first_dense = getattr(config, "first_k_dense_replace", 0) or 0
    n = getattr(config, "num_hidden_layers", None) or config.n_layer
    step = getattr(config, "decoder_sparse_step", 1) or 1
    mlp_only = set(getattr(config, "mlp_only_layers", None) or [])
    return [bool(experts) and i >= first_dense and i not in mlp_only and (i + 1) % step == 0 for i in range(n)]


def _layer_values_per_token(config, bf16: bool = False, expert_parallel: int = 1) -> list[tuple[float, float]]:
    """(fp32, bf16) values per token each decoder layer keeps for its backward (see the module doc)."""
    h = getattr(config, "hidden_size", None) or config.n_embd
    heads = getattr(config, "num_attention_heads", None) or config.n_head
    head_dim = getattr(config, "head_dim", None) or h // heads
    kv = (getattr(config, "num_key_value_heads", None) or heads) * head_dim
    dense_i = getattr(config, "intermediate_size", None) or getattr(config, "n_inner", None) or 4 * h
    experts, k = moe_shape(config)
    moe_i = getattr(config, "moe_intermediate_size", None) or dense_i
    moe = moe_layers(config)
    shared = getattr(config, "shared_expert_intermediate_size", 0) or 0
    # with expert parallelism the routing weights multiply the combined fp32 expert outputs on the token's rank
    # (kept: k h fp32) instead of the grouped GEMM's bf16 output on the expert's (no longer kept: unit weights)
    combined = k * h if bf16 and expert_parallel > 1 else 0
    out = []
    for i in range(len(moe)):
        if not moe[i]:
            out.append((4 * h, 7 * h + 2 * kv + 4 * dense_i) if bf16 else (10 * h + 2 * kv + 4 * dense_i, 0))
        elif bf16:  # the experts in bf16 (the versions hold the stacks in bf16, so transformers' grouped GEMM casts
            # its input to them): the GEMMs' inputs (k h, k I) and outputs weighted (k h); the routing's indices and
            # weights, about 10 fp32 values per chosen expert (measured: tests/test_memory_plan.py)
            out.append((5 * h + kv + experts + 10 * k + combined,
                        7 * h + 3 * kv + 2 * k * h + 4 * k * moe_i + 4 * shared - combined))
        else:
            out.append((10 * h + 4 * kv + 2 * k * h + 4 * k * moe_i + 4 * shared + experts, 0))
    return out


def all_to_all_values(config, layer_ids) -> float:
    """Values per token one all-to-all of an expert-parallel MoE layer moves (dispatch or combine, each way: a rank
    sends all its tokens' k copies, of which the (ep - 1) / ep bound for other ranks cross the link): k x h where
    ``layer_ids`` hold a MoE layer, else 0."""
    h = getattr(config, "hidden_size", None) or config.n_embd
    _, k = moe_shape(config)
    moe = moe_layers(config)
    return float(k * h) if any(moe[i] for i in layer_ids) else 0.0


ALL_TO_ALL_DTYPE_BYTES = 4
"""Bytes per value the expert all-to-alls move: the experts module's input is the post-attention norm's output, fp32
under autocast as the residual stream is (transformers' grouped GEMM casts it to the stacks' bf16 after the
dispatch and its output back to the input's dtype before the combine)."""


def all_to_all_bytes(config, layer_ids, tokens: int, expert_parallel: int) -> float:
    """Bytes one rank sends to the other ranks of its expert-parallel group per microbatch and pass through the MoE
    layers among ``layer_ids`` (and receives as many, the routing even): a dispatch and a combine per layer, each
    tokens x k x h values of which (ep - 1) / ep go to other ranks. The backward moves the same bytes again (the
    gradients of both, in the opposite direction). 0 without expert parallelism."""
    if expert_parallel <= 1:
        return 0.0
    moe = moe_layers(config)
    n_moe = sum(1 for i in layer_ids if moe[i])
    per_layer = 2 * tokens * all_to_all_values(config, layer_ids) * ALL_TO_ALL_DTYPE_BYTES
    return n_moe * per_layer * (expert_parallel - 1) / expert_parallel


def expert_parameters(model) -> set[str]:
    """Names of the parameters expert parallelism shards (dim 0, whole experts per rank): each experts module's
    tensors indexed by expert, its stacks (``expert_stacks``) and per-expert biases. A router's weight, one row per
    expert too, is not among them: every rank routes its own tokens over all experts."""
    owners = {name.rpartition(".")[0] for name in expert_stacks(model)}
    return {name for name, q in model.named_parameters(remove_duplicate=False)
            if name.rpartition(".")[0] in owners
            and q.shape[0] == model.get_submodule(name.rpartition(".")[0]).num_experts}


def check_expert_parallel(expert_parallel: int, replicas: int, config) -> None:
    """``pipeline.expert_parallel`` against the model and the layout: the model has experts, and the size divides
    both the replicas of a stage (the ranks it shards over) and each MoE layer's experts (whole experts per rank)."""
    if expert_parallel == 1:
        return
    experts, _ = moe_shape(config)
    field = f"pipeline.expert_parallel: {expert_parallel}"
    if not experts:
        raise RecipeError(f"{field} shards the experts of mixture-of-experts layers, and this model "
                          f"({getattr(config, 'model_type', 'dense')}) has none; set pipeline.expert_parallel: 1")
    if replicas % expert_parallel:
        fits = [d for d in range(1, replicas + 1) if replicas % d == 0 and experts % d == 0]
        raise RecipeError(f"{field} does not divide the {replicas} data-parallel replica(s) of each stage it shards "
                          f"the experts over; use one of {fits}, or run on a multiple of {expert_parallel} replicas")
    if experts % expert_parallel:
        fits = [d for d in range(1, replicas + 1) if replicas % d == 0 and experts % d == 0]
        raise RecipeError(f"{field} does not divide the model's {experts} experts per layer (each rank holds whole "
                          f"experts); use one of {fits}")


def activation_bytes_per_token(config, layer_ids: list[int], last: bool, checkpointed: bool = False,
                               bf16: bool = False, fused_loss: bool = False, expert_parallel: int = 1,
                               vocab_parallel: bool = False) -> float:
    """Bytes per token one in-flight microbatch keeps on a stage. With activation checkpointing a layer keeps only
    its input (the fp32 hidden state, h values) and the stage the rotary tables once; the head and loss are not
    checkpointed. ``fused_loss``: the last stage keeps the hidden states' fp32 gradient in place of the logits (plus
    :func:`fused_loss_bytes_per_microbatch`)."""
    h = getattr(config, "hidden_size", None) or config.n_embd
    heads = getattr(config, "num_attention_heads", None) or config.n_head
    head_dim = getattr(config, "head_dim", None) or h // heads
    per_layer = _layer_values_per_token(config, bf16, expert_parallel)
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


def recompute_bytes_per_token(config, layer_ids: list[int], bf16: bool = False, expert_parallel: int = 1) -> float:
    """With activation checkpointing: the one layer whose activations the backward holds at a time (recomputed)."""
    per_layer = _layer_values_per_token(config, bf16, expert_parallel)
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
    (stage, microbatch) pairs at the rank's peak, each of its own stage's size. ``pipeline.expert_parallel``
    (checked against ``dp`` and the model: ``check_expert_parallel``) shards the experts' state (module doc).
    ``vocab_parallel``: the vocabulary layers shared by every stage, one shard per rank, its VOCAB passes in the
    schedule (their deeper warm-up counts in the in-flight microbatches): what the recipe runs is
    ``plan.vocab.resolve_vocab_parallel``'s answer, the executor's (the caller asks it: that module plans with this
    one)."""
    p = num_stages or recipe.pipeline.num_stages
    sched = planned_schedule(recipe.pipeline.schedule)
    v = sched.stages_per_rank
    model = model or meta_model(recipe)
    ep = recipe.pipeline.expert_parallel
    check_expert_parallel(ep, dp, model.config)
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
    experts = expert_parameters(model)
    sharded = experts if ep > 1 else set()
    local = {n: size / ep if n in sharded else float(size) for n, size in sizes.items()}  # what one GPU holds
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
    local.update({n: float(c) for n, c in shard.items()})
    fused_head = fused_loss_bytes_per_microbatch(model) if fused else 0.0
    out = []
    for r in range(p):
        mine = [g for g, q in enumerate(ranks) if q == r]
        # a rank holding both names of a tied pair (V placement: the embedding's and the head's stage) holds one tensor
        held = [n for g in mine for n in per_stage_names[g]]
        held = [n for n in held if not any(n == copy and first in held for first, copy in plan.tied_pairs)]
        if vocab_parallel:  # the head's rows: a shard on every rank, none whole on the last stage's
            # (the plan names each stage's rows ``lm_head.weight@v0:v1``: counted here under the head's own name, whose
            # kind, cast and optimizer are the shard's)
            held = [n for n in held if n not in shard and n in sizes] + list(shard)
        n_params = sum(shard.get(n, sizes[n]) for n in held)
        n_local = sum(local[n] for n in held)
        n_experts = sum(local[n] for n in held if n in sharded)  # this GPU's shard of the experts
        versions = sched.weight_versions(r, p)
        if opt.name == "muon":
            per_param = {n: 4 if kinds.get(n) == "muon" else 8 for n in held}
        else:
            per_param = dict.fromkeys(held, 8 if opt.name in ("adamw", "nadam") else 4)
        opt_bytes = sum(local[n] * per_param[n] for n in held)
        opt_experts = sum(local[n] * per_param[n] for n in held if n in sharded)
        inflight = sim.peak_inflight[r]
        per_microbatch = {g: tokens_mb * (activation_bytes_per_token(cfg, list(plan.stages[g].layers), g == last, ckpt,
                                                                     bf16, fused and g == last, ep, vocab_parallel)
                                          + 4 * received_values_per_token(plan.anatomy, plan.stages[g].layers, g))
                          + (fused_head if g == last else 0.0) for g in mine}
        act = peak_in_flight([iv.action for iv in sim.timeline[r]], r, per_microbatch)
        layer_ids = [i for g in mine for i in plan.stages[g].layers]
        # bf16: the linear weights are held per version in bf16 (+ their fp32 master), except one also read uncast
        # on this stage (a tied head beside its embedding), which autocast casts for each microbatch in flight
        n16 = sum(local[n] for n in held if n in cast_names)
        weights = 4.0 * (n_local - n16) * versions + (4.0 + 2.0 * versions) * n16
        # (the fused loss keeps no cast for the backward: the weight's gradient is computed in the forward)
        casts = inflight * 2.0 * sizes[head] if bf16 and not fused and tied_here(plan, ranks, r) and head in sizes else 0.0
        recompute = tokens_mb * recompute_bytes_per_token(cfg, layer_ids, bf16, ep) if ckpt else 0.0
        # fp32 boundary tensors: outputs kept per in-flight microbatch + the received output gradient + one
        # prefetched receive of each kind + the input gradient on its way back (a stage next to one on the same
        # rank hands over in memory)
        boundary = 4.0 * tokens_mb * h
        sends = any(g < last and ranks[g + 1] != r for g in mine)
        receives = any(g > 0 and ranks[g - 1] != r for g in mine)
        transfers = boundary * ((inflight + 2 if sends else 0) + (2 if receives else 0))
        # the one expert all-to-all in flight: its send and receive buffers
        exchange = 2.0 * tokens_mb * all_to_all_values(cfg, layer_ids) * ALL_TO_ALL_DTYPE_BYTES if ep > 1 else 0.0
        ef = 4.0 * n_local if opt.delay_correction == "error_feedback" else 0.0
        ef_experts = 4.0 * n_experts if ef else 0.0
        if opt.shard_across_replicas and dp > 1:  # ZeRO-1: a replica keeps (and steps) about 1/dp of the state of
            # the tensors every replica holds: with expert parallelism the dense ones (an expert shard's stays whole)
            opt_bytes = opt_experts + (opt_bytes - opt_experts) / dp
            ef = ef_experts + (ef - ef_experts) / dp
        # the reducer's buckets: the gradients all-reduced among replicas; an expert shard's only among the dp / ep
        # replicas holding it
        reduced = n_local - (n_experts if dp // ep == 1 else 0.0)
        layers = ",".join(f"{plan.stages[g].layers.start}-{plan.stages[g].layers.stop - 1}" for g in mine)
        out.append(StageMemory(r, layers, n_params, weights, 4.0 * n_local * sched.grad_sets, float(opt_bytes), ef,
                               act, inflight, casts=casts, transfers=transfers, recompute=recompute, ef_copy=ef,
                               reducer=4.0 * reduced if dp > 1 else 0.0, all_to_all=exchange,
                               expert_params=sum(sizes[n] for n in held if n in experts), expert_parallel=ep,
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
