"""Recipe field names users bring from elsewhere: transformers' ``TrainingArguments`` names, each with what to write
instead (``config._build`` answers an unknown field with it).
"""
from __future__ import annotations

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
