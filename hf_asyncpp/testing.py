"""Run a function on N spawned worker processes, each a rank of one process group, and collect what each returns.

The one process-spawn helper of the tests (``tests/dist_utils.py``) and the benchmarks (``bench/``): a free port,
the rendezvous variables, one thread per rank unless told otherwise, every rank's result or the tracebacks of the
ranks that failed, and an optional time limit after which every rank is killed. A time limit here is a hang guard,
set far above the normal time of the work; it is never a judgement of speed.

Besides spawning, it holds the probes the tests and benchmarks run on a stage: ``HostOps`` (what the host dispatches
per action) and the memory and host-count workers, which build a stage engine from a recipe. Nothing in the package
imports this module (``tests/test_layout.py`` keeps it on its own floor, above the run and below the command line);
at import it needs only torch and the standard library, and it imports the package's config, model and pipeline
inside the probes that build a stage, so that spawning workers stays cheap.
"""
from __future__ import annotations

import gc
import os
import socket
import tempfile
import time
import traceback

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["WorkerError", "free_port", "run_workers", "stage_memory_report", "HostOps", "host_ops_per_step",
           "plain_ops_per_microbatch", "micro_stage_recipe"]


class WorkerError(RuntimeError):
    """A rank raised or died; the message holds the traceback of every rank that wrote one (``tracebacks``)."""

    def __init__(self, message: str, tracebacks: list[str] = ()):
        super().__init__(message)
        self.tracebacks = list(tracebacks)


def free_port() -> int:
    """A TCP port free on 127.0.0.1 right now (the rendezvous of a process group)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, world: int, port: int, fn, args: tuple, out_dir: str, backend: str | None, threads: int,
            env: dict, device: str | None) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      OMP_NUM_THREADS=str(threads), HF_EVALUATE_OFFLINE="1", HF_HUB_OFFLINE="1")
    os.environ.update(env)  # before the first CUDA call (CUDA_VISIBLE_DEVICES, LOCAL_RANK)
    torch.set_num_threads(threads)
    try:
        kw = {}
        if device is not None and torch.device(device).type == "cuda":
            torch.cuda.set_device(torch.device(device))
            if backend == "nccl":
                kw["device_id"] = torch.device(device)
        if backend:
            dist.init_process_group(backend, rank=rank, world_size=world, **kw)
        result = fn(rank, world, *args)
        torch.save(result, os.path.join(out_dir, f"rank{rank}.pt"))
    except BaseException:
        with open(os.path.join(out_dir, f"rank{rank}.err"), "w") as f:
            f.write(traceback.format_exc())
        raise
    finally:
        if dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception:  # noqa: BLE001 (the rank's own error, if any, is the one to report)
                pass
        # the interpreter's exit would walk every object torch and transformers made (about 500,000) in its own
        # garbage collections: over a second per worker, paid by every distributed test; the result is written
        gc.freeze()


def run_workers(fn, world: int, *args, backend: str | None = "gloo", threads: int = 1, env: dict | None = None,
                device: str | None = None, timeout_s: float | None = None, name: str | None = None) -> list:
    """``fn(rank, world, *args)`` on ``world`` spawned processes; the list of what each rank returned, by rank.

    ``fn`` and ``args`` must pickle (a module-level function). Each rank gets ``MASTER_ADDR``/``MASTER_PORT`` (a free
    port), ``RANK``, ``WORLD_SIZE``, ``OMP_NUM_THREADS`` and ``threads`` torch threads, the Hub and ``evaluate``
    offline, then ``env``; it joins a ``backend`` process group (``None``: none) before ``fn`` runs, on ``device``
    when that is a CUDA device. A rank that raises or dies makes this raise ``WorkerError`` with the tracebacks;
    ``timeout_s`` (a hang guard, far above the normal time) kills every rank and raises ``TimeoutError``.
    """
    label = name or getattr(fn, "__name__", "workers")
    with tempfile.TemporaryDirectory() as d:
        ctx = mp.start_processes(_worker, args=(world, free_port(), fn, args, d, backend, threads, dict(env or {}), device),
                                 nprocs=world, join=False, start_method="spawn")
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        try:
            while not ctx.join(timeout=1.0):
                if deadline is not None and time.monotonic() > deadline:
                    for p in ctx.processes:
                        if p.is_alive():
                            p.kill()
                    for p in ctx.processes:
                        p.join(10)
                    raise TimeoutError(f"{label}: no result after {timeout_s:.0f}s (killed)")
        except TimeoutError:
            raise
        except Exception as e:
            first = getattr(e, "error_index", None)  # the rank torch saw fail first: its traceback leads
            ranks = sorted((r for r in range(world) if os.path.exists(os.path.join(d, f"rank{r}.err"))),
                           key=lambda r: r != first)
            errs = [open(os.path.join(d, f"rank{r}.err")).read() for r in ranks]
            raise WorkerError("distributed run failed:\n" + ("\n".join(errs) or str(e)), errs) from e
        return [torch.load(os.path.join(d, f"rank{r}.pt"), weights_only=False) for r in range(world)]


def _stage_engine(rank: int, world: int, recipe: dict):
    """This rank's ``PipelineEngine`` of ``recipe`` (a recipe dict; the model seeded with 0) and a function giving
    ``n`` steps of random token ids of the recipe's shape."""
    # imported here: every spawned worker imports this module, most of them for other functions
    from .config.recipe import recipe_from_dict
    from .model.build import build_model
    from .pipeline.executor import PipelineEngine
    from .topology import Topology

    r = recipe_from_dict(recipe)
    torch.manual_seed(0)
    eng = PipelineEngine(r, build_model(r.model), Topology(rank=rank, world_size=world, num_stages=r.pipeline.num_stages),
                         log=lambda *a: None)
    p, g = r.pipeline, torch.Generator().manual_seed(0)
    return eng, lambda n: [torch.randint(0, eng.config.vocab_size, (p.num_microbatches, p.microbatch_size,
                                                                     r.data.seq_len), generator=g) for _ in range(n)]


def stage_memory_report(rank: int, world: int, recipe: dict, steps: int = 3) -> dict:
    """One stage's ``PipelineEngine.memory_report`` after ``steps`` tracked steps of ``recipe`` (a recipe dict, so it
    pickles): a worker for :func:`run_workers` with ``world`` = the recipe's stages. What the planner is checked
    against (``pipeline.memtrack.agreement``)."""
    eng, batches = _stage_engine(rank, world, recipe)
    eng.track_memory = True
    eng.train_steps(batches(steps), 0)
    out = eng.memory_report()
    eng.close()
    return out


# ---------------------------------------------------------------------------- what the host dispatches

NO_KERNEL = {"aten::empty", "aten::empty_strided", "aten::empty_like", "aten::_local_scalar_dense", "aten::set_",
             "aten::resize_", "aten::lift_fresh", "aten::_has_compatible_shallow_copy_type"}
"""Ops that allocate, read or re-point storage without launching a kernel on a GPU (besides the views)."""


def launches_no_kernel(func) -> bool:
    """A view (its result aliases its input, not written: ``view``, ``t``, ``select``, ``detach``, ``expand`` ...) or
    one of :data:`NO_KERNEL`."""
    if func._schema.name in NO_KERNEL:
        return True
    return any(r.alias_info is not None and not r.alias_info.is_write for r in func._schema.returns)


def _from_root(path: str, roots: tuple[str, ...]) -> str:
    """``.../site-packages/transformers/x.py`` or ``/checkout/hf_asyncpp/x.py`` -> ``transformers/x.py``."""
    at = max(path.rfind(r) for r in roots)
    return path[at + 1:] if at >= 0 else path


class HostOps(TorchDispatchMode):
    """Counts every aten op the calling thread dispatches below autograd, per label (the action being run: see
    :meth:`watch`), and names the source line of every scalar read (``.item()``, ``float(t)``: on a GPU a host sync
    unless the tensor lives on the host). The counts depend on the code and the model's topology, not on its width
    or the machine's speed: a CPU run predicts what a GPU's host dispatches (``bench/host_overhead.py``)."""

    def __init__(self, roots: tuple[str, ...] = ("hf_asyncpp", "transformers")):
        super().__init__()
        self.label = "between"
        self.ops: dict[str, int] = {}
        self.launching: dict[str, int] = {}
        self.calls: dict[str, int] = {}
        self.reads: dict[tuple[str, str], int] = {}
        self._roots = tuple(os.sep + r + os.sep for r in roots)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        label = self.label
        self.ops[label] = self.ops.get(label, 0) + 1
        if not launches_no_kernel(func):
            self.launching[label] = self.launching.get(label, 0) + 1
        if func._schema.name == "aten::_local_scalar_dense":
            where = next((f"{_from_root(f.filename, self._roots)}:{f.lineno}"
                          for f in reversed(traceback.extract_stack()[:-1]) if any(r in f.filename for r in self._roots)),
                         "?")
            self.reads[(label, where)] = self.reads.get((label, where), 0) + 1
        return func(*args, **(kwargs or {}))

    def watch(self, engine) -> None:
        """Label the ops of each of ``engine``'s actions (a ``PipelineEngine``) by the action's kind; everything
        else (the loop between actions, the drain) counts as ``between``."""
        for kind, handler in list(engine._handlers.items()):
            def labelled(a, w, handler=handler, name=kind.value):
                outer, self.label = self.label, name
                try:
                    handler(a, w)
                finally:
                    self.label = outer
                self.calls[name] = self.calls.get(name, 0) + 1
            engine._handlers[kind] = labelled

    def per_call(self) -> dict[str, dict[str, float]]:
        """{label: {"ops", "launching", "calls"}}, ops and launching per call of the label (between: in all)."""
        out = {}
        for label, n in self.ops.items():
            calls = self.calls.get(label, 1)
            out[label] = {"ops": n / calls, "launching": self.launching.get(label, 0) / calls, "calls": calls}
        return out


def host_ops_per_step(rank: int, world: int, recipe: dict, warmup: int = 2, steps: int = 2) -> dict:
    """What one stage's host dispatches per action in steady state: ``HostOps`` over ``steps`` steps of ``recipe``
    after ``warmup`` (the first steps build the optimizer state and the weight versions). A worker for
    :func:`run_workers`: {"actions": {kind: {"ops", "launching", "calls"}}, "reads_per_step": {(kind, line): n},
    "tensors": {"muon": n, "adamw": n}}."""
    eng, batches = _stage_engine(rank, world, recipe)
    eng.train_steps(batches(warmup), 0)
    mode = HostOps()
    mode.watch(eng)
    swaps = eng.weight_swaps
    with mode:
        eng.train_steps(batches(steps), warmup)
    groups = eng.optimizer.param_groups
    tensors = {"muon": sum(len(gr["params"]) for gr in groups if gr.get("use_muon")),
               "adamw": sum(len(gr["params"]) for gr in groups if not gr.get("use_muon"))}
    swaps = (eng.weight_swaps - swaps) / steps
    eng.close()
    return {"actions": mode.per_call(), "reads_per_step": {k: v / steps for k, v in mode.reads.items()},
            "tensors": tensors, "steps": steps, "weight_swaps_per_step": swaps}


def plain_ops_per_microbatch(rank: int, world: int, recipe: dict, bf16_weights: bool, microbatches: int = 4) -> dict:
    """What the host dispatches for one microbatch's forward and backward of the recipe's model as plain
    transformers trains it, for :func:`host_ops_per_step`'s stage to be measured against: the whole model (the
    stage's layout when it is one stage), loss from ``labels``, gradients accumulated over ``microbatches``.
    ``bf16_weights`` False: fp32 weights under bf16 autocast, the stage's numerics under ``training.bf16`` (its
    bf16 weight versions give autocast's casts bit for bit); True: bf16 weights without autocast, the eager ideal
    (other numerics: norms, softmax and gradient sums in bf16). {"F": {"ops", "launching"}, "B": {...}}."""
    # imported here, as in _stage_engine: every spawned worker imports this module, most of them for other functions
    from .config.recipe import recipe_from_dict
    from .model.build import build_model

    r = recipe_from_dict(recipe)
    torch.manual_seed(0)
    model = build_model(r.model).train()
    model.config.use_cache = False  # as the stage runs: no cache built in training
    if bf16_weights:
        model.to(torch.bfloat16)
    p = r.pipeline
    ids = torch.randint(0, model.config.vocab_size, (p.microbatch_size, r.data.seq_len),
                        generator=torch.Generator().manual_seed(0))

    def forward():
        with torch.autocast(ids.device.type, dtype=torch.bfloat16, enabled=not bf16_weights):
            return model(ids, labels=ids).loss / microbatches

    forward().backward()  # warm-up: every gradient exists, later microbatches accumulate
    mode = HostOps()
    for _ in range(microbatches):
        mode.label = "F"
        with mode:
            loss = forward()
        mode.label = "B"
        with mode:
            loss.backward()
    return {k: {"ops": mode.ops[k] / microbatches, "launching": mode.launching[k] / microbatches} for k in ("F", "B")}


MICRO = {"hidden_size": 24, "intermediate_size": 64, "num_attention_heads": 3, "num_key_value_heads": 1,
         "vocab_size": 128, "max_position_embeddings": 64}
"""A recipe's model at hidden size 24: its layers, tying, tensors and shape classes kept, its widths not."""
MOE_MICRO = {"moe_intermediate_size": 16, "head_dim": 8}


def micro_stage_recipe(path, layers: int | None = None) -> dict:
    """The recipe at ``path`` as one 2BW stage (m = 4, Muon + EF as the recipe sets the optimizer, ``training.bf16``)
    of its model at :data:`MICRO` width (``layers``: another depth): what :func:`host_ops_per_step` counts."""
    import yaml

    r = yaml.safe_load(open(path).read())
    model = r["model"]["config"]
    cfg = dict(model, **MICRO, **(MOE_MICRO if "num_experts" in model else {}))
    if layers:
        cfg["num_hidden_layers"] = layers
    return {"model": {"config": cfg}, "data": {"seq_len": 16},
            "pipeline": {"schedule": "2bw", "num_stages": 1, "num_microbatches": 4, "microbatch_size": 1},
            "optimizer": dict(r["optimizer"], delay_correction="error_feedback"),
            "training": {"bf16": True, "max_grad_norm": 1.0, "max_steps": 100, "report_to": [],
                         "lr_scheduler_type": "constant", "warmup_steps": 0}}
