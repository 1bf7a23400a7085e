"""Where this process sits (pipeline stage x data-parallel rank), its device, and the process groups it joins.

``world_size = dp_size * num_stages``; the ranks of one stage are contiguous (rank = stage * dp_size + dp_rank): the
row-major order of torch's ``DeviceMesh`` of shape (num_stages, dp_size) with dimensions ("pp", "dp"), which makes the
pipeline and data-parallel groups (``stage_mesh``). Every group is created collectively, in the same order on every
rank (``make_groups``).
"""
from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.distributed_c10d import _set_pg_timeout

from .schedules.channels import all_channels


@dataclass
class Topology:
    """Where this process sits: ``world_size = dp_size * num_stages``; ranks of a stage are contiguous in dp."""

    rank: int = 0
    world_size: int = 1
    num_stages: int = 1

    @property
    def dp_size(self) -> int:
        return self.world_size // self.num_stages

    @property
    def stage(self) -> int:
        return self.rank // self.dp_size

    @property
    def dp_rank(self) -> int:
        return self.rank % self.dp_size

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def first(self) -> bool:
        return self.stage == 0

    @property
    def last(self) -> bool:
        return self.stage == self.num_stages - 1

    def rank_of(self, stage: int) -> int:
        """The rank of ``stage`` in this process's data-parallel replica."""
        return stage * self.dp_size + self.dp_rank


def one_process_group(pipelined: bool, timeout: timedelta) -> bool:
    """Make the default process group of a pipelined run that no launcher started (``hf-asyncpp train`` with
    ``pipeline.num_stages: 1``, or a resume onto one stage, docs/checkpoints.md): its one process still builds its
    stage's groups (:func:`make_groups`) and gathers over them, and accelerate creates no group for a single
    process. One gloo rank over an in-memory store: nothing to rendezvous with, no port. True when it made the
    group (``Accelerator.end_training`` destroys it); a process with a group already (any launcher) keeps its own."""
    if not pipelined or dist.is_initialized():
        return False
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1, timeout=timeout)
    return True


def timed_out(e: BaseException) -> bool:
    """Whether ``e`` is a collective or transfer that waited past its timeout (gloo's and NCCL's wording)."""
    return isinstance(e, RuntimeError) and "timed out" in str(e).lower()


def silent_ranks(tag: str, wait_s: float = 30.0) -> list[int]:
    """After a collective timed out: the ranks that do not answer now (stopped, hung), to be named in the error.
    Found through the launcher's rendezvous store, which does not go through the process group that hung: every
    rank that got here marks itself under ``tag`` (its own timeout fired too, at about the same moment), and the
    ranks not marked within ``wait_s`` are the silent ones. Empty where there is no store (one process)."""
    try:
        store = dist.distributed_c10d._get_default_store()
    except (RuntimeError, ValueError):
        return []
    world, me = dist.get_world_size(), dist.get_rank()
    keys = [f"hf_asyncpp/answering/{tag}/{r}" for r in range(world)]
    store.set(keys[me], "1")
    deadline = time.monotonic() + wait_s
    while True:
        missing = [r for r in range(world) if not store.check([keys[r]])]
        if not missing or time.monotonic() > deadline:
            return missing
        time.sleep(0.2)


def who_went_silent(tag: str, wait_s: float) -> str:
    """The phrase an error names the silent ranks with (:func:`silent_ranks`): "rank 1 stopped answering", or
    "a rank stopped answering" where none can be told apart (no store, or every rank answered late)."""
    try:
        silent = silent_ranks(tag, wait_s)
    except (RuntimeError, ValueError):  # the store itself is gone (its host died): nothing more to name
        silent = []
    if not silent:
        return "a rank stopped answering"
    return f"rank{'s' if len(silent) > 1 else ''} {', '.join(map(str, silent))} stopped answering"


def local_device() -> torch.device:
    """This process's accelerator (torchrun's LOCAL_RANK picks the GPU), or the CPU."""
    if torch.cuda.is_available():
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)) % torch.cuda.device_count())
    return torch.device("cpu")


@dataclass
class Groups:
    """Process groups, created collectively in the same order on every rank."""

    dp: object = None  # this stage's data-parallel replicas (None without data parallelism): the mesh's "dp"
    pipe: object = None  # the stages of this data-parallel replica: the mesh's "pp"
    mesh: DeviceMesh | None = None  # (pp, dp), whose groups are ``pipe`` and ``dp`` (``stage_mesh``)
    ties: dict = field(default_factory=dict)  # stages sharing tensors (tuple of stage ids) -> group, this rank's only
    report: object = None  # every rank, gloo: per-step results travel here without blocking a stage
    dp_ranks: list = field(default_factory=list)
    # ZeRO-1 (optimizer.shard_across_replicas): the grad norm's sum over the owners, all ranks (global norm) or this
    # stage's replicas (stage-local); its own group: issued when the reduction's previous phase completes, it must
    # not interleave with the dp group's reductions and broadcasts, which each replica issues at fixed actions
    norm: object = None
    # point-to-point: one group per direction between adjacent stages of this replica (``pipeline.channels``),
    # this rank's only
    p2p: dict = field(default_factory=dict)
    # the stages of this replica, for the VOCAB passes of an output layer cut over them (``pipeline.vocab_parallel``):
    # a group of its own, because the reducer's grad-norm all-reduce on ``pipe`` is issued between actions and would
    # otherwise interleave with them
    vocab: object = None
    # expert parallelism (pipeline.expert_parallel > 1, ``expert_mesh``): "ep" carries the routed tokens' all-to-alls
    # of the forward and backward, at fixed actions, and nothing else; "ep_replicas" (the replicas holding the same
    # expert shard, when expert_parallel < replicas) the reducer's expert-gradient sums
    experts: DeviceMesh | None = None

    def _collective(self) -> list:
        ep = self.experts.get_all_groups() if self.experts is not None else []
        return [g for g in {id(x): x for x in (self.dp, self.pipe, self.report, self.norm, self.vocab, *self.ties.values(),
                                               *ep)
                            if x is not None and x is not dist.GroupMember.NON_GROUP_MEMBER}.values()]

    def set_timeouts(self, timeout: timedelta, p2p: timedelta) -> None:
        """The groups' own timeouts from now on (gloo's transport, NCCL's watchdog): ``timeout`` for the collective
        groups, ``p2p`` for the point-to-point ones. Set through torch's ``_set_pg_timeout``, as torchtitan shortens
        them after the first step."""
        for g in self._collective():
            _set_pg_timeout(timeout, g)
        for g in self.p2p.values():
            _set_pg_timeout(p2p, g)

    def destroy(self) -> None:
        mesh = self.mesh.get_all_groups() if self.mesh is not None else []  # with dp = 1 its "dp" too
        mesh += self.experts.get_all_groups() if self.experts is not None else []
        for g in {id(x): x for x in (self.dp, self.pipe, self.report, self.norm, self.vocab, *self.ties.values(),
                                     *self.p2p.values(),
                                     *mesh) if x is not None}.values():
            dist.destroy_process_group(g)


def set_default_group_timeout(timeout: timedelta) -> None:
    """The default process group's timeout from now on (the one accelerate made, which the checkpoint's gathers and
    barriers use), through the same ``_set_pg_timeout`` as :meth:`Groups.set_timeouts`."""
    _set_pg_timeout(timeout, None)


def stage_mesh(topo: Topology, timeout: timedelta) -> DeviceMesh:
    """The device mesh of shape (num_stages, dp_size), dimensions ("pp", "dp"): rank = stage * dp_size + dp_rank is its
    row-major order, so ``mesh["pp"]`` is this rank's pipeline (its replica's stages) and ``mesh["dp"]`` its stage's
    replicas: the currency of FSDP2, tensor parallelism and DTensor checkpoints per stage. Each dimension's groups are
    new ones on the default group's backend with ``timeout``: left to itself, the mesh would reuse the default group
    for a dimension spanning every rank (one stage, or no data parallelism), which ``Groups.destroy`` would then tear
    down and whose collectives could interleave with the default group's, and would create its groups with the
    backend's default timeout instead of ``init_timeout_s``."""
    # one options object per dimension: a NCCL group keeps (and c10d writes its ranks into) the one it was made with
    return init_device_mesh(local_device().type, (topo.num_stages, topo.dp_size), mesh_dim_names=("pp", "dp"),
                            backend_override={"pp": _own_groups(timeout), "dp": _own_groups(timeout)})


def _own_groups(timeout: timedelta):
    """A mesh dimension's backend override: new groups on the default group's backend with ``timeout`` (never the
    default group itself, see :func:`stage_mesh`)."""
    backend = dist.get_backend()
    if backend == "gloo":
        options = dist.ProcessGroupGloo._Options()
    elif backend == "nccl":
        options = dist.ProcessGroupNCCL.Options()
        options.is_high_priority_stream = False  # what new_group gives a NCCL group without options
    else:
        return backend
    options._timeout = timeout  # the mesh passes it on as the group's timeout
    return backend, options


def expert_mesh(topo: Topology, expert_parallel: int, timeout: timedelta) -> DeviceMesh:
    """The expert-parallel mesh of shape (num_stages, dp_size // expert_parallel, expert_parallel, 1), dimensions
    ("pp", "ep_replicas", "ep", "ep_tp"), in the same row-major rank order as :func:`stage_mesh`: a stage's replicas
    split into consecutive blocks of ``expert_parallel`` (dp_rank = block * expert_parallel + ep_rank). ``mesh["ep"]``
    is this rank's expert-parallel group (each holds a different shard; the tokens' all-to-alls run on it),
    ``mesh["ep_replicas"]`` the replicas holding this rank's shard, ``mesh["ep_tp"]`` this rank alone: transformers'
    ``EPImplementation`` takes the group of ranks sharing one batch as a mesh too, and here each replica has its own.
    Every dimension gets groups of its own (``_own_groups``), never the data-parallel group, on which the reducer
    issues its buckets at times that differ between replicas."""
    dp = topo.dp_size
    return init_device_mesh(local_device().type, (topo.num_stages, dp // expert_parallel, expert_parallel, 1),
                            mesh_dim_names=("pp", "ep_replicas", "ep", "ep_tp"),
                            backend_override={d: _own_groups(timeout) for d in ("pp", "ep_replicas", "ep", "ep_tp")})


def make_groups(topo: Topology, tied, timeout: timedelta, p2p_timeout: timedelta | None = None,
                sharded_norm: str | None = None, vocab_parallel: bool = False, expert_parallel: int = 1) -> Groups:
    """``tied``: the sets of stages that hold copies of one tensor (``shared_tensors``' holders). One group per set and
    data-parallel replica sums their gradients. ``timeout``: the collectives' groups; ``p2p_timeout`` (default the
    same): the point-to-point groups (on NCCL their watchdog is what ends a rank whose neighbour went silent).
    ``sharded_norm`` ("global" or "stage"): the optimizer state or the experts are sharded across replicas; make
    ``Groups.norm``. ``vocab_parallel``: the output layer is cut over the stages; make ``Groups.vocab``.
    ``expert_parallel`` > 1: make ``Groups.experts`` (:func:`expert_mesh`)."""
    g = Groups()
    p, dp = topo.num_stages, topo.dp_size
    g.mesh = stage_mesh(topo, timeout)
    g.pipe = g.mesh["pp"].get_group()
    g.dp_ranks = g.mesh["dp"].mesh.tolist()
    if dp > 1:
        g.dp = g.mesh["dp"].get_group()
    for d in range(dp):
        for kind, s in all_channels(p):
            grp = dist.new_group([s * dp + d, (s + 1) * dp + d], timeout=p2p_timeout or timeout)
            if d == topo.dp_rank and topo.stage in (s, s + 1):
                g.p2p[(kind, s)] = grp
    sets = sorted({tuple(sorted(x)) for x in tied})
    for stages in (sets if p > 1 else []):
        for d in range(dp):
            grp = dist.new_group([s * dp + d for s in stages], timeout=timeout)
            if d == topo.dp_rank and topo.stage in stages:
                g.ties[stages] = grp
    if vocab_parallel:
        for d in range(dp):
            grp = dist.new_group([s * dp + d for s in range(p)], timeout=timeout)
            if d == topo.dp_rank:
                g.vocab = grp
    # gloo whatever the default backend: the reports are a few CPU scalars, and a NCCL collective would
    # be ordered on the compute stream
    g.report = dist.new_group(list(range(topo.world_size)), timeout=timeout, backend="gloo")
    if sharded_norm == "global":
        g.norm = dist.new_group(list(range(topo.world_size)), timeout=timeout)
    elif sharded_norm == "stage" and dp > 1:
        for s in range(p):
            grp = dist.new_group([s * dp + d for d in range(dp)], timeout=timeout)
            if s == topo.stage:
                g.norm = grp
    if expert_parallel > 1:
        g.experts = expert_mesh(topo, expert_parallel, timeout)
    return g
