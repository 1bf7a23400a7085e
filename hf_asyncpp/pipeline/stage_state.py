"""One stage's part of a checkpoint, keyed by parameter name so a run can resume on another split.

A stage writes its newest weights, the older weight versions it still holds (2BW's version in use), its optimizer
state (including the Error-Feedback buffers) keyed by parameter name, the lr scheduler's position and its weight
version counter. Under ZeRO-1 each further replica writes the optimizer state of the tensors it owns into its own
file, so no replica's state travels to another rank; loading merges them by name. A save hands these files over
staged (:func:`stage_files`: the tensors copied once, the writing left to the background writer). Loading takes what this stage's parameters need by name, so a checkpoint of p stages resumes on
q stages, and reads only the files (and within them the tensors) holding them.
"""
from __future__ import annotations

import copy
from pathlib import Path

import torch
import torch.distributed as dist

from ..model.export import shard_file, write_shard
from ..model.vocab_parallel import assemble, parse_shard
from ..optim.ef import KEY as EF_KEY, ef_state_by_name, ef_state_from_names
from ..optim.lr import continue_schedule
from ..partition import merge_state_dicts
from ..storage import checkpoint_io as ckpt
from ..storage.names import (optimizer_of, optimizer_parts_of, stage_file, stage_optimizer_file,
                             stage_optimizer_part_file, stage_versions_file, stage_weight_files, versions_of)
from ..storage.staging import StagedFile, Stager
from .experts import gather_expert_slices, gather_expert_state, take_local_rows
from .sharding import merge_optimizer_states
from .versions import Versions


def param_names(stage: torch.nn.Module, optimizer: torch.optim.Optimizer) -> list[str]:
    """Parameter names in the optimizer's order (checkpoints key optimizer state by name, not position)."""
    name_of = {id(p): n for n, p in stage.named_parameters()}
    return [name_of[id(p)] for g in optimizer.param_groups for p in g["params"]]


def stage_files(stager: Stager, stage_index: int, stage: torch.nn.Module, optimizer, scheduler, versions: Versions,
                extra: dict, replica: int = 0, experts=None, zero: bool = False) -> list[StagedFile]:
    """This rank's files of the stage, staged in one copy (tensors several files share are copied once). Replica 0
    writes the weights, the older versions and the optimizer file; a further ``replica`` (ZeRO-1, whose optimizer
    holds the state of the tensors it owns only) writes its optimizer state alone. ``experts``
    (``pipeline/experts.ExpertShard``, collective over the first block of replicas): replica 0's files hold every
    expert whole (``gather_expert_state``), so the checkpoint is the same whatever ``expert_parallel`` wrote it and
    resumes onto any; a further replica's optimizer file (ZeRO-1) leaves its experts out. Other replicas of the block
    (without ZeRO-1) write nothing."""
    names = param_names(stage, optimizer)  # (a new list; the scheduler's state dict below: plain values, copied)
    weights, older, osd = stage.state_dict(), versions.state(), optimizer.state_dict()
    if experts is not None and experts.block == 0:
        weights, older, osd = gather_expert_state(weights, older, osd, names, experts, EF_KEY,
                                                  dst_rank=dist.get_rank() - replica)
    if replica:
        if not zero:
            return []
        if experts is not None:  # its experts' state is in replica 0's file, whole
            osd = _without(osd, {i for i, n in enumerate(names) if n in experts.names})
        return [StagedFile(stage_optimizer_part_file(stage_index, replica), "state",
                           {"optimizer": stager.stage(osd), "param_names": names})]
    staged = stager.stage({"weights": weights, "older": older, "optimizer": osd})
    files = [StagedFile(stage_file(stage_index), "tensors", staged["weights"])]
    if older:
        files.append(StagedFile(stage_versions_file(stage_index), "tensors", staged["older"]))
    files.append(StagedFile(stage_optimizer_file(stage_index), "state", {
        "optimizer": staged["optimizer"], "param_names": names, "scheduler": copy.deepcopy(scheduler.state_dict()),
        "latest_version": versions.latest, **extra}))
    return files


def _without(optimizer_state: dict, indices: set[int]) -> dict:
    """An optimizer state dict without the state (and Error-Feedback buffers) of the parameters at ``indices``."""
    out = {**optimizer_state, "state": {i: st for i, st in optimizer_state["state"].items() if i not in indices}}
    ef = optimizer_state.get(EF_KEY)
    if ef:
        out[EF_KEY] = {**ef, **{k: {i: t for i, t in (ef.get(k) or {}).items() if int(i) not in indices}
                                for k in ("prev", "diffs", "lam_of") if k in ef}}
    return out


def save_stage(tmp: Path, stage_index: int, stage: torch.nn.Module, optimizer, scheduler, versions: Versions,
               extra: dict) -> None:
    """Write the stage's files now, on this thread (a one-off checkpoint: tests, benchmarks)."""
    stager = Stager()
    ckpt.write_staged(tmp, stage_files(stager, stage_index, stage, optimizer, scheduler, versions, extra))
    stager.close()


def load_stage(path: Path, stage: torch.nn.Module, optimizer, scheduler, versions: Versions,
               stage_index: int | None = None, experts=None) -> dict:
    """Restore this stage from a checkpoint of any number of stages; returns the saved extra fields. The
    optimizer's hyperparameters and Error-Feedback lambda stay the recipe's (the optimizer was built from it).

    Reads only what this stage needs: a weights file's header says which of our tensors it holds, and only those
    are read, with the same file's older versions and optimizer state; files holding none of ours are never read
    past their header. ``stage_index`` (this rank's stage) is tried first, so on an unchanged split a rank reads
    its own three files and nothing else (at 16 ranks x a 165 GB checkpoint, the difference is the point)."""
    weights, older, by_name, ef_by_name = {}, {}, {}, {}
    files = stage_weight_files(path)
    if not files:
        raise FileNotFoundError(f"{path}: no stage-XX.safetensors; it was not written by a pipelined run "
                                "(resume it with pipeline.schedule: none)")
    own = Path(path) / stage_file(stage_index) if stage_index is not None else None
    mine, params = stage.state_dict(), dict(stage.named_parameters())
    meta: dict = {}
    for f in sorted(files, key=lambda f: f != own):  # our own stage's file first: on the same split, the only one
        if len(weights) == len(mine):
            break
        tf = ckpt.TensorFile(f)
        wanted = [n for n in tf.names if n in mine and n not in weights]
        if not wanted:
            continue
        weights.update(tf.get(wanted))
        v = versions_of(f)
        if v.exists():
            vf = ckpt.TensorFile(v)
            older.update(vf.get([k for k in vf.names if k.split("/", 1)[1] in wanted]))
        if not any(n in params for n in wanted):
            continue  # buffers only: no optimizer state of ours in this stage's file
        meta = ckpt.load_state(optimizer_of(f))
        osd, names = meta["optimizer"], meta["param_names"]
        parts = [ckpt.load_state(p)["optimizer"] for p in optimizer_parts_of(f)]  # ZeRO-1's further replicas
        if parts:
            osd = merge_optimizer_states([osd, *parts], EF_KEY)
        for i, n in enumerate(names):
            if i in osd["state"] and n in wanted:
                by_name[n] = osd["state"][i]
        ef_by_name.update({n: t for n, t in ef_state_by_name(osd, names).items() if n in wanted})
    missing = [k for k in mine if k not in weights]
    if missing:  # an output layer cut otherwise over the stages (vocab_parallel on, off, or another number of stages)
        _recut(files, [k for k in missing if k in params], weights, older, by_name, ef_by_name)
        missing = [k for k in mine if k not in weights]
    if missing:
        raise KeyError(f"{path}: the checkpoint has no {missing[:5]}; was it written for another model?")
    if experts is not None:  # a checkpoint holds every expert whole: this rank's rows of each (expert_parallel)
        full = {n: weights[n].shape[0] for n in experts.names}
        weights = {k: take_local_rows(k, t, experts, full.get(k)) for k, t in weights.items()}
        older = {k: take_local_rows(k.split("/", 1)[1], t, experts, full.get(k.split("/", 1)[1]))
                 for k, t in older.items()}
        by_name = {n: {key: take_local_rows(n, t, experts, full.get(n)) for key, t in st.items()}
                   for n, st in by_name.items()}
        ef_by_name = {n: {key: take_local_rows(n, t, experts, full.get(n)) for key, t in st.items()}
                      for n, st in ef_by_name.items()}
    stage.load_state_dict({k: weights[k] for k in mine}, strict=True)
    sd = optimizer.state_dict()
    names = param_names(stage, optimizer)
    sd["state"] = {i: by_name[n] for i, n in enumerate(names) if n in by_name}
    ef = ef_state_from_names(ef_by_name, names)
    if ef is not None:
        sd[EF_KEY] = ef
    optimizer.load_state_dict(sd)  # the fresh groups: the recipe's hyperparameters; the state by parameter name
    continue_schedule(optimizer, scheduler, meta["scheduler"])  # the saved position on the recipe's schedule
    versions.load(meta["latest_version"], {k: t for k, t in older.items() if k.split("/", 1)[1] in params})
    return meta


def _rows(parts: dict[str, torch.Tensor], base: str, rows: tuple[int, int] | None) -> torch.Tensor:
    whole = assemble(parts)[base]
    return (whole if rows is None else whole[rows[0]:rows[1]]).clone()


def _recut(files: list[Path], names: list[str], weights: dict, older: dict, by_name: dict, ef_by_name: dict) -> None:
    """The tensors ``names`` (this stage's rows of an output layer cut over the stages, ``lm_head.weight@v0:v1``, or
    its whole weight) from a checkpoint that cut it otherwise (whole on its last stage, or rows of another number of
    stages): every saved piece of the same weight is read (its values, older versions and optimizer and
    Error-Feedback state), the pieces put together by rows (``model.vocab_parallel.assemble``) and this stage's rows
    cut out. Optimizer state shaped like the weight is cut by rows; other entries (Adam's step) are the first
    piece's (equal on every stage). Reads each file holding a piece, optimizer state included: a resume onto
    another cut, not the common path."""
    wanted: dict[str, list[tuple[str, tuple[int, int] | None]]] = {}
    for n in names:
        parsed = parse_shard(n)
        base, rows = parsed if parsed else (n, None)
        wanted.setdefault(base, []).append((n, rows))
    for base, targets in wanted.items():
        values, versions, states, efs = {}, {}, {}, {}
        for f in files:
            tf = ckpt.TensorFile(f)
            pieces = [x for x in tf.names if x == base or (parse_shard(x) or ("",))[0] == base]
            if not pieces:
                continue
            values.update(tf.get(pieces))
            v = versions_of(f)
            if v.exists():
                vf = ckpt.TensorFile(v)
                for key in vf.names:
                    version, _, x = key.partition("/")
                    if x in pieces:
                        versions.setdefault(version, {})[x] = vf.get([key])[key]
            saved = ckpt.load_state(optimizer_of(f))
            osd, order = saved["optimizer"], saved["param_names"]
            parts = [ckpt.load_state(p)["optimizer"] for p in optimizer_parts_of(f)]
            if parts:
                osd = merge_optimizer_states([osd, *parts], EF_KEY)
            for i, x in enumerate(order):
                if x in pieces and i in osd["state"]:
                    states[x] = osd["state"][i]
            efs.update({x: e for x, e in ef_state_by_name(osd, order).items() if x in pieces})
        if not values:
            continue
        first = next(iter(values))

        def cut(per_piece: dict, rows):
            """Entries shaped like their piece of the weight, put together and cut; the others the first piece's."""
            out = {}
            for key, t in per_piece[first].items():
                rowwise = all(torch.is_tensor(e.get(key)) and e[key].shape == values[x].shape for x, e in per_piece.items())
                out[key] = _rows({x: e[key] for x, e in per_piece.items()}, base, rows) if rowwise else t
            return out
        for n, rows in targets:
            weights[n] = _rows(values, base, rows)
            for version, pieces_of in versions.items():
                older[f"{version}/{n}"] = _rows(pieces_of, base, rows)
            if len(states) == len(values):
                by_name[n] = cut(states, rows)
            if len(efs) == len(values):
                ef_by_name[n] = cut(efs, rows)


def gather_weights(stage: torch.nn.Module, topo, experts=None) -> dict[str, torch.Tensor] | None:
    """Every stage's newest weights (from data-parallel rank 0) merged by name on the main process, None elsewhere
    (collective). ``experts`` (``pipeline/experts.ExpertShard``): the expert tensors' slices of the first block's
    ranks concatenated on dim 0. For tests and one-process consumers: a run's own exports and evaluations never
    gather."""
    mine = None
    if topo.dp_rank == 0 or (experts is not None and experts.block == 0):
        sd = {n: t.detach().cpu().clone() for n, t in stage.state_dict().items()
              if topo.dp_rank == 0 or n in experts.names}
        mine = (topo.stage, experts.rank if experts is not None else 0, sd)
    parts = [None] * topo.world_size if topo.is_main else None
    dist.gather_object(mine, parts, dst=0)
    if not topo.is_main:
        return None
    stages: dict[int, dict] = {}
    for s, rank, sd in sorted((p for p in parts if p is not None), key=lambda p: p[:2]):  # by stage, then block order
        if s not in stages:
            stages[s] = sd
            continue
        for n, t in sd.items():
            stages[s][n] = torch.cat([stages[s][n], t])
    return merge_state_dicts([stages[s] for s in sorted(stages)])


def write_export_shards(stage: torch.nn.Module, config, topo, folder: Path,
                        vocab_group=None, experts=None) -> list[tuple[str, dict[str, int]]] | None:
    """Each stage (data-parallel rank 0) writes its own shard of an HF folder; only the file names and the tensor
    names and sizes travel to the main process, which writes the index (collective). An output layer cut over the
    stages (``vocab_group``: replica 0's stages) is gathered onto the last stage, which writes it whole under the
    model's name (the one tensor of the export that crosses ranks: the head's weight, once). ``experts``: the first
    block's expert slices are gathered to its rank 0 first, one tensor at a time, so the shard holds every expert, as
    ``from_pretrained`` reads them."""
    mine = None
    sd = stage.state_dict()
    if experts is not None and experts.block == 0:
        sd.update(gather_expert_slices(sd, experts, dst_rank=topo.stage * topo.dp_size))
    if topo.dp_rank == 0:
        name = shard_file(topo.stage, topo.num_stages)
        if getattr(stage, "vocab", None) is not None:
            own = stage.vocab.shard_name(topo.stage)
            rows = sd.pop(own).detach().cpu()
            parts = [None] * topo.num_stages if topo.last else None
            dist.gather_object(rows, parts, dst=topo.rank_of(topo.num_stages - 1), group=vocab_group)
            if topo.last:
                sd[stage.vocab.name] = torch.cat(parts)
        mine = (name, write_shard(sd, config, folder / name))
    parts = [None] * topo.world_size if topo.is_main else None
    dist.gather_object(mine, parts, dst=0)
    return [x for x in parts if x is not None] if topo.is_main else None
