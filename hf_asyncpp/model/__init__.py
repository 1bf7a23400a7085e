"""The model itself: built from a recipe, initialised independently of the split, scored, exported.

==================  ========================================================================================
``build``           the model a recipe asks for (config or ``from_pretrained``), whole or one stage at a time
``seeded_init``     random initialisation that does not depend on how the model is split
``nll``             the held-out loss of a block and the log-likelihoods lm-eval asks for, defined once
``fused_loss``      the head and loss without the ``[tokens, vocab]`` logits: chunked fused linear cross-entropy
``export``          a standard Hugging Face folder (``from_pretrained`` works), written stage by stage
``vocab_parallel``  the output layer cut by vocabulary rows over every stage: its head and loss as one collective pass
==================  ========================================================================================
"""
