"""The pipeline at run time: one stage's process running its schedule's action list (``schedules/`` holds the
records and the simulator; this is what executes them).

==================  ======================================================================================
``executor``        ``PipelineEngine``: one stage running its action list as a stream of steps
``versions``        the weight versions a stage holds (2BW: two buffers)
``p2p``             transfers between adjacent stages; a dead peer becomes ``PeerFailure``
``nccl_order``      NCCL's point-to-point ordering rule enforced on gloo: the test transport of CPU runs
``reducer``         the gradient reduction: asynchronous collectives issued at REDUCE, waited for at STEP
``split_backward``  the W of a split backward (zero bubble): the weight gradients in one backward
``sharding``        ZeRO-1 across a stage's data-parallel replicas
``reports``         per-step results delivered to the trainer without blocking a stage
``stage_state``     a stage's checkpoint files, by parameter name
``forward_only``    forward passes through the stages: held-out loss, the export read back
``memtrack``        the executor's memory accounting, term by term
``gpu_timer``       GPU time per action kind (CUDA)
``planner``         will it fit, how fast: memory and simulated step time without allocating; the layout search
``autosplit``       ``layers_per_stage: auto``: the split from costs measured at start, cached
``profile``         a run's measured per-stage times and the timeline they imply
==================  ======================================================================================

2BW in one place: ``schedules.TWO_BW`` (version rule, late STEP, m >= p) and ``versions.Versions`` (its two
buffers).
"""
