"""The gradient noise scale of a trained model (McCandlish et al. 2018, "An Empirical Model of Large-Batch
Training", appendix A): ``B_simple = tr(Sigma) / |G|^2``, the batch (in tokens) past which a larger batch stops
paying, estimated without bias from gradient norms at two batch sizes: one sequence (B_small) and all of them
(B_big), ``|G|^2 ~ (B_big |G_big|^2 - B_small |G_small|^2) / (B_big - B_small)`` and ``tr(Sigma) ~ (|G_small|^2 -
|G_big|^2) / (1 / B_small - 1 / B_big)``.

    python -m bench.noise_scale RUN_DIR [--sequences 256]

RUN_DIR is a finished run of scripts/pretrain.py (its ``export`` folder holds the model and the tokenizer; its
recipe names the data). Held-out blocks are used: the same distribution as training, never trained on.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
import yaml

ROOT = Path(__file__).resolve().parent.parent


def measure(run_dir: Path, sequences: int = 256) -> dict:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from hf_asyncpp.config.recipe import recipe_from_dict
    from hf_asyncpp.data.stream import eval_blocks

    recipe = recipe_from_dict(yaml.safe_load((run_dir / "recipe.yaml").read_text()))
    export = run_dir / "export"
    model = AutoModelForCausalLM.from_pretrained(export, dtype=torch.float32)
    tok = AutoTokenizer.from_pretrained(export)
    blocks = eval_blocks(recipe.data, tok, recipe.data.eval_files, sequences, recipe.data.train_files)
    params = [p for p in model.parameters() if p.requires_grad]
    total = [torch.zeros_like(p, dtype=torch.float64) for p in params]
    small = 0.0
    for ids in blocks:
        model.zero_grad(set_to_none=True)
        model(input_ids=ids[None], labels=ids[None]).loss.backward()
        g = [p.grad.double() for p in params]
        small += sum(float((x * x).sum()) for x in g)
        for t, x in zip(total, g):
            t += x
    n, seq = len(blocks), blocks.shape[1]
    g_small2 = small / n
    g_big2 = sum(float(((t / n) ** 2).sum()) for t in total)
    b_small, b_big = 1, n
    g2 = (b_big * g_big2 - b_small * g_small2) / (b_big - b_small)
    trace = (g_small2 - g_big2) / (1 / b_small - 1 / b_big)
    steps = int(json.loads((run_dir / "final_eval.json").read_text()).get("step", recipe.training.max_steps))
    return {"run": run_dir.name, "step": steps, "sequences": n, "seq_len": seq, "b_simple_sequences": trace / g2,
            "b_simple_tokens": trace / g2 * seq, "grad_norm2": g2, "trace_sigma": trace}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("run_dir")
    ap.add_argument("--sequences", type=int, default=256)
    args = ap.parse_args()
    torch.set_num_threads(1)
    print(json.dumps(measure(Path(args.run_dir), args.sequences), indent=1))


if __name__ == "__main__":
    main()
