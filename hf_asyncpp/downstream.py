"""Zero-shot multiple-choice evaluation (HellaSwag, PIQA, ARC, MMLU) by choice log-likelihood, as
lm-evaluation-harness scores it: acc = argmax of the summed log-probability of each choice given the
context; acc_norm = argmax of that sum divided by the choice's length in characters.

Task data comes through ``datasets``: the Hub id for users with network, or local json/jsonl/parquet files
in the same record format as the Hub dataset (or the normalized ``{"context", "choices", "label"}``).
Metrics go through the ``evaluate`` modules the package ships.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from .evaluation import evaluate_perplexity, load_metric


@dataclass(frozen=True)
class Task:
    hub_id: str
    hub_config: str | None
    split: str
    convert: Callable[[dict], tuple[str, list[str], int]]
    fields: tuple[str, ...]  # keys a record of this task must have


def _hellaswag_text(t: str) -> str:
    t = t.strip().replace(" [title]", ". ")
    t = re.sub(r"\[.*?\]", "", t)
    return t.replace("  ", " ")


def _hellaswag(r):
    ctx = r["ctx_a"] + " " + r["ctx_b"].capitalize()
    return _hellaswag_text(r["activity_label"] + ": " + ctx), [" " + _hellaswag_text(e) for e in r["endings"]], int(r["label"])


def _piqa(r):
    return f"Question: {r['goal']}\nAnswer:", [" " + r["sol1"], " " + r["sol2"]], int(r["label"])


def _arc(r):
    labels = list(r["choices"]["label"])
    return f"Question: {r['question']}\nAnswer:", [" " + c for c in r["choices"]["text"]], labels.index(r["answerKey"])


def _mmlu(r):
    letters = "ABCD"[: len(r["choices"])]
    body = "\n".join(f"{letter}. {c}" for letter, c in zip(letters, r["choices"]))
    return f"{r['question'].strip()}\n{body}\nAnswer:", [f" {letter}" for letter in letters], int(r["answer"])


TASKS = {
    "hellaswag": Task("Rowan/hellaswag", None, "validation", _hellaswag, ("ctx_a", "ctx_b", "activity_label", "endings", "label")),
    "piqa": Task("baber/piqa", None, "validation", _piqa, ("goal", "sol1", "sol2", "label")),
    "arc_easy": Task("allenai/ai2_arc", "ARC-Easy", "test", _arc, ("question", "choices", "answerKey")),
    "arc_challenge": Task("allenai/ai2_arc", "ARC-Challenge", "test", _arc, ("question", "choices", "answerKey")),
    "mmlu": Task("cais/mmlu", "all", "test", _mmlu, ("question", "choices", "answer")),
}
NORMALIZED = ("context", "choices", "label")


def known_tasks() -> list[str]:
    return sorted(TASKS) + ["perplexity"]


def load_items(task: str, path: str | None = None, limit: int | None = None) -> list[tuple[str, list[str], int]]:
    """(context, choices, label) items of a task, from local files or the Hub (streamed)."""
    import datasets

    if task not in TASKS:
        raise ValueError(f"unknown task {task!r}; known tasks: {', '.join(known_tasks())}")
    spec = TASKS[task]
    if path:
        kind = "parquet" if str(path).endswith(".parquet") else "json"
        ds = datasets.load_dataset(kind, data_files=[str(path)], split="train", streaming=True)
    else:
        ds = datasets.load_dataset(spec.hub_id, spec.hub_config, split=spec.split, streaming=True)
    items = []
    for i, r in enumerate(ds):
        if limit is not None and len(items) >= limit:
            break
        try:
            if all(r.get(k) is not None for k in NORMALIZED):
                item = (str(r["context"]), [str(c) for c in r["choices"]], int(r["label"]))
            else:
                missing = [k for k in spec.fields if r.get(k) is None]  # json fills absent columns with null
                if missing:
                    raise KeyError(f"missing {missing}")
                item = spec.convert(r)
            if not 0 <= item[2] < len(item[1]):
                raise ValueError(f"label {item[2]} outside the {len(item[1])} choices")
        except (KeyError, ValueError, TypeError, IndexError) as e:
            raise ValueError(f"{path or spec.hub_id}: record {i} is not a {task} record ({e}); expected the fields "
                             f"{', '.join(spec.fields)} or {', '.join(NORMALIZED)}: {json.dumps(r)[:200]}") from None
        items.append(item)
    if not items:
        raise ValueError(f"{path or spec.hub_id}: no {task} records")
    return items


@torch.no_grad()
def choice_logliks(model, tokenizer, items, batch_size: int = 16) -> list[list[float]]:
    """Summed log p(choice | context) for every choice of every item (context and choice tokenized together)."""
    requests = []
    for ctx, choices, _ in items:
        ctx_ids = tokenizer(ctx, add_special_tokens=False)["input_ids"]
        for c in choices:
            whole = tokenizer(ctx + c, add_special_tokens=False)["input_ids"]
            cont = whole[len(ctx_ids):] if whole[: len(ctx_ids)] == ctx_ids else tokenizer(c, add_special_tokens=False)["input_ids"]
            prefix = whole[: len(whole) - len(cont)] or [tokenizer.eos_token_id]
            requests.append((prefix, cont))
    was_training = model.training
    model.eval()
    device = next(model.parameters()).device
    scores = []
    for i in range(0, len(requests), batch_size):
        chunk = requests[i : i + batch_size]
        seqs = [p + c for p, c in chunk]
        width = max(len(s) for s in seqs)
        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
        ids = torch.full((len(seqs), width), pad, dtype=torch.long)
        mask = torch.zeros((len(seqs), width), dtype=torch.long)
        for j, s in enumerate(seqs):
            ids[j, : len(s)] = torch.tensor(s)
            mask[j, : len(s)] = 1
        logp = torch.log_softmax(model(input_ids=ids.to(device), attention_mask=mask.to(device)).logits.float(), dim=-1).cpu()
        for j, (p, c) in enumerate(chunk):
            pos = torch.arange(len(p) - 1, len(p) + len(c) - 1)
            scores.append(float(logp[j, pos, torch.tensor(c)].sum()))
    model.train(was_training)
    out, k = [], 0
    for _, choices, _ in items:
        out.append(scores[k : k + len(choices)])
        k += len(choices)
    return out


def score_task(model, tokenizer, items, batch_size: int = 16) -> dict:
    ll = choice_logliks(model, tokenizer, items, batch_size)
    refs = [label for _, _, label in items]
    pred = [max(range(len(s)), key=s.__getitem__) for s in ll]
    pred_norm = [max(range(len(s)), key=lambda c: s[c] / max(1, len(items[i][1][c]))) for i, s in enumerate(ll)]
    acc = load_metric("accuracy")
    return {"acc": acc.compute(predictions=pred, references=refs)["accuracy"],
            "acc_norm": acc.compute(predictions=pred_norm, references=refs)["accuracy"],
            "n": len(items), "chance": sum(1 / len(c) for _, c, _ in items) / len(items)}


def check_model_dir(path) -> None:
    p = Path(path)
    for needed, what in (("config.json", "config"), ("tokenizer_config.json", "tokenizer")):
        if not (p / needed).exists():
            raise FileNotFoundError(f"{p}: no {needed}; the {what} is missing (is it a model folder? export a checkpoint "
                                    "with hf-asyncpp export)")


def evaluate_models(model_dirs: list[str], tasks: list[str], *, task_files: dict[str, str] | None = None,
                    limit: int | None = None, perplexity_blocks=None, batch_size: int = 16) -> dict[str, dict[str, dict]]:
    """{model_dir: {task: metrics}} for every model and task (perplexity needs ``perplexity_blocks``)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer  # heavy: only when scoring

    for t in tasks:
        if t not in known_tasks():
            raise ValueError(f"unknown task {t!r}; known tasks: {', '.join(known_tasks())}")
    items = {t: load_items(t, (task_files or {}).get(t), limit) for t in tasks if t != "perplexity"}
    results = {}
    for d in model_dirs:
        check_model_dir(d)
        model = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32)
        tok = AutoTokenizer.from_pretrained(d)
        res = {t: score_task(model, tok, it, batch_size) for t, it in items.items()}
        if "perplexity" in tasks:
            if perplexity_blocks is None:
                raise ValueError("task perplexity needs --data files")
            res["perplexity"] = evaluate_perplexity(model, perplexity_blocks, batch_size)
        results[str(d)] = res
    return results


def results_table(results: dict[str, dict[str, dict]]) -> str:
    models = list(results)
    tasks = list(next(iter(results.values())))
    lines = ["| task | metric | " + " | ".join(Path(m).name or m for m in models) + " |", "|---|---|" + "---|" * len(models)]
    for t in tasks:
        metrics = ["eval_ppl"] if t == "perplexity" else ["acc", "acc_norm"]
        for m in metrics:
            lines.append(f"| {t} | {m} | " + " | ".join(f"{results[d][t][m]:.4f}" for d in models) + " |")
    return "\n".join(lines)


def plot_results(results: dict[str, dict[str, dict]], path) -> str:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    models = list(results)
    tasks = [t for t in next(iter(results.values())) if t != "perplexity"]
    fig, ax = plt.subplots(figsize=(max(5, 1.6 * len(tasks) * len(models) / 2 + 3), 4))
    width = 0.8 / max(1, len(models))
    for k, d in enumerate(models):
        ax.bar([i + k * width for i in range(len(tasks))], [results[d][t]["acc_norm"] for t in tasks], width,
               label=Path(d).name or d)
    if tasks:
        ax.scatter([i + 0.4 - width / 2 for i in range(len(tasks))], [results[models[0]][t]["chance"] for t in tasks],
                   marker="_", s=400, color="black", label="chance")
    ax.set_xticks([i + 0.4 - width / 2 for i in range(len(tasks))])
    ax.set_xticklabels(tasks)
    ax.set_ylabel("acc_norm")
    ax.set_ylim(0, 1)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return str(path)
