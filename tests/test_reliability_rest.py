"""Faults a user meets away from the main paths, each where it is met: a pipelined run on one process
started without a launcher, a same-size edit of a training file, symbolic links in the output folder, a checkpoint
without its manifest, JSON that another tool can read after a run with nothing to train, the step a non-finite
error names, and what the launcher leaves in the temporary folder."""
from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from hf_asyncpp.cli.export import main as export_main
from hf_asyncpp.config.recipe import recipe_from_dict
from hf_asyncpp.errors import NonFiniteError
from hf_asyncpp.run.checkpointer import data_fingerprint, sampled_digest
from hf_asyncpp.run.reporting import read_metrics
from hf_asyncpp.run.trainer import train
from hf_asyncpp.storage import checkpoint_io as ckpt
from hf_asyncpp.storage.names import RUN_STATE, checkpoint_name
from hf_asyncpp.storage.write import json_text
from support import FIXTURE, ROOT, recipe_file, run_main, tiny, train_steps


# ---------------------------------------------------------------------------- one pipelined process, no launcher

ONE_STAGE = dict(pipeline__schedule="2bw", pipeline__num_stages=1, training__max_steps=4, training__save_steps=2)


def test_a_one_stage_2bw_run_trains_and_resumes_without_a_launcher(tmp_path, capsys):
    """``hf-asyncpp train`` of a 1-stage 2BW recipe is one process that no launcher started: it makes its own
    one-process group (it crashed in make_groups with "Default process group has not been initialized")."""
    out = tmp_path / "one"
    recipe = recipe_file(tmp_path, out, **ONE_STAGE, training__stop_after_steps=2)
    code, err = run_main(capsys, recipe)
    assert code == 0, err
    assert train_steps(out) == [1, 2]
    code, err = run_main(capsys, recipe, "--training.resume_from_checkpoint=latest", "--training.stop_after_steps=null")
    assert code == 0, err
    assert train_steps(out) == [1, 2, 3, 4]
    assert json.loads((out / "checkpoint-0000004" / "run_state.json").read_text())["num_stages"] == 1


# ---------------------------------------------------------------------------- symbolic links in the output folder


def error_lines(err: str) -> list[str]:
    return [line for line in err.splitlines() if line.startswith("error:")]


def test_a_link_where_the_run_writes_is_refused_naming_it(tmp_path, capsys):
    """A symlinked ``tokenizer/`` or ``recipe.yaml`` was written through on resume (the target outside the folder
    changed), and ``overwrite_output_dir`` died in rmtree with a traceback: now one line names the link and the fix,
    and nothing is written; the output folder itself may be a link."""
    real = tmp_path / "real"
    out = tmp_path / "run"
    real.mkdir()
    out.symlink_to(real, target_is_directory=True)  # allowed: the folder itself
    recipe = recipe_file(tmp_path, out, training__max_steps=3, training__save_steps=3)
    code, err = run_main(capsys, recipe)
    assert code == 0, err

    victim_tok, victim_recipe, victim_ckpt = tmp_path / "victim_tok", tmp_path / "victim_recipe.yaml", tmp_path / "victim_ck"
    victim_tok.mkdir()
    (victim_tok / "tokenizer.json").write_text("theirs")
    victim_recipe.write_text("theirs")
    shutil.rmtree(real / "tokenizer")
    (real / "tokenizer").symlink_to(victim_tok, target_is_directory=True)
    (real / "recipe.yaml").unlink()
    (real / "recipe.yaml").symlink_to(victim_recipe)
    code, err = run_main(capsys, recipe, "--training.resume_from_checkpoint=latest", "--training.max_steps=4")
    assert code == 2 and "Traceback" not in err
    [line] = error_lines(err)
    assert f"{out / 'recipe.yaml'} -> {victim_recipe}, {out / 'tokenizer'} -> {victim_tok} are symbolic links" in line
    assert f"rm {out / 'recipe.yaml'} {out / 'tokenizer'}" in line
    assert (victim_tok / "tokenizer.json").read_text() == "theirs" and victim_recipe.read_text() == "theirs"
    assert train_steps(out) == [1, 2, 3]

    (real / "tokenizer").unlink()
    (real / "recipe.yaml").unlink()
    victim_ckpt.mkdir()
    (victim_ckpt / "keep.txt").write_text("theirs")
    (real / "checkpoint-0000009").symlink_to(victim_ckpt, target_is_directory=True)
    code, err = run_main(capsys, recipe, "--training.overwrite_output_dir=true")
    assert code == 2 and "Traceback" not in err
    [line] = error_lines(err)
    assert f"{out / 'checkpoint-0000009'} -> {victim_ckpt} is a symbolic link" in line
    assert (victim_ckpt / "keep.txt").read_text() == "theirs" and (real / "checkpoint-0000003").is_dir()


# ---------------------------------------------------------------------------- a checkpoint without its manifest


def test_a_checkpoint_without_its_manifest_is_named_and_not_exported_unverified(tmp_path, capsys, caplog):
    """``latest`` passes over a ``checkpoint-N`` that lost its manifest.json with one warning naming it (it was
    silent), and ``hf-asyncpp export`` of it refuses, naming the folder and ``--unverified`` (it exported the files
    unverified, without a word)."""
    out = tmp_path / "run"
    recipe = recipe_file(tmp_path, out, training__max_steps=6, training__save_steps=3)
    code, err = run_main(capsys, recipe)
    assert code == 0, err
    bare = out / checkpoint_name(6)
    (bare / "manifest.json").unlink()

    caplog.set_level(logging.INFO)
    code, err = run_main(capsys, recipe, "--training.resume_from_checkpoint=latest", "--training.max_steps=7")
    assert code == 0, err
    [line] = [r.getMessage() for r in caplog.records if "checkpoint-0000006" in r.getMessage()
              and r.levelno == logging.WARNING]
    assert line.startswith("not resuming checkpoint-0000006: no manifest.json, so not a complete checkpoint"), line
    assert f"resumed from {out / checkpoint_name(3)} at step 3" in caplog.text
    assert train_steps(out) == list(range(1, 8))

    shutil.copytree(out / checkpoint_name(7), tmp_path / "bare")
    (tmp_path / "bare" / "manifest.json").unlink()
    assert export_main([str(tmp_path / "bare"), str(tmp_path / "refused")]) == 1
    err = capsys.readouterr().err
    assert f"error: {tmp_path / 'bare'}: no manifest.json, so its files cannot be verified" in err and "--unverified" in err
    assert not (tmp_path / "refused").exists()
    caplog.clear()
    assert export_main([str(tmp_path / "bare"), str(tmp_path / "exported"), "--unverified"]) == 0
    assert "exporting its files unverified (--unverified)" in caplog.text
    assert (tmp_path / "exported" / "config.json").is_file()


# ---------------------------------------------------------------------------- valid JSON, always


def _refuse(token: str):
    raise ValueError(f"{token} is not JSON")


def assert_strict_json(folder: Path) -> list[Path]:
    """Every JSON file under ``folder`` parses with NaN and Infinity refused (jq's and JavaScript's JSON); the files."""
    found = sorted(folder.rglob("*.json")) + sorted(folder.rglob("*.jsonl"))
    for path in found:
        text = path.read_text()
        for line in text.splitlines() if path.suffix == ".jsonl" else [text]:
            try:
                json.loads(line, parse_constant=_refuse)
            except ValueError as e:
                raise AssertionError(f"{path}: {e}") from None
    return found


def test_a_resume_with_nothing_left_to_train_writes_valid_json(tmp_path, capsys):
    """Resuming a finished pipelined run trains no step: it leaves the measured pipeline profile as it was (it
    wrote one of zeros, with a bubble of 0/0 as Python's NaN, which no other JSON reader accepts), and every JSON
    file of the folder stays strict JSON (tests/test_no_damage.py checks that nothing changes at all)."""
    out = tmp_path / "done"
    recipe = recipe_file(tmp_path, out, **ONE_STAGE)
    code, err = run_main(capsys, recipe)
    assert code == 0, err
    code, err = run_main(capsys, recipe, "--training.resume_from_checkpoint=latest")
    assert code == 0, err
    assert json.loads((out / "pipeline_profile.json").read_text())["simulated_steady_bubble"] is not None
    assert out / "pipeline_profile.json" in assert_strict_json(out)


def test_the_run_refuses_to_write_nan_into_json():
    """The run's one JSON writer: non-finite numbers become null; anything else non-JSON fails at the writer."""
    assert json.loads(json_text({"a": float("nan"), "b": [float("inf"), 1.5, (float("-inf"),)]})) == \
        {"a": None, "b": [None, 1.5, [None]]}


# ---------------------------------------------------------------------------- the step a non-finite error names


@pytest.mark.parametrize("schedule", ["none", "2bw"])
def test_the_non_finite_error_names_the_step_as_metrics_jsonl_numbers_it(tmp_path, schedule):
    """The step ``on_nonfinite: skip`` marks as skipped in metrics.jsonl is the one ``stop`` names, in the single
    process and in the pipeline (whose error comes from the step reports); the steps before it are in metrics.jsonl.
    (It named the step before: the engines count from 0, metrics.jsonl and the progress bar from 1.)"""
    blowup = dict(optimizer__name="sgd", optimizer__learning_rate=1e30, training__max_grad_norm=0.0,
                  training__max_steps=6, training__save_steps=0, pipeline__schedule=schedule, pipeline__num_stages=1)
    skipped = tmp_path / "skip"
    try:
        train(recipe_from_dict(tiny(skipped, **blowup, training__on_nonfinite="skip")))
    except NonFiniteError:  # skip mode gives up; the skipped step is recorded first
        pass
    assert_strict_json(skipped)  # a skipped step's non-finite loss or norm is null in metrics.jsonl
    rows = read_metrics(skipped / "metrics.jsonl")
    first = next(r["step"] for r in rows if r.get("skipped_nonfinite"))
    assert first > 1
    stopped = tmp_path / "stop"
    with pytest.raises(NonFiniteError) as e:
        train(recipe_from_dict(tiny(stopped, **blowup, training__on_nonfinite="stop")))
    assert str(e.value).startswith(f"step {first}: non-finite"), (first, str(e.value))
    assert train_steps(stopped) == list(range(1, first))


# ---------------------------------------------------------------------------- the data fingerprint


def same_size_edit(path: Path) -> None:
    """A word changed for another of its length: the size stays, the text (and the blocks the stream makes) not."""
    text = path.read_text()
    assert " the " in text
    path.write_text(text.replace(" the ", " tha "))


def test_the_fingerprint_is_the_data_the_run_opened_not_what_is_there_at_its_first_save(tmp_path):
    """Taken at the first save, a file deleted before it was recorded as missing, and a resume on the restored
    files then rewound the stream to their beginning."""
    from hf_asyncpp.run.checkpointer import Checkpointer
    from hf_asyncpp.topology import Topology

    data = tmp_path / "train.jsonl"
    shutil.copy(FIXTURE, data)
    recipe = recipe_from_dict(tiny(tmp_path / "run"))
    first = Checkpointer(tmp_path / "run", recipe, Topology(rank=0, world_size=1, num_stages=1), None, None, [str(data)])
    middle = Checkpointer(tmp_path / "run", recipe, Topology(rank=1, world_size=3, num_stages=3), None, None, [str(data)])
    data.unlink()  # gone before the first save (a cleanup, a moved mount), back before the resume
    assert first.data_files == [["train.jsonl", FIXTURE.stat().st_size, sampled_digest(str(FIXTURE))]]  # as opened
    assert middle.data_files[0][1] is None  # a middle stage never reads them: nothing taken at its start


def test_a_same_size_edit_of_a_training_file_is_named_on_resume(tmp_path, capsys, caplog):
    """The checkpoint's data fingerprint holds a digest of each file's bytes: a same-size edit is a change, named,
    and the stream starts at the beginning of the new text (it resumed at the old position on other text, silently).
    A copy of the files elsewhere is the same data; a checkpoint written before the digest ([name, size]) is compared
    as it was then."""
    data = tmp_path / "data" / "train.jsonl"
    data.parent.mkdir()
    shutil.copy(FIXTURE, data)
    out = tmp_path / "run"
    recipe = recipe_file(tmp_path, out, data__train_files=[str(data)], training__stop_after_steps=3)
    code, err = run_main(capsys, recipe)
    assert code == 0, err
    saved = out / checkpoint_name(3)
    assert ckpt.load_json(saved / RUN_STATE)["data_files"] == data_fingerprint([str(data)])
    resume = ("--training.resume_from_checkpoint=latest", "--training.stop_after_steps=null")

    def resumed(folder: Path, files: Path) -> str:
        caplog.clear()
        code, err = run_main(capsys, recipe, f"--training.output_dir={folder}", f"--data.train_files=[{files}]", *resume)
        assert code == 0, err
        return caplog.text

    caplog.set_level(logging.INFO)
    moved = tmp_path / "moved" / "train.jsonl"  # the same bytes in another folder: no warning
    moved.parent.mkdir()
    shutil.copy(data, moved)
    shutil.copytree(out, tmp_path / "a")
    assert "differ" not in resumed(tmp_path / "a", moved)

    same_size_edit(data)
    shutil.copytree(out, tmp_path / "b")
    log = resumed(tmp_path / "b", data)
    assert ("data.train_files differ from the ones checkpoint-0000003 was trained on: train.jsonl (the same size, "
            "other content): the data stream starts at the beginning of the new files") in log

    # an old checkpoint's fingerprint has no digest: name and size, as then (no warning for what it cannot see)
    shutil.copytree(out, tmp_path / "c")
    state = ckpt.load_json(tmp_path / "c" / checkpoint_name(3) / RUN_STATE)
    state["data_files"] = [entry[:2] for entry in state["data_files"]]
    (tmp_path / "c" / checkpoint_name(3) / RUN_STATE).write_text(json.dumps(state))
    (tmp_path / "c" / checkpoint_name(3) / "manifest.json").write_text(json.dumps(_rehashed(tmp_path / "c" / checkpoint_name(3))))
    assert "differ" not in resumed(tmp_path / "c", data)

    # a file larger than what is read of it: its ends and the sampled blocks
    big = tmp_path / "big.bin"
    big.write_bytes(bytes(range(256)) * (5 * 4096))  # 5 MiB
    before = sampled_digest(big)
    for offset in (10, big.stat().st_size - 10, 1 << 20):
        raw = bytearray(big.read_bytes())
        raw[offset] ^= 0xFF
        changed = tmp_path / "changed.bin"
        changed.write_bytes(bytes(raw))
        assert sampled_digest(changed) != before, offset


def _rehashed(path: Path) -> dict:
    """The checkpoint's manifest with its files' sizes and sha256 as they are now (a run_state.json edited on
    purpose must still verify)."""
    manifest = ckpt.load_json(path / "manifest.json")
    for name in manifest["files"]:
        manifest["files"][name] = {"size": (path / name).stat().st_size, "sha256": ckpt.sha256_of(path / name)}
    return manifest


# ---------------------------------------------------------------------------- what the launcher leaves in /tmp


def test_the_launcher_leaves_nothing_in_the_temporary_folder(tmp_path):
    """``hf-asyncpp train`` starting its own stage processes: torchrun's logs go into the launcher's own temporary
    folder, removed at the end (one /tmp/torchelastic_* per run piled up), and the folder a SIGKILLed launcher left
    behind (its cleanup never ran) is removed by the next launcher; a live launcher's folder is not."""
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    gone = subprocess.Popen(["true"])
    gone.wait()  # a pid that no longer runs
    stale, live = tmp / f"hf_asyncpp-errors-{gone.pid}-x1", tmp / f"hf_asyncpp-errors-{os.getpid()}-x2"
    for folder in (stale, live):
        (folder / "torchelastic").mkdir(parents=True)
    recipe = recipe_file(tmp_path, tmp_path / "run", pipeline__schedule="2bw", pipeline__num_stages=2,
                         training__max_steps=2, training__save_steps=0)
    env = {**os.environ, "TMPDIR": str(tmp), "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    r = subprocess.run([sys.executable, str(ROOT / "scripts/pretrain.py"), recipe], cwd=tmp_path, env=env,
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    assert "starting 2 local processes" in r.stdout
    left = sorted(p.name for p in tmp.iterdir() if p.name.startswith(("torchelastic_", "hf_asyncpp-errors-")))
    assert left == [live.name], left
