"""Writing and resuming a run's checkpoints: what goes in one, from which rank, in which order.

``storage/checkpoint_io.py`` holds the atomic primitives, ``storage/staging.py`` the staging copy and the writer
thread, ``storage/names.py`` the file names and ``folder.py`` the run folder; this module is the choreography.

A save never stalls the pipeline for the write. On the training thread (every rank, collective): the previous save's
write is waited for (at most one in flight), the main process checks there is room (at least the previous
checkpoint's size free, else the run stops cleanly with the previous checkpoint the latest) and makes the temp dir,
and each rank *stages* its part: its engine files (weights, older versions, optimizer and EF state; under ZeRO-1 each
replica the state it owns), its RNG state and, on a rank that reads the training stream, its data position, copied
once to host memory. That is all the training thread does: it serializes, hashes and writes nothing
(:attr:`Checkpointer.counts`). On a background writer thread: each rank writes its own files (serialize, sha256,
fsync), then the writers meet over a gloo process group of their own, made when the checkpointer is (never the
training thread's groups, so the two threads never issue collectives on one communicator), to send the main
process the names, sizes and sha256 of what they wrote (no tensors, no data position); the main process adds
config, tokenizer, recipe, ``run_state.json`` (what a resume restores), ``trainer_state.json`` (the run as a
``transformers.TrainerState``), commits (manifest last), prunes, and tells every writer the outcome. A failed
write is raised on every rank at the next save or at the end of the run (:meth:`Checkpointer.finish`), with the
previous checkpoint still the latest; a process killed meanwhile never committed the new one.

The format stays the project's own (safetensors per stage, ``torch.save`` of the optimizer state keyed by
parameter name) rather than ``torch.distributed.checkpoint``'s ``.distcp`` files: ``from_pretrained`` opens a
checkpoint folder through its ``model.safetensors.index.json`` of the stage files, ``export`` and the stage-local
loaders read them by name (a rank reads only the tensors of its stage, on any new split: the resharding DCP would
give), and DCP's optimizer state dicts drop the Error-Feedback buffers and run an optimizer step to initialise
state. What DCP adds for speed is taken from it: its stager (pinned, cached host buffers) for the one copy.

Resume reverses it: ``folder.choose_resume`` verifies the checkpoint against its manifest (the ranks share the
hashing) and, for ``latest``, falls back to the newest one that verifies; :func:`check_model` refuses a recipe
whose model contradicts the checkpoint's; :func:`resume` restores the state and re-shards the data position when
the data-parallel size changed.
"""
from __future__ import annotations

import dataclasses
import hashlib
import logging
import os
import pickle
import shutil
import time
import uuid
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path

import torch.distributed as dist
import yaml
from transformers import TrainerState

from .. import supervision
from ..config.recipe import Recipe, save_recipe
from ..engine import Engine
from ..errors import EXIT_PEER, CheckpointError, PeerFailure, RecipeError, WriteError
from ..launch.failures import peer_gone, report
from ..model.build import build_config
from ..model.export import export_engine, tied_names
from ..storage import checkpoint_io as ckpt, write as storage
from ..storage.names import (CONFIG_FILE, INDEX_FILE, METRICS, RECIPE_FILE, RUN_STATE, TOKENIZER_DIR, TRAINER_STATE,
                             checkpoint_name, data_file, rng_file, stage_weight_files, temp_dir)
from ..storage.staging import BackgroundWriter, StagedFile, Stager
from ..storage.write import bytes_written_by, human, write_error, writing
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


@dataclass
class SaveCounts:
    """What one save cost this rank, on each side: the counts the asynchronous save promises (the manifest keeps
    every rank's under ``save``)."""

    step: int = 0
    staged_bytes: int = 0  # tensor bytes the training thread copied to host memory: its whole share of the work
    training_thread_bytes: int = 0  # bytes the training thread serialized, hashed or wrote for it: 0
    writer_bytes: int = 0  # bytes the background writer serialized, hashed and wrote (this rank's files)
    sent_bytes: int = 0  # pickled bytes this rank's writer sent the main process: names, sizes, sha256
    waited_s: float = 0.0  # training-thread seconds spent waiting for the previous save's write
    blocked_s: float = 0.0  # training-thread seconds in save() (waiting included): what the pipeline stalled


class Checkpointer:
    """Saves and resumes a run in ``out``; every method is collective (every rank calls it)."""

    def __init__(self, out: Path, recipe: Recipe, topo: Topology, accelerator, tokenizer, data_files=None,
                 pusher: Pusher | None = None):
        self.out, self.recipe, self.topo, self.accelerator, self.tokenizer = out, recipe, topo, accelerator, tokenizer
        self.pusher = pusher  # the main process's background Hub pushes (None elsewhere or without push_to_hub)
        self._data_files, self._fingerprint = data_files, None
        if topo.first or topo.last:  # the ranks that read the files: the data as the run opens it, not as it is later
            self._fingerprint = data_fingerprint(data_files)
        self.stager, self.writer = Stager(), BackgroundWriter()
        self.counts: list[SaveCounts] = []  # this rank's, one per save, once its write is done
        self._writing = 0  # the step of the save in flight (or last written)
        self._failed_at: float | None = None  # time.monotonic() of this rank's writer's last failure
        # the writers' own communicator, made now, on every rank, in the same order as every group: the writer
        # thread's collectives never share a communicator with the training thread's
        # (its timeout, pipeline.checkpoint_timeout_s, bounds how long a writer waits for the others)
        self._group = dist.new_group(backend="gloo", timeout=timedelta(seconds=recipe.pipeline.checkpoint_timeout_s)) \
            if topo.world_size > 1 and dist.is_initialized() else None

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
        """Start writing ``checkpoint-{step}`` (the engine must be drained: every STEP of the steps so far applied):
        returns once this rank's part is staged; the background writer writes and commits it. A rank that stops
        answering meanwhile (its gather waits ``pipeline.checkpoint_timeout_s``, ``init_timeout_s`` before the run's
        first step) is named in a PeerFailure, instead of a
        gather's traceback blaming the rank that waited."""
        try:
            return self._save(state, engine, stream)
        except RuntimeError as e:
            if not timed_out(e) or isinstance(e, (WriteError, PeerFailure)):
                raise
            budget = "checkpoint_timeout_s" if getattr(engine, "stepped", False) else "init_timeout_s"
            raise self._silent_peer(state.step, budget) from None

    def _silent_peer(self, step: int, budget: str = "checkpoint_timeout_s") -> PeerFailure:
        """The rank that went silent during a save, named; ``budget``: the timeout that ran out (the training
        thread's before the run's first step is ``init_timeout_s``; the writers' is ``checkpoint_timeout_s``)."""
        secs = getattr(self.recipe.pipeline, budget)
        who = who_went_silent(checkpoint_name(step), wait_s=min(30.0, secs))
        return PeerFailure(f"rank {self.topo.rank}: writing {checkpoint_name(step)}: {who} (nothing within "
                           f"pipeline.{budget}={secs:g}s: stalled or hung, see its log); {self._latest()}")

    def finish(self) -> None:
        """Wait for the save in flight to be written and committed (collective: its writers meet); raises what
        failed there, the same error on every rank. Called by the next save, at the end of a run and before a stop
        signal's exit."""
        try:
            self.writer.wait()
        except RuntimeError as e:
            if not timed_out(e) or isinstance(e, (WriteError, PeerFailure)):
                raise
            raise self._silent_peer(self._writing) from None

    def settle(self, error: BaseException) -> None:
        """The training thread failed with ``error`` while a save may be in flight: the save is finished first (a
        failure elsewhere does not lose it). Where it failed too, earlier, with a write error, that one is raised
        (a full disk fills for both: the save's failure came first and says which checkpoint stays the latest);
        where a rank went silent, the writer, which waits for it as well, names it with the checkpoint that stays
        the latest and ends the run. Else nothing: the caller raises ``error``. Not for a dead peer (the writer
        would wait out its timeout; the dead rank's launcher ends the job) or a second SIGINT (stop at once)."""
        if isinstance(error, KeyboardInterrupt) or peer_gone(error):
            return
        seen = time.monotonic()
        try:
            self.finish()
        except WriteError as mine:
            if isinstance(error, WriteError) and self._failed_at is not None and self._failed_at <= seen:
                raise mine from error
        except Exception:  # noqa: BLE001 - the save's own failure, after this one: this one is reported
            log.warning("the checkpoint in flight failed too", exc_info=True)

    def close(self) -> None:
        """Finish the save in flight, then release the writers' process group and the staging buffers."""
        self.finish()
        if self._group is not None:
            dist.destroy_process_group(self._group)
            self._group = None
        self.stager.close()

    def _save(self, state: RunState, engine: Engine, stream) -> Path:
        began, wrote = time.perf_counter(), bytes_written_by()
        self.finish()  # at most one save in flight: its staged buffers are the ones this save reuses
        waited = time.perf_counter() - began
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
        staged_before = self.stager.staged_bytes
        files = engine.checkpoint_files(self.stager)
        # rng_state() is a fresh copy; a stream's position is a new dict per position, never changed after (so it
        # is kept as it is, not copied: with a 10,000-document shuffle buffer it is tens of MB); a middle stage has
        # no stream and no position
        position = stream.state_dict() if stream is not None else None
        files.append(StagedFile(rng_file(topo.rank), "state", rng_state()))
        if position is not None:
            files.append(StagedFile(data_file(topo.rank), "json", position))
        counts = SaveCounts(step=state.step, staged_bytes=self.stager.staged_bytes - staged_before,
                            training_thread_bytes=bytes_written_by() - wrote, waited_s=waited)
        self._writing = state.step
        run, config = dataclasses.replace(state), engine.config
        final = self.out / checkpoint_name(state.step)
        counts.blocked_s = time.perf_counter() - began
        self.writer.submit(lambda: self._write(tmp, final, run, config, files, position, counts))
        if self.recipe.hub.push_to_hub and self.recipe.hub.hub_strategy != "end":
            self.finish()  # the push takes the committed checkpoint
            self._push(state, engine, final)
        return final

    def _write(self, tmp: Path, final: Path, state: RunState, config, files: list[StagedFile], position: dict | None,
               counts: SaveCounts) -> None:
        """The writer thread's half of a save: this rank's files, then (all writers together, over their own group)
        the commit by the main process; every writer ends with the same outcome, raised at :meth:`finish`."""
        topo = self.topo
        before, failure = bytes_written_by(), None
        try:
            ckpt.write_staged(tmp, files)
        except WriteError as e:
            failure, self._failed_at = ("write", str(e)), time.monotonic()
        except Exception as e:  # noqa: BLE001 - a bug: said to every rank, so none waits for this one
            log.exception("rank %d: writing %s", topo.rank, tmp.name)
            failure = ("bug", f"rank {topo.rank}: {type(e).__name__}: {e}")
        counts.writer_bytes = bytes_written_by() - before
        written = ckpt.take_written(tmp)
        where = None if position is None else {"sha256": written.get(data_file(topo.rank), {}).get("sha256"),
                                               "epoch": position.get("epoch"), "blocks": position.get("blocks")}
        mine = {"written": written, "position": where, "failure": failure}
        counts.sent_bytes = len(pickle.dumps(mine))
        mine["counts"] = dataclasses.asdict(counts)
        try:
            outcome = self._meet(tmp, final, state, config, mine)
        except RuntimeError as e:
            if not timed_out(e):
                raise
            # a rank went silent during the save: the training thread may be waiting on it too, in a transfer whose
            # own timeout is longer; the run ends now, naming it, as a save on the training thread did
            peer = self._silent_peer(state.step)
            code = report(peer, debug=False)
            os._exit(code if code is not None else EXIT_PEER)
        self.counts.append(counts)
        if outcome is not None:
            kind, message = outcome
            raise (WriteError if kind == "write" else RuntimeError)(message)

    def _meet(self, tmp: Path, final: Path, state: RunState, config, mine: dict) -> tuple[str, str] | None:
        """The writers together, over their own group: every rank's records to the main process, its commit, the
        outcome to every rank, and a barrier (a rank that stops answering during the save is noticed here)."""
        if self._group is None:
            return self._commit(tmp, final, state, config, [mine])
        main = self.topo.rank == 0
        parts = [None] * self.topo.world_size if main else None
        dist.gather_object(mine, parts, dst=0, group=self._group)
        box = [self._commit(tmp, final, state, config, parts) if main else None]
        dist.broadcast_object_list(box, src=0, group=self._group)
        dist.barrier(group=self._group)
        return box[0]

    def _commit(self, tmp: Path, final: Path, state: RunState, config, parts: list[dict]) -> tuple[str, str] | None:
        """The main process's writer, once every rank's files are written: the run's files, the manifest, the move
        into place, pruning. The outcome every writer raises (None: committed)."""
        failures = [p["failure"] for p in parts if p["failure"] is not None]
        if failures:
            kind, message = next((f for f in failures if f[0] == "bug"), failures[0])
            if kind == "bug":
                return kind, message
            return kind, str(self._failed(WriteError(message), tmp, alone=True))
        topo = self.topo
        try:
            check_same_position([p["position"] for p in parts], topo)
        except RuntimeError as e:
            return "bug", str(e)
        try:
            with writing(tmp / CONFIG_FILE):
                config.to_json_file(str(tmp / CONFIG_FILE))
            with writing(tmp / TOKENIZER_DIR):
                self.tokenizer.save_pretrained(str(tmp / TOKENIZER_DIR))
            with writing(tmp / RECIPE_FILE):
                save_recipe(self.recipe, tmp / RECIPE_FILE)
            ckpt.save_json(tmp / RUN_STATE, {
                "step": state.step, "tokens": state.tokens, "run_id": state.run_id, "data_files": self.data_files,
                "world_size": topo.world_size, "num_stages": topo.num_stages, "schedule": self.recipe.pipeline.schedule})
            index = ckpt.weight_index(tmp, tied=tied_names(config)) if stage_weight_files(tmp) else None
            if index is not None:  # from_pretrained(checkpoint) reads the stage files through it (None: a tied copy differs)
                ckpt.save_json(tmp / INDEX_FILE, index)
            with writing(tmp / TRAINER_STATE):
                trainer_state(self.recipe, state, read_metrics(self.out / METRICS, whole_lines=True)).save_to_json(
                    str(tmp / TRAINER_STATE))
            written = {k: v for p in parts for k, v in p["written"].items()}
            ckpt.commit(tmp, final, {"step": state.step, "world_size": topo.world_size, "num_stages": topo.num_stages,
                                     "save": [p["counts"] for p in parts]}, written,
                        before_move=supervision.check_parent)  # never commit after the launcher died
        except WriteError as e:  # every other rank is past its writes (the gather above)
            self._failed_at = time.monotonic()
            return "write", str(self._failed(e, tmp, alone=True))
        except Exception as e:  # noqa: BLE001 - a bug: said to every writer, which would otherwise wait for this one
            log.exception("committing %s", final.name)
            return "bug", f"committing {final.name}: {type(e).__name__}: {e}"
        prune(self.out, self.recipe.training.save_total_limit, keep=final)
        log.info("saved %s", final.name)
        return None

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
            stream.load_state_dict(saved_position(path, meta, topo.dp_rank))  # the first stage's (ranks 0..dp-1)
        else:
            states = [saved_position(path, meta, r) for r in range(old_dp)]
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


def saved_position(path: Path, meta: dict, rank: int) -> dict | None:
    """The data position ``rank`` saved in checkpoint ``path`` (its ``data-rankNNN.json``; None: a rank that reads
    no data). A resume reads the first stage's, ranks 0..dp-1. A checkpoint written before each rank wrote its own
    keeps them all in ``run_state.json`` (``meta``)."""
    if "data" in meta:
        return meta["data"][rank]
    f = Path(path) / data_file(rank)
    return ckpt.load_json(f) if f.exists() else None


def saved_positions(path: Path) -> list[dict | None]:
    """Every rank's saved data position in checkpoint ``path``, by rank (None: a rank that reads no data)."""
    meta = ckpt.load_json(Path(path) / RUN_STATE)
    return [saved_position(path, meta, r) for r in range(meta["world_size"])]


def check_same_position(states: list, topo: Topology) -> None:
    """The first and the last stage of a replica read the same stream (the ids and their labels): their positions
    must agree, or the checkpoint would record one and resume the other out of step. ``states``: by rank, what each
    writer sent of its position (its file's sha256, epoch and block), never the position itself."""
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

