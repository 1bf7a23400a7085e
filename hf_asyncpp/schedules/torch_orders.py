"""The compute orders of the virtual-stage schedules, taken from torch's own schedule classes.

Interleaved 1F1B, ZBV and DualPipeV are torch's schedules by definition (``torch.distributed.pipelining``'s
``ScheduleInterleaved1F1B``, ``ScheduleZBVZeroBubble``, ``ScheduleDualPipeV``), so the records take each rank's order
from torch's generator and only lower it (transfers, REDUCE, STEP, versions: ``records._lower``); when torch changes
an order, the simulator and the planner follow. The constructors build every rank's ``pipeline_order`` from the
stages' ``num_stages``, ``group_size`` and ``group_rank`` alone, so stand-ins with those fields and no module build
them without a process group or a device.

torch is imported here when an order is first built, not when the schedule floor is imported: the recipe's checks,
the other schedules and ``hf-asyncpp timeline`` of them stay pure Python (``tests/test_layout.py``). Each (schedule,
ranks, stages per rank, microbatches) is built once per process, because torch's constructors work per action over
every rank (about a second at 16 ranks x 64 microbatches).
"""
from __future__ import annotations

from functools import lru_cache
from types import SimpleNamespace

from .actions import ActionType

__all__ = ["TORCH_CLASSES", "torch_chunks", "torch_slots"]

TORCH_CLASSES = {"interleaved1f1b": "ScheduleInterleaved1F1B", "zbv": "ScheduleZBVZeroBubble",
                 "dualpipev": "ScheduleDualPipeV"}
"""The class of ``torch.distributed.pipelining.schedules`` whose order each virtual-stage record runs."""

_COMPUTE = {t.value: t for t in (ActionType.F, ActionType.B, ActionType.I, ActionType.W)}

Item = tuple[ActionType, int, int]  # (F, B, I or W, microbatch in the step, model stage)


def torch_chunks(name: str, num_ranks: int, stages_per_rank: int, num_microbatches: int) -> tuple[tuple[tuple[Item, ...], ...], ...]:
    """Per rank, one step's order of ``name``'s torch class as chunks: a chunk is one action of torch's
    ``pipeline_order``, one computation, except DualPipeV's overlapped pair (``OVERLAP_F_B``), whose forward and
    backward are one chunk, in the order torch's runtime computes them without a custom overlap function. torch's
    ``ValueError`` for a number of microbatches it refuses comes through (the records check first, with the fix)."""
    return _torch_order(name, num_ranks, stages_per_rank, num_microbatches)[0]


def torch_slots(name: str, num_ranks: int, stages_per_rank: int, num_microbatches: int) -> tuple[tuple[int, ...], ...]:
    """Per rank, the time slot of each chunk of ``torch_chunks`` in torch's ``pipeline_order``, a grid of slots (its
    idle slots are None there) whose actions of one slot are meant to run at the same time on every rank."""
    return _torch_order(name, num_ranks, stages_per_rank, num_microbatches)[1]


@lru_cache(maxsize=64)
def _torch_order(name: str, num_ranks: int, stages_per_rank: int, num_microbatches: int):
    """(``torch_chunks``, ``torch_slots``) from one build of torch's order."""
    from torch.distributed.pipelining import schedules

    cls = getattr(schedules, TORCH_CLASSES[name])
    p, v = num_ranks, stages_per_rank
    stages = [SimpleNamespace(num_stages=p * v, group_size=p, group_rank=0, submod=None,
                              stage_index_to_group_rank=None) for _ in range(v)]
    order = cls(stages, num_microbatches).pipeline_order
    out, slots = [], []
    for r in range(p):
        chunks, at = [], []
        for slot, a in enumerate(order[r]):
            if a is None:  # torch's idle slot: the lowering needs only the order
                continue
            at.append(slot)
            chunk = []
            for b in a.sub_actions or (a,):
                kind = _COMPUTE.get(b.computation_type.value)
                if kind is None:
                    raise RuntimeError(f"{TORCH_CLASSES[name]} put {b} in rank {r}'s order: the schedule records lower "
                                       f"only F, B, I, W and overlapped pairs of them")
                chunk.append((kind, b.microbatch_index, b.stage_index))
            chunks.append(tuple(chunk))
        out.append(tuple(chunks))
        slots.append(tuple(at))
    return tuple(out), tuple(slots)
