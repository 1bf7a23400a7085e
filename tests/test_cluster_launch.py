"""Launching on clusters: SLURM's srun as the launcher (its variables mapped to torch.distributed's), and torchrun
over two "nodes" (two launchers on localhost) giving the losses of one launcher.

The unit tests set what srun sets; the real runs start the ranks the way srun and a 2-node torchrun would, with gloo
on this machine. What needs a real cluster (two hosts, a real srun, NCCL between nodes) is not tested here
(docs/quickstart-gpu.md, "Several nodes").
"""
from __future__ import annotations

import json
import os
import random
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from dist_utils import free_port
from hf_asyncpp.config.recipe import load_recipe
from hf_asyncpp.errors import LaunchError, RecipeError
from hf_asyncpp.launch.spawn import (SLURM_PORT_BASE, SLURM_PORT_SPAN, adopt_slurm, expand_nodelist, should_spawn,
                                     slurm_mapping, slurm_master_port, started_by_launcher)
from hf_asyncpp.launch.spawn import check_topology
from support import ROOT, losses, write_recipe

# what srun sets in task 5 of `srun --nodes=3 --ntasks-per-node=4` (task 5 = 2nd task of the 2nd node), job 4242
SRUN_TASK_5 = {
    "SLURM_JOB_ID": "4242", "SLURM_JOBID": "4242", "SLURM_STEP_ID": "0", "SLURM_STEPID": "0",
    "SLURM_PROCID": "5", "SLURM_LOCALID": "1", "SLURM_NODEID": "1", "SLURM_NTASKS": "12", "SLURM_NPROCS": "12",
    "SLURM_STEP_NUM_TASKS": "12", "SLURM_STEP_NUM_NODES": "3", "SLURM_NNODES": "3",
    "SLURM_JOB_NODELIST": "gpu[007-009]", "SLURM_STEP_NODELIST": "gpu[007-009]", "SLURM_NODELIST": "gpu[007-009]",
    "SLURM_TASKS_PER_NODE": "4(x3)", "SLURM_STEP_TASKS_PER_NODE": "4(x3)", "SLURM_LAUNCH_NODE_IPADDR": "10.0.0.1",
}
TORCH_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "GROUP_RANK",
              "OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "TORCHELASTIC_RUN_ID")


def base_env(tmp: Path) -> dict[str, str]:
    """This process's environment without any launcher's or SLURM's variables (pytest may itself run under one)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_") and k not in TORCH_VARS}
    return {**env, "OMP_NUM_THREADS": "1", "HF_EVALUATE_OFFLINE": "1", "HF_HUB_OFFLINE": "1",
            "HF_HOME": str(tmp / "hf-home")}  # no user accelerate config


@pytest.mark.parametrize("nodelist, hosts", [
    ("gpu001", ["gpu001"]),
    ("gpu[001-003,007],login1", ["gpu001", "gpu002", "gpu003", "gpu007", "login1"]),
    ("node[8-11]", ["node8", "node9", "node10", "node11"]),  # no padding: the width of the range's start
    ("a[09-10],b,c[1,3]", ["a09", "a10", "b", "c1", "c3"]),
    ("rack[1-2]-n[01-02]", ["rack1-n01", "rack1-n02", "rack2-n01", "rack2-n02"]),
    ("login1,gpu[2-3]", ["login1", "gpu2", "gpu3"]),
])
def test_nodelist_expansion(nodelist, hosts):
    assert expand_nodelist(nodelist) == hosts


@pytest.mark.parametrize("bad", ["gpu[001-", "gpu[a-b]", "gpu]1["])
def test_unreadable_nodelist_is_named(bad, monkeypatch):
    with pytest.raises(ValueError):
        expand_nodelist(bad)
    monkeypatch.setenv("PATH", "/nonexistent")  # no scontrol to fall back on
    with pytest.raises(LaunchError, match="set MASTER_ADDR"):
        slurm_mapping({**SRUN_TASK_5, "SLURM_STEP_NODELIST": bad})


def test_srun_task_maps_to_torch_variables():
    env = dict(SRUN_TASK_5)
    port = SLURM_PORT_BASE + 4242 % SLURM_PORT_SPAN
    assert adopt_slurm(env) == {"RANK": "5", "WORLD_SIZE": "12", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "4",
                                "MASTER_ADDR": "gpu007", "MASTER_PORT": str(port)}
    assert env["RANK"] == "5" and env["MASTER_PORT"] == str(port)
    assert adopt_slurm(env) == {}  # done once: WORLD_SIZE is set now
    # the user's MASTER_ADDR/PORT are kept; an uneven step (5 tasks on 2 nodes: 3 + 2) gets this node's count
    env = {**SRUN_TASK_5, "MASTER_ADDR": "10.1.2.3", "MASTER_PORT": "29999", "SLURM_STEP_TASKS_PER_NODE": "3,2",
           "SLURM_STEP_NUM_TASKS": "5", "SLURM_PROCID": "4"}
    assert slurm_mapping(env) == {"RANK": "4", "WORLD_SIZE": "5", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2"}


def test_master_port_is_a_function_of_the_job():
    ports = {slurm_master_port(str(j)) for j in range(100000, 130000, 7)}
    assert all(SLURM_PORT_BASE <= p < SLURM_PORT_BASE + SLURM_PORT_SPAN < 32768 for p in ports)  # below ephemeral
    assert slurm_master_port("123456") == slurm_master_port("123456") == 23456
    assert SLURM_PORT_BASE <= slurm_master_port("123_4") < SLURM_PORT_BASE + SLURM_PORT_SPAN


def test_srun_tasks_are_launched_ranks(tmp_path, monkeypatch):
    """An srun step of several tasks is a launch (no local pipeline per task); one task (`srun -n 1`, or an sbatch
    script's single task that then calls torchrun/accelerate), the batch shell itself (SLURM_NTASKS but no step),
    and ranks that torchrun or mpirun started inside an srun step are not srun's."""
    recipe = load_recipe(str(write_recipe(tmp_path / "r.yaml", tmp_path / "run")))  # 2 stages
    for name in (*TORCH_VARS, "HF_ASYNCPP_NO_SPAWN", *SRUN_TASK_5):
        monkeypatch.delenv(name, raising=False)
    assert not started_by_launcher() and should_spawn(recipe)  # a plain `python -m hf_asyncpp.cli.train`
    for name, value in SRUN_TASK_5.items():
        monkeypatch.setenv(name, value)
    assert started_by_launcher() and not should_spawn(recipe)
    assert "RANK" not in os.environ  # deciding changes nothing: the trainer maps the variables (adopt_slurm)

    one_task = {**SRUN_TASK_5, "SLURM_NTASKS": "1", "SLURM_STEP_NUM_TASKS": "1", "SLURM_PROCID": "0",
                "SLURM_LOCALID": "0", "SLURM_NODEID": "0"}
    batch_shell = {k: v for k, v in SRUN_TASK_5.items() if k not in ("SLURM_STEP_ID", "SLURM_STEPID")}
    torchrun_in_srun = {**one_task, "WORLD_SIZE": "8", "RANK": "3", "LOCAL_RANK": "3"}
    mpirun_in_srun = {**SRUN_TASK_5, "SLURM_STEP_NUM_TASKS": "3", "PMI_SIZE": "12", "PMI_RANK": "5"}
    for env in (one_task, batch_shell):
        assert not started_by_launcher(env) and should_spawn(recipe, env)
        assert adopt_slurm(env) == {} and "RANK" not in env
    for env in (torchrun_in_srun, mpirun_in_srun):
        assert started_by_launcher(env) and not should_spawn(recipe, env)
        assert slurm_mapping(env) == {}  # left to torchrun's or MPI's variables
    pmi2 = {**SRUN_TASK_5, "PMI_SIZE": "12", "PMI_RANK": "5"}  # srun --mpi=pmi2: srun is still the launcher
    assert slurm_mapping(pmi2)["RANK"] == "5"
    with pytest.raises(LaunchError, match="SLURM_PROCID='x' is missing or not an integer"):
        slurm_mapping({**SRUN_TASK_5, "SLURM_PROCID": "x"})


def free_port_in_slurm_range() -> int:
    """A free port that a job id maps to, so that the real run derives its MASTER_PORT as on a cluster."""
    for port in random.sample(range(SLURM_PORT_BASE, SLURM_PORT_BASE + SLURM_PORT_SPAN), 200):
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError("no free port in the SLURM port range")


def run_all(cmds: list[list[str]], envs: list[dict[str, str]], timeout: int = 600) -> list[tuple[int, str]]:
    """Start the processes together (ranks or launchers of one run), wait for all; (exit code, output) each."""
    procs = [subprocess.Popen(c, cwd=ROOT, env=e, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                              start_new_session=True) for c, e in zip(cmds, envs)]
    try:
        outputs = [p.communicate(timeout=timeout)[0] for p in procs]
        return [(p.returncode, out) for p, out in zip(procs, outputs)]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()


def test_srun_style_two_tasks_train_a_two_stage_pipeline(tmp_path):
    """Two processes with only what srun sets (no RANK, WORLD_SIZE, MASTER_*): they become ranks 0 and 1 of one
    2-stage pipeline instead of two local pipelines, with MASTER_PORT derived from the job id."""
    port = free_port_in_slurm_range()
    job = str(7 * SLURM_PORT_SPAN + port - SLURM_PORT_BASE)
    assert slurm_master_port(job) == port
    out = tmp_path / "run"
    recipe = write_recipe(tmp_path / "r.yaml", out, max_steps=4, save_steps=4)
    step = {"SLURM_JOB_ID": job, "SLURM_STEP_ID": "0", "SLURM_NTASKS": "2", "SLURM_STEP_NUM_TASKS": "2",
            "SLURM_NNODES": "1", "SLURM_STEP_NUM_NODES": "1", "SLURM_NODEID": "0",
            "SLURM_JOB_NODELIST": "localhost", "SLURM_STEP_NODELIST": "localhost",
            "SLURM_TASKS_PER_NODE": "2", "SLURM_STEP_TASKS_PER_NODE": "2", "SLURM_LAUNCH_NODE_IPADDR": "127.0.0.1"}
    envs = [{**base_env(tmp_path), **step, "SLURM_PROCID": str(t), "SLURM_LOCALID": str(t)} for t in (0, 1)]
    cmd = [sys.executable, "-m", "hf_asyncpp.cli.train", str(recipe)]
    (rc0, log0), (rc1, log1) = run_all([cmd, cmd], envs)
    assert rc0 == 0 and rc1 == 0, log0[-3000:] + log1[-3000:]
    assert (f"SLURM detected (job {job}, step 0): 2 srun tasks on 1 node(s) as ranks: RANK=SLURM_PROCID, WORLD_SIZE=2, "
            f"LOCAL_RANK=SLURM_LOCALID, LOCAL_WORLD_SIZE=2 on this node, MASTER_ADDR=localhost, MASTER_PORT={port}") in log0
    assert "SLURM detected" not in log1 and "local processes" not in log0 + log1  # one line; nobody spawned
    assert [s["stage"] for s in json.loads((out / "pipeline_profile.json").read_text())["stages"]] == [0, 1]
    assert {"stage-00.safetensors", "stage-01.safetensors"} <= {p.name for p in (out / "checkpoint-0000004").iterdir()}
    assert len(losses(out)) == 4


def torchrun(nnodes: int, nproc: int, endpoint: str, recipe: Path, node_rank: int = 0) -> list[str]:
    """One torchrun "node" (a launcher) of an nnodes-node run that meets the others at endpoint (c10d rendezvous)."""
    return [sys.executable, "-m", "torch.distributed.run", f"--nnodes={nnodes}", f"--nproc_per_node={nproc}",
            "--rdzv_backend=c10d", f"--rdzv_endpoint={endpoint}", f"--node_rank={node_rank}", "--rdzv_id=cluster-test",
            "--local_addr=127.0.0.1", "--module", "hf_asyncpp.cli.train", str(recipe)]


def test_two_torchrun_nodes_equal_one(tmp_path):
    """2 stages x 2 data-parallel replicas (world 4): two torchrun launchers of 2 workers each (two "nodes", one
    stage per node: rank = stage * dp_size + dp_rank) give the losses of one launcher of 4 workers, bit for bit."""
    env = base_env(tmp_path)
    runs = {}
    for name, nodes in (("one-node", 1), ("two-nodes", 2)):
        out = tmp_path / name
        recipe = write_recipe(tmp_path / f"{name}.yaml", out, max_steps=3, save_steps=0, logging_steps=1)
        endpoint = f"127.0.0.1:{free_port()}"
        cmds = [torchrun(nodes, 4 // nodes, endpoint, recipe, node_rank=k) for k in range(nodes)]
        for rc, log in run_all(cmds, [env] * nodes):
            assert rc == 0, log[-3000:]
        rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
        runs[name] = [(r["step"], r["loss"], r["grad_norm"], r["num_input_tokens_seen"]) for r in rows if "loss" in r]
    assert [r[0] for r in runs["one-node"]] == [1, 2, 3]
    assert runs["one-node"][0][3] == 2 * 2 * 32 * 2  # 2 microbatches x 2 sequences x 32 tokens x 2 replicas
    assert runs["two-nodes"] == runs["one-node"]


def test_wrong_task_count_under_slurm_names_srun(tmp_path, monkeypatch):
    """3 srun tasks for 2 stages stop with the srun form of the command, besides the others."""
    recipe_path = write_recipe(tmp_path / "r.yaml", tmp_path / "run")
    monkeypatch.setenv("SLURM_JOB_ID", "4242")
    with pytest.raises(RecipeError, match=r"under SLURM: srun with --ntasks a multiple of 2, one task per GPU"):
        check_topology(load_recipe(str(recipe_path)), 3, str(recipe_path))
