"""One training run and what it leaves behind: the trainer wires the components below (torchtitan's
``components/``).

=================  ======================================================================================
``trainer``        ``train(recipe)``: the loop, one for the single-process and the pipelined run
``checkpointer``   writing and resuming checkpoints: what goes in one, from which rank, in which order
``folder``         the run folder: its checkpoints, the one a resume takes, whether a fresh run may start
``seeds``          the seed each rank starts from, each stage's own stream, the RNG state a checkpoint carries
``evaluator``      when a run is evaluated, and its end: export, the export's evaluation, the final push
``reporting``      metrics.jsonl, the trackers, the progress bar, the loss curve
``resume_report``  what a resume does with a recipe that differs from its checkpoint's
``model_card``     the model card of an export or a checkpoint
``hub``            pushes to the Hugging Face Hub, in the background
``preflight``      every check that needs no process group, before the processes start
=================  ======================================================================================
"""
