"""Stage modules: every stage runs the model's own forward, with other stages' layers skipped.

What a stage computes around its layers (masks, rotary / ALiBi, per-layer embeddings, scalings, final norms,
heads, the loss) is the model's code, not a re-implementation: new architectures need no new code here. A stage
holds a shallow copy of the model's containers in which

- its own decoder layers are the model's layer modules (shared, not copied), wrapped so that the first one takes
  the received hidden state (and received side inputs) instead of what the model computed before it;
- the other layers are hollow stand-ins that return their input (cost: a Python call);
- modules another stage holds (the embedding on a middle stage, the head on a non-last one) are hollow stand-ins
  returning zeros of their output's shape, which the model only uses for shapes (masks, positions);
- the forward stops at the next stage's first layer, so nothing after it runs.
"""
from __future__ import annotations

import copy
import warnings
from contextlib import nullcontext

import torch
from torch import nn

from ..model.fused_loss import HeadCapture, fused_loss_blocker
from ..model.seeded_init import initializers
from .moe_aux import AuxLoss, _aux_loss, _capture, _router_modules
from .hollow import MetaValues, absent, alias, hollow
from .plan import PartitionError, PartitionPlan, get_module, partition_plan
from ..model.vocab_parallel import HeadShard, VocabShards, assemble

# Model types whose stages the test suite compares with the whole model (loss, logits, every gradient) in
# tests/test_partition.py; tests/test_partition_sweep.py covers every decoder-only type transformers ships.
# Others are checked numerically at partition time (``check_partition``) before any stage is handed out.
VERIFIED_MODEL_TYPES = frozenset({
    "llama", "mistral", "qwen2", "qwen3", "gemma2", "gemma3_text", "phi3", "gpt2", "olmo2", "mixtral", "qwen2_moe",
    "qwen3_moe", "olmoe", "deepseek_v3", "gpt_oss", "granite", "granitemoe", "cohere", "gpt_neox",
})


class _Exit(Exception):
    """Raised at the next stage's first layer: the rest of the model's forward belongs to later stages."""


class _Run:
    """State of one stage forward, read by the layer wrappers (set by ``Stage.forward``, cleared after)."""

    def __init__(self, device, hidden=None, side=None):
        self.device, self.hidden_in, self.side_in = device, hidden, side or {}
        self.hidden_out, self.side_out = None, {}
        self.carry_in, self.carry_out = [], []
        self.fused = False  # the loss through the stage's HeadCapture (labels given, fused loss on)


def _shallow(module: nn.Module) -> nn.Module:
    """A new instance of the module's class with its own child / parameter / hook dicts (entries shared)."""
    new = type(module).__new__(type(module))
    new.__dict__.update({k: (v.copy() if isinstance(v, (dict, set)) else v) for k, v in module.__dict__.items()})
    return new


def _copy_only(module: nn.Module, copies: dict[int, nn.Parameter], to_copy: set[int]) -> nn.Module:
    """A structural copy of ``module`` in which the parameters in ``to_copy`` (tensor ids) are this stage's copies:
    the one in ``copies`` when an earlier layer of the stage made it, else a new one (added to ``copies``); every
    other parameter and buffer is the model's (``deepcopy`` with those pre-entered in its memo)."""
    memo = {id(t): t for t in (*module.parameters(), *module.buffers()) if id(t) not in to_copy}
    memo.update({k: v for k, v in copies.items()})
    new = copy.deepcopy(module, memo)
    for (_, old), (_, fresh) in zip(module.named_parameters(remove_duplicate=False),
                                    new.named_parameters(remove_duplicate=False)):
        if id(old) in to_copy:
            copies.setdefault(id(old), fresh)
    return new


def _weight_initializer(model: nn.Module):
    """The model class's ``_init_weights`` on a parameterless stand-in (a stage must not keep the model alive)."""
    cls = type(model)
    stub = cls.__new__(cls)
    nn.Module.__init__(stub)
    stub.config = model.config
    return stub._init_weights


def _has_meta(module: nn.Module) -> bool:
    return any(t.is_meta for t in (*module.parameters(), *module.buffers()))


class Stage(nn.Module):
    """One contiguous slice of the model's layers, run inside the model's own forward (see the module doc).

    ``forward(x, labels=None)``: ``x`` is ``input_ids`` on the first stage, else what the previous stage returned.
    The stage's children are the model's top-level children (copied shallowly), so parameter names are the
    model's own. ``fused_loss`` (last stage): the loss from labels without the whole logits
    (``model.fused_loss.HeadCapture``); the logits (no labels) are the model's head's.
    """

    def __init__(self, model: nn.Module, plan: PartitionPlan, index: int, aux: AuxLoss | None, fused_loss: bool = False):
        super().__init__()
        a, cfg = plan.anatomy, model.config
        self.config, self.index, self.num_stages = cfg, index, len(plan.stages)
        self.is_first, self.is_last = index == 0, index == self.num_stages - 1
        self.layer_ids = list(plan.stages[index].layers)
        starts = [s.layers.start for s in plan.stages]
        self._a, self._aux, self._L = a, aux, plan.num_layers
        self._start = starts[index]
        self._stop = starts[index + 1] if not self.is_last else plan.num_layers
        self.tied_pairs = list(plan.tied_pairs)
        self._init_fn = _weight_initializer(model)
        # side inputs (per-layer tensors with gradient computed before the layers): which come in, which go on
        self._side_in = [g for g, slots in enumerate(a.side) if not self.is_first and max(j for j, _ in slots) >= self._start]
        self._side_out = [g for g, slots in enumerate(a.side) if not self.is_last and max(j for j, _ in slots) >= self._stop]
        self._run: _Run | None = None
        self._capture: HeadCapture | None = None
        self.vocab: VocabShards | None = plan.vocab  # the output layer cut over every stage (model/vocab_parallel.py)
        self.head_shard: HeadShard | None = None
        self._fused = fused_loss and self.is_last and a.head is not None and plan.vocab is None
        held = {n for n in plan.param_names[index]}
        copied = {b for _, b in plan.tied_pairs} & held  # this stage's copies of a tensor an earlier stage holds
        shell = self._build(model, plan, held, copied)
        if self._capture is not None:
            shell.__dict__["_loss_function"] = self._capture.loss_function  # transformers reads it first
        self.__dict__["_shell"] = shell
        self.__dict__["_modules"] = shell._modules
        layers = get_module(model, a.layers)
        self._routers = [r for i in self.layer_ids for r in _router_modules(f"{a.layers}.{i}", layers[i], aux.recorders)] if aux else []
        self._loss_kwargs = dict(a.forward_kwargs)
        if aux:
            self._loss_kwargs["output_router_logits"] = False  # the pooled aux loss replaces the model's (stage-local) one

    # -------------------------------------------------------------- construction
    def _build(self, model, plan, held, copied) -> nn.Module:
        a = plan.anatomy
        shells = {c: _shallow(get_module(model, c)) for c in a.containers}
        for c, sh in shells.items():
            for n in [n for n in sh._parameters if (f"{c}.{n}" if c else n) in a.direct]:
                path = f"{c}.{n}" if c else n
                if a.direct[path] == "pre" and not self.is_first or a.direct[path] == "post" and not self.is_last:
                    # another stage holds it: zeros of its shape (only shapes matter here, as for ``absent`` modules)
                    p = sh._parameters.pop(n)
                    sh.register_buffer(n, torch.zeros_like(p, device="meta" if p.is_meta else p.device), persistent=False)
                    sh.__dict__.setdefault("_stand_in_buffers", set()).add(n)
            for n in list(sh._modules):
                path = f"{c}.{n}" if c else n
                if path in shells:
                    sh._modules[n] = shells[path]
                elif path == a.layers:
                    sh._modules[n] = self._layer_list(get_module(model, path), path, copied)
                elif path in a.units:
                    sh._modules[n] = self._unit(get_module(model, path), path, a.units[path], held, copied)
        return shells[""]

    def _unit(self, module, path, phase, held, copied):
        if phase == "copy":
            return copy.deepcopy(module)  # stateless (rotary frequencies, dropout): every stage runs its own
        if self.vocab is not None and path == self.vocab.head:
            shard = HeadShard(module, self.vocab.ranges[self.index])  # every stage: its rows
            self.__dict__["head_shard"] = shard  # not a child of its own: the shell holds it, under the head's name
            return shard
        if phase == "pre" and not self.is_first or phase == "post" and not self.is_last:
            return absent(module, lambda: self._run.device if self._run is not None else None)
        if any(n in copied for n, _ in module.named_parameters(prefix=path, remove_duplicate=False)):
            module = copy.deepcopy(module)  # e.g. a tied lm_head on the last stage: its own copy of the embedding
        if self._fused and path == self._a.head:
            return self._fused_head(module)
        return module

    def _fused_head(self, module: nn.Module) -> nn.Module:
        """The head, as a second instance sharing its parameters (``alias``), that hands its input to the stage's
        ``HeadCapture`` when the loss is fused, and runs as itself otherwise (the logits, without labels)."""
        cls = type(module)

        def forward(x):
            if self._run is not None and self._run.fused:
                return self._capture.head_forward(x)
            return cls.forward(head, x)
        head = alias(module, forward)
        self._capture = HeadCapture(head)
        return head

    def _layer_list(self, layers: nn.ModuleList, path: str, copied: set[str]) -> nn.ModuleList:
        # a block shared by several layers (Zamba) that an earlier stage holds: this stage's own copy, one per tensor
        # however many of the stage's layers run it
        to_copy = {id(p) for n, p in layers.named_parameters(prefix=path, remove_duplicate=False) if n in copied}
        copies: dict[int, nn.Parameter] = {}
        out = nn.ModuleList()
        for j, layer in enumerate(layers):
            if self._start <= j < self._stop:
                if any(id(p) in to_copy for p in layer.parameters()):
                    layer = _copy_only(layer, copies, to_copy)
                w = alias(layer, None)
                w.__dict__["forward"] = self._own(j, w, type(layer).forward)
            else:
                w = hollow(layer)
                w.__dict__["forward"] = self._skip(j)
            out.append(w)
        return out

    def _hidden(self, args, kwargs):
        key = self._a.hidden_arg
        return args[0] if key == 0 else kwargs[key]

    def _with(self, j, args, kwargs, hidden):
        """The layer call's arguments with the received hidden state and side inputs put in."""
        args, kwargs = list(args), dict(kwargs)
        run = self._run
        if hidden is not None:
            if self._a.hidden_arg == 0:
                args[0] = hidden
            else:
                kwargs[self._a.hidden_arg] = hidden
        for g in self._side_in:
            for jj, key in self._a.side[g]:
                if jj == j:
                    if isinstance(key, int):
                        args[key] = run.side_in[g]
                    else:
                        kwargs[key] = run.side_in[g]
        return args, kwargs

    def _capture_side(self, j, args, kwargs):
        run = self._run
        for g in self._side_out:
            if g not in run.side_out:
                for jj, key in self._a.side[g]:
                    if jj == j:
                        run.side_out[g] = args[key] if isinstance(key, int) else kwargs[key]
                        break

    def _boundary(self, j, args, kwargs):
        """At layer ``j``: take in the received state (first own layer), hand out ours (next stage's first layer)."""
        run = self._run
        if run is None:
            raise RuntimeError(f"stage {self.index}: the model's layers were called outside Stage.forward")
        if j == self._start and not self.is_first:
            args, kwargs = self._with(j, args, kwargs, run.hidden_in)
        elif self._start < j < self._stop and self._side_in:
            args, kwargs = self._with(j, args, kwargs, None)
        if self.is_first:
            self._capture_side(j, args, kwargs)
        if j == self._start and not self.is_first:
            for (_, key), t in zip(self._a.carry, run.carry_in):
                if isinstance(key, int):
                    args[key] = t
                else:
                    kwargs[key] = t
        if j == self._stop and not self.is_last:
            run.hidden_out = self._hidden(args, kwargs)
            run.carry_out = [args[key] if isinstance(key, int) else kwargs.get(key) for _, key in self._a.carry]
            if any(not isinstance(t, torch.Tensor) for t in run.carry_out):
                raise PartitionError(f"stage {self.index}: layer {j} receives no tensor in its argument(s) "
                                     f"{[k for _, k in self._a.carry]} from layer {j - 1}; cannot send it to the next stage")
        if run.hidden_out is not None and (j == self._L - 1 or len(run.side_out) == len(self._side_out)):
            raise _Exit
        return args, kwargs

    def _own(self, j, module, forward):
        def call(*args, **kwargs):
            args, kwargs = self._boundary(j, args, kwargs)
            return forward(module, *args, **kwargs)
        return call

    def _skip(self, j):
        a = self._a

        def call(*args, **kwargs):
            args, kwargs = self._boundary(j, args, kwargs)
            h = self._hidden(args, kwargs)
            if j == self._L - 1 and self._start == self._L and not self.is_first:
                h = self._run.hidden_in  # a last stage without layers: the received state is the last layer's output
            if a.out_index is None:
                return h
            return tuple(h if i == a.out_index else None for i in range(a.out_len))
        return call

    # -------------------------------------------------------------- materialization
    def _init_buffers(self) -> None:
        """Recompute non-persistent buffers (rotary frequencies, embedding scales), which no state dict holds.

        Only after ``to_empty``: the initializer of a module owning such a buffer also redraws its parameters.
        """
        fns = initializers(self, self._init_fn)  # a composite model's sub-models bring their own
        with torch.no_grad():
            for name, m in list(self.named_modules()):
                if not m._non_persistent_buffers_set:
                    continue
                stand_ins = m.__dict__.get("_stand_in_buffers", ())
                for n in stand_ins:  # zeros for a parameter another stage holds (see ``_build``)
                    if not getattr(m, n).is_meta:
                        getattr(m, n).zero_()
                bufs = {n: b for n, b in m.named_buffers(recurse=False)
                        if n in m._non_persistent_buffers_set and n not in stand_ins and b.is_floating_point()
                        and not b.is_meta}
                if "Rotary" in type(m).__name__ and hasattr(m, "config"):
                    dev = next(iter(bufs.values())).device if bufs else torch.device("cpu")
                    try:
                        with torch.device(dev):
                            fresh = type(m)(config=m.config)
                        for n, b in fresh.named_buffers(recurse=False):
                            setattr(m, n, b)
                        for k in ("attention_scaling",):
                            if hasattr(fresh, k):
                                setattr(m, k, getattr(fresh, k))
                        continue
                    except TypeError:
                        pass
                for b in bufs.values():
                    b.fill_(float("nan"))  # so a buffer the initializer skips cannot pass for a computed one
                fns[name](m)
                for n in bufs:
                    if torch.isnan(getattr(m, n)).any():
                        raise PartitionError(f"{name}.{n}: non-persistent buffer that {type(m).__name__}'s initializer does "
                                             "not restore; build the stage from a real (non-meta) model")

    def to_empty(self, *, device, recurse: bool = True):
        """``nn.Module.to_empty``, then the non-persistent buffers recomputed; parameters still need loading.

        ``to_empty`` gives every module a new tensor of its own, so a parameter two of the stage's modules share
        (the tied head of a stage that also holds the embedding: a 1-stage pipeline) would come out as two, trained
        apart: the sharing is put back, as in the model the stage was cut from."""
        shared: dict[int, list[str]] = {}
        for name, p in self.named_parameters(remove_duplicate=False):
            shared.setdefault(id(p), []).append(name)
        super().to_empty(device=device, recurse=recurse)
        for first, *others in (names for names in shared.values() if len(names) > 1):
            kept = self.get_parameter(first)
            for name in others:
                owner, _, attr = name.rpartition(".")
                setattr(self.get_submodule(owner), attr, kept)
        self._init_buffers()
        return self

    def init_weights(self) -> None:
        """Random initialization of every parameter as transformers initializes the model (training from scratch).

        Stages draw independently: with tied embeddings, copy the first stage's embedding into the last stage's head.
        """
        with torch.no_grad():
            for m in self.modules():
                if isinstance(m, HeadShard):
                    m.init_with(self._init_fn)
                else:
                    self._init_fn(m)
        self._init_buffers()

    def train(self, mode: bool = True):
        super().train(mode)
        self._shell.training = mode
        return self

    def decoder_layers(self) -> list[nn.Module]:
        """This stage's decoder layers, the model's own modules, in order (what ``training.torch_compile`` compiles)."""
        layers = get_module(self, self._a.layers)
        return [layers[j] for j in self.layer_ids]

    # -------------------------------------------------------------- forward
    def forward(self, x, labels: torch.Tensor | None = None):
        """The stage's part of the model's forward (see the class doc). With the output layer cut over the stages
        (``vocab``), the last stage returns the final hidden states (after the final norm), and with a router aux
        loss the tuple (hidden states, ``coef * aux_loss``): the head and the loss are the VOCAB pass's."""
        if labels is not None and not self.is_last:
            raise ValueError(f"stage {self.index} of {self.num_stages}: labels go to the last stage only")
        if labels is not None and self.vocab is not None:
            raise ValueError(f"stage {self.index}: the output layer is cut over the stages (vocab_parallel); the loss is "
                             "the VOCAB pass's (model.vocab_parallel.vocab_pass), not the last stage's")
        aux = self._aux
        if self.is_first:
            ids, run = x, _Run(x.device)
            stats = None
        else:
            parts = list(x) if isinstance(x, (tuple, list)) else [x]
            h = parts[0]
            side = dict(zip(self._side_in, parts[1:1 + len(self._side_in)]))
            nc = 1 + len(self._side_in) + len(self._a.carry)
            carry = parts[1 + len(self._side_in):nc]
            stats = parts[nc:] if aux else None
            bd = self._a.batch_dim
            ids, run = torch.zeros(h.shape[bd:bd + 2], dtype=torch.long, device=h.device), _Run(h.device, h, side)
            run.carry_in = list(carry)
        kwargs = dict(self._loss_kwargs)
        if labels is not None:
            kwargs["labels"] = labels
            run.fused = self._capture is not None
        self._run = run
        out = None
        try:
            with _capture(self._routers) as router_logits, (MetaValues() if ids.is_meta else nullcontext()):
                try:
                    out = self._shell(input_ids=ids, **kwargs)
                except _Exit:
                    pass
        finally:
            self._run = None
        if aux:
            stats = aux.accumulate(*(stats or aux.zeros(ids.device)), router_logits)
        if not self.is_last:
            if run.hidden_out is None:
                raise PartitionError(f"stage {self.index}: the model's forward ended before layer {self._stop}")
            sent = [run.hidden_out] + [run.side_out[g] if self.is_first else side[g] for g in self._side_out] + run.carry_out
            sent = [t.contiguous() for t in sent] + (list(stats) if aux else [])
            return sent[0] if len(sent) == 1 else tuple(sent)
        if self.vocab is not None:
            h = self.head_shard.take()
            return (h, aux.coef * aux.loss(*stats).to(h.device)) if aux else h
        if labels is None:
            return out.logits if hasattr(out, "logits") else out[0]
        if run.fused:
            self._capture.check_used()
        loss = out.loss if hasattr(out, "loss") else out[0]
        if aux:
            loss = loss + aux.coef * aux.loss(*stats).to(loss.device)
        return loss


# ---------------------------------------------------------------------------- public API


def partition_model(model: nn.Module, num_stages: int, layers_per_stage: list[int] | None = None, seq_len: int = 2048,
                    check: bool | None = None, fused_loss: bool = False, vocab_parallel: bool = False) -> list[Stage]:
    """``num_stages`` stage modules sharing the model's parameters (a tied lm_head is copied for the last stage).

    ``fused_loss``: the last stage computes its loss with ``model.fused_loss`` (no whole logits); a PartitionError
    names why where the model's head or loss is not one it stands for (``fused_loss_blocker``).

    ``vocab_parallel``: every stage holds its rows of the output layer (``model/vocab_parallel.py``; ``Stage.head_shard``), the last
    stage returns the final hidden states, and the layers split as if the last stage held no head.

    ``check``: compare the chained stages' logits with the model's on a short input before returning; None checks
    model types outside ``VERIFIED_MODEL_TYPES`` when the weights are real (a meta model cannot be checked). With
    ``vocab_parallel`` the same split with the head on the last stage is checked.
    """
    if fused_loss and (why := fused_loss_blocker(model)):
        raise PartitionError(f"{type(model).__name__}: the fused loss cannot stand for the model's own: {why}")
    plan = partition_plan(model, num_stages, layers_per_stage, seq_len, vocab_parallel=vocab_parallel)
    aux = _aux_loss(model)
    stages = [Stage(model, plan, s, aux, fused_loss) for s in range(num_stages)]
    if check is None:
        check = model.config.model_type not in VERIFIED_MODEL_TYPES
        if check and _has_meta(model):
            warnings.warn(f"{type(model).__name__}: model type {model.config.model_type!r} is not in the verified set and a "
                          "meta model cannot be checked; call hf_asyncpp.partition.check_partition once it has weights")
            check = False
    if check:
        if plan.vocab is not None:  # the same layers, with the head whole on the last stage
            whole = partition_plan(model, num_stages, [len(s.layers) for s in plan.stages], seq_len)
            check_partition(model, [Stage(model, whole, s, aux) for s in range(num_stages)])
        else:
            check_partition(model, stages)
    return stages


def run_stages(stages: list[nn.Module], input_ids: torch.Tensor, labels: torch.Tensor | None = None):
    """Chain the stages in one process: the loss with ``labels``, else the logits."""
    a = input_ids
    for s in stages[:-1]:
        a = s(a)
    return stages[-1](a, labels=labels)


def check_partition(model: nn.Module, stages: list[nn.Module], seq_len: int = 16) -> None:
    """Raise PartitionError unless the chained stages give the model's logits and loss (eval, no grad, a short input).

    A short input cannot show a sliding window longer than itself: masks are checked by the test suite only.
    """
    dev = next(model.parameters()).device
    if dev.type == "meta":
        raise PartitionError(f"{type(model).__name__}: a meta model cannot be checked; materialize it first")
    cfg = model.config
    T = min(seq_len, getattr(cfg, "max_position_embeddings", None) or getattr(cfg, "n_positions", None) or seq_len)
    ids = torch.randint(0, cfg.vocab_size, (2, T), generator=torch.Generator().manual_seed(0)).to(dev)
    modes = {m: m.training for m in model.modules()}
    modes.update({m: m.training for s in stages for m in s.modules()})
    try:
        model.eval()
        for s in stages:
            s.eval()
        with torch.no_grad():
            kw = stages[0]._a.forward_kwargs if isinstance(stages[0], Stage) else {}
            ref = model(input_ids=ids, labels=ids, **kw)
            want = torch.cat([ref.logits.flatten().float(), ref.loss.reshape(1).float()])
            try:
                got = torch.cat([run_stages(stages, ids).flatten().float(), run_stages(stages, ids, ids).reshape(1).float()])
            except Exception as e:
                raise PartitionError(f"{type(model).__name__}: the stages fail where the model runs ({type(e).__name__}: "
                                     f"{e}); it cannot be split into stages") from e
    finally:
        for m, t in modes.items():
            m.training = t
        for s in stages:
            if isinstance(s, Stage):
                s._shell.training = s.training
    scale = float(want.abs().max()) or 1.0
    rtol, atol = (1.3e-6, 1e-5) if ref.logits.dtype == torch.float32 else (1.6e-2, 1e-5)
    if got.shape != want.shape or not torch.allclose(got, want, rtol=rtol, atol=atol * max(1.0, scale)):
        diff = float((got - want).abs().max()) if got.shape == want.shape else float("nan")
        raise PartitionError(f"{type(model).__name__}: the stages do not reproduce the model's forward (max |logit or loss "
                             f"diff| {diff:.3g} of {scale:.3g}); something outside its decoder layers couples them")


def tied_parameters(stages: list[nn.Module]) -> list[tuple[str, str]]:
    """``(earlier-stage name, later-stage name)`` pairs: sum their gradients, keep their values equal. Empty for 1 stage."""
    return list(stages[0].tied_pairs) if stages else []


def shared_tensors(stages: list[nn.Module]) -> list[tuple[tuple[int, ...], list[str]]]:
    """Each tensor held on several stages (tied embeddings, a block shared by several layers): the stages holding it,
    ascending, and its name on each of them. Sorted, so every rank derives the same order (the runtime all-reduces
    the copies' gradients in it)."""
    pairs = tied_parameters(stages)
    if not pairs:
        return []
    where = {n: i for i, s in enumerate(stages) for n, _ in s.named_parameters()}
    groups: dict[str, list[str]] = {}
    for first, later in pairs:
        groups.setdefault(first, [first]).append(later)
    out = []
    for names in groups.values():
        by_stage = sorted((where[n], n) for n in names)
        out.append((tuple(i for i, _ in by_stage), [n for _, n in by_stage]))
    return sorted(out)


def merge_state_dicts(state_dicts: list[dict[str, torch.Tensor]],
                      tied: list[tuple[str, str]] | None = None) -> dict[str, torch.Tensor]:
    """One state dict by original names (vocabulary shards concatenated: ``vocab.assemble``), loadable into the HF model with ``strict=True``.

    With ``tied`` (from ``tied_parameters``), each later-stage copy is replaced by the earlier-stage tensor itself,
    so the tied pair is re-tied (one tensor, one value) whatever drift the copies had.
    """
    merged: dict[str, torch.Tensor] = {}
    for s, sd in enumerate(state_dicts):
        for name, t in sd.items():
            if name in merged:
                raise PartitionError(f"{name}: in two stage state dicts (second: stage {s}); stages own disjoint names")
            merged[name] = t
    merged = assemble(merged)  # an output layer cut over the stages: its rows concatenated under the model's name
    for first, last in tied or []:
        if first in merged:
            merged[last] = merged[first]
    return merged


__all__ = ["Stage", "AuxLoss", "VERIFIED_MODEL_TYPES", "partition_model", "run_stages", "check_partition",
           "tied_parameters", "shared_tensors", "merge_state_dicts"]
