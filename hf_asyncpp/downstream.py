"""Zero-shot multiple-choice evaluation (HellaSwag, PIQA, ARC, MMLU) with lm-evaluation-harness's task definitions.

Published tables (MMLU, HellaSwag, PIQA, ARC) come from lm-evaluation-harness, so this scorer reproduces its
official tasks, not a variant of them: the same prompt (MMLU with its per-subject description line), the same
continuations (target delimiter ``" "`` + choice), the same tokenization (lm-eval's ``_encode_pair``: trailing
context whitespace moved into the continuation, the tokenizer's own special tokens, left truncation to the
model's length), the same metrics (``acc``: argmax of the summed log-likelihood; ``acc_norm``: divided by the
choice's length in characters *without* the delimiter; MMLU reports ``acc`` only, micro-averaged over subjects)
and the same ``limit`` (per task, i.e. per MMLU subject). ``tests/test_lm_eval_parity.py`` checks all of it
against lm-eval itself; ``lm_eval_backend.py`` runs lm-eval instead of this scorer.

Why keep a scorer of our own: it needs no network, reads local files, and scores an in-memory model (during
training, on the training device). Task data comes through ``datasets``: the Hub id, or local json/jsonl/parquet
files in the Hub record format (or the normalized ``{"context", "choices", "label"}``, choices as scored, with
their leading space). Metrics go through the ``evaluate`` modules the package ships.
"""
from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Callable, NamedTuple

import torch
from accelerate.utils import find_executable_batch_size

from . import __version__
from .evaluation import evaluate_perplexity, load_metric, resolve_device
from .reporting import METRICS
from .storage import write_file

TARGET_DELIMITER = " "
"""lm-eval's default ``target_delimiter``, the same for all five tasks: continuation = delimiter + choice."""
SCORER = f"hf_asyncpp {__version__}"
MMLU_DESCRIPTION = "The following are multiple choice questions (with answers) about {}.\n\n"


class Item(NamedTuple):
    context: str
    choices: list[str]
    """Continuations as scored: the target delimiter + the choice."""
    label: int


@dataclass(frozen=True)
class Task:
    hub_id: str
    hub_config: str | None
    split: str
    convert: Callable[[dict], Item]
    fields: tuple[str, ...]  # keys a record of this task must have
    lm_eval_task: str  # the lm-eval task (or group) with the same definition
    metrics: tuple[str, ...] = ("acc", "acc_norm")


def _hellaswag_text(t: str) -> str:
    t = t.strip().replace(" [title]", ". ")
    t = re.sub(r"\[.*?\]", "", t)
    return t.replace("  ", " ")


def _delimited(choices) -> list[str]:
    return [TARGET_DELIMITER + str(c) for c in choices]


def _hellaswag(r):
    ctx = r["ctx_a"] + " " + r["ctx_b"].capitalize()
    return Item(_hellaswag_text(r["activity_label"] + ": " + ctx), _delimited(_hellaswag_text(e) for e in r["endings"]),
                int(r["label"]))


def _piqa(r):
    return Item(f"Question: {r['goal']}\nAnswer:", _delimited([r["sol1"], r["sol2"]]), int(r["label"]))


def _arc(r):
    labels = list(r["choices"]["label"])
    return Item(f"Question: {r['question']}\nAnswer:", _delimited(r["choices"]["text"]), labels.index(r["answerKey"]))


def _mmlu(r):
    # lm-eval's doc_to_text names four options whatever the row holds; cais/mmlu rows always have four
    body = "\n".join(f"{letter}. {r['choices'][i]}" for i, letter in enumerate("ABCD"))
    description = MMLU_DESCRIPTION.format(r["subject"].replace("_", " "))
    return Item(f"{description}{r['question'].strip()}\n{body}\nAnswer:", _delimited("ABCD"), int(r["answer"]))


_MMLU_FIELDS = ("question", "subject", "choices", "answer")
TASKS = {
    "hellaswag": Task("Rowan/hellaswag", None, "validation", _hellaswag, ("ctx_a", "ctx_b", "activity_label", "endings", "label"),
                      "hellaswag"),
    "piqa": Task("baber/piqa", None, "validation", _piqa, ("goal", "sol1", "sol2", "label"), "piqa"),
    "arc_easy": Task("allenai/ai2_arc", "ARC-Easy", "test", _arc, ("question", "choices", "answerKey"), "arc_easy"),
    "arc_challenge": Task("allenai/ai2_arc", "ARC-Challenge", "test", _arc, ("question", "choices", "answerKey"), "arc_challenge"),
    "mmlu": Task("cais/mmlu", "all", "test", _mmlu, _MMLU_FIELDS, "mmlu", ("acc",)),
}
NORMALIZED = ("context", "choices", "label")


def task_spec(task: str) -> Task:
    """The spec of a task name: one of :data:`TASKS` or ``mmlu_<subject>`` (one MMLU subject, as lm-eval names it)."""
    if task in TASKS:
        return TASKS[task]
    if task.startswith("mmlu_"):
        subject = task.removeprefix("mmlu_")
        return Task("cais/mmlu", subject, "test", _mmlu, _MMLU_FIELDS, task, ("acc",))
    raise ValueError(f"unknown task {task!r}; known tasks: {', '.join(known_tasks())}, mmlu_<subject>")


def known_tasks() -> list[str]:
    return sorted(TASKS) + ["perplexity"]


def _subject(task: str, record: dict) -> str | None:
    return record.get("subject") if task.startswith("mmlu") else None


def load_task(task: str, path: str | None = None, limit: int | None = None) -> tuple[list[Item], list[str | None]]:
    """(items, MMLU subject of each item or None) of a task, from a local file or the Hub (streamed).

    ``limit`` is applied as lm-eval applies it: the first ``limit`` documents of each task, and for MMLU each
    subject is a task (``mmlu`` with ``limit: 100`` scores 100 items of every subject, not the first subjects of
    the subject-sorted ``all`` split). ``mmlu_<subject>`` reads only that subject's rows of a local MMLU file.
    """
    import datasets

    spec = task_spec(task)
    if path:
        kind = "parquet" if str(path).endswith(".parquet") else "json"
        ds = datasets.load_dataset(kind, data_files=[str(path)], split="train", streaming=True)
    else:
        ds = datasets.load_dataset(spec.hub_id, spec.hub_config, split=spec.split, streaming=True)
    only = task.removeprefix("mmlu_") if task.startswith("mmlu_") else None
    items, subjects, per_subject = [], [], {}
    for i, r in enumerate(ds):
        subject = _subject(task, r)
        if only is not None and subject is not None and subject != only:
            continue
        if limit is not None and per_subject.get(subject, 0) >= limit:
            if subject is None:
                break  # one task, no subjects: the first `limit` documents
            continue
        try:
            if all(r.get(k) is not None for k in NORMALIZED):
                item = Item(str(r["context"]), [str(c) for c in r["choices"]], int(r["label"]))
            else:
                missing = [k for k in spec.fields if r.get(k) is None]  # json fills absent columns with null
                if missing:
                    raise KeyError(f"missing {missing}")
                item = spec.convert(r)
            if not 0 <= item.label < len(item.choices):
                raise ValueError(f"label {item.label} outside the {len(item.choices)} choices")
        except (KeyError, ValueError, TypeError, IndexError) as e:
            raise ValueError(f"{path or spec.hub_id}: record {i} is not a {task} record ({e}); expected the fields "
                             f"{', '.join(spec.fields)} or {', '.join(NORMALIZED)}: {json.dumps(r)[:200]}") from None
        per_subject[subject] = per_subject.get(subject, 0) + 1
        items.append(item)
        subjects.append(subject)
    if not items:
        raise ValueError(f"{path or spec.hub_id}: no {task} records")
    return items, subjects


def load_items(task: str, path: str | None = None, limit: int | None = None) -> list[Item]:
    """(context, choices, label) items of a task; see :func:`load_task`."""
    return load_task(task, path, limit)[0]


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
    large batch is safe on any device. Requests run longest first, as lm-eval runs them (less padding)."""
    device = next(model.parameters()).device
    order = sorted(range(len(requests)), key=lambda k: -len(requests[k][0]) - len(requests[k][1]))

    @find_executable_batch_size(starting_batch_size=batch_size)
    def run(bs: int) -> list[float]:
        scores = [0.0] * len(requests)
        for i in range(0, len(order), bs):
            chunk = order[i : i + bs]
            inps = [(requests[k][0] + requests[k][1])[-(length + 1):][:-1] for k in chunk]
            ids = torch.full((len(chunk), max(map(len, inps))), pad_id, dtype=torch.long)
            for j, s in enumerate(inps):
                ids[j, : len(s)] = torch.tensor(s)
            # right padding and no mask, as lm-eval: causal attention never looks at the pads after a sequence
            logp = torch.log_softmax(model(input_ids=ids.to(device)).logits.float(), dim=-1)  # (B, T, V)
            for j, k in enumerate(chunk):
                cont = requests[k][1]
                pos = torch.arange(len(inps[j]) - len(cont), len(inps[j]), device=device)
                scores[k] = float(logp[j, pos, torch.tensor(cont, device=device)].sum())
        return scores

    return run()


@torch.no_grad()
def choice_logliks(model, tokenizer, items, batch_size: int = 16) -> list[list[float]]:
    """Summed log p(choice | context) for every choice of every item, on the model's device (see :func:`encode_pair`)."""
    requests = [encode_pair(tokenizer, ctx, c) for ctx, choices, _ in items for c in choices]
    was_training = model.training
    model.eval()
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
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
                from .lm_eval_backend import evaluate_with_lm_eval  # optional dependency (the `eval` extra)
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
# during training


@lru_cache(maxsize=None)
def _cached_task(task: str, path: str | None, limit: int | None):
    return load_task(task, path, limit)  # read once per run, scored at every evaluation


def evaluate_tasks_during_training(engine, tokenizer, recipe, accelerator, out: Path, step: int) -> dict | None:
    """``eval.tasks`` on the newest weights at an evaluation point, when ``eval.during_training`` is set.

    The weights are gathered (``engine.full_state_dict``: collective, every rank calls this) into a model on the
    main process, on its training device, and scored there with this module's scorer; the pipeline stays as it
    is. Logged as ``eval/<task>/<metric>`` to ``metrics.jsonl`` and the trackers. Returns the results on the main
    process, None elsewhere or when there is nothing to do.
    """
    tasks = [t for t in recipe.eval.tasks if t != "perplexity"]
    if not (recipe.eval.during_training and tasks):
        return None
    weights = engine.full_state_dict()  # collective under the pipeline: merged on the main process only
    if not accelerator.is_main_process:
        return None
    from .export import assemble_model  # export imports this module

    model = assemble_model(weights, engine.config).to(accelerator.device)  # shares the weights where they already are
    task_items = {t: _cached_task(t, (recipe.eval.task_files or {}).get(t), recipe.eval.limit) for t in tasks}
    res = score_tasks(model, tokenizer, task_items, limit=recipe.eval.limit)
    rec = {f"eval/{t}/{m}": r[m] for t, r in res.items() for m in ("acc", "acc_norm") if m in r}
    line = (json.dumps({"step": step, **rec}) + "\n").encode()
    write_file(Path(out) / METRICS, lambda f: f.write(line), append=True, fsync=False)  # a full disk names the file
    accelerator.log(rec, step=step)
    return res


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
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

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
