"""The zero-shot tasks this package scores, as lm-evaluation-harness defines them: a registry and its data.

A leaf on purpose: the scorer (``downstream.py``), the lm-eval backend (``lm_eval.py``) and the model card all need
to know a task's Hub dataset, split, record fields and metrics, and none of them should pull in the others (or
torch) to learn it. Each :class:`Task` turns a Hub record into an :class:`Item` exactly as lm-eval's ``doc_to_text``
/ ``doc_to_choice`` do; local files may hold the Hub records or normalized ``{"context", "choices", "label"}`` rows.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Callable, NamedTuple

from .. import __version__
from ..errors import DataError

__all__ = ["Item", "MMLU_DESCRIPTION", "NORMALIZED", "SCORER", "TARGET_DELIMITER", "TASKS", "Task", "known_tasks",
           "load_items", "load_task", "task_spec"]

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


def _rows(task: str, spec, path: str | None):
    """The task's records, streamed from ``path`` or the Hub. Not reaching the Hub (offline, a firewall, a renamed
    dataset) is one DataError naming the task and the two ways out, never the datasets library's traceback."""
    import datasets  # heavy: only when a task is read

    try:
        if path:
            kind = "parquet" if str(path).endswith(".parquet") else "json"
            ds = datasets.load_dataset(kind, data_files=[str(path)], split="train", streaming=True)
        else:
            ds = datasets.load_dataset(spec.hub_id, spec.hub_config, split=spec.split, streaming=True)
        yield from ds
    except (OSError, ConnectionError) as e:  # datasets' DatasetNotFoundError is a FileNotFoundError
        if path:
            raise DataError(f"--task-file {task}={path}: cannot be read ({type(e).__name__}: {first_line(e)})") from e
        raise DataError(f"task {task}: {spec.hub_id!r} ({spec.hub_config or 'default'}, {spec.split}) cannot be "
                        f"loaded from the Hub ({type(e).__name__}: {first_line(e)}); download it while online (it is "
                        f"then read from the cache), or give a local copy with --task-file {task}=FILE") from e


def first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return text[0] if text else ""


def load_task(task: str, path: str | None = None, limit: int | None = None) -> tuple[list[Item], list[str | None]]:
    """(items, MMLU subject of each item or None) of a task, from a local file or the Hub (streamed).

    ``limit`` is applied as lm-eval applies it: the first ``limit`` documents of each task, and for MMLU each
    subject is a task (``mmlu`` with ``limit: 100`` scores 100 items of every subject, not the first subjects of
    the subject-sorted ``all`` split). ``mmlu_<subject>`` reads only that subject's rows of a local MMLU file.
    """
    spec = task_spec(task)
    only = task.removeprefix("mmlu_") if task.startswith("mmlu_") else None
    items, subjects, per_subject = [], [], {}
    for i, r in enumerate(_rows(task, spec, path)):
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
