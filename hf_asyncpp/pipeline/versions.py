"""Weight versions of one stage: where "two weight buffers" (2BW) and weight stashing (PipeDream) live.

The optimizer owns the stage's ``nn.Parameter``s, whose storage always holds the newest version. Forward passes
never use those Parameters directly: each version gets its own leaf tensors sharing storage with a version buffer,
and the executor points the stage's modules at them (``PipelineEngine._bind``: when the version a forward needs
changes, not per microbatch), so an update never touches a tensor that an in-flight microbatch saved for its
backward. A buffer is reused as soon as its version has no microbatch in
flight and no future forward needs it (``lag`` = the schedule record's ``lag``): 1 buffer for GPipe/1F1B (updates
in place), 2 for 2BW (the version in use and the one the next STEP writes), up to p at stage 0 for PipeDream.

The in-flight counts are only changed through a :class:`Hold`: a microbatch's forward takes one (``hold(v)``),
it travels with the microbatch's saved state, and its backward releases it exactly once. A second release raises
(it would free a buffer an in-flight backward still reads), and :meth:`Versions.check_released` at a drain point
names a hold never released (its buffer would never be freed).

bf16 (``use_bf16``): autocast casts a matrix to bf16 inside each microbatch's forward and the matmul's backward keeps
that cast, so every microbatch in flight held its own bf16 copy of the stage's matrices (up to p at stage 0). Instead,
a version holds the weights autocast casts (``autocast_casts``: found on the stage's first forward) as bf16 only,
made once when the STEP writes the version (``finish_update``); the fp32 master is the optimizer's Parameter,
updated in place. The forward reads the bf16 copy through :class:`_Bf16Weight`, whose backward hands the gradient
to an fp32 leaf as autocast's cast does (bf16 -> fp32, accumulated in fp32 over the step's microbatches), so the
numbers are autocast's bit for bit; from a step's second microbatch on the backward adds the bf16 gradient into
the leaf's fp32 ``.grad`` in place (no cast, no fp32 temporary; the same bits). The leaf is an expanded fp32 scalar
(one zero per version, expanded to each shape): it has a full-size fp32 ``.grad`` and holds no weights. A weight
autocast uses both cast and uncast (a tied embedding and head on one stage) stays fp32.
A mixture-of-experts layer's 3-D expert stacks (:func:`expert_stacks`) are held in bf16 too, like every other matrix:
autocast never casts a stack whole (the eager experts loop casts one expert's slice per matmul, per microbatch;
transformers' grouped GEMM is not autocast's and ran in fp32 on fp32 stacks). Slicing the bf16 copy gives autocast's
cast of the fp32 slice, so the eager loop's numbers stay autocast's bit for bit; the grouped GEMM now runs in bf16.
"""
from __future__ import annotations

import torch
from torch.func import functional_call

from ..model.build import autocast, expert_stacks


class Switch:
    """A flag the executor sets while autograd runs (a plain object: an autograd node may hold it)."""

    __slots__ = ("on",)

    def __init__(self) -> None:
        self.on = False


class _Bf16Weight(torch.autograd.Function):
    """The forward reads ``w16`` (a version's bf16 copy); the backward sends the gradient, as fp32, to ``sink``.

    Once ``sink`` has a gradient and ``add_in_place`` is on (no hook waits on the leaf's accumulation: the reducer
    hooks only the step's last backward), the backward adds the bf16 gradient into that fp32 ``.grad`` itself: one
    mixed-dtype ``add_`` instead of autocast's cast (an fp32 temporary) and autograd's add, the same bits (bf16
    widens to fp32 exactly, the sum is an fp32 add either way). Megatron's gradient-accumulation fusion, without a
    rewritten GEMM."""

    @staticmethod
    def forward(ctx, sink: torch.Tensor, w16: torch.Tensor, add_in_place: "Switch") -> torch.Tensor:
        ctx.sink, ctx.add_in_place = sink, add_in_place  # not the Versions: its compute dict holds this node
        return w16.view_as(w16)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        acc = ctx.sink.grad
        if acc is not None and ctx.add_in_place.on:
            acc.add_(grad)
            return None, None, None
        return grad.to(torch.float32), None, None


def leaf_readers(outputs, leaves: dict[str, torch.Tensor]) -> dict[str, set[str]]:
    """Per name of ``leaves`` the autograd nodes (``node.name()``) of the graph of ``outputs`` that read it."""
    name_of = {id(t): n for n, t in leaves.items()}
    readers: dict[str, set[str]] = {}
    seen = set()
    todo = [t.grad_fn for t in outputs if torch.is_tensor(t) and t.grad_fn is not None]
    while todo:
        node = todo.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        for nxt, _ in node.next_functions:
            if nxt is None:
                continue
            var = getattr(nxt, "variable", None)
            if var is not None and id(var) in name_of:
                readers.setdefault(name_of[id(var)], set()).add(node.name())
            else:
                todo.append(nxt)
    return readers


def autocast_casts(outputs, leaves: dict[str, torch.Tensor]) -> set[str]:
    """Names of the ``leaves`` that the autograd graph of ``outputs`` (one forward under autocast) reads only through a
    dtype cast of the whole tensor: the weights autocast copies to bf16 for each microbatch."""
    return {n for n, r in leaf_readers(outputs, leaves).items() if r == {"ToCopyBackward0"}}


def find_casts(stage: torch.nn.Module, leaves: dict[str, torch.Tensor], arg, kwargs) -> set[str]:
    """The weights held per version in bf16 on ``stage``: those autocast casts whole, read off the autograd graph of
    one forward of a microbatch under autocast (outside the schedule, once per process; its random numbers are given
    back), and the stage's expert stacks (:func:`expert_stacks`) but one the forward gathers per token
    (``stack[expert_ids]``: transformers' ``batched_mm``; ``IndexBackward0`` in the graph), whose backward sums each
    expert's per-token gradients in the stack's dtype: that sum stays fp32 (autocast casts the gathered copy)."""
    device = next(iter(leaves.values())).device
    # fork_rng: this extra forward's random numbers (dropout) are given back, so the schedule's first forward draws
    # the same ones as without it. force_eager: compiled layers (``training.torch_compile``) would show autograd one
    # ``CompiledFunctionBackward`` node per layer and no casts, so nothing would be held in bf16; run eagerly, the
    # forward shows autocast's casts as without compile (and compiles nothing: its fp32 weights are not the bf16
    # copies the schedule's forwards will read)
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []), autocast(True), \
            torch.compiler.set_stance("force_eager"):
        out = functional_call(stage, leaves, (arg,), kwargs, strict=False)
        outs = [out] if torch.is_tensor(out) else [t for t in (out.values() if isinstance(out, dict) else out)]
        readers = leaf_readers(outs, leaves)
    stacks = {n for n in expert_stacks(stage) & leaves.keys() if "IndexBackward0" not in readers.get(n, ())}
    return {n for n, r in readers.items() if r == {"ToCopyBackward0"}} | stacks


class Hold:
    """One microbatch's use of one weight version, from its forward to its backward; released exactly once."""

    __slots__ = ("_versions", "version", "_released")

    def __init__(self, versions: "Versions", version: int):
        self._versions, self.version, self._released = versions, version, False

    def release(self) -> None:
        if self._released:
            raise RuntimeError(f"weight version {self.version}: a microbatch's hold was released twice (its buffer "
                               "could be overwritten while another backward still uses it)")
        self._released = True
        self._versions.inflight[self.version] -= 1


class Versions:
    """Weight versions of one stage: version -> buffer; in-flight counts decide which buffers are free."""

    def __init__(self, params: dict[str, torch.nn.Parameter], lag: int):
        self.params, self.lag = params, lag
        self.buffers: dict[int, dict[str, torch.Tensor]] = {0: {n: p.data for n, p in params.items()}}
        self.leaves: dict[int, dict[str, torch.Tensor]] = {}
        self.inflight: dict[int, int] = {0: 0}
        self.latest = 0
        self.peak = 1
        self.cast: set[str] | None = None  # names held per version in bf16 (None: not decided yet, fp32 everywhere)
        self.compute: dict[int, dict[str, torch.Tensor]] = {}  # version -> what its forward reads
        self.pending: dict[int, object] = {}  # version -> what must run before its first use (ZeRO-1's broadcast)
        self.add_in_place = Switch()  # on: a backward adds bf16 gradients into the leaves' fp32 .grad (_Bf16Weight)
        self.peak_bytes = self.nbytes()

    def use_bf16(self, names: set[str]) -> None:
        """Hold ``names`` per version as bf16 copies from now on (nothing may be in flight)."""
        self.check_released()
        self.cast = set(names)
        for buf in self.buffers.values():
            for n in self.cast:
                buf[n] = buf[n].to(torch.bfloat16)  # the newest's fp32 stays the Parameter's (the master)
        self.leaves, self.compute = {}, {}
        self.peak_bytes = max(self.peak_bytes, self.nbytes())

    def nbytes(self) -> int:
        """Bytes of weights held: every version's buffers, plus the fp32 masters of the names held in bf16."""
        held = sum(b.numel() * b.element_size() for buf in self.buffers.values() for b in buf.values())
        return held + sum(self.params[n].numel() * self.params[n].element_size() for n in self.cast or ())

    def hold(self, v: int) -> Hold:
        """Version ``v`` is in use by one more microbatch until the returned hold is released (at its backward)."""
        self.inflight[v] = self.inflight.get(v, 0) + 1
        return Hold(self, v)

    def check_released(self) -> None:
        """At a drain point every hold must be released: raise naming the versions still held."""
        held = {v: n for v, n in self.inflight.items() if n}
        if held:
            raise RuntimeError(f"weight versions still held by microbatches at a drain point (version: count): {held}; "
                               "a forward's hold was never released by its backward")

    def settle(self) -> None:
        """Run what the versions wait for (the weights a replica receives from the owners, ZeRO-1)."""
        for v in sorted(self.pending):
            self.pending.pop(v)()

    def leaves_for(self, v: int) -> dict[str, torch.Tensor]:
        """Version ``v``'s gradient leaves (fp32, one per parameter): its gradients accumulate there."""
        if v in self.pending:
            self.pending.pop(v)()
        if v not in self.buffers:
            raise RuntimeError(f"weight version {v} is not held (held: {sorted(self.buffers)}, latest {self.latest})")
        if v not in self.leaves:
            cast = self.cast or ()
            zero: dict[tuple, torch.Tensor] = {}  # one scalar per (dtype, device) that every bf16-held leaf expands

            def leaf(n: str, b: torch.Tensor) -> torch.Tensor:
                if n not in cast:
                    return b.detach().requires_grad_()
                key = (self.params[n].dtype, b.device)
                if key not in zero:
                    zero[key] = torch.zeros((), dtype=key[0], device=key[1])
                return zero[key].expand(b.shape).requires_grad_()
            self.leaves[v] = {n: leaf(n, b) for n, b in self.buffers[v].items()}
        return self.leaves[v]

    def compute_for(self, v: int) -> dict[str, torch.Tensor]:
        """What version ``v``'s forward reads: its leaves, and for the names held in bf16 their copies, whose
        gradients reach the leaves (the same autograd node for all of the version's microbatches). Made with grad
        enabled whoever asks first: an evaluation (no grad) may be first to read the newest version, and the copies
        it cached would otherwise carry no gradient to the leaves in the training steps that read them next."""
        leaves = self.leaves_for(v)
        if not self.cast:
            return leaves
        if v not in self.compute:
            buf = self.buffers[v]
            with torch.enable_grad():
                self.compute[v] = {n: _Bf16Weight.apply(t, buf[n], self.add_in_place) if n in self.cast else t
                                   for n, t in leaves.items()}
        return self.compute[v]

    def _needed(self, v: int, latest: int) -> bool:
        return self.inflight.get(v, 0) > 0 or v >= latest - self.lag

    def prepare_update(self) -> None:
        """Point the optimizer's Parameters at a buffer holding the newest weights that it may overwrite."""
        self.settle()
        new = self.latest + 1
        src = self.buffers[self.latest]
        cast = self.cast or set()
        free = [v for v in self.buffers if not self._needed(v, new)]
        if self.latest in free:
            dst = src  # nothing in flight uses it and no future forward will: update in place
        elif free:
            dst = self.buffers[free[0]]
            names = [n for n in dst if n not in cast]  # bf16 copies are written after the step (finish_update)
            if names:
                with torch.no_grad():
                    torch._foreach_copy_([dst[n] for n in names], [src[n] for n in names])
        else:
            dst = {n: torch.empty_like(b) if n in cast else b.clone() for n, b in src.items()}
        for v in free:
            self.buffers.pop(v)
            self.leaves.pop(v, None)
            self.compute.pop(v, None)
            self.inflight.pop(v, None)
        for n, p in self.params.items():
            if n not in cast:  # a bf16-held name's master is updated in place: no forward reads it
                p.data = dst[n]
        self.latest = new
        self.buffers[new] = dst
        self.inflight[new] = 0
        self.peak = max(self.peak, len(self.buffers))
        self.peak_bytes = max(self.peak_bytes, self.nbytes())

    def finish_update(self) -> None:
        """After the optimizer wrote the newest weights: the newest version's bf16 copies of them (once per STEP)."""
        if self.cast:
            buf, names = self.buffers[self.latest], list(self.cast)
            with torch.no_grad():  # one foreach kernel for every bf16 copy
                torch._foreach_copy_([buf[n] for n in names], [self.params[n] for n in names])

    def state(self) -> dict[str, torch.Tensor]:
        """Held versions other than the newest (which is the module's state dict)."""
        return {f"v{v}/{n}": b for v, buf in self.buffers.items() if v != self.latest for n, b in buf.items()}

    def load(self, latest: int, older: dict[str, torch.Tensor]) -> None:
        """The newest version is the Parameters' (just loaded); ``older`` as :meth:`state` wrote them (bf16 where a
        bf16 run held them so; an fp32 run reads them back as fp32, a bf16 run casts fp32 ones as autocast would)."""
        cast = self.cast or set()
        self.buffers = {latest: {n: p.data.to(torch.bfloat16) if n in cast else p.data for n, p in self.params.items()}}
        for key, t in older.items():
            v, n = key[1:].split("/", 1)
            self.buffers.setdefault(int(v), {})[n] = t.to(torch.bfloat16 if n in cast else self.params[n].dtype, copy=True)
        self.latest, self.leaves, self.compute = latest, {}, {}
        self.inflight = {v: 0 for v in self.buffers}
