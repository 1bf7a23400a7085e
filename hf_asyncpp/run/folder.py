"""The run folder: its checkpoints, which one a resume takes, and whether a fresh run may start in it."""
from __future__ import annotations

import logging
import os
import shutil
from pathlib import Path

import torch.distributed as dist

from .. import supervision
from ..errors import CheckpointError, MissingCheckpoint, RecipeError, met_by_every_rank
from ..storage import checkpoint_io as ckpt
from ..storage.names import CHECKPOINT_DIR, EXPORT_DIR, FINAL_EVAL, MANIFEST, RUN_OUTPUTS, RUN_STATE
from ..storage.write import check_output_dir_free
from ..topology import Topology

log = logging.getLogger("hf_asyncpp")


def list_checkpoints(output_dir: str | Path) -> list[tuple[int, Path]]:
    """Complete checkpoints (with a manifest), oldest first."""
    out = []
    root = Path(output_dir)
    if not root.is_dir():
        return out
    for p in root.iterdir():
        m = CHECKPOINT_DIR.match(p.name)
        if m and (p / MANIFEST).is_file():
            out.append((int(m.group(1)), p))
    return sorted(out)


def incomplete_checkpoints(output_dir: str | Path) -> list[Path]:
    """``checkpoint-N`` folders without a manifest (a copy or a hand that removed it: an interrupted save never gets
    the final name), which no resume uses, oldest first."""
    root = Path(output_dir)
    if not root.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in root.iterdir() if (m := CHECKPOINT_DIR.match(p.name)) and p.is_dir()
             and not (p / MANIFEST).is_file()]
    return [p for _, p in sorted(found)]


def resume_candidates(output_dir: str | Path, resume: str | None) -> list[Path]:
    """The checkpoints a resume may use, in the order to try them: for ``latest`` every complete one, newest
    first (a damaged one falls back to the next); for an explicit path only that one. Completeness only: the one
    resolver, ``checkpointer.choose_resume``, verifies them in this order and picks.

    Raises:
        MissingCheckpoint: an explicit path without a manifest.
    """
    if resume is None:
        return []
    if resume == "latest":
        return [p for _, p in reversed(list_checkpoints(output_dir))]
    path = Path(resume)
    if not (path / MANIFEST).is_file():
        what = ("does not exist" if not path.exists() else "is a file, not a checkpoint folder" if not path.is_dir()
                else f"is not a complete checkpoint (no {MANIFEST})")
        raise MissingCheckpoint(f"training.resume_from_checkpoint: {resume!r} {what}; "
                                f"{checkpoints_near(path, output_dir)}")
    return [path]


def checkpoints_near(path: str | Path, output_dir: str | Path | None = None) -> str:
    """Which complete checkpoints a mistyped or wrong checkpoint path may have meant: those of the nearest folder above
    ``path`` that holds any (a step that was never saved, a checkpoint's own file given), else of ``output_dir``."""
    path = Path(path)
    for folder in [*path.parents[:3], *([Path(output_dir)] if output_dir is not None else [])]:
        found = list_checkpoints(folder) if folder.is_dir() else []
        if found:
            names = [p.name for _, p in found]
            shown = ", ".join(names[-5:]) + (f" (and {len(names) - 5} older)" if len(names) > 5 else "")
            return f"the complete checkpoints in {folder} are {shown}"
    return f"no complete checkpoint in {output_dir if output_dir is not None else path.parent}"


def previous_run(output_dir: str | Path) -> list[Path]:
    """What an earlier run left in ``output_dir``: its checkpoints (complete or not) and run outputs; [] if none."""
    root = Path(output_dir)
    if not root.is_dir():
        return []
    found = sorted(p for p in root.iterdir() if CHECKPOINT_DIR.match(p.name) or p.name.startswith(".tmp-checkpoint-"))
    return found + [root / n for n in RUN_OUTPUTS if (root / n).exists()]


def clear_stale(output_dir: str | Path) -> None:
    """Remove temp dirs of checkpoints that were never committed (a crash or a full disk left them)."""
    for p in Path(output_dir).glob(".tmp-checkpoint-*"):
        shutil.rmtree(p, ignore_errors=True)


def prune(output_dir: str | Path, limit: int | None, keep: Path | None = None) -> None:
    """Keep the newest ``limit`` complete checkpoints, ``keep`` (the one just written) always among them, even when
    older-numbered than others (a run resumed from an earlier checkpoint); also clear stale temp dirs."""
    root = Path(output_dir)
    clear_stale(root)
    if not limit:
        return
    ckpts = [p for _, p in list_checkpoints(root) if keep is None or p.resolve() != Path(keep).resolve()]
    kept = limit - 1 if keep is not None else limit
    for p in ckpts[:len(ckpts) - kept] if kept > 0 else ckpts:
        shutil.rmtree(p, ignore_errors=True)


def _verify_shared(path: Path, topo: Topology) -> list[str]:
    """``ckpt.verify`` with the files dealt out over the ranks; every rank gets every problem."""
    try:
        names = sorted(ckpt.manifest_files(path))
    except CheckpointError as e:
        return [str(e)]
    mine = ckpt.verify(path, names[topo.rank::topo.world_size])
    if topo.world_size == 1:
        return mine
    parts = [None] * topo.world_size
    dist.all_gather_object(parts, mine)
    return sorted(p for part in parts for p in part)


def saved_nothing(found: list[Path]) -> bool:
    """Whether what an earlier run left (:func:`previous_run`) holds nothing to continue or keep: no checkpoint, not
    even an incomplete one, no export, no final evaluation; only what a start writes (its tokenizer, recipe, logs and
    the metrics of steps never saved) and the ``.tmp-checkpoint-*`` of a save that never completed (a full disk at
    the first checkpoint, a kill during it: never renamed to a checkpoint, so nothing resumes it, ``export`` refuses
    it, and the next save removes it). The same command, fixed, then just runs: a failed start must not leave a
    folder that refuses its retry, nor advise a resume that has nothing to resume (torchrun's restarts resume
    ``latest``)."""
    kept = {EXPORT_DIR, FINAL_EVAL}
    return not any(CHECKPOINT_DIR.match(p.name) or p.name in kept for p in found)


def restarted() -> bool:
    """Whether this process restarts a run: torchrun's ``--max-restarts`` (``training.max_restarts``) started its
    worker group again, or SLURM requeued its job (``SLURM_RESTART_COUNT``, set from the first requeue on)."""
    raw = os.environ.get("SLURM_RESTART_COUNT", "0")
    return bool(supervision.restart_count()) or (raw.isdigit() and int(raw) > 0)


def check_something_to_resume(out: Path, setting: str | None) -> None:
    """``resume_from_checkpoint: latest`` finds a complete checkpoint in ``out``, as ``Trainer(resume_from_checkpoint=
    True)`` requires ("No valid checkpoint found"): a misspelt or empty ``output_dir`` would otherwise train from
    scratch, with a new tokenizer, without a word. Except in a restart (:func:`restarted`): the start it replaces may
    have failed before its first checkpoint, and the restart must take that folder over. A folder another run holds
    now (one that has not saved yet) is refused as that first (``check_output_dir_free``): the run there is the news.

    Raises:
        MissingCheckpoint: no complete checkpoint and not a restart; the message names the folder and both fixes.
    """
    if setting != "latest" or list_checkpoints(out) or restarted():
        return
    if out.is_dir():
        check_output_dir_free(out)
    if not out.is_dir():
        where = "no such folder (a misspelt output_dir?)"
    else:
        left = [p.name for p in previous_run(out)]
        where = f"it holds no complete checkpoint ({', '.join(left[:4])})" if left else "it holds no checkpoint"
    raise MissingCheckpoint(f"training.resume_from_checkpoint=latest: nothing to resume in {out}: {where}; point "
                            "training.output_dir at the run to continue, or drop resume_from_checkpoint to start afresh")


def check_fresh_run(out: Path, overwrite: bool, main: bool, resume: str | None = None) -> None:
    """A run that resumes nothing must not write into another run's folder: its metrics would be appended to the old
    ones, ``save_total_limit`` would prune its checkpoints in favour of the old higher-numbered ones, and ``latest``
    would resume the old run. Refused, naming both ways out; ``overwrite`` (``training.overwrite_output_dir``, the
    Trainer's name) removes the old run first (main process; called before anything of the new run is written)."""
    found = previous_run(out)
    if not found:
        return
    if saved_nothing(found):  # a start that failed (or was killed) before its first checkpoint: nothing to continue
        if main:
            log.warning("training.output_dir: %s holds an earlier start that saved nothing to continue (%s): "
                        "replaced by this run", out, ", ".join(p.name for p in found))
            for p in found:
                shutil.rmtree(p) if p.is_dir() else p.unlink()
        return
    if not overwrite:
        names = ", ".join(p.name + ("/" if p.is_dir() else "") for p in found[:4]) + (", ..." if len(found) > 4 else "")
        way = ("it has no complete checkpoint to resume" if resume == "latest" else
               "continue it with --training.resume_from_checkpoint=latest")
        raise RecipeError(f"training.output_dir: {out} holds another run ({names}); {way}; start over there with "
                          "--training.overwrite_output_dir=true (removes that run), or choose another output_dir")
    if main:
        log.warning("training.overwrite_output_dir: removing the previous run in %s (%s)", out,
                    ", ".join(p.name for p in found))
        for p in found:
            shutil.rmtree(p) if p.is_dir() else p.unlink()


def choose_resume(out: Path, setting: str | None, topo: Topology) -> Path | None:
    """The checkpoint to resume (collective): ``training.resume_from_checkpoint`` verified against its manifest.

    ``latest`` falls back to the newest checkpoint that verifies, with a warning naming what was skipped and why;
    an explicit path that fails is an error naming the file. None: nothing to resume. Every rank reaches the same
    verdict (the verification is shared), so an error is said once per node.
    """
    try:
        return _choose_resume(out, setting, topo)
    except CheckpointError as e:
        met_by_every_rank(e)
        raise


def _choose_resume(out: Path, setting: str | None, topo: Topology) -> Path | None:
    check_something_to_resume(out, setting)
    candidates = resume_candidates(out, setting)
    incomplete = incomplete_checkpoints(out) if setting == "latest" and topo.is_main else []
    if incomplete:  # said, not silently passed over: someone may think the newest one is resumed
        log.warning("not resuming %s: no %s, so not a complete checkpoint (its manifest was removed, or it was copied "
                    "in part); a save at its step replaces it (resume it by restoring its manifest.json)",
                    ", ".join(p.name for p in incomplete), MANIFEST)
    skipped = []
    for path in candidates:
        problems = _verify_shared(path, topo)
        if not problems:
            files = ckpt.manifest_files(path)
            if skipped:
                log.warning("skipped %d damaged checkpoint(s): %s; resuming from %s instead", len(skipped),
                            "; ".join(skipped), path.name)
            log.info("%s verified: its %d files have the sizes and sha256 of its manifest", path, len(files))
            return path
        detail = problems[0] + (f" (and {len(problems) - 1} more)" if len(problems) > 1 else "")
        if setting != "latest":
            others = [p.name for _, p in list_checkpoints(out) if p != path]
            raise CheckpointError(f"training.resume_from_checkpoint: {path} does not match its manifest: {detail}; "
                                       f"resume from another checkpoint ({', '.join(others) or 'none in ' + str(out)}) "
                                       "or start afresh")
        skipped.append(f"{path.name} ({detail})")
    if skipped:
        raise CheckpointError(f"no checkpoint in {out} matches its manifest: {'; '.join(skipped)}; move them "
                                   "aside to start afresh")
    return None


def finished_run(out: Path, resume: Path, training) -> str | None:
    """Why resuming ``resume`` into ``out`` has nothing left to do, or None. A run is finished when its checkpoint
    is at ``training.max_steps`` (or past it) and, with ``training.export``, its end is written too: ``export/``
    and ``final_eval.json`` (the last file the end writes, after the export, its evaluation and the final push). A
    run killed during its export or its final push is not finished: resuming it writes its end again. Resuming a
    finished run used to re-run that end on zero trained steps, replacing the measured pipeline profile with an
    empty one and appending a second final evaluation; now it is said and nothing is written. Raising
    ``max_steps`` continues the run."""
    step = ckpt.load_json(resume / RUN_STATE)["step"]
    if step < training.max_steps:
        return None
    if training.export and not ((out / EXPORT_DIR).is_dir() and (out / FINAL_EVAL).is_file()):
        return None
    end = f", and its {EXPORT_DIR}/ and {FINAL_EVAL} are written" if training.export else ""
    return (f"training.resume_from_checkpoint: the run in {out} is complete: {resume.name} is at step {step} "
            f"(training.max_steps {training.max_steps}){end}; nothing was changed. To train on, raise "
            "--training.max_steps")
