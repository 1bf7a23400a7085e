"""Pipeline schedules as data, and everything that reasons about them without a process: pure Python (torch only
when a virtual-stage order is built from torch's own schedule class).

================  ==============================================================================================
``actions``       the action vocabulary (``ActionType``, ``Action``) and its text form
``records``       ``Schedule`` records (``TWO_BW``, ``ONE_F_ONE_B``, ``ZB_H1``, ``GPIPE``, ``PIPEDREAM``; virtual
                  stages, planner only: ``INTERLEAVED_1F1B``, ``ZBV``, ``DUALPIPEV``) and their action lists
``torch_orders``  the virtual-stage orders, taken from torch's own schedule classes (interleaved 1F1B,
                  ZBV, DualPipeV) built with stand-in stages; torch is imported when one is first built
``simulator``     runs action lists without processes: deadlocks, order, versions, timelines, bubbles
                  (fill/drain and imbalance: ``split_bubble``)
``nccl_rule``     NCCL's point-to-point ordering rule, as the simulator applies it
``channels``      which communicator a transfer between two stages travels on
``timeline``      draws a simulated or measured timeline
================  ==============================================================================================

The recipe's checks, the planner, ``hf-asyncpp timeline`` and the runtime (``pipeline/``) read these; importing
them stays cheap.
"""
from .actions import Action, ActionType
from .records import (DUALPIPEV, GPIPE, INTERLEAVED_1F1B, ONE_F_ONE_B, PIPEDREAM, SCHEDULES, Schedule, TWO_BW,
                      VIRTUAL_SCHEDULES, ZBV, ZB_H1, get_schedule, interleaved_1f1b, schedule_actions)
from .simulator import BubbleSplit, Costs, ScheduleError, SimResult, simulate, split_bubble

__all__ = ["Schedule", "SCHEDULES", "TWO_BW", "ONE_F_ONE_B", "ZB_H1", "GPIPE", "PIPEDREAM", "get_schedule", "schedule_actions",
           "VIRTUAL_SCHEDULES", "INTERLEAVED_1F1B", "ZBV", "DUALPIPEV", "interleaved_1f1b",
           "Action", "ActionType", "BubbleSplit", "Costs", "ScheduleError", "SimResult", "simulate", "split_bubble"]
