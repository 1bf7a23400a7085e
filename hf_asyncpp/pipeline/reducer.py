"""The reduction worker: per step, the data-parallel all-reduce, the tied-embedding sum and the grad norm.

It runs on its own thread so that a stage never waits on a collective it does not need yet: the executor hands it
step k's gradients at ``REDUCE{k}`` and asks for the result at ``STEP{k}``, which 2BW places (m - p + 1)
forward/backward pairs later. Every stage submits in step order, so the collectives match across ranks.
"""
from __future__ import annotations

import queue
import threading

import torch
import torch.distributed as dist

from ..topology import Groups, Topology
from .p2p import PeerFailure


class Reducer:
    """Worker thread: per step, DP all-reduce, tied-gradient sum and the global grad-norm all-reduce, in order."""

    def __init__(self, groups: Groups, topo: Topology, tied_names: dict[tuple, list[str]], timeout_s: float,
                 global_norm: bool = True):
        """``tied_names``: per set of stages sharing tensors (as in ``Groups.ties``), this stage's names of them, in
        the same order on each of those stages."""
        self.groups, self.topo, self.timeout_s = groups, topo, timeout_s
        self.tied_sets = {k: v for k, v in tied_names.items() if v}
        self.tied = [n for names in self.tied_sets.values() for n in names]
        # a shared tensor's gradient counts once in the norm: on the lowest stage holding it
        self.not_counted = {n for k, names in self.tied_sets.items() if topo.stage != min(k) for n in names}
        self.global_norm = global_norm  # False: the norm stays stage-local and no stage waits for another
        self.jobs: queue.Queue = queue.Queue()
        self.results: dict[int, object] = {}
        self.cond = threading.Condition()
        self.thread = threading.Thread(target=self._run, daemon=True, name="hf_asyncpp-reducer")
        self.thread.start()

    def submit(self, key: int, grads: dict[str, torch.Tensor]) -> None:
        self.jobs.put((key, grads))

    def result(self, key: int):
        with self.cond:
            # twice the P2P timeout: the collectives inside have that timeout each, so they fail first and say why
            ok = self.cond.wait_for(lambda: key in self.results, timeout=self.timeout_s * 2)
            if not ok:
                raise PeerFailure(f"rank {self.topo.rank}: gradient reduction of step {key} did not finish within {self.timeout_s * 2:.0f}s; a peer has probably died")
            res = self.results.pop(key)
        if isinstance(res, BaseException):
            raise PeerFailure(f"rank {self.topo.rank}: gradient reduction of step {key} failed: {res}") from res
        return res

    def _run(self):
        while True:
            key, grads = self.jobs.get()
            if key is None:
                return
            try:
                res = self._reduce(grads)
            except BaseException as e:  # delivered to the main thread
                res = e
            with self.cond:
                self.results[key] = res
                self.cond.notify_all()

    def _reduce(self, grads: dict[str, torch.Tensor]):
        names = list(grads)
        device = grads[names[0]].device
        if device.type == "cuda":  # NCCL collectives from this thread need its current device set
            torch.cuda.set_device(device)
        if self.groups.dp is not None:
            flat = torch.cat([grads[n].reshape(-1) for n in names])
            dist.all_reduce(flat, group=self.groups.dp)
            flat /= self.topo.dp_size
            off = 0
            for n in names:
                k = grads[n].numel()
                grads[n] = flat[off : off + k].view_as(grads[n])
                off += k
        for stages, tied in self.tied_sets.items():  # in the same (sorted) order on every rank
            group = self.groups.ties.get(stages)
            if group is None:
                continue
            for n in tied:
                dist.all_reduce(grads[n], group=group)
        sq = torch.zeros((), dtype=torch.float64, device=next(iter(grads.values())).device)
        for n in names:
            if self.topo.num_stages > 1 and n in self.not_counted:
                continue  # counted once, on the lowest stage holding it
            sq += grads[n].double().pow(2).sum()
        if self.topo.num_stages > 1 and self.global_norm:
            dist.all_reduce(sq, group=self.groups.pipe)
        return grads, float(sq.sqrt())

    def close(self):
        self.jobs.put((None, None))
        self.thread.join(timeout=self.timeout_s)
