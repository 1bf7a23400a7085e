"""Writing and resuming a run's checkpoints: what goes in one, from which rank, in which order.

``checkpoint.py`` holds the atomic primitives and the file names; this module is the choreography: every rank
writes its engine part and RNG state into a temp dir, the data positions are gathered, the main process adds
config, tokenizer, recipe and ``trainer_state.json``, commits (manifest last), prunes, and pushes when asked.
Resume reverses it, and re-shards the data position when the data-parallel size changed.
"""
from __future__ import annotations

import logging
import random
import shutil
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist

from . import checkpoint as ckpt
from .config import Recipe, RecipeError, save_recipe
from .engine import Engine
from .export import export_engine
from .hub import Pusher, snapshot
from .model_card import card_from_recipe
from .reporting import METRICS, read_metrics
from .topology import Topology

log = logging.getLogger("hf_asyncpp")


@dataclass
class RunState:
    step: int = 0
    tokens: int = 0
    run_id: str = field(default_factory=lambda: uuid.uuid4().hex[:12])
    """The trackers' run id: kept in the checkpoint so a resumed run continues the same tracker run."""


def set_seed(seed: int) -> None:
    random.seed(seed)
    torch.manual_seed(seed)


def rng_state() -> dict:
    return {"python": list(random.getstate()[1]), "python_pos": random.getstate()[2], "torch": torch.get_rng_state()}


def set_rng_state(state: dict) -> None:
    random.setstate((3, tuple(state["python"]), state["python_pos"]))
    torch.set_rng_state(state["torch"])


class Checkpointer:
    """Saves and resumes a run in ``out``; every method is collective (every rank calls it)."""

    def __init__(self, out: Path, recipe: Recipe, topo: Topology, accelerator, tokenizer, pusher: Pusher | None = None):
        self.out, self.recipe, self.topo, self.accelerator, self.tokenizer = out, recipe, topo, accelerator, tokenizer
        self.pusher = pusher  # the main process's background Hub pushes (None elsewhere or without push_to_hub)

    def save(self, state: RunState, engine: Engine, stream) -> Path:
        """Write ``checkpoint-{step}`` (the engine must be drained: every STEP of the steps so far applied)."""
        acc, topo = self.accelerator, self.topo
        tmp = ckpt.temp_dir(self.out, state.step)
        if acc.is_main_process:
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)
        acc.wait_for_everyone()
        engine.save(tmp)
        ckpt.save_state(tmp / ckpt.rng_file(topo.rank), rng_state())
        data_states = [None] * topo.world_size
        if topo.world_size > 1:
            dist.all_gather_object(data_states, stream.state_dict())
        else:
            data_states = [stream.state_dict()]
        acc.wait_for_everyone()
        final = self.out / ckpt.checkpoint_name(state.step)
        if acc.is_main_process:
            engine.config.to_json_file(str(tmp / "config.json"))
            self.tokenizer.save_pretrained(str(tmp / "tokenizer"))
            save_recipe(self.recipe, tmp / "recipe.yaml")
            ckpt.save_json(tmp / ckpt.TRAINER_STATE, {"step": state.step, "tokens": state.tokens, "run_id": state.run_id,
                                                      "data": data_states,
                                                      "world_size": topo.world_size, "num_stages": topo.num_stages,
                                                      "schedule": self.recipe.pipeline.schedule})
            ckpt.commit(tmp, final, {"step": state.step, "world_size": topo.world_size, "num_stages": topo.num_stages})
            log.info("saved %s", final.name)
        self._push(state, engine, final)
        if acc.is_main_process:
            ckpt.prune(self.out, self.recipe.training.save_total_limit)
        acc.wait_for_everyone()
        return final

    def _push(self, state: RunState, engine: Engine, final: Path) -> None:
        """The Trainer's hub_strategy at a save: every_save and after push the model (a loadable HF folder, written
        by every stage), checkpoint also the checkpoint to last-checkpoint/, all_checkpoints each to its own folder.
        Uploads run in the background on the main process; this waits only for the export (collective)."""
        hub = self.recipe.hub
        if not hub.push_to_hub or hub.hub_strategy == "end":
            return
        staging = self.out / ".hub-staging"
        card = card_from_recipe(self.recipe, state.step, state.tokens, read_metrics(self.out / METRICS)) \
            if self.accelerator.is_main_process else None
        folder = export_engine(engine, staging / f"model-{state.step:07d}", tokenizer=self.tokenizer, card=card)
        if self.pusher is None:
            return
        self.pusher.push(folder, commit_message=f"hf_asyncpp: model at step {state.step}", remove_after=True)
        if hub.hub_strategy in ("checkpoint", "all_checkpoints"):
            where = "last-checkpoint" if hub.hub_strategy == "checkpoint" else final.name
            self.pusher.push(snapshot(final, staging / final.name), path_in_repo=where, remove_after=True,
                             commit_message=f"hf_asyncpp: checkpoint at step {state.step}")

    def resume(self, path: Path, engine: Engine, stream) -> RunState:
        return resume(path, engine, stream, self.topo, self.recipe.pipeline.schedule)


def resume(path: Path, engine: Engine, stream, topo: Topology, schedule: str = "none") -> RunState:
    """Restore engine, data position and RNG. A pipelined checkpoint may resume on another number of stages
    (weights, optimizer/EF state and weight versions are matched by parameter name); with another
    data-parallel size the data order cannot be the uninterrupted one, which is logged."""
    meta = ckpt.load_json(path / ckpt.TRAINER_STATE)
    written = meta.get("schedule", schedule)
    if written != schedule:
        raise RecipeError(f"pipeline.schedule: {path} was written by a {written!r} run; resume it with the same schedule "
                          f"(this run uses {schedule!r}; their update semantics differ)")
    same = meta["world_size"] == topo.world_size and meta["num_stages"] == topo.num_stages
    engine.load(path)
    old_dp = meta["world_size"] // meta["num_stages"]
    if old_dp == topo.dp_size:
        stream.load_state_dict(meta["data"][topo.dp_rank])
    else:
        states = meta["data"][:old_dp]
        blocks = sum(s["blocks"] for s in states) // topo.dp_size
        stream.load_state_dict({"epoch": max(s["epoch"] for s in states), "blocks": blocks})
        log.warning("resumed with %d data-parallel ranks instead of %d: each rank skips %d blocks of its new shard; the data "
                    "order differs from an uninterrupted run", topo.dp_size, old_dp, blocks)
    rng = path / ckpt.rng_file(topo.rank)
    set_rng_state(ckpt.load_state(rng if rng.exists() else path / ckpt.rng_file(0)))
    if not same:
        log.info("resumed a %d-process, %d-stage checkpoint on %d processes, %d stages", meta["world_size"],
                 meta["num_stages"], topo.world_size, topo.num_stages)
    return RunState(step=meta["step"], tokens=meta["tokens"], **({"run_id": meta["run_id"]} if "run_id" in meta else {}))
