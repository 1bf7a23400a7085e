"""Expert parallelism inside a stage (``pipeline.expert_parallel``): each MoE layer's experts sharded over a block of
the stage's data-parallel replicas, the routed tokens sent to their experts and back with all-to-alls.

What is transformers' own and what is ours. The model's ``base_model_ep_plan`` names the expert tensors
(``grouped_gemm``: the fused 3-D stacks, sharded on dim 0) and the experts modules (``ep_dispatch_experts``);
transformers' ``EpDispatchExpertsParallel`` installs the experts' forward and ``AllToAllEP`` moves the tokens
(``all_to_all_single_autograd``, whose backward is the reverse exchange). Only the parameter shard is done here
instead of by ``MoEParamShard``: it makes DTensor parameters, and the executor's weight versions swap plain tensors
into the modules (``_reparametrize_module``), so each expert tensor here keeps this rank's contiguous dim-0 slice as
a plain local Parameter, with ``num_experts`` set to the local count and ``_is_expert_parallel`` set, as
``MoEParamShard`` sets them. ``EpDispatchExpertsParallel``'s forward finds no DTensor to localise and runs as is.

Layout (``topology.expert_mesh``): a stage's replicas split into consecutive blocks of ``expert_parallel``; within a
block rank e holds experts [e * E / ep, (e + 1) * E / ep) of every MoE layer of the stage. The all-to-alls run on the
block's own group (``Groups.experts["ep"]``), at the same actions on every rank of it (the replicas of a stage run
the same action list); nothing else uses that group, so no reduction posted asynchronously can interleave with them.

Gradients (``pipeline/reducer.py``): a rank's expert gradient is already summed over the tokens of every replica of
its block (the all-to-all's backward brings them), so it is not all-reduced over the block; it is summed over the
replicas holding the same shard (other blocks, ``Groups.experts["ep_replicas"]``) and divided by the replica count,
which is the data-parallel mean the dense gradients get. The global grad norm counts each expert once (on the first
block) and each dense tensor once (on replica 0).

Host cost: ``AllToAllEP`` reads the per-rank split sizes to the host once per MoE layer and forward (a
``.tolist()``, one device sync): ``all_to_all_single`` takes its split sizes as host integers, and the receive
buffer's size must be known before the collective is posted. The backward reuses them (no further read).
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn
from transformers.distributed.expert_parallel import EpDispatchExpertsParallel

from ..errors import RecipeError
from ..plan.memory import check_expert_parallel

__all__ = ["ExpertShard", "expert_names", "shard_experts", "gather_expert_slices", "gather_expert_state",
           "take_local_rows"]

SHARDED_STYLE, DISPATCH_STYLE = "grouped_gemm", "ep_dispatch_experts"


@dataclass
class ExpertShard:
    """This rank's experts: which of the stage's tensors are sharded and where its slice sits."""

    names: frozenset[str]  # the stage's expert tensors (dim 0 sharded), by parameter name
    size: int  # pipeline.expert_parallel: ranks sharing one layer's experts
    rank: int  # this rank's place in its block (its slice's index)
    replicas: int  # the stage's data-parallel replicas (blocks = replicas // size)
    dp_rank: int  # this rank's replica
    global_rows: dict[str, int] = field(default_factory=dict)  # name -> dim 0 of the unsharded tensor (the experts)
    group: object = None  # the block: the tokens' all-to-alls, the gathers of an export
    replica_group: object = None  # the replicas holding the same shard (None when the block is every replica)

    @property
    def counted(self) -> bool:
        """Whether this rank's expert gradients count in the grad norm: those of the first block (each shard once)."""
        return self.block == 0

    @property
    def block(self) -> int:
        """This rank's block of replicas (0 .. replicas // size - 1)."""
        return self.dp_rank // self.size

    def local_slice(self, name: str) -> slice:
        """The dim-0 rows of ``name``'s unsharded tensor this rank holds."""
        rows = self.global_rows[name] // self.size
        return slice(self.rank * rows, (self.rank + 1) * rows)


def _pattern(key: str) -> re.Pattern:
    """A plan key (``model.layers.*.mlp.experts``) as a regex on module/parameter names (``*``: a layer index)."""
    return re.compile(re.escape(key).replace(r"\*", r"\d+"))


def expert_plan(model: nn.Module) -> dict[str, str]:
    """The model's expert-parallel plan by full name (transformers composes it from the config's
    ``base_model_ep_plan`` and the base model prefix), or {} for a model without one."""
    return dict(getattr(model, "_ep_plan", None) or {})


def expert_names(model: nn.Module, stage: nn.Module, expert_parallel: int, replicas: int) -> list[str]:
    """The stage's parameter names ``expert_parallel`` shards, checked: the value divides the replicas and the experts
    (the planner's own check, ``plan.memory.check_expert_parallel``), and the model has a plan transformers shards
    experts by. Raises ``RecipeError``
    naming ``pipeline.expert_parallel`` otherwise. Empty at ``expert_parallel`` 1."""
    if expert_parallel == 1:
        return []
    check_expert_parallel(expert_parallel, replicas, model.config)  # divides the replicas and the experts
    field_ = "pipeline.expert_parallel"
    plan = expert_plan(model)
    styles = set(plan.values())
    model_type = getattr(model.config, "model_type", type(model).__name__)
    if SHARDED_STYLE not in styles or DISPATCH_STYLE not in styles or styles - {SHARDED_STYLE, DISPATCH_STYLE}:
        raise RecipeError(f"{field_}: {expert_parallel}, but the model ({model_type}) has no expert-parallel plan "
                          f"transformers shards fused experts by (its config's base_model_ep_plan: {plan or 'none'}; "
                          f"needed: '{SHARDED_STYLE}' tensors and an '{DISPATCH_STYLE}' module); set it to 1")
    patterns = [_pattern(k) for k, s in plan.items() if s == SHARDED_STYLE]
    names = [n for n, _ in stage.named_parameters() if any(p.fullmatch(n) for p in patterns)]
    return names


def shard_experts(model: nn.Module, stage: nn.Module, names: list[str], mesh, dp_rank: int) -> ExpertShard:
    """Keep this rank's dim-0 slice of each expert tensor of ``names`` as a plain local Parameter, set each experts
    module's ``num_experts`` to the local count, and route the experts modules' forward through transformers'
    ``EpDispatchExpertsParallel`` with ``AllToAllEP`` on ``mesh["ep"]`` (``topology.expert_mesh``)."""
    ep_mesh, tp_mesh = mesh["ep"], mesh["ep_tp"]
    size, rank = ep_mesh.size(), ep_mesh.get_local_rank()
    modules = dict(stage.named_modules())
    shard = ExpertShard(frozenset(names), size, rank, mesh["ep_replicas"].size() * size, dp_rank,
                        group=ep_mesh.get_group(),
                        replica_group=mesh["ep_replicas"].get_group() if mesh["ep_replicas"].size() > 1 else None)
    for n in names:
        module_name, _, attr = n.rpartition(".")
        module = modules[module_name]
        full = module._parameters[attr]
        shard.global_rows[n] = full.shape[0]
        rows = shard.local_slice(n)
        with torch.no_grad():
            module._parameters[attr] = nn.Parameter(full.detach()[rows].clone(), requires_grad=full.requires_grad)
        module.num_experts = full.shape[0] // size
        module._is_expert_parallel = True
    dispatch = [_pattern(k) for k, s in expert_plan(model).items() if s == DISPATCH_STYLE]
    experts = [m for n, m in modules.items() if any(p.fullmatch(n) for p in dispatch)]
    for module in experts:
        EpDispatchExpertsParallel().install_forward(module, ep_mesh, tp_mesh=tp_mesh, ep_implementation="all_to_all")
    return shard


def gather_expert_slices(tensors: dict[str, torch.Tensor], shard: ExpertShard, dst_rank: int) -> dict[str, torch.Tensor]:
    """The block's slices of each expert tensor in ``tensors`` concatenated on dim 0 on ``dst_rank`` (a global rank of
    the block), in one gather per tensor (collective over the block); {} elsewhere."""
    out = {}
    for n in sorted(t for t in tensors if t in shard.names):
        t = tensors[n].detach().contiguous()
        parts = [torch.empty_like(t) for _ in range(shard.size)] if dist.get_rank() == dst_rank else None
        dist.gather(t, parts, dst=dst_rank, group=shard.group)
        if parts is not None:
            out[n] = torch.cat(parts)
    return out


def gather_expert_state(weights: dict, older: dict, optimizer_state: dict, names: list[str], shard: ExpertShard,
                        ef_key: str, dst_rank: int) -> tuple[dict, dict, dict]:
    """A checkpoint's stage state with every expert whole, on ``dst_rank`` (the stage's replica 0): the weights, the
    older versions (``v{k}/{name}``) and each optimizer and Error-Feedback tensor of an expert parameter's shape
    gathered from the block's ranks and concatenated on dim 0 (collective over the first block; the others return
    what they were given). New dicts: the live optimizer state is never modified."""
    shapes = {n: tuple(weights[n].shape) for n in shard.names if n in weights}
    flat = {f"w/{n}": weights[n] for n in shapes}
    flat.update({f"o/{k}": t for k, t in older.items() if k.split("/", 1)[1] in shapes})
    index = {i: n for i, n in enumerate(names) if n in shapes}
    state = optimizer_state["state"]
    for i, n in index.items():
        for key, t in (state.get(i) or {}).items():
            if torch.is_tensor(t) and tuple(t.shape) == shapes[n]:
                flat[f"s/{i}/{key}"] = t
    ef = optimizer_state.get(ef_key) or {}
    for part in ("prev", "diffs"):
        for i, t in (ef.get(part) or {}).items():
            if int(i) in index and torch.is_tensor(t) and tuple(t.shape) == shapes[index[int(i)]]:
                flat[f"e/{part}/{i}"] = t
    whole = {}
    for key in sorted(flat):  # the same keys, in the same order, on every rank of the block
        t = flat[key].detach().contiguous()
        parts = [torch.empty_like(t) for _ in range(shard.size)] if dist.get_rank() == dst_rank else None
        dist.gather(t, parts, dst=dst_rank, group=shard.group)
        if parts is not None:
            whole[key] = torch.cat(parts)
    if dist.get_rank() != dst_rank:
        return weights, older, optimizer_state
    weights = {**weights, **{k[2:]: t for k, t in whole.items() if k.startswith("w/")}}
    older = {**older, **{k[2:]: t for k, t in whole.items() if k.startswith("o/")}}
    optimizer_state = {**optimizer_state, "state": dict(state)}
    for k, t in whole.items():
        if k.startswith("s/"):
            _, i, key = k.split("/", 2)
            optimizer_state["state"][int(i)] = {**optimizer_state["state"][int(i)], key: t}
    if any(k.startswith("e/") for k in whole):
        ef = optimizer_state[ef_key] = {**ef, "prev": dict(ef.get("prev") or {}), "diffs": dict(ef.get("diffs") or {})}
        for k, t in whole.items():
            if k.startswith("e/"):
                _, part, i = k.split("/", 2)
                key = next(j for j in ef[part] if str(j) == i)
                ef[part][key] = t
    return weights, older, optimizer_state


def take_local_rows(name: str, t, shard: ExpertShard | None, full_rows: int | None = None):
    """A checkpoint's tensor of expert ``name`` as this rank holds it: its dim-0 slice when ``t`` has every expert
    (``full_rows``: the saved tensor's expert count, the unsharded tensor's by default); anything else unchanged."""
    if shard is None or name not in shard.names or not torch.is_tensor(t) or t.dim() == 0:
        return t
    if t.shape[0] != (full_rows or shard.global_rows[name]):
        return t
    return t[shard.local_slice(name)].clone()
