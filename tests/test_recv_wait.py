"""How a rank waits for its neighbour (``pipeline.recv_wait``): polling and blocking train the same bits, under
plain gloo and under the NCCL-order transport; a polled wait still turns a silent peer into ``PeerFailure`` naming
it; ``auto`` polls only on CPU with a core per rank."""
from __future__ import annotations

import dataclasses
import os
import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from dist_utils import run_distributed
from hf_asyncpp.pipeline.p2p import polls


def _train(rank, world, recipe, batches):
    """The same scenario trained with each wait and transport: (losses, norms) and the final weights of each."""
    from hf_asyncpp.pipeline.executor import PipelineEngine
    from hf_asyncpp.topology import Topology
    from support import build

    out = {}
    for transport in ("direct", "nccl-order"):
        for wait in ("block", "poll"):
            os.environ["HF_ASYNCPP_P2P"] = transport
            rec = dataclasses.replace(recipe, pipeline=dataclasses.replace(recipe.pipeline, recv_wait=wait))
            eng = PipelineEngine(rec, build(rec), Topology(rank=rank, world_size=world, num_stages=2),
                                 log=lambda *a: None)
            assert (eng.p2p.waiter is not None) == (wait == "poll")
            res = eng.train_steps(batches[:2], 0) + eng.train_steps(batches[2:], 2)  # two windows: a drain between
            out[transport, wait] = ([(r.loss, r.grad_norm) for r in res], eng.full_state_dict())
            eng.close()
    return out


def test_polling_and_blocking_waits_train_the_same_bits():
    """2BW with Muon and EF on 2 stages: every wait and transport gives the same losses, norms and weights, bit for bit
    (how a rank waits changes when it notices its data, never what arrives)."""
    import support

    rec, replicas, _, _ = support.scenario(support.LLAMA, "2bw", 2, 2, 2, "muon", True, seed=3)
    runs = run_distributed(_train, 2, rec, replicas[0])[0]
    base_losses, base_weights = runs["direct", "block"]
    assert len(base_losses) == support.STEPS
    for key, (losses, weights) in runs.items():
        assert losses == base_losses, key
        assert weights.keys() == base_weights.keys()
        assert all(torch.equal(weights[k], base_weights[k]) for k in weights), key


def _silent_peer(rank, world):
    """Rank 1 never sends: rank 0's polled receive must end in PeerFailure after the timeout, naming rank 1."""
    from hf_asyncpp.pipeline.p2p import P2P
    from hf_asyncpp.errors import PeerFailure
    from hf_asyncpp.topology import Topology

    groups = {ch: dist.new_group([0, 1]) for ch in (("act", 0), ("grad", 0))}
    p2p = P2P(Topology(rank=rank, world_size=2, num_stages=2), 2.0, torch.device("cpu"), groups, poll=True)
    result = None
    if rank == 0:
        t0 = time.monotonic()
        try:
            p2p.recv(1, like=[torch.empty(4)])
        except PeerFailure as e:
            result = (str(e), time.monotonic() - t0)
    else:
        time.sleep(4)  # silent past the timeout, then alive until rank 0 has given up
    dist.barrier(timeout=timedelta(seconds=60))
    return result


def test_a_polled_wait_for_a_silent_peer_ends_in_peer_failure():
    os.environ["HF_ASYNCPP_P2P"] = "direct"
    message, waited = run_distributed(_silent_peer, 2)[0]
    assert "rank 1" in message and "timed out after 2s" in message, message
    assert 1.5 < waited < 30


def test_auto_polls_on_cpu_with_a_core_per_rank_only(monkeypatch):
    cpu, cuda = torch.device("cpu"), torch.device("cuda", 0)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1})
    monkeypatch.setattr(torch, "get_num_threads", lambda: 1)
    assert polls("auto", cpu, 2) and polls("auto", cpu, 1)
    assert not polls("auto", cpu, 4)  # more ranks than cores: a polling rank would take turns from a computing one
    assert not polls("auto", cuda, 1)  # NCCL's receives are waited for by the stream, not the host
    assert polls("poll", cuda, 8) and not polls("block", cpu, 1)
    monkeypatch.setattr(torch, "get_num_threads", lambda: 2)
    assert not polls("auto", cpu, 2)  # two ranks of two threads each on two cores


def test_the_recipe_field_names_its_values():
    from hf_asyncpp.errors import RecipeError
    from hf_asyncpp.config.recipe import recipe_from_dict

    with pytest.raises(RecipeError, match=r"pipeline\.recv_wait.*auto.*poll.*block"):
        recipe_from_dict({"pipeline": {"recv_wait": "spin"}})
