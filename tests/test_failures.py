"""A dead pipeline peer ends the job with a message naming it, never a hang: at the default timeouts (minutes, so a
slow replica survives), a rank that dies is found within seconds, because its connections close."""
from __future__ import annotations

import os
import time

import torch
import torch.multiprocessing as mp

from dist_utils import free_port


def _rank_main(rank, world, port, die_after, err_path):
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    from hf_asyncpp.topology import Topology
    from hf_asyncpp.pipeline.executor import PipelineEngine
    from support import LLAMA, build, make_batches, make_recipe

    recipe = make_recipe(LLAMA, "2bw", 2, 2, 2, "adamw")
    rp = recipe.pipeline  # the defaults: a death is found at once, long before any timeout could end the run
    assert rp.p2p_timeout_s >= 60 and rp.collective_timeout_s >= 60 and rp.init_timeout_s >= 600
    eng = PipelineEngine(recipe, build(recipe), Topology(rank=rank, world_size=world, num_stages=2), log=lambda *a: None)
    try:
        for k in range(1000):
            if rank == 1 and k == die_after:
                os._exit(17)  # a crash: no clean-up, no goodbye to the peer
            eng.train_steps(make_batches(1, 2, 2, k), k)
    except Exception as e:  # noqa: BLE001 - the message is what we test
        with open(err_path, "w") as f:
            f.write(f"{type(e).__name__}: {e}")
        os._exit(3)


def test_killed_rank_ends_the_job_with_a_message(tmp_path):
    ctx = mp.get_context("spawn")
    port, err = free_port(), str(tmp_path / "rank0.err")
    procs = [ctx.Process(target=_rank_main, args=(r, 2, port, 3, err)) for r in range(2)]
    for p in procs:
        p.start()
    procs[1].join(120)
    t_dead = time.monotonic()
    procs[0].join(90)
    elapsed = time.monotonic() - t_dead
    for p in procs:
        if p.is_alive():
            p.kill()
    assert procs[1].exitcode == 17
    assert procs[0].exitcode == 3, "the surviving rank must exit with an error, not hang"
    assert elapsed < 60
    msg = open(err).read()
    assert "PeerFailure" in msg and "rank 1" in msg, msg
