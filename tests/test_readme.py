"""The README's own sequence runs as written, in order, after its main job: each command of its "Your own runs"
block, started as a user types it (``accelerate`` and ``hf-asyncpp`` from the environment, in a fresh folder with the
checkout's ``recipes/``, ``scripts/`` and ``data/``). Only the cost is cut: the training commands get fewer steps and a
slice of the corpus as extra overrides after the README's own (the last one given wins), and the zero-shot tasks,
which come from the Hub, are read from the test fixtures (``--task-file``, the network edge). A command that meets
the folder of one before it, names a checkpoint the main job never writes, or fails in any way fails the test."""
from __future__ import annotations

import glob
import os
import re
import shlex
import subprocess
import sys
import time
from pathlib import Path

from hf_asyncpp.config.recipe import load_recipe
from hf_asyncpp.storage.names import checkpoint_name
from support import FIXTURE, ROOT, TASK_FILES

MAIN_JOB = ["hf-asyncpp", "train", "recipes/cpu-tiny.yaml"]  # scripts/train.sh's last line
STEPS = 4
TRAINING_CAPS = [f"--training.max_steps={STEPS}", f"--training.save_steps={STEPS}", "--training.eval_steps=2",
                 "--data.eval_blocks=4", f"--data.train_files={FIXTURE}"]


def readme_commands() -> list[list[str]]:
    """The commands of the README's "Your own runs" block, comments dropped, globs left for the shell to expand."""
    text = (ROOT / "README.md").read_text()
    block = re.search(r"^Your own runs.*?```bash\n(.*?)```", text, re.S | re.M).group(1)
    return [shlex.split(line, comments=True) for line in block.splitlines() if line.strip()]


def last_checkpoint_of_the_main_job() -> str:
    """The newest checkpoint the default recipe keeps: the main job's last save (its final step)."""
    t = load_recipe(ROOT / "recipes" / "cpu-tiny.yaml").training
    return checkpoint_name(t.max_steps if t.save_steps else 0)


def capped(cmd: list[str]) -> list[str]:
    """``cmd`` with its cost cut and nothing else changed."""
    if cmd[:2] == ["accelerate", "launch"] or cmd[:2] == ["hf-asyncpp", "train"]:
        return [*cmd, *TRAINING_CAPS]
    if cmd[:2] == ["hf-asyncpp", "compare"]:
        return [*cmd, "--steps", str(STEPS), *TRAINING_CAPS[3:]]
    if cmd[:2] == ["hf-asyncpp", "export"]:  # the capped main job's last checkpoint for the default recipe's
        return [a.replace(last_checkpoint_of_the_main_job(), checkpoint_name(STEPS)) for a in cmd]
    if cmd[:2] == ["hf-asyncpp", "evaluate"] and "--tasks" in cmd:
        tasks = cmd[cmd.index("--tasks") + 1].split(",")
        return [*cmd, *(a for t in tasks for a in ("--task-file", f"{t}={TASK_FILES[t]}"))]
    return cmd


def run(cmd: list[str], cwd: Path, env: dict) -> str:
    """``cmd`` run in ``cwd``, its globs expanded there as the shell would."""
    line = " ".join(shlex.quote(a) for a in cmd)
    args = [m for a in cmd for m in ((sorted(glob.glob(a, root_dir=cwd)) or [a]) if "*" in a else [a])]
    t0 = time.time()
    r = subprocess.run(args, cwd=cwd, env=env, capture_output=True, text=True, timeout=600)
    print(f"{time.time() - t0:6.1f} s  $ {line}")
    assert r.returncode == 0, f"$ {line}\nexit {r.returncode}\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}"
    return r.stdout + r.stderr


def test_the_readme_sequence_runs_as_written_after_the_main_job(tmp_path):
    commands = readme_commands()
    exports = [c for c in commands if c[:2] == ["hf-asyncpp", "export"]]
    assert exports and all(last_checkpoint_of_the_main_job() in " ".join(c) for c in exports), exports
    for name in ("recipes", "scripts", "data"):
        (tmp_path / name).symlink_to(ROOT / name)
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
           "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
    for name in ("LOCAL_RANK", "RANK", "WORLD_SIZE", "TORCHELASTIC_RUN_ID", "HF_ASYNCPP_NO_SPAWN", "HF_ASYNCPP_DEBUG"):
        env.pop(name, None)
    before = checkout_status()
    assert (ROOT / "scripts" / "train.sh").read_text().rstrip().splitlines()[-1] == f'exec {" ".join(MAIN_JOB)} "$@"'
    out = {"main job": run([*MAIN_JOB, *TRAINING_CAPS], tmp_path, env)}
    assert "OMP_NUM_THREADS" not in out["main job"], out["main job"][:2000]  # no launcher banner before its lines
    assert (tmp_path / "runs" / "cpu-tiny" / checkpoint_name(STEPS)).is_dir()
    for cmd in commands:
        out[" ".join(cmd[:3])] = run(capped(cmd), tmp_path, env)
    for folder in ("runs/a/export", "runs/b/export", "runs/c/export", "out"):
        assert (tmp_path / folder / "config.json").is_file(), folder
    assert "perplexity" in out["hf-asyncpp evaluate out/"]
    assert any(tmp_path.glob("eval-*/eval_results.png"))  # the side-by-side chart, in a new folder where it ran
    assert (tmp_path / "moe-10b-8stages.png").is_file() and (tmp_path / "2bw.png").is_file()
    assert (tmp_path / "runs" / "compare-cpu-tiny" / "compare.json").is_file()
    a = tmp_path / "runs" / "a"  # accelerate's one process, which started the 2 stages
    assert {p.name for p in (a / checkpoint_name(STEPS)).iterdir()} >= {"stage-00.safetensors", "stage-01.safetensors"}
    assert (a / "export" / "model.safetensors.index.json").is_file()  # one shard per stage
    assert checkout_status() == before  # every tool wrote where it ran, nothing into the checkout
    noisy = [name for name, text in out.items() if "had defaults used instead" in text]
    assert noisy == [], f"accelerate warns about the defaults it used: {noisy}"


def checkout_status() -> str:
    return subprocess.run(["git", "status", "--porcelain", "--untracked-files=all"], cwd=ROOT, capture_output=True,
                          text=True).stdout
