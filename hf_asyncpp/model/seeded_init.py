"""Random initialisation that does not depend on how the model is split, so a rank can build its stage alone.

transformers initialises a model by drawing every tensor in turn from one random stream: a tensor's values depend
on everything drawn before it, so a stage could only get them by building the whole model. Here each module is
initialised by the model's own ``_init_weights`` from a generator seeded by (the run's seed, the module's name), in
transformers' order (children before their parent, so a parent's special init still wins). A tensor several modules
hold (a tied embedding and head, a shared block) takes the values of its first holder in module order, which runs
last. The whole model (``modeling.build_model``) and a stage built alone (``init_stage``) therefore get the same
values, bit for bit (tests/test_stage_local.py), whatever the split.
"""
from __future__ import annotations

import copy
import hashlib

import torch
from transformers import PreTrainedModel


def module_seed(base: int, name: str) -> int:
    return int.from_bytes(hashlib.sha256(f"{base}/{name}".encode()).digest()[:8], "little") & (2**63 - 1)


def _clear_flags(root: torch.nn.Module) -> None:
    """transformers' initializers skip a tensor marked initialised (set when weights are loaded): unmark them."""
    for t in root.parameters():
        if hasattr(t, "_is_hf_initialized"):
            del t._is_hf_initialized


def initializers(root: torch.nn.Module, init_fn) -> dict[str, object]:
    """Per module name, the ``_init_weights`` transformers applies to it: its nearest enclosing ``PreTrainedModel``'s
    (a composite model's sub-models bring their own), ``init_fn`` above the first one."""
    fns: dict[str, object] = {}
    for name, m in root.named_modules():
        parent = name.rsplit(".", 1)[0] if "." in name else ("" if name else None)
        fns[name] = m._init_weights if isinstance(m, PreTrainedModel) else fns.get(parent, init_fn)
    return fns


@torch.no_grad()
def seeded_init(root: torch.nn.Module, init_fn, base: int) -> None:
    """Initialise every module of ``root`` with the model's ``_init_weights`` (``initializers``; ``init_fn`` where
    no sub-model's applies), each from its own seed. The global random state is left as it was."""
    _clear_flags(root)
    modules = list(root.named_modules())
    fns = initializers(root, init_fn)
    devices = sorted({t.device.index or 0 for t in root.parameters() if t.is_cuda})
    with torch.random.fork_rng(devices=devices):
        for name, m in reversed(modules):  # children before parents, as transformers' ``smart_apply``
            if any(t.is_meta for t in m.parameters(recurse=False)):
                continue  # a stand-in for another stage's part
            torch.manual_seed(module_seed(base, name))
            # a part of a module (a stage's rows of the output layer) draws the whole module's values, keeps its own
            m.init_with(fns[name]) if hasattr(m, "init_with") else fns[name](m)


@torch.no_grad()
def init_stage(stage, full_meta: torch.nn.Module, base: int, device) -> list[str]:
    """Materialise ``stage`` (partitioned from ``full_meta``, the model on the meta device) on ``device`` with the
    values :func:`seeded_init` gives the whole model. Returns the names of the stage's parameters no initializer
    wrote (the caller then builds the whole model instead); empty when every value is the whole model's."""
    stage.to_empty(device=device)  # and the non-persistent buffers recomputed
    params = dict(stage.named_parameters(remove_duplicate=False))
    for t in params.values():
        t.fill_(float("nan"))
    seeded_init(stage, stage._init_fn, base)
    # a copy of a tensor an earlier stage holds (a tied head, a shared block): its holder's values, from the holder
    # module initialised on its own with its seed (the holder runs last in the whole model, so its values win)
    for first, copied in getattr(stage, "tied_pairs", ()):
        if copied not in params or first in params:
            continue
        owner_name, attr = first.rsplit(".", 1) if "." in first else ("", first)
        owner = copy.deepcopy(full_meta.get_submodule(owner_name)).to_empty(device=device)
        _clear_flags(owner)
        with torch.random.fork_rng(devices=[device.index or 0] if torch.device(device).type == "cuda" else []):
            torch.manual_seed(module_seed(base, owner_name))
            initializers(full_meta, stage._init_fn)[owner_name](owner)
        params[copied].copy_(getattr(owner, attr))
    for m in stage.modules():  # zeros where a parameter another stage holds is stood in for
        for n in m.__dict__.get("_stand_in_buffers", ()):
            if not getattr(m, n).is_meta:
                getattr(m, n).zero_()
    return [n for n, t in params.items() if t.is_floating_point() and torch.isnan(t).any()]
