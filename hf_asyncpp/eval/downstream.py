"""Zero-shot tasks of exported models, several side by side: lm-evaluation-harness scores them, this module
reads the folders, adds perplexity, and draws the tables and charts.

The tasks, their prompts and metrics are lm-eval's (``lm_eval.py``: ``HFLM`` on each folder, tasks built from
lm-eval's YAMLs, local files through task YAMLs that include lm-eval's own). lm-eval is the ``eval`` extra: a
command or recipe that asks for a task without it installed stops at once with one line naming
``pip install hf_asyncpp[eval]`` (:func:`require_lm_eval`), and perplexity needs nothing more.
"""
from __future__ import annotations

import importlib.util
from pathlib import Path

import torch

from ..figures import pyplot
from .perplexity import evaluate_perplexity, resolve_device

EVAL_EXTRA = "pip install hf_asyncpp[eval]"


def zero_shot_tasks(tasks: list[str]) -> list[str]:
    """The tasks lm-eval scores: all but ``perplexity``."""
    return [t for t in tasks if t != "perplexity"]


def require_lm_eval(tasks: list[str], where: str) -> None:
    """ImportError, one line naming ``where`` and the extra, when ``tasks`` need lm-eval and it is not installed
    (looked up without importing it: checked before a run starts)."""
    if zero_shot_tasks(tasks) and importlib.util.find_spec("lm_eval") is None:
        raise ImportError(f"{where}: the zero-shot tasks {', '.join(zero_shot_tasks(tasks))} are scored by "
                          f"lm-evaluation-harness, which is not installed: {EVAL_EXTRA}")


def check_model_dir(path) -> None:
    p = Path(path)
    for needed, what in (("config.json", "config"), ("tokenizer_config.json", "tokenizer")):
        if not (p / needed).exists():
            raise FileNotFoundError(f"{p}: no {needed}; the {what} is missing (is it a model folder? export a checkpoint "
                                    "with hf-asyncpp export)")


def evaluate_models(model_dirs: list[str], tasks: list[str], *, task_files: dict[str, str] | None = None,
                    limit: int | None = None, perplexity_blocks=None, batch_size: int = 16, device=None,
                    taskset=None) -> dict[str, dict[str, dict]]:
    """{model_dir: {task: metrics}} for every model and task: the zero-shot tasks by lm-eval's ``HFLM`` on each
    folder (any lm-eval task or group name; the tasks are built once for all models, or given as ``taskset``),
    perplexity from ``perplexity_blocks`` (token blocks, or a function of a model's tokenizer that makes them, so
    that models with other vocabularies each read the text in their own ids).

    Runs on ``device`` (None: the current accelerator, as in training, else the CPU).
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer  # heavy: only when scoring

    device = resolve_device(device)
    mc_tasks = zero_shot_tasks(tasks)
    require_lm_eval(mc_tasks, "hf-asyncpp evaluate")
    if "perplexity" in tasks and perplexity_blocks is None:
        raise ValueError("task perplexity needs --data files")
    for d in model_dirs:
        check_model_dir(d)
    if mc_tasks:
        from . import lm_eval  # the `eval` extra: imported only when a task asks for it

        taskset = taskset or lm_eval.load_tasks(mc_tasks, task_files, limit)
    results = {}
    for d in model_dirs:
        model = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).to(device)
        tokenizer = AutoTokenizer.from_pretrained(d)
        res = lm_eval.score(lm_eval.hf_lm(model, tokenizer, batch_size=batch_size), taskset)[0] if mc_tasks else {}
        if "perplexity" in tasks:  # a callable tokenizes for this model: ids are only comparable within a vocabulary
            blocks = perplexity_blocks(tokenizer) if callable(perplexity_blocks) else perplexity_blocks
            res["perplexity"] = evaluate_perplexity(model, blocks, batch_size)
        results[str(d)] = res
    return results


# ---------------------------------------------------------------------------------------------------
# tables and charts


def headline_metric(res: dict) -> str:
    """acc_norm where the task reports it (HellaSwag, PIQA, ARC), else acc (MMLU), as lm-eval's tables do."""
    return "acc_norm" if "acc_norm" in res else "acc"


def model_names(model_dirs: list[str]) -> list[str]:
    """A distinct short name per model folder: the folder's own name, with as many parent folders as it takes to
    tell the models apart (``runs/sync/export`` and ``runs/async/export`` are ``sync/export`` and ``async/export``)."""
    parts = [Path(d).resolve().parts for d in model_dirs]
    for depth in range(1, max(len(p) for p in parts) + 1):
        names = ["/".join(p[-depth:]) for p in parts]
        if len(set(names)) == len(names):
            return names
    return [str(d) for d in model_dirs]  # the same folder twice: its path each time


def results_table(results: dict[str, dict[str, dict]], names: list[str] | None = None) -> str:
    models = list(results)
    first = next(iter(results.values()))
    lines = ["| task | metric | " + " | ".join(names or model_names(models)) + " |", "|---|---|" + "---|" * len(models)]
    for t, res in first.items():
        metrics = ["eval_perplexity"] if t == "perplexity" else [m for m in ("acc", "acc_norm") if m in res]
        for m in metrics:
            lines.append(f"| {t} | {m} | " + " | ".join(f"{results[d][t][m]:.4f}" for d in models) + " |")
    return "\n".join(lines)


def plot_results(results: dict[str, dict[str, dict]], path, names: list[str] | None = None) -> str:
    plt = pyplot()

    models = list(results)
    first = next(iter(results.values()))
    tasks = [t for t in first if t != "perplexity"]
    fig, ax = plt.subplots(figsize=(max(5, 1.6 * len(tasks) * len(models) / 2 + 3), 4))
    width = 0.8 / max(1, len(models))
    for k, (d, name) in enumerate(zip(models, names or model_names(models))):
        ax.bar([i + k * width for i in range(len(tasks))], [results[d][t][headline_metric(results[d][t])] for t in tasks],
               width, label=name)
    chance = [(i, first[t]["chance"]) for i, t in enumerate(tasks) if "chance" in first[t]]
    if chance:
        ax.scatter([i + 0.4 - width / 2 for i, _ in chance], [c for _, c in chance], marker="_", s=400, color="black",
                   label="chance")
    ax.set_xticks([i + 0.4 - width / 2 for i in range(len(tasks))])
    ax.set_xticklabels([f"{t}\n({headline_metric(first[t])})" for t in tasks])
    ax.set_ylabel("accuracy")
    ax.set_ylim(0, 1)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return str(path)
