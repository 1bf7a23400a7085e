"""Build the model a recipe asks for: random init from a config dict, or from_pretrained.

The vocabulary is reconciled with the tokenizer here, once, so that every later
piece (partition, export, eval) can trust ``config.vocab_size >= len(tokenizer)``.
"""
from __future__ import annotations

import contextlib
import logging

import torch

from ..config.sections import ModelConfig
from ..errors import RecipeError, StageLocalError
from ..storage import checkpoint_io as ckpt
from .seeded_init import init_stage, seeded_init
from .vocab_parallel import parse_shard

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


CAUSAL_SDPA = "hf_asyncpp_causal_sdpa"
"""transformers' own SDPA attention under a name with no mask function: the mask is never built, so the causal
kernel (``is_causal``) runs and the packed-sequence probe, a host sync per forward on a GPU, never does."""
MASK_FREE_TYPES = {"llama", "mistral", "mixtral", "qwen2", "qwen2_moe", "qwen3", "qwen3_moe", "olmo", "olmo2",
                   "granite", "granitemoe"}
"""Model types whose SDPA attention is plain causal attention over the whole block when no window is set: their
mask, for blocks without padding or position resets (every block the data stream packs), is exactly causal."""


def use_mask_free_attention(model) -> bool:
    """Switch ``model`` to :data:`CAUSAL_SDPA` where that computes what its mask would (SDPA, a type of
    :data:`MASK_FREE_TYPES`, no sliding window or non-full layer); returns whether it did. A model whose attention
    needs a mask of its own (sliding windows, sinks, chunks) keeps it."""
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    cfg = model.config
    layer_types = getattr(cfg, "layer_types", None) or []
    if (cfg._attn_implementation != "sdpa" or cfg.model_type not in MASK_FREE_TYPES
            or getattr(cfg, "sliding_window", None) or any(t != "full_attention" for t in layer_types)):
        return False
    AttentionInterface.register(CAUSAL_SDPA, sdpa_attention_forward)
    model.set_attn_implementation(CAUSAL_SDPA)
    return True


def ties(model) -> dict[str, str]:
    """The model's ties, {name tied to another: that other name}, as transformers resolves them for its config
    (``all_tied_weights_keys``: e.g. ``{"lm_head.weight": "model.embed_tokens.weight"}``, empty when untied): the one
    reading of ties for saving, exporting and describing a model."""
    return dict(getattr(model, "all_tied_weights_keys", None) or {})


def build_model(model_cfg: ModelConfig, tokenizer=None, *, device: str | torch.device = "cpu"):
    """Random init (seeded by the caller: ``torch.initial_seed()``) or pretrained weights; always fp32 master
    weights. A random init is per module (``seeded_init``): a stage built alone gets the same values."""
    from transformers import AutoModelForCausalLM

    config = build_config(model_cfg, tokenizer)
    kw = {}
    if model_cfg.attn_implementation:
        kw["attn_implementation"] = model_cfg.attn_implementation
    if model_cfg.config is not None:
        cuda = [torch.device(device).index or 0] if torch.device(device).type == "cuda" else []
        with torch.device(device), torch.random.fork_rng(devices=cuda):  # its draws are replaced below
            model = AutoModelForCausalLM.from_config(config, dtype=torch.float32, **kw)
        seeded_init(model, model._init_weights, torch.initial_seed())
    else:
        model = AutoModelForCausalLM.from_pretrained(model_cfg.name_or_path, config=config, dtype=torch.float32, **kw)
        if tokenizer is not None and model.get_input_embeddings().num_embeddings < len(tokenizer):
            model.resize_token_embeddings(len(tokenizer))
        model.to(device)
    if not model_cfg.attn_implementation:
        use_mask_free_attention(model)
    n_params = sum(p.numel() for p in model.parameters())
    log.info("model %s: %.2fM parameters", config.model_type, n_params / 1e6)
    return model


def meta_model(model_cfg: ModelConfig, tokenizer=None):
    """The recipe's model on the meta device: modules, names and shapes without storage, built by transformers'
    own ``from_config`` under ``torch.device("meta")``. A rank partitions it and materialises only its stage
    (:func:`load_stage_pretrained`), so the fp32 weights of the other stages never sit in its memory."""
    from transformers import AutoModelForCausalLM

    config = build_config(model_cfg, tokenizer)
    kw = {"attn_implementation": model_cfg.attn_implementation} if model_cfg.attn_implementation else {}
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32, **kw)
    if not model_cfg.attn_implementation:
        use_mask_free_attention(model)
    if tokenizer is not None and model.get_input_embeddings().num_embeddings < len(tokenizer):
        # resize_token_embeddings initialises the new rows from the loaded ones: it needs the whole embedding
        raise StageLocalError(f"model.name_or_path: its {model.get_input_embeddings().num_embeddings} embeddings are "
                              f"fewer than the tokenizer's {len(tokenizer)}: a stage-local load cannot resize them")
    return model


def load_stage_pretrained(stage: torch.nn.Module, name_or_path: str, device: str | torch.device = "cpu") -> None:
    """Materialise a stage partitioned from :func:`meta_model` with its own tensors of a local safetensors
    checkpoint (:func:`read_stage_tensors`)."""
    tensors = read_stage_tensors(stage, name_or_path)
    stage.to_empty(device=device)  # and the non-persistent buffers (rotary frequencies) recomputed
    stage.load_state_dict({n: t.float() for n, t in tensors.items()}, strict=True)


def read_stage_tensors(stage: torch.nn.Module, name_or_path: str) -> dict[str, torch.Tensor]:
    """A stage's own tensors (its ``state_dict`` names) from a local safetensors checkpoint (``save_pretrained``'s
    single file or its sharded index), read by name: each file's header says what it holds and only this stage's
    tensors are read. A tied head the checkpoint leaves out (saved once, as the embedding) is read under its
    partner's name (the stage's ``tied_pairs``). KeyError when the checkpoint names a tensor otherwise (a layout
    transformers converts on load, such as MoE experts saved one by one): such a stage cannot be read alone."""
    import json
    from pathlib import Path

    from transformers.utils import SAFE_WEIGHTS_INDEX_NAME, SAFE_WEIGHTS_NAME

    folder, opened = Path(name_or_path), {}
    if (folder / SAFE_WEIGHTS_INDEX_NAME).is_file():
        where = {n: folder / f for n, f in json.loads((folder / SAFE_WEIGHTS_INDEX_NAME).read_text())["weight_map"].items()}
    else:
        opened[folder / SAFE_WEIGHTS_NAME] = single = ckpt.TensorFile(folder / SAFE_WEIGHTS_NAME)
        where = {n: single.path for n in single.names}
    partner = {}
    for a, b in getattr(stage, "tied_pairs", ()):
        partner.update({a: b, b: a})
    wanted, rows = {}, {}  # stage name -> name in the checkpoint; a vocabulary shard's -> its rows of that tensor
    for name in stage.state_dict():
        source = name if name in where else partner.get(name)
        shard = parse_shard(name) if source not in where else None
        if shard is not None:  # a stage's rows of the output layer (vocab_parallel): read from the whole matrix
            source, rows[name] = shard
        if source not in where:
            raise KeyError(f"{folder}: no tensor {name!r} for this stage; was it saved for another model?")
        wanted[name] = source
    by_file: dict[Path, list[str]] = {}
    for source in dict.fromkeys(wanted.values()):
        by_file.setdefault(where[source], []).append(source)
    read = {}
    for f, names in by_file.items():
        read.update((opened.get(f) or ckpt.TensorFile(f)).get(names))
    return {n: read[s][rows[n][0]:rows[n][1]].clone() if n in rows else read[s] for n, s in wanted.items()}


def local_weights(name_or_path: str):
    """The local folder of a pretrained model's safetensors: the path itself, or the Hub's cached snapshot of the
    weights and config only (``huggingface_hub.snapshot_download``)."""
    from pathlib import Path

    from huggingface_hub import snapshot_download

    folder = Path(name_or_path)
    if not folder.is_dir():
        folder = Path(snapshot_download(name_or_path, allow_patterns=["*.safetensors", "*.safetensors.index.json", "*.json"]))
    if not any(folder.glob("*.safetensors")):
        raise StageLocalError(f"{name_or_path}: no safetensors weights (a stage-local load reads tensors by name)")
    return folder


def materialise_stage(stage: torch.nn.Module, full_meta: torch.nn.Module, model_cfg: ModelConfig) -> None:
    """Give a stage partitioned from :func:`meta_model` its weights on the CPU, reading or drawing only its own:
    a pretrained model's tensors by name, or the random init :func:`build_model` gives the whole model (same seed,
    ``torch.initial_seed()``; ``seeded_init``). Raises :class:`StageLocalError` where that is not possible."""
    if model_cfg.config is None:
        load_stage_pretrained(stage, str(local_weights(model_cfg.name_or_path)))
        return
    left = init_stage(stage, full_meta, torch.initial_seed(), torch.device("cpu"))
    if left:
        raise StageLocalError(f"the model's initializer leaves {left[:3]} unset when a stage is built alone")


def compile_layers(layers, backend: str | None = None) -> None:
    """``torch.compile`` each decoder layer in place (``nn.Module.compile``): the layer's own module, so activation
    checkpointing still wraps it and a weight version's tensors reach it as inputs. Dynamo keeps one cache entry per
    layer object (all of one code object), so its limit is raised to the layers' count."""
    layers = list(layers)
    limit = "recompile_limit" if hasattr(torch._dynamo.config, "recompile_limit") else "cache_size_limit"
    setattr(torch._dynamo.config, limit, max(getattr(torch._dynamo.config, limit), 2 * len(layers) + 8))
    # an MoE stage's router hooks write the router logits to a list from inside the layer; under activation
    # checkpointing Dynamo refuses that side effect inside the checkpoint (a graph break per layer) unless told it
    # need not be replayed by the recomputation: it never is, the hooks are removed when the forward returns
    # (partition.aux._capture), before any backward recomputes
    if hasattr(torch._dynamo.config, "skip_fwd_side_effects_in_bwd_under_checkpoint"):
        torch._dynamo.config.skip_fwd_side_effects_in_bwd_under_checkpoint = True
    for layer in layers:
        layer.compile(backend=backend or "inductor")


LIMIT_HIT = "recompile limit"
"""What Dynamo's message says when a frame has hit ``recompile_limit``: from then on that code runs eagerly."""


def compile_counts() -> dict[str, int]:
    """What this process's ``torch.compile`` has done so far, from Dynamo's own counters (a dict read, no device
    work): ``graphs`` compiled, ``frames`` converted, ``recompiles`` (compilations of a function after its first),
    ``graph_breaks``, and ``eager_fallbacks``, the times a function hit the recompile limit and was left to run
    eagerly (Dynamo only logs it). A decoder stage compiles 2 graphs at its first step (its first layer, then one its
    other layers share: 1 recompile) and 2 more at its first evaluation (no grad); any growth after that is a
    recompile the run pays again and again."""
    from torch._dynamo import convert_frame
    from torch._dynamo.utils import counters

    per_function = getattr(convert_frame, "FRAME_COMPILE_COUNTER", {})  # function -> times compiled
    return {"graphs": int(counters["stats"]["unique_graphs"]), "frames": int(counters["frames"]["ok"]),
            "recompiles": int(sum(n - 1 for n in per_function.values() if n > 1)),
            "graph_breaks": int(sum(counters["graph_break"].values())),
            "eager_fallbacks": int(sum(n for msg, n in counters["unimplemented"].items() if LIMIT_HIT in msg.lower()))}


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


def autocast(enabled: bool):
    return torch.autocast("cpu" if not torch.cuda.is_available() else "cuda", dtype=torch.bfloat16) if enabled else contextlib.nullcontext()


def expert_stacks(stage: torch.nn.Module) -> set[str]:
    """Names of the stage's mixture-of-experts stacks: each 3-D floating parameter whose first dimension is its own
    module's ``num_experts``. Read off the model, not a list of classes: transformers' experts modules store expert
    ``e``'s matrix as slice ``e`` of one ``(experts, out, in)`` (or ``(experts, in, out)``) tensor and say how many
    experts they hold (every class ``@use_experts_implementation`` wraps: Mixtral, Qwen2/3-MoE, OLMoE, DeepSeek,
    GPT-OSS, ...; Llama-4's experts; JetMoE's parallel experts). Autocast casts none of them whole, so
    :func:`autocast_casts` misses them: the eager implementation slices ``stack[e]`` and casts the slice per matmul
    (a cast per expert per microbatch), and the grouped GEMM (``grouped_mm``, transformers' default; ``_grouped_mm``
    in ``transformers/integrations/moe.py``) is no autocast op: it casts its input to the stack's dtype, so on fp32
    stacks the experts ran in fp32 (on CUDA torch's per-expert loop after ``offs.cpu()``, a host sync per call).
    Held in bf16, the eager loop's slices are autocast's casts bit for bit and the grouped GEMM runs in bf16.
    Per-expert biases (2-D) are not matrices and stay fp32. (:func:`find_casts` leaves out a stack the forward
    gathers per token, ``batched_mm``.)"""
    found = set()
    for name, p in stage.named_parameters():
        owner = stage.get_submodule(name.rpartition(".")[0])
        experts = getattr(owner, "num_experts", None)
        if p.ndim == 3 and p.is_floating_point() and isinstance(experts, int) and p.shape[0] == experts:
            found.add(name)
    return found
