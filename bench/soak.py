"""Long runs stay healthy: the README's main job (recipes/cpu-tiny.yaml, 2BW on 2 processes x 1 thread) for 2,000
steps under the streaming executor, with each rank's resident memory sampled while it trains and the step time
read from metrics.jsonl; per 100 steps: median step time and RSS. Flat means no growth from weight versions,
pending sends, step reports or metrics.

    python -m bench.soak [--steps 2000] [--write] [-- extra recipe overrides]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _descendants(pid: int) -> list[int]:
    children: dict[int, list[int]] = {}
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                ppid = int((d / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(d.name))
    out, todo = [], [pid]
    while todo:
        for c in children.get(todo.pop(), []):
            out.append(c)
            todo.append(c)
    return out


def _rank_rss_mb(launcher: int) -> dict[int, float]:
    """RSS (MB) of each training rank below the launcher, by the RANK in its environment."""
    rss = {}
    for pid in _descendants(launcher):
        try:
            env = dict(kv.split("=", 1) for kv in Path(f"/proc/{pid}/environ").read_text().split("\0") if "=" in kv)
            if "RANK" not in env or "pretrain.py" not in Path(f"/proc/{pid}/cmdline").read_text():
                continue
            kb = next(int(line.split()[1]) for line in Path(f"/proc/{pid}/status").read_text().splitlines()
                      if line.startswith("VmRSS:"))
        except (OSError, StopIteration, ValueError):
            continue
        rss[int(env["RANK"])] = kb / 1024
    return rss


def _last_step(metrics: Path) -> int:
    try:
        lines = metrics.read_text().splitlines()
    except OSError:
        return 0
    for line in reversed(lines):
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            continue
        if "loss" in row:
            return row["step"]
    return 0


def main():
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--steps", type=int, default=2000)
    ap.add_argument("--every", type=int, default=100)
    ap.add_argument("--write", action="store_true")
    ap.add_argument("overrides", nargs="*")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as d:
        out = Path(d) / "soak"
        cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", "recipes/accelerate/cpu-2proc.yaml",
               "scripts/pretrain.py", "recipes/cpu-tiny.yaml", f"--training.max_steps={args.steps}", "--training.export=false",
               "--training.report_to=none", f"--training.output_dir={out}", *args.overrides]
        env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_EVALUATE_OFFLINE": "1", "HF_HUB_OFFLINE": "1"}
        log = open(Path(d) / "log.txt", "w")
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
        samples: list[tuple[int, dict[int, float]]] = []
        while proc.poll() is None:
            step, rss = _last_step(out / "metrics.jsonl"), _rank_rss_mb(proc.pid)
            if rss and step:
                samples.append((step, rss))
            time.sleep(2.0)
        log.close()
        if proc.returncode != 0:
            raise RuntimeError((Path(d) / "log.txt").read_text()[-3000:])
        rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    train = {r["step"]: r["elapsed_s"] for r in rows if "loss" in r}
    table = ["| steps | median step ms | rank 0 RSS MB | rank 1 RSS MB |", "|---|---|---|---|"]
    stats = []
    for lo in range(0, args.steps, args.every):
        hi = min(lo + args.every, args.steps)
        dts = [train[k] - train[k - 1] for k in range(max(lo, 1) + 1, hi + 1) if k in train and k - 1 in train]
        rss = [s[1] for s in samples if lo < s[0] <= hi]
        r0 = max((x.get(0, 0.0) for x in rss), default=float("nan"))
        r1 = max((x.get(1, 0.0) for x in rss), default=float("nan"))
        med = 1e3 * statistics.median(dts) if dts else float("nan")
        stats.append((med, r0, r1))
        table.append(f"| {lo + 1}-{hi} | {med:.0f} | {r0:.0f} | {r1:.0f} |")
    steady = stats[1:]  # the first window includes the warm-up
    spread = lambda xs: (max(xs) - min(xs)) / min(xs)
    verdict = (f"After the first {args.every} steps: step time within {100 * spread([s[0] for s in steady]):.1f}% "
               f"(max - min over min of the per-{args.every} medians), RSS within {100 * spread([s[1] for s in steady]):.1f}% "
               f"(rank 0) and {100 * spread([s[2] for s in steady]):.1f}% (rank 1).")
    body = ("## Soak: 2BW for a long run\n\n"
            f"Command: `python -m bench.soak --steps {args.steps} --write {' '.join(args.overrides)}`".rstrip() +
            f" ({time.strftime('%Y-%m-%d')}; the default recipe, evaluation and checkpoint every 100 steps as it sets; "
            "RSS sampled every 2 s, the maximum per window; step time = the time between two steps' results)\n\n"
            + "\n".join(table) + "\n\n" + verdict)
    print(body)
    if args.write:
        from .report import write_section

        write_section("soak", body)


if __name__ == "__main__":
    main()
