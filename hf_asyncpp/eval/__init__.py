"""Evaluation, in one home. Nothing here writes a model folder or knows about a training run: ``model/export.py``
writes folders, ``run/evaluator.py`` decides when a run is evaluated.

==============  =========================================================================================
``tasks``       the zero-shot task registry, as lm-evaluation-harness defines the tasks, and their data
``perplexity``  held-out perplexity of a model, a folder or NLL sums: exp(total NLL / predicted tokens)
``downstream``  our zero-shot scorer with lm-eval's task definitions; several models side by side, tables, plots
``lm_eval``     lm-evaluation-harness itself as the scorer (``eval.backend: lm_eval``), local task YAMLs
==============  =========================================================================================

``metrics/`` holds the ``evaluate`` metric script of the zero-shot scorer (accuracy), loaded by path.
"""
