"""Optimizers and delay tools.

===========  ============================================================================================
``builder``  the recipe's optimizer over a module: parameter classification and ``build_optimizer``
``muon``     Muon with an AdamW side, in one optimizer (one lr scheduler drives both)
``ef``       the update-level Error-Feedback delay correction, for any optimizer
``delay``    exact single-process simulation of the schedules' gradient delays, and its parameter groups
``lr``       learning-rate schedules: transformers' own, by their names and with their meanings
===========  ============================================================================================

- ``build_optimizer(module, cfg, log)``: hybrid Muon (+ AdamW side), AdamW, NAdam or SGD over a model
  or a pipeline stage, with the parameter classification of ``classify_parameters``.
- ``apply_delay_correction(optimizer, cfg)``: the update-level Error-Feedback correction (step hooks).
- ``DelaySimulator``: exact single-process PipeDream-2BW / PipeDream gradient delays.
"""
from __future__ import annotations

from .builder import KINDS, build_optimizer, classify_parameters
from .delay import DelaySimulator, MODES
from .ef import apply_delay_correction, auto_lambda, install_error_feedback
from .muon import Muon, adjusted_lr, zeropower_via_newtonschulz

__all__ = ["build_optimizer", "classify_parameters", "KINDS", "apply_delay_correction", "install_error_feedback", "auto_lambda",
           "DelaySimulator", "MODES", "Muon", "zeropower_via_newtonschulz", "adjusted_lr"]
