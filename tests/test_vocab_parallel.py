"""The output layer and loss shared by every stage (``partition/vocab.py``): the pass over gloo ranks against the
unpartitioned model's own head and loss; the stages built with it against the whole model."""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from dist_utils import run_distributed
from support import make_model

from hf_asyncpp.partition.vocab import assemble, parse_shard, rows_of, shard_name, vocab_pass, vocab_ranges


def test_vocab_ranges_cover_the_rows_evenly():
    assert vocab_ranges(128, 4) == [(0, 32), (32, 64), (64, 96), (96, 128)]
    assert vocab_ranges(130, 4) == [(0, 33), (33, 66), (66, 99), (99, 130)]
    assert vocab_ranges(10, 4) == [(0, 3), (3, 6), (6, 9), (9, 10)]
    with pytest.raises(ValueError, match="leaves a stage none"):
        vocab_ranges(5, 4)


def test_shard_names_assemble_and_recut():
    full = torch.arange(40.0).view(10, 4)
    parts = {shard_name("lm_head.weight", r): full[r[0]:r[1]] for r in vocab_ranges(10, 3)}
    assert parse_shard("lm_head.weight@4:8") == ("lm_head.weight", (4, 8))
    assert parse_shard("lm_head.weight") is None
    assert torch.equal(assemble({**parts, "x": full})["lm_head.weight"], full)
    with pytest.raises(ValueError, match="do not cover"):
        assemble({k: v for k, v in parts.items() if not k.endswith("@4:8")})
    # a shard of another cut from the full tensor
    assert torch.equal(rows_of("lm_head.weight@2:7", {"lm_head.weight": full}.get), full[2:7])


def _pass_worker(rank, world, arch, chunk, scale):
    """Every rank computes its shard's part of the model's loss; returns (loss, its weight gradient, the hidden
    gradient on the last rank)."""
    model = make_model(arch)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 128, (2, 9), generator=g)
    labels = ids.clone()
    labels[0, 3:6] = -100
    with torch.no_grad():
        h = model.model(input_ids=ids).last_hidden_state
    src = world - 1
    rows = vocab_ranges(model.config.vocab_size, world)[rank]
    w = model.lm_head.weight.detach()[rows[0]:rows[1]]
    hidden = h.clone() if rank == src else torch.full_like(h, float("nan"))
    lab = labels.clone() if rank == src else torch.zeros_like(labels)
    grad = torch.zeros(w.shape)
    loss, dh = vocab_pass(hidden, lab, w, rows, dist.group.WORLD, src, grad, grad_scale=scale, chunk=chunk)
    return loss, grad, dh


@pytest.mark.parametrize("world,chunk", [(2, None), (3, 5), (4, 7)])
def test_vocab_pass_equals_the_models_head_and_loss(world, chunk):
    """The loss, the head's weight gradient (shards concatenated) and the hidden states' gradient equal those of the
    model's own lm_head + loss_function (ignore_index labels included), within fp32 rounding."""
    arch, scale = "llama_untied", 0.5
    out = run_distributed(_pass_worker, world, arch, chunk, scale)
    model = make_model(arch)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 128, (2, 9), generator=g)
    labels = ids.clone()
    labels[0, 3:6] = -100
    with torch.no_grad():
        h = model.model(input_ids=ids).last_hidden_state
    h = h.clone().requires_grad_()
    logits = model.lm_head(h)
    ref = model.loss_function(logits, labels, vocab_size=model.config.vocab_size)
    (ref * scale).backward()
    for loss, _, _ in out:
        torch.testing.assert_close(loss, ref.detach(), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(torch.cat([w for _, w, _ in out]), model.lm_head.weight.grad, rtol=1e-5, atol=1e-7)
    assert all(dh is None for _, _, dh in out[:-1])
    torch.testing.assert_close(out[-1][2], h.grad, rtol=1e-5, atol=1e-7)
