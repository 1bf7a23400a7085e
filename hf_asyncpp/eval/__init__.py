"""Evaluation, in one home. Nothing here writes a model folder or knows about a training run: ``model/export.py``
writes folders, ``run/evaluator.py`` decides when a run is evaluated.

==============  =========================================================================================
``perplexity``  held-out perplexity of a model, a folder or NLL sums: exp(total NLL / predicted tokens)
``lm_eval``     lm-evaluation-harness, the zero-shot scorer: PipelineLM over the stages, HFLM, local task YAMLs
``downstream``  exported models side by side (lm-eval's tasks and perplexity), tables, plots; the extra's check
==============  =========================================================================================
"""
