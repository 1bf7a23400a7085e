"""transformers' router auxiliary loss, pooled across stages (2E + 1 numbers cross a stage boundary)."""
from __future__ import annotations

import inspect
import sys
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch import nn

from .plan import moe_shape
from .trace import PartitionError, get_module


@dataclass(frozen=True)
class AuxLoss:
    """transformers' Switch load-balancing loss, computed from statistics pooled over every MoE layer of every stage.

    ``load_balancing_loss_func`` only needs, summed over all router calls: the softmax probabilities per expert
    (differentiable), the top-k assignment counts per expert, and the number of rows. Stages add their layers' sums
    to the running totals they receive, so what crosses a stage boundary is 2E + 1 numbers, whatever the depth.
    """

    num_experts: int
    top_k: int
    coef: float
    recorders: tuple  # transformers OutputRecorder specs that capture router logits

    def zeros(self, device) -> tuple[torch.Tensor, torch.Tensor]:
        prob = torch.zeros(self.num_experts, dtype=torch.float32, device=device, requires_grad=torch.is_grad_enabled())
        return prob, torch.zeros(self.num_experts + 1, dtype=torch.int64, device=device)

    def accumulate(self, prob_sum, counts, logits_list):
        """Add router logits to (probability sums (E,), [assignment counts (E,), rows]) in transformers' order.

        One router call at a time, so the probability sums are added in the same order whatever the split (a stage
        boundary between two layers changes no bit); the integer counts are exact in any order, so each call adds
        its top-k hits with one out-of-place ``scatter_add`` and the rows are added once at the end (a layer costs
        one op for its counts, not seven)."""
        E, rows, ones = self.num_experts, 0, None
        for logits in logits_list:
            weights = torch.nn.functional.softmax(logits.to(prob_sum.device), dim=-1)
            _, selected = torch.topk(weights, self.top_k, dim=-1)
            sel = selected.reshape(-1)
            if ones is None or ones.shape != sel.shape:
                ones = torch.ones_like(sel)
            counts = counts.scatter_add(0, sel, ones)
            rows += weights.shape[0]
            prob_sum = prob_sum + weights.float().sum(dim=0)
        if rows:
            counts.select(0, E).add_(rows)  # in the tensor this call's scatter_add made, not the one received
        return prob_sum, counts

    def loss(self, prob_sum, counts) -> torch.Tensor:
        rows = counts[-1].to(torch.float32)
        tokens_per_expert = counts[:-1].to(torch.float32) / rows
        router_prob_per_expert = prob_sum / rows
        return torch.sum(tokens_per_expert * router_prob_per_expert.unsqueeze(0)) * self.num_experts


def expert_token_counts(router_logits, top_k: int) -> torch.Tensor:
    """(router calls, experts) int64: the tokens each router call sent to each expert, chosen as transformers' routers
    and ``load_balancing_loss_func`` choose them (top-k of the softmax). The aux loss is one number pooled over every
    layer; the counts per layer show which router's load drifts, and by how much. Counted with ``scatter_add`` into
    a fixed size (``bincount``'s size depends on the data: a host sync on a GPU)."""
    with torch.no_grad():
        selected = torch.stack([torch.topk(torch.softmax(logits.float(), dim=-1), top_k, dim=-1).indices.reshape(-1)
                                for logits in router_logits])
        counts = torch.zeros(selected.shape[0], router_logits[0].shape[-1], dtype=torch.int64, device=selected.device)
        return counts.scatter_add_(1, selected, torch.ones_like(selected))


@dataclass(frozen=True)
class GatheredAux:
    """A router aux loss that is not the Switch loss of pooled sums (Doge's product-key routing): every stage sends
    the router logits of all router calls so far, and the last stage calls the model's own loss function on all of
    them, with the arguments the model's forward passes it (read from its source). Cost: the router logits of the
    earlier layers cross each boundary (one (rows, experts) tensor per router call, small beside the hidden state).
    """

    fn: object  # the model module's load_balancing_loss_func
    args: tuple  # its arguments after the router logits (attention_mask: None, stages get no padding mask)
    coef: float
    recorders: tuple

    def zeros(self, device) -> tuple:
        return ()

    def accumulate(self, *stats_and_logits):
        *stats, logits_list = stats_and_logits
        return tuple(stats) + tuple(logits_list)

    def loss(self, *logits) -> torch.Tensor:
        # no router ran (a model without MoE layers): the model's function gets None, as from the model's forward
        return torch.as_tensor(self.fn(tuple(logits) if logits else None, *self.args))


def _loss_call(model: nn.Module):
    """From the model's forward source: the arguments of its ``load_balancing_loss_func(...)`` call after the router
    logits, and the coefficient of ``loss += coef * aux_loss``, evaluated on the model (None where not found)."""
    import ast
    import textwrap

    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(type(model).forward)))
    except (OSError, TypeError, SyntaxError):
        return None, None
    env = dict(vars(sys.modules[type(model).__module__]), self=model, attention_mask=None)
    args, coef = None, None
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "load_balancing_loss_func" and node.args:
            try:
                args = tuple(eval(compile(ast.Expression(a), "<aux>", "eval"), env) for a in node.args[1:])
            except Exception:
                args = None
        if isinstance(node, ast.AugAssign) and isinstance(node.op, ast.Add) and isinstance(node.value, ast.BinOp) \
                and isinstance(node.value.op, ast.Mult):
            for side in (node.value.left, node.value.right):
                if not any(isinstance(n, ast.Name) and n.id == "aux_loss" for n in ast.walk(side)):
                    try:
                        coef = float(eval(compile(ast.Expression(side), "<aux>", "eval"), env))
                    except Exception:
                        pass
    return args, coef


def _adds_aux_loss(model: nn.Module) -> bool:
    """Whether the model's forward adds an aux loss (mentions one other than ``aux_loss=None``)."""
    import re

    src = inspect.getsource(type(model).forward)
    return re.search(r"\baux_loss\b(?!\s*=\s*None)", src) is not None


def _aux_loss(model: nn.Module) -> AuxLoss | GatheredAux | None:
    """The router aux loss the model adds to its loss, or None; refuses a loss it cannot reproduce."""
    cfg, cls = model.config, type(model).__name__
    if not getattr(cfg, "output_router_logits", False):
        return None
    fn = getattr(sys.modules[type(model).__module__], "load_balancing_loss_func", None)
    if fn is None:
        if _adds_aux_loss(model):
            raise PartitionError(f"{cls}: adds a router aux loss without a module-level load_balancing_loss_func; "
                                 "the stage builder cannot reproduce it: set config.output_router_logits=False (no aux "
                                 "loss) or train on one stage")
        return None  # e.g. DeepSeek-V3: auxiliary-loss-free balancing, nothing is added
    rec = None
    for m in (model, get_module(model, getattr(model, "base_model_prefix", "model"))):
        rec = (getattr(m, "_can_record_outputs", None) or {}).get("router_logits") if m is not None else None
        if rec:
            break
    recorders = tuple(rec if isinstance(rec, (list, tuple)) else [rec]) if rec else ()
    if not recorders or any(getattr(r, "target_class", None) is None and getattr(r, "class_name", None) is None for r in recorders):
        raise PartitionError(f"{cls}: adds a router aux loss but declares no router_logits recorder; cannot pool router "
                             "statistics across stages")
    E = getattr(model, "num_experts", None) or moe_shape(cfg)[0]
    k = getattr(model, "num_experts_per_tok", None) or getattr(cfg, "num_experts_per_tok", None)
    coef = getattr(model, "router_aux_loss_coef", None)
    coef = coef if coef is not None else getattr(cfg, "router_aux_loss_coef", None)
    call_args, call_coef = _loss_call(model)
    coef = coef if coef is not None else call_coef
    if not (E and k and coef is not None):
        return _gathered(model, fn, call_args, call_coef, recorders)
    aux = AuxLoss(int(E), int(k), float(coef), recorders)
    # The pooled sums are exact only for the Switch loss; check this transformers' function is that loss.
    g = torch.Generator().manual_seed(0)
    logits = tuple(torch.randn(7, aux.num_experts, generator=g) for _ in range(3))
    try:
        with torch.no_grad():
            want = fn(logits, aux.num_experts, aux.top_k, None)
            got = aux.loss(*aux.accumulate(*aux.zeros("cpu"), logits))
    except Exception:  # another signature: not the Switch loss
        want = None
    if not torch.is_tensor(want) or not torch.allclose(got, want.float(), rtol=1e-5, atol=1e-7):
        return _gathered(model, fn, call_args, call_coef, recorders)
    return aux


def _gathered(model, fn, args, coef, recorders) -> GatheredAux:
    cls = type(model).__name__
    if args is None or coef is None:
        raise PartitionError(f"{cls}: {type(model).__module__}.load_balancing_loss_func is not the Switch loss of pooled "
                             "router statistics, and its arguments or coefficient cannot be read from "
                             f"{cls}.forward's source; set config.output_router_logits=False (no aux loss) or train on "
                             "one stage")
    return GatheredAux(fn, args, float(coef), recorders)


def _router_modules(layer_path: str, layer: nn.Module, recorders) -> list[tuple[nn.Module, int]]:
    """The modules whose outputs transformers records as router logits (same matching rules as its recorder)."""
    out = []
    for name, m in layer.named_modules():
        full = f"{layer_path}.{name}" if name else layer_path
        for r in recorders:
            hit = (r.target_class is not None and isinstance(m, r.target_class)) or (
                r.class_name is not None and full.endswith(r.class_name))
            if hit and r.layer_name is not None:
                hit = "." + r.layer_name.strip(".") + "." in full + "."
            if hit:
                out.append((m, r.index))
    return out


@contextmanager
def _capture(routers: list[tuple[nn.Module, int]]):
    """Collect router logits during the block, in router order; the hooks live only as long as the forward.

    Each router writes to a list of its own, empty when its layer starts: under ``torch.compile`` the hook runs
    inside the compiled layer and Dynamo guards on the length of the list it appends to, so one list shared by
    every router would read a different length in each layer and compile each layer its own graph (and hit the
    recompile limit on a deep stage)."""
    slots: list[list[torch.Tensor]] = [[] for _ in routers]

    def hook(slot, index):
        def fn(module, args, output):
            if not isinstance(output, tuple):
                slot.append(output)
            elif output[index] is not None:
                slot.append(output[index])
        return fn

    sink: list[torch.Tensor] = []
    handles = [m.register_forward_hook(hook(slot, i)) for slot, (m, i) in zip(slots, routers)]
    try:
        yield sink
    finally:
        for h in handles:
            h.remove()
        sink.extend(t for slot in slots for t in slot)
