"""Split every causal-LM type of the installed transformers into 2, 3 and 4 stages; write docs/supported-models.md.

    OMP_NUM_THREADS=1 python scripts/partition_sweep.py [--types llama mamba ...] [--no-write]

Each type is built tiny (4 layers, hidden 64, vocab 512, 4 experts top-2) and compared with the unpartitioned
model: loss (relative 1e-5) and every gradient (|g - ref| <= 1e-6 + 1e-5 |ref|), fp32, eval mode.
"""
from __future__ import annotations

import argparse
import signal
import time
from pathlib import Path

import torch

from hf_asyncpp.partition.sweep import Verdict, causal_lm_types, check_type

DOC = Path(__file__).resolve().parents[1] / "docs" / "supported-models.md"


def _timeout(*_):
    raise TimeoutError("over the per-type time limit")


def render(rows: list[Verdict], version: str) -> str:
    tried = [r for r in rows if r.verdict != "skipped"]
    exact = [r for r in tried if r.verdict == "exact"]
    out = ["# Supported models", "",
           f"Every causal-LM type registered in the installed transformers ({version}: `MODEL_FOR_CAUSAL_LM_MAPPING_NAMES`, "
           f"{len(rows)} types), built tiny (4 layers, hidden 64, vocab 512, MoE with 4 experts top-2) and split into 2, 3 "
           "and 4 stages by `scripts/partition_sweep.py`. **exact**: the chained stages give the unpartitioned model's loss "
           "(relative 1e-5) and every gradient (|g - ref| <= 1e-6 + 1e-5 |ref|), fp32, eval mode, at each stage count. "
           "Types that are encoder-decoder, multimodal or not causal are skipped with the reason.", "",
           f"**{len(exact)} of {len(tried)} decoder-only text types split exactly ({len(exact) / max(1, len(tried)):.1%}).** "
           f"{len(rows) - len(tried)} types skipped.", "",
           f"Generated with transformers {version}, torch {torch.__version__}. Regenerate with the pinned versions "
           "(`constraints.txt`): `OMP_NUM_THREADS=1 python scripts/partition_sweep.py`; a newer transformers: "
           "`bash scripts/test.sh --latest`, then the same command with `.venv-latest/bin/python`.", "",
           "| type | verdict | reason |", "|---|---|---|"]
    for r in rows:
        reason = r.reason.replace("|", "\\|").replace("\n", " ")
        out.append(f"| `{r.model_type}` | {r.verdict} | {reason} |")
    return "\n".join(out) + "\n"


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--types", nargs="*")
    ap.add_argument("--no-write", action="store_true")
    ap.add_argument("--limit-s", type=int, default=120, help="time limit per type")
    args = ap.parse_args()
    torch.set_num_threads(1)
    import transformers

    transformers.logging.set_verbosity_error()
    signal.signal(signal.SIGALRM, _timeout)
    rows, t0 = [], time.perf_counter()
    for t in args.types or causal_lm_types():
        signal.alarm(args.limit_s)
        try:
            r = check_type(t)
        except Exception as e:
            r = Verdict(t, "error", f"{type(e).__name__}: {str(e)[:160]}")
        finally:
            signal.alarm(0)
        rows.append(r)
        print(f"{t:28s} {r.verdict:8s} {r.seconds:5.1f}s {r.reason[:150]}", flush=True)
    tried = [r for r in rows if r.verdict != "skipped"]
    n_exact = sum(r.verdict == "exact" for r in tried)
    print(f"\n{n_exact}/{len(tried)} exact, {len(rows) - len(tried)} skipped, {time.perf_counter() - t0:.0f}s")
    if not args.no_write and not args.types:
        DOC.write_text(render(rows, transformers.__version__))
        print(f"wrote {DOC}")


if __name__ == "__main__":
    main()
