"""The pipeline at run time: one stage's process running its schedule's action list (``schedules/`` holds the
records and the simulator; this is what executes them; ``plan/`` says what they will cost).

=================  ======================================================================================
``executor``       ``PipelineEngine``: one stage running its action list as a stream of steps
``versions``       the weight versions a stage holds (2BW: two buffers)
``p2p``            transfers between adjacent stages; a dead peer becomes ``PeerFailure``
``nccl_order``     NCCL's point-to-point ordering rule enforced on gloo: the test transport of CPU runs
``reducer``        the gradient reduction: asynchronous collectives issued at REDUCE, waited for at STEP
``sharding``       ZeRO-1 across a stage's data-parallel replicas
``experts``        expert parallelism: each MoE layer's experts sharded over a stage's replicas, tokens by all-to-all
``step_reports``   per-step results delivered to the trainer without blocking a stage
``stage_state``    a stage's checkpoint files, by parameter name
``forward_only``   forward passes through the stages: held-out loss, the export read back
``memtrack``       the executor's memory accounting, term by term
``gpu_timer``      GPU time per action kind (CUDA)
=================  ======================================================================================

2BW in one place: ``schedules.TWO_BW`` (version rule, late STEP, m >= p) and ``versions.Versions`` (its two
buffers).
"""
