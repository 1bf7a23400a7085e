"""Point-to-point transfers between adjacent stages, and the error a dead peer becomes.

Sends are ``isend``s kept alive until ``drain``; receives wait with ``pipeline.p2p_timeout_s``, so a dead or
silent peer becomes ``PeerFailure`` naming it instead of a hang. On CPU a rank with a core of its own waits by
polling (``pipeline.recv_wait``, ``polls``): a rank that slept in its waits ran its next actions slower. Messages
between two stages arrive in send order (the simulator checks the lists receive them in that order), so no tags
are needed. A transfer carries only tensors; the first one of a window is preceded by a header with their dtypes
and shapes.

Each direction between two adjacent stages has its own process group (``channels.channel``): under NCCL's rule
(operations of one communicator complete in post order) a receive posted ahead must never stand in front of a
send. ``HF_ASYNCPP_P2P=nccl-order`` enforces that rule on gloo (``nccl_order.NcclOrder``), so CPU runs fail where
GPU runs would hang.
"""
from __future__ import annotations

import os
import queue
import threading
from collections import deque
from datetime import timedelta

import torch
import torch.distributed as dist

from ..errors import PeerFailure
from ..schedules.channels import Channel, channel
from ..topology import Topology
from .nccl_order import transport_from_env

_DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.int64, torch.int32, torch.bool, torch.float64]
_HEADER = 64


def polls(mode: str, device: torch.device, ranks_here: int) -> bool:
    """Whether this rank waits for its transfers by polling (``pipeline.recv_wait``): ``poll``/``block`` as told;
    ``auto`` polls on CPU when this node's ranks, each with its intra-op threads, fit the cores this process may
    use, and blocks otherwise. Polling keeps a waiting rank on its core, so a virtual CPU never halts between a
    rank's actions: on the 2-core VM of docs/benchmarks.md a stage that blocked in its waits ran its next forwards
    and backwards up to 25% slower ("Waiting by polling"). With more ranks than cores a polling rank would take
    turns from one that computes, so ``auto`` blocks there; on a GPU the host's wait is not the device's time
    (NCCL's receives are waited for by the stream), so ``auto`` blocks there too."""
    if mode != "auto":
        return mode == "poll"
    return device.type == "cpu" and ranks_here * torch.get_num_threads() <= len(os.sched_getaffinity(0))


def ranks_on_this_node(world_size: int) -> int:
    """LOCAL_WORLD_SIZE as torchrun, accelerate and the srun adapter set it; a spawned job without it is one node."""
    return int(os.environ.get("LOCAL_WORLD_SIZE", world_size))


class _Outcome:
    """What a polled wait hands back: set by the waiter thread, read by the polling one."""

    __slots__ = ("done", "error")

    def __init__(self):
        self.done, self.error = False, None


class PollingWaiter:
    """Waits for transfers on a helper thread while the caller polls, so that a rank waiting for a neighbour keeps
    its core busy instead of idling (``pipeline.recv_wait: poll``).

    gloo's point-to-point works report ``is_completed()`` only once ``wait()`` has returned, so the blocking wait
    runs here and the caller spins on its outcome, yielding the core (``sched_yield``, which also releases the
    GIL) to any other runnable thread of its own at every turn: gloo's transport thread, this waiter."""

    def __init__(self):
        self.jobs: queue.SimpleQueue = queue.SimpleQueue()
        self.thread = threading.Thread(target=self._run, name="hf_asyncpp-recv-waiter", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while (job := self.jobs.get()) is not None:
            work, timeout, out = job
            try:
                work.wait(timeout)
            except BaseException as e:  # noqa: BLE001 (re-raised in the polling thread)
                out.error = e
            out.done = True

    def wait(self, work, timeout: timedelta) -> None:
        out = _Outcome()
        self.jobs.put((work, timeout, out))
        while not out.done:
            os.sched_yield()
        if out.error is not None:
            raise out.error

    def close(self) -> None:
        self.jobs.put(None)
        self.thread.join()


class P2P:
    """Point-to-point transfers between adjacent stages; sends are async, receives block with a timeout.

    NCCL moves device tensors directly. gloo sends only CPU tensors, so with gloo on a GPU machine (several
    stages sharing one GPU, which NCCL refuses) transfers are staged through host memory.
    """

    def __init__(self, topo: Topology, timeout_s: float, device: torch.device, groups: dict[Channel, object],
                 poll: bool = False):
        """``groups``: this rank's process group of each channel it sends or receives on (``Groups.p2p``);
        ``poll``: wait for transfers by polling (``polls``, ``pipeline.recv_wait``)."""
        self.topo, self.timeout, self.device, self.groups = topo, timedelta(seconds=timeout_s), device, groups
        staged = device.type != "cpu" and dist.get_backend() == "gloo"
        self.wire = torch.device("cpu") if staged else device  # where transferred tensors live
        self.pending: deque = deque()  # (work, tensor, peer) of sends kept alive until they complete
        self.transport = transport_from_env(self.timeout)
        # NCCL: a receive is waited for by the compute stream, not the host (no host sync per receive); a dead or
        # silent peer is then found by the point-to-point group's watchdog after its timeout (p2p_timeout_s)
        self.stream_ordered = device.type == "cuda" and dist.get_backend() == "nccl"
        # polling replaces the host's waits; NCCL's receives are waited for by the stream, never by the host
        self.waiter = PollingWaiter() if poll and not self.stream_ordered else None

    def set_timeout(self, timeout: timedelta) -> None:
        """How long a receive waits from now on (the executor's first-step and steady budgets)."""
        self.timeout = timeout
        if hasattr(self.transport, "timeout"):
            self.transport.timeout = timeout

    def _group(self, src: int, dst: int):
        return self.groups[channel(src, dst)]

    def _wait(self, work, peer: int, what: str):
        try:
            if self.waiter is not None:
                self.waiter.wait(work, self.timeout)
            else:
                work.wait(self.timeout)
        except RuntimeError as e:
            raise PeerFailure(
                f"rank {self.topo.rank} (stage {self.topo.stage}): {what} rank {peer} failed or timed out after "
                f"{self.timeout.total_seconds():.0f}s; the peer has probably died ({e})"
            ) from None

    def send(self, tensors: list[torch.Tensor], stage: int, with_header: bool) -> None:
        peer = self.topo.rank_of(stage)
        tensors = [t.detach().to(self.wire).contiguous() for t in tensors]
        if with_header:
            vals = [len(tensors)]
            for t in tensors:
                vals += [_DTYPES.index(t.dtype), t.dim(), *t.shape]
            header = torch.tensor(vals + [0] * (_HEADER - len(vals)), dtype=torch.int64, device=self.wire)
            tensors = [header] + tensors
        pending, group = self.pending, self._group(self.topo.stage, stage)
        while pending and pending[0][0].is_completed():  # release finished sends: a stream never drains
            work, _, to = pending.popleft()
            self._wait(work, to, "completing a send to")
        for t in tensors:
            try:
                work = self.transport.isend(t, peer, group)
            except RuntimeError as e:  # gloo: "Connection reset by peer" when the peer has died
                raise PeerFailure(f"rank {self.topo.rank} (stage {self.topo.stage}): sending to rank {peer} failed; "
                                  f"the peer has probably died ({e})") from None
            pending.append((work, t, peer))

    def recv(self, stage: int, like: list[torch.Tensor] | None = None) -> list[torch.Tensor]:
        """Receive from ``stage``: with ``like`` the shapes are known, otherwise a header comes first."""
        if like is not None:
            return self.complete(self.post(stage, like))
        peer = self.topo.rank_of(stage)
        header = torch.empty(_HEADER, dtype=torch.int64, device=self.wire)
        self._wait(self.transport.irecv(header, peer, self._group(stage, self.topo.stage)), peer,
                   "waiting for activations from")
        vals = header.tolist()
        n, i, like = vals[0], 1, []
        for _ in range(n):
            dtype, ndim = _DTYPES[vals[i]], vals[i + 1]
            like.append(torch.empty(vals[i + 2 : i + 2 + ndim], dtype=dtype, device="meta"))
            i += 2 + ndim
        return self.complete(self.post(stage, like))

    def post(self, stage: int, like: list[torch.Tensor]) -> tuple:
        """Post the receives of tensors shaped like ``like`` now; ``complete`` waits for them.

        Posting before the data is needed matters on gloo: a send is a rendezvous, and a receive posted only when
        the data is needed makes the sender's transport thread wake up (on a core its compute thread is using)
        while the receiver idles; posted early, the data moves during the receiver's compute.
        """
        peer, group = self.topo.rank_of(stage), self._group(stage, self.topo.stage)
        bufs = [torch.empty(t.shape, dtype=t.dtype, device=self.wire) for t in like]
        return peer, [(self.transport.irecv(b, peer, group), b) for b in bufs]

    def complete(self, posted: tuple, what: str = "waiting for data from") -> list[torch.Tensor]:
        peer, pairs = posted
        for work, _ in pairs:
            if self.stream_ordered:
                work.wait()  # the current (compute) stream waits for the data; the host goes on
            else:
                self._wait(work, peer, what)
        return [b.to(self.device) for _, b in pairs]

    def drain(self) -> None:
        for work, _, peer in self.pending:
            self._wait(work, peer, "completing a send to")
        self.pending.clear()

    def close(self) -> None:
        """Stop the transport's workers (after ``drain``; before the groups are destroyed)."""
        self.transport.close()
        if self.waiter is not None:
            self.waiter.close()
