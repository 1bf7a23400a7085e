"""A pipelined run's report: where each stage's time went, and the simulator's timeline from those times.

``pipeline_profile.json`` gives per stage its share of time busy (forward, backward, optimizer step, reduction
posts) and waiting (receives), and the forward/backward/step means; ``pipeline_timeline.png`` is the simulator's
timeline of the recipe's schedule fed with the measured per-action means: is a stage the bottleneck, are there
bubbles. ``PipelineEngine.profile()`` gathers the measurements (``pipeline.executor.gather_action_times``).
"""
from __future__ import annotations

import logging
from pathlib import Path


from ..config.sections import PipelineConfig
from ..schedules.records import get_schedule
from ..schedules.simulator import Costs, simulate
from ..schedules.timeline import plot_timeline
from ..storage.names import PROFILE, TIMELINE
from ..storage.write import json_text, replace_file, write_file

log = logging.getLogger("hf_asyncpp")

BUSY = ("F", "B", "STEP", "REDUCE")
WAITING = ("RECV_ACT", "RECV_GRAD")


def stage_shares(seconds: dict[str, float]) -> tuple[float, float]:
    """(busy, waiting) shares of a stage's measured action time."""
    total = sum(seconds.values()) or 1.0
    return (sum(seconds.get(k, 0.0) for k in BUSY) / total, sum(seconds.get(k, 0.0) for k in WAITING) / total)


def write_report(out: Path, prof: list[dict], pipeline: PipelineConfig, max_grad_norm: float) -> dict | None:
    """Write pipeline_profile.json and pipeline_timeline.png into ``out``, each atomically (``replace_file``);
    returns the summary for the run's log.
    A process that trained no step (a run resumed at its end to finish its export) measured nothing: it writes
    nothing and returns None, so the run's measured report is never replaced by an empty one (all zeros, a
    "bubble 100%" picture)."""
    if not any(st["counts"].get("F") for st in prof):
        log.info("pipeline: no step trained in this process: %s and %s are left as they are", PROFILE, TIMELINE)
        return None
    sched = get_schedule(pipeline.schedule)
    stages = []
    for st in prof:
        sec, cnt = st["seconds"], st["counts"]
        busy, waiting = stage_shares(sec)
        per = {k: sec.get(k, 0.0) / max(1, cnt.get(k, 0)) for k in ("F", "B", "STEP")}
        stages.append({"stage": st["stage"], "busy_share": busy, "waiting_share": waiting,
                       "forward_ms": per["F"] * 1e3, "backward_ms": per["B"] * 1e3, "step_ms": per["STEP"] * 1e3,
                       "seconds": sec, "counts": cnt})
    costs = Costs.from_measured([st["seconds"] for st in prof], [st["counts"] for st in prof])
    m, steps = sched.representative(pipeline.num_stages, pipeline.num_microbatches)
    extra = pipeline.extra_warmup if sched.extra_warmup_ok else 0
    sim = simulate(sched.actions(pipeline.num_stages, m, steps, extra_warmup=extra), costs, sched,
                   reduce_scope=sched.reduce_scope(max_grad_norm))
    report = {"schedule": sched.name, "stages": stages, "simulated_bubble": sim.bubble,
              "simulated_steady_bubble": sim.steady_bubble}
    # each whole or not at all (a temporary name beside it, then renamed): a kill or a full disk mid-write leaves
    # the previous report, never half of one
    data = json_text(report, indent=1).encode()
    replace_file(out / PROFILE, lambda tmp: write_file(tmp, lambda f: f.write(data)))
    replace_file(out / TIMELINE, lambda tmp: plot_timeline(
        sim, str(tmp), f"{sched.name} on {pipeline.num_stages} stages: measured per-action means ({steps} steps)"))
    log.info("pipeline: %s; simulated steady-state bubble %.1f%% (pipeline_timeline.png)", ", ".join(
        f"stage {s['stage']} busy {s['busy_share']:.0%} (F {s['forward_ms']:.1f} ms, B {s['backward_ms']:.1f} ms), "
        f"waiting {s['waiting_share']:.0%}" for s in stages), 100 * sim.steady_bubble)
    return {"simulated_steady_bubble": sim.steady_bubble, "busy": [s["busy_share"] for s in stages]}


