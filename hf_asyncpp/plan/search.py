"""Which schedule and layout, and how fast: the simulated step time of a recipe and the search over layouts.

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
head's stage gets 1) and a 2BW bubble of 31%; on 8 stages x 2 replicas every stage has 4 layers. Each layout is tried
with every expert-parallel size (``pipeline.expert_parallel``: the divisors of the replica count that divide the
experts; 1 for a dense model) and with activation checkpointing off and on.

Expert parallelism in the step: the expert GEMMs' FLOPs per rank stay those of the dense layout (each rank runs 1/ep
of the experts on ep x the tokens, the routing even), and every MoE layer adds two all-to-alls to each forward and
two to each backward (``memory.all_to_all_bytes``: tokens x k x h x 4 B x (ep - 1) / ep each way), on the compute
stream at the link speed (``Costs.all_to_all``, ``expert_exchange``); the data-parallel all-reduce carries the dense
gradients over the replicas and each expert shard's over the dp / ep replicas holding it.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from ..config.recipe import Recipe
from ..partition import partition_plan
from ..partition.plan import moe_shape
from ..schedules.records import TWO_BW, Schedule, get_schedule
from ..schedules.simulator import BubbleSplit, Costs, simulate, split_bubble
from .memory import StageMemory, all_to_all_bytes, check_expert_parallel, meta_model, plan_memory, planned_schedule


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
    if schedule.name != TWO_BW.name:
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
    return Costs(forward=fwd, backward=[2 * f for f in fwd], vocab=vocab_seconds(plan, tokens_mb, flops_per_s))


def vocab_seconds(plan, tokens_mb: int, flops_per_s: float) -> float:
    """Seconds of one stage's VOCAB pass (its shard of the output layer and loss, forward + backward: 3 x the forward's
    FLOPs) for a microbatch of ``tokens_mb`` tokens; 0 unless the plan shares the vocabulary layers. Never replayed by
    activation checkpointing (the head is not checkpointed)."""
    return 3 * plan.vocab_cost * tokens_mb / flops_per_s


def expert_exchange(costs: Costs, stage_layers, recipe: Recipe, config, link_bytes_per_s: float | None) -> Costs:
    """``costs`` with each stage's expert all-to-alls per microbatch and pass (``Costs.all_to_all``): the bytes a
    rank sends through its MoE layers (``all_to_all_bytes``) at ``link_bytes_per_s`` per GPU, sending and receiving
    at once as the ring all-reduce is costed. ``stage_layers``: the layer ids of each stage of ``costs``. Unchanged
    without expert parallelism or a link speed."""
    ep = recipe.pipeline.expert_parallel
    if ep <= 1 or not link_bytes_per_s:
        return costs
    tokens_mb = recipe.pipeline.microbatch_size * recipe.data.seq_len
    return dataclasses.replace(costs, all_to_all=[all_to_all_bytes(config, list(layers), tokens_mb, ep)
                                                  / link_bytes_per_s for layers in stage_layers])


def run_costs(costs: Costs, recipe: Recipe) -> Costs:
    """``costs`` (of layers that keep their activations: FLOPs, or ``measure_costs``) as the recipe runs them: with
    activation checkpointing every backward pass replays its layers' forward (``Costs.checkpointed``)."""
    return costs.checkpointed() if recipe.training.gradient_checkpointing else costs


def schedule_memory(recipe: Recipe, schedule: str, num_stages: int, model=None, dp: int = 1,
                    vocab_parallel: bool = False) -> list[StageMemory]:
    """``plan_memory`` of ``recipe`` run with ``schedule`` instead of its own (per rank for a virtual-stage one)."""
    r = dataclasses.replace(recipe, pipeline=dataclasses.replace(recipe.pipeline, schedule=schedule))
    return plan_memory(r, num_stages, model, dp=dp, vocab_parallel=vocab_parallel)[1]


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
                  measured=None, link_bytes_per_s: float | None = None, vocab_parallel: bool = False) -> Costs:
    """The simulator's costs for a schedule whose ranks hold several stages: the model split into num_stages x
    stages_per_rank stages, each costed by its own layers -- ``measured`` per-layer seconds (``MeasuredCosts``,
    the split balanced by them), else the FLOPs of the balanced ``partition_plan`` of ``model`` at
    ``flops_per_s`` -- and the optimizer step per rank, the sum of its stages' (``Costs.per_rank``); with
    ``link_bytes_per_s`` and a model, each stage's expert all-to-alls (``expert_exchange``). With
    ``vocab_parallel`` each rank holds one shard of the vocabulary layers (1 / ``num_stages`` of them)."""
    stages = num_stages * sched.stages_per_rank
    if measured is not None:
        sizes = measured.balance(stages, planned_microbatches(recipe, num_stages), vocab_parallel)
        costs = measured.stage_costs(sizes, vocab_parallel, shards=num_stages)
        starts = [sum(sizes[:g]) for g in range(stages)]
        stage_layers = [range(a, a + n) for a, n in zip(starts, sizes)]
    elif model is not None and flops_per_s is not None:
        finer = partition_plan(model, stages, seq_len=recipe.data.seq_len, vocab_parallel=vocab_parallel)
        costs, stage_layers = flops_costs(finer, recipe, flops_per_s), [st.layers for st in finer.stages]
        costs.vocab *= sched.stages_per_rank  # the plan's shards are per model stage, a rank's is 1 / num_stages
    else:
        raise ValueError("virtual_costs needs measured per-layer costs, or a model and flops_per_s")
    if model is not None:
        costs = expert_exchange(costs, stage_layers, recipe, model.config, link_bytes_per_s)
    return run_costs(costs, recipe).per_rank(sched.stage_ranks(num_stages))


def simulate_schedules(plan, recipe: Recipe, num_stages: int, flops_per_s: float | None = None,
                       costs: Costs | None = None, model=None, measured=None,
                       link_bytes_per_s: float | None = None) -> dict[str, object]:
    """``PLANNED_SCHEDULES`` over ``PLANNED_STEPS`` steps on the same model's costs: ``costs`` (e.g. measured per
    stage, ``MeasuredCosts.stage_costs``) or the plan's FLOPs at ``flops_per_s`` (``flops_costs``). The virtual-stage
    schedules run where they fit (``why_not_planned``) and their costs can be had (``virtual_costs``: ``measured``, or
    ``model`` with ``flops_per_s``); the others are left out. Each result's bubble comes split into fill/drain and
    imbalance (``SimResult.fill_drain``, ``SimResult.imbalance``); ``peak_inflight`` per rank. The costs are those of
    layers that keep their activations: with activation checkpointing each backward pass is charged its replay
    (``run_costs``). With ``pipeline.expert_parallel`` > 1, ``link_bytes_per_s`` and ``model``, each stage's expert
    all-to-alls are added (``expert_exchange``). With ``plan.vocab_parallel`` every schedule runs its VOCAB passes
    (``costs.vocab`` each)."""
    vocab = plan.vocab_parallel
    if costs is None:
        if flops_per_s is None:
            raise ValueError("simulate_schedules needs costs or flops_per_s")
        costs = flops_costs(plan, recipe, flops_per_s)
    if model is not None:
        costs = expert_exchange(costs, [st.layers for st in plan.stages], recipe, model.config, link_bytes_per_s)
    costs = run_costs(costs, recipe)
    m = planned_microbatches(recipe, num_stages)
    res = {}
    for name in PLANNED_SCHEDULES:
        sched = get_schedule(name)
        if sched.stages_per_rank == 1:
            res[name] = simulate(sched.actions(num_stages, m, PLANNED_STEPS, vocab_parallel=vocab), costs, sched)
        elif (measured is not None or model is not None) and why_not_planned(sched, plan.num_layers, num_stages, m) is None:
            finer = virtual_costs(sched, recipe, num_stages, model, flops_per_s, measured, link_bytes_per_s, vocab)
            res[name] = simulate(sched.actions(num_stages, m, PLANNED_STEPS, vocab_parallel=vocab), finer, sched)
    return res


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
    expert_parallel: int = 1
    checkpointed: bool = False
    """Activation checkpointing on (``training.gradient_checkpointing``)."""
    vocab_parallel: bool = False
    """The vocabulary layers shared by every stage (``pipeline.vocab_parallel``)."""

    @property
    def feasible(self) -> bool:
        return self.fits and self.runnable

    def overrides(self) -> str:
        return (f"--pipeline.num_stages={self.num_stages} --pipeline.num_microbatches={self.num_microbatches} "
                f"--pipeline.microbatch_size={self.microbatch_size} "
                f"--pipeline.layers_per_stage=[{','.join(map(str, self.layers_per_stage))}] "
                f"--pipeline.expert_parallel={self.expert_parallel} "
                f"--training.gradient_checkpointing={str(self.checkpointed).lower()} "
                f"--pipeline.vocab_parallel={'true' if self.vocab_parallel else 'false'}")


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def steady_state(sched, p: int, m: int, costs: Costs, scope: str, extra: int = 0, vocab_parallel: bool = False,
                 **sim) -> tuple[float, BubbleSplit]:
    """(seconds per step, bubble split into fill/drain and imbalance) in steady state: the difference of a 4-step
    and a 2-step window, so the fill and drain of a window (paid once per drain point, not per step) do not count
    against an asynchronous schedule. ``vocab_parallel``: with the VOCAB passes of the vocabulary layers shared by
    every stage. ``sim``: further ``simulate`` options (``reduce_on_compute_stream``, ``nccl``)."""
    short = simulate(sched.actions(p, m, 2, extra_warmup=extra, vocab_parallel=vocab_parallel), costs, sched,
                     reduce_scope=scope, **sim)
    long = simulate(sched.actions(p, m, 4, extra_warmup=extra, vocab_parallel=vocab_parallel), costs, sched,
                    reduce_scope=scope, **sim)
    step = (long.makespan - short.makespan) / 2
    busy = [b_long - b_short for b_long, b_short in zip(long.busy, short.busy)]
    return step, split_bubble(busy, 2 * step)


def steady_step_time(sched, p: int, m: int, costs: Costs, scope: str, extra: int = 0, vocab_parallel: bool = False,
                     **sim) -> tuple[float, float]:
    """(seconds per step, bubble) in steady state (``steady_state`` without the bubble's split)."""
    step, bubble = steady_state(sched, p, m, costs, scope, extra, vocab_parallel, **sim)
    return step, bubble.total


def expert_parallel_sizes(config, replicas: int) -> list[int]:
    """The ``pipeline.expert_parallel`` sizes a stage of ``replicas`` replicas can take: the divisors of the replica
    count that divide each MoE layer's experts (``check_expert_parallel``); [1] for a dense model."""
    experts, _ = moe_shape(config)
    return [d for d in _divisors(replicas) if d == 1 or (experts and experts % d == 0)]


def _ring_all_reduce_seconds(nbytes: float, ranks: int, link_bytes_per_s: float) -> float:
    return 2 * (ranks - 1) / ranks * nbytes / link_bytes_per_s if ranks > 1 else 0.0


def evaluate_plan(recipe: Recipe, model, p: int, dp: int, m: int, mbs: int, split: list[int] | None, cap: float,
                  flops_per_s: float, link_bytes_per_s: float, expert_parallel: int | None = None,
                  checkpointed: bool | None = None, vocab_parallel: bool = False) -> Candidate:
    """Memory and steady-state speed of one (stages, replicas, microbatches, microbatch size, split, expert-parallel
    size, activation checkpointing, vocabulary layers shared or not); expert-parallel size and checkpointing None: the
    recipe's. With ``vocab_parallel`` a VOCAB pass costs its shard's FLOPs plus a broadcast of the final hidden states
    and a reduce of their gradient, each one boundary transfer at the link speed (``Costs.vocab_comm``'s default; the
    softmax statistics' all-gather, 3 values per token, is left out)."""
    ep = recipe.pipeline.expert_parallel if expert_parallel is None else expert_parallel
    ckpt = recipe.training.gradient_checkpointing if checkpointed is None else checkpointed
    check_expert_parallel(ep, dp, model.config)
    rp = dataclasses.replace(recipe.pipeline, num_stages=p, num_microbatches=m, microbatch_size=mbs,
                             layers_per_stage=split, extra_warmup=0, expert_parallel=ep)
    r = dataclasses.replace(recipe, pipeline=rp,
                            training=dataclasses.replace(recipe.training, gradient_checkpointing=ckpt))
    sched = planned_schedule(rp.schedule)
    plan, mem, _ = plan_memory(r, p, model, split, dp=dp, vocab_parallel=vocab_parallel)
    sizes = [len(st.layers) for st in plan.stages]
    worst = max(x.total for x in mem)
    tokens_mb = mbs * recipe.data.seq_len
    layout = dict(expert_parallel=ep, checkpointed=ckpt, vocab_parallel=vocab_parallel)
    try:
        sched.check(p, m)
    except ValueError:
        return Candidate(p, dp, m, mbs, sizes, float("nan"), float("nan"), worst, worst <= 0.9 * cap, False, 0.0,
                         **layout)
    fwd = [st.cost * tokens_mb / flops_per_s for st in plan.stages]
    # ring all-reduce of the fp32 gradients among the dp replicas of a stage (an expert shard's among the dp / ep
    # replicas holding it); activations of a microbatch between stages
    reduce = [_ring_all_reduce_seconds(4 * (x.params - x.expert_params), dp, link_bytes_per_s)
              + _ring_all_reduce_seconds(4 * x.expert_params / ep, dp // ep, link_bytes_per_s) for x in mem]
    h = getattr(model.config, "hidden_size", None) or model.config.n_embd
    comm = tokens_mb * h * 4 / link_bytes_per_s  # the boundary tensor is the fp32 residual stream, bf16 or not
    costs = Costs(forward=fwd, backward=[2 * f for f in fwd], reduce=reduce, comm=comm,
                  vocab=vocab_seconds(plan, tokens_mb, flops_per_s))
    costs = run_costs(expert_exchange(costs, [st.layers for st in plan.stages], r, model.config, link_bytes_per_s), r)
    step, bubble = steady_state(sched, p, m, costs, sched.reduce_scope(recipe.training.max_grad_norm),
                                vocab_parallel=vocab_parallel)
    tokens = m * tokens_mb * dp
    return Candidate(p, dp, m, mbs, sizes, step, bubble.total, worst, worst <= 0.9 * cap, True, tokens / step, costs,
                     imbalance=bubble.imbalance, **layout)


def reduction_stall(recipe: Recipe, c: Candidate) -> float:
    """Seconds per step the plan loses waiting for gradient reductions: its step time against the same plan with
    free reductions. 2BW hides a reduction behind m - p + 1 forward/backward pairs of stage 0; a synchronous
    schedule behind nothing (its STEP follows the step's last backward)."""
    sched = planned_schedule(recipe.pipeline.schedule)
    free = dataclasses.replace(c.costs, reduce=0.0)
    step, _ = steady_step_time(sched, c.num_stages, c.num_microbatches, free,
                               sched.reduce_scope(recipe.training.max_grad_norm), vocab_parallel=c.vocab_parallel)
    return max(0.0, round(c.step_s - step, 9))  # float noise of the two simulations is no stall


def search_plans(recipe: Recipe, gpus: int, cap: float, flops_per_s: float, link_bytes_per_s: float,
                 model=None, vocab_modes: tuple[bool, ...] = (False,)) -> list[Candidate]:
    """Every plan for ``gpus`` GPUs at the recipe's global batch, best first: feasible ones (fits in 90% of
    ``cap``, schedule accepts m) by simulated tokens/s, then the rest by tokens/s. ``vocab_modes``: each layout
    with the vocabulary layers on the last stage (False) and/or shared by every stage (True; where the model and
    the schedule allow it: ``plan.vocab.why_not_vocab_parallel``), each with its own balanced split.

    The global batch (sequences per step) is the recipe's ``num_microbatches x microbatch_size`` times the
    data-parallel degree the recipe implies on these GPUs (``gpus / num_stages``), so every candidate trains the same
    model on the same batches; only how the work is laid out changes. Each layout is tried at every expert-parallel
    size its replicas allow (``expert_parallel_sizes``) and with activation checkpointing off and on.
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
            for vocab in vocab_modes:
                for split in splits:
                    for ep in expert_parallel_sizes(model.config, dp):
                        for ckpt in (False, True):
                            c = evaluate_plan(recipe, model, p, dp, m, mbs, split, cap, flops_per_s,
                                              link_bytes_per_s, ep, ckpt, vocab)
                            key = (tuple(c.layers_per_stage), ep, ckpt, vocab)
                            if key not in seen:
                                seen.add(key)
                                out.append(c)
    # ties (to 6 digits: float noise of the simulation) go to the larger microbatch, whose kernels run faster
    return sorted(out, key=lambda c: (not c.feasible, -float(f"{c.tokens_per_s:.6g}"), -c.microbatch_size))
