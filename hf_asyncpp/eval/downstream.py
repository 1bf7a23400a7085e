"""Zero-shot multiple-choice evaluation (HellaSwag, PIQA, ARC, MMLU) with lm-evaluation-harness's task definitions.

Published tables (MMLU, HellaSwag, PIQA, ARC) come from lm-evaluation-harness, so this scorer reproduces its
official tasks, not a variant of them: the same prompt (MMLU with its per-subject description line), the same
continuations (target delimiter ``" "`` + choice), the same tokenization (lm-eval's ``_encode_pair``: trailing
context whitespace moved into the continuation, the tokenizer's own special tokens, left truncation to the
model's length), the same metrics (``acc``: argmax of the summed log-likelihood; ``acc_norm``: divided by the
choice's length in characters *without* the delimiter; MMLU reports ``acc`` only, micro-averaged over subjects)
and the same ``limit`` (per task, i.e. per MMLU subject). ``tests/test_lm_eval_parity.py`` checks all of it
against lm-eval itself; ``lm_eval.py`` runs lm-eval instead of this scorer.

Why keep a scorer of our own: it needs no network, reads local files, and scores an in-memory model (during
training, on the training device). Task data comes through ``datasets``: the Hub id, or local json/jsonl/parquet
files in the Hub record format (or the normalized ``{"context", "choices", "label"}``, choices as scored, with
their leading space; the registry is ``tasks.py``). Metrics go through the ``evaluate`` modules the package ships.
"""
from __future__ import annotations

import math
from pathlib import Path

import torch
from accelerate.utils import find_executable_batch_size

from ..figures import pyplot
from ..model.nll import continuation_logprobs, request_batches
from .perplexity import evaluate_perplexity, load_metric, resolve_device
from .tasks import SCORER, TARGET_DELIMITER, load_task, task_spec


# ---------------------------------------------------------------------------------------------------
# scoring


def _prefix_token_id(tokenizer) -> int:
    return tokenizer.bos_token_id if tokenizer.bos_token_id is not None else tokenizer.eos_token_id


def _encode(tokenizer, text: str) -> list[int]:
    """lm-eval's ``HFLM.tok_encode``: the tokenizer's default special tokens (a BOS where the tokenizer adds one,
    as Llama's does), none when the text already starts with the prefix token."""
    prefix_id = _prefix_token_id(tokenizer)
    prefix = tokenizer.decode([prefix_id]) if prefix_id is not None else ""
    return tokenizer(text, add_special_tokens=not (prefix and text.startswith(prefix)))["input_ids"]


def encode_pair(tokenizer, context: str, continuation: str) -> tuple[list[int], list[int]]:
    """Token ids of (context, continuation) as lm-eval's ``loglikelihood`` makes them: trailing whitespace of the
    context moves into the continuation, context + continuation is encoded whole and split after the context's
    tokens; an empty context becomes the prefix (BOS, else EOS) token."""
    if not context:
        cont = tokenizer(continuation, add_special_tokens=False)["input_ids"]
        prefix = _prefix_token_id(tokenizer)
        return ([prefix], cont) if prefix != cont[0] else (cont[:1], cont[1:])
    n = len(context) - len(context.rstrip())
    if n:
        context, continuation = context[:-n], context[-n:] + continuation
    whole = _encode(tokenizer, context + continuation)
    ctx = _encode(tokenizer, context)
    return ctx, whole[len(ctx):]


def max_length(model, tokenizer, default: int = 2048) -> int:
    """The model's context length as lm-eval resolves it (config, then the tokenizer, then 2048): longer
    requests are truncated from the left."""
    cfg = getattr(model.config, "text_config", None) or model.config
    for attr in ("n_positions", "max_position_embeddings", "n_ctx"):
        if getattr(cfg, attr, None) is not None:
            return int(getattr(cfg, attr))
    limit = getattr(tokenizer, "model_max_length", None)
    return int(limit) if limit is not None and limit < int(1e30) else default


def _score_requests(model, requests: list[tuple[list[int], list[int]]], batch_size: int, pad_id: int,
                    length: int) -> list[float]:
    """Summed log p(continuation | context) of each request, batched on the model's device. The batch size starts
    at ``batch_size`` and halves on an out-of-memory error (accelerate's ``find_executable_batch_size``), so a
    large batch is safe on any device."""
    device = next(model.parameters()).device

    @find_executable_batch_size(starting_batch_size=batch_size)
    def run(bs: int) -> list[float]:
        scores = [0.0] * len(requests)
        for chunk, ids, lengths in request_batches(requests, bs, pad_id, length):
            logits = model(input_ids=ids.to(device)).logits
            for k, v in zip(chunk, continuation_logprobs(logits, chunk, lengths, requests).tolist()):
                scores[k] = v
        return scores

    return run()


@torch.no_grad()
def choice_logliks(model, tokenizer, items, batch_size: int = 16) -> list[list[float]]:
    """Summed log p(choice | context) for every choice of every item (see :func:`encode_pair`). ``model``: a model
    on one device, or a scorer with the model's ``config`` and ``score_requests(requests, batch_size, pad_id,
    length)`` that runs the batches elsewhere (``pipeline.forward_only.StageScorer``: through a pipeline's stages)."""
    requests = [encode_pair(tokenizer, ctx, c) for ctx, choices, _ in items for c in choices]
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    if not isinstance(model, torch.nn.Module):
        scores = model.score_requests(requests, batch_size, pad, max_length(model, tokenizer))
    else:
        was_training = model.training
        model.eval()
        try:
            scores = _score_requests(model, requests, batch_size, pad, max_length(model, tokenizer))
        finally:
            model.train(was_training)
    out, k = [], 0
    for _, choices, _ in items:
        out.append(scores[k : k + len(choices)])
        k += len(choices)
    return out


def _completion_len(continuation: str) -> int:
    """lm-eval's acc_norm denominator: the choice's length in characters, without the target delimiter."""
    return len(continuation.removeprefix(TARGET_DELIMITER))


def _argmax(values: list[float]) -> int:
    return max(range(len(values)), key=values.__getitem__)  # the first of equal maxima, as numpy's argmax


def predictions(logliks: list[list[float]], items) -> dict[str, list[int]]:
    """``{acc: [choice], acc_norm: [choice]}`` per item, as lm-eval's ``process_results`` picks them: the argmax of
    the summed log-likelihoods, and of those divided by each choice's length in characters without the delimiter."""
    norm = [[x / n if (n := _completion_len(c)) else -math.inf for x, c in zip(s, it[1])] for s, it in zip(logliks, items)]
    return {"acc": [_argmax(s) for s in logliks], "acc_norm": [_argmax(s) for s in norm]}


def score_task(model, tokenizer, items, batch_size: int = 16, metrics=("acc", "acc_norm"), subjects=None) -> dict:
    """``{acc, acc_norm, n, chance}`` of the items (only the ``metrics`` asked for). With ``subjects`` (one per
    item), also ``subjects: {subject: {acc, n}}``; ``acc`` stays the micro-average over all items, as lm-eval's
    ``mmlu`` group (``weight_by_size``)."""
    ll = choice_logliks(model, tokenizer, items, batch_size)
    refs = [label for _, _, label in items]
    preds = predictions(ll, items)
    acc = load_metric("accuracy")
    res = {m: acc.compute(predictions=preds[m], references=refs)["accuracy"] for m in metrics}
    res.update(n=len(items), chance=sum(1 / len(c) for _, c, _ in items) / len(items))
    if subjects is not None and any(s is not None for s in subjects):
        res["subjects"] = {}
        for s in sorted(set(subjects)):
            idx = [i for i, x in enumerate(subjects) if x == s]
            res["subjects"][s] = {"acc": acc.compute(predictions=[preds["acc"][i] for i in idx],
                                                    references=[refs[i] for i in idx])["accuracy"], "n": len(idx)}
    return res


def score_tasks(model, tokenizer, task_items: dict[str, tuple], batch_size: int = 16, limit: int | None = None) -> dict:
    """``{task: metrics}`` of loaded tasks (``{task: (items, subjects)}``), each with what it was measured on:
    ``n``, ``limit``, ``num_fewshot`` and the ``scorer``."""
    out = {}
    for t, (items, subjects) in task_items.items():
        res = score_task(model, tokenizer, items, batch_size, task_spec(t).metrics, subjects)
        out[t] = {**res, "limit": limit, "num_fewshot": 0, "scorer": SCORER}
    return out


def check_model_dir(path) -> None:
    p = Path(path)
    for needed, what in (("config.json", "config"), ("tokenizer_config.json", "tokenizer")):
        if not (p / needed).exists():
            raise FileNotFoundError(f"{p}: no {needed}; the {what} is missing (is it a model folder? export a checkpoint "
                                    "with hf-asyncpp export)")


def evaluate_models(model_dirs: list[str], tasks: list[str], *, task_files: dict[str, str] | None = None,
                    limit: int | None = None, perplexity_blocks=None, batch_size: int = 16, device=None,
                    backend: str = "hf_asyncpp") -> dict[str, dict[str, dict]]:
    """{model_dir: {task: metrics}} for every model and task (perplexity needs ``perplexity_blocks``: token blocks,
    or a function of a model's tokenizer that makes them, so that models with other vocabularies each read the
    text in their own ids).

    Runs on ``device`` (None: the current accelerator, as in training, else the CPU). ``backend="lm_eval"`` scores
    the tasks (any lm-eval task name) with lm-evaluation-harness itself; perplexity stays ours.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer  # heavy: only when scoring

    device = resolve_device(device)
    mc_tasks = [t for t in tasks if t != "perplexity"]
    if backend == "hf_asyncpp":
        for t in mc_tasks:
            task_spec(t)
        items = {t: load_task(t, (task_files or {}).get(t), limit) for t in mc_tasks}
    elif backend != "lm_eval":
        raise ValueError(f"unknown backend {backend!r}; choose hf_asyncpp or lm_eval")
    if "perplexity" in tasks and perplexity_blocks is None:
        raise ValueError("task perplexity needs --data files")
    results = {}
    for d in model_dirs:
        check_model_dir(d)
        if backend == "lm_eval":
            try:
                from .lm_eval import evaluate_with_lm_eval  # optional dependency (the `eval` extra)
            except ImportError as e:
                raise ImportError(f"backend lm_eval needs lm-evaluation-harness ({e}); pip install hf_asyncpp[eval]") from e

            res = evaluate_with_lm_eval(d, mc_tasks, task_files=task_files, limit=limit, device=device,
                                        batch_size=batch_size)[0] if mc_tasks else {}
            model = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).to(device) if "perplexity" in tasks else None
        else:
            model = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).to(device)
            res = score_tasks(model, AutoTokenizer.from_pretrained(d), items, batch_size, limit)
        if "perplexity" in tasks:  # a callable tokenizes for this model: ids are only comparable within a vocabulary
            blocks = perplexity_blocks(AutoTokenizer.from_pretrained(d)) if callable(perplexity_blocks) else perplexity_blocks
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
        metrics = ["eval_ppl"] if t == "perplexity" else [m for m in ("acc", "acc_norm") if m in res]
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
