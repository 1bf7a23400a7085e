"""Build the model a recipe asks for: random init from a config dict, or from_pretrained.

The vocabulary is reconciled with the tokenizer here, once, so that every later
piece (partition, export, eval) can trust ``config.vocab_size >= len(tokenizer)``.
"""
from __future__ import annotations

import logging

import torch

from .config import ModelConfig, RecipeError

log = logging.getLogger("hf_asyncpp.modeling")


def build_config(model_cfg: ModelConfig, tokenizer=None):
    """The transformers config for the recipe, vocab and special ids set from the tokenizer."""
    from transformers import AutoConfig

    if model_cfg.config is not None:
        kw = dict(model_cfg.config)
        model_type = kw.pop("model_type")
        try:
            config = AutoConfig.for_model(model_type, **kw)
        except (ValueError, KeyError) as e:
            raise RecipeError(f"model.config.model_type: {model_type!r} is not a model type transformers knows ({e})") from None
    else:
        config = AutoConfig.from_pretrained(model_cfg.name_or_path)
    if (tokenizer is None and model_cfg.config is not None and "vocab_size" not in model_cfg.config
            and model_cfg.tokenizer_name_or_path is None):
        config.vocab_size = model_cfg.vocab_size  # planning without the tokenizer: the size it will be trained to
    if tokenizer is not None:
        n = len(tokenizer)
        if model_cfg.config is not None and ("vocab_size" not in model_cfg.config or config.vocab_size < n):
            config.vocab_size = n
        for attr in ("bos_token_id", "eos_token_id", "pad_token_id"):
            tok_id = getattr(tokenizer, attr, None)
            if tok_id is not None and model_cfg.config is not None and attr not in model_cfg.config:
                setattr(config, attr, tok_id)
    if model_cfg.attn_implementation:
        config._attn_implementation = model_cfg.attn_implementation
    return config


def build_model(model_cfg: ModelConfig, tokenizer=None, *, device: str | torch.device = "cpu"):
    """Random init (seeded by the caller) or pretrained weights; always fp32 master weights."""
    from transformers import AutoModelForCausalLM

    config = build_config(model_cfg, tokenizer)
    kw = {}
    if model_cfg.attn_implementation:
        kw["attn_implementation"] = model_cfg.attn_implementation
    if model_cfg.config is not None:
        with torch.device(device):
            model = AutoModelForCausalLM.from_config(config, dtype=torch.float32, **kw)
    else:
        model = AutoModelForCausalLM.from_pretrained(model_cfg.name_or_path, config=config, dtype=torch.float32, **kw)
        if tokenizer is not None and model.get_input_embeddings().num_embeddings < len(tokenizer):
            model.resize_token_embeddings(len(tokenizer))
        model.to(device)
    n_params = sum(p.numel() for p in model.parameters())
    log.info("model %s: %.2fM parameters", config.model_type, n_params / 1e6)
    return model


def enable_activation_checkpointing(model) -> None:
    """Turn on the model's own activation checkpointing: each decoder layer (a ``GradientCheckpointingLayer``)
    recomputes its activations in the backward, so a microbatch in flight keeps only the layers' inputs.

    Non-reentrant ``torch.utils.checkpoint``: it accepts keyword tensor arguments (position embeddings, masks),
    restores autocast and the RNG state (dropout) for the recomputation, and lets the pipeline send activations
    that require grad. Call it before partitioning: a stage's layers copy the flags when they are built.
    """
    kwargs = {"use_reentrant": False}
    if hasattr(model, "activation_checkpointing_enable"):  # transformers >= 5.x; the older name warns there
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
