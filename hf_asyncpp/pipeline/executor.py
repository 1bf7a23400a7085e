"""The pipeline executor: this rank's stage runs its action list as one stream of steps.

One executor for every schedule (the ``Schedule`` record makes the action lists; the simulator checks them), so
sync and async runs differ only in their lists. Its parts live beside it: weight versions (``versions.py``),
transfers (``p2p.py``), the gradient reduction (``reducer.py``), checkpoint files (``stage_state.py``).

Streaming. ``run(batches, first_step, num_steps)`` executes the steps as one action list and yields each step's
result as soon as every stage has applied it: the loss lives on the last stage and the grad norm/lr at every
stage's STEP, so at STEP{k} each rank posts a non-blocking all-reduce of step k's loss on a gloo group of its own
(``StepReports``) and the caller gets step k a step or so later, while the pipeline keeps running. Nothing in
reporting waits on a peer; the pipeline drains only at the end of a ``run`` call, which the trainer makes only
where the numbers need it (a checkpoint, an evaluation, the end).

Stopping. A stop signal (``supervision``) is voted in step k's report; at its first action of step k + STOP_LAG every
rank reads that vote (the same sum everywhere) and, when it says stop, runs the list of the window that ends after
that step instead: the actions it has run so far are a prefix of that list (checked here, proven for every schedule
in the tests), so every stage drains at the same step and the trainer saves a checkpoint there.

Hot loop. Per action: one dict lookup to its handler, two clock reads, one poll of the oldest pending report
and, while a reduction is in flight on gloo, of its phase, and one look at whether a ``torch.profiler`` records
(then the action runs inside ``record_function("PP:<action>")``); per step, one look at a delivered stop vote.
Batches are pulled from the iterator at a step's first forward and dropped after its last; receives of known
shape are posted one ahead (see ``P2P.post``).
"""
from __future__ import annotations

import itertools
import time
from collections import defaultdict
from contextlib import ExitStack, nullcontext
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Iterable, Iterator

import torch
import torch.distributed as dist
from torch.distributed.pipelining._backward import stage_backward_input
from torch.nn.utils.stateless import _reparametrize_module
from torch.profiler import record_function

from .. import supervision
from ..config.recipe import Recipe
from ..engine import StepResult, finite_step
from ..model.build import autocast, compile_layers, enable_activation_checkpointing, materialise_stage
from ..model.fused_loss import use_fused_loss
from ..model.vocab_parallel import vocab_pass
from ..optim import apply_delay_correction, build_optimizer
from ..optim.ef import KEY as EF_KEY, has_correction, learned_values
from ..optim.lr import build_scheduler
from ..plan.vocab import resolve_vocab_parallel
from ..partition import partition_model, shared_tensors
from ..partition.split_backward import weight_gradients
from ..schedules.actions import Action, ActionType
from ..schedules.records import get_schedule, with_sync_start
from ..storage import checkpoint_io as ckpt
from ..storage.staging import StagedFile, Stager
from ..topology import Topology, local_device, make_groups, set_default_group_timeout
from . import forward_only, stage_state
from .experts import expert_names, shard_experts
from .gpu_timer import DEVICE_TIMED, GpuTimer
from .memtrack import checkpoint_input_hooks, is_weight_cast, stage_memory, storage_key, transfer_bytes
from .p2p import P2P, polls, ranks_on_this_node
from .reducer import Reducer
from .step_reports import StepReports
from .sharding import assign_owners, keep_owned
from .versions import Hold, Versions, find_casts

__all__ = ["PipelineEngine"]

T = ActionType
STOP_LAG = 3
"""A stop vote cast at STEP{k} is read at each rank's first action of step k + STOP_LAG: every stage has run STEP{k}
two steps before that (tests/test_stop_signals.py checks every schedule), so its report has been posted everywhere
and has normally landed; one more step keeps the first stage, which runs ahead, from waiting for it."""

UNLABELLED = nullcontext()
"""An action run while no profiler records: ``torch.profiler.record_function`` is not entered at all, because
entering it dispatches two ops (``profiler._record_function_enter_new`` and its exit) even with no profiler on, which
would add two host ops to every action of a training step; ``torch.autograd._profiler_enabled()`` (one C call, no
dispatch) says whether a profiler records on this thread."""


def profiler_label(a: Action) -> str:
    """An action's name in a ``torch.profiler`` trace: ``PP:`` and its text form (``PP:F3.1@v2``, ``PP:STEP3``), as
    ``torch.distributed.pipelining`` labels its own actions, so a trace shows the schedule by step and microbatch."""
    return f"PP:{a}"


@dataclass
class _Micro:
    """What a forwarded microbatch keeps until its backward."""

    version: int
    hold: Hold | None = None  # the version's in-flight hold, taken at the forward, released at the backward
    inputs: list = field(default_factory=list)
    outputs: list = field(default_factory=list)
    loss: torch.Tensor | None = None  # the last stage's; with vocab_parallel its router aux term (None without one)
    labels: torch.Tensor | None = None  # vocab_parallel, last stage: the ids, from the forward to the VOCAB pass
    grad_to_prev: list | None = None  # input gradients, sent back to the previous stage
    grad_from_next: list | None = None  # output gradients, received from the next stage
    weight_pass: tuple | None = None  # after an I: what its W computes the weight gradient from (_backward_input)
    sent: bool = False  # SEND_GRAD done (its W may come after it)
    done: bool = False  # B or W done (its SEND_GRAD may come after it)
    saved_bytes: int = 0
    cast_bytes: int = 0  # of saved_bytes: autocast's bf16 copies of the weights (track_memory)


@dataclass
class _Window:
    """State of one ``run``: the steps between two drain points."""

    first_step: int
    m: int
    batches: Iterator[torch.Tensor] | None  # None: a middle stage, which reads no data
    shape: tuple
    data: dict = field(default_factory=dict)  # step -> its batch, from the step's first forward to its last
    micro: dict = field(default_factory=dict)  # (step, microbatch) -> _Micro
    step_version: dict = field(default_factory=dict)
    loss_sums: dict = field(default_factory=dict)  # last stage: step -> summed microbatch losses (on the device)
    end_step: int = 0
    recv_shapes: dict = field(default_factory=dict)  # kind -> meta tensors; fixed within a window
    prefetch: dict = field(default_factory=dict)  # (kind, (step, microbatch)) -> posted receive
    backwards: dict = field(default_factory=dict)  # step -> backwards run here so far (the m-th is its last)
    act_header_sent: bool = False
    vocab_inputs: tuple | None = None  # vocab_parallel, stages but the last: what the VOCAB passes receive into
    vocab_grads: dict = field(default_factory=dict)  # vocab_parallel: step -> its shard's gradient, until the step's
    # last backward hands it to the version's leaf (two steps may share a version: 2BW's 0 and 1)

    def next_micro(self, key: tuple[int, int]) -> tuple[int, int] | None:
        """The microbatch after ``key`` in this window. Receives of one kind come in microbatch order in every
        schedule (messages are FIFO per pair of stages), so it is also the next receive of the kind."""
        k, i = key
        nxt = (k, i + 1) if i + 1 < self.m else (k + 1, 0)
        return nxt if nxt[0] < self.end_step else None


class PipelineEngine:
    """This rank's stage of the pipeline; the same ``engine.Engine`` interface as ``engine.LocalEngine``."""

    def __init__(self, recipe: Recipe, model: torch.nn.Module, topo: Topology, log=print):
        self.recipe, self.topo, self.config, self.device = recipe, topo, model.config, local_device()
        rc, p = recipe.pipeline, recipe.pipeline.num_stages
        self.schedule = with_sync_start(get_schedule(rc.schedule), recipe.optimizer.delay_start_step)
        if recipe.training.gradient_checkpointing:
            enable_activation_checkpointing(model)  # before partitioning: the stages' layers copy the flags
        # the output layer cut over the stages, each running a VOCAB pass per microbatch (model/vocab_parallel.py)
        # (``auto``: where the planner's simulation says it pays and, on a GPU, its memory model says it fits; the same
        # answer on every rank)
        device_bytes = torch.cuda.get_device_properties(self.device).total_memory if self.device.type == "cuda" else None
        self.vocab_parallel = resolve_vocab_parallel(recipe, model, device_bytes=device_bytes, replicas=topo.dp_size)[0]
        stages = partition_model(model, p, rc.split, seq_len=recipe.data.seq_len,
                                 fused_loss=use_fused_loss(recipe.training.fused_loss, model),
                                 vocab_parallel=self.vocab_parallel)
        shared = shared_tensors(stages)  # tensors held on several stages: gradients summed across them
        if any(t.is_meta for t in stages[topo.stage].parameters()):  # ``model`` on the meta device: build our stage only
            materialise_stage(stages[topo.stage], model, recipe.model)
        self.stage = stages[topo.stage].to(self.device)  # only this stage's weights reach the device
        del stages
        self.first, self.last = topo.first, topo.last
        tied: dict[tuple, list[str]] = {}  # per set of stages sharing tensors, this stage's names of them
        for holders, names in shared:
            if topo.stage in holders:
                tied.setdefault(holders, []).append(names[holders.index(topo.stage)])
        self.tied_names = [n for names in tied.values() for n in names]
        # expert parallelism: the stage's expert tensors sharded over blocks of replicas (pipeline/experts.py),
        # before anything (optimizer, versions, compiled layers) holds them
        sharded = expert_names(model, self.stage, rc.expert_parallel, topo.dp_size)
        # a stage-local norm (pipedream without clipping) is not logged as grad_norm
        self.global_norm = self.schedule.reduce_scope(recipe.training.max_grad_norm) == "global"
        # ZeRO-1: this replica steps (and keeps optimizer state for) the replicated tensors it owns, the owners
        # broadcast them; each rank steps its own experts
        self.owner_of = None
        if recipe.optimizer.shard_across_replicas and topo.dp_size > 1:
            sizes = {n: q.numel() for n, q in self.stage.named_parameters() if n not in sharded}
            self.owner_of = assign_owners(sizes, topo.dp_size, set(self.tied_names))
        # every wait starts with the long budget (init_timeout_s, until the run's first STEP); after a STEP of a stream
        # receives wait p2p_timeout_s for a neighbour, collectives collective_timeout_s (_use_timeouts)
        # the groups are made collectively: decided by the recipe, the same on every rank, also on a stage without
        # MoE layers (its norm then still sums over the norm group, as the other stages' does)
        ep = rc.expert_parallel  # (expert_names checked that it divides the replicas)
        self.groups = make_groups(topo, [holders for holders, _ in shared], timedelta(seconds=rc.init_timeout_s),
                                  p2p_timeout=timedelta(seconds=rc.init_timeout_s),
                                  sharded_norm=None if self.owner_of is None and ep == 1
                                  else "global" if self.global_norm else "stage",
                                  vocab_parallel=self.vocab_parallel, expert_parallel=ep)
        self.experts = shard_experts(model, self.stage, sharded, self.groups.experts, topo.dp_rank) if sharded else None
        if recipe.training.compiles():
            compile_layers(self.stage.decoder_layers(), recipe.training.torch_compile_backend)
        self.params = dict(self.stage.named_parameters())
        # vocab_parallel: this stage's rows of the output layer (a parameter of its own, in its versions like any)
        self.shard = self.stage.vocab.shard_name(topo.stage) if self.vocab_parallel else None
        # a learned EF lambda per stage, and one per set of stages sharing tensors (a tied head's copies must take the
        # same update on every holder: their lambda is learned from the shared tensors alone, the same everywhere)
        own = [p for n, p in self.params.items() if n not in self.tied_names and p.requires_grad]
        candidates = [(own, True)] + [([self.params[n] for n in names], topo.stage == min(holders))
                                      for holders, names in tied.items()]
        lam_groups = [g for g, _ in candidates if g]
        # the groups whose lambda this rank reports (a tied group on its lowest stage, replica 0 only): the logged
        # mean is over the model's groups, as the single-process reference's
        self.lam_reported = [i for i, (_, counted) in enumerate(c for c in candidates if c[0]) if counted] \
            if topo.dp_rank == 0 else []
        self.optimizer = apply_delay_correction(build_optimizer(self.stage, recipe.optimizer, log=log), recipe.optimizer,
                                                groups=lam_groups)
        self.scheduler = build_scheduler(self.optimizer, recipe.training)
        self.reducer = Reducer(self.groups, topo, tied, rc.init_timeout_s, self.global_norm, owner_of=self.owner_of,
                               experts=self.experts)
        self.p2p = P2P(topo, rc.init_timeout_s, self.device, self.groups.p2p,
                       poll=polls(rc.recv_wait, self.device, ranks_on_this_node(topo.world_size)))
        self.reports = StepReports(self.groups.report, topo.dp_size, rc.init_timeout_s,
                                   stop_on_nonfinite=recipe.training.on_nonfinite == "stop")
        self.versions = Versions(self.params, lag=self.schedule.lag(topo.stage, p))
        # training.bf16, read once: bf16 autocast in every forward and backward, and each version holding the weights
        # autocast casts as one bf16 copy, made at its STEP, instead of each in-flight microbatch holding autocast's own
        # (versions.py); bf16_versions False keeps autocast's per-microbatch casts (the versions' bit-for-bit reference)
        self.bf16 = self.bf16_versions = recipe.training.bf16
        # the weights the stage's modules read now: one version's (``_bind``), swapped in when a forward (or a
        # recomputing backward) needs another version, not per microbatch; swapped out before a step's result goes
        # to the caller and when a window ends, so nothing outside the actions sees them
        self._bound: dict[str, torch.Tensor] | None = None
        self._binding = ExitStack()
        self.weight_swaps = 0  # times the stage's modules were pointed at another version's weights (_bind)
        # on CUDA, F/B/STEP run asynchronously: their time is the GPU's, read from events (the profile would
        # otherwise show launch times and put the GPU time into the receives)
        self.gpu_timer = GpuTimer() if self.device.type == "cuda" else None
        self.nonfinite_skipped = 0
        self.stopped = False  # the last ``run`` ended early, at a stop every rank agreed to
        self._timeouts = "init"  # the groups and waits were made with init_timeout_s (_use_timeouts)
        self.stepped = False  # this rank has run a STEP: init_timeout_s is over for good
        self.peak_inflight = 0
        self.track_memory = False  # count saved activation bytes (memory_report); off in training: it costs a hook per tensor
        self.mem = {"activations": 0, "peak_activations": 0, "pending_grads": 0, "accumulating": 0, "peak_grad_sets": 1,
                    "casts": 0, "peak_casts": 0, "peak_transfers": 0, "ef_copy": 0}
        # measured time and count per action kind (ActionType is a str enum: "F" finds ActionType.F)
        self.action_seconds: dict[ActionType, float] = defaultdict(float)
        self.action_counts: dict[ActionType, int] = defaultdict(int)
        self._handlers = {T.F: self._do_forward, T.B: self._do_backward, T.I: self._do_backward_input,
                          T.W: self._do_backward, T.SEND_ACT: self._do_send_act,
                          T.RECV_ACT: self._do_recv_act, T.SEND_GRAD: self._do_send_grad,
                          T.RECV_GRAD: self._do_recv_grad, T.VOCAB: self._do_vocab, T.REDUCE: self._do_reduce,
                          T.STEP: self._do_step}

    # ------------------------------------------------------------------ the stream
    def run(self, batches: Iterable[torch.Tensor] | None, first_step: int, num_steps: int) -> Iterator[StepResult]:
        """Run steps [first_step, first_step + num_steps), pulling one ``(m, microbatch_size, seq_len)`` batch per
        step from ``batches``; yields each step's result, in order, once every stage has applied it. The pipeline
        is drained when the generator is exhausted. A middle stage uses no ids, so it may pass None: the recipe
        gives the number of microbatches, and it then reads no data at all."""
        if batches is None:
            if self.first or self.last:
                raise ValueError("pipeline: the first and the last stage need batches (input ids, labels)")
            rp = self.recipe.pipeline
            w = _Window(first_step, rp.num_microbatches, None, (rp.num_microbatches, rp.microbatch_size,
                                                                self.recipe.data.seq_len), end_step=first_step + num_steps)
        else:
            batches = iter(batches)
            head = next(batches)
            w = _Window(first_step, head.shape[0], batches, tuple(head.shape), data={first_step: head},
                        end_step=first_step + num_steps)
        self.stopped = False
        self._use_timeouts("drain" if self.stepped else "init")  # until this rank's first STEP of the stream
        actions = self._window_actions(w, num_steps)
        try:
            yield from self._run_window(w, actions)
        finally:
            self._unbind()

    def _run_window(self, w: _Window, actions: Iterator[Action]) -> Iterator[StepResult]:
        handlers, secs, counts, pending = self._handlers, self.action_seconds, self.action_counts, self.reports.pending
        reducing, reducer, on_gpu = self.reducer.jobs, self.reducer, self.gpu_timer is not None
        clock, profiling = time.perf_counter, torch.autograd._profiler_enabled
        for a in actions:
            with record_function(profiler_label(a)) if profiling() else UNLABELLED:
                if on_gpu and a.type in DEVICE_TIMED:
                    self.gpu_timer.start(a.type)
                    handlers[a.type](a, w)
                    self.gpu_timer.stop()
                else:
                    t0 = clock()
                    handlers[a.type](a, w)
                    secs[a.type] += clock() - t0
            counts[a.type] += 1
            if self.track_memory:
                m = self.mem
                m["peak_transfers"] = max(m["peak_transfers"], transfer_bytes(w.micro.values(), w.prefetch.values()))
            if reducing:  # issue a reduction's next phase once the previous one has completed
                reducer.poll()
            if pending:
                ready = self.reports.ready()
                if ready:
                    self._unbind()
                    yield from ready
        self._unbind()
        self.p2p.drain()
        self.versions.check_released()
        self.versions.settle()
        if on_gpu:
            self.gpu_timer.collect(secs)
        yield from self.reports.drain()
        self._use_timeouts("drain" if self.stepped else "init")  # what follows a drain: a checkpoint, an evaluation

    def train_steps(self, batches: list[torch.Tensor], first_step: int) -> list[StepResult]:
        """``run`` over a list, collected (drained at the end)."""
        return list(self.run(batches, first_step, len(batches)))

    def _actions(self, w: _Window, num_steps: int) -> Iterator[Action]:
        return self.schedule.stage_actions(self.topo.stage, self.recipe.pipeline.num_stages, w.m, num_steps,
                                           w.first_step, self.recipe.pipeline.extra_warmup,
                                           vocab_parallel=self.vocab_parallel)

    def _window_actions(self, w: _Window, num_steps: int) -> Iterator[Action]:
        """The window's actions, cut short after step s when the stop vote of step s - STOP_LAG says stop."""
        seen, done = w.first_step - 1, 0
        for a in self._actions(w, num_steps):
            if a.step > seen:  # this rank's first action of step a.step
                seen = a.step
                if seen + 1 < w.end_step and seen - STOP_LAG >= w.first_step and self.reports.stop_vote(seen - STOP_LAG):
                    yield from self._stopped_after(seen, done, w, num_steps)
                    return
            yield a
            done += 1

    def _stopped_after(self, last: int, done: int, w: _Window, num_steps: int) -> Iterator[Action]:
        """The rest of the window that ends after step ``last``, whose list begins with the ``done`` actions run."""
        short = self._actions(w, last + 1 - w.first_step)
        for ran, planned in zip(itertools.islice(self._actions(w, num_steps), done), itertools.islice(short, done)):
            if ran != planned:
                raise RuntimeError(f"pipeline: stopping after step {last}, stage {self.topo.stage} has run {ran}, which "
                                   f"the shorter window does not run there ({planned}); schedule "
                                   f"{self.schedule.name!r} cannot stop early")
        w.end_step = last + 1
        self.stopped = True
        yield from short

    def _use_timeouts(self, phase: str) -> None:
        """The waits' budget for a phase of the run. ``init``: until the run's first STEP, everything waits up to
        ``init_timeout_s`` (setting up, compiling, the data's first read). ``steady``: once this rank has run a STEP
        of the stream, receives wait ``p2p_timeout_s`` for a neighbour and all-reduces ``collective_timeout_s``, so
        that a rank that hangs mid-run ends the job within about two minutes. ``drain``: what follows a drain after
        the run's first step (a checkpoint, an evaluation, the first step of the next stream) waits
        ``checkpoint_timeout_s``, the default process group's collectives too (the gathers of a save, its barrier),
        as torchtitan shortens every timeout after the first step. The process groups' own timeouts, which NCCL's
        watchdog enforces, follow the same rule."""
        if phase == self._timeouts:
            return
        rc = self.recipe.pipeline
        p2p, coll = {"init": (rc.init_timeout_s, rc.init_timeout_s), "steady": (rc.p2p_timeout_s, rc.collective_timeout_s),
                     "drain": (rc.checkpoint_timeout_s, rc.checkpoint_timeout_s)}[phase]
        self.p2p.set_timeout(timedelta(seconds=p2p))
        self.reducer.timeout = self.reports.timeout = timedelta(seconds=coll)
        self.groups.set_timeouts(timedelta(seconds=coll), p2p=timedelta(seconds=p2p))
        if phase != "steady" and dist.is_initialized():  # the checkpoint's and evaluation's gathers and barriers
            set_default_group_timeout(timedelta(seconds=coll))
        self._timeouts = phase

    def agree_stop(self) -> bool:
        """At a drain point: whether a stop signal reached any rank (collective, on the report group)."""
        vote = torch.tensor([1.0 if supervision.stop_requested() else 0.0], dtype=torch.float64)
        try:
            dist.all_reduce(vote, group=self.groups.report)
        except RuntimeError as e:  # a rank silent at the drain point: named, as a step's report names it
            raise self.reports.failure("the drain point's stop vote", e) from None
        return bool(vote.tolist()[0] > 0)

    def _batch(self, w: _Window, k: int) -> torch.Tensor | None:
        if w.batches is None:  # a middle stage: no data
            return None
        b = w.data.get(k)
        if b is None:
            b = next(w.batches)
            if self.device.type == "cuda" and not b.is_pinned():  # a copy from pageable memory would make the host
                b = b.pin_memory()  # wait for the stream (the trainer's prefetcher pins off the critical path)
            w.data[k] = b
            if tuple(b.shape) != w.shape:
                raise ValueError(f"pipeline: every step's batch must have one shape between drain points "
                                 f"(step {w.first_step}: {w.shape}, step {k}: {tuple(b.shape)})")
        return b

    # ------------------------------------------------------------------ actions
    def _do_forward(self, a: Action, w: _Window) -> None:
        k, i = a.step, a.microbatch
        mb = w.micro.get((k, i))
        if mb is None:
            mb = w.micro[(k, i)] = _Micro(a.version)
        mb.version = a.version
        w.step_version.setdefault(k, a.version)
        batch = self._batch(w, k)
        if i == w.m - 1:
            w.data.pop(k, None)  # the step's last forward: its batch is no longer needed here
        ids = batch[i].to(self.device, non_blocking=True) if self.first or self.last else None
        out = self._forward(mb, ids)
        mb.hold = self.versions.hold(a.version)
        if self.track_memory:
            self.mem["activations"] += mb.saved_bytes - mb.cast_bytes
            self.mem["casts"] += mb.cast_bytes
            self.mem["peak_activations"] = max(self.mem["peak_activations"], self.mem["activations"])
            self.mem["peak_casts"] = max(self.mem["peak_casts"], self.mem["casts"])
            self.peak_inflight = max(self.peak_inflight, sum(self.versions.inflight.values()))
        if self.last and self.vocab_parallel:  # the loss is the VOCAB pass's
            h, mb.loss = out if isinstance(out, tuple) else (out, None)
            mb.outputs, mb.labels = [h], ids
        elif self.last:
            mb.loss = out
            s = w.loss_sums.get(k)
            # float64 on the device: no host sync per microbatch
            w.loss_sums[k] = out.detach().double() if s is None else s + out.detach()
        else:
            mb.outputs = list(out) if isinstance(out, (tuple, list)) else [out]

    def _do_backward_input(self, a: Action, w: _Window) -> None:
        """I: the input gradient of (k, i) only, for its SEND_GRAD; the weight gradient waits for its W."""
        mb = w.micro[(a.step, a.microbatch)]
        self._recompute_from(mb)
        self._backward_input(mb, w.m)

    def _do_backward(self, a: Action, w: _Window) -> None:
        """B, or the W that completes a split backward: the microbatch's weight gradient, accumulated."""
        mb = w.micro[(a.step, a.microbatch)]
        done = w.backwards.get(a.step, 0)
        last = done == w.m - 1
        # the step's gradients become final during its last B: its reduction may start inside it, from hooks on the
        # leaves' accumulation (a W sets .grad itself: reduced at REDUCE)
        if last:
            self._settle_vocab_grad(w, a.step, mb.version)
        hooked = last and a.type == T.B and self.reducer.arm(a.step, self.versions.leaves_for(mb.version),
                                                              final=(self.shard,) if self.shard else ())
        self._recompute_from(mb)
        if a.type == T.W:  # weight_gradients takes each gradient from autograd: none added in place
            self._backward_weight(mb)
        else:
            self.versions.add_in_place.on = not hooked
            try:
                self._backward_pass(mb, w.m)
            finally:
                self.versions.add_in_place.on = False
        if last:
            w.backwards.pop(a.step, None)
            self.reducer.after_backward()
        else:
            w.backwards[a.step] = done + 1
        mb.hold.release()
        if self.track_memory:
            self.mem["activations"] -= mb.saved_bytes - mb.cast_bytes
            self.mem["casts"] -= mb.cast_bytes
            self.mem["accumulating"] = 1
            self._count_grad_sets()
        mb.done = True
        if self.first or mb.sent:
            del w.micro[(a.step, a.microbatch)]

    def _do_vocab(self, a: Action, w: _Window) -> None:
        """VOCAB: this stage's rows of the output layer and loss for microbatch (k, i), forward and backward at once,
        a collective of the replica's stages (``vocab_pass``): the shard's gradient accumulates into the version's
        leaf as a B's does; on the last stage the loss is counted and the final hidden states' gradient kept for
        its B. The last stage's hidden states and labels reach the others inside the pass (a middle stage reads no
        data); they arrive in buffers made once per window."""
        leaf = self.versions.leaves_for(a.version)[self.shard]
        weight = self.versions.buffers[a.version][self.shard]  # the version's bf16 copy where held so, else fp32
        grad = w.vocab_grads.get(a.step)
        if grad is None:  # one per step, not in the leaf: a VOCAB of the next step may come before this one's REDUCE
            grad = w.vocab_grads[a.step] = torch.zeros(leaf.shape, dtype=leaf.dtype, device=leaf.device)
        dtype, p = self.params[self.shard].dtype, self.topo.num_stages
        if self.last:
            mb = w.micro[(a.step, a.microbatch)]
            hidden, labels = mb.outputs[0].detach().to(dtype).contiguous(), mb.labels
            mb.labels = None
        else:
            if w.vocab_inputs is None:
                _, mbs, seq = w.shape
                w.vocab_inputs = (torch.empty((mbs, seq, weight.shape[1]), dtype=dtype, device=self.device),
                                  torch.empty((mbs, seq), dtype=torch.long, device=self.device))
            hidden, labels = w.vocab_inputs
        rows = self.stage.vocab.ranges[self.topo.stage]
        with autocast(self.bf16):
            loss, dh = vocab_pass(hidden, labels, weight.detach(), rows, self.groups.vocab, self.topo.rank_of(p - 1),
                                  grad, grad_scale=1.0 / w.m)
        if self.last:
            mb.grad_from_next = [dh.to(mb.outputs[0].dtype)]
            if mb.loss is not None:
                loss = loss + mb.loss.detach()  # the model's loss: its cross-entropy + coef * router aux loss
            s = w.loss_sums.get(a.step)
            w.loss_sums[a.step] = loss.double() if s is None else s + loss

    def _settle_vocab_grad(self, w: _Window, step: int, version: int) -> None:
        """Before the step's last backward (where its reduction may start) or its REDUCE: the shard's gradient of the
        step's VOCABs, all run by then, into the version's leaf. Kept apart until now because with the deeper warm-up
        (``records._vocab_passes``) a VOCAB of step k + 1 can run before REDUCE{k}, and 2BW's steps 0 and 1 (a sync
        start's K and K + 1) use one version: its leaf would mix the two steps' gradients."""
        grad = w.vocab_grads.pop(step, None)
        if grad is not None:
            leaf = self.versions.leaves_for(version)[self.shard]
            leaf.grad = grad if leaf.grad is None else leaf.grad.add_(grad)

    def _do_send_act(self, a: Action, w: _Window) -> None:
        self.p2p.send(w.micro[(a.step, a.microbatch)].outputs, self.topo.stage + 1, with_header=not w.act_header_sent)
        w.act_header_sent = True

    def _do_recv_act(self, a: Action, w: _Window) -> None:
        mb = w.micro.get((a.step, a.microbatch))
        if mb is None:
            mb = w.micro[(a.step, a.microbatch)] = _Micro(-1)
        mb.inputs = self._receive(w, T.RECV_ACT, (a.step, a.microbatch), self.topo.stage - 1, None)

    def _do_recv_grad(self, a: Action, w: _Window) -> None:
        mb = w.micro[(a.step, a.microbatch)]
        like = [o for o in mb.outputs if o.is_floating_point()]
        mb.grad_from_next = self._receive(w, T.RECV_GRAD, (a.step, a.microbatch), self.topo.stage + 1, like)

    def _do_send_grad(self, a: Action, w: _Window) -> None:
        mb = w.micro[(a.step, a.microbatch)]
        self.p2p.send(mb.grad_to_prev, self.topo.stage - 1, with_header=False)
        mb.grad_to_prev, mb.sent = None, True
        if mb.done:
            del w.micro[(a.step, a.microbatch)]

    def _do_reduce(self, a: Action, w: _Window) -> None:
        version = w.step_version.pop(a.step)
        self._settle_vocab_grad(w, a.step, version)  # (done at the step's last backward; here if none ran on this stage)
        leaves = self.versions.leaves_for(version)
        grads = {}
        for n, leaf in leaves.items():
            grads[n] = leaf.grad if leaf.grad is not None else torch.zeros_like(leaf)
            leaf.grad = None
        self.reducer.submit(a.step, grads)
        if self.track_memory:
            self.mem["accumulating"], self.mem["pending_grads"] = 0, self.mem["pending_grads"] + 1
            self._count_grad_sets()

    def _do_step(self, a: Action, w: _Window) -> None:
        k = a.step
        grads, norm = self.reducer.result(k)  # on the device
        cfg = self.recipe.training
        lr = self.optimizer.param_groups[0]["lr"]
        if cfg.on_nonfinite == "skip":  # skipping needs the decision on the host before the step: its one read
            norm = float(norm)
            finite = finite_step(k, norm, cfg.on_nonfinite)
        else:  # stop: nothing waits for the device here; a non-finite norm ends the run when step k's report lands
            finite = True
        self.versions.prepare_update()
        if self.track_memory and has_correction(self.optimizer):
            # the correction clones every parameter with a gradient for the step (optim/ef.py: ``transient``)
            self.mem["ef_copy"] = max(self.mem["ef_copy"], sum(g.numel() * g.element_size() for g in grads.values()))
        if finite:
            if cfg.max_grad_norm and grads:  # the clip in one kernel, its coefficient where the norm is
                coef = cfg.max_grad_norm / (norm + 1e-6)
                if not isinstance(coef, float):  # float64 (the norm's sum): in the gradients' dtype, or CUDA's
                    # foreach kernel, which needs one dtype, falls back to one multiply per tensor
                    coef = coef.clamp(max=1.0).to(next(iter(grads.values())).dtype)
                torch._foreach_mul_(list(grads.values()), min(1.0, coef) if isinstance(coef, float) else coef)
            for n, g in grads.items():  # ZeRO-1: the owned ones; the optimizer skips a tensor without a gradient
                self.params[n].grad = g
            self.optimizer.step()
            self.scheduler.step()
            for prm in self.params.values():
                prm.grad = None
        else:
            self.nonfinite_skipped += 1
        if finite and self.owner_of is not None:
            self._broadcast_new_version()
        else:
            self.versions.finish_update()
        if self.track_memory:
            self.mem["pending_grads"] -= 1
        loss = w.loss_sums.pop(k) / w.m if self.last else None
        values = learned_values(self.optimizer)  # ef_lambda: learned, one per group
        lam = torch.stack([values[i] for i in self.lam_reported]).sum() if values and self.lam_reported else None
        self.reports.post(k, loss, norm, lr, finite, lam, len(self.lam_reported) if values else 0,
                          log_norm=self.global_norm)
        if self._timeouts != "steady":  # this rank's first step of the stream is done
            self.stepped = True
            self._use_timeouts("steady")

    def _broadcast_new_version(self) -> None:
        """ZeRO-1: each owner sends its tensors' new weights to the other replicas (in buckets, in the same order on
        each, at this STEP); a replica waits for them, and makes the version's bf16 copies, before its first use of
        it."""
        received = self.reducer.broadcast_from_owners({n: prm.data for n, prm in self.params.items()
                                                        if n in self.owner_of})

        def settle():
            received()
            self.versions.finish_update()
        self.versions.pending[self.versions.latest] = settle

    # ------------------------------------------------------------------ compute
    def _forward(self, micro: _Micro, ids: torch.Tensor | None):
        if self.first:
            arg = ids
        else:
            for t in micro.inputs:
                if t.is_floating_point():
                    t.requires_grad_()
            arg = micro.inputs[0] if len(micro.inputs) == 1 else tuple(micro.inputs)
        kwargs = {"labels": ids} if self.last and ids is not None and not self.vocab_parallel else None
        if self.bf16_versions and self.versions.cast is None:
            casts = find_casts(self.stage, self.versions.leaves_for(micro.version), arg, kwargs)
            # the shard of the output layer: read by the VOCAB passes' GEMMs in bf16, held so per version
            self.versions.use_bf16(casts | ({self.shard} if self.shard else set()))
        self._bind(micro.version)
        if not self.track_memory:
            with autocast(self.bf16):
                return self.stage(arg, **(kwargs or {}))
        weights = {b.untyped_storage().data_ptr() for buf in self.versions.buffers.values() for b in buf.values()}
        seen: set = set()

        def pack(t):  # count the activation bytes autograd keeps for this microbatch's backward
            key = storage_key(t)
            if key[0] not in weights and key not in seen:
                seen.add(key)
                micro.saved_bytes += t.untyped_storage().nbytes()
                if is_weight_cast(t):
                    micro.cast_bytes += t.untyped_storage().nbytes()
            return t

        # activation checkpointing keeps each layer's inputs outside the saved tensors: counted by pre-hooks
        hooks = checkpoint_input_hooks(self.stage, pack) if self.recipe.training.gradient_checkpointing else []
        try:
            with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), autocast(self.bf16):
                return self.stage(arg, **(kwargs or {}))
        finally:
            for h in hooks:
                h.remove()

    def _bind(self, version: int) -> None:
        """Make the stage's modules read ``version``'s weights (its leaves, and the bf16 copies of the names held in
        bf16) until :meth:`_unbind`: the swap ``functional_call`` makes per call (every parameter of the stage set
        and restored, about 1.7 ms of host for 290 tensors), made here only when the version changes, about once
        per step, not once per microbatch. Keyed on the version's tensors, not its number: a cast decision or a
        checkpoint load rebuilds them."""
        weights = self.versions.compute_for(version)
        if weights is self._bound:
            return
        self._unbind()
        self._binding.enter_context(_reparametrize_module(self.stage, weights, tie_weights=True, strict=False))
        self._bound = weights
        self.weight_swaps += 1

    def _unbind(self) -> None:
        """The stage's own Parameters back in its modules (a checkpoint, an export or an evaluation reads them)."""
        if self._bound is not None:
            self._bound = None
            self._binding.close()

    def _recompute_from(self, micro: _Micro) -> None:
        """Before a backward: with activation checkpointing the layers recompute their forward inside it, from the
        weights the stage's modules read then, so those must be the microbatch's own version's, as in its forward
        (the newest may be another by now: 2BW, PipeDream)."""
        if self.recipe.training.gradient_checkpointing:
            self._bind(micro.version)

    def _roots(self, micro: _Micro, m: int) -> tuple[list[torch.Tensor], list[torch.Tensor] | None]:
        """(tensors, their gradients) a microbatch's backward starts from: the loss, or the outputs the next stage
        sent gradients for."""
        if self.last and not self.vocab_parallel:
            return [micro.loss / m], None
        if self.last:  # the final hidden states, with the gradient the VOCAB pass reduced here; the router aux term
            h = micro.outputs[0]
            if micro.loss is None:
                return [h], micro.grad_from_next
            aux = micro.loss / m
            return [h, aux], [micro.grad_from_next[0], torch.ones_like(aux)]
        floats = [o for o in micro.outputs if o.is_floating_point()]
        pairs = [(o, g) for o, g in zip(floats, micro.grad_from_next) if o.requires_grad]
        return [o for o, _ in pairs], [g for _, g in pairs]

    def _backward_pass(self, micro: _Micro, m: int) -> None:
        roots, grads = self._roots(micro, m)
        torch.autograd.backward(roots, grads)
        if not self.first:
            micro.grad_to_prev = [
                t.grad if t.grad is not None else torch.zeros_like(t) for t in micro.inputs if t.is_floating_point()
            ]
        micro.inputs, micro.outputs = [], [o.detach() for o in micro.outputs]

    def _backward_input(self, micro: _Micro, m: int) -> None:
        """The first half of a split backward (torch.distributed.pipelining's own ``stage_backward_input``): the
        gradient to the stage's inputs, keeping in ``weight_pass`` the graph's nodes where the weight gradients
        branch off, with the gradients that reached them, for :meth:`_backward_weight`. The first stage has no
        input to send a gradient to: its whole backward waits for the W, as in torch's zero-bubble schedules."""
        roots, grads = self._roots(micro, m)
        inputs = [t for t in micro.inputs if t.is_floating_point()]
        if self.first or not inputs:
            micro.weight_pass = (roots, grads, None)
        else:
            leaves = list(self.versions.leaves_for(micro.version).values())
            dinputs, groups = stage_backward_input(roots, grads, inputs, iter(leaves))
            micro.grad_to_prev = [g if g is not None else torch.zeros_like(t) for t, g in zip(inputs, dinputs)]
            micro.weight_pass = (None, None, groups)
        micro.inputs, micro.outputs = [], [o.detach() for o in micro.outputs]

    def _backward_weight(self, micro: _Micro) -> None:
        """The second half: the weight gradients from what the I kept (:func:`weight_gradients`), accumulated into
        the version's leaves as a whole backward accumulates them; the graph is freed."""
        roots, grads, groups = micro.weight_pass
        micro.weight_pass = None
        if groups is None:
            torch.autograd.backward(roots, grads)
        else:
            weight_gradients(self.versions.leaves_for(micro.version).values(), groups)

    def _receive(self, w: _Window, kind: ActionType, key: tuple[int, int], stage: int, like: list | None) -> list[torch.Tensor]:
        """This receive (posted earlier if its shapes were known), then post the next one of its kind."""
        posted = w.prefetch.pop((kind, key), None)
        if posted is not None:
            data = self.p2p.complete(posted)
        else:
            data = self.p2p.recv(stage, like=w.recv_shapes.get(kind, like))
        if kind not in w.recv_shapes:  # shapes are fixed within a window: learned from its first receive
            w.recv_shapes[kind] = [torch.empty(t.shape, dtype=t.dtype, device="meta") for t in data]
        nxt = w.next_micro(key)
        if nxt is not None:
            w.prefetch[(kind, nxt)] = self.p2p.post(stage, w.recv_shapes[kind])
        return data

    # ------------------------------------------------------------------ accounting
    def _count_grad_sets(self) -> None:
        """Gradient sets alive: one accumulating + those reduced and waiting for their STEP (2BW: up to 2)."""
        self.mem["peak_grad_sets"] = max(self.mem["peak_grad_sets"], self.mem["accumulating"] + self.mem["pending_grads"])

    def memory_report(self) -> dict[str, float]:
        """Bytes this stage really held at its peak (with ``track_memory``), per term as the planner plans them
        (``memtrack.stage_memory``)."""
        return stage_memory(self.params, self.optimizer, self.versions, self.mem)

    def profile(self) -> list[dict] | None:
        """Seconds and counts per action kind of every stage so far (collective; the main process gets the list)."""
        return gather_action_times(self.topo, self.action_seconds, self.action_counts)

    def close(self) -> None:
        """Finish what is in flight and release this engine's process groups (before destroying the default one)."""
        self.reducer.close()
        self.p2p.close()
        self.groups.destroy()

    # ------------------------------------------------------------------ eval
    def eval_nll(self, blocks: torch.Tensor, batch_size: int, weights: dict | None = None) -> tuple[float, int]:
        """Forward-only microbatches through the stages with the newest weights (or ``weights``, this stage's tensors
        by name); NLL summed on the last stage (``forward_only.eval_nll``)."""
        return forward_only.eval_nll(self, blocks, batch_size, weights)

    def reload_nll(self, folder: Path, blocks: torch.Tensor, batch_size: int) -> tuple[float, int] | None:
        """The held-out NLL of an exported HF folder, through the pipeline, each stage reading only its own tensors
        (``forward_only.read_export``): checking that the export is the trained model costs a rank one stage's
        weights. None on every rank when a stage cannot be read alone: the caller reloads with ``from_pretrained``."""
        weights = forward_only.read_export(self, folder)
        return None if weights is None else self.eval_nll(blocks, batch_size, weights)

    def scorer(self, folder: Path | None = None) -> forward_only.StageScorer | None:
        """The downstream tasks' scorer through the stages (collective), with the newest weights or those of an
        exported ``folder``; None on every rank when a stage of the folder cannot be read alone."""
        if folder is None:
            return forward_only.StageScorer(self)
        weights = forward_only.read_export(self, folder)
        return None if weights is None else forward_only.StageScorer(self, weights)

    # ------------------------------------------------------------------ state
    def full_state_dict(self) -> dict[str, torch.Tensor] | None:
        """Newest weights merged by name on the main process (collective: every rank calls it)."""
        return stage_state.gather_weights(self.stage, self.topo, self.experts)

    def export_shards(self, folder: Path) -> list[tuple[str, dict[str, int]]] | None:
        """Each stage (data-parallel rank 0) writes its own shard of the HF folder; only names and sizes travel."""
        return stage_state.write_export_shards(self.stage, self.config, self.topo, folder, self.groups.vocab,
                                               self.experts)

    def checkpoint_files(self, stager: Stager) -> list[StagedFile]:
        """This rank's part of a checkpoint, staged (the pipeline must be drained): data-parallel rank 0 of each stage
        its weights, versions and optimizer state; under ZeRO-1 each further replica the optimizer state it owns,
        written by itself, so a checkpoint never gathers a replica's state on another rank. With the experts sharded,
        the first block of replicas gathers their slices (weights, versions, optimizer state) into replica 0's files,
        one tensor at a time, so a checkpoint holds every expert whole. Others: nothing."""
        if self.topo.dp_rank == 0 or self.owner_of is not None or (self.experts is not None and self.experts.block == 0):
            return stage_state.stage_files(stager, self.topo.stage, self.stage, self.optimizer, self.scheduler,
                                           self.versions, {"nonfinite_skipped": self.nonfinite_skipped},
                                           replica=self.topo.dp_rank, experts=self.experts,
                                           zero=self.owner_of is not None)
        return []

    def save(self, tmp: Path) -> None:
        """Write this rank's part of a checkpoint into ``tmp`` now, on this thread (a one-off; a run's saves go
        through the checkpointer's background writer)."""
        stager = Stager()
        ckpt.write_staged(tmp, self.checkpoint_files(stager))
        stager.close()

    def load(self, path: Path) -> None:
        """Restore this stage from a checkpoint of any number of stages (matched by parameter name); on an unchanged
        split this rank reads only its own stage's files."""
        meta = stage_state.load_stage(path, self.stage, self.optimizer, self.scheduler, self.versions,
                                       stage_index=self.topo.stage, experts=self.experts)
        self.nonfinite_skipped = meta["nonfinite_skipped"]
        if self.owner_of is not None:
            keep_owned(self.optimizer, {q for n, q in self.params.items()  # experts: every rank its own
                                         if self.owner_of.get(n, self.topo.dp_rank) == self.topo.dp_rank}, EF_KEY)


def gather_action_times(topo, seconds: dict, counts: dict) -> list[dict] | None:
    """Every stage's seconds and counts per action kind (from data-parallel rank 0), sorted by stage, on the main
    process; None elsewhere (collective)."""
    mine = ({"stage": topo.stage, "seconds": {t.value: s for t, s in seconds.items()},
             "counts": {t.value: c for t, c in counts.items()}} if topo.dp_rank == 0 else None)
    parts = [None] * topo.world_size if topo.is_main else None
    dist.gather_object(mine, parts, dst=0)
    return sorted((x for x in parts if x), key=lambda x: x["stage"]) if topo.is_main else None
