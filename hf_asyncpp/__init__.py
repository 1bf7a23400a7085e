"""hf_asyncpp: asynchronous pipeline-parallel LLM pretraining (PipeDream-2BW + Muon + EF) for transformers models.

===============  =========================================================================================
``errors``       every error a user can meet and the exit code it ends a run with
``figures``      matplotlib off screen, set up once for every plot
``offline``      whether the Hub can be reached, asked once; the cache and offline mode when it cannot
``schedules``    schedules as data and their simulator, pure Python (torch only for torch's virtual-stage orders)
``storage``      the disk: the one write path, file names, atomic verified checkpoints
``topology``     where a process sits (stage x data-parallel rank), its device, its process groups
``supervision``  which process this is, and a rank never outlives its launcher; stop signals
``config``       the recipe: typed sections, loading, overrides, checks, the generated reference
``data``         files or Hub datasets -> documents -> tokens -> packed blocks
``model``        the model a recipe asks for, initialised, scored, exported
``launch``       starting a run's processes, and ending them with one line
``partition``    exact pipeline stages of any transformers causal LM
``optim``        Muon, AdamW, the EF correction, the single-process delay references
``plan``         what a recipe will cost before anything runs: memory, speed, layouts, the measured split
``engine``       the engine protocol the trainer drives, and the single-process engine
``pipeline``     the runtime: one stage's process running its schedule's action list
``eval``         perplexity and zero-shot tasks
``run``          one training run: the trainer, the components it wires, the checks before it starts
``testing``      spawned gloo ranks for the tests and benchmarks; the host-op and memory probes
``cli``          the ``hf-asyncpp`` command
``__main__``     ``python -m hf_asyncpp``
===============  =========================================================================================
"""

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
