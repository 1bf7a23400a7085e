"""``pipeline.vocab_parallel``: whether the vocabulary layers are shared by every stage (Vocabulary Parallelism,
Yeung et al., MLSys 2025), decided before anything is built.

Sharing them moves the output layer and the loss off the last stage into a VOCAB pass per microbatch on every stage
(``schedules.records._vocab_passes``), so the decoder layers split evenly. It pays where the head weighs a good part
of a layer or more (moe-10b: 1.6 layers; 2BW on 8 stages loses 16% of each step to the imbalance) and costs where it
does not: each VOCAB is a barrier of every stage with a broadcast and a reduce of the hidden states, and the orders
that carry it run more forwards ahead (``records.vocab_warmup``: more activations in flight). So ``auto`` simulates
the recipe's own schedule both ways on the partition's FLOPs and turns it on only where the step gets faster by more
than ``VOCAB_PARALLEL_MARGIN``, and only for a model whose head is a plain linear layer of its own
(``why_not_vocab_parallel``): a head tied to the input embedding would need its gradient summed with the
embedding's across every stage, and a soft-capped or scaled head is not the logits' plain softmax the shards combine.
"""
from __future__ import annotations

import dataclasses

from ..config.recipe import Recipe
from ..errors import RecipeError
from ..model.vocab_parallel import vocab_parallel_blocker
from ..partition import partition_plan
from ..schedules.records import pipelined
from .memory import meta_model, plan_memory, planned_schedule
from .search import flops_costs, planned_microbatches, run_costs, steady_state

VOCAB_PARALLEL_MARGIN = 0.02
"""The share of a step ``auto`` must save (simulated) to share the vocabulary layers: below it, the simulation's
error (FLOPs, not kernels; the collectives' latency estimated) is as large as the gain."""

DECISION_FLOPS = 300e12
"""FLOP/s per device the decision's simulation assumes; only the ratio of the two step times matters, and with no
link modelled it does not depend on this."""

def why_not_vocab_parallel(recipe: Recipe, model=None, num_stages: int | None = None) -> str | None:
    """Why ``recipe`` cannot share its vocabulary layers by every stage (None: it can): one stage, a schedule with
    several stages per rank (planner only) or an update per microbatch, or the model (``model.vocab_parallel.
    vocab_parallel_blocker``: an untied plain linear head under transformers' own loss)."""
    p = num_stages or recipe.pipeline.num_stages
    if not pipelined(recipe.pipeline.schedule) or p < 2:
        return "one stage holds the whole vocabulary already"
    sched = planned_schedule(recipe.pipeline.schedule)
    if sched.one_update_per_microbatch:
        return f"{sched.name} updates the weights per microbatch; the shards need one version per step"
    if not sched.runs_in_executor:
        return f"{sched.name} runs in the simulator and the planner only"
    model = model if model is not None else meta_model(recipe)
    why = vocab_parallel_blocker(model)
    return f"{type(model).__name__}: {why}" if why else None


def vocab_parallel_step_times(recipe: Recipe, model=None, num_stages: int | None = None,
                              flops_per_s: float = DECISION_FLOPS) -> tuple[float, float]:
    """Simulated steady-state seconds per step of the recipe's schedule on ``num_stages`` (the recipe's) stages at its
    microbatch count, without and with the vocabulary layers shared by every stage, each on its own split (the
    recipe's ``layers_per_stage`` where it lists one, else balanced by FLOPs) and the partition's FLOPs."""
    model = model if model is not None else meta_model(recipe)
    p = num_stages or recipe.pipeline.num_stages
    sched = planned_schedule(recipe.pipeline.schedule)
    m = planned_microbatches(recipe, p)
    split = recipe.pipeline.split if p == recipe.pipeline.num_stages else None
    scope = sched.reduce_scope(recipe.training.max_grad_norm)
    out = []
    for vocab in (False, True):
        plan = partition_plan(model, p, split, seq_len=recipe.data.seq_len, vocab_parallel=vocab)
        costs = run_costs(flops_costs(plan, recipe, flops_per_s), recipe)
        out.append(steady_state(sched, p, m, costs, scope, vocab_parallel=vocab)[0])
    return out[0], out[1]


def decide_vocab_parallel(recipe: Recipe, model=None, num_stages: int | None = None, device_bytes: float | None = None,
                          replicas: int = 1) -> tuple[bool, str]:
    """``pipeline.vocab_parallel: auto``: (on or off, why, with the simulated figures). On where the model and the
    schedule allow it (``why_not_vocab_parallel``), the recipe's schedule simulates more than
    ``VOCAB_PARALLEL_MARGIN`` faster per step with it (``vocab_parallel_step_times``) and, where the device's memory
    is known (``device_bytes``: a GPU's, with ``replicas`` per stage), its fullest stage fits 90% of it by the planner's
    memory model or needs no more than without: the VOCAB passes' deeper warm-up keeps up to twice the activations on
    the first stages, which at moe-10b's 8 x 2 without activation checkpointing is 90.9 GB against 68.4."""
    model = model if model is not None else meta_model(recipe)
    why = why_not_vocab_parallel(recipe, model, num_stages)
    if why is not None:
        return False, f"off: {why}"
    p = num_stages or recipe.pipeline.num_stages
    without, with_ = vocab_parallel_step_times(recipe, model, p)
    gain = 1 - with_ / without
    figures = (f"{recipe.pipeline.schedule} on {p} stages simulates {without:.4g} s/step without, {with_:.4g} with "
               f"({gain:+.1%}) at {DECISION_FLOPS / 1e12:g} TFLOP/s")
    if gain <= VOCAB_PARALLEL_MARGIN:
        return False, f"off: {figures}, not more than the {VOCAB_PARALLEL_MARGIN:.0%} margin"
    if device_bytes:
        shared, whole = (max(x.total for x in plan_memory(recipe, p, model, dp=replicas, vocab_parallel=v)[1])
                         for v in (True, False))
        if shared > 0.9 * device_bytes and shared > whole:
            return False, (f"off: {figures}, but the fullest stage would need {shared / 1e9:.1f} GB (without: "
                           f"{whole / 1e9:.1f} GB) of the device's {device_bytes / 1e9:.1f} GB (90% budget)")
    return True, f"on: {figures}"


def resolve_vocab_parallel(recipe: Recipe, model=None, num_stages: int | None = None, device_bytes: float | None = None,
                           replicas: int = 1) -> tuple[bool, str]:
    """(``pipeline.vocab_parallel`` as it applies to this recipe, why): ``true`` where allowed (else a ``RecipeError``
    naming the field and the reason), ``false``, or ``auto`` decided (``decide_vocab_parallel``; ``device_bytes`` and
    ``replicas``: the memory it must fit)."""
    field = recipe.pipeline.vocab_parallel
    if field == "auto":
        return decide_vocab_parallel(recipe, model, num_stages, device_bytes, replicas)
    if not field:
        return False, "off: pipeline.vocab_parallel is false"
    why = why_not_vocab_parallel(recipe, model, num_stages)
    if why is not None:
        raise RecipeError(f"pipeline.vocab_parallel: true, but {why}; set pipeline.vocab_parallel: false (or auto)")
    return True, "on: pipeline.vocab_parallel is true"


def with_vocab_parallel(recipe: Recipe, on: bool) -> Recipe:
    """``recipe`` with ``pipeline.vocab_parallel`` set to ``on``."""
    return dataclasses.replace(recipe, pipeline=dataclasses.replace(recipe.pipeline, vocab_parallel=on))
