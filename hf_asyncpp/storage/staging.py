"""What lets a checkpoint be written while training goes on: a copy of the state taken once, and one writer thread.

A save has two halves. The training thread *stages*: it copies the tensors it will write (weights, the older weight
versions, optimizer and Error-Feedback state) once into host memory that belongs to the checkpoint, pinned where a
GPU is present, through ``torch.distributed.checkpoint``'s own stager (``DefaultStager``: the device-to-host copy
``dcp.async_save`` makes, with its buffers cached and reused by the next save). Everything after that (serializing
safetensors and ``torch.save``, sha256, the writes, fsync, the manifest and the commit) is the writer's, on a
:class:`BackgroundWriter` thread, while the training thread runs the next steps.

Why a thread and not a process (``dcp.async_save``'s ``AsyncCheckpointerType.PROCESS``): a thread reads the staged
copy where it is, where a process needs it copied again into shared memory; and what the writer does is outside the
GIL for its bulk (hashlib's sha256 of a large buffer, file writes and fsync release it; safetensors serializes in
Rust), so the training thread, itself mostly in torch kernels that release the GIL too, is not slowed by it.

At most one save is in flight: the next save (and the end of the run, and a stop signal's exit) first waits for the
previous one, so the staged copies are one checkpoint's worth, and a checkpoint is committed in order.
"""
from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Callable

import torch
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions


@dataclass
class StagedFile:
    """One file of a checkpoint, its tensors already copied out of the training state: ``kind`` says how the writer
    serializes ``content`` (``tensors``: safetensors of a name -> tensor dict; ``state``: ``torch.save``, loaded back
    with ``weights_only=True``; ``json``)."""

    name: str  # relative to the checkpoint folder
    kind: str  # "tensors" | "state" | "json"
    content: object


class Stager:
    """Copies a state (nested dicts and lists of tensors and plain values) into host memory owned by the checkpoint,
    with ``DefaultStager``: pinned memory and non-blocking copies where a GPU is present, synchronous CPU copies
    otherwise; the staged buffers are reused by the next save. Counts what it copied (``staged_bytes``)."""

    def __init__(self):
        gpu = torch.cuda.is_available()
        self._stager = DefaultStager(StagingOptions(use_pinned_memory=gpu, use_shared_memory=False,
                                                    use_async_staging=False, use_non_blocking_copy=gpu))
        self.staged_bytes = 0

    def stage(self, state):
        """A copy of ``state`` whose tensors are on the host, independent of the live ones (complete on return)."""
        staged = self._stager.stage(state)
        self.staged_bytes += _tensor_bytes(staged)
        return staged

    def close(self) -> None:
        self._stager.close()


def _tensor_bytes(obj) -> int:
    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if isinstance(obj, dict):
        return sum(_tensor_bytes(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(_tensor_bytes(v) for v in obj)
    return 0


class BackgroundWriter:
    """One daemon thread running one job at a time. :meth:`submit` first waits for the job before (at most one in
    flight); :meth:`wait` returns once the job is done and raises what it raised, on the caller's thread. A daemon:
    a process that dies or exits on an error does not wait for a write, whose checkpoint then is never committed (the
    previous one stays the latest).

    :meth:`in_order` keeps the run folder's other writes (a ``metrics.jsonl`` record) in the order they were made
    with respect to a checkpoint: while a job is in flight they run on its thread after it, else at once. So a record
    of a step after a save never reaches the disk before that save's commit (a disk that fills meanwhile fails the
    record, not the checkpoint), and the writer's commit never reads a file the training thread is appending to."""

    def __init__(self, name: str = "checkpoint-writer"):
        self.name = name
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self._lock = threading.Lock()
        self._running = False
        self._after: list[Callable[[], None]] = []

    @property
    def thread(self) -> threading.Thread | None:
        """The thread of the job in flight or last run (None before the first)."""
        return self._thread

    def submit(self, job: Callable[[], None]) -> None:
        self.wait()
        self._running = True
        self._thread = threading.Thread(target=self._run, args=(job,), name=self.name, daemon=True)
        self._thread.start()

    def _run(self, job: Callable[[], None]) -> None:
        while job is not None:
            try:
                job()
            except BaseException as e:  # noqa: BLE001 - handed to the caller's thread at wait()
                if self._error is None:
                    self._error = e
            with self._lock:
                job = self._after.pop(0) if self._after else None
                if job is None:
                    self._running = False

    def in_order(self, write: Callable[[], None]) -> None:
        """Run ``write`` after the job in flight, on its thread (its error raised at :meth:`wait`), or now."""
        with self._lock:
            if self._running:
                self._after.append(write)
                return
        write()

    def busy(self) -> bool:
        return self._running

    def wait(self) -> None:
        if self._thread is not None:
            self._thread.join()
        error, self._error = self._error, None
        if error is not None:
            raise error
