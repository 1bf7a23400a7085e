"""Run a function on N gloo processes (spawned), collect rank 0's result. Shared by the distributed tests."""
from __future__ import annotations

import os
import socket
import tempfile
import traceback

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, world: int, port: int, fn, args, out_dir: str):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      OMP_NUM_THREADS="1", HF_EVALUATE_OFFLINE="1", HF_HUB_OFFLINE="1")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        result = fn(rank, world, *args)
        torch.save(result, os.path.join(out_dir, f"rank{rank}.pt"))
    except BaseException:
        with open(os.path.join(out_dir, f"rank{rank}.err"), "w") as f:
            f.write(traceback.format_exc())
        raise
    finally:
        dist.destroy_process_group()


def run_distributed(fn, world: int, *args):
    """Returns the list of per-rank results; raises with the first rank's traceback on failure."""
    with tempfile.TemporaryDirectory() as d:
        try:
            mp.start_processes(_worker, args=(world, free_port(), fn, args, d), nprocs=world, join=True, start_method="spawn")
        except Exception as e:
            errs = [open(os.path.join(d, f)).read() for f in sorted(os.listdir(d)) if f.endswith(".err")]
            raise RuntimeError("distributed run failed:\n" + "\n".join(errs)) from e
        return [torch.load(os.path.join(d, f"rank{r}.pt"), weights_only=False) for r in range(world)]
