"""Plan a run before launching it: partition, per-stage memory, whether it fits, simulated step time, bubble and
fullest stage's memory of 2bw against 1f1b, zbh1 and gpipe -- and, planner only, interleaved 1F1B, ZBV and DualPipeV
(2 stages per rank, on the model split into twice the stages: where the layers allow and the schedule takes the
microbatch count) -- and a timeline PNG. Nothing is allocated (meta device). Each bubble is split into fill/drain (the
schedule's warm-up, cool-down and dependency waits: what equal stages would idle too) and imbalance (what the stages'
unequal work adds), which sum to it.

    hf-asyncpp plan recipes/moe-10b.yaml --num-stages 16 --gpu-memory 80GB
    hf-asyncpp plan recipes/smollm2-360m.yaml --num-stages 4
    hf-asyncpp plan recipes/cpu-tiny.yaml --measure   # also time every layer here and balance by time

After the recipe's own plan it searches what can be changed on the same GPUs (``--gpus``, default the stage
count times ``pipeline.expert_parallel``): stages (the rest data-parallel replicas), the split (FLOPs-balanced, or even
where the stages divide the layers), the microbatch size and so the microbatch count at the same global batch, the
expert-parallel size (a MoE model: the divisors of the replica count that divide the experts; the all-to-alls at
``--link-gbs``) and activation checkpointing off or on; it prints the best plans by
simulated tokens/s with their bubble, reduction stall (seconds per step waiting for the data-parallel all-reduce),
memory per GPU and feasibility, and the overrides that select the best.

The timeline PNG, one steady step of the recipe's schedule with each stage's busy and idle shares, goes into
``--out`` (default: the current directory) as ``<recipe>-<p>stages.png``, or to ``--png FILE``.

The arguments and the recipe are read before the planner's modules are imported (they import torch and
transformers: seconds), so a mistake in either answers at once.

``--measure`` builds the model (random weights) on ``--device`` and times each layer's forward + backward at the
recipe's microbatch shape, as training runs them (the layers compiled where training compiles them, with its
backend; the head and the loss eager and fused or not, as the last stage computes them); run it on a quiet machine
of the kind that will train (the head's memory-bound softmax slows down most when other processes share the memory
bus). It prints the split to put in the recipe
(``pipeline.layers_per_stage``), and the four schedules simulated again on that split with the measured seconds per
stage of F, B, the split backward's I and W (torch's ``stage_backward_input`` / ``split_backward.weight_gradients``,
as the executor runs ZB-H1) and the optimizer step, instead of FLOPs and I = W = B / 2.
"""
import argparse
import os
import sys

from . import at_least
from ..config.recipe import load_recipe, split_overrides
from ..errors import RecipeError
from ..schedules.records import get_schedule

def parse_bytes(text: str) -> float:
    """``80GB`` (or ``80GiB``, ``512MB``, ``1TB``, ``1000B``) in bytes. A bare number is refused: ``80`` meant 80 GB
    to everyone who typed it and was planned as 80 bytes ("0 of 20 plans fit"), and reading it as GB would make
    ``1000000`` wrong the other way; the unit costs two characters.

    Raises:
        ValueError: no unit, or not a number; the message names the fix.
    """
    t = text.strip().upper().replace("IB", "B")
    for unit, mult in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("KB", 1e3), ("B", 1)):
        if t.endswith(unit):
            try:
                value = float(t[: -len(unit)])
            except ValueError:
                break
            if value > 0:
                return value * mult
            break
    try:
        float(t)
    except ValueError:
        raise ValueError(f"{text!r} is not a memory size; write a positive number and a unit, e.g. 80GB") from None
    raise ValueError(f"{text!r} has no unit (or is not positive); write it with one, e.g. {text.strip()}GB")


def gb(x: float) -> str:
    return f"{x / 1e9:.2f}"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="hf-asyncpp plan", description=__doc__, epilog="Recipe overrides: "
                                 "--section.field=value or --section.field value, anywhere after the recipe.",
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("recipe")
    ap.add_argument("--num-stages", type=at_least(1), default=None)
    ap.add_argument("--gpu-memory", default="80GB")
    ap.add_argument("--tflops", type=float, default=300.0, help="sustained TFLOP/s per device for the time estimate")
    ap.add_argument("--measure", action="store_true", help="time each layer on --device and balance stages by time")
    ap.add_argument("--device", default=None, help="device for --measure (default: cuda if available, else cpu)")
    ap.add_argument("--gpus", type=at_least(1), default=None,
                    help="GPUs to search plans for (default: the stage count x pipeline.expert_parallel)")
    ap.add_argument("--top", type=at_least(0), default=5, help="plans of the search to print (0: no search)")
    ap.add_argument("--link-gbs", type=float, default=25.0,
                    help="GB/s per GPU for the data-parallel all-reduce, the stage-to-stage transfers and the expert "
                         "all-to-alls (pipeline.expert_parallel)")
    ap.add_argument("--out", default=None, metavar="DIR",
                    help="folder for the timeline PNG, created if missing (default: the current directory)")
    ap.add_argument("--png", default=None, metavar="FILE",
                    help="the timeline PNG's own path (default: <recipe>-<p>stages.png in --out)")
    own, overrides = split_overrides(list(sys.argv[1:] if argv is None else argv))
    args = ap.parse_args(own)

    try:
        cap = parse_bytes(args.gpu_memory)
    except ValueError as e:
        print(f"error: --gpu-memory: {e}", file=sys.stderr)
        return 2
    try:
        recipe = load_recipe(args.recipe, overrides)
    except RecipeError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return report(recipe, args, cap)


def report(recipe, args, cap: float) -> int:
    """The plan of a loaded recipe, printed, and its timeline PNG."""
    # imported here, after the arguments and the recipe are read: they import torch and transformers
    from ..plan.memory import meta_model, plan_memory
    from ..plan.search import planned_microbatches, schedule_memory, simulate_schedules
    from ..plan.vocab import resolve_vocab_parallel, why_not_vocab_parallel
    from ..schedules.timeline import plot_steady_step

    p = args.num_stages or recipe.pipeline.num_stages
    ep = recipe.pipeline.expert_parallel
    gpus = args.gpus or p * ep
    dp = max(1, gpus // p)
    model = meta_model(recipe)
    try:
        vocab, vocab_why = resolve_vocab_parallel(recipe, model, p, device_bytes=cap, replicas=dp)
        plan, mem, _ = plan_memory(recipe, p, model=model, dp=dp, vocab_parallel=vocab)
    except RecipeError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    shareable = why_not_vocab_parallel(recipe, model, p) is None
    total_params = sum(m.params for m in mem)
    print(f"{args.recipe}: {recipe.model.config.get('model_type') if recipe.model.config else recipe.model.name_or_path}, "
          f"{total_params / 1e9:.3f}B parameters (tied copies counted per stage), {p} stages, schedule {recipe.pipeline.schedule}, "
          f"microbatch {recipe.pipeline.microbatch_size} x {recipe.data.seq_len} tokens, {recipe.pipeline.num_microbatches} per step\n")
    print(plan.format() + "\n")
    field = recipe.pipeline.vocab_parallel
    print(f"vocabulary layers shared by every stage (pipeline.vocab_parallel: "
          f"{field if isinstance(field, str) else str(field).lower()}): "
          f"{vocab_why}\n")
    heads = ("weights", "grads", "optim", "EF", "casts", "activ.", "recomp.", "transf.", "a2a", "vocab", "steady",
             "EF@STEP", "buckets")
    experts = (f"; experts sharded over {ep} of them (expert_parallel), a2a = the all-to-all's buffers" if ep > 1
               else "")
    print(f"GB per GPU of each stage and term (plan/memory.py explains each; steady = between steps, peak = + EF's "
          f"clone at STEP + the reducer's buckets with {dp} data-parallel replica(s){experts}):")
    print(f"{'stage':>5} {'layers':>7} {'in-flight':>9} " + " ".join(f"{x:>7}" for x in heads) + f" {'peak':>7}  fits 90% of {args.gpu_memory}?")
    worst = max(mem, key=lambda m: m.total)
    for m in mem:
        ok = "yes" if m.total <= cap * 0.9 else "NO"
        vals = (m.weights, m.grads, m.optimizer, m.ef, m.casts, m.activations, m.recompute, m.transfers, m.all_to_all,
                m.vocab,
                m.steady, m.ef_copy, m.reducer)
        print(f"{m.stage:>5} {m.layers:>7} {m.inflight:>9} " + " ".join(f"{gb(v):>7}" for v in vals)
              + f" {gb(m.total):>7}  {ok} ({(cap - m.total) / cap:+.0%} margin)")
    if worst.total > cap * 0.9:
        act_share = (worst.activations + worst.casts + worst.recompute) / worst.total
        hint = ("lower pipeline.microbatch_size (activations dominate)" if act_share > 0.4 else
                f"use more stages (--num-stages {p * 2}) or data parallelism with fewer weights per stage")
        print(f"\nstage {worst.stage} needs {gb(worst.total)} GB > 90% of {args.gpu_memory}: {hint}; "
              "optimizer.delay_correction: none saves the EF buffer and its clone; training.gradient_checkpointing keeps "
              "only the layers' inputs")
    else:
        print(f"\nfits: the largest stage (stage {worst.stage}) needs {gb(worst.total)} GB at its peak of "
              f"{args.gpu_memory} ({(cap - worst.total) / cap:.0%} margin; 90% budget)")
    if ep > 1:
        print("\n" + all_to_all_line(recipe, plan, model.config, args.link_gbs))
    sims = simulate_schedules(plan, recipe, p, args.tflops * 1e12, model=model, link_bytes_per_s=args.link_gbs * 1e9)
    fullest = {name: max(x.total for x in schedule_memory(recipe, name, p, model, dp, vocab)) for name in sims}
    print(f"\nsimulated at {args.tflops:g} TFLOP/s per device, {planned_microbatches(recipe, p)} microbatches per "
          "step (bubble = fill/drain, what equal stages would idle too, + imbalance, what unequal stages add; the "
          "virtual-stage schedules on the model split into more stages, balanced by FLOPs, planner only):")
    print("\n".join(schedule_lines(sims, recipe, fullest, not_planned(sims, plan.num_layers, recipe, p))))
    if shareable:
        other = plan_memory(recipe, p, model=model, dp=dp, vocab_parallel=not vocab)[0]
        other_sims = simulate_schedules(other, recipe, p, args.tflops * 1e12, model=model)
        print("\n" + "\n".join(vocab_lines(*((sims, other_sims) if vocab else (other_sims, sims)),
                                            *((plan, other) if vocab else (other, plan)))))
    name = os.path.splitext(os.path.basename(args.recipe))[0]
    png = args.png or os.path.join(args.out or "", f"{name}-{p}stages.png")
    os.makedirs(os.path.dirname(png) or ".", exist_ok=True)
    shown = recipe.pipeline.schedule if recipe.pipeline.schedule in sims else "2bw"
    plot_steady_step(sims[shown], png, f"{name}: {shown} on {p} stages, "
                     f"{planned_microbatches(recipe, p)} microbatches per step (simulated)")
    print(f"\ntimeline: {png}")
    if args.top:
        search(recipe, gpus, cap, args)
    if args.measure:
        measure(recipe, plan, p, args.device, args.link_gbs)
    return 0


def all_to_all_line(recipe, plan, config, link_gbs: float) -> str:
    """What expert parallelism sends per microbatch: bytes per MoE layer and pass, and seconds per stage."""
    from ..plan.memory import all_to_all_bytes, moe_layers  # see report()

    ep, tokens = recipe.pipeline.expert_parallel, recipe.pipeline.microbatch_size * recipe.data.seq_len
    first = moe_layers(config).index(True)
    per_layer = all_to_all_bytes(config, [first], tokens, ep)
    stages = " ".join(f"{all_to_all_bytes(config, list(st.layers), tokens, ep) / (link_gbs * 1e9) * 1e3:.1f}"
                      for st in plan.stages)
    return (f"expert all-to-alls ({ep} ranks): {per_layer / 1e9:.3f} GB sent per MoE layer, microbatch and pass "
            f"(dispatch + combine; the backward the same again), at {link_gbs:g} GB/s per stage and pass: [{stages}] "
            "ms, added to each F, B (and I) on the compute stream")


def schedule_lines(sims: dict, recipe, fullest: dict | None = None, skipped: dict | None = None) -> list[str]:
    """One line per simulated schedule: seconds per step, the bubble and its two parts, the speed against 1F1B and,
    where a step is worth less than a synchronous one (2BW), the speed to the same loss; the fullest stage's (or
    rank's) planned memory where ``fullest`` has it, and for a virtual-stage schedule its stages per rank. Then one
    line per schedule in ``skipped``: why it does not fit."""
    from ..plan.search import PLANNED_STEPS, STEP_WORTH_SOURCE, step_worth  # see report()

    base = sims["1f1b"].makespan
    lines = []
    for name, r in sims.items():
        sched = get_schedule(name)
        speed = base / r.makespan
        worth = step_worth(sched, recipe.optimizer)
        if worth is None:
            loss = "; to the same loss: not measured for this optimizer"
        elif worth == 1.0 and sched.synchronous:
            loss = ""
        else:
            loss = (f"; {speed * worth:.2f}x to the same loss: a step is worth {worth:.2f} of a synchronous one with "
                    f"{recipe.optimizer.name} + delay correction {recipe.optimizer.delay_correction} ({STEP_WORTH_SOURCE})")
        where = "stage" if sched.runs_in_executor else "rank"
        memory = f"; fullest {where} {gb(fullest[name])} GB" if fullest and name in fullest else ""
        virtual = (f"; {sched.stages_per_rank} stages per rank ({sched.placement} placement), "
                   f"{max(r.peak_inflight)} stage-microbatches in flight at most" if not sched.runs_in_executor else "")
        lines.append(f"  {name:>15}: {r.makespan / PLANNED_STEPS:.4g} s/step, bubble {r.bubble:.1%} = fill/drain "
                     f"{r.fill_drain:.1%} + imbalance {r.imbalance:.1%}; {speed:.2f}x the speed of 1f1b{loss}"
                     f"{memory}{virtual}")
    for name, why in (skipped or {}).items():
        lines.append(f"  {name:>15}: does not fit: {why}")
    return lines


def vocab_lines(shared: dict, whole: dict, shared_plan, whole_plan) -> list[str]:
    """Per schedule simulated both ways, its seconds per step and imbalance with the vocabulary layers shared by every
    stage and without (the head and loss on the last stage), each on its own split, and the speed-up."""
    split = lambda plan: [len(st.layers) for st in plan.stages]
    from ..plan.search import PLANNED_STEPS  # see report()

    lines = [f"with the vocabulary layers shared by every stage (split {split(shared_plan)}) and without (split "
             f"{split(whole_plan)}):"]
    for name in shared:
        if name in whole:
            a, b = shared[name], whole[name]
            lines.append(f"  {name:>15} shared: {a.makespan / PLANNED_STEPS:.4g} s/step, imbalance {a.imbalance:.1%}; "
                         f"without: {b.makespan / PLANNED_STEPS:.4g} s/step, imbalance {b.imbalance:.1%}; "
                         f"{b.makespan / a.makespan:.2f}x the speed")
    return lines


def not_planned(sims: dict, num_layers: int, recipe, p: int) -> dict[str, str]:
    """Why each planned schedule missing from ``sims`` was left out."""
    from ..plan.search import PLANNED_SCHEDULES, planned_microbatches, why_not_planned  # see report()

    m = planned_microbatches(recipe, p)
    return {name: why_not_planned(get_schedule(name), num_layers, p, m) or "no per-layer costs to split it by"
            for name in PLANNED_SCHEDULES if name not in sims}


def search(recipe, gpus: int, cap: float, args) -> None:
    from ..plan.memory import meta_model
    from ..plan.search import reduction_stall, search_plans  # see report()
    from ..plan.vocab import why_not_vocab_parallel

    model = meta_model(recipe)
    shareable = why_not_vocab_parallel(recipe, model, max(2, recipe.pipeline.num_stages)) is None
    cands = search_plans(recipe, gpus, cap, args.tflops * 1e12, args.link_gbs * 1e9, model,
                         (False, True) if shareable else (False,))
    feasible = [c for c in cands if c.feasible]
    batch = recipe.pipeline.num_microbatches * recipe.pipeline.microbatch_size * max(1, gpus // recipe.pipeline.num_stages)
    print(f"\nsearch on {gpus} GPUs, {batch} sequences per step, {recipe.pipeline.schedule} in steady state at "
          f"{args.tflops:g} TFLOP/s, data-parallel ring all-reduce (fp32 gradients), stage-to-stage activations and "
          f"expert all-to-alls at {args.link_gbs:g} GB/s per GPU{', each with the vocabulary layers shared by every stage and not' if shareable else ''}; "
          f"ep = pipeline.expert_parallel, ckpt = activation checkpointing: {len(feasible)} of {len(cands)} plans fit "
          f"in 90% of {args.gpu_memory} and run; the best:")
    print(f"  {'stages':>6} {'dp':>3} {'ep':>3} {'ckpt':>4} {'m':>4} {'mb size':>7} {'s/step':>7} {'tokens/s':>10} "
          f"{'bubble':>7} {'imbal.':>7} {'reduce stall':>12} {'GB/GPU':>7}  feasible  vocab  layers per stage")
    for c in (feasible or cands)[: args.top]:
        why = "yes" if c.feasible else ("over memory" if not c.fits else "m < p")
        stall = f"{reduction_stall(recipe, c):.3g} s" if c.runnable else "-"
        print(f"  {c.num_stages:>6} {c.dp:>3} {c.expert_parallel:>3} {'on' if c.checkpointed else 'off':>4} "
              f"{c.num_microbatches:>4} {c.microbatch_size:>7} {c.step_s:>7.3g} "
              f"{c.tokens_per_s:>10,.0f} {c.bubble:>7.1%} {c.imbalance:>7.1%} {stall:>12} {gb(c.memory):>7}  {why:<8}  "
              f"{'shared' if c.vocab_parallel else 'last':<6} {c.layers_per_stage}")
    if feasible:
        print(f"  best: {feasible[0].overrides()} on {gpus} GPUs ({feasible[0].dp} data-parallel replicas)")
        print(without_checkpointing(recipe, cands))


def without_checkpointing(recipe, cands) -> str:
    """Whether a layout without activation checkpointing fits, and what the fastest one gains over the fastest with
    it (the backward's replay of every forward saved)."""
    feasible = [c for c in cands if c.feasible]
    off = [c for c in feasible if not c.checkpointed]
    on = [c for c in feasible if c.checkpointed]
    if not off:
        return "  without activation checkpointing no layout fits"
    if not on:
        return f"  without activation checkpointing: {off[0].step_s:.3g} s/step (no layout with it fits)"
    b, a = off[0], on[0]
    return (f"  without activation checkpointing the fastest layout that fits runs {b.step_s:.3g} s/step "
            f"({b.num_stages} stages x {b.dp} replicas, expert_parallel {b.expert_parallel}, {gb(b.memory)} GB/GPU), "
            f"{a.step_s / b.step_s:.2f}x the speed of the fastest with it ({a.step_s:.3g} s/step: {a.num_stages} "
            f"stages x {a.dp} replicas, expert_parallel {a.expert_parallel})")


def measure(recipe, plan, p: int, device: str | None, link_gbs: float) -> None:
    import torch  # see report()

    from ..model.build import autocast, build_model
    from ..model.fused_loss import use_fused_loss
    from ..optim import apply_delay_correction, build_optimizer
    from ..plan.costs import measure_costs, trainer_compile
    from ..plan.search import simulate_schedules

    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cpu":
        torch.set_num_threads(1)  # as one pipeline rank on CPU
    torch.manual_seed(0)
    opt = recipe.optimizer
    factory = lambda stage: apply_delay_correction(build_optimizer(stage, opt, log=lambda *_: None), opt)
    backend = trainer_compile(recipe.training)
    with autocast(recipe.training.bf16):  # as the run computes (and as layers_per_stage: auto measures)
        model = build_model(recipe.model)
        c = measure_costs(model, recipe.data.seq_len, recipe.pipeline.microbatch_size, device, optimizer=factory,
                          split_backward=True, fused_loss=use_fused_loss(recipe.training.fused_loss, model),
                          compile_backend=backend)
    m = recipe.pipeline.num_microbatches
    mid = sorted(c.layers)[len(c.layers) // 2]
    print(f"\nmeasured on {device}, {f'layers compiled ({backend})' if backend else 'eager layers'} "
          f"(forward + backward per microbatch of {recipe.pipeline.microbatch_size} x {recipe.data.seq_len}): "
          f"layer {mid * 1e3:.1f} ms (median), embedding +{c.first * 1e3:.1f} ms, "
          f"head and loss +{c.last * 1e3:.1f} ms ({c.last / mid:.1f} layers); optimizer step per layer "
          f"{sorted(c.layer_steps)[len(c.layer_steps) // 2] * 1e3:.1f} ms (median), counted 1/{m} per microbatch")
    flops_split = [len(s.layers) for s in plan.stages]
    vocab = plan.vocab_parallel  # the head and loss measured, spread over every stage where they are shared
    time_split = c.balance(p, m, vocab)
    for name, split in (("cost model", flops_split), ("measured", time_split)):
        secs = c.stage_seconds(split, m, vocab)
        print(f"  {name:>10} split {split}: stage seconds {' '.join(f'{x * 1e3:.1f}' for x in secs)} ms, "
              f"slowest / mean {max(secs) / (sum(secs) / len(secs)):.3f}")
    if time_split != flops_split:
        print(f"  use the measured split: --pipeline.layers_per_stage=[{','.join(map(str, time_split))}] "
              "(or layers_per_stage: auto, which measures at start on the machine that trains)")
    costs = c.stage_costs(time_split, vocab)
    ms = lambda v: " ".join(f"{x * 1e3:.2f}" for x in v)
    split_ms = "" if backend else (f"  I [{ms(costs.backward_input)}]  W [{ms(costs.backward_weight)}]")
    print(f"\nthe schedules on the measured split {time_split}, simulated with the measured ms per stage (the first stage "
          f"has no input gradient: its W is its whole backward):\n  F [{ms(costs.forward)}]  B [{ms(costs.backward)}]"
          f"{split_ms}  step [{ms(costs.step)}]")
    # the measured stages ran whole experts on one device: expert parallelism's all-to-alls are added at --link-gbs
    sims = simulate_schedules(plan, recipe, p, costs=costs, measured=c, model=model, link_bytes_per_s=link_gbs * 1e9)
    refused = {}
    if backend:  # not simulated on made-up halves: the recipe checks refuse them with compiled layers
        refused = {name: ("refused with training.torch_compile on (a compiled layer runs its whole backward in I "
                          "and again in W)")
                   for name in sims if get_schedule(name).split_backward}
        sims = {name: sim for name, sim in sims.items() if name not in refused}
    print("\n".join(schedule_lines(sims, recipe, skipped={**not_planned(sims, plan.num_layers, recipe, p), **refused})))


if __name__ == "__main__":
    sys.exit(main())
