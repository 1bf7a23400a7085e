"""What the host dispatches per action: aten ops (and the kernel-launching ones) per F, B, REDUCE and STEP, and every
scalar read of a step with its source line, for one stage with a real recipe's layout at a tiny width.

    python -m bench.host_overhead [--write]

The counts come from a ``TorchDispatchMode`` (``hf_asyncpp.testing.HostOps``) over the executor's own actions, in
steady state. They depend on the code and on the model's topology (layers, tensors, shape classes), not on its width
or on how busy the machine is, so a 2-core CPU run gives what a GPU's host dispatches for the same stage: the host's
share of a GPU step is these ops times the host's cost per op. A scalar read (``.item()``, ``float(t)``) of a tensor
on the device is a host sync there; reads inside one kernel are not dispatched and not counted (on CPU torch's
fused AdamW reads its step counters from host memory; on CUDA it reads them on the device, with no sync).
``tests/test_host_overhead.py`` holds the targets.

Layouts: smollm2-360m (32 Llama layers, tied embedding: 290 tensors, 224 of them Muon matrices) and moe-2b (Qwen3-MoE
experts as 3-D stacks), each as one stage (2BW, m = 4, Muon + EF, bf16 weight versions: ``training.bf16``) at
hidden size 24. Beside each stage's F and B: transformers' own model of the same layout, trained plainly
(``hf_asyncpp.testing.plain_ops_per_microbatch``), at the stage's precision (fp32 weights under bf16 autocast) and
with bf16 weights and no autocast (the eager ideal, other numerics). ``--write`` replaces the ``host-overhead``
section of docs/benchmarks/parts.md.
"""
from __future__ import annotations

import argparse
from pathlib import Path

from hf_asyncpp.testing import host_ops_per_step, micro_stage_recipe, plain_ops_per_microbatch, run_workers

ROOT = Path(__file__).resolve().parent.parent
BEFORE = {"smollm2-360m": {"F": (2793.5, 1624.0), "B": (5063.0, 3027.5), "REDUCE": (5.0, 5.0), "STEP": (9837.0, 7559.0),
                           "reads": 73, "swaps": 4}}
"""Measured by this script's counter at d6e578e (before the batched optimizer step), the same counts as an
independent count with a dispatch mode at the time (F 2,793.5, B 5,063, STEP 9,837, 73 scalar reads)."""
TARGETS = {"STEP launching": 150, "reads per step": 2}


def measure(name: str, layers: int | None = None) -> dict:
    """The stage's counts, with the plain model's per microbatch under "plain" (fp32 weights + autocast) and
    "plain bf16" (bf16 weights)."""
    recipe = micro_stage_recipe(ROOT / "recipes" / f"{name}.yaml", layers)
    res = run_workers(host_ops_per_step, 1, recipe)[0]
    res["plain"] = run_workers(plain_ops_per_microbatch, 1, recipe, False)[0]
    res["plain bf16"] = run_workers(plain_ops_per_microbatch, 1, recipe, True)[0]
    return res


def table(results: dict) -> str:
    lines = ["| layout (tensors: Muon / AdamW) | action | aten ops, before | aten ops now | kernel-launching, before | "
             "kernel-launching now | plain model, autocast: ops / launching | plain model, bf16 weights |",
             "|---|---|---|---|---|---|---|---|"]
    for name, res in results.items():
        t = res["tensors"]
        for kind in ("F", "B", "REDUCE", "STEP"):
            now = res["actions"][kind]
            before = BEFORE.get(name, {}).get(kind)
            b_ops, b_launch = (f"{before[0]:,.1f}", f"{before[1]:,.1f}") if before else ("-", "-")
            plain = [f"{res[k][kind]['ops']:,.0f} / {res[k][kind]['launching']:,.0f}" if kind in res[k] else "-"
                     for k in ("plain", "plain bf16")]
            lines.append(f"| {name} ({t['muon']} / {t['adamw']}) | {kind} | {b_ops} | {now['ops']:,.1f} | {b_launch} | "
                         f"{now['launching']:,.1f} | {plain[0]} | {plain[1]} |")
    lines += ["", "| layout | scalar reads per step, before | now | where (action: line, per step) | weight swaps per "
              "step, before | now |", "|---|---|---|---|---|---|"]
    for name, res in results.items():
        reads = res["reads_per_step"]
        where = "; ".join(f"{k}: {line} x{n:g}" for (k, line), n in sorted(reads.items()))
        before = BEFORE.get(name, {})
        lines.append(f"| {name} | {before.get('reads', '-')} | {sum(reads.values()):g} | {where} | "
                     f"{before.get('swaps', '-')} | {res['weight_swaps_per_step']:g} |")
    return "\n".join(lines)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--write", action="store_true", help="replace the host-overhead section of docs/benchmarks/parts.md")
    args = ap.parse_args(argv)
    results = {name: measure(name) for name in ("smollm2-360m", "moe-2b")}
    smol = results["smollm2-360m"]
    step = smol["actions"]["STEP"]["launching"]
    reads = sum(smol["reads_per_step"].values())
    fb = all(res["actions"][k][c] <= res["plain"][k][c] for res in results.values() for k in ("F", "B")
             for c in ("ops", "launching"))
    text = (f"### Host overhead per action (`python -m bench.host_overhead --write`)\n\n{table(results)}\n\n"
            f"Targets: STEP at most {TARGETS['STEP launching']} kernel-launching ops "
            f"(now {step:g}: {'met' if step <= TARGETS['STEP launching'] else 'not met'}); at most "
            f"{TARGETS['reads per step']} scalar reads per step, none of them a device sync (now {reads:g}: "
            f"{'met' if reads <= TARGETS['reads per step'] else 'not met'}); F and B per microbatch no more ops and "
            f"kernels than the plain model at the same precision, both layouts ({'met' if fb else 'not met'}: smollm2-360m's F "
            f"{smol['actions']['F']['ops'] / smol['plain']['F']['ops']:.2f}x, B "
            f"{smol['actions']['B']['ops'] / smol['plain']['B']['ops']:.2f}x; against bf16 weights without autocast, "
            f"another precision, {smol['actions']['F']['ops'] / smol['plain bf16']['F']['ops']:.2f}x and "
            f"{smol['actions']['B']['ops'] / smol['plain bf16']['B']['ops']:.2f}x: autocast keeps the norms, the "
            "rotary tables and the loss in fp32 and casts around them). Kernel-launching: every op but the views "
            "and the allocations (`hf_asyncpp.testing.launches_no_kernel`). Weight swaps: the times a step points "
            "the stage's modules at another version's weights (before: a `functional_call` per forward).")
    print(text)
    if args.write:
        from .report import write_section

        write_section("host-overhead", text)


if __name__ == "__main__":
    main()
