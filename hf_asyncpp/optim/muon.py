"""Muon with an AdamW side, in one optimizer (so one LR scheduler drives both).

Pure functions first (Newton-Schulz, the Muon and AdamW updates), then a thin
``torch.optim.Optimizer`` whose param groups carry ``use_muon`` (Keller Jordan's
``MuonWithAuxAdam`` layout).

- 2-D matrices: numerically the same update as ``torch.optim.Muon`` (momentum
  lerp, Nesterov, quintic Newton-Schulz in bfloat16 on the Frobenius-normalized
  matrix, rows <= cols by transposing, lr scaled per matrix, decoupled weight
  decay ``p *= 1 - lr * wd`` with the *unscaled* lr, as torch does).
- 3-D MoE expert stacks ``(E, A, B)``: every expert's ``(A, B)`` matrix is
  orthogonalized in ONE batched call over the leading dim. HF stores most
  experts as ``(E, out, in)`` but GPT-OSS as ``(E, in, out)``; NS is
  transpose-equivariant (NS(G^T) = NS(G)^T, the rows <= cols convention only
  picks which Gram matrix is formed), so the update is right either way.
- The lr scale reads the tensor's last two dims as (rows, cols), like
  ``torch.optim.Muon`` and Keller Jordan's code. ``match_rms_adamw``
  (0.2 sqrt(max(rows, cols))) is symmetric; ``original`` (sqrt(max(1, rows/cols)))
  is not: for tensors stored (in, out) -- GPT-2 Conv1D, GPT-OSS experts -- it
  gives sqrt(max(1, in/out)) where a Linear of the same layer would get
  sqrt(max(1, out/in)).

- Fused projections: a Muon group with ``split_rows = k`` (> 1) orthogonalizes each of the k equal row blocks
  of every matrix on its own, with the lr scale of the block's shape: exactly what k separate
  parameters would get. transformers 5 stores an MoE layer's expert gate and up projections as one
  ``gate_up_proj`` (E, 2I, H) where transformers 4 (and dense Llama) had two (I, H) matrices;
  ``optimizer.muon_split_fused`` (builder) puts those in a ``split_rows = 2`` group.

``Muon.ns_calls[id(p)]`` counts the matrices Newton-Schulz orthogonalized for
``p`` (experts count one each), so tests can prove no Muon parameter ever fell
back silently to another update.
"""
from __future__ import annotations

import math

import torch
from torch import Tensor
from torch.optim.adam import adam

__all__ = ["NS_COEFFICIENTS", "zeropower_via_newtonschulz", "adjusted_lr", "muon_update", "adamw_update", "Muon"]

NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)
EPS = 1e-7

MUON_DEFAULTS = dict(lr=1e-3, momentum=0.95, nesterov=True, weight_decay=0.1, ns_steps=5, adjust_lr="original",
                     ns_dtype="bfloat16", ns_coefficients=NS_COEFFICIENTS, eps=EPS, split_rows=1)
"""Muon group keys and their defaults (those of ``torch.optim.Muon``)."""
ADAMW_DEFAULTS = dict(lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2)
"""AdamW group keys and their defaults (those of ``torch.optim.AdamW``)."""
_OTHER_KEYS = {"params", "use_muon", "name", "initial_lr", "param_names"}


def zeropower_via_newtonschulz(g: Tensor, steps: int = 5, coefficients=NS_COEFFICIENTS, eps: float = EPS,
                               dtype: torch.dtype = torch.bfloat16) -> Tensor:
    """Approximately orthogonalize the last two dims of ``g`` (batched over any leading dims).

    Quintic Newton-Schulz on the Frobenius-normalized matrix, computed in ``dtype`` (bfloat16 as
    ``torch.optim.Muon``). The coefficients maximize the slope at zero rather than converge: the
    result is about U S' V^T with S' in roughly [0.5, 1.5] instead of U V^T, which does not hurt
    training (Keller Jordan). Wide matrices are iterated as given, tall ones transposed first, so
    the Gram matrix is the small (rows x rows) one. Returns a tensor of ``dtype``.
    """
    a, b, c = coefficients
    x = g.to(dtype)
    tall = g.size(-2) > g.size(-1)
    if tall:
        x = x.mT
    x = x / x.norm(dim=(-2, -1), keepdim=True).clamp(min=eps)  # spectral norm <= 1
    if x.dim() not in (2, 3):
        raise ValueError(f"Newton-Schulz takes a matrix or a stack of matrices, got shape {tuple(g.shape)}")
    mm = torch.addmm if x.dim() == 2 else torch.baddbmm  # 3-D: one batched call over the experts
    for _ in range(steps):
        gram = x @ x.mT
        update = mm(gram, gram, gram, beta=b, alpha=c)  # b A + c A^2
        x = mm(x, update, x, beta=a)  # a X + (b A + c A^2) X
    return x.mT if tall else x


def adjusted_lr(lr: float, shape: torch.Size, how: str) -> float:
    """Per-matrix lr of a (..., rows, cols) tensor: ``original`` lr sqrt(max(1, rows/cols)),
    ``match_rms_adamw`` lr 0.2 sqrt(max(rows, cols)) (Moonshot: update RMS about AdamW's)."""
    rows, cols = shape[-2], shape[-1]
    if how == "original":
        return lr * math.sqrt(max(1.0, rows / cols))
    if how == "match_rms_adamw":
        return lr * 0.2 * math.sqrt(max(rows, cols))
    raise ValueError(f"optimizer.adjust_lr: {how!r} is not one of 'original', 'match_rms_adamw'")


def muon_update(grad: Tensor, momentum_buffer: Tensor, *, momentum: float, nesterov: bool, ns_steps: int,
                ns_coefficients=NS_COEFFICIENTS, eps: float = EPS, ns_dtype: torch.dtype = torch.bfloat16,
                split_rows: int = 1) -> Tensor:
    """Advance the momentum buffer in place and return the orthogonalized direction (not yet lr-scaled).
    ``split_rows = k``: each of the k equal row blocks of every matrix is orthogonalized on its own (one batched
    call over experts x blocks)."""
    momentum_buffer.lerp_(grad, 1 - momentum)
    direction = grad.lerp(momentum_buffer, momentum) if nesterov else momentum_buffer
    if split_rows == 1:
        return zeropower_via_newtonschulz(direction, ns_steps, ns_coefficients, eps, ns_dtype)
    rows, cols = direction.shape[-2:]
    blocks = direction.reshape(-1, rows // split_rows, cols)  # (..., k*r, c) -> (... * k, r, c): row blocks in order
    return zeropower_via_newtonschulz(blocks, ns_steps, ns_coefficients, eps, ns_dtype).reshape(direction.shape)


def adamw_update(p: Tensor, grad: Tensor, state: dict, *, lr: float, betas, eps: float, weight_decay: float) -> None:
    """``torch.optim.AdamW``'s single-tensor update of ``p`` in place (same state keys: step, exp_avg, exp_avg_sq)."""
    if not state:
        state["step"] = torch.zeros((), dtype=torch.float32)
        state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
    state["step"] += 1
    step = float(state["step"])
    beta1, beta2 = betas
    p.mul_(1 - lr * weight_decay)
    state["exp_avg"].lerp_(grad, 1 - beta1)
    state["exp_avg_sq"].mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
    denom = (state["exp_avg_sq"].sqrt() / math.sqrt(1 - beta2**step)).add_(eps)
    p.addcdiv_(state["exp_avg"], denom, value=-lr / (1 - beta1**step))


def _dtype(d) -> torch.dtype:
    """``ns_dtype`` is kept as a string ('bfloat16') in the group so state dicts stay plain data."""
    out = d if isinstance(d, torch.dtype) else getattr(torch, str(d), None)
    if not isinstance(out, torch.dtype):
        raise ValueError(f"Muon: ns_dtype {d!r} is not a torch dtype; use 'bfloat16', 'float32' or 'float64'")
    return out


class Muon(torch.optim.Optimizer):
    """Hybrid optimizer: groups with ``use_muon=True`` get Muon, the others AdamW.

    Every group must say ``use_muon``. Muon groups take the keys of ``MUON_DEFAULTS`` (lr, momentum,
    nesterov, weight_decay, ns_steps, adjust_lr, ns_dtype as a string, ns_coefficients, eps) and
    2-D or 3-D parameters; AdamW groups those of ``ADAMW_DEFAULTS`` (lr, betas, eps, weight_decay).
    A missing key takes its default, an unknown one is an error. An optional ``name`` labels the group.

    Example::

        opt = Muon([dict(params=matrices, use_muon=True, lr=0.02, adjust_lr="match_rms_adamw"),
                    dict(params=others, use_muon=False, lr=3e-4, betas=(0.9, 0.95), weight_decay=0.0)])
    """

    def __init__(self, param_groups: list[dict]):
        self.ns_calls: dict[int, int] = {}
        super().__init__(param_groups, {})  # every group goes through add_param_group
        self.register_load_state_dict_post_hook(_steps_on_the_parameters_device)

    def add_param_group(self, param_group: dict) -> None:
        """Check a group (``use_muon``, known keys, Muon shapes) and fill its missing keys with the defaults."""
        i, g = len(self.param_groups), param_group
        if not isinstance(g, dict) or "use_muon" not in g:
            raise ValueError(f"Muon param group {i}: needs use_muon=True (Muon) or use_muon=False (AdamW)")
        defaults = MUON_DEFAULTS if g["use_muon"] else ADAMW_DEFAULTS
        unknown = sorted(set(g) - set(defaults) - _OTHER_KEYS)
        if unknown:
            kind = "Muon" if g["use_muon"] else "AdamW"
            raise ValueError(f"Muon param group {i} ({kind}): unknown keys {unknown}; allowed: {sorted(defaults)}")
        g = {**defaults, **g}
        if g["use_muon"]:
            adjusted_lr(1.0, torch.Size([1, 1]), g["adjust_lr"])  # validates the name
            _dtype(g["ns_dtype"])
            params = [g["params"]] if isinstance(g["params"], Tensor) else list(g["params"])
            k = g["split_rows"]
            for p in params:
                if p.dim() not in (2, 3):
                    raise ValueError(f"Muon param group {i}: Muon takes 2-D matrices or 3-D expert stacks, got "
                                     f"shape {tuple(p.shape)}; put it in a use_muon=False (AdamW) group")
                if not isinstance(k, int) or k < 1 or p.shape[-2] % k:
                    raise ValueError(f"Muon param group {i}: split_rows {k!r} does not divide the rows of a matrix "
                                     f"of shape {tuple(p.shape)}")
            g["params"] = params
        super().add_param_group(g)

    @torch.no_grad()
    def step(self, closure=None):
        """One update of every parameter with a gradient, in a handful of kernels: per Muon group one batched
        Newton-Schulz per shape class (every same-shape matrix of the group in one stack, as modded-nanogpt and
        nanochat do) and foreach momentum, decay and update; per AdamW group torch's fused AdamW (its step counters
        on the parameters' device, so nothing is read back to the host)."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for g in self.param_groups:
            params = [p for p in g["params"] if p.grad is not None]
            if params:
                (self._muon_step if g["use_muon"] else self._adamw_step)(g, params)
        return loss

    def _muon_step(self, g: dict, params: list[Tensor]) -> None:
        states = [self.state[p] for p in params]
        for p, s in zip(params, states):
            if "momentum_buffer" not in s:  # the first step only
                s["momentum_buffer"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        grads, bufs = [p.grad for p in params], [s["momentum_buffer"] for s in states]
        torch._foreach_lerp_(bufs, grads, 1 - g["momentum"])
        directions = torch._foreach_lerp(grads, bufs, g["momentum"]) if g["nesterov"] else bufs
        torch._foreach_mul_(params, 1 - g["lr"] * g["weight_decay"])
        k = g["split_rows"]
        for idx in shape_classes(params).values():
            shape = params[idx[0]].shape
            block = (shape[-2] // k, shape[-1])  # the matrices Newton-Schulz sees (a row block of a fused projection)
            stack = torch.stack([directions[i] for i in idx])
            update = zeropower_via_newtonschulz(stack.reshape(-1, *block), g["ns_steps"], g["ns_coefficients"],
                                                g["eps"], _dtype(g["ns_dtype"])).reshape(stack.shape)
            torch._foreach_add_([params[i] for i in idx], list(update.unbind(0)),
                                alpha=-adjusted_lr(g["lr"], block, g["adjust_lr"]))
            per_tensor = (math.prod(shape[:-2]) if len(shape) > 2 else 1) * k
            for i in idx:
                self.ns_calls[id(params[i])] = self.ns_calls.get(id(params[i]), 0) + per_tensor

    def _adamw_step(self, g: dict, params: list[Tensor]) -> None:
        states = [self.state[p] for p in params]
        for p, s in zip(params, states):
            if not s:  # the first step only
                s["step"] = torch.zeros((), dtype=torch.float32, device=p.device)
                s["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                s["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        beta1, beta2 = g["betas"]
        adam(params, [p.grad for p in params], [s["exp_avg"] for s in states], [s["exp_avg_sq"] for s in states], [],
             [s["step"] for s in states], fused=True, decoupled_weight_decay=True, amsgrad=False, beta1=beta1,
             beta2=beta2, lr=g["lr"], weight_decay=g["weight_decay"], eps=g["eps"], maximize=False)


def shape_classes(params: list[Tensor]) -> dict[tuple, list[int]]:
    """Indices of ``params`` by (shape, dtype, device): the tensors one batched Newton-Schulz call takes."""
    classes: dict[tuple, list[int]] = {}
    for i, p in enumerate(params):
        classes.setdefault((tuple(p.shape), p.dtype, p.device), []).append(i)
    return classes


def _steps_on_the_parameters_device(opt: Muon) -> None:
    """After ``load_state_dict``: AdamW's step counters where the fused kernel reads them (torch moves a ``step`` to
    the parameter's device only for groups it knows to be fused or capturable)."""
    for g in opt.param_groups:
        if not g["use_muon"]:
            for p in g["params"]:
                s = opt.state.get(p)
                if s and "step" in s and s["step"].device != p.device:
                    s["step"] = s["step"].to(device=p.device, dtype=torch.float32)
