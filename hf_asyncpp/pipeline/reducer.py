"""The gradient reduction of each step: data-parallel mean, tied-gradient sums, global grad norm.

Issued by the executor's own thread as asynchronous collectives at ``REDUCE{k}`` and waited for at ``STEP{k}``,
which 2BW places (m - p + 1) forward/backward pairs later; in between nothing waits for them. Three phases per
step, each issued when the one before it has completed, because each needs the previous one's result: the
data-parallel all-reduce (in buckets of at most ``bucket_mb``, so no copy of every gradient at once), the sums of
tensors several stages hold (tied embeddings), then the all-reduce of the squared norm over the pipeline. Steps
are reduced in order, so the collectives match across ranks.

How a phase waits for the one before it depends on the backend:

- NCCL: every collective runs on its communicator's stream; ``work.wait()`` makes the *current* stream wait and
  returns at once. The reducer issues all three phases right away on a side stream of its own (after the compute
  stream's gradients are ready), so the compute stream never waits for a collective until ``STEP`` joins the
  side stream; the one host sync of a step is the norm's value at ``STEP`` (clipping and the non-finite check).
  No second thread issues NCCL calls (NCCL's documentation calls that unsafe on one device).
- gloo: ``work.wait()`` blocks the calling thread, so the next phase is issued when the executor finds the
  previous one completed (``poll``, once per action) or at ``STEP`` (``result``), whichever comes first.

The data-parallel buckets start before the step's last backward has finished: ``arm`` (called by the executor
right before that backward) hooks the version's leaves, and a bucket whose gradients have all been accumulated is
launched at once, in bucket order (the same on every replica: bucket i only after buckets 0..i-1), the buckets
laid out last parameter first, the order in which backward finishes them. On gloo the hook issues the all-reduce
(backward runs on the executor's thread); on CUDA it records an event, and the executor's thread issues the
all-reduce right after ``backward()`` returns, on the side stream waiting for that event, so the GPU starts it as
soon as the bucket's gradients exist while the rest of the backward still runs (no NCCL call from autograd's
thread). ``submit`` launches what is left.

Before this module, a worker thread ran the phases with synchronous collectives; on NCCL that made the compute
stream wait for every reduction at once, and the global norm could not finish before stage 0's ``REDUCE``.
"""
from __future__ import annotations

from collections import deque
from contextlib import nullcontext
from datetime import timedelta
from typing import Iterator

import torch
import torch.distributed as dist

from ..errors import PeerFailure
from ..topology import Groups, Topology, timed_out, who_went_silent


class _Job:
    """One step's reduction: a generator yielding the works of each phase; its return value is (grads, sq)."""

    def __init__(self, key: int, phases: Iterator[list], stream_ordered: bool):
        self.key, self.phases, self.stream_ordered = key, phases, stream_ordered
        self.works: list = []  # the collectives the next phase waits for
        self.result = None


class _Early:
    """Step ``key``'s data-parallel buckets: those launched during its last backward (``Reducer.arm``), then, at
    submit, the rest (every one, when the step was not armed)."""

    def __init__(self, key: int, leaves: dict[str, torch.Tensor], buckets: list[list[str]]):
        self.key, self.leaves, self.buckets = key, leaves, buckets
        self.grad_of = lambda n: leaves[n].grad  # at submit: the step's gradient dict instead
        self.left = [len(b) for b in buckets]  # gradients each bucket still waits for
        self.bucket_of = {n: i for i, b in enumerate(buckets) for n in b}
        self.events: dict[int, object] = {}  # CUDA: bucket -> event recorded when its last gradient landed
        self.launched: list[tuple[list[str], torch.Tensor, object]] = []  # (names, flat, work), in bucket order
        self.handles: list = []


BROADCASTS_IN_FLIGHT = 2
"""ZeRO-1's weight buckets in flight at once after a STEP: two keep the link busy while one is unpacked; each costs
a flat copy of at most ``bucket_mb``."""


class Reducer:
    """Per step, in order: DP all-reduce in buckets, tied-gradient sums, the global grad-norm all-reduce."""

    def __init__(self, groups: Groups, topo: Topology, tied_names: dict[tuple, list[str]], timeout_s: float,
                 global_norm: bool = True, bucket_mb: float = 25.0, owner_of: dict[str, int] | None = None,
                 experts=None):
        """``tied_names``: per set of stages sharing tensors (as in ``Groups.ties``), this stage's names of them, in
        the same order on each of those stages. ``owner_of`` (ZeRO-1, ``pipeline/sharding.py``): the replica owning
        each replicated name; each bucket (one owner's) is then reduced to its owner, and a step's result holds the
        owned gradients only, their norm summed over the owners on ``Groups.norm``. ``experts``
        (``pipeline/experts.ExpertShard``): this rank's expert shard; its gradients stay out of the data-parallel
        buckets (they hold every replica's tokens of the block already): summed over the replicas holding the same
        shard where there are several, divided by the replica count, and counted in the norm by the first block
        (the norm's sum then runs on ``Groups.norm``, as under ZeRO-1)."""
        self.groups, self.topo, self.timeout = groups, topo, timedelta(seconds=timeout_s)
        self.tied_sets = {k: v for k, v in tied_names.items() if v}
        # a shared tensor's gradient counts once in the norm: on the lowest stage holding it
        self.not_counted = {n for k, names in self.tied_sets.items() if topo.stage != min(k) for n in names}
        self.global_norm = global_norm  # False: the norm stays stage-local and no stage waits for another
        self.bucket_bytes = int(bucket_mb * 2**20)
        self.jobs: deque[_Job] = deque()
        self.done: dict[int, _Job] = {}
        self.side = self.compute = None  # CUDA (NCCL): the reducer's side stream and the executor's compute stream
        self.early: _Early | None = None  # the step whose last backward is running or has run
        self.owner_of = owner_of if groups.dp is not None else None
        self.experts = experts
        self.expert_names = experts.names if experts is not None else frozenset()

    # ------------------------------------------------------------------ the executor's calls
    def arm(self, key: int, leaves: dict[str, torch.Tensor], final: tuple[str, ...] = ()) -> bool:
        """Step ``key``'s last backward on this stage is next: launch each data-parallel bucket as soon as its
        gradients are final (no-op without data parallelism). True when it hooked the leaves' accumulation (the
        backward must then accumulate through autograd, where the hooks fire). ``final``: leaves whose gradient is
        already final, accumulated outside this backward (the VOCAB passes' shard of the output layer)."""
        some = next(iter(leaves.values()))
        # gloo on CPU: the hooks run on this thread and issue the all-reduce; NCCL on CUDA: events, issued after
        # backward; gloo with CUDA tensors (stages sharing a GPU): at submit, as without arming
        if self.groups.dp is None or (some.is_cuda and not self._stream(leaves)):
            return False
        early = self.early = self._plan(key, leaves)
        for n, leaf in leaves.items():
            if leaf.requires_grad and n not in final and n in early.bucket_of:
                early.handles.append(leaf.register_post_accumulate_grad_hook(
                    lambda t, n=n: self._accumulated(early, n)))
        for n in final:
            self._accumulated(early, n)
        return True

    def _plan(self, key: int, tensors: dict[str, torch.Tensor]) -> _Early:
        """Step ``key``'s data-parallel buckets, last parameters first (backward finishes them first)."""
        names = [n for n in list(tensors)[::-1] if n not in self.expert_names]
        return _Early(key, tensors, self._buckets(names, tensors))

    def after_backward(self) -> None:
        """Right after the armed backward returned (executor's thread): on CUDA, issue the buckets whose events were
        recorded (the side stream waits for each; the GPU starts them while the backward's kernels still run)."""
        early = self.early
        if early is None or not early.events:
            return
        with torch.cuda.stream(self.side):
            self._launch(early, cuda=True)

    def _accumulated(self, early: _Early, name: str) -> None:
        """A leaf's gradient of the armed backward is final (post-accumulate-grad hook, autograd's thread)."""
        i = early.bucket_of[name]
        early.left[i] -= 1
        if early.left[i]:
            return
        if early.leaves[name].is_cuda:  # no NCCL call from this thread: mark the moment, issue later
            ev = torch.cuda.Event()
            ev.record()
            early.events[i] = ev
        else:
            self._launch(early, cuda=False)

    def _launch(self, early: _Early, cuda: bool, final: bool = False) -> None:
        """Launch the complete buckets that are next in bucket order (``final``: every one left, at submit)."""
        while len(early.launched) < len(early.buckets):
            i = len(early.launched)
            if not final and (early.left[i] or (cuda and i not in early.events)):
                return
            if cuda and i in early.events:
                self.side.wait_event(early.events.pop(i))
            bucket = early.buckets[i]
            flat = torch.cat([early.grad_of(n).reshape(-1) for n in bucket])
            if cuda:
                flat.record_stream(self.compute)  # made on the side stream, read by the optimizer on the compute one
            if self.owner_of is None:
                work = dist.all_reduce(flat, group=self.groups.dp, async_op=True)
            else:  # ZeRO-1: only the owner needs the sum
                dst = self.groups.dp_ranks[self.owner_of[bucket[0]]]
                work = dist.reduce(flat, dst=dst, group=self.groups.dp, async_op=True)
            early.launched.append((bucket, flat, work))

    def _stream(self, grads: dict[str, torch.Tensor]) -> bool:
        """Whether this step's collectives are stream-ordered (NCCL on CUDA); makes the side stream on first use."""
        device = next(iter(grads.values())).device
        if device.type == "cuda" and dist.get_backend() == "nccl":
            if self.side is None:  # called from the executor's thread outside any stream context
                self.compute, self.side = torch.cuda.current_stream(device), torch.cuda.Stream(device)
            return True
        return False

    def submit(self, key: int, grads: dict[str, torch.Tensor]) -> None:
        """Start step ``key``'s reduction (its gradients are final)."""
        device = next(iter(grads.values())).device
        stream_ordered = self._stream(grads)
        early, self.early = self.early, None
        if early is not None:
            for h in early.handles:
                h.remove()
            early = early if early.key == key else None
        job = _Job(key, self._phases(grads, stream_ordered, early), stream_ordered)
        if stream_ordered:
            self.side.wait_stream(torch.cuda.current_stream(device))  # the gradients are computed there
        self.jobs.append(job)
        self.poll()

    def poll(self) -> None:
        """Issue every phase whose predecessor has completed, in step order; never waits."""
        while self.jobs and self._advance(self.jobs[0], block=False):
            job = self.jobs.popleft()
            self.done[job.key] = job

    def result(self, key: int) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
        """Step ``key``'s reduced gradients and grad norm, a 0-dim float64 tensor on the device (waits for the
        collectives still in flight; never for the device: the norm is read back only where a caller must decide on
        the host)."""
        while key not in self.done:
            if not self.jobs:
                raise RuntimeError(f"rank {self.topo.rank}: step {key} was never submitted for reduction")
            job = self.jobs[0]
            self._advance(job, block=True)
            self.done[self.jobs.popleft().key] = job
        grads, sq = self.done.pop(key).result
        if self.side is not None and sq.is_cuda:
            torch.cuda.current_stream(sq.device).wait_stream(self.side)  # the optimizer reads the reduced grads
        return grads, sq.sqrt()

    def broadcast_from_owners(self, tensors: dict[str, torch.Tensor]):
        """ZeRO-1, after a STEP: each owner's new weights of ``tensors`` (this stage's, every replica's in the same
        order) to the other replicas, one broadcast per bucket of one owner's consecutive tensors (the gradient
        buckets' layout, in parameter order), never one per tensor. A bucket is packed into one flat tensor by its
        owner and unpacked by one foreach copy on the others; at most ``BROADCASTS_IN_FLIGHT`` buckets are in flight
        (the oldest is finished before another is issued: on NCCL that waits on the stream, not the host), so the
        flat copies never add up to the stage's weights. Returns the wait for the rest: on return every replica
        holds every owner's weights."""
        ranks, dp, me = self.groups.dp_ranks, self.groups.dp, self.topo.dp_rank
        in_flight: deque = deque()

        def finish(work, flat, parts, own) -> None:
            work.wait()  # the group's own timeout ends a run whose owner died
            if not own:
                with torch.no_grad():
                    views = flat.split([t.numel() for t in parts])
                    torch._foreach_copy_(parts, [v.view_as(t) for v, t in zip(views, parts)])

        for bucket in self._buckets(list(tensors), tensors):
            owner, parts = self.owner_of[bucket[0]], [tensors[n] for n in bucket]
            if owner == me:
                flat = torch.cat([t.reshape(-1) for t in parts])
            else:
                flat = torch.empty(sum(t.numel() for t in parts), dtype=parts[0].dtype, device=parts[0].device)
            in_flight.append((dist.broadcast(flat, src=ranks[owner], group=dp, async_op=True), flat, parts,
                              owner == me))
            if len(in_flight) > BROADCASTS_IN_FLIGHT:
                finish(*in_flight.popleft())

        def wait() -> None:
            while in_flight:
                finish(*in_flight.popleft())
        return wait

    def close(self) -> None:
        for job in list(self.jobs):  # a failed run: let what is in flight finish or time out
            for w in job.works:
                try:
                    w.wait(self.timeout)
                except RuntimeError:
                    pass
        self.jobs.clear()

    # ------------------------------------------------------------------ phases
    def _advance(self, job: _Job, block: bool) -> bool:
        """Run ``job``'s phases as far as their collectives allow; True when it has finished."""
        with torch.cuda.stream(self.side) if job.stream_ordered else nullcontext():
            while True:
                if job.works:
                    if job.stream_ordered:
                        for w in job.works:
                            w.wait()  # the side stream waits; the host does not
                    elif not block and not all(w.is_completed() for w in job.works):
                        return False
                    else:
                        for w in job.works:
                            self._wait(w, job.key)
                try:
                    job.works = next(job.phases)
                except StopIteration as stop:
                    job.result, job.works = stop.value, []
                    return True

    def _wait(self, work, key: int) -> None:
        try:
            work.wait(self.timeout)
        except RuntimeError as e:
            where = f"rank {self.topo.rank} (stage {self.topo.stage}): gradient reduction of step {key}"
            if timed_out(e):  # a peer alive but stalled: name it, found outside the group that hung
                who = who_went_silent(f"reduce-{key}", wait_s=min(30.0, self.timeout.total_seconds()))
                raise PeerFailure(f"{where}: {who} (nothing within {self.timeout.total_seconds():g}s: stalled or "
                                  f"hung, see its log)") from None
            raise PeerFailure(f"{where} failed after {self.timeout.total_seconds():.0f}s or less; a peer has probably "
                              f"died ({e})") from None

    def _phases(self, grads: dict[str, torch.Tensor], stream_ordered: bool, early: _Early | None = None):
        """The three phases as a generator: each ``yield`` hands over the works the next phase must wait for."""
        names, device = list(grads), next(iter(grads.values())).device
        if self.groups.dp is not None:
            # the buckets launched during the last backward (if armed), then the rest, in bucket order
            early = early or self._plan(-1, grads)
            early.grad_of = grads.__getitem__  # what never got a gradient holds zeros there
            self._launch(early, cuda=stream_ordered, final=True)
            buckets = early.launched
            experts = self._launch_experts(grads)
            yield [w for _, _, w in buckets] + [w for _, _, w in experts if w is not None]
            self._finish_experts(grads, experts)
            for bucket, flat, _ in buckets:
                if self.owner_of is not None and self.owner_of[bucket[0]] != self.topo.dp_rank:
                    for n in bucket:  # another replica's: its sum is there, this copy is dropped
                        del grads[n]
                    continue
                flat /= self.topo.dp_size
                _unflatten(grads, bucket, flat)
        works = [dist.all_reduce(grads[n], group=self.groups.ties[stages], async_op=True)
                 for stages, tied in self.tied_sets.items() if stages in self.groups.ties for n in tied if n in grads]
        if works:  # in the same (sorted) order on every rank
            yield works
        counted = [grads[n] for n in names if n in grads and not (self.topo.num_stages > 1 and n in self.not_counted)
                   and self._counts(n)]
        # per-tensor norms in the gradients' dtype (no float64 copy of any gradient), summed in float64
        sq = torch.stack(torch._foreach_norm(counted, 2)).double().pow(2).sum() if counted else \
            torch.zeros((), dtype=torch.float64, device=device)
        if self.groups.norm is not None:  # ZeRO-1 or sharded experts: each replica has its part of the sum
            yield [dist.all_reduce(sq, group=self.groups.norm, async_op=True)]
        elif self.topo.num_stages > 1 and self.global_norm:
            yield [dist.all_reduce(sq, group=self.groups.pipe, async_op=True)]
        return grads, sq

    def _counts(self, name: str) -> bool:
        """Whether this rank adds ``name``'s gradient to the norm's sum: where the sum runs over the replicas too
        (``Groups.norm``: ZeRO-1 or sharded experts) an expert on the first block, a replicated tensor on replica 0
        (ZeRO-1: on its owner, the only one holding its gradient)."""
        if self.groups.norm is None:
            return True
        if name in self.expert_names:
            return self.experts.counted
        return self.owner_of is not None or self.topo.dp_rank == 0

    def _launch_experts(self, grads: dict[str, torch.Tensor]) -> list:
        """The expert gradients' sums over the replicas holding the same shard (one all-reduce per bucket on the
        group of those replicas; none when the block is every replica): [(names, flat or None, work)]."""
        if self.experts is None:
            return []
        names = [n for n in list(grads)[::-1] if n in self.expert_names]
        if self.experts.replica_group is None:
            return [(names, None, None)] if names else []
        out = []
        for bucket in self._buckets(names, grads, by_owner=False):
            flat = torch.cat([grads[n].reshape(-1) for n in bucket])
            if flat.is_cuda and self.side is not None:
                flat.record_stream(self.compute)  # made on the side stream, read by the optimizer on the compute one
            out.append((bucket, flat, dist.all_reduce(flat, group=self.experts.replica_group, async_op=True)))
        return out

    def _finish_experts(self, grads: dict[str, torch.Tensor], launched: list) -> None:
        """Each expert gradient divided by the replica count: the data-parallel mean (the sum of every replica's
        tokens over the replica count), which the dense gradients get from their all-reduce."""
        for bucket, flat, _ in launched:
            if flat is None:
                torch._foreach_div_([grads[n] for n in bucket], self.topo.dp_size)
                continue
            flat /= self.topo.dp_size
            _unflatten(grads, bucket, flat)

    def _buckets(self, names: list[str], grads: dict[str, torch.Tensor], by_owner: bool = True) -> list[list[str]]:
        """Consecutive gradients of one dtype, at most ``bucket_bytes`` each (a larger tensor is a bucket alone)."""
        out, cur, size = [], [], 0
        for n in names:
            g = grads[n]
            nbytes = g.numel() * g.element_size()
            owned = by_owner and self.owner_of is not None
            owner = self.owner_of[n] if owned else 0
            if cur and (size + nbytes > self.bucket_bytes or g.dtype != grads[cur[0]].dtype
                        or (owned and owner != self.owner_of[cur[0]])):
                out.append(cur)
                cur, size = [], 0
            cur.append(n)
            size += nbytes
        return out + ([cur] if cur else [])


def _unflatten(grads: dict[str, torch.Tensor], bucket: list[str], flat: torch.Tensor) -> None:
    """The reduced gradients of ``bucket`` as views of its flat buffer, in the order they were concatenated."""
    off = 0
    for n in bucket:
        k = grads[n].numel()
        grads[n] = flat[off: off + k].view_as(grads[n])
        off += k
