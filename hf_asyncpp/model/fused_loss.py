"""A causal LM's head and loss without its ``[tokens, vocab]`` logits: chunked fused linear cross-entropy.

transformers computes ``lm_head(hidden)`` (bf16 under autocast), then ``ForCausalLMLoss``, which upcasts the whole
logits to fp32 before the log-softmax: at its peak about 11 bytes per logit live at once (540,672 bytes per token
at hidden 960, vocab 49,152; 17.9 GB for 16 x 2048 tokens). Here the head's GEMM, the log-softmax, the loss and
its gradients with respect to the hidden states and the head's weight (and bias) are computed together, one chunk
of tokens at a time, in the forward: only one chunk's logits exist at a time, and what outlives the forward is the
hidden states' gradient (the hidden states' size) and the head's (the weight's size). The backward only scales them
by the incoming gradient. Numerics are transformers' under autocast: the GEMMs in the autocast dtype, the
log-softmax and the loss in fp32, the weight gradient summed over chunks in fp32.

Pure torch (no kernel of its own): the peak falls, the memory traffic per logit stays about the eager path's.
``HeadCapture`` routes a model's own forward through it, so everything else the model computes (MoE auxiliary
losses, masks) stays the model's.
"""
from __future__ import annotations

import inspect
from contextlib import contextmanager

import torch
from torch import nn
from transformers.loss.loss_utils import ForCausalLMLoss

from ..errors import RecipeError

__all__ = ["fused_linear_cross_entropy", "chunk_tokens", "fused_loss_blocker", "use_fused_loss", "HeadCapture",
           "CHUNK_BYTES", "LOGIT_KNOBS"]

CHUNK_BYTES = 256 * 2**20
"""fp32 logits per chunk, at most (unless a chunk would hold fewer than 64 tokens): 1,024 tokens at vocab 49,152,
256 at 151,936. A chunk's peak is about 10 bytes per logit of it (bf16 logits, their fp32 copy, the fp32 log-softmax,
then the bf16 gradient): about 640 MB, a constant whatever the microbatch. Smaller chunks add a pass over the fp32
weight gradient each (one accumulation per chunk)."""


def chunk_tokens(vocab_size: int, budget: int = CHUNK_BYTES) -> int:
    """Tokens per chunk: the largest power of two whose fp32 logits fit ``budget`` bytes (64 at least)."""
    n = max(64, budget // (4 * vocab_size))
    return 1 << (n.bit_length() - 1)


class _HiddenGrad(torch.autograd.Function):
    """The loss (sum over the targets, divided by ``denom``) and, when asked, both gradients, chunk by chunk. Its node
    holds only the hidden states' gradient; the head's weight gradient is :class:`_WeightGrad`'s, so that a
    zero-bubble W (the weights' part of a backward, run again from the I's intermediates) recomputes nothing here."""

    @staticmethod
    def forward(ctx, h, w, b, targets, denom, chunk: int, grads: bool, ignore_index: int):
        x2 = h.reshape(-1, h.shape[-1])
        n, dtype = x2.shape[0], w.dtype
        total = torch.zeros((), dtype=torch.float32, device=h.device)
        dh = dw = db = None
        if grads:
            valid = targets != ignore_index
            scale = valid.to(torch.float32).div_(denom)  # d loss / d logit of a row, before the softmax
            safe = targets.masked_fill(~valid, 0)[:, None]
            minus = torch.full((1, 1), -1.0, device=h.device).expand(n, 1)
            dh = torch.empty_like(x2)
            dw = torch.zeros(w.shape, dtype=torch.float32, device=w.device)
            db = torch.zeros(w.shape[0], dtype=torch.float32, device=w.device) if b is not None else None
        with torch.autocast(h.device.type, enabled=False):
            for s in range(0, n, chunk):
                e = min(s + chunk, n)
                x = x2[s:e].to(dtype)
                logits = nn.functional.linear(x, w, b)
                logp = torch.log_softmax(logits.float(), dim=-1)
                del logits
                total += nn.functional.nll_loss(logp, targets[s:e], ignore_index=ignore_index, reduction="sum")
                if not grads:
                    continue
                g = logp.exp_()  # the softmax, in place
                del logp
                g.scatter_add_(1, safe[s:e], minus[s:e]).mul_(scale[s:e, None])
                g = g.to(dtype)
                if dh.dtype == dtype:
                    torch.mm(g, w, out=dh[s:e])
                else:
                    dh[s:e] = torch.mm(g, w)
                if dtype == torch.float32:
                    dw.addmm_(g.t(), x)
                else:
                    dw += torch.mm(g.t(), x)
                if db is not None:
                    db += g.sum(0, dtype=torch.float32)
        loss = total / denom
        if not grads:
            return loss, None, None
        ctx.dh = dh  # not saved_tensors: its version moves with the in-place scaling below
        ctx.shape, ctx.scaled_by = h.shape, None
        out = (dw, db) if db is not None else (dw,)
        ctx.mark_non_differentiable(*out)
        return loss, dw, db

    @staticmethod
    def backward(ctx, g, *_):
        # The hidden states' gradient is scaled in place (a copy would double the last stage's peak). A second
        # traversal of the graph is the zero-bubble W re-entering it with the gradient the I gave (the split backward
        # clamps every intermediate to it): rescaling by g / g_before is then a multiplication by exactly 1.
        dh = ctx.dh
        dh.mul_(g if ctx.scaled_by is None else g / ctx.scaled_by)
        ctx.scaled_by = g
        return dh.view(ctx.shape), None, None, None, None, None, None, None


class _WeightGrad(torch.autograd.Function):
    """Passes the loss on and gives the head's weight (and bias) the gradient :class:`_HiddenGrad` computed."""

    @staticmethod
    def forward(ctx, loss, w, b, dw, db):
        ctx.save_for_backward(dw, db)
        ctx.has_bias = b is not None
        return loss.clone()

    @staticmethod
    def backward(ctx, g):
        dw, db = ctx.saved_tensors
        return g, dw * g, (db * g if ctx.has_bias else None), None, None


def fused_linear_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                               labels: torch.Tensor, *, num_items_in_batch=None, ignore_index: int = -100,
                               shift_labels: torch.Tensor | None = None, chunk: int | None = None) -> torch.Tensor:
    """``ForCausalLMLoss(F.linear(hidden, weight, bias), labels, V, num_items_in_batch, ignore_index, shift_labels)``,
    value and gradients, without the whole logits.

    As transformers: ``labels`` ``(..., T)`` are shifted left by one inside (the last position predicts nothing),
    unless ``shift_labels`` gives the targets already shifted; targets equal to ``ignore_index`` count for nothing;
    the loss is the mean over the other targets, or, with ``num_items_in_batch``, their sum divided by it. Under
    autocast the weight and bias are cast as autocast casts them for ``F.linear`` (a cast autograd sees, so a bf16
    copy held per weight version replaces it), the hidden states one chunk at a time. ``chunk``: tokens per chunk
    (default :func:`chunk_tokens`)."""
    dev = hidden.device.type
    if torch.is_autocast_enabled(dev):
        dtype = torch.get_autocast_dtype(dev)
        weight = weight.to(dtype)
        bias = bias.to(dtype) if bias is not None else None
    if shift_labels is None:
        shift_labels = nn.functional.pad(labels, (0, 1), value=ignore_index)[..., 1:]
    targets = shift_labels.reshape(-1).to(hidden.device)
    if num_items_in_batch is None:
        denom = (targets != ignore_index).sum()
    else:
        denom = num_items_in_batch.to(hidden.device) if torch.is_tensor(num_items_in_batch) else num_items_in_batch
    needs = [t for t in (hidden, weight, bias) if t is not None and t.requires_grad]
    grads = torch.is_grad_enabled() and bool(needs)
    loss, dw, db = _HiddenGrad.apply(hidden, weight.detach(), bias.detach() if bias is not None else None, targets,
                                     denom, chunk or chunk_tokens(weight.shape[0]), grads, ignore_index)
    if not grads:
        return loss
    return _WeightGrad.apply(loss, weight, bias, dw, db)


LOGIT_KNOBS = ("final_logit_softcapping", "logit_scale", "logits_scaling")
"""Config fields with which a transformers model changes the head's output before its loss (Gemma-2/3's soft-capping
``tanh(x / c) * c``, Cohere's ``logit_scale`` product, Granite's ``logits_scaling`` division): the loss is no longer
the cross-entropy of a plain linear head, so such a model keeps transformers' own path."""


def fused_loss_blocker(model: nn.Module) -> str | None:
    """Why the fused loss cannot stand for this model's own (None: it can). Conservative on purpose: the output
    head must be exactly ``nn.Linear`` (a subclass or another module may compute something else), the model's loss
    transformers' ``ForCausalLMLoss`` (no ``loss_type`` of its own, no loss function set on it) and called by its
    forward as ``self.loss_function(...)`` (read from the forward's source: some classes compute their cross-entropy
    inline), and its config must set none of :data:`LOGIT_KNOBS`. At run time :class:`HeadCapture` also checks that the loss receives the head's
    output untouched, and raises if not."""
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if head is None or type(head) is not nn.Linear:
        return f"its output head is {type(head).__name__}, not a plain torch.nn.Linear"
    if "_loss_function" in vars(model) or getattr(model, "loss_function", None) is not ForCausalLMLoss:
        return "its loss is not transformers' ForCausalLMLoss"
    try:
        source = inspect.getsource(type(model).forward)
    except (OSError, TypeError):
        source = ""
    if "self.loss_function(" not in source:
        return "its forward does not compute its loss with self.loss_function (it would read the head's stand-in)"
    knobs = [k for k in LOGIT_KNOBS if getattr(model.config, k, None) is not None]
    if knobs:
        return f"its config transforms the logits before the loss ({', '.join(f'{k}={getattr(model.config, k)}' for k in knobs)})"
    return None


def use_fused_loss(setting, model: nn.Module) -> bool:
    """``training.fused_loss``: ``auto`` turns it on where :func:`fused_loss_blocker` finds nothing against it;
    ``true`` requires it (a RecipeError names why it cannot be); ``false`` keeps transformers' own head and loss."""
    if setting is False:
        return False
    why = fused_loss_blocker(model)
    if setting is True and why:
        raise RecipeError(f"training.fused_loss: true, but {type(model).__name__}: {why}; use auto or false")
    return why is None


class HeadCapture:
    """Runs a model's own forward with ``labels`` through :func:`fused_linear_cross_entropy`: the head records its
    input and returns a stand-in (an expanded scalar: no memory), and the model's ``loss_function`` (its
    ``_loss_function`` attribute, which transformers reads first) computes the fused loss from what the head
    recorded, with the arguments the model passes (``num_items_in_batch``, ``ignore_index``, ``shift_labels``). The
    rest of the model's forward is its own: a MoE model still adds its router loss to what the loss returns.
    ``chunk``: tokens per chunk (default :func:`chunk_tokens`)."""

    def __init__(self, head: nn.Linear, chunk: int | None = None):
        self.head, self.chunk = head, chunk
        self._hidden = self._stand_in = None

    def head_forward(self, x: torch.Tensor) -> torch.Tensor:
        """The head's forward while capturing: record ``x``, return a stand-in of the logits' shape and dtype."""
        dev = x.device.type
        dtype = torch.get_autocast_dtype(dev) if torch.is_autocast_enabled(dev) else self.head.weight.dtype
        self._hidden = x
        self._stand_in = torch.empty((), dtype=dtype, device=x.device).expand(*x.shape[:-1], self.head.out_features)
        return self._stand_in

    def loss_function(self, logits, labels, vocab_size=None, num_items_in_batch=None, ignore_index: int = -100,
                      shift_labels=None, **kwargs):
        """``ForCausalLMLoss``'s signature; ``logits`` must be the head's stand-in, untouched."""
        hidden, stand_in = self._hidden, self._stand_in
        self._hidden = self._stand_in = None
        if stand_in is None or logits is not stand_in:
            raise RuntimeError("fused loss: the model's loss did not receive its head's output as it left the head (the "
                               "forward transforms the logits first); set training.fused_loss: false for this model")
        return fused_linear_cross_entropy(hidden, self.head.weight, self.head.bias, labels,
                                          num_items_in_batch=num_items_in_batch, ignore_index=ignore_index,
                                          shift_labels=shift_labels, chunk=self.chunk)

    def check_used(self) -> None:
        """After the model's forward: its loss was this one. A model that computes its cross-entropy itself, not
        through ``loss_function``, would have read the stand-in (values never written): refused, loudly."""
        if self._stand_in is not None:
            self._hidden = self._stand_in = None
            raise RuntimeError("fused loss: the model's forward never called its loss_function on its head's output (it "
                               "computes its loss some other way); set training.fused_loss: false for this model")

    @contextmanager
    def installed(self, model: nn.Module):
        """For the duration: ``model`` (whose output head is ``self.head``) computes its loss here. Restored after."""
        had = "_loss_function" in vars(model)
        if had:
            raise RuntimeError(f"{type(model).__name__} has a loss function of its own; the fused loss would replace it")
        self.head.__dict__["forward"] = self.head_forward
        model.__dict__["_loss_function"] = self.loss_function
        try:
            yield
        finally:
            del self.head.__dict__["forward"]
            del model.__dict__["_loss_function"]
            self._hidden = self._stand_in = None
