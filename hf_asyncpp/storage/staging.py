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
    previous one stays the latest)."""

    def __init__(self, name: str = "checkpoint-writer"):
        self.name = name
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None

    @property
    def thread(self) -> threading.Thread | None:
        """The thread of the job in flight or last run (None before the first)."""
        return self._thread

    def submit(self, job: Callable[[], None]) -> None:
        self.wait()

        def run():
            try:
                job()
            except BaseException as e:  # noqa: BLE001 - handed to the training thread at wait()
                self._error = e

        self._thread = threading.Thread(target=run, name=self.name, daemon=True)
        self._thread.start()

    def busy(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def wait(self) -> None:
        if self._thread is not None:
            self._thread.join()
        error, self._error = self._error, None
        if error is not None:
            raise error
