"""Stand-ins for modules a stage does not hold, so that the model's own forward can run on every stage.

A stage runs the whole model's ``forward``. The decoder layers of other stages and the embedding / head modules
that another stage owns are replaced by *hollow* instances of the same class: no parameters, no buffers, the same
plain attributes (``layer_idx``, ``attention_type``, ``embed_scale``...), so the model's code that inspects them
still works, and ``isinstance`` still holds. Their weights are meta tensors kept as plain attributes (shapes and
dtypes readable, nothing allocated, nothing in ``named_parameters()`` or the state dict).
"""
from __future__ import annotations

import torch
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_map


DATA_DEPENDENT = {torch.Tensor.__bool__: False, torch.Tensor.item: 0, torch.Tensor.__int__: 0,
                  torch.Tensor.__float__: 0.0, torch.Tensor.tolist: []}
"""What a meta tensor answers when the model asks for its values: the branch for "no padding, no packing"."""


class MetaValues(TorchFunctionMode):
    """Answers the model's data-dependent checks on meta tensors (padding / packing probes) with "none"."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func in DATA_DEPENDENT and args and isinstance(args[0], torch.Tensor) and args[0].is_meta:
            return DATA_DEPENDENT[func]
        return func(*args, **(kwargs or {}))


def hollow(module: nn.Module) -> nn.Module:
    """An instance of ``type(module)`` without parameters, buffers or hooks; its submodules hollowed the same way."""
    cls = type(module)
    new = cls.__new__(cls)
    nn.Module.__init__(new)
    internal = set(new.__dict__)
    for k, v in module.__dict__.items():
        if k not in internal and k != "forward" and not isinstance(v, (nn.Module, torch.Tensor)):
            new.__dict__[k] = v
    new.training = module.training
    for name, t in list(module._parameters.items()) + list(module._buffers.items()):
        new.__dict__[name] = None if t is None else torch.empty_like(t, device="meta")
    for name, child in module._modules.items():
        if child is not None:
            new._modules[name] = hollow(child)
    return new


def alias(module: nn.Module, forward) -> nn.Module:
    """A second instance of ``type(module)`` sharing the module's parameters, submodules and hooks, whose ``forward``
    is ``forward`` (an instance attribute): the stage can wrap a layer without renaming its parameters or leaving a
    hook on the model's module."""
    cls = type(module)
    new = cls.__new__(cls)
    new.__dict__.update(module.__dict__)
    new.__dict__["forward"] = forward
    return new


def _to_meta(x):
    return x.to("meta") if isinstance(x, torch.Tensor) else x


_MAX_SHAPES = 64  # input signatures a stand-in remembers (a run sees one or two: training and evaluation shapes)


def _leaf_key(x):
    if isinstance(x, torch.Tensor):
        return (tuple(x.shape), x.dtype)
    if isinstance(x, (tuple, list)):
        return (type(x), tuple(_leaf_key(y) for y in x))
    if isinstance(x, dict):
        return (dict, tuple((k, _leaf_key(v)) for k, v in x.items()))
    return x


def _shape_key(args, kwargs):
    """What a module's output shapes can depend on: tensors as (shape, dtype), other values as themselves, plus the
    dtype state (autocast, default dtype); None when a value is not hashable (then nothing is cached)."""
    key = (tuple(_leaf_key(a) for a in args), tuple((k, _leaf_key(v)) for k, v in kwargs.items()),
           torch.get_default_dtype(), torch.is_autocast_enabled("cpu"), torch.is_autocast_enabled("cuda"))
    try:
        hash(key)
    except TypeError:
        return None
    return key


def absent(module: nn.Module, device_of=lambda: None) -> nn.Module:
    """A hollow ``module`` that computes its output's shape on the meta device and returns zeros of it.

    Used for modules another stage owns (the token embedding on a middle stage): what the model's code computes
    from their output (masks, positions) depends on shapes only, and the stage's real input replaces the hidden
    state at its first layer. The meta forward (about 0.5 ms of Python for an embedding, a third of a stage's fixed
    cost) runs once per input signature; later calls only allocate the zeros.
    """
    shell = hollow(module)
    cls = type(module)
    shapes: dict = {}  # input signature -> the meta output

    def forward(*args, **kwargs):
        # the stage's device: the model may have moved the input to this module's (meta) weights' device
        device = device_of() or next((t.device for t in (*args, *kwargs.values()) if isinstance(t, torch.Tensor)),
                                     torch.device("cpu"))
        key = _shape_key(args, kwargs)
        out = shapes.get(key) if key is not None else None
        if out is None:
            with torch.no_grad(), MetaValues():
                out = cls.forward(shell, *tree_map(_to_meta, args), **tree_map(_to_meta, kwargs))
            if key is not None:
                if len(shapes) >= _MAX_SHAPES:  # e.g. an object argument hashed by identity, new at every call
                    shapes.clear()
                shapes[key] = out
        return tree_map(lambda t: torch.zeros(t.shape, dtype=t.dtype, device=device) if isinstance(t, torch.Tensor) else t, out)

    shell.__dict__["forward"] = forward
    shell.__dict__["_output_shapes"] = shapes
    return shell


