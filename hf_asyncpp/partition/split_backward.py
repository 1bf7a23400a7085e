"""The W of a split backward (zero-bubble schedules), for the executor and for the cost measurement that times it.

The I is torch.distributed.pipelining's own ``stage_backward_input``: the input gradient, keeping the graph's nodes
where the weight gradients branch off (its parameter groups) with the gradients that reached them.
"""
from __future__ import annotations

from typing import Iterable

import torch
from torch.autograd.graph import GradientEdge
from torch.distributed.pipelining._backward import _get_grad_fn_or_grad_acc

__all__ = ["weight_gradients"]


def weight_gradients(weights: Iterable[torch.Tensor], groups: list[dict]) -> None:
    """The W of a split backward: every parameter group's weight gradients from the gradients its intermediates
    received in the I (``stage_backward_input``'s groups), in ONE ``autograd.grad`` call, accumulated into the
    weights' ``.grad``. torch's ``stage_backward_weight`` makes one call per group, and each call is a graph task of
    its own: a non-reentrant checkpointed layer replays its forward once per graph task that reaches it, so a layer
    with 9 parameter groups replayed 9 times in W; here once. Each intermediate gets exactly the gradient it got in
    the I (a pre-hook returns it, as torch's clamps a group), so nothing flows twice through an intermediate another
    one descends from, and each weight's gradient is the per-group call's, bit for bit."""
    acc_to_weight = {_get_grad_fn_or_grad_acc(w): w for w in weights}
    edges, outs, handles, params = [], [], [], {}
    try:
        for g in groups:
            for saved, node in zip(g.get("grads") or (), g["intermediates"]):
                if saved is None:  # nothing reached this intermediate in the I: no weight gradient through it
                    continue
                for i, grad in enumerate(saved):
                    if grad is not None:
                        edges.append(GradientEdge(node, i))
                        outs.append(grad)
                handles.append(node.register_prehook(lambda _, saved=saved: saved))
            params.update(dict.fromkeys(g["params"]))  # a group's params: grad accumulators, in a stable order
        if edges:
            accs = list(params)
            grads = torch.autograd.grad(edges, tuple(GradientEdge(a, 0) for a in accs), grad_outputs=outs)
            for acc, dw in zip(accs, grads):
                w = acc_to_weight[acc]
                if w.grad is None:
                    w.grad = dw
                else:
                    w.grad += dw
    finally:
        for h in handles:
            h.remove()
        for g in groups:  # the hooks' and the groups' references to the graph: freed with it
            g.pop("intermediates", None)
            g.pop("grads", None)
