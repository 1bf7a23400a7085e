"""Evaluation, in one home: the task registry (``tasks``), held-out perplexity through the shipped ``evaluate``
metrics (``perplexity``, ``metrics/``), our zero-shot scorer with its tables (``downstream``) and lm-evaluation-harness
as the other scorer (``lm_eval``). Nothing here writes a model folder or knows about a training run: ``model/export.py``
writes folders, ``run/evaluator.py`` decides when a run is evaluated."""
