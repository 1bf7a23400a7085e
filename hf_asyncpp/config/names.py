"""Recipe field names users bring from elsewhere: the HF Trainer's ``TrainingArguments``, the ``run_clm`` example
script's, trl's and torch's, each with the field that means the same here (``recipe._unknown_field`` answers an
unknown field with it, in the recipe file and on the command line; docs/recipes.md lists them).

None of them is accepted in place of the field: a user who writes ``--block_size`` learns ``--data.seq_len`` once,
and a name whose meaning differs here (``eval_strategy``, ``num_train_epochs``) is never guessed. A name that is a
field of another section here (``--max_steps``, ``training.learning_rate``) needs no entry: the recipe's own
dataclasses answer it.
"""
from __future__ import annotations

TRAINER = "transformers.TrainingArguments"
RUN_CLM = "run_clm"  # transformers' examples/pytorch/language-modeling/run_clm.py
TRL = "trl"  # SFTConfig / ScriptArguments / ModelConfig
TORCH = "torch.optim"

FOREIGN_NAMES: dict[str, tuple[str, str | None, str]] = {
    # name: (whose name it is, the field here (None: not a recipe field), what differs)
    "per_device_train_batch_size": (TRAINER, "pipeline.microbatch_size",
                                    "sequences per microbatch; a step takes pipeline.num_microbatches of them on each "
                                    "data-parallel replica"),
    "gradient_accumulation_steps": (TRAINER, "pipeline.num_microbatches",
                                    "microbatches accumulated per optimizer step; in a pipeline they are also what "
                                    "keeps the stages busy"),
    "optim": (TRAINER, "optimizer.name", "muon, adamw, nadam, sgd; adamw_torch_fused: adamw with optimizer.fused: true"),
    "num_train_epochs": (TRAINER, "training.max_steps", "training is counted in optimizer steps"),
    "max_train_samples": (RUN_CLM, "training.max_steps", "training is counted in optimizer steps"),
    "eval_strategy": (TRAINER, "training.eval_steps", "evaluate every N steps; 0: only at the end"),
    "evaluation_strategy": (TRAINER, "training.eval_steps", "evaluate every N steps; 0: only at the end"),
    "save_strategy": (TRAINER, "training.save_steps", "checkpoint every N steps; 0: only at the end"),
    "logging_strategy": (TRAINER, "training.logging_steps", "log every N steps"),
    "hub_private_repo": (TRAINER, "hub.private", "true by default here"),
    "hub_token": (TRAINER, None, "the token is not a recipe field: `hf auth login` or the HF_TOKEN variable"),
    "fp16": (TRAINER, "training.bf16", "fp16 is not supported; bf16 autocast, the weights and optimizer stay fp32"),
    "model_name_or_path": (RUN_CLM, "model.name_or_path", ""),
    "tokenizer_name": (RUN_CLM, "model.tokenizer_name_or_path", ""),
    "config_name": (RUN_CLM, "model.config", "a mapping of config keys with model_type, for a random init"),
    "config_overrides": (RUN_CLM, "model.config", "one key each: --model.config.KEY=VALUE"),
    "model_type": (RUN_CLM, "model.config.model_type", ""),
    "dataset_name": (RUN_CLM, "data.dataset", "streamed"),
    "dataset_config_name": (RUN_CLM, "data.dataset_config", ""),
    "train_file": (RUN_CLM, "data.train_files", "a list of files or globs"),
    "validation_file": (RUN_CLM, "data.eval_files", "a list of files or globs"),
    "validation_split_percentage": (RUN_CLM, "data.eval_split",
                                    "a split name; unset, 1 in 50 documents are held out, or give data.eval_files"),
    "block_size": (RUN_CLM, "data.seq_len", "tokens per packed training block"),
    "max_seq_length": (TRL, "data.seq_len", "tokens per packed training block"),
    "max_length": (TRL, "data.seq_len", "tokens per packed training block"),
    "dataset_text_field": (TRL, "data.text_column", ""),
    "lr": (TORCH, "optimizer.learning_rate", ""),
    "eps": (TORCH, "optimizer.adam_epsilon", ""),
}
"""Names from elsewhere that are not a field here, and the field that means the same (with what differs)."""
