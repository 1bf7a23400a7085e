"""The last unchecked inputs, and the commands that could lose a model or a run without a word.

Each used to pass silently or end in rank tracebacks: ``export`` into another run's ``export/`` replaced that model
(exit 0); ``resume_from_checkpoint=latest`` into a misspelt folder trained from scratch; ``plan --gpu-memory 80``
planned for 80 bytes; ``layers_per_stage: [2, 0]`` passed the check and failed in the ranks; a typo in
``lr_scheduler_kwargs`` gave a ``TypeError`` per rank; a pretrained model with another model's tokenizer trained
silently. Each is now one ``error:`` line naming the field or file and the fix, a non-zero exit code, and nothing
written that the user did not ask for (checked by hashing the folders)."""
from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from hf_asyncpp.cli.export import main as export_main
from hf_asyncpp.cli.plan import main as plan_main
from hf_asyncpp.data.tokenizer import train_tokenizer
from support import DIMS, FIXTURE, ROOT, record_errors, recipe_file, run_main, train_steps


def tree(root: Path) -> dict[str, str]:
    """Every file under ``root`` by its sha256 (a folder as such)."""
    return {str(p.relative_to(root)): "dir" if p.is_dir() else hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*"))}


def error_lines(err: str) -> list[str]:
    return [line for line in err.splitlines() if line.startswith("error:")]


# ---------------------------------------------------------------------------- export


def hand_checkpoint(folder: Path, seed: int) -> Path:
    """A checkpoint folder as a run writes it for one stage (``model.safetensors`` and ``config.json``), without a
    manifest (exported with ``--unverified``): a tiny llama initialized from ``seed``."""
    from transformers import AutoConfig, AutoModelForCausalLM

    folder.mkdir(parents=True)
    torch.manual_seed(seed)
    config = AutoConfig.for_model("llama", **DIMS, num_hidden_layers=2, vocab_size=64)
    model = AutoModelForCausalLM.from_config(config).float()
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(folder / "model.safetensors"))
    config.to_json_file(str(folder / "config.json"))
    return folder


def export(capsys, *argv) -> tuple[int, str]:
    code = export_main([*map(str, argv), "--unverified"])
    err = capsys.readouterr().err
    record_errors("hf-asyncpp export", code, err)
    return code, err


def test_export_never_replaces_another_model_unless_asked(tmp_path, capsys):
    """Another model's folder (another run's ``export/``) is refused, untouched, unless ``--overwrite``; the same
    checkpoint exported again into its own earlier export is allowed (the weights there are its own)."""
    from transformers import AutoModelForCausalLM

    mine, other = hand_checkpoint(tmp_path / "mine" / "checkpoint-0000020", 0), \
        hand_checkpoint(tmp_path / "other" / "checkpoint-0000400", 1)
    out = tmp_path / "other" / "export"
    assert export(capsys, other, out)[0] == 0
    assert export(capsys, other, out)[0] == 0  # the same checkpoint again: its own folder
    before = tree(out)
    code, err = export(capsys, mine, out)
    [line] = error_lines(err)
    assert code == 1 and line == (f"error: export: {out} holds another model (README.md, config.json, "
                                  "generation_config.json, model.safetensors), which this export would replace; "
                                  "choose another folder, or pass --overwrite to replace it"), err
    assert tree(out) == before and sorted(p.name for p in out.parent.iterdir()) == ["checkpoint-0000400", "export"]
    assert export(capsys, mine, out, "--overwrite")[0] == 0  # asked: replaced
    reloaded = AutoModelForCausalLM.from_pretrained(out).state_dict()
    from safetensors.torch import load_file

    assert all(torch.equal(reloaded[k], v) for k, v in load_file(str(mine / "model.safetensors")).items())


# ---------------------------------------------------------------------------- resume


def test_resume_latest_with_nothing_to_resume_is_one_line_unless_a_restart(tmp_path, capsys, monkeypatch):
    """``latest`` into a misspelt folder made nothing (no folder, no tokenizer); a torchrun restart of a start
    that saved nothing takes the folder over (its first start may have died before any checkpoint)."""
    monkeypatch.delenv("TORCHELASTIC_RESTART_COUNT", raising=False)
    out = tmp_path / "run"
    recipe = recipe_file(tmp_path, out, training__max_steps=2, training__save_steps=2)
    code, err = run_main(capsys, recipe, "--training.output_dir", str(tmp_path / "rnu"),
                         "--training.resume_from_checkpoint=latest")
    assert code == 5 and error_lines(err) == [
        f"error: MissingCheckpoint: training.resume_from_checkpoint=latest: nothing to resume in {tmp_path / 'rnu'}: no such folder (a "
        "misspelt output_dir?); point training.output_dir at the run to continue, or drop resume_from_checkpoint to "
        "start afresh"], err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run.yaml"]
    # a start that saved nothing: its tokenizer, its metrics, the temporary folder of a save that never completed
    out.mkdir()
    (out / "metrics.jsonl").write_text(json.dumps({"step": 1, "loss": 5.0}) + "\n")
    (out / ".tmp-checkpoint-0000002").mkdir()
    code, err = run_main(capsys, recipe, "--training.resume_from_checkpoint=latest")
    [line] = error_lines(err)
    assert code == 5 and "it holds no complete checkpoint (.tmp-checkpoint-0000002, metrics.jsonl)" in line, err
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")  # torchrun's restart of that start: takes it over
    code, err = run_main(capsys, recipe, "--training.resume_from_checkpoint=latest")
    assert code == 0 and not error_lines(err), err
    assert train_steps(out) == [1, 2] and not list(out.glob(".tmp-checkpoint-*"))


def test_a_wrong_checkpoint_path_says_what_it_is_and_lists_the_run_s_checkpoints(tmp_path, capsys):
    """A checkpoint's file given as the resume path was called "not a complete checkpoint (no manifest.json)" with an
    empty list, and ``export`` of a step never saved did not list the steps that were."""
    out = tmp_path / "run"
    recipe = recipe_file(tmp_path, out, training__max_steps=2, training__save_steps=1)
    assert run_main(capsys, recipe)[0] == 0
    for given, what, said in ((out / "checkpoint-0000002" / "manifest.json", "a file, not a checkpoint folder",
                               "is a file, not a checkpoint folder"),
                              (out / "checkpoint-0000500", "no such folder", "does not exist")):
        code, err = run_main(capsys, recipe, f"--training.resume_from_checkpoint={given}")
        assert code == 5 and error_lines(err) == [
            f"error: MissingCheckpoint: training.resume_from_checkpoint: '{given}' {said}; the complete checkpoints "
            f"in {out} are checkpoint-0000001, checkpoint-0000002"], err
        code, err = export(capsys, given, tmp_path / "hf")
        assert code == 1 and error_lines(err) == [
            f"error: {given}: {what}; the complete checkpoints in {out} are checkpoint-0000001, checkpoint-0000002"], err
    assert not (tmp_path / "hf").exists()


# ---------------------------------------------------------------------------- recipe checks


def test_a_stage_of_no_layers_is_refused_before_any_process_starts(tmp_path, capsys):
    out = tmp_path / "run"
    recipe = recipe_file(tmp_path, out, pipeline__schedule="2bw", pipeline__num_stages=2,
                         pipeline__layers_per_stage=[2, 0])
    code, err = run_main(capsys, recipe)
    assert code == 2 and error_lines(err) == [
        "error: pipeline.layers_per_stage: [2, 0] must have 2 positive integers summing to the 2 decoder layers (it "
        "has 2 entries summing to 2)"], err
    assert not out.exists()


def test_lr_scheduler_kwargs_are_the_schedule_functions_arguments(tmp_path, capsys):
    """Read from transformers' own schedule function for the type (``TYPE_TO_SCHEDULER_FUNCTION``), so a key it
    takes passes and a misspelt one gets a did-you-mean; a value it refuses is named too, all before any process
    starts."""
    out = tmp_path / "run"
    recipe = recipe_file(tmp_path, out, training__lr_scheduler_type="cosine_with_min_lr")
    code, err = run_main(capsys, recipe, "--training.lr_scheduler_kwargs={min_lr_rat: 0.1}")
    assert code == 2 and error_lines(err) == [
        "error: training.lr_scheduler_kwargs.min_lr_rat: not an argument of transformers' "
        "get_cosine_with_min_lr_schedule_with_warmup (lr_scheduler_type 'cosine_with_min_lr'); did you mean "
        "'min_lr_rate'?"], err
    code, err = run_main(capsys, recipe, "--training.lr_scheduler_kwargs={}")  # it needs min_lr or min_lr_rate
    [line] = error_lines(err)
    assert code == 2 and line.startswith("error: training.lr_scheduler_kwargs: {} for lr_scheduler_type "
                                         "'cosine_with_min_lr' is refused by transformers' get_cosine_with_min_lr"), err
    code, err = run_main(capsys, recipe, "--training.lr_scheduler_type=constant",
                         "--training.lr_scheduler_kwargs={num_cycles: 2}")
    assert code == 2 and error_lines(err) == [
        "error: training.lr_scheduler_kwargs.num_cycles: not an argument of transformers' get_constant_schedule "
        "(lr_scheduler_type 'constant'); it takes none: remove lr_scheduler_kwargs"], err
    assert not out.exists()


def test_plan_refuses_a_memory_size_without_a_unit(capsys):
    """``--gpu-memory 80`` planned for 80 bytes ("0 of 20 plans fit"); units stay as they were."""
    from hf_asyncpp.cli.plan import parse_bytes

    assert plan_main(["recipes/cpu-tiny.yaml", "--top", "0", "--gpu-memory", "80"]) == 2
    err = capsys.readouterr().err
    record_errors("hf-asyncpp plan", 2, err)
    assert err == "error: --gpu-memory: '80' has no unit (or is not positive); write it with one, e.g. 80GB\n"
    assert (parse_bytes("80GB"), parse_bytes("80GiB"), parse_bytes("512mb"), parse_bytes("1000B")) == (8e10, 8e10, 5.12e8, 1e3)
    for bad in ("0GB", "abc", "-1GB"):
        with pytest.raises(ValueError, match="e.g."):
            parse_bytes(bad)


def test_a_pretrained_model_refuses_a_tokenizer_that_is_not_its_own(tmp_path, capsys):
    """The export of such a run paired 4,096 embeddings with a 1,000-token tokenizer. The model's own tokenizer,
    given by path, passes; so does one with tokens added at its end (the embeddings grow to it)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    own = train_tokenizer([str(FIXTURE)], 320)
    (tmp_path / "corpus.txt").write_text("zebra quokka " * 200 + "".join(chr(0x3b1 + i % 20) for i in range(3000)))
    other = train_tokenizer([str(tmp_path / "corpus.txt")], 280)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model("llama", **DIMS, num_hidden_layers=2, vocab_size=len(own)))
    model.save_pretrained(tmp_path / "my-model")
    own.save_pretrained(tmp_path / "my-model")
    other.save_pretrained(tmp_path / "other-tok")
    extended = train_tokenizer([str(FIXTURE)], 320)
    extended.add_tokens(["<added-1>", "<added-2>"])
    extended.save_pretrained(tmp_path / "extended-tok")
    out = tmp_path / "run"
    recipe = recipe_file(tmp_path, out, model__config=None, model__name_or_path=str(tmp_path / "my-model"))
    code, err = run_main(capsys, recipe, f"--model.tokenizer_name_or_path={tmp_path / 'other-tok'}")
    assert code == 2 and error_lines(err) == [
        f"error: model.tokenizer_name_or_path: '{tmp_path / 'other-tok'}' (280 tokens) is not the tokenizer "
        f"model.name_or_path '{tmp_path / 'my-model'}' was trained with (320 tokens, other ids): its 320 embeddings "
        "would mean other tokens; drop model.tokenizer_name_or_path to use the model's own, or train model.config "
        "from random init for a new vocabulary"], err
    assert not out.exists()  # made, as training would, and removed again: the start failed with nothing in it
    from hf_asyncpp.config.recipe import load_recipe
    from hf_asyncpp.run.preflight import check_model

    for tok in ("my-model", "extended-tok"):
        r = load_recipe(recipe, [f"--model.tokenizer_name_or_path={tmp_path / tok}"])
        assert check_model(r.model, r.data).vocab_size == 320


def test_hub_model_id_is_checked_without_the_network(tmp_path, capsys):
    out = tmp_path / "run"
    recipe = recipe_file(tmp_path, out, hub__push_to_hub=True, hub__hub_model_id="not a valid id!!")
    code, err = run_main(capsys, recipe)
    [line] = error_lines(err)
    assert code == 2 and line.startswith("error: hub.hub_model_id: Repo id must use alphanumeric chars") \
        and line.endswith("'not a valid id!!'. Write it as user/name"), err


def test_a_hub_out_of_reach_is_asked_once_then_the_cache_is_used_or_one_line_says_how(tmp_path, capsys, monkeypatch):
    """Without HF_HUB_OFFLINE on a machine that cannot reach the Hub, each load retried five times with backoff (11
    retry lines and 38 s for one model id) before an error that did not name the way out. Now one request finds the
    Hub out of reach (here an endpoint nothing listens on): a model in the cache is read from it and the run goes
    offline (for the ranks too: the environment); one that is not gets one line with the fix, and no folder is left."""
    from huggingface_hub import constants
    from transformers import AutoConfig, AutoModelForCausalLM

    from hf_asyncpp.config.recipe import load_recipe
    from hf_asyncpp import offline
    from hf_asyncpp.run.preflight import check_model

    cache = tmp_path / "hub-cache"
    snapshot = cache / "models--someone--tiny" / "snapshots" / ("0" * 40)  # huggingface_hub's cache layout
    torch.manual_seed(0)
    tok = train_tokenizer([str(FIXTURE)], 320)
    AutoModelForCausalLM.from_config(AutoConfig.for_model("llama", **DIMS, num_hidden_layers=2,
                                                          vocab_size=len(tok))).save_pretrained(snapshot)
    tok.save_pretrained(snapshot)
    (cache / "models--someone--tiny" / "refs").mkdir()
    (cache / "models--someone--tiny" / "refs" / "main").write_text("0" * 40)
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(constants, "ENDPOINT", "http://127.0.0.1:9")  # the discard port: refused at once
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(offline, "_said", [])
    offline.hub_unreachable.cache_clear()
    out = tmp_path / "run"
    recipe = recipe_file(tmp_path, out, model__config=None, model__name_or_path="someone/other")
    code, err = run_main(capsys, recipe)
    assert code == 2 and error_lines(err) == [
        "error: model.name_or_path: 'someone/other': the Hub (http://127.0.0.1:9) cannot be reached (ConnectError: "
        f"[Errno 111] Connection refused) and 'someone/other' is not in the cache ({cache}); download it where the "
        "Hub is reachable (`hf download someone/other`, into the same cache or HF_HOME), give a local folder, or set "
        "HF_HUB_OFFLINE=1 once the cache holds it"], err
    assert not out.exists() and not constants.HF_HUB_OFFLINE and "Retrying" not in err
    r = load_recipe(recipe, ["--model.name_or_path=someone/tiny"])
    assert check_model(r.model, r.data).vocab_size == len(tok)  # from the cache
    assert constants.HF_HUB_OFFLINE and os.environ["HF_HUB_OFFLINE"] == "1"  # and offline from then on
    said = capsys.readouterr().out
    assert said.count("cannot be reached") == 1 and "model.name_or_path 'someone/tiny' is in the cache" in said, said
    offline.hub_unreachable.cache_clear()


def test_a_failed_start_leaves_no_folder_and_an_unwritable_one_exits_4(tmp_path, capsys):
    """Failed starts left an empty output folder each (27 after a morning of mistakes). A folder that existed
    before is kept, whatever the failure; one the run cannot write is a write error (4), as the exit-code table says."""
    out = tmp_path / "new" / "run"
    recipe = recipe_file(tmp_path, out, data__train_files=[str(tmp_path / "missing-*.jsonl")])
    code, err = run_main(capsys, recipe)
    assert code == 6 and len(error_lines(err)) == 1 and not out.exists(), err
    out.mkdir()
    code, err = run_main(capsys, recipe)
    assert code == 6 and out.is_dir() and list(out.iterdir()) == [], err
    (tmp_path / "file").write_text("x")
    code, err = run_main(capsys, recipe, f"--training.output_dir={tmp_path / 'file' / 'run'}")
    [line] = error_lines(err)
    assert code == 4 and line.startswith("error: WriteError: training.output_dir:") and "cannot be written" in line, err


# ---------------------------------------------------------------------------- the small tools


def tool(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    return subprocess.run([sys.executable, "-m", "hf_asyncpp", *args], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=300)


def test_the_small_tools_refuse_counts_out_of_range_in_argparses_line_and_a_typo_gets_a_did_you_mean(tmp_path):
    """``compare --steps 0``, ``timeline --stages 0`` and ``evaluate --limit -1`` ended in tracebacks (or blamed the
    task file); now argparse's usage line and one line naming the option, exit code 2, before anything runs."""
    for args, option in ((("compare", "recipes/cpu-tiny.yaml", "--steps", "0"), "--steps: 0"),
                         (("timeline", "--stages", "0", "--out", str(tmp_path / "t.png")), "--stages: 0"),
                         (("evaluate", str(tmp_path), "--data", str(FIXTURE), "--limit", "-1"), "--limit: -1")):
        r = tool(*args)
        assert r.returncode == 2 and r.stderr.splitlines()[-1] == (
            f"hf-asyncpp {args[0]}: error: argument {option} is out of range; allowed: >= 1"), r.stderr
    assert list(tmp_path.iterdir()) == []
    r = tool("trian")
    assert r.returncode == 2 and r.stderr.splitlines()[0] == "error: unknown command 'trian'; did you mean 'train'?"
    r = tool("timeline", "--schedule", "1f1b", "--steps", "2", "--out", str(tmp_path / "t.png"))
    assert r.returncode == 0 and "nan" not in r.stdout and "steady-state bubble n/a (no steady state: draw --steps 3" \
        in r.stdout, r.stdout


def test_evaluate_names_its_own_flag_for_a_missing_text_column_once(tmp_path):
    """The screening's line named ``data.text_column``, a recipe field, where evaluate's flag is ``--text-column``,
    and a warning said the same before the error."""
    from transformers import AutoConfig, AutoModelForCausalLM

    tok = train_tokenizer([str(FIXTURE)], 320)
    AutoModelForCausalLM.from_config(AutoConfig.for_model("llama", **DIMS, num_hidden_layers=2, vocab_size=len(tok))
                                     ).save_pretrained(tmp_path / "model")
    tok.save_pretrained(tmp_path / "model")
    data = tmp_path / "content.jsonl"
    data.write_text("".join(json.dumps({"content": f"document {i} " * 30}) + "\n" for i in range(20)))
    r = tool("evaluate", str(tmp_path / "model"), "--data", str(data), "--out", str(tmp_path / "eval"))
    assert r.returncode == 1 and r.stderr.splitlines()[-1:] == [
        f"error: --data: no usable file: --text-column: 'text' is not a column of {data} (columns: ['content'])"], r.stderr
    assert "skipping" not in r.stderr + r.stdout and not (tmp_path / "eval").exists()
