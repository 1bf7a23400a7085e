"""Pipeline executor: runs this rank's action list with its stage over torch.distributed.

One executor for every schedule (``schedules.py`` makes the action lists; the
simulator checks them), so sync and async runs differ only in their lists.

Weight versions. The optimizer owns the stage's ``nn.Parameter``s, whose storage
always holds the newest version. Forward passes never use those Parameters
directly: each version gets its own leaf tensors sharing storage with a version
buffer, and ``functional_call`` runs the stage with them, so an update never
touches a tensor that an in-flight microbatch saved for its backward. A buffer
is reused as soon as its version has no microbatch in flight and no future
forward needs it: 1 buffer for GPipe/1F1B (updates in place), 2 for 2BW (the
current version and the shadow), up to p at stage 0 for PipeDream.

Reductions. After the last backward of a step, its gradients are handed to a
worker thread that all-reduces them in the stage's data-parallel group, sums the
tied embedding gradient between the first and last stage and all-reduces the
squared gradient norm across stages. The optimizer step waits for that result
only when the schedule places it, so 2BW never stalls on a collective.

No hangs. Every receive and every wait has ``pipeline.p2p_timeout_s``; a dead or
silent peer becomes ``PeerFailure`` naming it, and the process exits non-zero.
"""
from __future__ import annotations

import math
import queue
import threading
import time
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from torch.func import functional_call

from . import checkpoint as ckpt
from .config import Recipe
from .engine import NonFiniteError, StepResult, Topology, autocast
from .lr import build_scheduler

_DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.int64, torch.int32, torch.bool, torch.float64]
_HEADER = 64


class PeerFailure(RuntimeError):
    """A pipeline peer died, stalled past the timeout, or closed its connection."""


# ---------------------------------------------------------------------------- groups


@dataclass
class Groups:
    """Process groups, created collectively in the same order on every rank."""

    dp: object = None  # this stage's data-parallel replicas
    pipe: object = None  # the stages of this data-parallel replica
    tie: object = None  # first + last stage of this replica (tied embeddings)
    dp_ranks: list = field(default_factory=list)


def make_groups(topo: Topology, tied: bool, timeout: timedelta) -> Groups:
    g = Groups()
    p, dp = topo.num_stages, topo.dp_size
    for s in range(p):
        ranks = [s * dp + d for d in range(dp)]
        grp = dist.new_group(ranks, timeout=timeout) if dp > 1 else None
        if s == topo.stage:
            g.dp, g.dp_ranks = grp, ranks
    for d in range(dp):
        ranks = [s * dp + d for s in range(p)]
        grp = dist.new_group(ranks, timeout=timeout)
        if d == topo.dp_rank:
            g.pipe = grp
    if tied and p > 1:
        for d in range(dp):
            ranks = [d, (p - 1) * dp + d]
            grp = dist.new_group(ranks, timeout=timeout)
            if d == topo.dp_rank and topo.stage in (0, p - 1):
                g.tie = grp
    return g


# ---------------------------------------------------------------------------- p2p


class P2P:
    """Point-to-point transfers between adjacent stages; sends are async, receives block with a timeout.

    NCCL moves device tensors directly. gloo sends only CPU tensors, so with gloo on a GPU machine (several
    stages sharing one GPU, which NCCL refuses) transfers are staged through host memory.
    """

    def __init__(self, topo: Topology, timeout_s: float, device: torch.device):
        self.topo, self.timeout, self.device = topo, timedelta(seconds=timeout_s), device
        staged = device.type != "cpu" and dist.get_backend() == "gloo"
        self.wire = torch.device("cpu") if staged else device  # where transferred tensors live
        self.pending: list = []  # (work, tensors) kept alive until the chunk ends

    def peer_rank(self, stage: int) -> int:
        return stage * self.topo.dp_size + self.topo.dp_rank

    def _wait(self, work, peer: int, what: str):
        try:
            work.wait(self.timeout)
        except RuntimeError as e:
            raise PeerFailure(
                f"rank {self.topo.rank} (stage {self.topo.stage}): {what} rank {peer} failed or timed out after "
                f"{self.timeout.total_seconds():.0f}s; the peer has probably died ({e})"
            ) from None

    def send(self, tensors: list[torch.Tensor], stage: int, with_header: bool) -> None:
        peer = self.peer_rank(stage)
        tensors = [t.detach().to(self.wire).contiguous() for t in tensors]
        if with_header:
            vals = [len(tensors)]
            for t in tensors:
                vals += [_DTYPES.index(t.dtype), t.dim(), *t.shape]
            header = torch.tensor(vals + [0] * (_HEADER - len(vals)), dtype=torch.int64, device=self.wire)
            tensors = [header] + tensors
        for t in tensors:
            self.pending.append((dist.isend(t, peer), t))

    def recv(self, stage: int, like: list[torch.Tensor] | None = None) -> list[torch.Tensor]:
        """Receive from ``stage``: with ``like`` the shapes are known, otherwise a header comes first."""
        if like is not None:
            return self.complete(self.post(stage, like))
        peer = self.peer_rank(stage)
        header = torch.empty(_HEADER, dtype=torch.int64, device=self.wire)
        self._wait(dist.irecv(header, peer), peer, "waiting for activations from")
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
        peer = self.peer_rank(stage)
        bufs = [torch.empty(t.shape, dtype=t.dtype, device=self.wire) for t in like]
        return peer, [(dist.irecv(b, peer), b) for b in bufs]

    def complete(self, posted: tuple, what: str = "waiting for data from") -> list[torch.Tensor]:
        peer, pairs = posted
        for work, _ in pairs:
            self._wait(work, peer, what)
        return [b.to(self.device) for _, b in pairs]

    def drain(self) -> None:
        for work, _ in self.pending:
            self._wait(work, -1, "completing a send to")
        self.pending.clear()


# ---------------------------------------------------------------------------- reductions


class Reducer:
    """Worker thread: per step, DP all-reduce, tied-gradient sum and the global grad-norm all-reduce, in order."""

    def __init__(self, groups: Groups, topo: Topology, tied_names: list[str], timeout_s: float, global_norm: bool = True):
        self.groups, self.topo, self.tied, self.timeout_s = groups, topo, tied_names, timeout_s
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
        if self.groups.tie is not None:
            for n in self.tied:
                dist.all_reduce(grads[n], group=self.groups.tie)
        sq = torch.zeros((), dtype=torch.float64, device=next(iter(grads.values())).device)
        last = self.topo.stage == self.topo.num_stages - 1 and self.topo.num_stages > 1
        for n in names:
            if last and n in self.tied:
                continue  # counted once, on the first stage
            sq += grads[n].double().pow(2).sum()
        if self.topo.num_stages > 1 and self.global_norm:
            dist.all_reduce(sq, group=self.groups.pipe)
        return grads, float(sq.sqrt())

    def close(self):
        self.jobs.put((None, None))
        self.thread.join(timeout=self.timeout_s)


# ---------------------------------------------------------------------------- versions


class Versions:
    """Weight versions of one stage: version -> buffer; in-flight counts decide which buffers are free."""

    def __init__(self, params: dict[str, torch.nn.Parameter], lag: int):
        self.params, self.lag = params, lag
        self.buffers: dict[int, dict[str, torch.Tensor]] = {0: {n: p.data for n, p in params.items()}}
        self.leaves: dict[int, dict[str, torch.Tensor]] = {}
        self.inflight: dict[int, int] = {0: 0}
        self.latest = 0
        self.peak = 1

    def leaves_for(self, v: int) -> dict[str, torch.Tensor]:
        if v not in self.buffers:
            raise RuntimeError(f"weight version {v} is not held (held: {sorted(self.buffers)}, latest {self.latest})")
        if v not in self.leaves:
            self.leaves[v] = {n: b.detach().requires_grad_() for n, b in self.buffers[v].items()}
        return self.leaves[v]

    def _needed(self, v: int, latest: int) -> bool:
        return self.inflight.get(v, 0) > 0 or v >= latest - self.lag

    def prepare_update(self) -> None:
        """Point the optimizer's Parameters at a buffer holding the newest weights that it may overwrite."""
        new = self.latest + 1
        src = self.buffers[self.latest]
        free = [v for v in self.buffers if not self._needed(v, new)]
        if self.latest in free:
            dst = src  # nothing in flight uses it and no future forward will: update in place
        elif free:
            dst = self.buffers[free[0]]
            for n, b in dst.items():
                b.copy_(src[n])
        else:
            dst = {n: b.clone() for n, b in src.items()}
        for v in free:
            self.buffers.pop(v)
            self.leaves.pop(v, None)
            self.inflight.pop(v, None)
        for n, p in self.params.items():
            p.data = dst[n]
        self.latest = new
        self.buffers[new] = dst
        self.inflight[new] = 0
        self.peak = max(self.peak, len(self.buffers))

    def state(self) -> dict[str, torch.Tensor]:
        """Held versions other than the newest (which is the module's state dict)."""
        return {f"v{v}/{n}": b for v, buf in self.buffers.items() if v != self.latest for n, b in buf.items()}

    def load(self, latest: int, older: dict[str, torch.Tensor]) -> None:
        self.buffers = {latest: {n: p.data for n, p in self.params.items()}}
        for key, t in older.items():
            v, n = key[1:].split("/", 1)
            self.buffers.setdefault(int(v), {})[n] = t.clone()
        self.latest, self.leaves = latest, {}
        self.inflight = {v: 0 for v in self.buffers}


# ---------------------------------------------------------------------------- engine


@dataclass
class _Micro:
    """What a forwarded microbatch keeps until its backward."""

    version: int
    inputs: list = field(default_factory=list)
    outputs: list = field(default_factory=list)
    loss: torch.Tensor | None = None
    input_grads: list | None = None  # to send back to the previous stage
    grads_in: list | None = None  # received from the next stage
    saved_bytes: int = 0


class PipelineEngine:
    """This rank's stage of the pipeline; same interface as ``engine.LocalEngine``."""

    def __init__(self, recipe: Recipe, model: torch.nn.Module, topo: Topology, log=print):
        from .optim import apply_delay_correction, build_optimizer
        from .partition import partition_model, tied_parameters

        from .engine import local_device

        self.recipe, self.topo, self.config, self.device = recipe, topo, model.config, local_device()
        p = recipe.pipeline.num_stages
        stages = partition_model(model, p, recipe.pipeline.layers_per_stage, seq_len=recipe.data.seq_len)
        tied_pairs = tied_parameters(stages)
        self.stage = stages[topo.stage].to(self.device)  # only this stage's weights reach the device
        del stages
        self.first, self.last = topo.stage == 0, topo.stage == p - 1
        self.params = dict(self.stage.named_parameters())
        mine = set(self.params)
        self.tied_names = [n for pair in tied_pairs for n in pair if n in mine]
        self.optimizer = apply_delay_correction(build_optimizer(self.stage, recipe.optimizer, log=log), recipe.optimizer)
        self.scheduler = build_scheduler(self.optimizer, recipe.training)
        timeout_s = recipe.pipeline.p2p_timeout_s
        self.groups = make_groups(topo, bool(tied_pairs), timedelta(seconds=timeout_s))
        from .schedules import reduce_scope

        # a stage-local norm (pipedream without clipping) is not logged as grad_norm
        self.global_norm = reduce_scope(recipe.pipeline.schedule, recipe.training.max_grad_norm) == "global"
        self.reducer = Reducer(self.groups, topo, self.tied_names, timeout_s, self.global_norm)
        self.p2p = P2P(topo, timeout_s, self.device)
        from .schedules import version_lag

        self.versions = Versions(self.params, lag=version_lag(recipe.pipeline.schedule, topo.stage, p))
        self.nonfinite_skipped = 0
        self.peak_inflight = 0
        self.track_memory = False  # count saved activation bytes (memory_report); off in training: it costs a hook per tensor
        self.mem = {"activations": 0, "peak_activations": 0, "pending_grads": 0, "accumulating": 0, "peak_grad_sets": 1}
        self.action_seconds: dict[str, float] = {}  # measured time per action kind (feeds the simulator)
        self.action_counts: dict[str, int] = {}
        # per window (reset by train_steps): receive shapes, receives posted ahead, whether the header went out
        self._like: dict[str, list] = {}
        self._prefetch: dict[tuple, tuple] = {}
        self._next_recv: dict[str, dict] = {}
        self._act_header_sent = False

    # ------------------------------------------------------------------ compute
    def _forward(self, micro: _Micro, ids: torch.Tensor | None, labels: torch.Tensor | None):
        leaves = self.versions.leaves_for(micro.version)
        if self.first:
            arg = ids
        else:
            for t in micro.inputs:
                if t.is_floating_point():
                    t.requires_grad_()
            arg = micro.inputs[0] if len(micro.inputs) == 1 else tuple(micro.inputs)
        kwargs = {"labels": labels} if self.last and labels is not None else None
        if not self.track_memory:
            with autocast(self.recipe.training.bf16):
                return functional_call(self.stage, leaves, (arg,), kwargs, strict=False)
        weights = {b.untyped_storage().data_ptr() for buf in self.versions.buffers.values() for b in buf.values()}
        seen: set = set()

        def pack(t):  # count the activation bytes autograd keeps for this microbatch's backward
            key = (t.untyped_storage().data_ptr(), t.dtype)
            if key[0] not in weights and key not in seen:
                seen.add(key)
                micro.saved_bytes += t.untyped_storage().nbytes()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), autocast(self.recipe.training.bf16):
            out = functional_call(self.stage, leaves, (arg,), kwargs, strict=False)
        return out

    def _backward(self, micro: _Micro, grads: list[torch.Tensor] | None, m: int) -> None:
        if self.last:
            (micro.loss / m).backward()
        else:
            floats = [o for o in micro.outputs if o.is_floating_point()]
            pairs = [(o, g) for o, g in zip(floats, grads) if o.requires_grad]
            torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
        if not self.first:
            micro.input_grads = [
                t.grad if t.grad is not None else torch.zeros_like(t) for t in micro.inputs if t.is_floating_point()
            ]
        micro.inputs, micro.outputs = [], [o.detach() for o in micro.outputs]

    def _step(self, k: int, results: dict) -> None:
        grads, norm = self.reducer.result(k)
        cfg = self.recipe.training
        lr = self.optimizer.param_groups[0]["lr"]
        finite = math.isfinite(norm)
        if not finite and cfg.on_nonfinite == "stop":
            raise NonFiniteError(f"step {k}: non-finite gradient norm {norm}; stopping (training.on_nonfinite: stop). "
                                 "The last checkpoint is intact; lower optimizer.learning_rate or set training.on_nonfinite: skip")
        self.versions.prepare_update()
        if finite:
            coef = min(1.0, cfg.max_grad_norm / (norm + 1e-6)) if cfg.max_grad_norm else 1.0
            for n, prm in self.params.items():
                prm.grad = grads[n].mul_(coef) if coef != 1.0 else grads[n]
            self.optimizer.step()
            self.scheduler.step()
            for prm in self.params.values():
                prm.grad = None
        else:
            self.nonfinite_skipped += 1
        results[k] = (norm if self.global_norm else None, lr, finite)

    def train_steps(self, batches: list[torch.Tensor], first_step: int) -> list[StepResult]:
        from .schedules import schedule_actions

        rc = self.recipe.pipeline
        m = batches[0].shape[0]
        actions = schedule_actions(rc.schedule, rc.num_stages, m, len(batches), first_step=first_step,
                                   extra_warmup=rc.extra_warmup)[self.topo.stage]
        if any(b.shape != batches[0].shape for b in batches):
            raise ValueError(f"pipeline window: every step's batch must have one shape (got {sorted({tuple(b.shape) for b in batches})})")
        micro: dict[tuple[int, int], _Micro] = {}
        step_version: dict[int, int] = {}
        loss_sums = torch.zeros(len(batches), dtype=torch.float64, device=self.device)
        # Within a window every microbatch has the same shape, so only the window's first activation carries a
        # header; after each receive the next one of its kind is posted at once (see P2P.post).
        self._like, self._prefetch, self._act_header_sent, self._next_recv = {}, {}, False, {}
        for kind in ("RECV_ACT", "RECV_GRAD"):
            keys = [(a.step, a.microbatch) for a in actions if _kind(a) == kind]
            self._next_recv[kind] = dict(zip(keys, keys[1:]))
        results: dict[int, tuple] = {}
        clock = time.perf_counter
        for a in actions:
            kind = _kind(a)
            t0 = clock()
            self._run_action(a, kind, batches, first_step, micro, step_version, loss_sums, results, m)
            self.action_seconds[kind] = self.action_seconds.get(kind, 0.0) + clock() - t0
            self.action_counts[kind] = self.action_counts.get(kind, 0) + 1
        self.p2p.drain()
        return self._gather_results(first_step, len(batches), loss_sums / m, results)

    def _run_action(self, a, kind, batches, first_step, micro, step_version, loss_sums, results, m) -> None:
        """Execute one action of this stage's list (state lives in the dicts the caller owns)."""
        if kind == "F":
            k, i = a.step, a.microbatch
            mb = micro.setdefault((k, i), _Micro(a.version))
            mb.version = a.version
            step_version.setdefault(k, a.version)
            ids = batches[k - first_step][i].to(self.device, non_blocking=True) if self.first or self.last else None
            out = self._forward(mb, ids, ids)
            self.mem["activations"] += mb.saved_bytes
            self.mem["peak_activations"] = max(self.mem["peak_activations"], self.mem["activations"])
            self.versions.inflight[a.version] = self.versions.inflight.get(a.version, 0) + 1
            if self.last:
                mb.loss = out
                loss_sums[k - first_step] += out.detach()  # stays on the device: no sync per microbatch
            else:
                mb.outputs = list(out) if isinstance(out, (tuple, list)) else [out]
            self.peak_inflight = max(self.peak_inflight, sum(self.versions.inflight.values()))
        elif kind == "B":
            mb = micro[(a.step, a.microbatch)]
            self._backward(mb, mb.grads_in, m)
            self.mem["activations"] -= mb.saved_bytes
            self.mem["accumulating"] = 1
            self._count_grad_sets()
            self.versions.inflight[mb.version] -= 1
            if self.first:
                micro.pop((a.step, a.microbatch))
        elif kind == "SEND_ACT":
            self.p2p.send(micro[(a.step, a.microbatch)].outputs, self.topo.stage + 1, with_header=not self._act_header_sent)
            self._act_header_sent = True
        elif kind == "RECV_ACT":
            mb = micro.setdefault((a.step, a.microbatch), _Micro(-1))
            mb.inputs = self._receive(kind, (a.step, a.microbatch), self.topo.stage - 1, None)
        elif kind == "RECV_GRAD":
            mb = micro[(a.step, a.microbatch)]
            like = [o for o in mb.outputs if o.is_floating_point()]
            mb.grads_in = self._receive(kind, (a.step, a.microbatch), self.topo.stage + 1, like)
        elif kind == "SEND_GRAD":
            mb = micro.pop((a.step, a.microbatch))
            self.p2p.send(mb.input_grads, self.topo.stage - 1, with_header=False)
        elif kind == "REDUCE":
            leaves = self.versions.leaves_for(step_version[a.step])
            grads = {}
            for n, leaf in leaves.items():
                grads[n] = leaf.grad if leaf.grad is not None else torch.zeros_like(leaf)
                leaf.grad = None
            self.reducer.submit(a.step, grads)
            self.mem["accumulating"], self.mem["pending_grads"] = 0, self.mem["pending_grads"] + 1
            self._count_grad_sets()
        elif kind == "STEP":
            self._step(a.step, results)
            self.mem["pending_grads"] -= 1
        else:
            raise ValueError(f"unknown pipeline action {a}")

    def _receive(self, kind: str, key: tuple[int, int], stage: int, like: list | None) -> list[torch.Tensor]:
        """This receive (posted earlier if its shapes were known), then post the next one of its kind."""
        posted = self._prefetch.pop((kind, key), None)
        if posted is not None:
            data = self.p2p.complete(posted)
        else:
            data = self.p2p.recv(stage, like=self._like.get(kind, like))
        if kind not in self._like:  # shapes are fixed within a window: learned from its first receive
            self._like[kind] = [torch.empty(t.shape, dtype=t.dtype, device="meta") for t in data]
        nxt = self._next_recv[kind].get(key)
        if nxt is not None:
            self._prefetch[(kind, nxt)] = self.p2p.post(stage, self._like[kind])
        return data

    def _gather_results(self, first_step, n, losses, results) -> list[StepResult]:
        buf = (losses if self.last else torch.zeros_like(losses)).to(self.device)
        dist.all_reduce(buf)
        buf = buf.cpu()
        buf /= self.topo.dp_size
        out = []
        for j in range(n):
            k = first_step + j
            norm, lr, finite = results.get(k, (None, self.optimizer.param_groups[0]["lr"], False))
            out.append(StepResult(k, float(buf[j]), norm, lr, k in results and finite, k in results and not finite))
        return out

    def _count_grad_sets(self) -> None:
        """Gradient sets alive: one accumulating + those reduced and waiting for their STEP (2BW: up to 2)."""
        self.mem["peak_grad_sets"] = max(self.mem["peak_grad_sets"], self.mem["accumulating"] + self.mem["pending_grads"])

    def memory_report(self) -> dict[str, float]:
        """Bytes this stage really held at its peak: weight versions, gradients, optimizer state, EF buffer, activations."""
        nbytes = lambda ts: sum(t.numel() * t.element_size() for t in ts)
        param_bytes = nbytes(self.params.values())
        ef = getattr(self.optimizer, "error_feedback", None)
        opt_state = [t for st in self.optimizer.state.values() for t in st.values() if torch.is_tensor(t) and t.dim() > 0]
        rep = {"weights": param_bytes * self.versions.peak, "grads": param_bytes * self.mem["peak_grad_sets"],
               "optimizer": nbytes(opt_state), "ef": nbytes(ef["prev"].values()) if ef else 0,
               "activations": self.mem["peak_activations"]}
        rep["total"] = sum(rep.values())
        return rep

    def profile(self) -> list[dict] | None:
        """Seconds and counts per action kind of every stage so far (collective; the main process gets the list)."""
        mine = ({"stage": self.topo.stage, "seconds": dict(self.action_seconds), "counts": dict(self.action_counts)}
                if self.topo.dp_rank == 0 else None)
        parts = [None] * self.topo.world_size if self.topo.is_main else None
        dist.gather_object(mine, parts, dst=0)
        return sorted((x for x in parts if x), key=lambda x: x["stage"]) if self.topo.is_main else None

    def close(self) -> None:
        """Stop the reduction worker and release this engine's process groups (before destroying the default one)."""
        self.reducer.close()
        for g in {id(x): x for x in (self.groups.dp, self.groups.pipe, self.groups.tie) if x is not None}.values():
            dist.destroy_process_group(g)

    # ------------------------------------------------------------------ eval
    @torch.no_grad()
    def eval_nll(self, blocks: torch.Tensor, batch_size: int) -> tuple[float, int]:
        """Forward-only microbatches through the stages with the newest weights; NLL summed on the last stage."""
        self.stage.eval()
        mine = blocks[self.topo.dp_rank :: self.topo.dp_size]
        total = torch.zeros(2, dtype=torch.float64, device=self.device)
        leaves = self.versions.leaves_for(self.versions.latest)
        for i in range(0, len(mine), batch_size):
            ids = mine[i : i + batch_size].to(self.device)
            arg = ids
            if not self.first:
                inputs = self.p2p.recv(self.topo.stage - 1)
                arg = inputs[0] if len(inputs) == 1 else tuple(inputs)
            with autocast(self.recipe.training.bf16):
                out = functional_call(self.stage, leaves, (arg,), strict=False)
            if self.last:
                logits = out.float() if torch.is_tensor(out) else out.logits.float()
                nll = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1), reduction="sum")
                total += torch.tensor([float(nll), ids[:, 1:].numel()], dtype=torch.float64, device=self.device)
            else:
                self.p2p.send(list(out) if isinstance(out, (tuple, list)) else [out], self.topo.stage + 1, with_header=True)
        self.p2p.drain()
        dist.all_reduce(total)
        self.stage.train()
        return float(total[0]), int(total[1])

    # ------------------------------------------------------------------ state
    def full_state_dict(self) -> dict[str, torch.Tensor] | None:
        """Newest weights merged by name on the main process (collective: every rank calls it)."""
        from .partition import merge_state_dicts

        sd = {n: t.detach().cpu().clone() for n, t in self.stage.state_dict().items()} if self.topo.dp_rank == 0 else None
        parts = [None] * self.topo.world_size if self.topo.is_main else None
        dist.gather_object(sd, parts, dst=0)
        if not self.topo.is_main:
            return None
        return merge_state_dicts([p for p in parts if p is not None])

    def _param_names(self) -> list[str]:
        """Parameter names in the optimizer's order (checkpoints key optimizer state by name, not position)."""
        name_of = {id(p): n for n, p in self.stage.named_parameters()}
        return [name_of[id(p)] for g in self.optimizer.param_groups for p in g["params"]]

    def save(self, tmp: Path) -> None:
        if self.topo.dp_rank != 0:
            return
        s = self.topo.stage
        ckpt.save_tensors(tmp / f"stage-{s:02d}.safetensors", self.stage.state_dict())
        older = self.versions.state()
        if older:
            ckpt.save_tensors(tmp / f"stage-{s:02d}-versions.safetensors", older)
        ckpt.save_state(tmp / f"stage-{s:02d}-optimizer.pt", {
            "optimizer": self.optimizer.state_dict(), "param_names": self._param_names(),
            "scheduler": self.scheduler.state_dict(), "latest_version": self.versions.latest,
            "nonfinite_skipped": self.nonfinite_skipped,
        })

    def load(self, path: Path) -> None:
        """Restore this stage from a checkpoint of any number of stages: everything is matched by parameter name."""
        weights, older, by_name, ef_by_name, groups = {}, {}, {}, {}, {}
        files = sorted(p for p in path.glob("stage-*.safetensors") if not p.name.endswith("-versions.safetensors"))
        if not files:
            raise FileNotFoundError(f"{path}: no stage-XX.safetensors; it was not written by a pipelined run "
                                    "(resume it with pipeline.schedule: none)")
        for f in files:
            weights.update(ckpt.load_tensors(f))
            v = f.with_name(f.stem + "-versions.safetensors")
            if v.exists():
                older.update(ckpt.load_tensors(v))
            state = ckpt.load_state(f.with_name(f.stem + "-optimizer.pt"))
            osd, names = state["optimizer"], state["param_names"]
            for i, n in enumerate(names):
                if i in osd["state"]:
                    by_name[n] = osd["state"][i]
            for i, t in (osd.get("error_feedback") or {}).get("prev", {}).items():
                ef_by_name[names[int(i)]] = t
            for g in osd["param_groups"]:
                groups.setdefault(g.get("name"), g)
            meta = state
        mine = self.stage.state_dict()
        missing = [k for k in mine if k not in weights]
        if missing:
            raise KeyError(f"{path}: the checkpoint has no {missing[:5]}; was it written for another model?")
        self.stage.load_state_dict({k: weights[k] for k in mine}, strict=True)
        sd = self.optimizer.state_dict()
        names = self._param_names()
        sd["state"] = {i: by_name[n] for i, n in enumerate(names) if n in by_name}
        for g in sd["param_groups"]:  # the lr the schedule had reached, not the fresh optimizer's
            saved = groups.get(g.get("name"))
            if saved is not None:
                g.update({k: v for k, v in saved.items() if k not in ("params", "param_names")})
        if ef_by_name:
            sd["error_feedback"] = {"lam": self.recipe.optimizer.ef_lambda,
                                    "prev": {i: ef_by_name[n] for i, n in enumerate(names) if n in ef_by_name}}
        self.optimizer.load_state_dict(sd)
        sched = self.scheduler.state_dict()  # per-group lists differ between stages: keep ours, take the position
        sched.update({k: meta["scheduler"][k] for k in ("last_epoch", "_step_count") if k in meta["scheduler"]})
        sched["_last_lr"] = [g["lr"] for g in self.optimizer.param_groups]
        self.scheduler.load_state_dict(sched)
        mine_older = {k: t for k, t in older.items() if k.split("/", 1)[1] in self.params}
        self.versions.load(meta["latest_version"], mine_older)
        self.nonfinite_skipped = meta["nonfinite_skipped"]


def _kind(action) -> str:
    """The action's type as a plain string (schedules.py uses a str Enum)."""
    t = getattr(action, "type", None) or getattr(action, "kind", None) or getattr(action, "op", None)
    return t.value if hasattr(t, "value") else str(t)
