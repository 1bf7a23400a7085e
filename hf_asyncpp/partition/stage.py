"""Stage modules: a contiguous slice of the model that computes exactly what the model computes there."""
from __future__ import annotations

import copy
import inspect
import sys
import warnings
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch import nn

from .plan import MASK_BUILDERS, PartitionError, PartitionPlan, get_module, partition_plan

# Model types whose stages the test suite compares with the whole model (loss, logits, every gradient).
# Others are checked numerically at partition time (``check_partition``) before any stage is handed out.
VERIFIED_MODEL_TYPES = frozenset({
    "llama", "mistral", "qwen2", "qwen3", "gemma2", "gemma3_text", "phi3", "gpt2", "olmo2", "mixtral", "qwen2_moe",
    "qwen3_moe", "olmoe", "deepseek_v3", "gpt_oss", "granite", "granitemoe", "cohere", "gpt_neox",
})


# ---------------------------------------------------------------------------- router auxiliary loss


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
        """Add router logits to (probability sums (E,), [assignment counts (E,), rows]) in transformers' order."""
        E = self.num_experts
        for logits in logits_list:
            weights = torch.nn.functional.softmax(logits.to(prob_sum.device), dim=-1)
            _, selected = torch.topk(weights, self.top_k, dim=-1)
            sel = selected.reshape(-1)
            hits = torch.zeros(E + 1, dtype=torch.int64, device=counts.device).scatter_add_(0, sel, torch.ones_like(sel))
            hits[E] = weights.shape[0]
            counts = counts + hits
            prob_sum = prob_sum + weights.float().sum(dim=0)
        return prob_sum, counts

    def loss(self, prob_sum, counts) -> torch.Tensor:
        rows = counts[-1].to(torch.float32)
        tokens_per_expert = counts[:-1].to(torch.float32) / rows
        router_prob_per_expert = prob_sum / rows
        return torch.sum(tokens_per_expert * router_prob_per_expert.unsqueeze(0)) * self.num_experts


def _aux_loss(model: nn.Module) -> AuxLoss | None:
    """The router aux loss the model adds to its loss, or None; refuses a loss it cannot reproduce from pooled sums."""
    cfg, cls = model.config, type(model).__name__
    if not getattr(cfg, "output_router_logits", False):
        return None
    fn = getattr(sys.modules[type(model).__module__], "load_balancing_loss_func", None)
    if fn is None:
        if "aux_loss" in inspect.getsource(type(model).forward):
            raise PartitionError(f"{cls}: adds a router aux loss without a module-level load_balancing_loss_func; "
                                 "the stage builder cannot reproduce it")
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
    E = getattr(model, "num_experts", None) or _cfg_experts(cfg)
    k = getattr(model, "num_experts_per_tok", None) or getattr(cfg, "num_experts_per_tok", None)
    coef = getattr(model, "router_aux_loss_coef", None)
    coef = coef if coef is not None else getattr(cfg, "router_aux_loss_coef", None)
    if not (E and k and coef is not None):
        raise PartitionError(f"{cls}: adds a router aux loss but its number of experts, top-k or router_aux_loss_coef "
                             "is not where transformers' Switch-loss models keep them")
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
        raise PartitionError(f"{cls}: {type(model).__module__}.load_balancing_loss_func is not the Switch loss of pooled "
                             "router statistics; pooling across stages would change the loss")
    return aux


def _cfg_experts(cfg):
    return getattr(cfg, "num_local_experts", None) or getattr(cfg, "num_experts", None) or getattr(cfg, "n_routed_experts")


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
    """Collect router logits during the block; the hooks live only as long as the forward."""
    sink: list[torch.Tensor] = []

    def hook(index):
        def fn(module, args, output):
            if not isinstance(output, tuple):
                sink.append(output)
            elif output[index] is not None:
                sink.append(output[index])
        return fn

    handles = [m.register_forward_hook(hook(i)) for m, i in routers]
    try:
        yield sink
    finally:
        for h in handles:
            h.remove()


# ---------------------------------------------------------------------------- stage


def _place(root: nn.Module, path: str, module: nn.Module) -> None:
    """Register ``module`` at dotted ``path`` under ``root`` so parameter names stay the original ones."""
    node = root
    for p in path.split(".")[:-1]:
        if not hasattr(node, p):
            node.add_module(p, nn.Module())
        node = getattr(node, p)
    node.add_module(path.rsplit(".", 1)[-1], module)


def _weight_initializer(model: nn.Module):
    """The model class's ``_init_weights`` on a parameterless stand-in (a stage must not keep the model alive)."""
    cls = type(model)
    stub = cls.__new__(cls)
    nn.Module.__init__(stub)
    stub.config = model.config
    return stub._init_weights


class Stage(nn.Module):
    """One contiguous slice of the model: [embedding] + layers[a:b] + [norm + lm_head].

    ``forward(x, labels=None)``: ``x`` is ``input_ids`` on the first stage, else what the previous stage returned.
    Layers, norm and embeddings are the model's own modules (shared, not copied); the rotary embedding is a
    per-stage copy and a tied lm_head is a separate copy on the last stage (see ``tied_parameters``).
    """

    def __init__(self, model: nn.Module, plan: PartitionPlan, index: int, aux: AuxLoss | None, tied: list):
        super().__init__()
        a, cfg = plan.anatomy, model.config
        self.config, self.index, self.num_stages = cfg, index, len(plan.stages)
        self.is_first, self.is_last = index == 0, index == self.num_stages - 1
        self.layer_ids = list(plan.stages[index].layers)
        self.tied_pairs = list(tied)
        self._a, self._aux = a, aux
        self._init_fn = _weight_initializer(model)
        if self.is_first:
            for path in [*a.embed, *a.pre] + ([a.learned_positions] if a.learned_positions else []):
                _place(self, path, get_module(model, path))
        rotary = get_module(model, a.rotary)
        if rotary is not None:
            _place(self, a.rotary, self._fresh_rotary(rotary) if _has_meta(rotary) else copy.deepcopy(rotary))
        layers = get_module(model, a.layers)
        _place(self, a.layers, nn.ModuleDict({str(i): layers[i] for i in self.layer_ids}))
        if self.is_last:
            _place(self, a.norm, get_module(model, a.norm))
            head = get_module(model, a.head)
            _place(self, a.head, copy.deepcopy(head) if (plan.tied and self.num_stages > 1) else head)
        self._routers = [r for i in self.layer_ids for r in _router_modules(f"{a.layers}.{i}", layers[i], aux.recorders)] if aux else []
        self._rotary_by_type = rotary is not None and "layer_type" in inspect.signature(rotary.forward).parameters
        sig = inspect.signature(layers[0].forward).parameters
        self._pass_positions = "position_ids" in sig or any(p.kind is p.VAR_KEYWORD for p in sig.values())
        base = get_module(model, a.layers.rsplit(".", 1)[0])
        self._embed_mult = getattr(base, "embedding_multiplier", None)  # Granite
        self._logits_div = getattr(cfg, "logits_scaling", None) if cfg.model_type.startswith("granite") else None
        self._logits_mult = getattr(model, "logit_scale", None)  # Cohere
        self._softcap = getattr(cfg, "final_logit_softcapping", None)
        self._loss_fn = model.loss_function if self.is_last else None  # a plain function, not bound to the model

    # -------------------------------------------------------------- materialization
    def _fresh_rotary(self, rotary: nn.Module, device="cpu") -> nn.Module:
        """A rotary embedding with real buffers, recomputed from the config (its buffers are in no checkpoint)."""
        with torch.device(device):
            try:
                return type(rotary)(config=rotary.config)
            except TypeError as e:
                raise PartitionError(f"{type(rotary).__name__}: cannot rebuild the rotary embedding from its config ({e})") from None

    def _init_buffers(self) -> None:
        """Recompute non-persistent buffers (rotary frequencies, embedding scales), which no state dict holds.

        Only after ``to_empty``: the initializer of a module owning such a buffer also redraws its parameters.
        """
        if self._a.rotary:
            old = self.get_submodule(self._a.rotary)
            dev = next(old.buffers()).device if any(True for _ in old.buffers()) else torch.device("cpu")
            _place(self, self._a.rotary, self._fresh_rotary(old, "cpu" if dev.type == "meta" else dev))
        with torch.no_grad():
            for name, m in self.named_modules():
                if name.startswith(self._a.rotary or "\0") or not m._non_persistent_buffers_set:
                    continue
                bufs = {n: b for n, b in m.named_buffers(recurse=False)
                        if n in m._non_persistent_buffers_set and b.is_floating_point() and not b.is_meta}
                for b in bufs.values():
                    b.fill_(float("nan"))  # so a buffer the initializer skips cannot pass for a computed one
                self._init_fn(m)
                for n in bufs:
                    if torch.isnan(getattr(m, n)).any():
                        raise PartitionError(f"{name}.{n}: non-persistent buffer that {type(m).__name__}'s initializer does "
                                             "not restore; build the stage from a real (non-meta) model")

    def to_empty(self, *, device, recurse: bool = True):
        """``nn.Module.to_empty``, then the non-persistent buffers recomputed; parameters still need loading."""
        super().to_empty(device=device, recurse=recurse)
        self._init_buffers()
        return self

    def init_weights(self) -> None:
        """Random initialization of every parameter as transformers initializes the model (training from scratch).

        Stages draw independently: with tied embeddings, copy the first stage's embedding into the last stage's head.
        """
        with torch.no_grad():
            for m in self.modules():
                self._init_fn(m)
        self._init_buffers()

    # -------------------------------------------------------------- forward helpers
    def _masks(self, h: torch.Tensor, pos: torch.Tensor):
        from transformers import masking_utils

        cfg = self.config
        # position_ids=None: arange positions hold no packed sequences, and the packing probe would sync with the host
        kw = dict(config=cfg, inputs_embeds=h, attention_mask=None, past_key_values=None, position_ids=None)
        types = getattr(cfg, "layer_types", None)
        if types:
            built = {}
            for t in {types[i] for i in self.layer_ids}:
                fn = MASK_BUILDERS[t]
                built[t] = getattr(masking_utils, fn)(**kw) if fn else None
            return lambda i: built[types[i]]
        sliding = getattr(cfg, "sliding_window", None) is not None and getattr(cfg, "use_sliding_window", True)
        mask = (masking_utils.create_sliding_window_causal_mask if sliding else masking_utils.create_causal_mask)(**kw)
        return lambda i: mask

    def _rope(self, h: torch.Tensor, pos: torch.Tensor):
        if not self._a.rotary:
            return lambda i: None
        rot = self.get_submodule(self._a.rotary)
        if self._rotary_by_type:
            types = self.config.layer_types
            pe = {t: rot(h, pos, t) for t in {types[i] for i in self.layer_ids}}
            return lambda i: pe[types[i]]
        pe = rot(h, pos)
        return lambda i: pe

    def _embed(self, ids: torch.Tensor) -> torch.Tensor:
        a = self._a
        h = self.get_submodule(a.embed[0])(ids)
        if self._embed_mult is not None:
            h = h * self._embed_mult
        if a.learned_positions:
            h = h + self.get_submodule(a.learned_positions)(torch.arange(ids.shape[1], device=ids.device).unsqueeze(0))
        for p in a.pre:
            h = self.get_submodule(p)(h)
        return h

    # -------------------------------------------------------------- forward
    def forward(self, x, labels: torch.Tensor | None = None):
        if labels is not None and not self.is_last:
            raise ValueError(f"stage {self.index} of {self.num_stages}: labels go to the last stage only")
        a, aux = self._a, self._aux
        if self.is_first:
            h = self._embed(x)
            stats = aux.zeros(h.device) if aux else None
        elif aux:
            h, *stats = x
        else:
            h = x[0] if isinstance(x, (tuple, list)) else x
        pos = torch.arange(h.shape[1], device=h.device).unsqueeze(0)
        mask, rope = self._masks(h, pos), self._rope(h, pos)
        layers = self.get_submodule(a.layers)
        with _capture(self._routers) as router_logits:
            for i in self.layer_ids:
                kw = {"attention_mask": mask(i)}
                if self._pass_positions:
                    kw["position_ids"] = pos
                pe = rope(i)
                if pe is not None:
                    kw["position_embeddings"] = pe
                out = layers[str(i)](h, **kw)
                h = out[0] if isinstance(out, tuple) else out
        if aux:
            stats = aux.accumulate(*stats, router_logits)
        if not self.is_last:
            return (h, *stats) if aux else h
        logits = self.get_submodule(a.head)(self.get_submodule(a.norm)(h))
        if self._logits_mult is not None:
            logits = logits * self._logits_mult
        if self._logits_div is not None:
            logits = logits / self._logits_div
        if self._softcap is not None:
            logits = torch.tanh(logits / self._softcap) * self._softcap
        if labels is None:
            return logits
        loss = self._loss_fn(logits=logits, labels=labels, vocab_size=self.config.vocab_size)
        if aux:
            loss = loss + aux.coef * aux.loss(*stats).to(loss.device)
        return loss


def _has_meta(module: nn.Module) -> bool:
    return any(t.is_meta for t in (*module.parameters(), *module.buffers()))


# ---------------------------------------------------------------------------- public API


def partition_model(model: nn.Module, num_stages: int, layers_per_stage: list[int] | None = None, seq_len: int = 2048,
                    check: bool | None = None) -> list[Stage]:
    """``num_stages`` stage modules sharing the model's parameters (a tied lm_head is copied for the last stage).

    ``check``: compare the chained stages' logits with the model's on a short input before returning; None checks
    model types outside ``VERIFIED_MODEL_TYPES`` when the weights are real (a meta model cannot be checked).
    """
    plan = partition_plan(model, num_stages, layers_per_stage, seq_len)
    aux = _aux_loss(model)
    a = plan.anatomy
    tied = [(f"{a.embed[0]}.weight", f"{a.head}.weight")] if plan.tied and num_stages > 1 else []
    stages = [Stage(model, plan, s, aux, tied) for s in range(num_stages)]
    if check is None:
        check = model.config.model_type not in VERIFIED_MODEL_TYPES
        if check and _has_meta(model):
            warnings.warn(f"{type(model).__name__}: model type {model.config.model_type!r} is not in the verified set and a "
                          "meta model cannot be checked; call hf_asyncpp.partition.check_partition once it has weights")
            check = False
    if check:
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
            ref = model(input_ids=ids, labels=ids)
            want = torch.cat([ref.logits.flatten().float(), ref.loss.reshape(1).float()])
            try:
                got = torch.cat([run_stages(stages, ids).flatten().float(), run_stages(stages, ids, ids).reshape(1).float()])
            except Exception as e:
                raise PartitionError(f"{type(model).__name__}: the stages fail where the model runs ({type(e).__name__}: "
                                     f"{e}); it cannot be split into stages") from e
    finally:
        for m, t in modes.items():
            m.training = t
    scale = float(want.abs().max()) or 1.0
    rtol, atol = (1.3e-6, 1e-5) if ref.logits.dtype == torch.float32 else (1.6e-2, 1e-5)
    if got.shape != want.shape or not torch.allclose(got, want, rtol=rtol, atol=atol * max(1.0, scale)):
        diff = float((got - want).abs().max()) if got.shape == want.shape else float("nan")
        raise PartitionError(f"{type(model).__name__}: the stages do not reproduce the model's forward (max |logit or loss "
                             f"diff| {diff:.3g} of {scale:.3g}); its base model does something between or around its layers "
                             "that the stage builder does not know")


def tied_parameters(stages: list[nn.Module]) -> list[tuple[str, str]]:
    """``(first-stage name, last-stage name)`` pairs: sum their gradients, keep their values equal. Empty for 1 stage."""
    return list(stages[0].tied_pairs) if stages else []


def merge_state_dicts(state_dicts: list[dict[str, torch.Tensor]],
                      tied: list[tuple[str, str]] | None = None) -> dict[str, torch.Tensor]:
    """One state dict by original names, loadable into the HF model with ``strict=True``.

    With ``tied`` (from ``tied_parameters``), each last-stage copy is replaced by the first-stage tensor itself,
    so the tied pair is re-tied (one tensor, one value) whatever drift the copies had.
    """
    merged: dict[str, torch.Tensor] = {}
    for s, sd in enumerate(state_dicts):
        for name, t in sd.items():
            if name in merged:
                raise PartitionError(f"{name}: in two stage state dicts (second: stage {s}); stages own disjoint names")
            merged[name] = t
    for first, last in tied or []:
        if first in merged:
            merged[last] = merged[first]
    return merged


__all__ = ["Stage", "AuxLoss", "VERIFIED_MODEL_TYPES", "partition_model", "run_stages", "check_partition",
           "tied_parameters", "merge_state_dicts"]
