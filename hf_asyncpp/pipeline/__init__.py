"""Everything that is the pipeline, in one place.

=================  ===========================================================================================
``schedules``      ``Schedule`` records (``TWO_BW``, ``ONE_F_ONE_B``, ``GPIPE``, ``PIPEDREAM``) and their action lists
``simulator``      runs action lists without processes: deadlocks, order, versions, timelines, bubbles
``timeline``       draws a simulated or measured timeline
``versions``       the weight versions a stage holds (2BW: two buffers)
``p2p``            transfers between adjacent stages; ``PeerFailure``
``reducer``        the gradient reduction: asynchronous collectives issued at REDUCE, waited for at STEP
``executor``       ``PipelineEngine``: one stage running its action list as a stream of steps
``stage_state``    a stage's checkpoint files, by parameter name
``planner``        will it fit, how fast: memory and simulated step time without allocating; the layout search
``autosplit``      ``layers_per_stage: auto``: the split from costs measured at start, cached
``profile``        a run's measured per-stage times and the timeline they imply
=================  ===========================================================================================

2BW in one place: ``schedules.TWO_BW`` (version rule, late STEP, m >= p) and ``versions.Versions`` (its two
buffers). Importing this package stays cheap: the executor (torch.distributed, the partitioner) is imported from
``hf_asyncpp.pipeline.executor`` where it is needed.
"""
from .schedules import GPIPE, ONE_F_ONE_B, PIPEDREAM, SCHEDULES, TWO_BW, Action, ActionType, Schedule, get_schedule, schedule_actions
from .simulator import Costs, ScheduleError, SimResult, simulate

__all__ = ["Schedule", "SCHEDULES", "TWO_BW", "ONE_F_ONE_B", "GPIPE", "PIPEDREAM", "get_schedule", "schedule_actions",
           "Action", "ActionType", "Costs", "ScheduleError", "SimResult", "simulate"]
