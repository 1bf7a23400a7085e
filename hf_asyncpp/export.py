"""Export to a standard Hugging Face folder (``from_pretrained`` works) with a model card.

The merged state dict (original HF names, e.g. gathered from the pipeline stages) is loaded into a
model built on the meta device, so export never allocates a second copy of random weights. The
non-persistent buffers that state dicts do not carry (rotary ``inv_freq``, Gemma's ``embed_scale``)
are then computed by the model's own ``_init_weights``, exactly as ``from_pretrained`` does.

Everything is written to a temp dir next to ``out_dir`` and renamed into place at the end: an
existing export is replaced only when the new one is complete.

Checkpoint layout read by :func:`load_checkpoint_state` (the trainer writes it)::

    checkpoint-0000300/
        model.safetensors            single process, or
        stage-00.safetensors ...     one per pipeline stage, original HF names (merged by name)
        config.json                  PretrainedConfig.to_json_file
        tokenizer/                   tokenizer.save_pretrained (optional)
        recipe.yaml                  the run's recipe (optional, card fields)
        trainer_state.json           {"step": ..., "tokens": ...} (optional, card fields)
"""
from __future__ import annotations

import copy
import json
import logging
import shutil
import tempfile
from collections import Counter
from pathlib import Path

import torch

from .checkpoint import replace_dir

__all__ = ["CARD_FIELDS", "StateDictMismatchError", "assemble_model", "card_from_checkpoint", "export_from_model",
           "export_hf_model", "load_checkpoint_state", "render_model_card"]

log = logging.getLogger(__name__)

TEMPLATE = Path(__file__).resolve().parent.parent / "model_cards" / "template.md"

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
    "loss_curve": "loss-curve image: an existing file is copied next to the card; otherwise used as a link relative to it",
}
"""The keys of the ``card`` dict taken by :func:`export_hf_model`; every one is optional (missing or None is omitted)."""

_SCHEDULES = {
    "2bw": "PipeDream-2BW, asynchronous",
    "pipedream": "PipeDream with weight stashing, asynchronous",
    "1f1b": "1F1B, synchronous",
    "gpipe": "GPipe, synchronous",
    "none": "no pipeline, one process",
}


class StateDictMismatchError(KeyError):
    """The weights do not match the model the config builds; the message names the keys."""

    def __str__(self) -> str:
        return str(self.args[0])


# ---------------------------------------------------------------------------------------------------
# assembling a model from merged weights


def _dominant_float_dtype(state_dict: dict[str, torch.Tensor]) -> torch.dtype:
    counts = Counter()
    for t in state_dict.values():
        if t.is_floating_point():
            counts[t.dtype] += t.numel()
    return counts.most_common(1)[0][0] if counts else torch.float32


def _untie_shared_storage(state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Clone tensors that are views of one storage (e.g. flat pipeline buffers): safetensors refuses shared storage."""
    by_storage: dict[tuple, list[str]] = {}
    for k, t in state_dict.items():
        by_storage.setdefault((t.device, t.untyped_storage().data_ptr()), []).append(k)
    out = dict(state_dict)
    for keys in by_storage.values():
        if len(keys) > 1:
            for k in keys:
                out[k] = state_dict[k].clone()
    return out


def _unset(value: torch.Tensor) -> bool:
    if value.is_floating_point():
        return bool(value.isnan().any())
    return value.dtype != torch.bool and bool((value == torch.iinfo(value.dtype).min).any())


def _init_non_persistent_buffers(model, device) -> None:
    """Compute the buffers state dicts do not carry, as ``from_pretrained`` does: put sentinel-filled tensors
    in place of the meta ones, flag every loaded tensor as initialized, run ``initialize_weights`` (which
    then writes only unflagged tensors), and check that no sentinel is left."""
    pending = []
    for name, buf in list(model.named_non_persistent_buffers()):
        if buf.is_meta:
            parent, _, attr = name.rpartition(".")
            fill = float("nan") if buf.is_floating_point() else False if buf.dtype == torch.bool else torch.iinfo(buf.dtype).min
            module = model.get_submodule(parent)
            module._buffers[attr] = torch.full(buf.shape, fill, dtype=buf.dtype, device=device)
            pending.append((name, module, attr))
    if not pending:
        return
    for t in list(model.parameters()) + list(model.buffers()):
        t._is_hf_initialized = True  # loaded (or tied, still on meta): initialize_weights must leave them alone
    for _, module, attr in pending:
        module._buffers[attr]._is_hf_initialized = False
    model.initialize_weights()
    for name, module, attr in pending:
        value = module._buffers[attr]
        if not _unset(value):
            continue
        # NOTE: the model's _init_weights does not know this buffer: rebuild its module from the config, take the buffer.
        try:
            with torch.device(device):
                fresh = type(module)(config=getattr(module, "config", model.config))
        except TypeError as e:
            raise RuntimeError(f"export: cannot compute the non-persistent buffer {name} ({type(module).__name__}): "
                               f"the model's _init_weights leaves it unset and the module is not built from a config ({e})") from None
        module._buffers[attr] = fresh._buffers[attr].to(device=device, dtype=value.dtype)


def assemble_model(state_dict: dict[str, torch.Tensor], config):
    """A ready ``AutoModelForCausalLM`` (eval mode) from merged weights, without copying them
    (only tensors that are views of one shared storage, e.g. flat buffers, are cloned).

    Args:
        state_dict: every persistent parameter and buffer by its original HF name (MoE experts as the
            fused 3-D in-memory tensors). A tied head (``lm_head.weight`` with ``tie_word_embeddings``)
            may be absent; if present it must equal the embedding.
        config: the model's ``PretrainedConfig`` (not modified).

    Raises:
        StateDictMismatchError: missing or unexpected keys, all named.
        ValueError: a tied head that differs from the embedding it is tied to.
    """
    from transformers import AutoModelForCausalLM

    if not state_dict:
        raise ValueError("export: the state dict is empty")
    config = copy.deepcopy(config)  # from_config writes the dtype into the config it is given
    device = next(iter(state_dict.values())).device
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=_dominant_float_dtype(state_dict))
    tied = dict(getattr(model, "all_tied_weights_keys", None) or {})  # {target: source}, empty when untied
    sd = dict(state_dict)
    for target, source in tied.items():
        if target in sd:
            head = sd.pop(target)
            if source in sd and not torch.equal(head.to(sd[source].device), sd[source]):
                raise ValueError(f"export: {target} is tied to {source} (tie_word_embeddings=True) but their values differ; "
                                 "export the weights the model was trained with, or set tie_word_embeddings=False")
    missing, unexpected = model.load_state_dict(_untie_shared_storage(sd), strict=False, assign=True)
    missing = [k for k in missing if k not in tied]
    if missing or unexpected:
        raise StateDictMismatchError(
            f"export: the state dict does not match {type(model).__name__} built from the config "
            f"({len(sd)} tensors given): missing {sorted(missing)}, unexpected {sorted(unexpected)}")
    _init_non_persistent_buffers(model, device)
    if tied:
        model.tie_weights()
    still_meta = [n for n, t in list(model.named_parameters()) + list(model.named_buffers()) if t.is_meta]
    if still_meta:
        raise RuntimeError(f"export: tensors left on the meta device after loading: {still_meta}")
    return model.eval()


# ---------------------------------------------------------------------------------------------------
# model card


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
            "tied": bool(getattr(model, "all_tied_weights_keys", None) or getattr(cfg, "tie_word_embeddings", False))}
    for key, names in (("num_layers", ("num_hidden_layers",)), ("hidden_size", ("hidden_size",)),
                       ("vocab_size", ("vocab_size",)), ("num_experts", ("num_local_experts", "num_experts", "n_routed_experts")),
                       ("experts_per_token", ("num_experts_per_tok",))):
        for name in names:
            if getattr(cfg, name, None):
                arch[key] = getattr(cfg, name)
                break
    return arch


def _training_rows(c: dict) -> list[tuple[str, str]]:
    rows = []
    if "schedule" in c:
        what = _SCHEDULES.get(str(c["schedule"]))
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
    if "simulate_delay" in c and str(c["simulate_delay"]) != "0":
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


def _clean_card(card: dict | None) -> dict:
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


def render_model_card(card: dict | None, model, load_path: str = "path/to/this/folder"):
    """A ``huggingface_hub.ModelCard`` from ``model_cards/template.md``; ``card`` keys are :data:`CARD_FIELDS`.

    Card metadata: tags (hf_asyncpp, pipeline-parallel, pretraining, the schedule, the optimizer), datasets,
    metrics and a model-index with ``eval_loss``/``perplexity`` when they are given. Missing fields are
    left out of the card; unknown ones are logged and ignored.
    """
    from huggingface_hub import EvalResult, ModelCard, ModelCardData

    c = _clean_card(card)
    name = str(c.get("model_id") or load_path)
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
                         language=c.get("language"), datasets=c.get("datasets"), metrics=metric_names or None,
                         model_name=name, eval_results=results or None)
    return ModelCard.from_template(
        data, template_path=str(TEMPLATE), model_id=name, model_description=c.get("model_description"),
        load_path=str(c.get("model_id") or load_path), training_rows=_training_rows(c), eval_rows=_eval_rows(c),
        schedule=c.get("schedule"), loss_curve=c.get("loss_curve"), **_architecture(model))


# ---------------------------------------------------------------------------------------------------
# writing the folder


def _check_out_dir(out: Path) -> None:
    if out.exists() and not out.is_dir():
        raise ValueError(f"export: {out} exists and is not a directory")
    if out.is_dir() and any(out.iterdir()) and not (out / "config.json").exists():
        raise ValueError(f"export: refusing to replace {out}: it is not empty and holds no config.json (not a model "
                         "folder); choose another output directory")


def export_hf_model(state_dict: dict[str, torch.Tensor], config, out_dir, *, tokenizer=None, card: dict | None = None,
                    max_shard_size: str | int = "2GB") -> Path:
    """Write a standard Hugging Face model folder from merged weights; returns its path.

    Args:
        state_dict: weights by original HF names (see :func:`assemble_model`); not modified, not copied.
        config: the model's ``PretrainedConfig``.
        out_dir: the folder to write; an existing model folder there is replaced only on success.
        tokenizer: saved into the folder; its bos/eos/pad ids go to ``generation_config.json``.
        card: model-card fields, see :data:`CARD_FIELDS` (all optional).
        max_shard_size: safetensors shards above this size are split, with a ``model.safetensors.index.json``.

    Writes config.json, generation_config.json, model*.safetensors, the tokenizer files and README.md.
    """
    out = Path(out_dir)
    _check_out_dir(out)
    model = assemble_model(state_dict, config)
    if tokenizer is not None:
        if len(tokenizer) > model.config.get_text_config().vocab_size:
            raise ValueError(f"export: the tokenizer has {len(tokenizer)} tokens but the model's vocab_size is "
                             f"{model.config.get_text_config().vocab_size}; ids past it have no embedding")
        for attr in ("bos_token_id", "eos_token_id", "pad_token_id"):
            if getattr(tokenizer, attr, None) is not None:
                setattr(model.generation_config, attr, getattr(tokenizer, attr))
    card = _clean_card(card)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-export-", dir=out.parent))
    try:
        model.save_pretrained(str(tmp), max_shard_size=max_shard_size)
        if not (tmp / "generation_config.json").exists():
            model.generation_config.save_pretrained(str(tmp))
        if tokenizer is not None:
            tokenizer.save_pretrained(str(tmp))
        curve = card.get("loss_curve")
        if curve and Path(curve).is_file():
            shutil.copy(curve, tmp / Path(curve).name)
            card["loss_curve"] = Path(curve).name
        render_model_card(card, model, load_path=str(out)).save(str(tmp / "README.md"))
        replace_dir(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def export_from_model(model, out_dir, tokenizer=None, card: dict | None = None, max_shard_size: str | int = "2GB") -> Path:
    """:func:`export_hf_model` of an in-memory model (its state dict and config; the model itself is untouched)."""
    model = getattr(model, "_orig_mod", model)  # torch.compile wrapper
    return export_hf_model(model.state_dict(), model.config, out_dir, tokenizer=tokenizer, card=card,
                           max_shard_size=max_shard_size)


# ---------------------------------------------------------------------------------------------------
# checkpoints


def load_checkpoint_state(ckpt_dir) -> tuple[dict[str, torch.Tensor], object, object]:
    """(merged weights, config, tokenizer or None) of a checkpoint (layout in the module docstring).

    Stage files are merged by name; a name in several files (a tied head) must hold equal values.
    ``stage-XX-versions.safetensors`` (2BW's older weight version) is not part of the model.
    """
    from safetensors.torch import load_file
    from transformers import AutoConfig, AutoTokenizer

    ckpt = Path(ckpt_dir)
    if not ckpt.is_dir():
        raise FileNotFoundError(f"{ckpt}: no such checkpoint directory")
    files = [ckpt / "model.safetensors"] if (ckpt / "model.safetensors").exists() else sorted(
        p for p in ckpt.glob("stage-*.safetensors") if not p.name.endswith("-versions.safetensors"))
    if not files:
        raise FileNotFoundError(f"{ckpt}: no model.safetensors or stage-XX.safetensors; is it a hf_asyncpp checkpoint?")
    if not (ckpt / "config.json").exists():
        raise FileNotFoundError(f"{ckpt}: config.json is missing")
    state: dict[str, torch.Tensor] = {}
    owner: dict[str, str] = {}
    for f in files:
        for k, v in load_file(str(f)).items():
            if k in state and not torch.equal(state[k], v):
                raise ValueError(f"{ckpt}: {k} differs between {owner[k]} and {f.name}")
            state[k], owner[k] = v, f.name
    config = AutoConfig.from_pretrained(str(ckpt))
    tok = AutoTokenizer.from_pretrained(str(ckpt / "tokenizer")) if (ckpt / "tokenizer").is_dir() else None
    return state, config, tok


def card_from_checkpoint(ckpt_dir) -> dict:
    """Model-card fields from what a checkpoint holds: ``recipe.yaml`` (training setup), ``trainer_state.json``
    (steps, tokens) and the run's ``metrics.jsonl`` one level up (the last evaluation at or before the step).
    Whatever is absent is left out."""
    ckpt = Path(ckpt_dir)
    card: dict = {}
    if (ckpt / "recipe.yaml").exists():
        from .config import load_recipe

        r = load_recipe(ckpt / "recipe.yaml")
        card.update(schedule=r.pipeline.schedule, num_stages=r.pipeline.num_stages,
                    num_microbatches=r.pipeline.num_microbatches, microbatch_size=r.pipeline.microbatch_size,
                    optimizer=r.optimizer.name, learning_rate=r.optimizer.learning_rate,
                    delay_correction=r.optimizer.delay_correction, simulate_delay=r.optimizer.simulate_delay,
                    seq_len=r.data.seq_len, datasets=[r.data.dataset] if r.data.dataset else None,
                    data_description=r.data.dataset or (", ".join(r.data.train_files) if r.data.train_files else None),
                    model_id=r.hub.hub_model_id)
    step = None
    if (ckpt / "trainer_state.json").exists():
        info = json.loads((ckpt / "trainer_state.json").read_text())
        step = info.get("step")
        card.update(steps=step, tokens=info.get("tokens"))
    metrics = ckpt.parent / "metrics.jsonl"
    if metrics.exists():
        evals = [m for m in (json.loads(line) for line in metrics.read_text().splitlines() if line.strip())
                 if "eval_loss" in m and (step is None or m.get("step", 0) <= step)]
        if evals:
            card.update(eval_loss=evals[-1]["eval_loss"], perplexity=evals[-1].get("eval_ppl"),
                        eval_tokens=evals[-1].get("eval_tokens"))
    return {k: v for k, v in card.items() if v is not None}
