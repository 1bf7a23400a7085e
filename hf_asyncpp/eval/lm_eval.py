"""lm-evaluation-harness, the one zero-shot scorer: its tasks, its requests, its metrics, on this package's models.

Published tables (MMLU, HellaSwag, PIQA, ARC) come from lm-eval, so every zero-shot number this package reports is
lm-eval's: the tasks are built by lm-eval from its own YAMLs (:func:`load_tasks`), it renders the prompts, tokenizes
them (``TemplateLM._encode_pair``), aggregates acc / acc_norm and groups (``lm_eval.evaluator.evaluate``). This
module supplies only the model side, two ways:

- :class:`PipelineLM`, a ``TemplateLM`` over the pipeline's scorer (``pipeline.forward_only.StageScorer``): lm-eval's
  log-likelihood requests run through the stages, each rank holding only its stage's weights (during training and
  at the end of a pipelined run). Every rank runs lm-eval on the same requests; the scorer is collective.
- lm-eval's own ``HFLM`` for a model in one process: an exported folder, or a single-process run's model.

Local data, for offline runs: :func:`write_local_tasks` writes, for each task with a file, a task YAML that
``include:``s lm-eval's own definition of the task and only points its dataset at the file (``dataset_path: json``),
so lm-eval's prompts, choices and metrics stay unchanged. Needs the ``eval`` extra (``pip install hf_asyncpp[eval]``).
"""
from __future__ import annotations

import json
import logging
import tempfile
from collections import defaultdict
from dataclasses import dataclass, field
from functools import lru_cache
from importlib.metadata import version
from pathlib import Path

import torch
import yaml
from lm_eval.api.model import TemplateLM
from lm_eval.evaluator import evaluate
from lm_eval.models.huggingface import HFLM
from lm_eval.models.utils import resolve_max_length
from lm_eval.tasks import TaskManager
from lm_eval.tasks._yaml_loader import load_yaml

from ..errors import DataError
from ..offline import hub_unreachable, switch_offline, unreachable
from ..storage.write import write_file
from .perplexity import resolve_device

__all__ = ["LOCAL_PREFIX", "PipelineLM", "TaskSet", "hf_lm", "lm_eval_version", "load_tasks", "score",
           "write_local_tasks"]

LOCAL_PREFIX = "hf_asyncpp_"
"""Name prefix of the local tasks, so that they never shadow lm-eval's own."""
DEFAULT_MAX_LENGTH = 2048
"""``HFLM``'s context length where neither the config nor the tokenizer sets one."""


def lm_eval_version() -> str:
    return version("lm_eval")


# ---------------------------------------------------------------------------------------------------
# the model side


class PipelineLM(TemplateLM):
    """lm-eval's model over a scorer with ``config`` and ``score_requests(requests, batch_size, pad_id, length) ->
    [(logprob, is_greedy)]`` (``StageScorer``: through a pipeline's stages). Tokenization, the context length and the
    request order are ``HFLM``'s (the tokenizer's default special tokens, none before a text that starts with the
    prefix token; left truncation; longest first), so the same model gives ``HFLM``'s numbers to float rounding
    (``HFLM`` also shares one forward between choices that differ only in their last token; this runs one per
    request). Only log-likelihoods: the multiple-choice tasks this package reports."""

    def __init__(self, scorer, tokenizer, batch_size: int = 16, quiet: bool = False):
        super().__init__()
        self.scorer, self.tokenizer, self.batch_size, self.quiet = scorer, tokenizer, batch_size, quiet
        self.max_length = resolve_max_length(scorer.config, tokenizer, default=DEFAULT_MAX_LENGTH)

    @property
    def eot_token_id(self) -> int:
        return self.tokenizer.eos_token_id

    @property
    def prefix_token_id(self) -> int:
        """``HFLM``'s: BOS, else EOS (the context of an empty-context request)."""
        return self.tokenizer.bos_token_id if self.tokenizer.bos_token_id is not None else self.tokenizer.eos_token_id

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kwargs) -> list[int]:
        if add_special_tokens is None and string.startswith(self.tokenizer.decode(self.prefix_token_id)):
            add_special_tokens = False
        kw = {} if add_special_tokens is None else {"add_special_tokens": add_special_tokens}
        return self.tokenizer.encode(string, **kw)

    def loglikelihood(self, requests, disable_tqdm: bool = False) -> list[tuple[float, bool]]:
        return super().loglikelihood(requests, disable_tqdm=disable_tqdm or self.quiet)

    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, **kwargs) -> list[tuple[float, bool]]:
        pad = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0
        return self.scorer.score_requests([(ctx, cont) for _, ctx, cont in requests], self.batch_size, pad,
                                          self.max_length)

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        raise NotImplementedError("PipelineLM scores multiple-choice tasks only; for perplexity use the held-out "
                                  "evaluation (eval_perplexity), or score the exported folder with lm-eval's HFLM")

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        raise NotImplementedError("PipelineLM does not generate; score generative tasks on the exported folder with "
                                  "lm-eval's HFLM (lm_eval --model hf --model_args pretrained=EXPORT)")


def hf_lm(model, tokenizer=None, device=None, batch_size: int = 16) -> HFLM:
    """lm-eval's ``HFLM`` on a model in one process: a model folder (loaded here in fp32 on ``device``; None: see
    ``resolve_device``), or a model already on its device with its ``tokenizer``.

    ``HFLM`` always gets the model itself, never a path: given a path it starts an ``Accelerator``, and inside a
    multi-process run (the main process scoring the export alone) it would then wait on ranks that never come."""
    if isinstance(model, (str, Path)):
        from transformers import AutoModelForCausalLM, AutoTokenizer

        tokenizer = tokenizer or AutoTokenizer.from_pretrained(str(model))
        model = AutoModelForCausalLM.from_pretrained(str(model), dtype=torch.float32).to(resolve_device(device))
    return HFLM(pretrained=model, tokenizer=tokenizer, batch_size=batch_size)


# ---------------------------------------------------------------------------------------------------
# the tasks


def _write(path: Path, text: str) -> None:
    """A task file for lm-eval, through the package's one write path (a full disk names the file)."""
    write_file(path, lambda f: f.write(text.encode()), fsync=False)


def _read_rows(path) -> list[dict]:
    import datasets

    kind = "parquet" if str(path).endswith(".parquet") else "json"
    return list(datasets.load_dataset(kind, data_files=[str(path)], split="train"))


_SPLITS = ("training_split", "validation_split", "test_split", "fewshot_split")


def _task_yaml(upstream: Path, name: str, data_file: Path) -> dict:
    """The local file is the split lm-eval scores the task on (its test split where it has one, else its validation
    split); the other splits (train, few-shot) do not exist locally, so they are unset: zero-shot only."""
    own = load_yaml(upstream, resolve_func=False)  # includes resolved
    key = "test_split" if own.get("test_split") else "validation_split"
    if not own.get(key):
        raise ValueError(f"{upstream}: the task has no test or validation split to read from a local file")
    cfg = {"include": str(upstream), "task": name, "dataset_path": "json", "dataset_name": None,
           "dataset_kwargs": {"data_files": {own[key]: str(data_file)}}}
    cfg.update({k: (own[key] if k == key else None) for k in _SPLITS})
    return cfg


@lru_cache(maxsize=1)
def _upstream() -> TaskManager:
    """lm-eval's own tasks (scanning its thousands of YAMLs takes seconds: once per process)."""
    return TaskManager()


def _upstream_index() -> dict:
    return _upstream().task_index


def write_local_tasks(task_files: dict[str, str], out_dir) -> dict[str, str]:
    """Task YAMLs in ``out_dir`` over local files (``{task: file}``, any lm-eval task; ``mmlu`` and
    ``mmlu_<subject>`` read the rows of a file of several subjects); returns ``{task: the lm-eval task or group name
    to request}``.

    Each YAML includes lm-eval's own YAML of the task and overrides only the dataset (path, and the split the task
    evaluates). ``mmlu`` becomes a group of one task per subject in the file (each includes lm-eval's
    ``mmlu_<subject>``), aggregated as lm-eval's ``mmlu`` group is (acc, weighted by size).
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    index = _upstream_index()
    names = {}
    for task, path in task_files.items():
        if not task.startswith("mmlu"):
            if task not in index:
                raise ValueError(f"--task-file {task}={path}: lm-eval {lm_eval_version()} has no task {task!r}")
            name = LOCAL_PREFIX + task
            _write(out / f"{name}.yaml", yaml.safe_dump(_task_yaml(index[task].yaml_path, name, Path(path).resolve())))
            names[task] = name
            continue
        by_subject = defaultdict(list)
        for r in _read_rows(path):
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
            _write(out / f"{name}.yaml", yaml.safe_dump(_task_yaml(index[f"mmlu_{subject}"].yaml_path, name, data)))
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


@dataclass
class TaskSet:
    """Tasks built by lm-eval once (their data read), scored at every evaluation of a run: ``names`` maps each task
    asked for to the lm-eval task or group requested (a local one for a task with a file), ``loaded`` is
    ``TaskManager.load``'s result, ``limit`` the first documents per task (per MMLU subject)."""

    tasks: list[str]
    names: dict[str, str]
    loaded: dict
    limit: int | None
    inverse_choices: dict[str, list[float]] = field(default_factory=dict)
    """1 / the number of choices of each scored document, by lm-eval task: the chance baseline, computed once."""


def _first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return text[0] if text else ""


def load_tasks(tasks: list[str], task_files: dict[str, str] | None = None, limit: int | None = None) -> TaskSet:
    """lm-eval's tasks (any task or group name), their data read now: a local file where ``task_files`` has one
    (:func:`write_local_tasks`), else the Hub (or its cache). Not reaching the Hub is one DataError naming the task
    and the two ways out, never the datasets library's traceback. Zero-shot: a task's few-shot default is lm-eval's
    (0 for the tasks above; a local file holds no few-shot split)."""
    files = {t: f for t, f in (task_files or {}).items() if t in tasks}
    why = hub_unreachable() if any(t not in files for t in tasks) else None
    if why:  # the cache only, at once, instead of five retries with backoff per file (datasets' offline mode)
        switch_offline()
    with tempfile.TemporaryDirectory(prefix="hf_asyncpp-lm_eval-") as tmp:
        names = write_local_tasks(files, tmp) if files else {}
        # the local tasks from tmp alone (they include lm-eval's YAMLs by path), the others from lm-eval's own index
        local = TaskManager(include_path=tmp, include_defaults=False) if files else None
        loaded = {"tasks": {}, "groups": {}, "group_map": {}}
        for t in tasks:  # one at a time: an error names its task; the data is read here, before tmp goes
            name = names.get(t, t)
            try:
                one = (local if t in files else _upstream()).load([name])
            except KeyError as e:
                raise ValueError(f"unknown task {t!r}: lm-eval {lm_eval_version()} has no task or group of that name "
                                 f"(lm_eval --tasks list shows them)") from e
            except (OSError, ConnectionError) as e:  # datasets' DatasetNotFoundError is a FileNotFoundError
                if t in files:
                    raise DataError(f"--task-file {t}={files[t]}: cannot be read ({type(e).__name__}: "
                                    f"{_first_line(e)})") from e
                if why:
                    raise DataError(f"task {t}: its data is not in the cache and {unreachable(why)}; download it "
                                    f"where the Hub is reachable (it is then read from the cache), or "
                                    f"give a local copy with --task-file {t}=FILE") from None
                raise DataError(f"task {t}: lm-eval cannot load its data from the Hub ({type(e).__name__}: "
                                f"{_first_line(e)}); download it while online (it is then read from the cache), or "
                                f"give a local copy with --task-file {t}=FILE") from e
            for key in loaded:
                loaded[key].update(one[key])
    for task in loaded["tasks"].values():
        if task.get_config("num_fewshot") is None:  # as simple_evaluate: a task without a default is zero-shot
            task.set_config(key="num_fewshot", value=0)
    return TaskSet(list(tasks), names, loaded, limit)


# ---------------------------------------------------------------------------------------------------
# scoring


def score(lm, taskset: TaskSet, log_samples: bool = False) -> tuple[dict[str, dict], dict]:
    """``({task: metrics}, lm-eval's raw output)`` of ``lm`` (a :class:`PipelineLM` or an ``HFLM``) on the tasks,
    through ``lm_eval.evaluator.evaluate`` (not ``simple_evaluate``, which reseeds the global random generators: in
    training that would change the run). Metrics in this package's format: ``acc``, ``acc_norm`` and their stderr,
    ``n``, ``limit``, ``num_fewshot``, ``scorer``, ``subjects`` for groups, and the ``dataset`` scored. Under a
    pipeline every rank calls it with the same tasks (the scorer is collective)."""
    quiet = logging.getLogger("lm_eval")
    level = quiet.level
    if getattr(lm, "quiet", False):
        quiet.setLevel(logging.ERROR)
    try:
        raw = evaluate(lm=lm, task_dict=taskset.loaded, limit=taskset.limit, log_samples=log_samples)
    finally:
        quiet.setLevel(level)
    scorer = f"lm-eval {lm_eval_version()}"
    out = {}
    for t in taskset.tasks:
        out[t] = _metrics(raw, taskset.names.get(t, t), taskset.limit, scorer)
        out[t]["chance"] = _chance(taskset, _leaves(raw, taskset.names.get(t, t)))
    return out, raw


def _chance(taskset: TaskSet, leaves: list[str]) -> float:
    """The accuracy of a uniform guess over the documents scored (the mean of 1 / their number of choices): the
    baseline an untrained model is read against. Per task once per run (a task set is scored at every evaluation)."""
    inverse = []
    for leaf in leaves:
        if leaf not in taskset.inverse_choices:
            task = taskset.loaded["tasks"][leaf]
            docs = list(task.eval_docs)
            taskset.inverse_choices[leaf] = [1 / len(task.doc_to_choice(doc))
                                             for doc in (docs[: taskset.limit] if taskset.limit else docs)]
        inverse += taskset.inverse_choices[leaf]
    return sum(inverse) / len(inverse)


def _leaves(raw: dict, name: str) -> list[str]:
    subs = raw.get("group_subtasks", {}).get(name)
    if not subs:
        return [name]
    return [leaf for s in subs for leaf in _leaves(raw, s)]


def _dataset(raw: dict, leaves: list[str]) -> dict:
    """The Hub dataset lm-eval scored (path, config, split); a group's config where its tasks share one."""
    cfgs = [raw["configs"][t] for t in leaves]
    paths = {c.get("dataset_path") for c in cfgs}
    configs = {c.get("dataset_name") for c in cfgs}
    splits = {c.get("test_split") or c.get("validation_split") for c in cfgs}
    one = lambda values: values.pop() if len(values) == 1 else None  # noqa: E731
    return {"path": one(paths), "config": one(configs), "split": one(splits)}


def _metrics(raw: dict, name: str, limit, scorer: str) -> dict:
    r = raw["results"][name]
    res = {m: r[f"{m},none"] for m in ("acc", "acc_norm") if f"{m},none" in r}
    res.update({f"{m}_stderr": r[f"{m}_stderr,none"] for m in ("acc", "acc_norm") if isinstance(r.get(f"{m}_stderr,none"), float)})
    leaves = _leaves(raw, name)
    res["n"] = sum(int(raw["n-samples"][t]["effective"]) for t in leaves)
    shots = {raw["n-shot"].get(t, 0) for t in leaves}
    res.update(limit=limit, num_fewshot=shots.pop() if len(shots) == 1 else sorted(shots), scorer=scorer,
               dataset=_dataset(raw, leaves))
    if len(leaves) > 1:
        res["subjects"] = {t.removeprefix(LOCAL_PREFIX).removeprefix("mmlu_"):
                           {"acc": raw["results"][t]["acc,none"], "n": int(raw["n-samples"][t]["effective"])} for t in leaves}
    return res
