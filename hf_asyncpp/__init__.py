"""hf_asyncpp: asynchronous pipeline-parallel LLM pretraining (PipeDream-2BW + Muon + EF) for transformers models."""

__version__ = "0.1.0"

from .errors import RecipeError  # noqa: E402  (a leaf: no import of its own)


def __getattr__(name):
    # Lazy: `import hf_asyncpp` must stay cheap (transformers imports take seconds).
    if name in ("partition_model", "tied_parameters", "partition_plan"):
        from . import partition

        return getattr(partition, name)
    if name in ("load_recipe", "Recipe"):
        from .config import recipe

        return getattr(recipe, name)
    raise AttributeError(name)
