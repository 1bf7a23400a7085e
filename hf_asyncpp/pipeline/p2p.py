"""Point-to-point transfers between adjacent stages, and the error a dead peer becomes.

Sends are ``isend``s kept alive until ``drain``; receives block with ``pipeline.p2p_timeout_s``, so a dead or
silent peer becomes ``PeerFailure`` naming it instead of a hang. Messages between two stages arrive in send order
(the simulator checks the lists receive them in that order), so no tags are needed. A transfer carries only
tensors; the first one of a window is preceded by a header with their dtypes and shapes.

Each direction between two adjacent stages has its own process group (``channels.channel``): under NCCL's rule
(operations of one communicator complete in post order) a receive posted ahead must never stand in front of a
send. ``HF_ASYNCPP_P2P=nccl-order`` enforces that rule on gloo (``nccl_order.NcclOrder``), so CPU runs fail where
GPU runs would hang.
"""
from __future__ import annotations

from collections import deque
from datetime import timedelta

import torch
import torch.distributed as dist

from ..topology import Topology
from .channels import Channel, channel
from .nccl_order import transport_from_env

_DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.int64, torch.int32, torch.bool, torch.float64]
_HEADER = 64


class PeerFailure(RuntimeError):
    """A pipeline peer died, stalled past the timeout, or closed its connection."""


class P2P:
    """Point-to-point transfers between adjacent stages; sends are async, receives block with a timeout.

    NCCL moves device tensors directly. gloo sends only CPU tensors, so with gloo on a GPU machine (several
    stages sharing one GPU, which NCCL refuses) transfers are staged through host memory.
    """

    def __init__(self, topo: Topology, timeout_s: float, device: torch.device, groups: dict[Channel, object]):
        """``groups``: this rank's process group of each channel it sends or receives on (``Groups.p2p``)."""
        self.topo, self.timeout, self.device, self.groups = topo, timedelta(seconds=timeout_s), device, groups
        staged = device.type != "cpu" and dist.get_backend() == "gloo"
        self.wire = torch.device("cpu") if staged else device  # where transferred tensors live
        self.pending: deque = deque()  # (work, tensor) of sends kept alive until they complete
        self.transport = transport_from_env(self.timeout)
        # NCCL: a receive is waited for by the compute stream, not the host (no host sync per receive); a dead or
        # silent peer is then found by the point-to-point group's watchdog after its timeout (p2p_timeout_s)
        self.stream_ordered = device.type == "cuda" and dist.get_backend() == "nccl"

    def _group(self, src: int, dst: int):
        return self.groups[channel(src, dst)]

    def _wait(self, work, peer: int, what: str):
        try:
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
            self._wait(pending.popleft()[0], peer, "completing a send to")
        for t in tensors:
            try:
                work = self.transport.isend(t, peer, group)
            except RuntimeError as e:  # gloo: "Connection reset by peer" when the peer has died
                raise PeerFailure(f"rank {self.topo.rank} (stage {self.topo.stage}): sending to rank {peer} failed; "
                                  f"the peer has probably died ({e})") from None
            pending.append((work, t))

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
        for work, _ in self.pending:
            self._wait(work, -1, "completing a send to")
        self.pending.clear()

    def close(self) -> None:
        """Stop the transport's workers (after ``drain``; before the groups are destroyed)."""
        self.transport.close()
