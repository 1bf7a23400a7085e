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


def _early_worker(rank, world):
    from hf_asyncpp.pipeline.reducer import Reducer
    from hf_asyncpp.topology import Topology, make_groups

    topo = Topology(rank=rank, world_size=world, num_stages=1)
    groups = make_groups(topo, [], timedelta(seconds=30))
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(32, 32) for _ in range(6)])
    leaves = dict(model.named_parameters())
    red = Reducer(groups, topo, {}, 30.0, bucket_mb=8 / 1024)  # 8 KB: about two layers a bucket
    x = torch.randn(4, 32, generator=torch.Generator().manual_seed(rank))
    model(x).pow(2).sum().backward()  # an earlier microbatch: accumulates, launches nothing
    red.arm(0, leaves)
    model(x + 1).pow(2).sum().backward()  # the step's last backward
    launched_in_backward = len(red.early.launched)
    red.after_backward()
    grads = {n: p.grad for n, p in leaves.items()}
    local = {n: g.clone() for n, g in grads.items()}
    red.submit(0, grads)
    reduced, norm = red.result(0)
    assert all(len(p._post_accumulate_grad_hooks or {}) == 0 for p in leaves.values())  # hooks removed
    red.close()
    groups.destroy()
    return launched_in_backward, len(red._buckets(list(leaves)[::-1], leaves)), local, {n: g.clone() for n, g in reduced.items()}, norm


def test_data_parallel_buckets_start_during_the_last_backward():
    """Armed before the step's last backward, the buckets whose gradients are final are launched from inside it
    (last layers first); the rest at submit; the result is the replicas' mean either way."""
    results = run_distributed(_early_worker, 2)
    for launched, n_buckets, _, reduced, norm in results:
        assert 0 < launched <= n_buckets and n_buckets > 2, (launched, n_buckets)
        want = {n: (results[0][2][n] + results[1][2][n]) / 2 for n in reduced}
        for n in want:
            torch.testing.assert_close(reduced[n], want[n], rtol=1e-6, atol=1e-7)
        assert norm == pytest.approx(sum(float(v.double().pow(2).sum()) for v in want.values()) ** 0.5, rel=1e-6)


def _groups_worker(rank, world, stages):
    import torch.distributed as dist

    from hf_asyncpp.topology import Topology, make_groups

    topo = Topology(rank=rank, world_size=world, num_stages=stages)
    out = []
    for timeout in (17, 23):  # made, torn down and made again, as each engine does
        groups = make_groups(topo, [], timedelta(seconds=timeout))
        mesh = groups.mesh
        out.append({"pipe": dist.get_process_group_ranks(groups.pipe), "dp_ranks": groups.dp_ranks,
                    "dp": None if groups.dp is None else dist.get_process_group_ranks(groups.dp),
                    "dims": mesh.mesh_dim_names, "mesh": mesh.mesh.tolist(),
                    "world_reused": any(g is dist.group.WORLD for g in mesh.get_all_groups()),
                    "timeouts": [g._get_backend(torch.device("cpu")).options._timeout.total_seconds()
                                 for g in mesh.get_all_groups()]})
        groups.destroy()
    dist.barrier()  # the default group outlives the engine's groups
    return out


@pytest.mark.parametrize("world,stages", [(4, 2), (2, 2), (2, 1)])
def test_pipeline_and_data_parallel_groups_are_the_meshs_rows_and_columns(world, stages):
    """The pipeline and data-parallel groups come from torch's (pp, dp) device mesh: rank = stage x dp + dp_rank is its
    row-major order, so a rank's pipeline is its replica's stages and its data-parallel group its stage's replicas,
    as ``Topology`` places them; every dimension a group of its own (never the default group, which ``destroy``
    would tear down), with the timeout asked for."""
    results = run_distributed(_groups_worker, world, stages)
    dp = world // stages
    for rank, made in enumerate(results):
        stage, dp_rank = divmod(rank, dp)
        for res, timeout in zip(made, (17, 23)):
            assert res["dims"] == ("pp", "dp") and res["mesh"] == [[s * dp + d for d in range(dp)] for s in range(stages)]
            assert res["pipe"] == [s * dp + dp_rank for s in range(stages)], (rank, res)
            assert res["dp_ranks"] == [stage * dp + d for d in range(dp)], (rank, res)
            assert res["dp"] == (res["dp_ranks"] if dp > 1 else None), (rank, res)
            assert not res["world_reused"] and res["timeouts"] == [timeout, timeout], (rank, res)
