"""What can be checked before training is checked before the processes start.

A wrong model path, an unreachable Hub dataset, a tracker that is not installed, an unwritable output folder or a
token the Hub refuses used to surface inside the stage processes (as a traceback from every rank), or, for the Hub
push, only after the training. :func:`check_recipe` checks them once: in the process that starts the ranks
(``hf-asyncpp train``, ``scripts/pretrain.py``), or under a launcher in each rank before its first step (the Hub
on the main rank only). It goes through the libraries' own calls (``AutoConfig``/``AutoTokenizer.from_pretrained``,
``datasets.load_dataset_builder``, ``HfApi.whoami``/``create_repo``), so that what passes here loads in training
too, from a local folder, the cache (offline) or the Hub; what fails is one ``error:`` line naming the recipe field.
Nothing is written but the output folder (created, as training would).
"""
from __future__ import annotations

import os

import datasets
from transformers import AutoConfig, AutoTokenizer

from ..config.recipe import DataConfig, ModelConfig, Recipe
from ..data.files import expand_files, screen_files
from ..data.stream import nothing_usable
from ..errors import DataError, RecipeError
from ..storage.write import check_output_dir
from .folder import check_fresh_run
from .hub import cause_of, check_repo
from .reporting import check_trackers


def check_recipe(recipe: Recipe, *, hub: bool = True) -> None:
    """Every check below (``hub``: also the Hub token and repository, when the run pushes)."""
    t = recipe.training
    check_trackers(t.report_to)
    out = check_output_dir(t.output_dir)
    if t.resume_from_checkpoint is None:
        check_fresh_run(out, t.overwrite_output_dir, main=False)  # refuses another run's folder; removes nothing
    check_model(recipe.model)
    check_data(recipe.data)
    if hub and recipe.hub.push_to_hub:
        check_repo(recipe.hub)


def _looks_local(name: str) -> bool:
    """A path rather than a Hub id (``user/name`` or ``name``)."""
    return name.startswith((".", "/", "~")) or name.count("/") > 1 or os.sep != "/" and os.sep in name


def _loadable(field: str, name: str, load, what: str) -> None:
    if _looks_local(name) and not os.path.exists(os.path.expanduser(name)):
        raise RecipeError(f"{field}: {name!r}: no such folder (a Hub id is written user/name)")
    try:
        load(name)
    except Exception as e:  # noqa: BLE001 - transformers raises OSError, ValueError, KeyError, httpx errors
        where = "the folder" if os.path.isdir(name) else "not a local folder; from the Hub"
        raise RecipeError(f"{field}: {name!r} has no {what} that transformers can load ({where}: {cause_of(e)})") from e


def check_model(model: ModelConfig) -> None:
    """``model.name_or_path`` has a config, and the tokenizer to be used (``model.tokenizer_name_or_path``, else the
    model's own) loads."""
    if model.name_or_path:
        _loadable("model.name_or_path", model.name_or_path, AutoConfig.from_pretrained, "model config")
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
            usable, _, skipped = screen_files(files, data.text_column)
            if not usable:
                raise DataError(nothing_usable(skipped, data.text_column) if skipped else
                                f"{field}: every file is empty: {files[:5]}")
