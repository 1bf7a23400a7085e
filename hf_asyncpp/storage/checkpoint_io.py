"""Atomic, verified checkpoints: each process writes its part into a temp dir, the main process writes the
manifest last and renames the dir into place.

A checkpoint without ``manifest.json`` is never resumed from, so a run killed mid-write leaves the previous
checkpoint the latest one. The manifest records every file's size and sha256 (hashed as it was written, see
``storage.write_file``) and the library versions that wrote it; :func:`verify` checks a checkpoint against it
before a resume, so a truncated or overwritten file is named instead of loaded. Tensors go through safetensors;
other state through ``torch.load(weights_only=True)`` or JSON, so loading never unpickles arbitrary objects.

Every file name is spelled in ``storage.names``. A save's files arrive here staged (``storage.staging``: the
tensors already copied out of the training state) and are written by :func:`write_staged`, on the background writer
thread of an asynchronous save.
"""
from __future__ import annotations

import hashlib
import importlib.metadata as md
import json
import os
import shutil
from collections.abc import Callable, Mapping
from pathlib import Path
from types import MappingProxyType

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save as safetensors_bytes

from ..errors import CheckpointError
from .names import MANIFEST, stage_weight_files
from .staging import StagedFile
from .write import Written, json_text, write_file

_LIBRARIES = ("hf_asyncpp", "torch", "transformers", "accelerate", "datasets", "safetensors", "tokenizers")
_written: dict[str, Written] = {}  # absolute path -> size and sha256 of what this process wrote, until commit
_read = {"bytes": 0}  # what this process read through the loaders below: what a resume costs each rank


def _fsync(path: Path) -> None:
    """Flush a directory's entries (so a rename survives a crash) to disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _record(path: Path, written: Written) -> Written:
    _written[str(Path(path).absolute())] = written
    return written


def untie_shared_storage(state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Clone tensors that are views of one storage (flat pipeline buffers, a tied head on the stage that holds the
    embedding): safetensors refuses shared storage. Loading both names back into the module, which shares them
    again, gives the same values."""
    by_storage: dict[tuple, list[str]] = {}
    for k, t in state_dict.items():
        by_storage.setdefault((t.device, t.untyped_storage().data_ptr()), []).append(k)
    out = dict(state_dict)
    for keys in by_storage.values():
        if len(keys) > 1:
            for k in keys:
                out[k] = state_dict[k].clone()
    return out


def save_tensors(path: Path, tensors: dict[str, torch.Tensor], metadata: dict | None = None) -> Written:
    """Write safetensors through the storage edge (serialized in memory first: one file's worth of bytes)."""
    tensors = untie_shared_storage({k: v.detach().contiguous().cpu() for k, v in tensors.items()})
    data = safetensors_bytes(tensors, metadata=metadata)
    return _record(path, write_file(path, lambda f: f.write(data)))


def save_state(path: Path, obj) -> Written:
    return _record(path, write_file(path, lambda f: torch.save(obj, f)))


def save_json(path: Path, obj) -> Written:
    data = json_text(obj, indent=1).encode()
    return _record(path, write_file(path, lambda f: f.write(data)))


def write_staged(tmp: Path, files: list[StagedFile]) -> None:
    """Serialize, hash, write and fsync each staged file into ``tmp`` (recorded for the manifest, as every write)."""
    for f in files:
        path = tmp / f.name
        if f.kind == "tensors":
            save_tensors(path, f.content)
        elif f.kind == "state":
            save_state(path, f.content)
        elif f.kind == "json":
            save_json(path, f.content)
        else:
            raise ValueError(f"{f.name}: unknown staged file kind {f.kind!r}")


def _unreadable(path: Path, e: Exception) -> CheckpointError:
    first = str(e).strip().splitlines()[0] if str(e).strip() else ""
    return CheckpointError(f"{path}: cannot be read ({type(e).__name__}: {first[:200]}); the checkpoint is damaged or "
                           "incomplete")


def bytes_read(reset: bool = False) -> int:
    """Bytes this process has read through :func:`load_tensors`, :func:`load_state` and :class:`TensorFile` (the
    checkpoint read edge), so a test or a bench can check that a rank reads only its own stage; ``reset`` zeroes it."""
    n = _read["bytes"]
    if reset:
        _read["bytes"] = 0
    return n


def load_tensors(path: Path) -> dict[str, torch.Tensor]:
    try:
        out = load_file(str(path))
    except Exception as e:  # noqa: BLE001 - SafetensorError, OSError: both mean this file cannot be used
        raise _unreadable(path, e) from e
    _read["bytes"] += os.path.getsize(path)
    return out


class TensorFile:
    """A safetensors file read by name: opening reads its header only (the names), :meth:`get` only the tensors
    asked for. A rank resuming on another split takes the few tensors it needs from a file without loading the
    rest; header and tensors read count as :func:`bytes_read` (all of them add up to the file's size)."""

    def __init__(self, path: Path):
        self.path = Path(path)
        try:
            with open(self.path, "rb") as f:
                header = 8 + int.from_bytes(f.read(8), "little")
            self._file = safe_open(str(self.path), framework="pt")
            self.names = list(self._file.keys())
        except Exception as e:  # noqa: BLE001 - as in load_tensors
            raise _unreadable(self.path, e) from e
        _read["bytes"] += header

    def get(self, names) -> dict[str, torch.Tensor]:
        out = {}
        for name in names:
            try:
                out[name] = t = self._file.get_tensor(name)
            except Exception as e:  # noqa: BLE001 - a truncated file fails here, not at the header
                raise _unreadable(self.path, e) from e
            _read["bytes"] += t.numel() * t.element_size()
        return out


def load_state(path: Path):
    try:
        out = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001 - a truncated zip, a bad pickle opcode, a missing file
        raise _unreadable(path, e) from e
    _read["bytes"] += os.path.getsize(path)
    return out


def load_json(path: Path):
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError) as e:
        raise _unreadable(path, e) from e


def sha256_of(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()


def take_written(tmp: Path) -> dict[str, dict]:
    """Size and sha256 of the files this process wrote under ``tmp``, by relative name (forgotten here)."""
    root = str(Path(tmp).absolute()) + os.sep
    out = {}
    for key in [k for k in list(_written) if k.startswith(root)]:  # list(): the writer thread may add meanwhile
        w = _written.pop(key)
        out[key[len(root):]] = {"size": w.size, "sha256": w.sha256}
    return out


def library_versions() -> dict[str, str]:
    out = {}
    for name in _LIBRARIES:
        try:
            out[name] = md.version(name)
        except md.PackageNotFoundError:
            pass
    return out


def commit(tmp: Path, final: Path, manifest: dict, written: dict[str, dict] | None = None,
           before_move: Callable[[], None] | None = None) -> Path:
    """Write the manifest last, then move the complete directory into place.

    ``written``: size and sha256 of files recorded while they were written (every rank's ``take_written``);
    the rest (written by libraries: config, tokenizer, recipe) are hashed here. ``before_move`` runs after the
    manifest is on disk and right before the move, the last moment a commit can still be called off (the
    supervisor's launcher check: hashing and fsync take long enough for a launcher to die meanwhile).
    """
    known = {**take_written(tmp), **(written or {})}
    files = {}
    for p in sorted(tmp.rglob("*")):
        if p.is_file():
            name = str(p.relative_to(tmp))
            rec = known.get(name)
            if rec is None or rec["size"] != p.stat().st_size:
                rec = {"size": p.stat().st_size, "sha256": sha256_of(p)}
            files[name] = rec
    save_json(tmp / MANIFEST, {**manifest, "files": files, "versions": library_versions()})
    _written.pop(str((tmp / MANIFEST).absolute()), None)
    _fsync(tmp)
    if before_move is not None:
        before_move()
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


def manifest_files(path: Path) -> dict[str, dict]:
    """The manifest's files: name -> {size, sha256}."""
    manifest = load_json(Path(path) / MANIFEST)
    files = manifest.get("files") if isinstance(manifest, dict) else None
    if not isinstance(files, dict):
        raise CheckpointError(f"{Path(path) / MANIFEST}: no file list; the checkpoint is damaged")
    return files


def verify(path: Path, names: list[str] | None = None) -> list[str]:
    """Problems of checkpoint ``path`` against its manifest (empty: it verifies), each naming the file.

    Checks each listed file's presence, size and sha256;
    ``names`` restricts the check to some of the files (ranks share the hashing).
    """
    path = Path(path)
    try:
        files = manifest_files(path)
    except CheckpointError as e:
        return [str(e)]
    problems = []
    for name in (sorted(files) if names is None else names):
        rec, f = files.get(name), path / name
        if not f.is_file():
            problems.append(f"{f}: missing")
        elif f.stat().st_size != rec["size"]:
            problems.append(f"{f}: {f.stat().st_size} bytes, the manifest says {rec['size']} (truncated or overwritten)")
        elif sha256_of(f) != rec["sha256"]:
            problems.append(f"{f}: its sha256 differs from the manifest's (the file was changed or damaged)")
    return problems


def checkpoint_size(path: Path) -> int:
    """Bytes of a checkpoint: the manifest's sizes, or what is on disk where the manifest cannot be read."""
    try:
        files = manifest_files(path)
    except CheckpointError:
        files = {}
    if files:
        return sum(rec["size"] for rec in files.values())
    return sum(p.stat().st_size for p in Path(path).rglob("*") if p.is_file())




def weight_index(path: Path, tied: Mapping[str, str] = MappingProxyType({})) -> dict | None:
    """The ``model.safetensors.index.json`` of a pipelined checkpoint: every weight name of its ``stage-XX.safetensors``
    files (names from their headers; not the optimizer or 2BW's ``-versions`` files) mapped to its file, so that
    ``AutoModelForCausalLM.from_pretrained(checkpoint)`` loads the model, as from a Trainer checkpoint.

    ``tied``: the model's ties, {tied name: the name it is tied to} (transformers' ``all_tied_weights_keys``, e.g.
    a tied head to the embedding). A tied name is left out of the index, as ``save_pretrained`` leaves it out of its
    files (``from_pretrained`` re-ties it). But ``from_pretrained`` reads every tensor of a file the index names, so a
    stage file's own copy of a tied name (the head the last stage holds) is loaded too: where it differs from its
    partner, transformers unties the two and the model is not the checkpoint's. So each such copy, and each name
    several stage files hold, is compared (``torch.equal``, read by name: only those tensors) with its partner's
    first copy; None (no index rather than a wrong model) where one differs or its partner is in no stage file. The
    copies of a run's checkpoint are equal (one stage: one parameter; several: the same summed gradient and
    update); a file edited by hand, or a run that let them drift apart, gets no index; nor does a checkpoint whose
    output layer is cut over the stages (``pipeline.vocab_parallel``)."""
    files = [TensorFile(f) for f in stage_weight_files(path)]  # the headers
    held: dict[str, list[TensorFile]] = {}  # name -> the stage files holding it, in stage order
    for tf in files:
        for name in tf.names:
            held.setdefault(name, []).append(tf)
    if any("@" in name for name in held):
        # rows of a weight cut over the stages (``model/vocab_parallel.shard_name``: ``lm_head.weight@v0:v1``) are no
        # tensor from_pretrained reads: no index rather than a model with a freshly drawn head (the export has it whole)
        return None
    copies = [(tf, name, held[name][0], name) for name, tfs in held.items() for tf in tfs[1:]]
    for name, partner in tied.items():
        if name in held:
            if partner not in held:
                return None
            copies += [(tf, name, held[partner][0], partner) for tf in held[name]]
    for tf, name, first, other in copies:
        if not torch.equal(tf.get([name])[name], first.get([other])[other]):
            return None
    weight_map = {name: tfs[0].path.name for name, tfs in held.items() if name not in tied}
    return {"metadata": {"total_size": sum(tf.path.stat().st_size for tf in files)}, "weight_map": weight_map}
