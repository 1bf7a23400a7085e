"""What a measured 2-stage run predicts for deeper pipelines: the simulator fed with the run's per-action costs.

    python bench/predict_scaling.py runs/cpu-tiny/pipeline_profile.json [--comm-ms 0] [--write]

Takes a run's measured mean forward, backward and optimizer-step seconds per stage (``pipeline_profile.json``,
written at the end of every pipelined run, or the per-action seconds the throughput benchmarks collect), adds them
up to the whole model's cost per microbatch and cuts that into p equal stages (a model deep enough to split evenly;
the measured imbalance of the 2-stage split is not carried over), then simulates 2BW and 1F1B at p = 4, 8, 16 with
m = p and m = 2p in steady state. Printed per (p, m): 2BW / 1F1B (the schedule's gain) and 2BW / the no-bubble
limit (p x one process's rate, which does m x (forward + backward) + one step of the whole model per step).

Assumptions, printed with the table: a transfer between stages takes ``--comm-ms`` (default 0: transfers hidden,
as isend/irecv overlap compute when a stage's input arrives before it is needed); the gradient reduction is free
(no data parallelism; the grad-norm scalar); a measured STEP includes any wait for its reduction. Per-action
overhead that grows with p (more, smaller messages) is not modelled, so the ratios are what the schedule allows,
an upper bound for the executor.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[0] = str(ROOT)

from hf_asyncpp.pipeline.planner import steady_step_time  # noqa: E402 (after the path set-up)
from hf_asyncpp.pipeline.schedules import ONE_F_ONE_B, TWO_BW  # noqa: E402
from hf_asyncpp.pipeline.simulator import Costs  # noqa: E402


def whole_model(seconds: list[dict], counts: list[dict]) -> dict[str, float]:
    """Per microbatch forward and backward, per step the optimizer step: summed over the measured stages."""
    c = Costs.from_measured(seconds, counts)
    return {"F": sum(c.forward), "B": sum(c.backward), "STEP": sum(c.step)}


def predict(seconds: list[dict], counts: list[dict], ps=(4, 8, 16), comm_s: float = 0.0) -> list[dict]:
    tot = whole_model(seconds, counts)
    rows = []
    for p in ps:
        for m in (p, 2 * p):
            costs = Costs(forward=tot["F"] / p, backward=tot["B"] / p, step=tot["STEP"] / p, comm=comm_s)
            t2, bubble2 = steady_step_time(TWO_BW, p, m, costs, "global")
            t1, bubble1 = steady_step_time(ONE_F_ONE_B, p, m, costs, "global")
            limit = (m * (tot["F"] + tot["B"]) + tot["STEP"]) / p
            rows.append({"p": p, "m": m, "2bw_s": t2, "1f1b_s": t1, "2bw_bubble": bubble2, "1f1b_bubble": bubble1,
                         "2bw_over_1f1b": t1 / t2, "2bw_over_limit": limit / t2})
    return rows


def table(rows: list[dict], tot: dict, comm_s: float) -> str:
    lines = [f"Measured whole-model costs: forward {tot['F'] * 1e3:.1f} ms and backward {tot['B'] * 1e3:.1f} ms per "
             f"microbatch, optimizer step {tot['STEP'] * 1e3:.1f} ms per step, cut into p equal stages; transfers "
             f"{comm_s * 1e3:g} ms each, reductions free, per-action overhead not modelled (an upper bound).", "",
             "| p | m | 2bw s/step | 1f1b s/step | 2bw bubble | 1f1b bubble | 2bw / 1f1b | 2bw / no-bubble limit |",
             "|---|---|---|---|---|---|---|---|"]
    lines += [f"| {r['p']} | {r['m']} | {r['2bw_s']:.3f} | {r['1f1b_s']:.3f} | {r['2bw_bubble']:.1%} | "
              f"{r['1f1b_bubble']:.1%} | {r['2bw_over_1f1b']:.2f} | {r['2bw_over_limit']:.2f} |" for r in rows]
    return "\n".join(lines)


def report(seconds: list[dict], counts: list[dict], comm_s: float = 0.0) -> str:
    return table(predict(seconds, counts, comm_s=comm_s), whole_model(seconds, counts), comm_s)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("profile", help="a run's pipeline_profile.json (or the run's folder)")
    ap.add_argument("--comm-ms", type=float, default=0.0, help="latency of one stage-to-stage transfer")
    ap.add_argument("--write", action="store_true", help="replace the predict-scaling section of docs/benchmarks.md")
    args = ap.parse_args()
    path = Path(args.profile)
    path = path / "pipeline_profile.json" if path.is_dir() else path
    stages = json.loads(path.read_text())["stages"]
    text = report([s["seconds"] for s in stages], [s["counts"] for s in stages], args.comm_ms / 1e3)
    print(text)
    if args.write:
        from bench.report import write_section

        write_section("predict-scaling", f"## Predicted at p = 4, 8, 16 from measured costs\n\nCommand: `python "
                      f"bench/predict_scaling.py {args.profile} --comm-ms {args.comm_ms:g} --write` "
                      f"({time.strftime('%Y-%m-%d')})\n\n{text}")


if __name__ == "__main__":
    main()
