"""NCCL's point-to-point ordering rule, enforced on gloo: the test transport of CPU runs.

gloo matches a send with its receive whatever else the two ranks have posted; NCCL does not. It runs a rank's
point-to-point operations on one communicator to one peer on one stream, one at a time, in the order they were
posted, in both directions: a receive at the head holds back every later send and receive of the pair until its
data arrives, and a send completes only with the matching receive at the head of the peer's stream. A post order
that gloo completes can therefore hang on GPUs. ``NcclOrder`` makes gloo runs obey the rule: one worker thread per
(process group, peer) carries out the operations posted there one at a time, in post order, each as a gloo
operation waited for before the next starts (gloo's sends are rendezvous, as NCCL's are past its buffers);
``batch`` posts a grouped call (``batch_isend_irecv``), whose operations progress together as one unit.

Selected with ``HF_ASYNCPP_P2P=nccl-order`` (the test suite sets it for every distributed test; any bench or run
on CPU can), read by ``transport_from_env``. A run that hangs under it would hang under NCCL: the receive's wait
times out and the executor reports the peer, as for a dead one.
"""
from __future__ import annotations

import os
import queue
import threading
from datetime import timedelta

import torch
import torch.distributed as dist

ENV = "HF_ASYNCPP_P2P"


class _Posted:
    """One posted operation (or grouped call): what the executor waits on, completed by its FIFO's worker."""

    def __init__(self, ops: list[tuple[str, torch.Tensor, int, object]]):
        self.ops, self.done, self.error = ops, threading.Event(), None

    def wait(self, timeout: timedelta | None = None) -> bool:
        if not self.done.wait(timeout.total_seconds() if timeout is not None else None):
            kinds = ", ".join(f"{kind} {'to' if kind == 'send' else 'from'} rank {peer}" for kind, _, peer, _ in self.ops)
            raise RuntimeError(f"{kinds} did not complete within {timeout} (NCCL order: it waits behind earlier "
                               "operations of its communicator, or its peer never posts the match)")
        if self.error is not None:  # its gloo operation failed or timed out in the worker
            raise RuntimeError(f"{self.error} (NCCL order transport)") from self.error
        return True

    def is_completed(self) -> bool:
        return self.done.is_set()


class NcclOrder:
    """Point-to-point transport with NCCL's per-(communicator, peer) FIFO rule (see the module doc)."""

    def __init__(self, timeout: timedelta):
        self.timeout = timeout
        self.fifos: dict[tuple[int, int], queue.Queue] = {}
        self.threads: list[threading.Thread] = []

    def isend(self, tensor: torch.Tensor, peer: int, group=None) -> _Posted:
        return self._post([("send", tensor, peer, group)])

    def irecv(self, tensor: torch.Tensor, peer: int, group=None) -> _Posted:
        return self._post([("recv", tensor, peer, group)])

    def batch(self, ops: list[tuple[str, torch.Tensor, int, object]]) -> _Posted:
        """A grouped call: ``("send" | "recv", tensor, peer, group)`` operations on one (group, peer) FIFO that
        progress together (gloo posts them all, then waits for all)."""
        keys = {(id(g), peer) for _, _, peer, g in ops}
        if len(keys) != 1:
            raise ValueError("a grouped call spans one communicator and one peer here; split it per peer")
        return self._post(ops)

    def _post(self, ops) -> _Posted:
        _, _, peer, group = ops[0]
        key = (id(group), peer)
        fifo = self.fifos.get(key)
        if fifo is None:
            fifo = self.fifos[key] = queue.Queue()
            t = threading.Thread(target=self._serve, args=(fifo,), daemon=True, name=f"nccl-order-{peer}")
            t.start()
            self.threads.append(t)
        posted = _Posted(ops)
        fifo.put(posted)
        return posted

    def _serve(self, fifo: queue.Queue) -> None:
        failed = None  # after a failure the stream is dead (NCCL aborts the communicator): every later op fails too
        while True:
            posted = fifo.get()
            if posted is None:
                return
            if failed is None:
                try:
                    works = [(dist.isend if kind == "send" else dist.irecv)(t, peer, group=group)
                             for kind, t, peer, group in posted.ops]
                    for w in works:
                        w.wait(self.timeout)
                except BaseException as e:  # delivered to whoever waits on it
                    failed = e
            posted.error = failed
            posted.done.set()

    def close(self) -> None:
        """Stop the workers; one still inside a gloo operation (a failed run) ends when that operation times out,
        which must happen before its process group is destroyed."""
        for fifo in self.fifos.values():
            fifo.put(None)
        for t in self.threads:
            t.join(timeout=self.timeout.total_seconds() + 1.0)
        self.fifos.clear()
        self.threads.clear()


class Direct:
    """The plain transport: ``torch.distributed``'s own point-to-point calls (gloo, or NCCL on GPUs)."""

    def isend(self, tensor: torch.Tensor, peer: int, group=None):
        return dist.isend(tensor, peer, group=group)

    def irecv(self, tensor: torch.Tensor, peer: int, group=None):
        return dist.irecv(tensor, peer, group=group)

    def close(self) -> None:
        pass


def transport_from_env(timeout: timedelta):
    """``NcclOrder`` when ``HF_ASYNCPP_P2P=nccl-order`` on a gloo run, else ``Direct``."""
    want = os.environ.get(ENV, "").strip().lower()
    if want in ("", "direct"):
        return Direct()
    if want != "nccl-order":
        raise ValueError(f"{ENV}={want!r}: use 'nccl-order' (NCCL's ordering rule enforced on gloo) or 'direct'")
    if dist.get_backend() != "gloo":
        return Direct()  # NCCL enforces the rule itself
    return NcclOrder(timeout)
