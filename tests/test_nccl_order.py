"""The NCCL-order test transport enforces NCCL's point-to-point rule on gloo: operations of one (communicator, peer)
complete one at a time in post order; a grouped call progresses as one unit. gloo alone forgives a receive posted in
front of a send; under the rule that order hangs (here: times out), as it would on GPUs."""
from __future__ import annotations

from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from dist_utils import run_distributed

TIMEOUT = timedelta(seconds=3)


def _exchange(rank, transport, send_group, recv_group, grouped=False):
    """Each rank posts its receive first, then its send (the executor's prefetch in miniature); True if both
    complete."""
    peer = 1 - rank
    out, inp = torch.full((4,), float(rank)), torch.empty(4)
    if grouped:
        works = [transport.batch([("recv", inp, peer, recv_group), ("send", out, peer, send_group)])]
    else:
        works = [transport.irecv(inp, peer, recv_group), transport.isend(out, peer, send_group)]
    try:
        for w in works:
            w.wait(TIMEOUT)
    except RuntimeError as e:
        return str(e)
    assert inp.eq(float(peer)).all()
    return True


def _worker(rank, world):
    from hf_asyncpp.pipeline.nccl_order import Direct, NcclOrder

    one = dist.new_group([0, 1])  # both directions on one communicator
    act, grad = dist.new_group([0, 1]), dist.new_group([0, 1])  # one per direction (rank 0 -> 1 on act)
    fresh = dist.new_group([0, 1])
    mine, theirs = (act, grad) if rank == 0 else (grad, act)
    res = {"gloo, one group": _exchange(rank, Direct(), one, one)}
    t = NcclOrder(TIMEOUT)
    res["nccl order, a group per direction"] = _exchange(rank, t, mine, theirs)
    res["nccl order, one group, grouped call"] = _exchange(rank, t, one, one, grouped=True)
    res["nccl order, one group"] = _exchange(rank, t, fresh, fresh)  # last: it leaves the group's streams dead
    t.close()
    return res


def test_the_rule_hangs_a_receive_posted_before_a_send_on_one_communicator():
    both = run_distributed(_worker, 2)
    for res in both:
        assert res["gloo, one group"] is True  # gloo forgives the order
        assert res["nccl order, a group per direction"] is True
        assert res["nccl order, one group, grouped call"] is True
    # both ranks fail; the first to time out says why, its peer may only see the connection it then closed
    msgs = [res["nccl order, one group"] for res in both]
    assert all(isinstance(m, str) for m in msgs) and any("did not complete within" in m for m in msgs), msgs


def _pipeline_worker(rank, world, scenarios, one_communicator=False):
    """Each scenario trained twice, plain gloo then under the NCCL order (or, with ``one_communicator``, only under
    the NCCL order with both directions on one group: the executor before per-direction channels)."""
    import os
    import time

    import hf_asyncpp.pipeline.p2p as p2p
    from hf_asyncpp.pipeline.executor import PipelineEngine
    from hf_asyncpp.pipeline.p2p import PeerFailure
    from hf_asyncpp.topology import Topology
    from support import build

    if one_communicator:
        p2p.channel = lambda src, dst: ("act", min(src, dst))
    out = []
    for recipe, replica_batches in scenarios:
        runs = []
        for transport in (["nccl-order"] if one_communicator else ["direct", "nccl-order"]):
            os.environ["HF_ASYNCPP_P2P"] = transport
            topo = Topology(rank=rank, world_size=world, num_stages=recipe.pipeline.num_stages)
            eng = PipelineEngine(recipe, build(recipe), topo, log=lambda *a: None)
            batches = replica_batches[topo.dp_rank]
            try:
                res = eng.train_steps(batches[:2], 0) + eng.train_steps(batches[2:], 2)  # two windows
            except PeerFailure as e:
                # what is still in flight (the transport's workers, the peer's side of the hang) times out before
                # the groups are destroyed: destroying a gloo group under a pending operation aborts the process
                time.sleep(recipe.pipeline.p2p_timeout_s)
                eng.close()
                return str(e)
            runs.append(([(r.loss, r.grad_norm, r.lr) for r in res], eng.full_state_dict()))
            eng.close()
        out.append(runs)
    return out


SPECS = {  # world size -> (arch, schedule, stages, microbatches, microbatch size, optimizer, EF, replicas)
    2: [("LLAMA", "2bw", 2, 2, 2, "muon", True, 1), ("LLAMA", "1f1b", 2, 3, 2, "adamw", False, 1),
        ("MIXTRAL", "gpipe", 2, 2, 2, "adamw", False, 1), ("LLAMA_UNTIED", "pipedream", 2, 1, 2, "adamw", False, 1)],
    4: [("LLAMA", "2bw", 4, 4, 1, "muon", True, 1), ("LLAMA", "2bw", 2, 2, 2, "adamw", True, 2),
        ("LLAMA", "1f1b", 4, 4, 1, "adamw", False, 1), ("MIXTRAL", "gpipe", 4, 2, 1, "muon", False, 1),
        ("LLAMA", "pipedream", 4, 1, 2, "muon", True, 1)],
}


@pytest.mark.parametrize("world", [2, 4])
def test_runs_under_the_rule_are_bit_identical_to_plain_gloo(world):
    """Every schedule at p = 2 and p = 4 (tied embeddings, MoE) and 2 stages x 2 replicas: the same losses, norms and
    weights bit for bit whichever transport (the rule changes when transfers complete, never what they carry)."""
    import support

    specs = SPECS[world]
    scenarios = [support.scenario(getattr(support, s[0]), *s[1:7], dp=s[7], seed=7 + i)
                 for i, s in enumerate(specs)]
    results = run_distributed(_pipeline_worker, world, [(s[0], s[1]) for s in scenarios])
    for spec, (plain, ordered) in zip(specs, results[0]):
        assert plain[0] == ordered[0], spec[1:3]
        assert plain[1].keys() == ordered[1].keys()
        assert all(torch.equal(plain[1][k], ordered[1][k]) for k in plain[1]), spec[1:3]


def test_one_communicator_for_both_directions_hangs_under_the_rule():
    """The executor's post order with activations and gradients on one group (as before per-direction channels):
    stage 0's prefetched gradient receive stands in front of its next activation send and stage 1's prefetched
    activation receive in front of its next gradient send; under the rule both wait until the timeout."""
    from support import LLAMA, scenario

    rec, replica, _, _ = scenario(LLAMA, "2bw", 2, 2, 2, "muon", False)
    rec.pipeline.p2p_timeout_s = rec.pipeline.init_timeout_s = 4.0  # the hang comes in the first step
    msgs = run_distributed(_pipeline_worker, 2, [(rec, replica)], True)
    # both stages stop with PeerFailure; the first to time out names the rule, its peer may see the closed connection
    assert all(isinstance(m, str) and "timed out after 4s" in m for m in msgs), msgs
    assert any("NCCL order" in m for m in msgs), msgs
