"""Recipe field names users bring from elsewhere: fields that changed name here, and transformers'
``TrainingArguments`` names, each with what to write instead (``config._build`` answers an unknown field with it).
"""
from __future__ import annotations

RENAMED = {
    "training.min_lr_ratio": "renamed: for a cosine decay to a fraction of the peak use lr_scheduler_type: "
                             "cosine_with_min_lr with lr_scheduler_kwargs: {min_lr_rate: 0.1} (transformers' names; "
                             "lr_scheduler_type: cosine now decays to 0, as in transformers)",
}
"""Recipe fields that changed name, and what to write instead."""

TRAINER_EQUIVALENTS = {
    "per_device_train_batch_size": "pipeline.microbatch_size (sequences per microbatch; a step takes "
                                   "pipeline.num_microbatches of them on each data-parallel replica)",
    "gradient_accumulation_steps": "pipeline.num_microbatches (microbatches accumulated per optimizer step; in a "
                                   "pipeline they are also what keeps the stages busy)",
    "learning_rate": "optimizer.learning_rate",
    "weight_decay": "optimizer.weight_decay",
    "adam_epsilon": "optimizer.adam_epsilon",
    "optim": "optimizer.name (muon, adamw, nadam, sgd; adamw_torch_fused: adamw with optimizer.fused: true)",
    "num_train_epochs": "training.max_steps (training is counted in optimizer steps)",
}
"""transformers.TrainingArguments names a recipe does not use under that name, and the field that means the same."""
