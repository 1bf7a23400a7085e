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
import torch
import transformers
from huggingface_hub.utils import HFValidationError, validate_repo_id
from transformers import CONFIG_MAPPING, AutoConfig, AutoTokenizer
from transformers.optimization import TYPE_TO_SCHEDULER_FUNCTION
from transformers.trainer_utils import SchedulerType
from transformers.utils import SAFE_WEIGHTS_INDEX_NAME, SAFE_WEIGHTS_NAME, WEIGHTS_INDEX_NAME, WEIGHTS_NAME

from ..config.recipe import Recipe
from ..config.sections import DataConfig, EvalConfig, ModelConfig, PipelineConfig, TrainingConfig
from ..data.files import expand_files, screen_files
from ..data.sources import nothing_usable
from ..errors import DataError, RecipeError
from ..eval.downstream import require_lm_eval
from ..optim.lr import build_scheduler
from ..partition import PartitionError, partition_plan
from ..schedules.records import pipelined
from ..storage.write import check_output_dir, check_output_dir_free
from .folder import check_fresh_run, check_something_to_resume
from .hub import cause_of, check_repo
from ..offline import go_offline, hub_unreachable, offline_advice, switch_offline
from .reporting import check_trackers

WEIGHT_FILES = (SAFE_WEIGHTS_NAME, SAFE_WEIGHTS_INDEX_NAME, WEIGHTS_NAME, WEIGHTS_INDEX_NAME)
"""What ``from_pretrained`` loads a local folder's weights from (single file or sharded index, safetensors first)."""


def check_recipe(recipe: Recipe, *, hub: bool = True) -> None:
    """Every check below (``hub``: also the Hub token and repository, when the run pushes)."""
    t = recipe.training
    check_lr_schedule(t)
    config = check_model_config(recipe.model, recipe.data)
    if config is not None:
        check_stage_split(recipe.pipeline, config, recipe.data.seq_len)
    check_trackers(t.report_to)
    check_eval_tasks(recipe.eval)
    check_something_to_resume(Path(t.output_dir), t.resume_from_checkpoint)  # before the folder is made
    out = check_output_dir(t.output_dir)
    check_output_dir_free(out)  # another run holds it: said first, whatever else the folder holds
    if t.resume_from_checkpoint is None:
        check_fresh_run(out, t.overwrite_output_dir, main=False)  # refuses another run's folder; removes nothing
    pretrained = check_model(recipe.model, recipe.data)
    if pretrained is not None:  # its layers, now that its config is read
        check_stage_split(recipe.pipeline, pretrained, recipe.data.seq_len)
    check_data(recipe.data)
    if recipe.hub.push_to_hub:
        check_repo_id(recipe.hub.hub_model_id)
    if hub and recipe.hub.push_to_hub:
        check_repo(recipe.hub)


def check_eval_tasks(ev: EvalConfig) -> None:
    """``eval.tasks`` other than perplexity are scored by lm-evaluation-harness, the ``eval`` extra: without it the
    run stops before it starts (one line naming the install), not after its training."""
    try:
        require_lm_eval(ev.tasks, "eval.tasks")
    except ImportError as e:
        raise RecipeError(str(e)) from None


def check_repo_id(repo_id: str) -> None:
    """``hub.hub_model_id`` is a repository id the Hub takes (``huggingface_hub``'s own ``validate_repo_id``),
    checked here without the network: offline, or with no token, a malformed id was met only by the push."""
    try:
        validate_repo_id(repo_id)
    except HFValidationError as e:
        raise RecipeError(f"hub.hub_model_id: {' '.join(str(e).split())} Write it as user/name") from None


def _looks_local(name: str) -> bool:
    """A path rather than a Hub id (``user/name`` or ``name``)."""
    return name.startswith((".", "/", "~")) or name.count("/") > 1 or os.sep != "/" and os.sep in name


def _loadable(field: str, name: str, load, what: str):
    """What ``load(name)`` returns; an error naming ``field`` when it cannot be loaded. A Hub id with the Hub out of
    reach is read from the cache (offline mode from then on) or refused in one line (``run/offline.py``)."""
    if _looks_local(name) and not os.path.exists(os.path.expanduser(name)):
        raise RecipeError(f"{field}: {name!r}: no such folder (a Hub id is written user/name)")
    if not os.path.exists(os.path.expanduser(name)) and (why := hub_unreachable()):
        try:
            loaded = load(name, local_files_only=True)
        except Exception:  # noqa: BLE001 - not in the cache (OSError), or cached incompletely
            raise RecipeError(f"{field}: {name!r}: {offline_advice(name, why)}") from None
        go_offline(why, f"{field} {name!r}")
        return loaded
    try:
        return load(name)
    except Exception as e:  # noqa: BLE001 - transformers raises OSError, ValueError, KeyError, httpx errors
        where = "the folder" if os.path.isdir(name) else "not a local folder; from the Hub"
        raise RecipeError(f"{field}: {name!r} has no {what} that transformers can load ({where}: {cause_of(e)})") from e


SET_BY_THE_RECIPE = {"optimizer": "the run's optimizer", "num_warmup_steps": "training.warmup_steps",
                     "num_training_steps": "training.max_steps", "last_epoch": "a resume"}
"""The arguments of transformers' schedule functions that ``get_scheduler`` fills itself."""


def check_lr_schedule(training: TrainingConfig) -> None:
    """``training.lr_scheduler_kwargs`` holds only arguments of the schedule function ``lr_scheduler_type`` names
    (transformers' ``TYPE_TO_SCHEDULER_FUNCTION``, read by ``inspect.signature``; a misspelt key gets a
    did-you-mean), and the schedule builds and gives a finite lr at the first and the last step, on a one-parameter
    probe optimizer, as the trainer builds it. A typo here used to be met by every rank after the start, as a
    ``TypeError`` traceback each; a missing ``min_lr_rate`` of ``cosine_with_min_lr`` the same way."""
    kwargs = dict(training.lr_scheduler_kwargs)
    kind = training.lr_scheduler_type
    fn = TYPE_TO_SCHEDULER_FUNCTION[SchedulerType(kind)]
    params = inspect.signature(fn).parameters
    if not any(p.kind == p.VAR_KEYWORD for p in params.values()):
        takes = [n for n in params if n not in SET_BY_THE_RECIPE]
        for key in kwargs:
            if key in SET_BY_THE_RECIPE:
                raise RecipeError(f"training.lr_scheduler_kwargs.{key}: set by {SET_BY_THE_RECIPE[key]}; remove it "
                                  "from lr_scheduler_kwargs")
            if key not in takes:
                near = difflib.get_close_matches(str(key), takes, n=1, cutoff=0.6)
                fix = (f"did you mean {near[0]!r}?" if near else
                       f"it takes {', '.join(takes)}" if takes else "it takes none: remove lr_scheduler_kwargs")
                raise RecipeError(f"training.lr_scheduler_kwargs.{key}: not an argument of transformers' {fn.__name__} "
                                  f"(lr_scheduler_type {kind!r}); {fix}")
    probe = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    try:
        scheduler = build_scheduler(probe, training)
        for fn_of_step in getattr(scheduler, "lr_lambdas", []):
            for step in (0, training.max_steps):
                lr = float(fn_of_step(step))
                if not lr == lr or lr in (float("inf"), float("-inf")):
                    raise ValueError(f"the lr at step {step} is {lr}")
    except Exception as e:  # noqa: BLE001 - transformers raises ValueError, TypeError, ZeroDivisionError
        raise RecipeError(f"training.lr_scheduler_kwargs: {kwargs} for lr_scheduler_type {kind!r} is refused by "
                          f"transformers' {fn.__name__}: {' '.join(str(e).split())}") from None


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


def check_model(model: ModelConfig, data: DataConfig):
    """``model.name_or_path`` has a config whose positions hold ``data.seq_len``, and the tokenizer to be used
    (``model.tokenizer_name_or_path``, else the model's own) loads and fits the model (:func:`check_tokenizer_fits`);
    the pretrained model's config (None for a random init)."""
    config = None
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
        tokenizer = _loadable("model.tokenizer_name_or_path", model.tokenizer_name_or_path,
                              AutoTokenizer.from_pretrained, "tokenizer")
        if model.name_or_path:
            check_tokenizer_fits(model, config, tokenizer)
    elif model.name_or_path:
        _loadable("model.name_or_path", model.name_or_path, AutoTokenizer.from_pretrained,
                  "tokenizer (set model.tokenizer_name_or_path)")
    return config


def same_ids(a, b) -> bool:
    """Whether two tokenizers give every token they share the same id: the smaller vocabulary is contained in the
    larger, id for id (a tokenizer with tokens added at the end keeps the ids of the one it extends)."""
    small, big = sorted((a.get_vocab(), b.get_vocab()), key=len)
    return all(big.get(token) == i for token, i in small.items())


def check_tokenizer_fits(model: ModelConfig, config, tokenizer) -> None:
    """A pretrained ``model.name_or_path`` given another tokenizer (``model.tokenizer_name_or_path``) is refused when
    that tokenizer's ids are not the model's own tokenizer's: its embedding rows are indexed by its own ids, so with
    another tokenizer every id names a different token (measured: untrained perplexity 7528 where the model with its
    own tokenizer scores 76), the run trains that scramble away at full cost, and the export pairs the model's
    embeddings with the other tokenizer; nothing said so. Refused rather than warned: a warning scrolls by in a run
    that then exits 0, and both fixes are one field (drop ``tokenizer_name_or_path``, or train ``model.config`` from
    random init for a new vocabulary). The model's own tokenizer with tokens added keeps the ids: allowed, and its
    embeddings grow to it (``resize_token_embeddings``, logged). Where the model has no tokenizer of its own to
    compare with, a tokenizer larger than the model's embeddings is refused (its ids past them would need rows that
    no one trained, and a stage-local load cannot add them); a smaller one is allowed."""
    embeddings = config.get_text_config().vocab_size
    try:
        own = AutoTokenizer.from_pretrained(model.name_or_path, local_files_only=True)  # never a Hub round trip
    except Exception:  # noqa: BLE001 - no tokenizer beside the model (a bare weights folder), or not cached
        own = None
    if own is not None and not same_ids(own, tokenizer):
        raise RecipeError(f"model.tokenizer_name_or_path: {model.tokenizer_name_or_path!r} ({len(tokenizer)} tokens) "
                          f"is not the tokenizer model.name_or_path {model.name_or_path!r} was trained with "
                          f"({len(own)} tokens, other ids): its {embeddings} embeddings would mean other tokens; drop "
                          "model.tokenizer_name_or_path to use the model's own, or train model.config from random init "
                          "for a new vocabulary")
    if own is None and len(tokenizer) > embeddings:
        raise RecipeError(f"model.tokenizer_name_or_path: {model.tokenizer_name_or_path!r} has {len(tokenizer)} "
                          f"tokens, more than the {embeddings} embeddings of model.name_or_path "
                          f"{model.name_or_path!r}; give the tokenizer the model was trained with")


def check_data(data: DataConfig) -> None:
    """A Hub dataset resolves (its builder, not its data); local files exist and at least one can be read; for a
    mixture, each source's (named ``data.sources[i]``)."""
    if data.sources:
        for i, (source, _) in enumerate(data.source_configs().values()):
            _check_source(source, f"data.sources[{i}]")
        return
    _check_source(data, "data")


def _check_source(data: DataConfig, where: str) -> None:
    if data.dataset:
        why = None if os.path.exists(os.path.expanduser(data.dataset)) else hub_unreachable()
        if why:  # datasets has no local_files_only: its offline mode reads the cache
            switch_offline()
        try:
            datasets.load_dataset_builder(data.dataset, data.dataset_config)
            if why:
                go_offline(why, f"{where}.dataset {data.dataset!r}")
        except Exception as e:  # noqa: BLE001 - not found, offline, a wrong config name
            if why:
                raise DataError(f"{where}.dataset: {data.dataset!r}: {offline_advice(data.dataset, why)}") from None
            raise DataError(f"{where}.dataset: {data.dataset!r} cannot be loaded ({cause_of(e)}); check its name and "
                            f"{where}.dataset_config, download it while online, or set {where}.train_files") from e
    fields = ((f"{where}.eval_files", data.eval_files),) if data.dataset else (
        (f"{where}.train_files", data.train_files), (f"{where}.eval_files", data.eval_files))
    for field, patterns in fields:
        if patterns:
            files = expand_files(patterns, field)
            usable, _, skipped = screen_files(files, data.text_column, data.encoding)
            if not usable:
                raise DataError(nothing_usable(skipped, data.text_column) if skipped else
                                f"{field}: every file is empty: {files[:5]}")
