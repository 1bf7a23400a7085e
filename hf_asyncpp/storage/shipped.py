"""Files shipped with the package that live at the top of the checkout (setup.py maps them into the package).

An installed package (wheel or editable) reaches them as ``hf_asyncpp.model_cards`` and
``hf_asyncpp.accelerate_configs``; a process whose current directory is the checkout imports ``hf_asyncpp`` from the
directory itself, where those two subpackages are not folders of ``hf_asyncpp/``: there they are read from the
checkout's ``model_cards/`` and ``recipes/accelerate/``.
"""
from __future__ import annotations

from importlib import resources
from pathlib import Path

_CHECKOUT = {"model_cards": "model_cards", "accelerate_configs": "recipes/accelerate"}


def shipped_file(folder: str, name: str) -> Path:
    """``folder`` is ``model_cards`` or ``accelerate_configs``; the path may not exist (check ``is_file()``)."""
    try:
        return Path(str(resources.files(f"hf_asyncpp.{folder}") / name))
    except ModuleNotFoundError:
        return Path(__file__).resolve().parents[2] / _CHECKOUT[folder] / name
