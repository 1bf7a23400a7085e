"""Batches packed ahead of the step that uses them: a worker thread fills a bounded queue from the block stream.

Why: reading, tokenizing and packing a step's documents inline cost stage 0 (and the last stage) that much time
on the critical path of every step (docs/benchmarks.md, "Data path"). A thread suffices: the fast tokenizers and
pyarrow release the GIL while they work, and the torch ops of the step release it too, so the two overlap.

Why each batch travels with a copy of the stream's position: a checkpoint must record where the batches the
training loop *consumed* end, not where the worker has read to, or a resumed run would skip the batches that sat
in the queue. :meth:`Prefetcher.state_dict` is the position after the last batch handed out.

A worker's exception is raised again in the training thread, as the same object (a ``DataError`` stays a
``DataError``, one error line), at the step that would have used the batch.
"""
from __future__ import annotations

import queue
import threading
import time

import torch

from .stream import next_batch

__all__ = ["Prefetcher"]

_POLL_S = 0.1  # how often a worker blocked on a full queue checks whether it was told to stop


class Prefetcher:
    """Iterator of ``(num_microbatches, microbatch_size, seq_len)`` batches of ``stream``, ``depth`` batches ahead.

    Args:
        stream: a :class:`~hf_asyncpp.data.BlockStream` (anything with ``__next__``, ``state_dict`` and
            ``load_state_dict``); only the worker reads it once iteration has started.
        depth: batches made ahead (the queue's bound: memory is ``depth`` batches of ids); 0 packs inline, on the
            calling thread.
        pin: page-lock each batch in the worker (the host-to-device copy then needs no staging on the step's thread).

    Attributes:
        stall_s: seconds the caller waited for batches (inline: the time spent packing them); ``waits``: one entry per
            batch, the same in seconds.
    """

    def __init__(self, stream, num_microbatches: int, microbatch_size: int, depth: int = 2, pin: bool = False):
        self.stream, self.m, self.mbs, self.depth, self.pin = stream, num_microbatches, microbatch_size, depth, pin
        self._consumed = stream.state_dict()
        self._queue: queue.Queue = queue.Queue(maxsize=max(depth, 1))
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._failure: BaseException | None = None
        self.stall_s, self.waits = 0.0, []

    # ------------------------------------------------------------------ position

    def state_dict(self) -> dict:
        """The stream's position after the last batch handed out (not after the ones still queued)."""
        return self._consumed

    def load_state_dict(self, sd: dict) -> None:
        """Continue from ``sd``; only before the first batch (the worker reads the stream from then on)."""
        if self._thread is not None:
            raise RuntimeError("Prefetcher.load_state_dict: the worker has started reading the stream")
        self.stream.load_state_dict(sd)
        self._consumed = self.stream.state_dict()

    # ------------------------------------------------------------------ iteration

    def __iter__(self) -> "Prefetcher":
        return self

    def __next__(self) -> torch.Tensor:
        t0 = time.perf_counter()
        if self.depth == 0:
            batch, state = self._make()
        else:
            batch, state = self._take()
        waited = time.perf_counter() - t0
        self.stall_s += waited
        self.waits.append(waited)
        self._consumed = state
        return batch

    def _make(self) -> tuple[torch.Tensor, dict]:
        batch = next_batch(self.stream, self.m, self.mbs)
        if self.pin:
            batch = batch.pin_memory()
        return batch, self.stream.state_dict()

    def _take(self) -> tuple[torch.Tensor, dict]:
        if self._failure is not None:
            raise self._failure
        if self._thread is None:
            self._thread = threading.Thread(target=self._work, name="hf_asyncpp-prefetch", daemon=True)
            self._thread.start()
        item = self._queue.get()
        if isinstance(item, BaseException):
            self._failure = item
            raise item
        return item

    def _work(self) -> None:
        while not self._stop.is_set():
            try:
                item = self._make()
            except BaseException as e:  # noqa: BLE001 - raised again in the training thread
                item = e
            while not self._stop.is_set():
                try:
                    self._queue.put(item, timeout=_POLL_S)
                    break
                except queue.Full:
                    continue
            if isinstance(item, BaseException):
                return

    def close(self) -> None:
        """Stop the worker (it may be blocked on a full queue or inside a read; it exits at its next put)."""
        self._stop.set()
        if self._thread is not None:
            while True:  # free a slot so a worker waiting to put sees the stop flag
                try:
                    self._queue.get_nowait()
                except queue.Empty:
                    break
            self._thread.join(timeout=5 * _POLL_S)
