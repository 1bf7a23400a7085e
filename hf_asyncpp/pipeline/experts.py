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

__all__ = ["ExpertShard", "expert_names", "shard_experts", "gather_expert_slices"]

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
    """The stage's parameter names ``expert_parallel`` shards, checked: the value divides the replicas and every
    sharded tensor's expert count, and the model has a plan transformers shards experts by. Raises ``RecipeError``
    naming ``pipeline.expert_parallel`` otherwise. Empty at ``expert_parallel`` 1."""
    if expert_parallel == 1:
        return []
    field_ = "pipeline.expert_parallel"
    if replicas % expert_parallel:
        raise RecipeError(f"{field_}: {expert_parallel} does not divide the {replicas} data-parallel replicas of a "
                          f"stage (world size / pipeline.num_stages); use a divisor of {replicas}, or 1")
    plan = expert_plan(model)
    styles = set(plan.values())
    model_type = getattr(model.config, "model_type", type(model).__name__)
    if SHARDED_STYLE not in styles or DISPATCH_STYLE not in styles or styles - {SHARDED_STYLE, DISPATCH_STYLE}:
        raise RecipeError(f"{field_}: {expert_parallel}, but the model ({model_type}) has no expert-parallel plan "
                          f"transformers shards fused experts by (its config's base_model_ep_plan: {plan or 'none'}; "
                          f"needed: '{SHARDED_STYLE}' tensors and an '{DISPATCH_STYLE}' module); set it to 1")
    patterns = [_pattern(k) for k, s in plan.items() if s == SHARDED_STYLE]
    names = [n for n, _ in stage.named_parameters() if any(p.fullmatch(n) for p in patterns)]
    for n, p in stage.named_parameters():
        if n in names and p.shape[0] % expert_parallel:
            raise RecipeError(f"{field_}: {expert_parallel} does not divide the {p.shape[0]} experts of {n}; use a "
                              f"divisor of {p.shape[0]} that divides the replicas, or 1")
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
