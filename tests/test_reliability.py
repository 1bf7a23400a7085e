"""Faults an operator meets, injected where they happen: a disk that fills during a write (at the file-write edge,
``storage.open_for_write``, the only fake here), damaged checkpoint files, a resume into a new folder with other
training files, a metrics line cut short, unusable data files among good ones, and Hub tokens in error texts.
Each ends in one ``error:`` line naming the file, or in a counted skip; nothing good is lost."""
from __future__ import annotations

import errno
import json
import logging
import os
import random
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from hf_asyncpp.config.recipe import recipe_from_dict
from hf_asyncpp.errors import RecipeError
from hf_asyncpp.run.checkpointer import saved_positions
from hf_asyncpp.run.folder import choose_resume
from hf_asyncpp.run.reporting import read_metrics
from hf_asyncpp.storage import checkpoint_io as ckpt, write as storage
from hf_asyncpp.topology import Topology
from support import FIXTURE, assert_each_damage_is_named, flip, recipe_file, run_main, tiny, train_steps
from hf_asyncpp.errors import CheckpointError
from hf_asyncpp.run.folder import list_checkpoints
from hf_asyncpp.storage.names import MANIFEST, checkpoint_name


def error_lines(err: str) -> list[str]:
    return [line for line in err.splitlines() if line.startswith("error:")]


# ---------------------------------------------------------------------------- a full disk


class FullDisk:
    """The file system fills up while the ``nth`` file called ``name`` is written: its first ``room`` bytes land,
    then every write fails with ENOSPC, as the OS reports it, and the free space reads 0."""

    def __init__(self, name: str, nth: int = 1, room: int = 100):
        self.name, self.nth, self.room, self.full = name, nth, room, False

    def open(self, path, append=False):
        f = open(path, "ab" if append else "wb")
        if Path(path).name == self.name:
            self.nth -= 1
            if self.nth == 0:
                self.full = True
        return _FillingFile(f, self) if self.full else f

    def free(self, path):
        return 0 if self.full else 10**12


class _FillingFile:
    def __init__(self, f, disk: FullDisk):
        self.f, self.disk = f, disk

    def write(self, data):
        data = memoryview(data).cast("B")
        if len(data) > self.disk.room:
            self.f.write(data[: self.disk.room])
            self.disk.room = 0
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        self.disk.room -= len(data)
        return self.f.write(data)

    def flush(self):
        self.f.flush()

    def fileno(self):
        return self.f.fileno()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.f.close()


@pytest.mark.parametrize("name,nth,latest", [("optimizer.pt", 2, 3), ("metrics.jsonl", 5, 3), ("final_eval.json", 1, 6)])
def test_full_disk_is_one_line_naming_the_file_and_the_previous_checkpoint_resumes(tmp_path, monkeypatch, capsys, name,
                                                                                    nth, latest):
    out = tmp_path / "run"
    recipe = recipe_file(tmp_path, out, training__max_steps=6, training__save_steps=3,
                         training__export=name == "final_eval.json")  # written at the end of the export
    disk = FullDisk(name, nth)
    monkeypatch.setattr(storage, "open_for_write", disk.open)
    monkeypatch.setattr(storage, "disk_free", disk.free)
    code, err = run_main(capsys, recipe)
    assert code == 4 and "Traceback" not in err
    [line] = error_lines(err)
    assert f"{name}: no space left on device (0 B free" in line, line
    assert "checkpoint-0000003 stays the latest" in line or name != "optimizer.pt"
    assert choose_resume(out, "latest", Topology()) == out / checkpoint_name(latest)
    assert ckpt.verify(out / checkpoint_name(latest)) == []
    if name == "metrics.jsonl":  # the fault left half a line behind
        assert not (out / "metrics.jsonl").read_text().endswith("\n")
    monkeypatch.undo()  # space freed: resume
    code, err = run_main(capsys, recipe, "--training.resume_from_checkpoint=latest")
    assert code == 0, err
    assert train_steps(out) == [1, 2, 3, 4, 5, 6]


def test_a_full_disk_at_the_first_checkpoint_leaves_no_partial_folder_and_the_same_command_starts_again(
        tmp_path, monkeypatch, capsys, caplog):
    """The temporary folder of the failed save (what filled the disk) is removed, and the retry is not refused as
    "another run" whose advised resume then finds nothing: nothing was saved, so the same command starts afresh."""
    out = tmp_path / "run"
    recipe = recipe_file(tmp_path, out, training__max_steps=6, training__save_steps=3)
    disk = FullDisk("optimizer.pt", 1)
    monkeypatch.setattr(storage, "open_for_write", disk.open)
    monkeypatch.setattr(storage, "disk_free", disk.free)
    code, err = run_main(capsys, recipe)
    [line] = error_lines(err)
    assert code == 4 and f"{out}/.tmp-checkpoint-0000003/optimizer.pt: no space left on device" in line, err
    assert line.endswith("; removed the partial .tmp-checkpoint-0000003; no checkpoint was completed yet, so the same "
                         "command, once space is free, starts the run afresh there"), line
    assert not list(out.glob(".tmp-checkpoint-*")) and list_checkpoints(out) == []
    monkeypatch.undo()  # space freed: the same command
    with caplog.at_level(logging.WARNING, logger="hf_asyncpp"):
        code, err = run_main(capsys, recipe)
    assert code == 0 and not error_lines(err), err
    assert any("holds an earlier start that saved nothing to continue" in r.getMessage() for r in caplog.records)
    assert train_steps(out) == [1, 2, 3, 4, 5, 6] and [s for s, _ in list_checkpoints(out)] == [3, 6]


def test_too_little_space_stops_before_writing_a_checkpoint(tmp_path, monkeypatch, capsys):
    out = tmp_path / "run"
    recipe = recipe_file(tmp_path, out, training__max_steps=6, training__save_steps=3)
    monkeypatch.setattr(storage, "disk_free", lambda path: 50_000)  # less than one checkpoint of the tiny model
    code, err = run_main(capsys, recipe)
    assert code == 4
    [line] = error_lines(err)
    assert "not enough space for checkpoint-0000006" in line and "50.0 KB are free" in line
    assert "checkpoint-0000003 stays the latest" in line
    assert [s for s, _ in list_checkpoints(out)] == [3] and not list(out.glob(".tmp-checkpoint-*"))


# ---------------------------------------------------------------------------- damaged checkpoints


SINGLE_KINDS = ["model.safetensors", "optimizer.pt", "run_state.json", "trainer_state.json", "rng-rank000.pt", "config.json",
                "recipe.yaml", "tokenizer/tokenizer.json"]


@pytest.fixture(scope="module")
def two_checkpoints(tmp_path_factory):
    from hf_asyncpp.run.trainer import train

    out = tmp_path_factory.mktemp("ckpts") / "run"
    train(recipe_from_dict(tiny(out, training__max_steps=6, training__save_steps=3)))
    return out


def test_each_damaged_file_kind_is_named(two_checkpoints, tmp_path):
    good = two_checkpoints / checkpoint_name(6)
    manifest = ckpt.load_json(good / MANIFEST)
    assert set(SINGLE_KINDS) <= set(manifest["files"]) and {"torch", "transformers", "safetensors"} <= set(manifest["versions"])
    assert all(set(rec) == {"size", "sha256"} for rec in manifest["files"].values())
    assert ckpt.verify(good) == []
    assert_each_damage_is_named(good, SINGLE_KINDS, tmp_path)
    from hf_asyncpp.model.export import load_checkpoint_state  # scripts/export.py: a damaged checkpoint is not exported

    with pytest.raises(CheckpointError, match=r"flip-model.safetensors/model.safetensors: its sha256 differs"):
        load_checkpoint_state(tmp_path / "flip-model.safetensors")


def test_a_manifest_without_sizes_and_hashes_is_named_as_damaged(two_checkpoints, tmp_path):
    """Every manifest records each file's size and sha256; one that lists names only is not trusted as complete."""
    old = tmp_path / "old"
    shutil.copytree(two_checkpoints / checkpoint_name(6), old)
    manifest = ckpt.load_json(old / MANIFEST)
    ckpt.save_json(old / MANIFEST, {**manifest, "files": sorted(manifest["files"])})
    assert ckpt.verify(old) == [f"{old / MANIFEST}: no file list; the checkpoint is damaged"]


def test_resume_latest_falls_back_to_the_newest_checkpoint_that_verifies(two_checkpoints, tmp_path, capsys, caplog):
    out = tmp_path / "run"
    shutil.copytree(two_checkpoints, out)
    flip(out / checkpoint_name(6) / "model.safetensors")  # plausible floats: it would load
    recipe = recipe_file(tmp_path, out, training__max_steps=8, training__save_steps=3)
    code, err = run_main(capsys, recipe, f"--training.resume_from_checkpoint={out / checkpoint_name(6)}")
    assert code == 5
    [line] = error_lines(err)
    assert "checkpoint-0000006/model.safetensors: its sha256 differs" in line and "checkpoint-0000003" in line
    caplog.set_level(logging.INFO)
    code, err = run_main(capsys, recipe, "--training.resume_from_checkpoint=latest")
    assert code == 0, err
    assert "skipped 1 damaged checkpoint(s): checkpoint-0000006 (" in caplog.text and "model.safetensors" in caplog.text
    assert f"resumed from {out / checkpoint_name(3)} at step 3" in caplog.text
    assert train_steps(out) == list(range(1, 9))


# ---------------------------------------------------------------------------- the run's own state on resume


def other_corpus(path: Path) -> Path:
    """Another training file: the fixture's documents with their words in another order (other BPE merges)."""
    rng = random.Random(0)
    rows = []
    for line in FIXTURE.read_text().splitlines():
        words = json.loads(line)["text"].split()
        rng.shuffle(words)
        rows.append(json.dumps({"text": " ".join(w[::-1] for w in words)}))
    path.write_text("\n".join(rows) + "\n")
    return path


def test_resume_into_a_new_folder_uses_the_checkpoints_tokenizer(two_checkpoints, tmp_path, capsys, caplog):
    from hf_asyncpp.data.tokenizer import train_tokenizer

    saved = two_checkpoints / checkpoint_name(3) / "tokenizer"
    other = other_corpus(tmp_path / "other.jsonl")
    assert train_tokenizer([str(other)], 320).get_vocab() != json.loads((saved / "tokenizer.json").read_text())["model"]["vocab"]
    new = tmp_path / "new"
    recipe = recipe_file(tmp_path, new, training__max_steps=5, data__train_files=[str(other)], data__eval_files=[str(other)],
                         training__resume_from_checkpoint=str(saved.parent))
    caplog.set_level(logging.INFO)
    code, err = run_main(capsys, recipe)
    assert code == 0, err
    assert (new / "tokenizer" / "tokenizer.json").read_bytes() == (saved / "tokenizer.json").read_bytes()
    assert "data.train_files differ from the ones checkpoint-0000003 was trained on" in caplog.text
    assert train_steps(new) == [4, 5]

    # a recipe that contradicts the checkpoint's model: one line naming the field, and nothing written
    before = (two_checkpoints / "recipe.yaml").read_bytes()
    with pytest.raises(RecipeError, match=r"model.config.hidden_size: the checkpoint has 32, the recipe 64"):
        from hf_asyncpp.run.trainer import train

        conf = tiny(two_checkpoints, training__resume_from_checkpoint="latest")["model"]["config"]
        train(recipe_from_dict(tiny(two_checkpoints, training__resume_from_checkpoint="latest",
                                    model__config={**conf, "hidden_size": 64})))
    assert (two_checkpoints / "recipe.yaml").read_bytes() == before


def test_metrics_line_cut_short_is_left_out(tmp_path, caplog):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1, "loss": 2.0}\n{"step": 2, "loss": 1.5}\n{"step": 3, "lo')
    with caplog.at_level(logging.WARNING):
        assert read_metrics(path) == [{"step": 1, "loss": 2.0}, {"step": 2, "loss": 1.5}]
    assert "metrics.jsonl line 3 is not a whole record" in caplog.text


# ---------------------------------------------------------------------------- bad data


def bad_files(folder: Path) -> dict[str, str]:
    """One data file of each unusable kind, and the words its skip reason must contain."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "garbage.jsonl").write_bytes(random.Random(1).randbytes(5000))
    (folder / "notjson.jsonl").write_text("these are words, not JSON\n" * 50)
    (folder / "wrongcol.jsonl").write_text(json.dumps({"content": "a document under another key " * 20}) + "\n")
    os.symlink(folder / "nowhere.jsonl", folder / "gone.jsonl")  # unreadable, also for root
    reasons = {"garbage.jsonl": "not UTF-8 text", "notjson.jsonl": "not JSON lines",
               "wrongcol.jsonl": "data.text_column: 'text' is not a column", "gone.jsonl": "cannot be read"}
    if os.geteuid() != 0:  # root reads any file whatever its mode
        (folder / "secret.jsonl").write_text(FIXTURE.read_text())
        (folder / "secret.jsonl").chmod(0)
        reasons["secret.jsonl"] = "cannot be read (Permission denied)"
    return reasons


def test_a_file_without_read_permission_is_named_as_such(tmp_path):
    """The permission case of :func:`bad_files`, also where the suite runs as root (CI): root reads a mode-000 file
    through its DAC capabilities, so the probe runs in a process whose bounding set lacks them."""
    secret = tmp_path / "secret.jsonl"
    secret.write_text(FIXTURE.read_text())
    secret.chmod(0)
    probe = [sys.executable, "-c", "import sys; from hf_asyncpp.data.files import problem_of; print(problem_of(sys.argv[1], 'text'))",
             str(secret)]
    if os.geteuid() == 0:
        probe = ["setpriv", "--bounding-set=-dac_override,-dac_read_search", "--inh-caps=-dac_override,-dac_read_search",
                 *probe]
    r = subprocess.run(probe, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == f"{secret}: cannot be read (Permission denied)"


def test_unusable_files_among_good_ones_are_skipped_named_and_counted(tmp_path, caplog):
    from hf_asyncpp.run.trainer import train

    data = tmp_path / "data"
    reasons = bad_files(data)
    shutil.copy(FIXTURE, data / "good.jsonl")
    out = tmp_path / "run"
    caplog.set_level(logging.INFO)
    train(recipe_from_dict(tiny(out, data__train_files=[str(data / "*.jsonl")], data__eval_files=[str(FIXTURE)],
                                training__max_steps=2, training__save_steps=2)))  # tokenizer trained on them too
    skips = [r.getMessage() for r in caplog.records if "unusable data file" in r.getMessage()]
    assert skips, caplog.text
    for name, why in reasons.items():  # each reason is one "; "-separated part of the message
        assert any(str(data / name) in part and why in part for m in skips for part in m.split("; ")), (name, skips)
    assert saved_positions(out / checkpoint_name(2))[0]["stats"]["skipped_files"] == len(reasons)

    # the same in a text corpus: a binary file among text files
    from hf_asyncpp.config.sections import DataConfig
    from hf_asyncpp.data.stream import BlockStream
    from transformers import AutoTokenizer

    (data / "good.txt").write_text(FIXTURE.read_text().replace('"}', '"}\n\n'))
    (data / "binary.txt").write_bytes(bytes(range(256)) * 40)
    s = BlockStream(DataConfig(seq_len=32), AutoTokenizer.from_pretrained(str(out / "tokenizer")),
                    [str(data / "binary.txt"), str(data / "good.txt")], repeat=False)
    assert next(s).shape == (32,) and s.stats["skipped_files"] == 1


def test_a_corpus_with_nothing_usable_is_one_error_line(tmp_path, capsys):
    data = tmp_path / "data"
    reasons = bad_files(data)
    recipe = recipe_file(tmp_path, tmp_path / "run", data__train_files=[str(data / "*.jsonl")], data__eval_files=[str(FIXTURE)])
    code, err = run_main(capsys, recipe, "--debug")  # the traceback behind the line, on request
    assert code == 6 and "Traceback" in err
    code, err = run_main(capsys, recipe)
    assert code == 6 and "Traceback" not in err
    [line] = error_lines(err)
    assert line.startswith("error: DataError: no usable data file") and "data.text_column" in line
    assert all(str(data / name) in line for name in reasons)
    assert not (tmp_path / "run" / "recipe.yaml").exists()  # a run that never started leaves no recipe behind


# ---------------------------------------------------------------------------- Hub tokens


@pytest.mark.parametrize("token", ["hf_AbCdEfGhIjKlMnOpQrStUvWxYz01234567", "hf_oauth_AbCdEfGhIjKlMnOpQrStUvWxYz0123",
                                   "api_org_AbCdEfGhIjKlMnOpQrStUvWxYz"])
def test_every_hub_token_form_is_scrubbed(token, monkeypatch):
    from hf_asyncpp.run.hub import _scrub

    text = f"401 for {token}: Authorization: Bearer {token}; see hf_asyncpp docs"
    assert token not in _scrub(text) and "hf_asyncpp docs" in _scrub(text)
    monkeypatch.setenv("HF_TOKEN", "x-odd-shaped-token-9")  # a form no pattern knows: the value itself is scrubbed
    assert "x-odd-shaped-token-9" not in _scrub("failed with x-odd-shaped-token-9")


def test_a_missing_codec_a_compressed_parquet_and_a_bad_source_are_one_line_each(tmp_path, monkeypatch, capsys):
    """The data mistakes of compressed corpora and mixtures, through the command: one error line each, naming the
    file or the source's field and the fix, before anything is written."""
    import fsspec.utils
    import zstandard

    zst = tmp_path / "corpus.jsonl.zst"
    zst.write_bytes(zstandard.ZstdCompressor().compress(FIXTURE.read_bytes()))
    (tmp_path / "corpus.parquet.gz").write_bytes(b"\x1f\x8b" + b"\x00" * 64)
    cases = [({"data__train_files": [str(zst)]}, f"{zst}: reading .zst files needs the zstandard package, which is not "
                                                 "installed: pip install zstandard"),
             ({"data__train_files": [str(tmp_path / "corpus.parquet.gz")]}, "corpus.parquet.gz: a compressed parquet file "
                                                                             "cannot be read"),
             ({"data__train_files": None, "data__eval_files": None, "data__sources": [
                 {"name": "web", "train_files": [str(FIXTURE)]}, {"name": "web", "train_files": [str(zst)], "weight": 2}]},
              "data.sources[1].name: 'web' is also the name of data.sources[0]; give each source its own name"),
             ({"data__train_files": None, "data__eval_files": None, "data__sources": [
                 {"name": "web", "train_files": [str(FIXTURE)], "weight": 0}]},
              "data.sources[0].weight: 0.0 is out of range; allowed: > 0.0")]
    monkeypatch.delitem(fsspec.utils.compressions, "zst")  # as fsspec is without the zstandard package
    for i, (overrides, expected) in enumerate(cases):
        out = tmp_path / f"run{i}"
        code, err = run_main(capsys, recipe_file(tmp_path, out, **overrides))
        [line] = error_lines(err)
        assert code != 0 and expected in line, (line, expected)
        assert not (out / "metrics.jsonl").exists()
