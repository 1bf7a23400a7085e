"""One stage's part of a checkpoint, keyed by parameter name so a run can resume on another split.

A stage writes its newest weights, the older weight versions it still holds (2BW's version in use), its optimizer
state (including the Error-Feedback buffers) keyed by parameter name, the lr scheduler's position and its weight
version counter. Loading reads every stage's files and takes what this stage's parameters need by name, so a
checkpoint of p stages resumes on q stages.
"""
from __future__ import annotations

from pathlib import Path

import torch

from .. import checkpoint as ckpt
from ..lr import continue_schedule
from ..optim.ef import KEY as EF_KEY, ef_state_by_name, ef_state_from_names
from .versions import Versions


def param_names(stage: torch.nn.Module, optimizer: torch.optim.Optimizer) -> list[str]:
    """Parameter names in the optimizer's order (checkpoints key optimizer state by name, not position)."""
    name_of = {id(p): n for n, p in stage.named_parameters()}
    return [name_of[id(p)] for g in optimizer.param_groups for p in g["params"]]


def save_stage(tmp: Path, stage_index: int, stage: torch.nn.Module, optimizer, scheduler, versions: Versions,
               extra: dict) -> None:
    ckpt.save_tensors(tmp / ckpt.stage_file(stage_index), stage.state_dict())
    older = versions.state()
    if older:
        ckpt.save_tensors(tmp / ckpt.stage_versions_file(stage_index), older)
    ckpt.save_state(tmp / ckpt.stage_optimizer_file(stage_index), {
        "optimizer": optimizer.state_dict(), "param_names": param_names(stage, optimizer),
        "scheduler": scheduler.state_dict(), "latest_version": versions.latest, **extra,
    })


def load_stage(path: Path, stage: torch.nn.Module, optimizer, scheduler, versions: Versions) -> dict:
    """Restore this stage from a checkpoint of any number of stages; returns the saved extra fields. The
    optimizer's hyperparameters and Error-Feedback lambda stay the recipe's (the optimizer was built from it)."""
    weights, older, by_name, ef_by_name = {}, {}, {}, {}
    files = ckpt.stage_weight_files(path)
    if not files:
        raise FileNotFoundError(f"{path}: no stage-XX.safetensors; it was not written by a pipelined run "
                                "(resume it with pipeline.schedule: none)")
    meta: dict = {}
    for f in files:
        weights.update(ckpt.load_tensors(f))
        v = ckpt.versions_of(f)
        if v.exists():
            older.update(ckpt.load_tensors(v))
        meta = ckpt.load_state(ckpt.optimizer_of(f))
        osd, names = meta["optimizer"], meta["param_names"]
        for i, n in enumerate(names):
            if i in osd["state"]:
                by_name[n] = osd["state"][i]
        ef_by_name.update(ef_state_by_name(osd, names))
    mine = stage.state_dict()
    missing = [k for k in mine if k not in weights]
    if missing:
        raise KeyError(f"{path}: the checkpoint has no {missing[:5]}; was it written for another model?")
    stage.load_state_dict({k: weights[k] for k in mine}, strict=True)
    sd = optimizer.state_dict()
    names = param_names(stage, optimizer)
    sd["state"] = {i: by_name[n] for i, n in enumerate(names) if n in by_name}
    ef = ef_state_from_names(ef_by_name, names)
    if ef is not None:
        sd[EF_KEY] = ef
    optimizer.load_state_dict(sd)  # the fresh groups: the recipe's hyperparameters; the state by parameter name
    continue_schedule(optimizer, scheduler, meta["scheduler"])  # the saved position on the recipe's schedule
    params = dict(stage.named_parameters())
    versions.load(meta["latest_version"], {k: t for k, t in older.items() if k.split("/", 1)[1] in params})
    return meta
