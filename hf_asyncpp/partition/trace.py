"""Learn, by running the model's own forward once, where each of its pieces runs relative to the decoder layers.

The decoder layers are replaced by pass-through stand-ins for the run (a layer's computation does not matter here,
and MoE routing cannot run on the meta device), so the trace works on a meta model of any size. It records:

- which modules outside the layers touch their weights before the first layer (``pre``: the first stage holds
  them) and which after the last (``post``: the last stage holds them). A module with no state is copied to every
  stage. Weights are followed through ``__torch_function__``, so a weight the model reads directly (``F.linear(h,
  self.embed_tokens.weight)``) counts as well as a module call;
- how a layer receives its hidden state and returns it;
- layer arguments that carry gradient other than the hidden state (Gemma-3n's per-layer embeddings, Zamba's
  original embeddings): the first stage computes them and they travel with the hidden state.
"""
from __future__ import annotations

import inspect
from dataclasses import dataclass, field

import torch
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_leaves

from .hollow import DATA_DEPENDENT, hollow


class PartitionError(ValueError):
    """The model or the requested split cannot be partitioned; the message names the module or the knob and why."""


@dataclass
class Anatomy:
    """Where the pieces of a causal LM run. Paths are module paths in the model (``model.layers``)."""

    layers: str  # the ModuleList of decoder layers
    num_layers: int
    containers: list[str]  # modules the stages copy shallowly to swap children: root "", ..., the layers' parent
    units: dict[str, str]  # module path -> "pre" (first stage) | "post" (last stage) | "copy" (stateless: every stage)
    embed: list[str]  # the input embedding module(s)
    head: str | None  # the output embedding module
    hidden_arg: int | str  # where a layer takes its hidden state: 0 (first positional) or a keyword
    out_index: int | None  # None: a layer returns the hidden state; else its index in the returned tuple
    out_len: int = 1  # length of that tuple (stand-ins fill the other places with None)
    batch_dim: int = 0  # where (batch, sequence) sit in the hidden state's shape (Gemma-3n stacks 4 streams first)
    side: list[list[tuple[int, int | str]]] = field(default_factory=list)  # carried tensors: their (layer, arg) slots
    forward_kwargs: dict = field(default_factory=dict)  # passed to the model's forward on every stage
    # parameters held directly by a container (Zaya's input scale on ZayaModel): name -> "pre" | "post"
    direct: dict[str, str] = field(default_factory=dict)
    # outputs a layer hands to the next layer besides the hidden state (Zaya's router state): (output index, arg)
    carry: list[tuple[int, int | str]] = field(default_factory=list)
    # values per token of each side input, then of each carried output: what crosses a boundary besides the hidden
    # state (the planner counts them in a stage's activation memory)
    extra_values: list[int] = field(default_factory=list)

    @property
    def norm(self) -> str | None:  # kept for callers of the former anatomy
        return next((u for u, ph in self.units.items() if ph == "post" and u != self.head), None)


def get_module(model: nn.Module, path: str | None) -> nn.Module | None:
    if path is None:
        return None
    try:
        return model.get_submodule(path)
    except AttributeError:
        return None


def find_layers(model: nn.Module) -> str:
    """The decoder layers: the model's ``_pp_plan`` layer list, else the ModuleList holding the most weights."""
    cls = type(model).__name__
    best, size = None, -1
    for name, m in model.named_modules():
        if isinstance(m, nn.ModuleList) and len(m) > 0 and name:
            n = sum(p.numel() for p in m.parameters())
            if n > size:
                best, size = name, n
    if best is None or size <= 0:
        raise PartitionError(f"{cls}: cannot find the decoder layers (no ModuleList with weights); only models that run "
                             "a list of decoder layers can be split into stages")
    return best


def _state(module: nn.Module):
    """Parameters and persistent buffers: what a stage must hold (and checkpoint) to run the module."""
    out = list(module.parameters())
    for m in module.modules():
        out += [b for n, b in m._buffers.items() if b is not None and n not in m._non_persistent_buffers_set]
    return out


class _Watch(TorchFunctionMode):
    """Records, for every use of a watched weight, whether the layers have started / finished; and, for every tensor
    with gradient an operation reads after the last layer, the module that reads it (``late``: a side input read
    there is refused, see ``_side_inputs``)."""

    def __init__(self, owners: dict[int, list[str]], clock: dict, stack: list, uses: dict):
        super().__init__()
        self.owners, self.clock, self.stack, self.uses = owners, clock, stack, uses
        self.late: dict[int, str] = {}

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in DATA_DEPENDENT and args and isinstance(args[0], torch.Tensor) and args[0].is_meta:
            return DATA_DEPENDENT[func]  # a meta model has no values: take the branch for "no padding, no packing"
        if getattr(func, "__name__", "") == "__get__" or func in _METADATA:
            return func(*args, **kwargs)  # reading a weight's dtype or shape is not using it
        late = self.clock["phase"] == "post"
        for t in tree_leaves((args, kwargs)):
            if late and isinstance(t, torch.Tensor) and t.requires_grad:
                self.late.setdefault(id(t), self.stack[-1] if self.stack else "")
            if isinstance(t, torch.Tensor) and id(t) in self.owners:
                owners = self.owners[id(t)]
                mine = [o for o in owners if o in self.stack]
                for o in mine or owners:
                    self.uses.setdefault(o, set()).add(self.clock["phase"])
        return func(*args, **kwargs)


_METADATA = {torch.Tensor.size, torch.Tensor.dim, torch.Tensor.numel, torch.Tensor.stride, torch.Tensor.get_device,
             torch.Tensor.is_floating_point, torch.Tensor.data_ptr, torch.Tensor.element_size, torch.Tensor.__len__}


def _phase(clock, L):
    return "pre" if clock["started"] == 0 else ("post" if clock["done"] == L and not clock["inside"] else "in")


def trace(model: nn.Module, seq_len: int = 16) -> Anatomy:
    """Run the model's forward once with stand-in layers and return where everything runs (see the module doc)."""
    cls = type(model).__name__
    layers_path = find_layers(model)
    layers = model.get_submodule(layers_path)
    L = len(layers)
    parts = layers_path.split(".")
    containers = [".".join(parts[:i]) for i in range(len(parts))]
    paths = {m: n for n, m in model.named_modules(remove_duplicate=False)}
    layer_mods = {id(m) for layer in layers for m in layer.modules()}
    # watched tensors: each parameter / buffer -> the module paths that hold it directly
    owners: dict[int, list[str]] = {}
    for name, m in model.named_modules(remove_duplicate=False):
        if id(m) in layer_mods:
            continue
        for t in (*m._parameters.values(), *m._buffers.values()):
            if t is not None:
                owners.setdefault(id(t), []).append(name)

    clock = {"started": 0, "done": 0, "inside": False, "phase": "pre"}
    calls, args_seen, outs = [], {}, {}
    layer_nodes: set = set()  # autograd nodes of the stand-in layers' outputs
    sig = inspect.signature(layers[0].forward)
    first = next((n for n, p in sig.parameters.items() if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)), None)
    real0 = {"out": None}

    def stand_in(j, real):
        def forward(*args, **kwargs):
            calls.append(j)
            clock["started"] += 1
            clock["inside"], clock["phase"] = True, "in"
            args_seen[j] = (args, kwargs)
            h = args[0] if args else kwargs.get(first)
            out = h
            if j == 0:
                try:
                    out = real(*args, **kwargs)
                    real0["out"] = out
                except Exception:  # e.g. MoE kernels without a meta implementation: a CPU copy tells the structure
                    out = _run_on_cpu(real, args, kwargs) if isinstance(h, torch.Tensor) and h.is_meta else None
                    real0["out"] = out
                    if out is None:  # assume the layer returns a tensor
                        out = h
            else:
                if isinstance(h, torch.Tensor) and h.requires_grad:
                    h = h.clone()  # a node of its own: what the model computes from it is found in autograd graphs
                    layer_nodes.add(h.grad_fn)
                if isinstance(real0["out"], (tuple, list)):
                    out = tuple(h if i == _hidden_index(real0["out"], h) else None for i in range(len(real0["out"])))
                else:
                    out = h
            clock["done"] += 1
            clock["inside"] = False
            clock["phase"] = _phase(clock, L)
            outs[j] = out
            return out
        return forward

    saved = dict(layers._modules)
    stack: list[str] = []
    uses: dict[str, set] = {}

    def pre_hook(mod, args):
        p = paths.get(mod)
        if p is not None:
            stack.append(p)

    def post_hook(mod, args, out):
        if paths.get(mod) is not None and stack:
            stack.pop()

    handles = []
    try:
        for j in range(L):
            stub = hollow(saved[str(j)])
            stub.__dict__["forward"] = stand_in(j, saved[str(j)])
            layers._modules[str(j)] = stub
        handles = [nn.modules.module.register_module_forward_pre_hook(pre_hook),
                   nn.modules.module.register_module_forward_hook(post_hook)]
        dev = next((t.device for t in model.parameters()), torch.device("cpu"))
        vocab = getattr(model.config, "vocab_size", None) or 2
        ids = torch.randint(0, vocab, (_B, seq_len), generator=torch.Generator().manual_seed(0)).to(dev)
        kw = model_kwargs(model)
        if "output_router_logits" in inspect.signature(type(model).forward).parameters:
            kw["output_router_logits"] = False  # the stand-in layers route nothing
        watch = _Watch(owners, clock, stack, uses)
        with torch.enable_grad(), watch:
            model(input_ids=ids, labels=ids, **kw)
    except PartitionError:
        raise
    except Exception as e:
        raise PartitionError(f"{cls}: its forward fails with stand-in decoder layers ({type(e).__name__}: {e}); the "
                             "model does not run its layers as a plain sequence") from e
    finally:
        for h in handles:
            h.remove()
        layers._modules.update(saved)

    if calls != list(range(L)):
        raise PartitionError(f"{cls}: calls its decoder layers in the order {calls[:12]}{'...' if len(calls) > 12 else ''}, "
                             f"not once each in order 0..{L - 1}; a stage boundary between layers would be crossed more "
                             "than once per forward (recurrent-depth models run their layers in cycles): train this model "
                             "on one stage (num_stages=1) or with data parallelism only")
    hidden_arg = 0
    a0, k0 = args_seen[0]
    if not a0:
        if first not in k0:
            raise PartitionError(f"{cls}: {layers_path}.0 is called without its hidden state as first argument")
        hidden_arg = first
    out0 = real0["out"]
    out_index = None
    if isinstance(out0, (tuple, list)):
        h0 = a0[0] if a0 else k0[first]
        out_index = _hidden_index(out0, h0)
    elif out0 is not None and not isinstance(out0, torch.Tensor):
        raise PartitionError(f"{cls}: {type(layers[0]).__name__} returns {type(out0).__name__}, not a tensor or a tuple")

    pos = [n for n, p in sig.parameters.items() if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    side = _side_inputs(cls, layers_path, args_seen, hidden_arg, L, layer_nodes, pos, watch.late)
    carry = _carries(out0, out_index, args_seen, hidden_arg, L)
    if carry:  # a carried output is a layer argument, not a side input computed before the layers
        slots = {key for _, key in carry}
        side = [g for g in side if not all(j > 0 and key in slots for j, key in g)]

    def per_token(j, key):  # values per token of the tensor in layer j's argument ``key``
        a, k = args_seen[j]
        t = a[key] if isinstance(key, int) else k[key]
        return t.numel() // (_B * seq_len)
    side_values = [per_token(*g[0]) for g in side]
    carry_values = [per_token(1, key) for _, key in carry]
    units = _units(model, cls, containers, layers_path, uses)
    direct = _direct(model, cls, containers, uses)
    emb = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    embed = [paths[emb]] if emb is not None and emb in paths else []
    out_len = len(out0) if isinstance(out0, (tuple, list)) else 1
    shape = list((a0[0] if a0 else k0[first]).shape)
    batch_dim = next((i for i in range(len(shape) - 1) if shape[i:i + 2] == [_B, seq_len]), None)
    if batch_dim is None:
        raise PartitionError(f"{cls}: the hidden state entering {layers_path}.0 has shape {shape}, without (batch, sequence "
                             f"{seq_len}): its decoder layers run over something other than the tokens (byte-latent "
                             "models: patches, whose number depends on the data), so stages cannot exchange a fixed-shape "
                             "hidden state; train this model on one stage (num_stages=1) or with data parallelism only")
    return Anatomy(layers_path, L, containers, units, embed, paths.get(head) if head is not None else None, hidden_arg,
                   out_index, out_len, batch_dim, side, model_kwargs(model), direct, carry, side_values + carry_values)


def _run_on_cpu(layer: nn.Module, args, kwargs):
    """The output of a randomly initialized CPU copy of a meta ``layer`` on zero inputs, as meta tensors (None if it
    fails too): only its structure (which element is the hidden state, what else it returns) is used."""
    import copy

    from torch.utils._pytree import tree_map

    try:
        cpu = copy.deepcopy(layer).to_empty(device="cpu")
        with torch.no_grad():
            for t in cpu.parameters():
                t.normal_(0.0, 0.02) if t.is_floating_point() else t.zero_()
            for t in cpu.buffers():
                t.zero_()
        to_cpu = lambda x: torch.zeros(x.shape, dtype=x.dtype) if isinstance(x, torch.Tensor) and x.is_meta else x  # noqa: E731
        out = cpu(*tree_map(to_cpu, args), **tree_map(to_cpu, kwargs))
    except Exception:
        return None
    h = args[0] if args else None
    return tree_map(lambda x: torch.empty(x.shape, dtype=x.dtype, device="meta",
                                          requires_grad=bool(h is not None and h.requires_grad and x.is_floating_point()))
                    if isinstance(x, torch.Tensor) else x, out)


_B = 3  # trace batch size: distinct from the sequence length and small stacked dimensions


def _hidden_index(out, h) -> int:
    for i, x in enumerate(out):
        if isinstance(x, torch.Tensor) and x.shape == h.shape:
            return i
    return 0


def model_kwargs(model: nn.Module) -> dict:
    """Keyword arguments every stage passes to the model's forward: no KV / state cache in training."""
    params = inspect.signature(type(model).forward).parameters
    return {"use_cache": False} if "use_cache" in params else {}


def _carries(out0, out_index, args_seen, hidden_arg, L) -> list[tuple[int, int | str]]:
    """Elements of layer 0's output other than the hidden state that the model passes to layer 1 as an argument."""
    if L < 2 or not isinstance(out0, (tuple, list)):
        return []
    args, kwargs = args_seen[1]
    items = [(i, a) for i, a in enumerate(args)] + list(kwargs.items())
    return [(i, key) for i, x in enumerate(out0) if i != out_index and isinstance(x, torch.Tensor)
            for key, v in items if v is x and key != hidden_arg]


def _reaches(t: torch.Tensor, nodes: set, limit: int = 20000) -> bool:
    """Whether ``t`` is computed from one of the autograd ``nodes``."""
    todo, seen = [t.grad_fn], set()
    while todo and len(seen) < limit:
        n = todo.pop()
        if n is None or n in seen:
            continue
        if n in nodes:
            return True
        seen.add(n)
        todo.extend(f for f, _ in n.next_functions)
    return False


def _side_inputs(cls, layers_path, args_seen, hidden_arg, L, layer_nodes=frozenset(), arg_names=(),
                 late=None) -> list[list[tuple[int, int | str]]]:
    """Layer arguments other than the hidden state that carry gradient, grouped by tensor (one tensor may feed all
    layers); in order of first use. Refused: one the model computes from earlier layers' outputs outside the layers
    (a later stage cannot rebuild it), and one the model also reads after the last layer (``late``: tensor id ->
    the module reading it), since the last stage would read its own stand-in value, not the carried one."""
    groups: dict[int, list] = {}
    for j in range(L):
        args, kwargs = args_seen[j]
        items = [(i, a) for i, a in enumerate(args)] + list(kwargs.items())
        for key, v in items:
            if key == hidden_arg:
                continue
            if isinstance(v, torch.Tensor):
                why = None
                if v.requires_grad and layer_nodes and _reaches(v, layer_nodes):
                    why = ("which the model's forward builds from earlier decoder layers' outputs outside the layers "
                           f"(between them); the stage holding layer {j} cannot rebuild it from one hidden state")
                elif v.requires_grad and late and id(v) in late:
                    why = ("which the model computes before the decoder layers and reads again after the last one "
                           f"(in {late[id(v)] or 'the top-level forward'}); the stages carry it to the layers that take "
                           "it, but the last stage would rebuild it from stand-ins of the first stage's modules and "
                           "compute something else")
                if why:
                    name = arg_names[key] if isinstance(key, int) and key < len(arg_names) else key
                    raise PartitionError(f"{cls}: {layers_path}.{j} receives {name!r}, {why}: train this model on one "
                                         "stage (num_stages=1) or with data parallelism only")
                if v.requires_grad:
                    groups.setdefault(id(v), []).append((j, key))
            elif any(isinstance(t, torch.Tensor) and t.requires_grad for t in tree_leaves(v)):
                raise PartitionError(f"{cls}: {layers_path}.{j} receives {key!r}, a structure holding tensors with gradient; "
                                     "the stage builder carries plain tensors between stages only")
    return list(groups.values())


def _direct(model, cls, containers, uses) -> dict[str, str]:
    """Parameters sitting directly on a container (next to the layers): the first stage holds those the model uses
    before the layers, the last those it uses after; one used between or on both sides cannot be held by one stage."""
    out: dict[str, str] = {}
    for c in containers:
        m = get_module(model, c)
        names = [n for n, _ in m.named_parameters(recurse=False)]
        if not names:
            continue
        phases = uses.get(c, set())  # uses of the container's own tensors (its parameters and buffers)
        if "in" in phases or phases == {"pre", "post"} or not phases:
            how = ("is used between the decoder layers" if "in" in phases else
                   "is used before and after them" if phases else "is never used by the forward")
            raise PartitionError(f"{cls}: parameter {c + '.' if c else ''}{names[0]} sits directly on {type(m).__name__}, "
                                 f"next to the decoder layers, and {how}; no single stage can hold it: remove it or train "
                                 "this model on one stage (num_stages=1)")
        for n in names:
            out[f"{c}.{n}" if c else n] = "post" if phases == {"post"} else "pre"
    return out


def _units(model, cls, containers, layers_path, uses) -> dict[str, str]:
    """Each module outside the layers: which stage holds it. Splits a module used on both sides into its children."""
    units: dict[str, str] = {}
    todo = []
    for c in containers:
        m = get_module(model, c)
        for n, child in m.named_children():
            path = f"{c}.{n}" if c else n
            if path not in containers and path != layers_path:
                todo.append(path)
    while todo:
        path = todo.pop(0)
        mod = model.get_submodule(path)
        if not _state(mod):
            units[path] = "copy"
            continue
        phases = set()
        for name, _ in mod.named_modules(remove_duplicate=False):
            phases |= uses.get(f"{path}.{name}" if name else path, set())
        if "in" in phases:
            raise PartitionError(f"{cls}: {path} ({type(mod).__name__}) runs between decoder layers, outside them; no "
                                 "single stage can hold it")
        if phases == {"pre", "post"}:
            kids = [f"{path}.{n}" for n, _ in mod.named_children()]
            direct = [n for n, _ in mod.named_parameters(recurse=False)]
            if direct or not kids:
                raise PartitionError(f"{cls}: {path} ({type(mod).__name__}) is used both before and after the decoder "
                                     "layers (as embedding and as head); untie it or use a single stage")
            containers.append(path)
            todo = kids + todo
            continue
        units[path] = "post" if phases == {"post"} else "pre"  # an unused module stays on the first stage
    return units
