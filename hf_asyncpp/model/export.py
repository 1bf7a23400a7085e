"""Export to a standard Hugging Face folder (``from_pretrained`` works) with a model card.

The merged state dict (original HF names, e.g. gathered from the pipeline stages) is loaded into a
model built on the meta device, so export never allocates a second copy of random weights. The
non-persistent buffers that state dicts do not carry (rotary ``inv_freq``, Gemma's ``embed_scale``)
are then computed by the model's own ``_init_weights``, exactly as ``from_pretrained`` does.

Everything is written to a temp dir next to ``out_dir`` and renamed into place at the end: an
existing export is replaced only when the new one is complete.

:func:`load_checkpoint_state` reads a checkpoint (layout in ``storage/names.py``) into merged weights.

This module writes folders and nothing else: the engines import it (``shard_file``, ``write_shard``), so it must not
pull in evaluation, the model card or the Hub. The card comes from the caller as a :data:`CardWriter`
(``model_card.card_writer``); evaluating and pushing an export is ``run/evaluator.py``'s.
"""
from __future__ import annotations

import copy
import logging
import os
import shutil
from collections import Counter
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist
from safetensors.torch import save_file

from ..errors import CheckpointError
from ..storage import checkpoint_io as ckpt
from ..storage.checkpoint_io import replace_dir
from ..storage.names import MANIFEST, MODEL_FILE, TOKENIZER_DIR, stage_weight_files
from ..storage.write import follow_umask, writing
from ..supervision import is_main_process
from .build import ties

__all__ = ["CardWriter", "StateDictMismatchError", "assemble_model", "export_engine", "export_from_model", "export_hf_model", "holds_model",
           "load_checkpoint_state", "shard_file", "tied_names", "tokenizer_for_export", "write_shard"]

log = logging.getLogger("hf_asyncpp")

CardWriter = Callable[[Any, Path, Path], None]
"""Writes README.md (and what it links, e.g. the loss-curve image) into a folder being built: called with the model
(possibly on the meta device), the folder, and where the folder will end up. None: the folder gets no card."""

LOADER_KWARGS = ("is_local", "local_files_only")
"""What a tokenizer's ``init_kwargs`` hold about how it was loaded, not what it is."""


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
    tied = ties(model)  # {target: source}, empty when untied
    sd = dict(state_dict)
    for target, source in tied.items():
        if target in sd:
            head = sd.pop(target)
            if source in sd and not torch.equal(head.to(sd[source].device), sd[source]):
                raise ValueError(f"export: {target} is tied to {source} (tie_word_embeddings=True) but their values differ; "
                                 "export the weights the model was trained with, or set tie_word_embeddings=False")
    missing, unexpected = model.load_state_dict(ckpt.untie_shared_storage(sd), strict=False, assign=True)
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
# writing the folder


def _check_out_dir(out: Path) -> None:
    if out.exists() and not out.is_dir():
        raise ValueError(f"export: {out} exists and is not a directory")
    if out.is_dir() and any(out.iterdir()) and not (out / "config.json").exists():
        raise ValueError(f"export: refusing to replace {out}: it is not empty and holds no config.json (not a model "
                         "folder); choose another output directory")


def holds_model(out: Path, state_dict: dict[str, torch.Tensor], config) -> bool:
    """Whether the model folder ``out`` holds exactly these weights: every tensor of its safetensors files (single
    file or sharded index) equal to the one of ``state_dict`` by that name, in the folder's dtype, and every name it
    leaves out tied to one it holds. Read one tensor at a time (``safe_open``), never the whole folder at once. What
    tells a repeated export of the same checkpoint (replacing it loses nothing) from another model's folder."""
    from safetensors import safe_open

    index = out / "model.safetensors.index.json"
    if index.is_file():
        files = sorted(set(ckpt.load_json(index).get("weight_map", {}).values()))
    elif (out / MODEL_FILE).is_file():
        files = [MODEL_FILE]
    else:
        return False
    seen = set()
    try:
        for name in files:
            with safe_open(str(out / name), framework="pt") as f:
                for key in f.keys():
                    if key not in state_dict:
                        return False
                    held = f.get_tensor(key)
                    mine = state_dict[key]
                    if held.shape != mine.shape or not torch.equal(held, mine.to(held.dtype)):
                        return False
                    seen.add(key)
    except (OSError, ValueError, RuntimeError):  # a damaged or partial folder is not this model
        return False
    return bool(seen) and set(state_dict) - seen <= set(tied_names(config))


def export_hf_model(state_dict: dict[str, torch.Tensor], config, out_dir, *, tokenizer=None, card: CardWriter | None = None,
                    max_shard_size: str | int = "2GB") -> Path:
    """Write a standard Hugging Face model folder from merged weights; returns its path.

    Args:
        state_dict: weights by original HF names (see :func:`assemble_model`); not modified, not copied.
        config: the model's ``PretrainedConfig``.
        out_dir: the folder to write; an existing model folder there is replaced only on success.
        tokenizer: saved into the folder; its bos/eos/pad ids go to ``generation_config.json``.
        card: writes the model card (``model_card.card_writer(fields)``); None writes none.
        max_shard_size: safetensors shards above this size are split, with a ``model.safetensors.index.json``.

    Writes config.json, generation_config.json, model*.safetensors, the tokenizer files and the card's README.md.
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
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.parent / f".{out.name}.tmp-export-{os.getpid()}"  # mkdir, not mkdtemp: the user's umask, not 0700
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    tokenizer = tokenizer_for_export(tokenizer, config)
    try:
        with writing(out):  # a full disk or a permission error names the folder and the free space
            model.save_pretrained(str(tmp), max_shard_size=max_shard_size)
            if not (tmp / "generation_config.json").exists():
                model.generation_config.save_pretrained(str(tmp))
            if tokenizer is not None:
                tokenizer.save_pretrained(str(tmp))
            if card is not None:
                card(model, tmp, out)
            follow_umask(tmp)
            replace_dir(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def tokenizer_for_export(tokenizer, config):
    """The tokenizer to save with a model, the same whichever way it was made. A tokenizer trained here has no
    length (transformers' 1e30, "no limit"), which pipelines, vLLM and TGI read as the model's context: it gets the
    model's. One read back from a folder carries how this process loaded it (``is_local``, ``local_files_only``,
    which ``save_pretrained`` writes back): not a property of the tokenizer, left out. Copied: the run's tokenizer
    is left as it is."""
    from transformers.tokenization_utils_base import VERY_LARGE_INTEGER  # heavy: only when exporting

    if tokenizer is None:
        return None
    tokenizer = copy.deepcopy(tokenizer)
    for key in LOADER_KWARGS:
        tokenizer.init_kwargs.pop(key, None)
    limit = getattr(config.get_text_config(), "max_position_embeddings", None)
    if limit and tokenizer.model_max_length >= VERY_LARGE_INTEGER:
        tokenizer.model_max_length = limit
    return tokenizer


def export_from_model(model, out_dir, tokenizer=None, card: CardWriter | None = None, max_shard_size: str | int = "2GB") -> Path:
    """:func:`export_hf_model` of an in-memory model (its state dict and config; the model itself is untouched)."""
    model = getattr(model, "_orig_mod", model)  # torch.compile wrapper
    return export_hf_model(model.state_dict(), model.config, out_dir, tokenizer=tokenizer, card=card,
                           max_shard_size=max_shard_size)


# ---------------------------------------------------------------------------------------------------
# a sharded export: every stage writes its own weights


def shard_file(index: int, count: int) -> str:
    return f"model-{index + 1:05d}-of-{count:05d}.safetensors"


def _meta_model(config, dtype: torch.dtype = torch.float32):
    from transformers import AutoModelForCausalLM  # heavy: only when exporting

    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(copy.deepcopy(config), dtype=dtype)


def tied_names(config) -> dict[str, str]:
    """The model's ties, {name tied to another: that other name} (transformers' ``all_tied_weights_keys``, e.g.
    ``{"lm_head.weight": "model.embed_tokens.weight"}``; empty when untied): ``from_pretrained`` re-ties them, so a
    folder's index leaves the tied names out, as ``save_pretrained`` does (``storage.checkpoint_io.weight_index``)."""
    return ties(_meta_model(config))


def write_shard(state_dict: dict[str, torch.Tensor], config, path: Path) -> dict[str, int]:
    """Write one stage's weights (original HF names) as one safetensors shard of the HF folder; returns
    {on-disk name: bytes}. The on-disk layout is the one ``from_pretrained`` expects: transformers' own weight
    conversions (e.g. fused MoE expert matrices) are reverted by its ``revert_weight_conversion``, and a tied
    head copy is left out (the model re-ties it on load)."""
    from transformers.core_model_loading import revert_weight_conversion  # heavy: only when exporting

    model = _meta_model(config, _dominant_float_dtype(state_dict))
    tied = set(ties(model))
    sd = {k: v.detach().cpu().contiguous() for k, v in state_dict.items() if k not in tied}
    sd = revert_weight_conversion(model, ckpt.untie_shared_storage(sd)) if sd else {}
    with writing(path):
        save_file(sd, str(path), metadata={"format": "pt"})
    return {k: v.numel() * v.element_size() for k, v in sd.items()}


def export_engine(engine, out_dir, *, tokenizer=None, card: CardWriter | None = None) -> Path | None:
    """Export the engine's newest weights as an HF folder without gathering them: every stage (data-parallel rank 0)
    writes its own shard, the main process gets only names and sizes and writes the index
    (``model.safetensors.index.json``), config, generation config, tokenizer and card. Collective: every rank calls
    it; returns the folder on the main process (None elsewhere). An existing export is replaced only when the new
    one is complete."""
    out = Path(out_dir)
    main = is_main_process()
    tmp = out.parent / f".{out.name}.partial"
    if main:
        _check_out_dir(out)
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()
    shards = engine.export_shards(tmp)  # collective: (file, {name: bytes}) of every stage, on the main process
    if not main:
        return None
    try:
        with writing(tmp):
            _finish_folder(tmp, shards, engine.config, tokenizer, card, out)
            follow_umask(tmp)
            replace_dir(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def _finish_folder(tmp: Path, shards: list[tuple[str, dict[str, int]]], config, tokenizer, card, out: Path) -> None:
    from transformers import GenerationConfig  # heavy: only when exporting

    if len(shards) == 1:  # one shard: the name save_pretrained gives it, no index
        (tmp / shards[0][0]).rename(tmp / "model.safetensors")
    else:
        weight_map = {k: f for f, sizes in shards for k in sizes}
        ckpt.save_json(tmp / "model.safetensors.index.json", {
            "metadata": {"total_size": sum(sum(sizes.values()) for _, sizes in shards)}, "weight_map": weight_map})
    config = copy.deepcopy(config)
    config.dtype = torch.float32  # the stages train fp32 master weights
    meta = _meta_model(config)
    config.architectures = [type(meta).__name__]  # what save_pretrained writes; vLLM's registry needs it
    config.save_pretrained(str(tmp))
    generation = GenerationConfig.from_model_config(config)
    tokenizer = tokenizer_for_export(tokenizer, config)
    if tokenizer is not None:
        for attr in ("bos_token_id", "eos_token_id", "pad_token_id"):
            if getattr(tokenizer, attr, None) is not None:
                setattr(generation, attr, getattr(tokenizer, attr))
        tokenizer.save_pretrained(str(tmp))
    generation.save_pretrained(str(tmp))
    if card is not None:
        card(meta, tmp, out)


# ---------------------------------------------------------------------------------------------------
# checkpoints


def load_checkpoint_state(ckpt_dir, unverified: bool = False) -> tuple[dict[str, torch.Tensor], object, object]:
    """(merged weights, config, tokenizer or None) of a checkpoint (layout in the module docstring), verified
    against its manifest. A folder without one is refused: a training checkpoint always has one, so it was removed
    or the folder is incomplete, and nothing would say whether its files are the ones written. ``unverified``
    (``hf-asyncpp export --unverified``): read it anyway (a hand-assembled folder), with a warning.

    Stage files are merged by name; a name in several files (a tied head) must hold equal values.
    ``stage-XX-versions.safetensors`` (2BW's older weight version) is not part of the model.
    """
    from transformers import AutoConfig, AutoTokenizer

    path = Path(ckpt_dir)
    if not path.is_dir():
        raise FileNotFoundError(f"{path}: no such checkpoint directory")
    files = [path / MODEL_FILE] if (path / MODEL_FILE).exists() else stage_weight_files(path)
    if not files:
        raise FileNotFoundError(f"{path}: no model.safetensors or stage-XX.safetensors; is it a hf_asyncpp checkpoint?")
    if not (path / "config.json").exists():
        raise FileNotFoundError(f"{path}: config.json is missing")
    if (path / MANIFEST).is_file():
        problems = ckpt.verify(path)
        if problems:
            raise CheckpointError(f"{path} does not match its manifest: {'; '.join(problems)}")
    elif not unverified:
        raise CheckpointError(f"{path}: no {MANIFEST}, so its files cannot be verified (a training checkpoint always "
                              "has one: it was removed, or the folder is incomplete); export a complete checkpoint, or "
                              "pass --unverified to export this folder's files as they are")
    else:
        log.warning("%s: no %s; exporting its files unverified (--unverified)", path, MANIFEST)
    state: dict[str, torch.Tensor] = {}
    owner: dict[str, str] = {}
    for f in files:
        for k, v in ckpt.load_tensors(f).items():
            if k in state and not torch.equal(state[k], v):
                raise ValueError(f"{path}: {k} differs between {owner[k]} and {f.name}")
            state[k], owner[k] = v, f.name
    config = AutoConfig.from_pretrained(str(path))
    tok = AutoTokenizer.from_pretrained(str(path / TOKENIZER_DIR)) if (path / TOKENIZER_DIR).is_dir() else None
    return state, config, tok
