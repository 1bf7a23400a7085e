"""What can be checked before training is checked before the processes start.

A wrong model path, an unreachable Hub dataset, a tracker that is not installed, an unwritable output folder or a
token the Hub refuses would otherwise surface inside the stage processes (as a traceback from every rank), or, for
the Hub push, only after the training. :func:`check_recipe` checks them once: in the process that starts the ranks
(``hf-asyncpp train``, ``scripts/pretrain.py``), or under a launcher in each rank before its first step (the Hub
on the main rank only). It goes through the libraries' own calls (``AutoConfig``/``AutoTokenizer.from_pretrained``,
``datasets.load_dataset_builder``, ``HfApi.whoami``/``create_repo``), so that what passes here loads in training
too, from a local folder, the cache (offline) or the Hub; what fails is one ``error:`` line naming the recipe field.
Nothing is written but the output folder (created, as training would).

The model's own config is checked first (:func:`check_model_config`), before anything is created: transformers keeps
a key its config class does not know as a plain attribute, so a typo in ``model.config`` would train the class's
default and publish the typo in the export's ``config.json``, and a ``data.seq_len`` beyond the model's positions
would train without a word.
"""
from __future__ import annotations

import difflib
import inspect
import os
import re
from pathlib import Path

import datasets
import transformers
from transformers import CONFIG_MAPPING, AutoConfig, AutoTokenizer
from transformers.utils import SAFE_WEIGHTS_INDEX_NAME, SAFE_WEIGHTS_NAME, WEIGHTS_INDEX_NAME, WEIGHTS_NAME

from ..config.recipe import Recipe
from ..config.sections import DataConfig, ModelConfig, PipelineConfig
from ..data.files import expand_files, screen_files
from ..data.sources import nothing_usable
from ..errors import DataError, RecipeError
from ..partition import PartitionError, partition_plan
from ..schedules.records import pipelined
from ..storage.write import check_output_dir, check_output_dir_free
from .folder import check_fresh_run
from .hub import cause_of, check_repo
from .reporting import check_trackers

WEIGHT_FILES = (SAFE_WEIGHTS_NAME, SAFE_WEIGHTS_INDEX_NAME, WEIGHTS_NAME, WEIGHTS_INDEX_NAME)
"""What ``from_pretrained`` loads a local folder's weights from (single file or sharded index, safetensors first)."""


def check_recipe(recipe: Recipe, *, hub: bool = True) -> None:
    """Every check below (``hub``: also the Hub token and repository, when the run pushes)."""
    t = recipe.training
    config = check_model_config(recipe.model, recipe.data)
    if config is not None:
        check_stage_split(recipe.pipeline, config, recipe.data.seq_len)
    check_trackers(t.report_to)
    out = check_output_dir(t.output_dir)
    check_output_dir_free(out)  # another run holds it: said first, whatever else the folder holds
    if t.resume_from_checkpoint is None:
        check_fresh_run(out, t.overwrite_output_dir, main=False)  # refuses another run's folder; removes nothing
    check_model(recipe.model, recipe.data)
    check_data(recipe.data)
    if hub and recipe.hub.push_to_hub:
        check_repo(recipe.hub)


def _looks_local(name: str) -> bool:
    """A path rather than a Hub id (``user/name`` or ``name``)."""
    return name.startswith((".", "/", "~")) or name.count("/") > 1 or os.sep != "/" and os.sep in name


def _loadable(field: str, name: str, load, what: str):
    """What ``load(name)`` returns; an error naming ``field`` when it cannot be loaded."""
    if _looks_local(name) and not os.path.exists(os.path.expanduser(name)):
        raise RecipeError(f"{field}: {name!r}: no such folder (a Hub id is written user/name)")
    try:
        return load(name)
    except Exception as e:  # noqa: BLE001 - transformers raises OSError, ValueError, KeyError, httpx errors
        where = "the folder" if os.path.isdir(name) else "not a local folder; from the Hub"
        raise RecipeError(f"{field}: {name!r} has no {what} that transformers can load ({where}: {cause_of(e)})") from e


def check_model_config(model: ModelConfig, data: DataConfig):
    """A random-init ``model.config`` names a model type transformers knows and only keys its config class takes,
    with values the class accepts, and ``data.seq_len`` fits the positions it gives the model; the config built
    (None for a pretrained model)."""
    if model.config is None:
        return None
    kwargs = dict(model.config)
    model_type = kwargs.pop("model_type")
    if model_type not in CONFIG_MAPPING:
        near = difflib.get_close_matches(str(model_type), list(CONFIG_MAPPING.keys()), n=3, cutoff=0.6)
        hint = f"; did you mean {', '.join(map(repr, near))}?" if near else ""
        raise RecipeError(f"model.config.model_type: {model_type!r} is not a model type transformers "
                          f"{transformers.__version__} knows{hint} (docs/supported-models.md lists the causal LMs)")
    cls = CONFIG_MAPPING[model_type]
    try:
        config = cls(**kwargs)
    except Exception as e:  # noqa: BLE001 - strict validation raises TypeError, ValueError and hub's own errors
        raise RecipeError(f"model.config: {cls.__name__} refuses it: {' '.join(str(e).split())}") from None
    unknown = unknown_config_keys(config, kwargs)
    if unknown:
        known = config_keys(cls)
        near = difflib.get_close_matches(unknown[0], known, n=1, cutoff=0.6)
        fix = f"did you mean {near[0]!r}?" if near else f"its keys: {', '.join(known)}"
        raise RecipeError(f"model.config.{unknown[0]}: not a key of {cls.__name__} (model_type {model_type!r}; "
                          f"transformers would keep it unused and train the default); {fix}")
    name = cls.attribute_map.get("max_position_embeddings", "max_position_embeddings")  # gpt2: n_positions
    given = name in kwargs or "max_position_embeddings" in kwargs
    _check_positions(data, getattr(config, "max_position_embeddings", None),
                     f"model.config.{name}{'' if given else f', {cls.__name__} default'}",
                     f"lower data.seq_len or raise model.config.{name}")
    return config


def check_stage_split(pipeline: PipelineConfig, config, seq_len: int) -> None:
    """The stages fit the model's decoder layers (``pipeline.num_stages``, a ``layers_per_stage`` list), checked on
    the config by the partitioner's own plan, before any stage process starts (it was found after starting them all,
    in one traceback per process)."""
    if not pipelined(pipeline.schedule):
        return
    try:
        partition_plan(config, pipeline.num_stages, pipeline.split, seq_len=seq_len)
    except PartitionError as e:
        raise RecipeError(f"pipeline.{e}") from None


def config_keys(cls) -> list[str]:
    """The keys a config class takes by name: its ``__init__``'s parameters (a transformers 5 config is a
    dataclass: its fields, the ``PreTrainedConfig`` base's included) and the aliases of its ``attribute_map``."""
    params = [n for n, p in inspect.signature(cls.__init__).parameters.items()
              if n != "self" and p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL)]
    return sorted(set(params) | set(cls.attribute_map))


def unknown_config_keys(config, kwargs: dict) -> list[str]:
    """The keys of ``kwargs`` that nothing of transformers takes. A config class keeps whatever its parameters,
    aliases and properties do not take as a plain attribute, so a key is unknown when it ended up that way (keys the
    class consumes, ``rope_theta`` into ``rope_parameters``, are not) and no code of the model or of transformers'
    shared config and modeling code reads it either: ``head_dim`` is no parameter of ``Qwen3MoeConfig``, but
    its attention reads ``getattr(config, "head_dim", ...)``; ``Gemma3TextConfig`` takes the legacy
    ``sliding_window_pattern`` from its kwargs."""
    cls = type(config)
    known = set(config_keys(cls))
    left = [k for k in kwargs if k not in known and k in vars(config) and not hasattr(cls, k)]
    if not left:
        return []
    sources = _sources(Path(inspect.getsourcefile(cls)).parent)
    return sorted(k for k in left if not re.search(rf"""(?:config|self)\.{re.escape(k)}\b|["']{re.escape(k)}["']""",
                                                   sources))


def _sources(model_folder: Path) -> str:
    """The text of a model's transformers folder and of the shared code that reads configs."""
    root = Path(transformers.__file__).parent
    files = [*sorted(model_folder.glob("*.py")), *(root / name for name in SHARED_CONFIG_READERS)]
    return "\n".join(f.read_text(encoding="utf-8") for f in files if f.is_file())


SHARED_CONFIG_READERS = ("configuration_utils.py", "modeling_rope_utils.py", "modeling_utils.py", "masking_utils.py",
                         "cache_utils.py")
"""transformers' modules (under its package folder) that read config attributes for every model."""


def _check_positions(data: DataConfig, positions, where: str, fix: str) -> None:
    """``data.seq_len`` at most the model's positions (nothing to check where the config has none)."""
    if isinstance(positions, int) and not isinstance(positions, bool) and data.seq_len > positions:
        raise RecipeError(f"data.seq_len: {data.seq_len} tokens per block, but the model has {positions} positions "
                          f"({where}); {fix}")


def check_model(model: ModelConfig, data: DataConfig) -> None:
    """``model.name_or_path`` has a config whose positions hold ``data.seq_len``, and the tokenizer to be used
    (``model.tokenizer_name_or_path``, else the model's own) loads."""
    if model.name_or_path:
        config = _loadable("model.name_or_path", model.name_or_path, AutoConfig.from_pretrained, "model config")
        _check_positions(data, getattr(config, "max_position_embeddings", None),
                         f"max_position_embeddings of model.name_or_path {model.name_or_path!r}",
                         "lower data.seq_len")
        folder = Path(os.path.expanduser(model.name_or_path))
        if folder.is_dir() and not any((folder / n).is_file() for n in WEIGHT_FILES):
            raise RecipeError(f"model.name_or_path: {model.name_or_path!r} has a config but no weights (none of "
                              f"{', '.join(WEIGHT_FILES)}); to train that config from scratch give it as model.config "
                              "instead, or point at the folder save_pretrained wrote")
    if model.tokenizer_name_or_path:
        _loadable("model.tokenizer_name_or_path", model.tokenizer_name_or_path, AutoTokenizer.from_pretrained, "tokenizer")
    elif model.name_or_path:
        _loadable("model.name_or_path", model.name_or_path, AutoTokenizer.from_pretrained,
                  "tokenizer (set model.tokenizer_name_or_path)")


def check_data(data: DataConfig) -> None:
    """A Hub dataset resolves (its builder, not its data); local files exist and at least one can be read."""
    if data.dataset:
        try:
            datasets.load_dataset_builder(data.dataset, data.dataset_config)
        except Exception as e:  # noqa: BLE001 - not found, offline, a wrong config name
            raise DataError(f"data.dataset: {data.dataset!r} cannot be loaded ({cause_of(e)}); check its name and "
                            "data.dataset_config, download it while online, or set data.train_files") from e
    fields = (("data.eval_files", data.eval_files),) if data.dataset else (
        ("data.train_files", data.train_files), ("data.eval_files", data.eval_files))
    for field, patterns in fields:
        if patterns:
            files = expand_files(patterns, field)
            usable, _, skipped = screen_files(files, data.text_column, data.encoding)
            if not usable:
                raise DataError(nothing_usable(skipped, data.text_column) if skipped else
                                f"{field}: every file is empty: {files[:5]}")
