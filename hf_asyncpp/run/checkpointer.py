"""Writing and resuming a run's checkpoints: what goes in one, from which rank, in which order.

``storage/checkpoint_io.py`` holds the atomic primitives, ``storage/names.py`` the file names and ``folder.py`` the run folder; this module is the choreography: the main
process first checks there is room (at least the previous checkpoint's size free, else the run stops cleanly
with the previous checkpoint the latest), every rank writes its engine part and RNG state into a temp dir, the
data positions and the sizes and hashes of what each rank wrote are gathered, the main process adds config,
tokenizer, recipe, ``run_state.json`` (what a resume restores) and ``trainer_state.json`` (the run as a
``transformers.TrainerState``, for tools made for Trainer checkpoints), commits (manifest last), prunes, and pushes
when asked.

Resume reverses it: ``folder.choose_resume`` verifies the checkpoint against its manifest (the ranks share the
hashing) and, for ``latest``, falls back to the newest one that verifies; :func:`check_model` refuses a recipe
whose model contradicts the checkpoint's; :func:`resume` restores the state and re-shards the data position when
the data-parallel size changed.
"""
from __future__ import annotations

import hashlib
import logging
import os
import shutil
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import torch.distributed as dist
import yaml
from transformers import TrainerState

from .. import supervision
from ..config.recipe import Recipe, save_recipe
from ..engine import Engine
from ..errors import CheckpointError, PeerFailure, RecipeError, WriteError
from ..model.build import build_config
from ..model.export import export_engine, tied_names
from ..storage import checkpoint_io as ckpt, write as storage
from ..storage.names import (CONFIG_FILE, INDEX_FILE, METRICS, RECIPE_FILE, RUN_STATE, TOKENIZER_DIR, TRAINER_STATE,
                             checkpoint_name, rng_file, stage_weight_files, temp_dir)
from ..storage.write import human, write_error, writing
from ..topology import Topology, timed_out, who_went_silent
from .folder import clear_stale, list_checkpoints, prune
from .hub import Pusher, snapshot
from .model_card import card_from_recipe, card_writer
from .reporting import log_history, read_metrics
from .resume_report import resume_report
from .seeds import rng_state, set_rng_state

log = logging.getLogger("hf_asyncpp")


@dataclass
class RunState:
    step: int = 0
    tokens: int = 0
    run_id: str = field(default_factory=lambda: uuid.uuid4().hex[:12])
    """The trackers' run id: kept in the checkpoint so a resumed run continues the same tracker run."""


_CONFIG_NOISE = {"transformers_version", "architectures", "dtype", "torch_dtype", "use_cache", "attn_implementation",
                 "output_attentions", "output_hidden_states", "return_dict"}  # (and private "_..." keys): not the model


def trainer_state(recipe: Recipe, state: RunState, records: list[dict]) -> TrainerState:
    """The run at ``state.step`` as the HF Trainer keeps it (``trainer_state.json``): its counters, and its log as
    ``log_history`` from the run's metrics records. A step is an optimizer step, as in the Trainer; its batch size is
    the microbatch (``per_device_train_batch_size``)."""
    t = recipe.training
    return TrainerState(global_step=state.step, max_steps=t.max_steps, logging_steps=t.logging_steps,
                        eval_steps=t.eval_steps, save_steps=t.save_steps,
                        train_batch_size=recipe.pipeline.microbatch_size, num_input_tokens_seen=state.tokens,
                        log_history=log_history(records, t.logging_steps, t.max_steps, state.step))


SAMPLE_ENDS = 1 << 20  # bytes hashed at each end of a training file
SAMPLE_BLOCKS, SAMPLE_BLOCK = 16, 1 << 16  # and this many blocks of this size spread evenly between the ends


def sampled_digest(path: str | os.PathLike) -> str | None:
    """sha256 of a training file's size and bytes: all of them for a file up to 3 MiB, else its first and last MiB
    and 16 blocks of 64 KiB spread evenly between them (at most 3 MiB read whatever the file's size, so a corpus of
    many large shards is fingerprinted in seconds; the name and size alone missed a same-size edit). A same-size
    edit of a large file that touches no sampled byte goes unseen. None: not a readable file."""
    try:
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            h = hashlib.sha256(str(size).encode())
            if size <= 2 * SAMPLE_ENDS + SAMPLE_BLOCKS * SAMPLE_BLOCK:
                while chunk := f.read(SAMPLE_ENDS):
                    h.update(chunk)
                return h.hexdigest()
            middle = size - 2 * SAMPLE_ENDS - SAMPLE_BLOCK
            spans = [(0, SAMPLE_ENDS), *((SAMPLE_ENDS + middle * i // (SAMPLE_BLOCKS - 1), SAMPLE_BLOCK)
                                         for i in range(SAMPLE_BLOCKS)), (size - SAMPLE_ENDS, SAMPLE_ENDS)]
            for start, length in spans:
                f.seek(start)
                h.update(f.read(length))
            return h.hexdigest()
    except OSError:
        return None


def data_fingerprint(files: list[str] | None) -> list | None:
    """What identifies the training files across a moved folder: [name, size, :func:`sampled_digest`] of each (the
    folder they are in is not part of it: a corpus copied elsewhere is the same data)."""
    if files is None:
        return None
    return [[Path(f).name, os.path.getsize(f) if os.path.exists(f) else None, sampled_digest(f)] for f in files]


def data_changes(saved: list, now: list) -> list[str]:
    """How this run's training files differ from those a checkpoint was trained on (empty: the same data), each
    change naming its file: added, gone, resized, or the same size with other bytes. A checkpoint written before the
    digest was recorded ([name, size] per file) is compared by name and size, as it was then."""
    names_then, names_now = [e[0] for e in saved], [e[0] for e in now]
    if names_then != names_now:
        added, gone = [n for n in names_now if n not in names_then], [n for n in names_then if n not in names_now]
        return ([f"{n} (new)" for n in added] + [f"{n} (gone)" for n in gone]) or ["the same files in another order"]
    changes = []
    for then, cur in zip(saved, now):
        if then[1] != cur[1]:
            changes.append(f"{cur[0]} ({then[1]} bytes then, {cur[1]} now)")
        elif len(then) > 2 and then[2] != cur[2]:
            changes.append(f"{cur[0]} (the same size, other content)")
    return changes


def save_due(training, step: int) -> bool:
    """Whether the run saves a checkpoint after ``step``: every ``training.save_steps``, and where it ends
    (``max_steps``, ``stop_after_steps``)."""
    return bool(training.save_steps and step % training.save_steps == 0) or step in (training.max_steps,
                                                                                    training.stop_after_steps)


class Checkpointer:
    """Saves and resumes a run in ``out``; every method is collective (every rank calls it)."""

    def __init__(self, out: Path, recipe: Recipe, topo: Topology, accelerator, tokenizer, data_files=None,
                 pusher: Pusher | None = None):
        self.out, self.recipe, self.topo, self.accelerator, self.tokenizer = out, recipe, topo, accelerator, tokenizer
        self.pusher = pusher  # the main process's background Hub pushes (None elsewhere or without push_to_hub)
        self._data_files, self._fingerprint = data_files, None
        if topo.first or topo.last:  # the ranks that read the files: the data as the run opens it, not as it is later
            self._fingerprint = data_fingerprint(data_files)

    @property
    def data_files(self) -> list | None:
        """The training files' :func:`data_fingerprint`, taken when the run starts on the ranks that read them (the
        first and last stages: the main process is one), so a file deleted or restored before the first save does
        not change what the checkpoints say the run trained on; a middle stage, which never reads the files, takes
        it only if asked."""
        if self._fingerprint is None:
            self._fingerprint = data_fingerprint(self._data_files)
        return self._fingerprint

    def _from_main(self, obj):
        if self.topo.world_size == 1:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def _latest(self) -> str:
        done = list_checkpoints(self.out)
        return (f"{done[-1][1].name} stays the latest checkpoint" if done else
                "no checkpoint was completed yet, so the same command, once space is free, starts the run afresh there")

    def _failed(self, e: WriteError, tmp: Path, alone: bool) -> WriteError:
        """The error of a save that could not be written, after removing its temporary folder where no other rank can
        still be writing into it (``alone``: one process, or the main process's part, written after every rank's):
        it holds nothing a resume or an export takes, and on a full disk it is what filled it. Elsewhere the next
        save, or the next start in the folder, removes it."""
        if alone:
            shutil.rmtree(tmp, ignore_errors=True)
        gone = f"removed the partial {tmp.name}" if alone and not tmp.exists() else \
            f"the next start or save removes the partial {tmp.name}"
        return WriteError(f"{e}; {gone}; {self._latest()}")

    def _space_problem(self, step: int) -> str | None:
        """Why ``checkpoint-{step}`` must not be started: less free space than the previous checkpoint took
        (the previous ones are deleted only after the new one is committed, so it must fit beside them)."""
        prev = [p for s, p in list_checkpoints(self.out) if s != step]
        if not prev:
            return None
        need, free = ckpt.checkpoint_size(prev[-1]), storage.disk_free(self.out)
        if free is None or free >= need:
            return None
        return (f"not enough space for {checkpoint_name(step)} in {self.out}: the previous checkpoint took "
                f"{human(need)} and {human(free)} are free; stopped before writing it, so {prev[-1].name} stays the "
                "latest (free space, then resume with --training.resume_from_checkpoint=latest)")

    def save(self, state: RunState, engine: Engine, stream) -> Path:
        """Write ``checkpoint-{step}`` (the engine must be drained: every STEP of the steps so far applied). A rank
        that stops answering meanwhile (its gather waits ``pipeline.checkpoint_timeout_s``, ``init_timeout_s`` before
        the run's first step) is named in a PeerFailure,
        instead of a gather's traceback blaming the rank that waited."""
        try:
            return self._save(state, engine, stream)
        except RuntimeError as e:
            if not timed_out(e) or isinstance(e, (WriteError, PeerFailure)):
                raise
            budget = "checkpoint_timeout_s" if getattr(engine, "stepped", False) else "init_timeout_s"
            secs = getattr(self.recipe.pipeline, budget)
            who = who_went_silent(checkpoint_name(state.step), wait_s=min(30.0, secs))
            raise PeerFailure(f"rank {self.topo.rank}: writing {checkpoint_name(state.step)}: {who} (nothing within "
                              f"pipeline.{budget}={secs:g}s: stalled or hung, see its log); {self._latest()}") from None

    def _save(self, state: RunState, engine: Engine, stream) -> Path:
        acc, topo = self.accelerator, self.topo
        tmp = temp_dir(self.out, state.step)
        problem = None
        if acc.is_main_process:
            clear_stale(self.out)
            problem = self._space_problem(state.step)
            if problem is None:
                try:
                    tmp.mkdir(parents=True)
                except OSError as e:
                    problem = f"{write_error(tmp, e)}; {self._latest()}"
        problem = self._from_main(problem)
        if problem:
            raise WriteError(problem)
        try:
            engine.save(tmp)
            ckpt.save_state(tmp / rng_file(topo.rank), rng_state())
        except WriteError as e:
            raise self._failed(e, tmp, alone=topo.world_size == 1) from None
        # a middle stage has no stream (None), but takes part in the gather: every rank joins every collective
        mine = {"data": stream.state_dict() if stream is not None else None, "written": ckpt.take_written(tmp)}
        parts = [None] * topo.world_size
        if topo.world_size > 1:
            dist.all_gather_object(parts, mine)
        else:
            parts = [mine]
        if acc.is_main_process:
            check_same_position([p["data"] for p in parts], topo)
        acc.wait_for_everyone()
        final = self.out / checkpoint_name(state.step)
        if acc.is_main_process:
            try:
                with writing(tmp / CONFIG_FILE):
                    engine.config.to_json_file(str(tmp / CONFIG_FILE))
                with writing(tmp / TOKENIZER_DIR):
                    self.tokenizer.save_pretrained(str(tmp / TOKENIZER_DIR))
                with writing(tmp / RECIPE_FILE):
                    save_recipe(self.recipe, tmp / RECIPE_FILE)
                ckpt.save_json(tmp / RUN_STATE, {
                    "step": state.step, "tokens": state.tokens, "run_id": state.run_id, "data": [p["data"] for p in parts],
                    "data_files": self.data_files, "world_size": topo.world_size, "num_stages": topo.num_stages,
                    "schedule": self.recipe.pipeline.schedule})
                index = ckpt.weight_index(tmp, tied=tied_names(engine.config)) if stage_weight_files(tmp) else None
                if index is not None:  # from_pretrained(checkpoint) reads the stage files through it (None: a tied copy differs)
                    ckpt.save_json(tmp / INDEX_FILE, index)
                with writing(tmp / TRAINER_STATE):
                    trainer_state(self.recipe, state, read_metrics(self.out / METRICS)).save_to_json(
                        str(tmp / TRAINER_STATE))
                written = {k: v for p in parts for k, v in p["written"].items()}
                ckpt.commit(tmp, final, {"step": state.step, "world_size": topo.world_size,
                                         "num_stages": topo.num_stages}, written,
                            before_move=supervision.check_parent)  # never commit after the launcher died
            except WriteError as e:  # every other rank is past its writes (wait_for_everyone above)
                raise self._failed(e, tmp, alone=True) from None
            prune(self.out, self.recipe.training.save_total_limit, keep=final)
            log.info("saved %s", final.name)
        self._push(state, engine, final)
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
        card = card_writer(card_from_recipe(self.recipe, state.step, state.tokens, read_metrics(self.out / METRICS))) \
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
        """Restore engine, data position and RNG. A pipelined checkpoint may resume on another number of stages
        (weights, optimizer/EF state and weight versions are matched by parameter name); with another
        data-parallel size the data order cannot be the uninterrupted one, which is logged. With other training
        files the saved position means nothing: the stream starts at their beginning, which is logged."""
        topo, schedule = self.topo, self.recipe.pipeline.schedule
        meta = ckpt.load_json(path / RUN_STATE)
        written = meta.get("schedule", schedule)
        if written != schedule:
            raise RecipeError(f"pipeline.schedule: {path} was written by a {written!r} run; resume it with the same schedule "
                              f"(this run uses {schedule!r}; their update semantics differ)")
        same = meta["world_size"] == topo.world_size and meta["num_stages"] == topo.num_stages
        engine.load(path)
        old_dp = meta["world_size"] // meta["num_stages"]
        saved_files = meta.get("data_files")
        changes = [] if stream is None or saved_files is None or self.data_files is None else \
            data_changes(saved_files, self.data_files)
        if stream is None:  # a middle stage: no data position to restore
            pass
        elif changes:
            log.warning("data.train_files differ from the ones %s was trained on: %s: the data stream starts at the "
                        "beginning of the new files", path.name, "; ".join(changes[:5]) +
                        (f"; and {len(changes) - 5} more" if len(changes) > 5 else ""))
        elif old_dp == topo.dp_size:
            stream.load_state_dict(meta["data"][topo.dp_rank])  # the first stage's (ranks 0..dp-1) position
        else:
            states = meta["data"][:old_dp]
            blocks = sum(s["blocks"] for s in states) // topo.dp_size
            stream.load_state_dict({"epoch": max(s["epoch"] for s in states), "blocks": blocks})
            log.warning("resumed with %d data-parallel ranks instead of %d: each rank skips %d blocks of its new shard; the data "
                        "order differs from an uninterrupted run", topo.dp_size, old_dp, blocks)
        rng = path / rng_file(topo.rank)
        set_rng_state(ckpt.load_state(rng if rng.exists() else path / rng_file(0)))
        if not same:
            log.info("resumed a %d-process, %d-stage checkpoint on %d processes, %d stages", meta["world_size"],
                     meta["num_stages"], topo.world_size, topo.num_stages)
        saved = path / RECIPE_FILE
        if self.accelerator.is_main_process and saved.is_file():  # a changed recipe is run, and said
            for line in resume_report(yaml.safe_load(saved.read_text()) or {}, self.recipe,
                                      engine.scheduler.last_epoch, path.name):
                log.warning("resume: %s", line)
        return RunState(step=meta["step"], tokens=meta["tokens"], **({"run_id": meta["run_id"]} if "run_id" in meta else {}))


def check_same_position(states: list, topo: Topology) -> None:
    """The first and the last stage of a replica read the same stream (the ids and their labels): their positions
    must agree, or the checkpoint would record one and resume the other out of step. The saved list keeps the first
    stage's positions first (ranks 0..dp-1), which is what a resume reads."""
    dp, last = topo.dp_size, topo.num_stages - 1
    for r in range(dp):
        first, end = states[r], states[last * dp + r]
        if first != end:
            raise RuntimeError(f"data position of replica {r}: stage 0 is at {_where(first)}, stage {last} at "
                               f"{_where(end)}; they read the same stream and must agree")


def _where(state: dict | None) -> str:
    return "nowhere" if state is None else f"epoch {state.get('epoch')} block {state.get('blocks')}"


def check_model(path: Path, recipe: Recipe, tokenizer) -> None:
    """Refuse a recipe whose model contradicts the checkpoint's, naming each field (before anything is written)."""
    from transformers import AutoConfig

    try:
        saved = AutoConfig.from_pretrained(str(path)).to_dict()
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{path / CONFIG_FILE}: cannot be read ({e})") from e
    mine = build_config(recipe.model, tokenizer).to_dict()
    fields = []
    for key in sorted(set(saved) | set(mine)):
        if key in _CONFIG_NOISE or key.startswith("_") or saved.get(key) == mine.get(key):
            continue
        if recipe.model.config is not None and key in recipe.model.config:
            field = f"model.config.{key}"
        elif recipe.model.name_or_path:
            field = f"model.name_or_path ({key})"
        else:
            field = f"model.config.{key}"
        fields.append(f"{field}: the checkpoint has {saved.get(key)!r}, the recipe {mine.get(key)!r}")
    if fields:
        raise RecipeError(f"{'; '.join(fields)} ({path.name} was trained with another model; resume with its recipe.yaml, "
                          "or start a new run in another training.output_dir)")

