"""Split a transformers ``*ForCausalLM`` into exact pipeline stages, without changing its class or code.

==================  ======================================================================================
``plan``            where a model's pieces live and how its layers split into stages (no stage built)
``trace``           where each piece runs relative to the decoder layers, learnt from one forward
``stage``           stage modules: each runs the model's own forward, other stages' layers skipped
``hollow``          stand-ins for the modules a stage does not hold
``moe_aux``         transformers' router auxiliary loss, pooled across stages
``split_backward``  the W of a split backward (zero bubble): every group's weight gradients in one backward
``sweep``           every causal-LM type of the installed transformers, built tiny and split: which split exactly
==================  ======================================================================================

Stage contract (the runtime and the tests rely on it):

- ``partition_model(model, p)`` returns ``p`` plain ``nn.Module`` stages. ``stages[0](input_ids)`` -> activation;
  ``stages[i](activation)`` -> activation; ``stages[-1](activation, labels=labels)`` -> the loss, the mean over
  the microbatch's tokens exactly as ``model(input_ids, labels=labels).loss`` (labels shifted inside, -100
  ignored); ``stages[-1](activation)`` -> the logits. Each forward takes exactly one positional argument.
- An activation is the hidden-state tensor, or for MoE models whose config sets ``output_router_logits`` (and
  that add transformers' router auxiliary loss) the tuple
  ``(hidden (B, T, H) float, router_prob_sum (E,) float32, router_counts (E + 1,) int64)``:
  the softmax probabilities and top-k assignment counts summed over every router so far (the last count entry is
  the number of router rows). The last stage adds ``router_aux_loss_coef * aux_loss`` computed from these pooled
  sums, exactly transformers' loss over all layers. Floating elements (hidden, router_prob_sum) require grad and
  need their gradients sent back; the int64 counts need no gradient. Nothing else (no None, no Python objects).
- Parameter names are the model's own (``model.layers.3.mlp.gate_proj.weight``); every parameter is in exactly
  one stage, except tensors the model uses under several names on several stages (tied input/output embeddings,
  Zamba's transformer block shared by several layers): each stage that needs one holds a copy, and
  ``tied_parameters(stages)`` lists ``(earlier-stage name, later-stage name)`` pairs whose gradients must be summed
  and whose values must stay equal (``shared_tensors(stages)``: the same, per tensor, with the stages holding it).
  ``merge_state_dicts(stage_state_dicts, tied)`` re-ties them.
- Parameters held directly by a layer container (Zaya's input scale on ``ZayaModel``) go to the stage that uses
  them (first or last). A layer output the model hands to the next layer besides the hidden state (Zaya's router
  state, HY-V4's indexer top-k) travels after the side inputs, in the order of ``anatomy(model).carry``. A router
  aux loss other than the Switch loss (Doge) is computed by the model's own function on the last stage from every
  router call's logits, which the stages send after the hidden state instead of the pooled statistics.
- Every stage runs the model's own forward (stage.py): its layers are the model's modules (shared, not copied),
  other stages' layers and weights are hollow stand-ins, so masks, rotary / ALiBi, per-layer embeddings, scalings,
  norms and heads are the model's code. Layer arguments with gradient computed before the layers (per-layer
  embeddings) travel after the hidden state, in the order of ``anatomy(model).side``. Stages hold no reference to
  the model: layers no stage uses are freed with the model.
- A stage built from a meta model can be ``.to_empty(device=...)``'d (non-persistent buffers such as rotary
  frequencies are recomputed; load the weights next) or ``init_weights()``'d.
- Model types outside ``VERIFIED_MODEL_TYPES`` are checked numerically against the model at partition time; a
  model the stage builder cannot reproduce raises ``PartitionError`` naming the module and why.
"""
from .plan import Anatomy, PartitionError, PartitionPlan, StagePlan, anatomy, balanced_sizes, partition_plan
from .stage import (AuxLoss, Stage, VERIFIED_MODEL_TYPES, check_partition, merge_state_dicts, partition_model,
                    run_stages, shared_tensors, tied_parameters)

__all__ = ["partition_model", "partition_plan", "tied_parameters", "shared_tensors", "merge_state_dicts", "check_partition", "run_stages",
           "PartitionPlan", "StagePlan", "PartitionError", "Stage", "AuxLoss", "Anatomy", "anatomy", "balanced_sizes",
           "VERIFIED_MODEL_TYPES"]
