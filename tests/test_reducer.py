"""The gradient reduction against a direct computation: the data-parallel mean in several buckets, the tied sum, the
global norm over the pipeline; issued asynchronously and advanced by ``poll`` without waiting (gloo)."""
from __future__ import annotations

import time
from datetime import timedelta

import pytest
import torch

from dist_utils import run_distributed

SHAPES = [(64, 32), (32,), (128, 64), (7,), (64, 64)]


def _grads(rank: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(10 + rank)
    return {f"w{i}": torch.randn(sh, generator=g) for i, sh in enumerate(SHAPES)}


def _worker(rank, world, stages):
    from hf_asyncpp.pipeline.reducer import Reducer
    from hf_asyncpp.topology import Topology, make_groups

    topo = Topology(rank=rank, world_size=world, num_stages=stages)
    tied = [(0, stages - 1)] if stages > 1 else []
    groups = make_groups(topo, tied, timedelta(seconds=30))
    names = {(0, stages - 1): ["w0"]} if stages > 1 else {}
    # 40 KB buckets: the 5 tensors travel in 3 buckets
    red = Reducer(groups, topo, names, 30.0, bucket_mb=40 / 1024)
    assert [len(b) for b in red._buckets(list(_grads(0)), _grads(0))] == [2, 2, 1]
    out = []
    for step in range(3):
        red.submit(step, _grads(rank + 100 * step))
        deadline = time.monotonic() + 20
        while step not in red.done and time.monotonic() < deadline:  # advanced by polling alone: no call waits
            red.poll()
            time.sleep(0.001)
        polled = step in red.done
        grads, norm = red.result(step)
        out.append((polled, {k: v.clone() for k, v in grads.items()}, norm))
    red.close()
    groups.destroy()
    return out


@pytest.mark.parametrize("stages", [1, 2])
def test_reduction_equals_the_direct_computation(stages):
    """stages 1: 2 data-parallel replicas (mean in buckets, local norm); stages 2: 2 stages holding a tied tensor
    (its gradients summed, counted once in the global norm)."""
    results = run_distributed(_worker, 2, stages)
    for step in range(3):
        local = [_grads(r + 100 * step) for r in range(2)]
        for rank, res in enumerate(results):
            polled, got, norm = res[step]
            assert polled, "the reduction should complete through poll() alone"
            if stages == 1:
                want = {k: (local[0][k] + local[1][k]) / 2 for k in local[0]}
                sq = sum(float(v.double().pow(2).sum()) for v in want.values())
            else:
                want = dict(local[rank], w0=local[0]["w0"] + local[1]["w0"])
                sq = sum(float(v.double().pow(2).sum()) for r in range(2) for k, v in local[r].items() if k != "w0")
                sq += float(want["w0"].double().pow(2).sum())
            for k in want:
                torch.testing.assert_close(got[k], want[k], rtol=1e-6, atol=1e-7)
            assert norm == pytest.approx(sq ** 0.5, rel=1e-6)
