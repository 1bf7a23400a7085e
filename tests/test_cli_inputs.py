"""``hf-asyncpp train`` as a new user meets it: ``--help`` lists every recipe field with its default (from the
dataclasses), ``--help`` and a recipe mistake answer before torch, transformers and datasets are imported (a missing
recipe file took 9.6 s), and a model type transformers does not know is one short line before anything runs."""
from __future__ import annotations

import dataclasses
import os
import re
import subprocess
import sys
import typing

import yaml

from hf_asyncpp.config.recipe import Recipe
from hf_asyncpp.config.reference import as_typed
from support import ROOT, record_errors, tiny

HEAVY = ("torch", "transformers", "datasets")


def run(*code_or_args: str, cwd=ROOT) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    for name in ("LOCAL_RANK", "TORCHELASTIC_RUN_ID", "SLURM_PROCID", "HF_ASYNCPP_DEBUG"):
        env.pop(name, None)
    r = subprocess.run([sys.executable, *code_or_args], cwd=cwd, env=env, capture_output=True, text=True, timeout=300)
    if code_or_args[:2] == ("-m", "hf_asyncpp"):  # a command as typed (a -c script's exit code is the script's)
        record_errors("hf-asyncpp train", r.returncode, r.stderr)
    return r


def test_help_lists_every_field_with_its_default():
    r = run("-m", "hf_asyncpp", "train", "--help")
    assert r.returncode == 0, r.stderr
    sections = typing.get_type_hints(Recipe)
    for section in dataclasses.fields(Recipe):
        for f in dataclasses.fields(sections[section.name]):
            default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
            flag = f"--{section.name}.{f.name}={as_typed(default)}"
            assert re.search(rf"^    {re.escape(flag)}( |$)", r.stdout, re.M), flag
    assert "--training.max_steps=100 " in r.stdout and "--training.report_to=[tensorboard] " in r.stdout
    assert "--section.field value" in r.stdout and "--block_size" in r.stdout
    assert max(map(len, r.stdout.splitlines())) <= 120


def test_help_and_recipe_mistakes_answer_before_the_training_machinery_is_imported(tmp_path):
    """Deterministic where a wall-clock bound would not be on a shared machine: what takes the seconds is never
    imported. The line and exit code are the ones the full machinery prints."""
    recipe = tmp_path / "r.yaml"
    recipe.write_text(yaml.safe_dump(tiny(tmp_path / "run")))
    code = (
        "import sys\nfrom hf_asyncpp.cli.train import main\n"
        f"codes = [main(['--help']), main(['{tmp_path}/missing.yaml']), main(['{recipe}', '--block_size', '256']),\n"
        f"         main(['{recipe}', '--training.max_stepz=5']), main(['{recipe}', '--training.max_steps']),\n"
        f"         main(['{tmp_path}']), main(['{tmp_path}/list.yaml']), main(['{tmp_path}/latin1.yaml'])]\n"
        f"print(codes, [m for m in {HEAVY!r} if m in sys.modules], file=sys.stderr)\n")
    (tmp_path / "list.yaml").write_text("- model\n- data\n")
    (tmp_path / "latin1.yaml").write_bytes("training:\n  output_dir: caf\xe9\n".encode("latin-1"))
    r = run("-c", code, cwd=tmp_path)
    lines = [line for line in r.stderr.splitlines() if line.startswith("error:")]
    assert r.stderr.splitlines()[-1] == "[0, 2, 2, 2, 2, 2, 2, 2] []", r.stderr[-3000:]
    record_errors("hf-asyncpp train", 2, r.stderr)  # each of those lines came with exit code 2
    assert lines == [
        f"error: recipe file '{tmp_path}/missing.yaml' not found",
        "error: --block_size: run_clm's name; here it is --data.seq_len (tokens per packed training block)",
        lines[2],
        "error: --training.max_steps: no value given (an integer); write --training.max_steps=VALUE or "
        "--training.max_steps VALUE",
        f"error: recipe file '{tmp_path}' is a folder; give the recipe's YAML file (e.g. recipes/cpu-tiny.yaml)",
        f"error: recipe file '{tmp_path}/list.yaml' holds a YAML list, not a mapping of sections (model:, data:, "
        "training:, ...); see recipes/cpu-tiny.yaml",
        f"error: recipe file '{tmp_path}/latin1.yaml' is not UTF-8 text (invalid continuation byte at byte 27); "
        "save it as UTF-8",
    ]
    assert lines[2].startswith("error: --training.max_stepz: unknown field; did you mean 'max_steps'?")
    assert not (tmp_path / "run").exists()


def test_an_unknown_model_type_is_one_short_line_before_anything_runs(tmp_path, capsys):
    """It used to come after the output folder was made and a tokenizer trained, as an 11,737-character line
    listing every model type."""
    from hf_asyncpp.cli.train import main

    recipe = tmp_path / "r.yaml"
    recipe.write_text(yaml.safe_dump(tiny(tmp_path / "run")))
    assert main([str(recipe), "--model.config.model_type", "lama"]) == 2
    err = capsys.readouterr().err.strip()
    record_errors("hf-asyncpp train", 2, err)
    assert err.startswith("error: model.config.model_type: 'lama' is not a model type transformers") and "'llama'" in err
    assert "\n" not in err and len(err) < 300
    assert not (tmp_path / "run").exists()  # nothing made, no tokenizer trained


def test_the_debug_flag_read_before_the_imports_is_the_launchers():
    """``cli/train.py`` reads ``--debug`` and ``HF_ASYNCPP_DEBUG`` before ``launch.failures`` (and torch) is imported;
    they must stay the ones every started process reads."""
    from hf_asyncpp.cli import train
    from hf_asyncpp.launch import failures

    assert (train.DEBUG_FLAG, train.DEBUG_ENV) == (failures.DEBUG_FLAG, failures.DEBUG_ENV)


TOOLS = {"plan": ["recipes/cpu-tiny.yaml"], "timeline": [], "evaluate": ["model"], "export": ["ckpt", "out"],
         "compare": ["recipes/cpu-tiny.yaml", "--steps", "3"], "prepare-data": [], "train": ["recipes/cpu-tiny.yaml"]}
"""Each command with arguments that parse (nothing runs: each call below adds a bad flag or --help)."""


def test_every_commands_argument_errors_come_before_torch_is_imported():
    """argparse's usage line, and ``--help``, of every command answer without importing torch, transformers or
    datasets (seconds on a loaded machine): as typed, and for all commands in one process."""
    r = run("-X", "importtime", "-m", "hf_asyncpp", "plan", "x.yaml", "--bad-flag")
    assert r.returncode == 2 and "unrecognized arguments: --bad-flag" in r.stderr, r.stderr[-2000:]
    imported = {line.rsplit("|", 1)[-1].strip() for line in r.stderr.splitlines() if line.startswith("import time:")}
    assert "hf_asyncpp.config.recipe" in imported and not imported & set(HEAVY), sorted(imported & set(HEAVY))
    code = ("import sys\nfrom hf_asyncpp.cli import main\ncodes = []\n"
            f"for name, args in {TOOLS!r}.items():\n"
            "    for extra in ('--bad-flag', '--help'):\n"
            "        try:\n            codes.append(main([name, *args, extra]))\n"
            "        except SystemExit as e:\n            codes.append(e.code)\n"
            f"print(codes, [m for m in {HEAVY!r} if m in sys.modules], file=sys.stderr)\n")
    r = run("-c", code)
    assert r.stderr.splitlines()[-1] == f"{[2, 0] * len(TOOLS)} []", r.stderr[-3000:]
    assert r.stderr.count("unrecognized arguments: --bad-flag") == len(TOOLS) - 1  # train names the flag its own way


def test_every_tool_spells_its_outputs_the_same_way(tmp_path, capsys):
    """``--out DIR``: the folder a tool writes into, for every tool; ``--png FILE``: the picture's own path, where a
    tool draws one; as the README says. ``timeline --out FILE.png`` (the old spelling) still works."""
    from hf_asyncpp.cli import main

    for name in ("plan", "timeline", "evaluate", "compare", "export"):
        try:
            main([name, "--help"])
        except SystemExit:
            pass
        text = capsys.readouterr().out
        assert "--out DIR" in text, name
        assert ("--png FILE" in text) == (name in ("plan", "timeline")), name
    readme = (ROOT / "README.md").read_text()
    assert "`--out DIR`" in readme and "`--png FILE`" in readme
    small = ["--stages", "2", "--microbatches", "2"]
    assert main(["timeline", *small, "--out", str(tmp_path / "figures")]) == 0
    assert main(["timeline", *small, "--png", str(tmp_path / "mine.png")]) == 0
    assert main(["timeline", *small, "--out", str(tmp_path / "old.png")]) == 0
    assert main(["plan", str(ROOT / "recipes" / "cpu-tiny.yaml"), "--top", "0", "--out", str(tmp_path / "plans")]) == 0
    written = sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*.png"))
    assert written == ["figures/2bw.png", "mine.png", "old.png", "plans/cpu-tiny-2stages.png"], written
    for args, why in ((["ckpt"], "give the output folder: OUT or --out DIR"),
                      (["ckpt", "a", "--out", "b"], "two output folders, a and --out b: give one")):
        try:
            main(["export", *args])
        except SystemExit as e:
            assert e.code == 2
        assert why in capsys.readouterr().err


def test_the_schedules_import_torch_only_for_a_virtual_stage_order():
    """What the recipe's checks and ``hf-asyncpp timeline`` of a one-stage-per-rank schedule load: the schedule floor
    and its simulator without torch; torch comes with a virtual-stage order (``schedules/torch_orders.py``)."""
    r = run("-c", "import sys; from hf_asyncpp.schedules import TWO_BW, ZBV, simulate; "
                  "simulate(TWO_BW.actions(4, 8, 2)); print(sorted(set(sys.modules) & set(HEAVY))); "
                  "ZBV.actions(2, 4, 1); print('torch' in sys.modules)".replace("HEAVY", repr(HEAVY)))
    assert r.returncode == 0 and r.stdout.split("\n")[:2] == ["[]", "True"], r.stdout + r.stderr[-2000:]
