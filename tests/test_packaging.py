"""A wheel install works outside the checkout, and the tools write where the user works.

The wheel is built from the checkout and installed (no dependencies) into a fresh virtualenv whose only other
path is the test environment's site-packages (read as plain paths, so the checkout's editable install is not
active there): everything the package needs at run time must be inside the wheel.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import sysconfig
from pathlib import Path

from support import FIXTURE, ROOT, tiny_llama


def _env(**extra) -> dict:
    return {**os.environ, "OMP_NUM_THREADS": "1", "HF_EVALUATE_OFFLINE": "1", "HF_HUB_OFFLINE": "1", **extra}


def _fresh_venv_with_wheel(tmp: Path) -> Path:
    dist = tmp / "dist"
    r = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(dist),
                        str(ROOT)], capture_output=True, text=True, timeout=300, cwd=tmp)
    assert r.returncode == 0, r.stderr[-2000:]
    wheel = next(dist.glob("hf_asyncpp-*.whl"))
    venv = tmp / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    py = venv / "bin" / "python"
    site = subprocess.run([str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          capture_output=True, text=True, check=True).stdout.strip()
    (Path(site) / "test-dependencies.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    r = subprocess.run([sys.executable, "-m", "pip", "--python", str(py), "install", "--no-deps", "-q", str(wheel)],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    return venv


def test_wheel_install_trains_exports_and_evaluates_outside_the_checkout(tmp_path):
    venv = _fresh_venv_with_wheel(tmp_path)
    work = tmp_path / "work"
    work.mkdir()
    cli = str(venv / "bin" / "hf-asyncpp")
    r = subprocess.run([str(venv / "bin" / "python"), "-c", "import hf_asyncpp; print(hf_asyncpp.__file__)"],
                       cwd=work, capture_output=True, text=True, env=_env())
    assert str(venv) in r.stdout, r.stdout + r.stderr  # the wheel's copy, not the checkout
    r = subprocess.run([cli, "--help"], cwd=work, capture_output=True, text=True, env=_env())
    assert r.returncode == 0 and all(c in r.stdout for c in ("train", "export", "evaluate", "plan")), r.stdout

    recipe = work / "r.yaml"
    recipe.write_text(json.dumps({
        "model": {"config": tiny_llama(2), "vocab_size": 320},
        "data": {"train_files": [str(FIXTURE)], "eval_files": [str(FIXTURE)], "seq_len": 32, "eval_blocks": 4},
        "pipeline": {"schedule": "none", "num_stages": 1, "num_microbatches": 2, "microbatch_size": 2},
        "optimizer": {"name": "adamw", "learning_rate": 0.01},
        "training": {"output_dir": "run", "max_steps": 4, "save_steps": 4, "report_to": [], "export": True}}))
    r = subprocess.run([cli, "train", "r.yaml"], cwd=work, capture_output=True, text=True, env=_env(), timeout=600)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    card = (work / "run" / "export" / "README.md").read_text()  # the template came from the wheel
    assert "hf_asyncpp" in card
    r = subprocess.run([cli, "export", "run/checkpoint-0000004", "again"], cwd=work, capture_output=True, text=True,
                       env=_env(), timeout=300)
    assert r.returncode == 0 and (work / "again" / "config.json").exists(), r.stderr[-2000:]
    r = subprocess.run([cli, "evaluate", "again", "--data", str(FIXTURE), "--seq-len", "16", "--max-blocks", "2",
                        "--no-card"], cwd=work, capture_output=True, text=True, env=_env(), timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    [results] = work.glob("eval-*/eval_results.json")  # the default --out: a new folder where it is run
    assert json.loads(results.read_text())["num_tokens"] == 2 * 15
