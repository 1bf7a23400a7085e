"""lm-evaluation-harness as the scorer (``eval.backend: lm_eval``, ``hf-asyncpp evaluate --backend lm_eval``).

Runs lm-eval's own API, ``simple_evaluate`` with its ``HFLM`` wrapper, on an exported folder (or an in-memory
model), for any lm-eval task name; numbers are then lm-eval's by construction. Needs the ``eval`` extra
(``pip install -e .[eval]``); tasks without a local file download their data from the Hub.

Local data: :func:`write_local_tasks` writes, for each task with a file, a task YAML that ``include:``s lm-eval's
own definition of the task and only points its dataset at the file (``dataset_path: json``), so offline runs
and the parity test (``tests/test_lm_eval_parity.py``) use lm-eval's prompts, choices and metrics unchanged.
"""
from __future__ import annotations

import json
import tempfile
from collections import defaultdict
from functools import lru_cache
from importlib.metadata import version
from pathlib import Path

import lm_eval
import yaml
from lm_eval.models.huggingface import HFLM
from lm_eval.tasks import TaskManager

from ..storage.write import write_file
from .perplexity import resolve_device
from .tasks import task_spec

__all__ = ["LOCAL_PREFIX", "evaluate_with_lm_eval", "lm_eval_version", "write_local_tasks"]

LOCAL_PREFIX = "hf_asyncpp_"
"""Name prefix of the local tasks, so that they never shadow lm-eval's own."""


def lm_eval_version() -> str:
    return version("lm_eval")


def _write(path: Path, text: str) -> None:
    """A task file for lm-eval, through the package's one write path (a full disk names the file)."""
    write_file(path, lambda f: f.write(text.encode()), fsync=False)


def _read_jsonl(path) -> list[dict]:
    import datasets

    kind = "parquet" if str(path).endswith(".parquet") else "json"
    return list(datasets.load_dataset(kind, data_files=[str(path)], split="train"))


_SPLITS = ("training_split", "validation_split", "test_split", "fewshot_split")


def _task_yaml(upstream: Path, name: str, split: str, data_file: Path) -> dict:
    """The local file is the split the task evaluates; the other splits (train, few-shot) do not exist locally, so
    they are unset: zero-shot only."""
    cfg = {"include": str(upstream), "task": name, "dataset_path": "json", "dataset_name": None,
           "dataset_kwargs": {"data_files": {split: str(data_file)}}}
    cfg.update({key: (split if key == f"{'validation' if split == 'validation' else 'test'}_split" else None) for key in _SPLITS})
    return cfg


@lru_cache(maxsize=1)
def _upstream_index() -> dict:
    """lm-eval's own task index (scanning its thousands of YAMLs takes seconds: once per process)."""
    return TaskManager().task_index


def write_local_tasks(task_files: dict[str, str], out_dir) -> dict[str, str]:
    """Task YAMLs in ``out_dir`` over local files (``{task: file}``, tasks as in ``tasks.TASKS`` or
    ``mmlu_<subject>``); returns ``{task: the lm-eval task or group name to request}``.

    Each YAML includes lm-eval's own YAML of the task and overrides only the dataset (path, and the split the
    task evaluates). ``mmlu`` becomes a group of one task per subject in the file (each includes lm-eval's
    ``mmlu_<subject>``), aggregated as lm-eval's ``mmlu`` group is (acc, weighted by size).
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    index = _upstream_index()
    names = {}
    for task, path in task_files.items():
        spec = task_spec(task)
        if not task.startswith("mmlu"):
            entry = index[spec.lm_eval_task]
            name = LOCAL_PREFIX + task
            _write(out / f"{name}.yaml", yaml.safe_dump(_task_yaml(entry.yaml_path, name, spec.split, Path(path).resolve())))
            names[task] = name
            continue
        by_subject = defaultdict(list)
        for r in _read_jsonl(path):
            by_subject[r["subject"]].append(r)
        if task != "mmlu":
            by_subject = {s: rows for s, rows in by_subject.items() if f"mmlu_{s}" == task}
        subtasks = []
        for subject, rows in sorted(by_subject.items()):
            if f"mmlu_{subject}" not in index:
                raise ValueError(f"{path}: {subject!r} is not an MMLU subject lm-eval knows (no task mmlu_{subject})")
            name = f"{LOCAL_PREFIX}{'' if task == 'mmlu' else 'only_'}mmlu_{subject}"  # `mmlu` and `mmlu_x` may come together
            data = out / f"{name}.jsonl"
            _write(data, "".join(json.dumps(r) + "\n" for r in rows))
            _write(out / f"{name}.yaml", yaml.safe_dump(_task_yaml(index[f"mmlu_{subject}"].yaml_path, name, "test", data)))
            subtasks.append(name)
        if not subtasks:
            raise ValueError(f"{path}: no rows of {task}")
        if task == "mmlu":
            group = {"group": LOCAL_PREFIX + "mmlu", "task": subtasks,
                     "aggregate_metric_list": [{"metric": "acc", "weight_by_size": True}], "metadata": {"version": 2}}
            _write(out / f"{LOCAL_PREFIX}mmlu.yaml", yaml.safe_dump(group))
            names[task] = LOCAL_PREFIX + "mmlu"
        else:
            names[task] = subtasks[0]
    return names


def _leaves(raw: dict, name: str) -> list[str]:
    subs = raw.get("group_subtasks", {}).get(name)
    if not subs:
        return [name]
    return [leaf for s in subs for leaf in _leaves(raw, s)]


def _metrics(raw: dict, name: str, limit, scorer: str) -> dict:
    r = raw["results"][name]
    res = {m: r[f"{m},none"] for m in ("acc", "acc_norm") if f"{m},none" in r}
    res.update({f"{m}_stderr": r[f"{m}_stderr,none"] for m in ("acc", "acc_norm") if isinstance(r.get(f"{m}_stderr,none"), float)})
    leaves = _leaves(raw, name)
    res["n"] = sum(int(raw["n-samples"][t]["effective"]) for t in leaves)
    shots = {raw["n-shot"].get(t, 0) for t in leaves}
    res.update(limit=limit, num_fewshot=shots.pop() if len(shots) == 1 else sorted(shots), scorer=scorer)
    if len(leaves) > 1:
        res["subjects"] = {t.removeprefix(LOCAL_PREFIX).removeprefix("mmlu_"):
                           {"acc": raw["results"][t]["acc,none"], "n": int(raw["n-samples"][t]["effective"])} for t in leaves}
    return res


def evaluate_with_lm_eval(model, tasks: list[str], *, tokenizer=None, task_files: dict[str, str] | None = None,
                          limit: int | None = None, device=None, batch_size: int = 16, num_fewshot: int | None = None,
                          log_samples: bool = False) -> tuple[dict[str, dict], dict]:
    """``({task: metrics}, lm-eval's raw output)``: lm-eval's ``simple_evaluate`` with ``HFLM`` on ``model`` (a
    model folder, or a model with its ``tokenizer``), on ``device`` (None: see ``resolve_device``).

    ``tasks`` are lm-eval task or group names; those in ``task_files`` read the local file through
    :func:`write_local_tasks`. Metrics are in this package's format (``acc``, ``acc_norm``, ``n``, ``limit``,
    ``num_fewshot``, ``scorer``, and ``subjects`` for groups), reported under the names asked for.
    """
    files = {t: f for t, f in (task_files or {}).items() if t in tasks}
    if files and num_fewshot:
        raise ValueError(f"local task files hold only the evaluated split, no few-shot examples: {sorted(files)} with "
                         f"num_fewshot={num_fewshot}")
    pretrained = str(model) if isinstance(model, (str, Path)) else model
    lm = HFLM(pretrained=pretrained, tokenizer=tokenizer, device=str(resolve_device(device)), batch_size=batch_size,
              dtype="float32")
    with tempfile.TemporaryDirectory(prefix="hf_asyncpp-lm_eval-") as tmp:
        names = write_local_tasks(files, tmp) if files else {}
        # lm-eval's own index is only needed for tasks without a file (the local ones include lm-eval's YAMLs by path)
        manager = TaskManager(include_path=tmp if files else None, include_defaults=len(files) < len(tasks))
        requested = [names.get(t, t) for t in tasks]
        raw = lm_eval.simple_evaluate(model=lm, tasks=requested, limit=limit, num_fewshot=num_fewshot,
                                      task_manager=manager, log_samples=log_samples)
    scorer = f"lm-eval {lm_eval_version()}"
    return {t: _metrics(raw, names.get(t, t), limit, scorer) for t in tasks}, raw
