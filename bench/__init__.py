"""The benchmarks: one question each, run from the repository root as ``python -m bench.<name>``.

Results go to docs/benchmarks/ (``--write`` rewrites the script's own marked section of its page; bench.report holds
which page has which section); docs/benchmarks.md is the index of questions, latest answers and commands. Most
take minutes to hours on a 2-core CPU; ``--help`` on each says what it measures and how.

Speed on a 2-core CPU (docs/benchmarks/speed.md)
    throughput        our gpipe / 1f1b / 2bw against torch.distributed.pipelining and the no-bubble limit, in
                      process; also the workers the other speed benchmarks use  python -m bench.throughput
    cli_throughput    2BW through ``hf-asyncpp train`` (real data) against torch's Schedule1F1B, the no-bubble limit
                      and the schedules' own ceilings; per-action costs          python -m bench.cli_throughput
    stage_ceiling     2BW against its stages computing alone and one process, interleaved window by window in the
                      same two processes                                          python -m bench.stage_ceiling
    default_recipe    the README's main job against one process; the simulator at p = 4, 8, 16 from its profile
                                                                                  python -m bench.default_recipe
    time_to_loss      wall time for 2BW to reach synchronous 1F1B's final loss    python -m bench.time_to_loss
    soak              a 2000-step 2BW run: step time and RSS stay flat            python -m bench.soak
    schedules         which schedule wins for a recipe at its scale: the planner's decision table, simulated
                                                                                  python -m bench.schedules
    schedule_anchors  our 2BW, 1F1B and ZB-H1 beside torch.distributed.pipelining's own schedules, measured
                                                                                  python -m bench.schedule_anchors
    vocab_parallel    a head-heavy model trained with the vocabulary layers on the last stage and shared by every
                      stage, side by side: the ratio                              python -m bench.vocab_parallel
What one part costs (docs/benchmarks/parts.md)
    partition_overhead  a chain of stages against the plain model: work and time  python -m bench.partition_overhead
    optimizer_step    the optimizer step against forward + backward per stage, Muon against AdamW
                                                                                  python -m bench.optimizer_step
    reduction         the gradient reduction off the compute stream, measured and simulated at p = 4, 8
                                                                                  python -m bench.reduction
    data_path         blocks/s of the data path and the stage-0 stall, packed inline or ahead
                                                                                  python -m bench.data_path
    streaming         logging never drains the pipeline                           python -m bench.streaming
    host_overhead     what the host dispatches per action: aten ops and scalar reads per F, B, REDUCE, STEP
                                                                                  python -m bench.host_overhead
    checkpoint_save   the training thread's blocked time per save, asynchronous against waited for to the commit
                                                                                  python -m bench.checkpoint_save
Memory (docs/benchmarks/memory.md)
    memory            the planner's memory term by term against the executor; bytes per parameter with bf16
                      versions and ZeRO-1 (``--per-param``)                       python -m bench.memory
    stage_local       what each rank reads and holds at a stage-local start and resume
                                                                                  python -m bench.stage_local
    fused_loss        the last stage's head and loss: peak bytes per token, transformers' path against the fused loss
                                                                                  python -m bench.fused_loss
Quality: the paper's claims at our scale (docs/benchmarks/quality.md)
    quality           the delay-tolerance table: {AdamW, Muon, NAdam} x {sync, delay, delay + EF}, seeds, the EF
                      lambda sweep, PipeDream at p = 4, 8 (300 steps; ``--long``: 1000)  python -m bench.quality
    paper_regime      the same in the paper's regime (20 tokens per parameter), as the paper's ratios; a
                      dense model and a MoE of its active parameters (--phases moe-tune,moe-main,moe-ladder)
                                                                                  python -m bench.paper_regime
    noise_scale       the gradient noise scale of a finished run (used by paper_regime)
                                                                                  python -m bench.noise_scale RUN_DIR
The GPU proof (docs/benchmarks/gpu.md)
    gpu               the one GPU call (defaults, under 9 minutes): the recipe's first and last stage against plain
                      transformers, eager and compiled; by flags, the planner on a GPU, per-action host overhead, the
                      reducer and the compute stream (``--cpu-tiny``: the same code on CPU)  python -m bench.gpu
    check_gpu         bench.gpu does not rot between GPU runs: every part produces its numbers at a tiny size on CPU
                                                                                  python -m pytest -q bench/check_gpu.py
Plumbing
    report            ``write_section``: which page holds which section, and the rewrite of one section

Shared process spawning (a free port, N gloo ranks, their results or tracebacks) is ``hf_asyncpp.testing``.
docs/supported-models.md is generated by scripts/partition_sweep.py, not a benchmark.
"""
