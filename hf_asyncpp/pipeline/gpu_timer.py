"""GPU time per action kind, for the run's profile on CUDA.

On CUDA a forward, backward or optimizer step returns once its kernels are launched, so a host clock around it
reads launch time, and the GPU time lands in whatever waits next (a receive, a STEP). ``GpuTimer`` records a CUDA
event pair around each such action and reads the elapsed times once the events have completed: without waiting
at each STEP (so the list stays short), waiting only at a drain point, where the pipeline waits anyway.
"""
from __future__ import annotations

from collections import defaultdict, deque

import torch

from ..schedules.actions import ActionType

DEVICE_TIMED = frozenset({ActionType.F, ActionType.B, ActionType.I, ActionType.W, ActionType.VOCAB, ActionType.STEP})


class GpuTimer:
    """Event pairs around device actions; ``collect`` adds their GPU seconds per kind to a dict."""

    def __init__(self):
        self.open: deque = deque()  # (kind, start event, end event), in launch order
        self.held: dict = defaultdict(float)  # seconds of completed pairs not yet collected
        self._start = None

    def start(self, kind: ActionType) -> None:
        ev = torch.cuda.Event(enable_timing=True)
        ev.record()
        self._start = (kind, ev)

    def stop(self) -> None:
        end = torch.cuda.Event(enable_timing=True)
        end.record()
        kind, start = self._start
        self.open.append((kind, start, end))
        if kind == ActionType.STEP:
            self._fold(wait=False)

    def _fold(self, wait: bool) -> None:
        while self.open:
            kind, start, end = self.open[0]
            if wait:
                end.synchronize()
            elif not end.query():
                return
            self.held[kind] += start.elapsed_time(end) / 1e3
            self.open.popleft()

    def collect(self, seconds: dict) -> None:
        """Wait for every recorded pair and add the GPU seconds per kind to ``seconds``."""
        self._fold(wait=True)
        for kind, v in self.held.items():
            seconds[kind] += v
        self.held.clear()
