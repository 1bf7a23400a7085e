"""Export to a standard Hugging Face folder (``from_pretrained`` works) with a model card.

The merged state dict (by original HF names, e.g. from the pipeline stages) is
loaded into a model built on the meta device, so export never allocates a second
copy of random weights. Writes go to a temp dir that replaces ``out_dir`` only
on success.
"""
from __future__ import annotations

import shutil
from pathlib import Path

import torch

TEMPLATE = Path(__file__).resolve().parent.parent / "model_cards" / "template.md"


def _materialize_meta_buffers(model, config) -> None:
    """Non-persistent buffers (rotary ``inv_freq``) are not in state dicts: rebuild their modules on CPU."""
    for name, module in list(model.named_modules()):
        if any(b.is_meta for b in module.buffers(recurse=False)):
            try:
                fresh = type(module)(config=getattr(module, "config", config), device="cpu")
            except TypeError:
                try:
                    fresh = type(module)(config=getattr(module, "config", config))
                except TypeError as e:
                    raise RuntimeError(f"export: cannot rebuild the buffers of {name} ({type(module).__name__}): {e}") from None
            parent, _, attr = name.rpartition(".")
            setattr(model.get_submodule(parent) if parent else model, attr, fresh)


def assemble_model(state_dict: dict[str, torch.Tensor], config):
    """A ready model from merged weights; missing or unexpected keys are an error naming them."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    tied = set()
    if getattr(config, "tie_word_embeddings", False):
        keys = getattr(model, "_tied_weights_keys", None) or {}
        tied = set(keys) if isinstance(keys, dict) else set(keys)
    sd = {k: v for k, v in state_dict.items() if k not in tied}
    missing, unexpected = model.load_state_dict(sd, strict=False, assign=True)
    missing = [k for k in missing if k not in tied]
    if missing or unexpected:
        raise KeyError(f"export: the state dict does not match {type(model).__name__}: missing {missing}, unexpected {unexpected}")
    _materialize_meta_buffers(model, config)
    if tied:
        model.tie_weights()
    still_meta = [n for n, t in list(model.named_parameters()) + list(model.named_buffers()) if t.is_meta]
    if still_meta:
        raise RuntimeError(f"export: tensors left on the meta device: {still_meta[:5]}")
    return model.eval()


def render_model_card(card: dict, model, load_path: str = "path/to/this/folder"):
    """Model card from ``model_cards/template.md`` via huggingface_hub's ModelCard/ModelCardData.

    ``card`` keys (all optional): schedule, num_stages, num_microbatches, microbatch_size, optimizer,
    delay_correction, simulate_delay, learning_rate, steps, tokens, seq_len, datasets, data_description,
    eval_loss, perplexity, loss_curve, model_id.
    """
    from huggingface_hub import EvalResult, ModelCard, ModelCardData

    card = {k: v for k, v in (card or {}).items() if v is not None}
    tags = ["hf_asyncpp", "pipeline-parallel", "pretraining", *(str(card[k]) for k in ("schedule", "optimizer") if k in card)]
    if card.get("delay_correction") == "error_feedback":
        tags.append("error-feedback")
    name = card.get("model_id", "hf_asyncpp-model")
    evals = None
    if "perplexity" in card:
        ds = (card.get("datasets") or ["held-out"])[0]
        evals = [EvalResult(task_type="text-generation", dataset_type=ds, dataset_name=card.get("data_description", ds)[:80],
                            metric_type="perplexity", metric_value=round(float(card["perplexity"]), 4)),
                 EvalResult(task_type="text-generation", dataset_type=ds, dataset_name=card.get("data_description", ds)[:80],
                            metric_type="loss", metric_value=round(float(card["eval_loss"]), 4))]
    data = ModelCardData(library_name="transformers", pipeline_tag="text-generation", tags=tags,
                         datasets=card.get("datasets"), model_name=name, eval_results=evals)
    defaults = dict(schedule="none", num_stages=1, num_microbatches=1, microbatch_size=1, optimizer="?", learning_rate="?",
                    delay_correction="none", simulate_delay="0", steps="?", tokens="?", seq_len="?",
                    data_description="?", eval_loss=None, perplexity=None, loss_curve=None)
    values = {**defaults, **card}
    return ModelCard.from_template(
        data, template_path=str(TEMPLATE), model_id=name, model_type=model.config.model_type,
        num_parameters=f"{sum(p.numel() for p in model.parameters()):,}",
        tied=bool(getattr(model.config, "tie_word_embeddings", False)), load_path=load_path,
        **{k: v for k, v in values.items() if k not in ("model_id", "datasets")},
    )


def export_hf_model(state_dict: dict[str, torch.Tensor], config, out_dir, *, tokenizer=None, card: dict | None = None,
                    max_shard_size: str | int = "2GB") -> Path:
    out = Path(out_dir)
    model = assemble_model(state_dict, config)
    if tokenizer is not None:
        for attr in ("bos_token_id", "eos_token_id", "pad_token_id"):
            if getattr(tokenizer, attr, None) is not None:
                setattr(model.generation_config, attr, getattr(tokenizer, attr))
    tmp = out.with_name(out.name + ".tmp-export")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(str(tmp), max_shard_size=max_shard_size)
    if not (tmp / "generation_config.json").exists():
        model.generation_config.save_pretrained(str(tmp))
    if tokenizer is not None:
        tokenizer.save_pretrained(str(tmp))
    render_model_card(card or {}, model, load_path=str(out)).save(str(tmp / "README.md"))
    if out.exists():
        shutil.rmtree(out)
    tmp.rename(out)
    return out


def load_checkpoint_state(ckpt_dir) -> tuple[dict[str, torch.Tensor], object, object]:
    """(merged weights, config, tokenizer or None) of a checkpoint written by the trainer.

    A checkpoint holds ``model.safetensors`` (single process) or ``stage-XX.safetensors`` (one per
    pipeline stage, original HF names), ``config.json`` and ``tokenizer/``.
    """
    from safetensors.torch import load_file
    from transformers import AutoConfig, AutoTokenizer

    ckpt = Path(ckpt_dir)
    files = [ckpt / "model.safetensors"] if (ckpt / "model.safetensors").exists() else sorted(
        p for p in ckpt.glob("stage-*.safetensors") if not p.name.endswith("-versions.safetensors"))
    if not files:
        raise FileNotFoundError(f"{ckpt}: no model.safetensors or stage-XX.safetensors; is it a hf_asyncpp checkpoint?")
    state: dict[str, torch.Tensor] = {}
    for f in files:
        state.update(load_file(str(f)))
    if not (ckpt / "config.json").exists():
        raise FileNotFoundError(f"{ckpt}: config.json is missing")
    config = AutoConfig.from_pretrained(str(ckpt))
    tok = AutoTokenizer.from_pretrained(str(ckpt / "tokenizer")) if (ckpt / "tokenizer").is_dir() else None
    return state, config, tok
