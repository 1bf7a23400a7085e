"""The chunked fused linear cross-entropy (hf_asyncpp/model/fused_loss.py) against transformers' own head and loss
(``F.linear`` then ``ForCausalLMLoss``, autograd through both): the loss and the gradients of the hidden states, the
head's weight (tied to the embedding or not) and its bias, in fp32 and under bf16 autocast; the targets it ignores;
the models that keep transformers' path; and the peak memory per token, read from the allocator."""
from __future__ import annotations

import pytest
import torch
from torch.nn import functional as F
from transformers import AutoConfig, AutoModelForCausalLM, LlamaForCausalLM
from transformers.loss.loss_utils import ForCausalLMLoss

from bench.fused_loss import head_and_loss_bytes_per_token
from hf_asyncpp.errors import RecipeError
from hf_asyncpp.model.fused_loss import (HeadCapture, chunk_tokens, fused_linear_cross_entropy, fused_loss_blocker,
                                         use_fused_loss)
from hf_asyncpp.partition import partition_model, run_stages
from support import DIMS

B, T, H, V = 2, 37, 32, 101

# fp32: the same sums in another order (chunks, the loss summed per chunk): a few ulps
FP32 = dict(rtol=1e-5, atol=1e-7)
# bf16 autocast: the GEMMs in bf16 as autocast runs them; the weight gradient is summed over chunks from bf16 partial
# products (transformers' single GEMM rounds once), so it may differ by about one bf16 ulp (2^-8 relative) of its
# largest entry; the loss and the hidden states' gradient are transformers' within fp32 rounding
BF16_W = dict(rtol=0.0, atol=2 ** -7)


def _labels(seed=0):
    g = torch.Generator().manual_seed(seed)
    y = torch.randint(0, V, (B, T), generator=g)
    y[0, 3] = y[1, :5] = y[1, -1] = -100  # ignored targets, among them one the shift moves to the last position
    return y


def _both(bias: bool, bf16: bool, labels, chunk=16, **kw):
    """(loss, dh, dW, db) from transformers' path and from the fused one, same inputs, loss scaled by 0.5 before the
    backward (the backward must scale what the forward computed)."""
    torch.manual_seed(0)
    h0, w0 = torch.randn(B, T, H), torch.randn(V, H) * 0.2
    b0 = torch.randn(V) * 0.1 if bias else None
    out = []
    for fused in (False, True):
        h, w = h0.clone().requires_grad_(), w0.clone().requires_grad_()
        b = b0.clone().requires_grad_() if bias else None
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            if fused:
                loss = fused_linear_cross_entropy(h, w, b, labels, chunk=chunk, **kw)
            else:
                loss = ForCausalLMLoss(F.linear(h, w, b), labels, V, **kw)
        (0.5 * loss).backward()
        out.append((loss.detach(), h.grad, w.grad, b.grad if bias else None))
    return out


@pytest.mark.parametrize("bias", [False, True])
def test_fp32_loss_and_gradients_equal_transformers(bias):
    ref, got = _both(bias, False, _labels())
    for name, a, b in zip(("loss", "hidden", "weight", "bias"), ref, got):
        if a is not None:
            assert b.dtype == a.dtype, name
            torch.testing.assert_close(b, a, **FP32, msg=name)


@pytest.mark.parametrize("bias", [False, True])
def test_bf16_autocast_loss_and_gradients_equal_transformers(bias):
    (l0, h0, w0, b0), (l1, h1, w1, b1) = _both(bias, True, _labels())
    torch.testing.assert_close(l1, l0, **FP32)
    torch.testing.assert_close(h1, h0, rtol=1e-5, atol=1e-6)  # each row's GEMM is transformers' own, in bf16
    torch.testing.assert_close(w1 / w0.abs().max(), w0 / w0.abs().max(), **BF16_W)
    assert not torch.equal(w1, torch.zeros_like(w1))
    if bias:
        torch.testing.assert_close(b1 / b0.abs().max(), b0 / b0.abs().max(), **BF16_W)


def test_ignored_targets_count_for_nothing():
    """Targets at ``ignore_index`` change neither the loss nor any gradient: the mean is over the others, the rows
    they ignore get no hidden-state gradient; all ignored gives NaN, as transformers' mean of nothing."""
    y = _labels()
    ref, got = _both(False, False, y)
    torch.testing.assert_close(got[0], ref[0], **FP32)
    rows = torch.nn.functional.pad(y, (0, 1), value=-100)[:, 1:] == -100  # the shifted targets that are ignored
    assert rows.sum() == 5 + 1 + 1 + 1  # y[1, :5] and the last position of each row, y[0, 3] and y[1, -1]
    assert torch.equal(got[1][rows], torch.zeros_like(got[1][rows]))
    none = torch.full_like(y, -100)
    assert torch.isnan(fused_linear_cross_entropy(torch.randn(B, T, H), torch.randn(V, H), None, none))
    assert torch.isnan(ForCausalLMLoss(torch.randn(B, T, V), none, V))


def test_num_items_in_batch_and_shift_labels_as_transformers():
    """The sum divided by ``num_items_in_batch`` (the Trainer's gradient-accumulation normalization) and targets
    given already shifted (``shift_labels``), with the same meaning as in ``ForCausalLMLoss``."""
    y = _labels(1)
    ref, got = _both(False, False, y, num_items_in_batch=torch.tensor(50))
    for a, b in zip(ref[:3], got[:3]):
        torch.testing.assert_close(b, a, **FP32)
    shifted = torch.randint(0, V, (B, T), generator=torch.Generator().manual_seed(2))
    shifted[0, :4] = -100
    ref, got = _both(False, False, y, shift_labels=shifted)
    for a, b in zip(ref[:3], got[:3]):
        torch.testing.assert_close(b, a, **FP32)


def test_chunk_size_does_not_change_the_result_beyond_rounding():
    y = _labels()
    whole = _both(False, False, y, chunk=B * T)[1]
    for chunk in (1, 7, 64):
        got = _both(False, False, y, chunk=chunk)[1]
        for a, b in zip(whole[:3], got[:3]):
            torch.testing.assert_close(b, a, **FP32)
    assert chunk_tokens(49152) == 1024 and chunk_tokens(151936) == 256 and chunk_tokens(10 ** 7) == 64


def _tiny(model_type, **extra):
    cfg = AutoConfig.for_model(model_type, **DIMS, num_hidden_layers=2, vocab_size=V, **extra)
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(cfg)


@pytest.mark.parametrize("tied", [True, False])
@pytest.mark.parametrize("bf16", [False, True])
def test_a_models_own_forward_through_the_capture_equals_its_loss(tied, bf16):
    """A tiny llama trained one microbatch with its forward's loss routed through ``HeadCapture`` (as the
    single-process engine runs it) and as transformers runs it: the same loss and the same gradient of every
    parameter, the tied embedding's (the head's and the embedding's parts in one tensor) among them."""
    model = _tiny("llama", tie_word_embeddings=tied)
    assert (model.lm_head.weight is model.model.embed_tokens.weight) == tied
    ids = torch.randint(0, V, (B, 16), generator=torch.Generator().manual_seed(3))
    capture = HeadCapture(model.get_output_embeddings(), chunk=8)
    res = []
    for fused in (False, True):
        model.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            if fused:
                with capture.installed(model):
                    loss = model(input_ids=ids, labels=ids).loss
                    capture.check_used()
            else:
                loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        res.append((loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}))
    assert "_loss_function" not in vars(model) and "forward" not in vars(model.lm_head)  # restored
    torch.testing.assert_close(res[1][0], res[0][0], **FP32)
    assert res[1][1].keys() == res[0][1].keys()
    for n, g in res[0][1].items():
        scale = g.abs().max()
        # through the layers the last ulps of the hidden states' gradient spread: relative to each gradient's largest
        # entry, 1e-6 in fp32 (2.4e-7 seen); one bf16 ulp under autocast
        tol = dict(rtol=0.0, atol=1e-6) if not bf16 else BF16_W
        torch.testing.assert_close(res[1][1][n] / scale, g / scale, **tol, msg=n)


def test_soft_capped_or_scaled_logits_keep_transformers_path():
    """Gemma-2's final soft-capping, Cohere's and Granite's logit scaling change the logits before the loss: the
    fused loss is refused for them (``auto`` keeps transformers' path, ``true`` is an error naming why), and a
    gemma2 stage with ``auto`` gives exactly the model's own loss and gradients."""
    gemma = _tiny("gemma2", head_dim=8)
    assert gemma.config.final_logit_softcapping is not None
    assert "final_logit_softcapping" in fused_loss_blocker(gemma)
    assert "logit_scale" in fused_loss_blocker(_tiny("cohere"))
    assert "logits_scaling" in fused_loss_blocker(_tiny("granite"))
    assert fused_loss_blocker(_tiny("llama")) is None
    assert not use_fused_loss("auto", gemma) and use_fused_loss("auto", _tiny("llama"))
    with pytest.raises(RecipeError, match="final_logit_softcapping"):
        use_fused_loss(True, gemma)
    stages = partition_model(gemma, 2, fused_loss=use_fused_loss("auto", gemma))
    assert stages[-1]._capture is None
    ids = torch.randint(0, V, (B, 16), generator=torch.Generator().manual_seed(4))
    torch.manual_seed(5)
    ref = gemma(input_ids=ids, labels=ids).loss
    ref.backward()
    want = {n: p.grad.clone() for n, p in gemma.named_parameters()}
    gemma.zero_grad(set_to_none=True)
    torch.manual_seed(5)
    loss = run_stages(stages, ids, ids)
    loss.backward()
    torch.testing.assert_close(loss, ref, **FP32)
    got = {n: p.grad for s in stages for n, p in s.named_parameters() if p.grad is not None}
    assert gemma.config.tie_word_embeddings and len(got) == len(want) + 1  # the last stage's copy of the embedding
    for n, g in want.items():
        if n != "model.embed_tokens.weight":  # tied: the stages' two copies each hold a part of its gradient
            torch.testing.assert_close(got[n], g, **FP32, msg=n)
    torch.testing.assert_close(got["model.embed_tokens.weight"] + got["lm_head.weight"], want["model.embed_tokens.weight"],
                               **FP32)


class _InlineLoss(LlamaForCausalLM):
    """A causal LM computing its cross-entropy itself, as some transformers classes do."""

    def forward(self, input_ids=None, labels=None, **kwargs):
        out = super().forward(input_ids=input_ids, **kwargs)
        if labels is not None:
            out.loss = F.cross_entropy(out.logits[:, :-1].flatten(0, 1).float(), labels[:, 1:].flatten())
        return out


def test_a_forward_that_skips_the_loss_function_is_refused():
    """A model whose forward computes its cross-entropy without ``loss_function`` would read the stand-in: refused
    from its source, and the capture says so at run time instead of returning a loss."""
    inline = _InlineLoss(_tiny("llama").config)
    assert "self.loss_function" in fused_loss_blocker(inline) and not use_fused_loss("auto", inline)
    model = _tiny("llama")
    capture = HeadCapture(model.get_output_embeddings())
    ids = torch.randint(0, V, (1, 8))
    with capture.installed(model):
        model(input_ids=ids)  # no labels: the head's stand-in returned, no loss asked for
        with pytest.raises(RuntimeError, match="never called its loss_function"):
            capture.check_used()


# ---------------------------------------------------------------------------- memory


def test_peak_memory_per_token_of_the_fused_head_and_loss():
    """At most 4,096 bytes per token at smollm2-360m's head (hidden 960, vocab 49,152; the hidden states' fp32
    gradient is 3,840 of them), read from the allocator (``python -m bench.fused_loss``): transformers' path,
    measured the same way, holds about 12 bytes per logit (590 KB per token; its weight-sized terms set the peak
    below about 600 tokens, hence its larger counts)."""
    fused = head_and_loss_bytes_per_token(True, (256, 512))
    assert fused <= 4096, fused
    plain = head_and_loss_bytes_per_token(False, (1024, 2048))
    assert plain >= 11 * 49152, plain
