"""The executor's memory accounting (``PipelineEngine.track_memory``), term by term, so the planner's every term can
be checked against what a stage really holds: which saved tensors are autocast's bf16 casts of the weights (each
in-flight microbatch keeps its own: the cast cache lives for one autocast region), what activation checkpointing
keeps that no saved-tensor hook sees (the layers' inputs, held by the checkpoint's closure), and the transfer buffers
(outputs kept for the backward, prefetched receives, gradients on their way back).
"""
from __future__ import annotations

import torch

from ..optim.ef import ef_buffers

MEASURED_TERMS = ("weights", "grads", "optimizer", "ef", "casts", "activations", "transfers", "ef_copy")
"""The terms of ``PipelineEngine.memory_report`` the planner predicts one for one (``plan_memory``'s
``StageMemory``); the recomputation's one layer and the reducer's buckets are planned only."""


def agreement(planned: dict, measured: dict) -> float:
    """Planned over measured bytes, summed over :data:`MEASURED_TERMS`: how far the planner is from a stage."""
    return sum(planned[t] for t in MEASURED_TERMS) / sum(measured[t] for t in MEASURED_TERMS)

# autograd nodes of ops that only view their input: a weight reaches a matmul through a transpose (CPU linear saves
# the transposed cast), an expert's slice, a reshape
_VIEWS = {"TBackward0", "ViewBackward0", "TransposeBackward0", "PermuteBackward0", "SelectBackward0", "SliceBackward0",
          "UnsqueezeBackward0", "ExpandBackward0", "UnsafeViewBackward0", "AsStridedBackward0", "IndexBackward0",
          "ReshapeAliasBackward0"}


def is_weight_cast(t: torch.Tensor) -> bool:
    """Whether a saved tensor is a dtype cast of a leaf (a weight), seen through views: autocast's copy."""
    fn, cast = t.grad_fn, False
    for _ in range(6):
        if fn is None or not fn.next_functions:
            return False
        name = fn.name()
        if name == "ToCopyBackward0":
            cast = True
        elif name not in _VIEWS:
            return False
        fn = fn.next_functions[0][0]
        if type(fn).__name__ == "AccumulateGrad":
            return cast
    return False


def storage_key(t: torch.Tensor) -> tuple:
    return t.untyped_storage().data_ptr(), t.dtype


def checkpoint_input_hooks(stage: torch.nn.Module, count) -> list:
    """Forward pre-hooks on the checkpointed layers calling ``count(tensor)`` on each tensor argument: a
    non-reentrant checkpoint keeps a layer's inputs by reference for the recomputation, not as saved tensors, so
    the saved-tensor hook never sees them. Remove the returned handles after the forward (the recomputation in the
    backward calls the layers again)."""
    def hook(module, args, kwargs):
        for v in (*args, *kwargs.values()):
            for t in (v if isinstance(v, (tuple, list)) else (v,)):
                if torch.is_tensor(t) and t.is_floating_point():
                    count(t)
    return [m.register_forward_pre_hook(hook, with_kwargs=True) for m in stage.modules()
            if getattr(m, "gradient_checkpointing", False) and m is not stage]


def nbytes(ts) -> int:
    return sum(t.numel() * t.element_size() for t in ts if torch.is_tensor(t))


def transfer_bytes(micros, prefetch) -> int:
    """Bytes of the microbatches' transfer tensors alive now: outputs kept for the backward and the send (their
    storage is no saved tensor of this stage), gradients received or on their way back, and the posted receives'
    buffers (``P2P.post``: (peer, [(work, buffer)])). Received inputs count as activations (the first op saves them)."""
    held = sum(nbytes(mb.outputs) + nbytes(mb.grad_to_prev or ()) + nbytes(mb.grad_from_next or ()) for mb in micros)
    return held + sum(nbytes(b for _, b in posted[1]) for posted in prefetch)


def stage_memory(params: dict, optimizer, versions, mem: dict) -> dict[str, float]:
    """A stage's peak bytes per term as the planner plans them (``plan/memory.py``): weight versions, gradients,
    optimizer state, EF buffer, autocast's weight casts, activations, transfer buffers (``mem``: the executor's
    counters); ``steady`` their sum, ``total`` with the EF clone at STEP."""
    param_bytes = nbytes(params.values())
    opt_state = [t for st in optimizer.state.values() for t in st.values() if torch.is_tensor(t) and t.dim() > 0]
    rep = {"weights": versions.peak_bytes, "grads": param_bytes * mem["peak_grad_sets"],
           "optimizer": nbytes(opt_state), "ef": nbytes(ef_buffers(optimizer)),
           "casts": mem["peak_casts"], "activations": mem["peak_activations"], "transfers": mem["peak_transfers"]}
    rep["steady"] = sum(rep.values())
    rep["ef_copy"] = mem["ef_copy"]  # at STEP only (plan/memory.py: steady vs peak)
    rep["total"] = rep["steady"] + rep["ef_copy"]
    return rep
