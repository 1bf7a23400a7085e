"""Atomic checkpoints: each process writes its part into a temp dir, the main
process writes the manifest last and renames the dir into place.

A checkpoint without ``manifest.json`` is never resumed from, so a run killed
mid-write leaves the previous checkpoint the latest one. Tensors go through
safetensors; other state through ``torch.load(weights_only=True)`` or JSON,
so loading never unpickles arbitrary objects.

The layout (every file name is spelled here and nowhere else)::

    checkpoint-0000100/
      manifest.json                  written last: its presence makes the checkpoint valid
      trainer_state.json             step, tokens, data positions per rank, topology, schedule
      rng-rank000.pt ...             python/torch RNG per rank
      config.json  tokenizer/  recipe.yaml
      model.safetensors  optimizer.pt                                      single-process run
      stage-00.safetensors  stage-00-optimizer.pt  [stage-00-versions.safetensors]   pipelined run, per stage
"""
from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

MANIFEST = "manifest.json"
TRAINER_STATE = "trainer_state.json"
MODEL_FILE = "model.safetensors"
OPTIMIZER_FILE = "optimizer.pt"
_NAME = re.compile(r"^checkpoint-(\d+)$")
_VERSIONS = "-versions.safetensors"


def rng_file(rank: int) -> str:
    return f"rng-rank{rank:03d}.pt"


def stage_file(stage: int) -> str:
    """The stage's newest weights, by the model's parameter names."""
    return f"stage-{stage:02d}.safetensors"


def stage_versions_file(stage: int) -> str:
    """Older weight versions the stage still holds (2BW: the one in use), ``v{version}/{name}``."""
    return f"stage-{stage:02d}{_VERSIONS}"


def stage_optimizer_file(stage: int) -> str:
    return f"stage-{stage:02d}-optimizer.pt"


def stage_weight_files(path: Path) -> list[Path]:
    """The ``stage-XX.safetensors`` files of a pipelined checkpoint, in stage order."""
    return sorted(p for p in Path(path).glob("stage-*.safetensors") if not p.name.endswith(_VERSIONS))


def versions_of(weights_file: Path) -> Path:
    return weights_file.with_name(weights_file.stem + _VERSIONS)


def optimizer_of(weights_file: Path) -> Path:
    return weights_file.with_name(weights_file.stem + "-optimizer.pt")


def checkpoint_name(step: int) -> str:
    return f"checkpoint-{step:07d}"


def temp_dir(output_dir: str | Path, step: int) -> Path:
    return Path(output_dir) / f".tmp-{checkpoint_name(step)}"


def _fsync(path: Path) -> None:
    """Flush a file's data, or a directory's entries (so a rename survives a crash), to disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def save_tensors(path: Path, tensors: dict[str, torch.Tensor], metadata: dict | None = None) -> None:
    tensors = {k: v.detach().contiguous().cpu() for k, v in tensors.items()}
    save_file(tensors, str(path), metadata=metadata)
    _fsync(path)


def load_tensors(path: Path) -> dict[str, torch.Tensor]:
    return load_file(str(path))


def save_state(path: Path, obj) -> None:
    torch.save(obj, path)
    _fsync(path)


def load_state(path: Path):
    return torch.load(path, map_location="cpu", weights_only=True)


def save_json(path: Path, obj) -> None:
    with open(path, "w") as f:
        json.dump(obj, f, indent=1)
        f.flush()
        os.fsync(f.fileno())


def load_json(path: Path):
    with open(path) as f:
        return json.load(f)


def commit(tmp: Path, final: Path, manifest: dict) -> Path:
    """Write the manifest last, then move the complete directory into place."""
    files = sorted(str(p.relative_to(tmp)) for p in tmp.rglob("*") if p.is_file())
    save_json(tmp / MANIFEST, {**manifest, "files": files})
    _fsync(tmp)
    replace_dir(tmp, final)  # re-saving the same step (e.g. after a resume) replaces it
    _fsync(final.parent)
    return final


def replace_dir(tmp: Path, final: Path) -> None:
    """Move a complete ``tmp`` directory to ``final``; an existing ``final`` is set aside first, then deleted."""
    if final.exists():
        old = final.with_name(f".{final.name}.old-{os.getpid()}")
        shutil.rmtree(old, ignore_errors=True)
        os.replace(final, old)
        os.replace(tmp, final)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(tmp, final)


def list_checkpoints(output_dir: str | Path) -> list[tuple[int, Path]]:
    """Complete checkpoints (with a manifest), oldest first."""
    out = []
    root = Path(output_dir)
    if not root.is_dir():
        return out
    for p in root.iterdir():
        m = _NAME.match(p.name)
        if m and (p / MANIFEST).is_file():
            out.append((int(m.group(1)), p))
    return sorted(out)


def resolve_resume(output_dir: str | Path, resume: str | None) -> Path | None:
    """``latest`` (None if there is none yet) or an explicit checkpoint directory."""
    if resume is None:
        return None
    if resume == "latest":
        ckpts = list_checkpoints(output_dir)
        return ckpts[-1][1] if ckpts else None
    path = Path(resume)
    if not (path / MANIFEST).is_file():
        raise FileNotFoundError(
            f"training.resume_from_checkpoint: {resume!r} is not a complete checkpoint (no {MANIFEST}); "
            f"complete ones: {[str(p) for _, p in list_checkpoints(output_dir)]}"
        )
    return path


def prune(output_dir: str | Path, limit: int | None) -> None:
    """Keep the newest ``limit`` complete checkpoints; also clear stale temp dirs."""
    root = Path(output_dir)
    for p in root.glob(".tmp-checkpoint-*"):
        shutil.rmtree(p, ignore_errors=True)
    if not limit:
        return
    ckpts = list_checkpoints(root)
    for _, p in ckpts[:-limit]:
        shutil.rmtree(p, ignore_errors=True)
