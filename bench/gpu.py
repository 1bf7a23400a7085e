"""The GPU proof: what the executor's way of running a stage costs on a real accelerator, whether the planner's
memory model holds there, what the executor adds per action, and whether the reducer keeps the compute stream free.

    python -m bench.gpu --save $OUT/gpu.pkl   # THE ONE CALL (defaults), one H100/H200, no network: part 1 on the
                                              # recipe's stage 0 and its last stage; limits 200 + 200 = 400 s
                                              # (run it with timeout_s 540)
    python -m bench.gpu --parts 2,3,4,5 --save $OUT/rest.pkl                   # a second call: limits 480 s
    python -m bench.gpu --parts 1 --models moe-2b,moe-10b --save $OUT/moe.pkl  # a third: the MoE rows, 500 s
    python -m bench.gpu --load a.pkl b.pkl --write   # merge saved calls into docs/benchmarks/gpu.md
    python -m bench.gpu --cpu-tiny --parts 1,2,3,4,5 --models all   # the same code paths at a tiny size on CPU
                                              # (automatic without CUDA; bench/check_gpu.py runs it, 2-3 minutes)

A call's processes run under per-part limits (``TIMEOUTS``; part 1 per model, ``PART1_TIMEOUTS``); a call prints
what its limits sum to and says so if that is over the 540 s (``CALL_BUDGET_S``) a 10-minute command leaves.

Models are built from recipe configs (``AutoConfig.for_model``, random weights) and fed random token ids, so
nothing is downloaded; ``datasets``/``evaluate`` are never imported (the GPU image lacks them; every part's process
reports whether it imported them, and the output warns if one did). Every part runs in processes of its own, under
a time limit (``TIMEOUTS`` on a GPU; on CPU only a hang guard, ``CPU_HANG_GUARD_S``): a failure (an OOM, a compile
error, a hang) becomes a row of the table and the other parts still run.

1. **A stage as the executor runs it, against the plain model** (the fair shape, the one call: stage 0 of
   smollm2-360m's 4 stages -- its embedding and 9 layers -- at the recipe's 16 x 2048 with the 4 microbatches 2BW
   keeps in flight there, against transformers' base model with 9 layers run to its hidden states, both backwards
   from a gradient as the next stage sends it; and its last stage -- 5 layers, final norm, tied head and the loss
   as training computes it (``training.fused_loss: auto``: the chunked fused linear cross-entropy,
   ``hf_asyncpp/model/fused_loss.py``) -- fed hidden states already on the device, against transformers' model
   with 5 layers fed the same hidden states (``inputs_embeds``) through its norm, head and ``ForCausalLMLoss``;
   host batches pinned once, outside the timing, for both sides; every timed round under
   ``torch.nn.attention.sdpa_kernel`` with the cuDNN, flash and memory-efficient backends only, so that the math
   kernel raises instead of running, and the backend that ran read off a profile of one round (aten's SDPA op
   names, or the CUDA kernels': ``cudnn_generated_fort_native_sdpa*``, ``flash_fwd*``, ``fmha_cutlass*``);
   compiled layers as training compiles them (``compile_layers``; ``find_casts`` runs eagerly, so the compiled
   stage holds the same bf16 weight versions as training), the first compiled rounds' extra seconds noted as the
   compile time. Then, as a separate call: moe-2b and moe-10b cut to 4 layers as one stage; the whole smollm2-360m as one
   stage only with ``--models smollm2-360m``: at a halved microbatch it is host-bound for the plain model too;
   bf16 autocast over fp32 master weights, as ``training.bf16``). A whole model's stage is
   ``partition_model(model, 1)[0]``,
   run as ``PipelineEngine._forward`` does: the stage's modules pointed at a weight version once per round
   (``_reparametrize_module(stage, compute)``, ``PipelineEngine._bind``), then ``stage(ids, labels=ids)``; the
   backward adds the bf16 weight gradients into the fp32 ones in place from the second microbatch on
   (``Versions.add_in_place``) -- on a weight version (``Versions.compute_for``: the linear weights and the MoE expert stacks as
   the version's bf16 copies, made once, ``find_casts``, ``Versions.use_bf16``; their gradients reach fp32 leaves)
   under ``hf_asyncpp.model.build.autocast``
   (``torch.autocast(device, bfloat16)``), k forwards then k backwards, k = the in-flight microbatches of that
   stage (stage 0 for a whole model) of the recipe's own pipeline (from its action list: the most activations a stage holds). The plain model runs
   ``model(input_ids, labels).loss.backward()`` one microbatch at a time on the same microbatches; it is a second
   model with the same weights, because a plain forward leaves transformers' output-recorder hooks on modules a
   stage shares, which the executor's stage never has (under torch.compile they break its graph). The microbatch
   is the recipe's, halved until k of them fit (the planner's activation model x 2; an OOM halves it again). Each
   eagerly, with ``torch.compile`` per decoder layer (``compile_layers``, as training: the stage's own layer
   wrappers, the plain model's layers), and for MoE with transformers' experts implementations (``config._experts_implementation``:
   ``eager`` loops over experts, ``grouped_mm``, transformers' default, one grouped GEMM; ``ExpertsInterface`` in
   ``transformers/integrations/moe.py``), plus a contrast row of the plain model with bf16 weights (no autocast):
   the bar for the stage's MoE (the target: the stage, experts grouped_mm, at least 0.9x it; a note gives the ratio).
   Under autocast transformers casts the grouped-GEMM input to the weights' dtype, so the plain model's fp32
   masters run the expert GEMMs in fp32, where torch's CUDA grouped GEMM has no kernel (its fast path is bf16;
   other dtypes loop over the groups after ``offs.cpu()``, a host sync), and under torch.compile transformers swaps
   in its own per-expert fallback op; the stage's versions hold the expert stacks in bf16, so its grouped GEMMs
   take the bf16 kernel (each row's note says which path ran, stage and plain). Timed
   with CUDA events, synchronized only at the end of each timed region. Reported: tokens/s, TFLOP/s = 6 x active
   parameters x tokens/s plus attention's 12 L H Q T per token (torchtitan's convention; active: every parameter
   that multiplies, the input embedding of an untied model being a lookup; expert tensors x top-k / experts; before
   2026-11-27 attention was left out, 0.74x this count at smollm2-360m's shape), MFU of the stage's forward and
   backward only (no optimizer step, reduction, p2p or bubble) against the device's dense bf16 peak
   (``PEAK_TFLOPS``: H100 SXM / H200 / GH200 989 TFLOP/s, H100 NVL / H200 NVL 835, H100 PCIe 756; unknown device:
   n/a), stage / plain, and peak memory (the stage holds
   k microbatches, the plain model one), host syncs per microbatch (``torch.cuda.set_sync_debug_mode``; the
   calling thread's), and for compiled variants the graphs, graph breaks and their reasons. Why: the executor adds
   a wrapper around every layer, functional_call and versioned leaves; this shows what that costs at real width,
   and what compile and the experts kernel give.
2. **The executor with 2 stages sharing the GPU (gloo)** on moe-10b cut to 2+2 layers, 2BW, Muon + EF, bf16,
   ``num_microbatches=8, extra_warmup=6``: stage 0 holds 8 microbatches in flight, as stage 0 of the real 8-stage
   moe-10b pipeline does (microbatches of 1 x 4096 tokens, the recipe's 2 would not leave room for both stages;
   ``--part2-mbs``). Per stage: ``PipelineEngine.memory_report()`` (with ``track_memory``) and
   ``torch.cuda.max_memory_allocated`` against ``plan_memory(recipe)`` (``plan/memory.py``) term by term
   (weights, gradients, optimizer, EF, activations). Why: the planner decides what fits on GPUs
   (``hf-asyncpp plan``); its activation model was calibrated on CPU only.
3. **Executor overhead per action and host syncs per step** on a 1-stage run of the smollm2-360m shape (layers
   compiled where ``training.torch_compile`` defaults to it, on CUDA). First without the profiler: the step's wall
   time and the share of it the device actions' CUDA event spans cover (the engine's own ``GpuTimer``: is the GPU
   left waiting between actions). Then under ``torch.profiler``: every action is wrapped in a ``record_function``; per action kind the host time against
   the GPU time of the kernels it launched, the loop's own time between actions, the GPU's busy share, and per
   step the ``cudaStreamSynchronize``/``cudaDeviceSynchronize``/``cudaEventSynchronize`` calls, the device-to-host
   copies and the ``aten::_local_scalar_dense`` calls (``.item()``/``float()``, the sources of host syncs), each
   attributed to the action that made it; then one more step under a dispatch mode names the source line of each
   ``.item()``, data-dependent-shape op and device-to-host copy. Why: a GPU pipeline only overlaps if the host
   stays ahead of the device.
4. **The reducer and the compute stream**: the real ``Reducer`` on a 1-rank NCCL group (its collectives are real
   and instant; the data-parallel bucketed all-reduce and the norm's all-reduce both run), a step of compute
   between ``submit`` and ``result`` (the slack 2BW gives a reduction), and ``torch.cuda._sleep`` standing for a
   slow all-reduce: on the reducer's side stream the compute throughput must equal the one without the delay;
   the same delay on the compute stream (what a synchronous collective on the default stream did) lowers it.
   Skipped on CPU (it needs CUDA streams).
5. **F, I and W per layer on the device** (``hf-asyncpp plan recipes/smollm2-360m.yaml --measure``; cpu-tiny on
   CPU): each layer's forward, input-gradient and weight-gradient passes timed apart, and 2BW, 1F1B, ZB-H1 and
   GPipe simulated on those costs. Why: whether ZB-H1's split backward pays where F, I and W cost what a GPU makes
   them cost (on CPU the split costs about what the bubble saves).

``--write`` replaces the ``gpu`` section of docs/benchmarks/gpu.md (device, torch and transformers versions,
command); it refuses a CPU run, whose numbers would replace the GPU ones.
"""
from __future__ import annotations

import argparse
import bisect
import json
import math
import os
import pickle
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch
import torch.distributed as dist

ROOT = Path(__file__).resolve().parent.parent

PARTS = {1: "stage vs plain", 2: "2 stages, memory vs planner", 3: "per-action overhead and host syncs",
         4: "reducer vs compute stream", 5: "F, I and W per layer: the planner's schedules on measured costs"}
# Dense bf16 tensor-core peak TFLOP/s by device name; the first entry whose key the name contains wins, so each
# slower variant comes before the name it contains ("H100 NVL" before "H100", "H200 NVL" before "H200"). NVIDIA's
# H100 and H200 product pages / datasheets give bf16 "with sparsity": H100 SXM 1,979, H100 PCIe 1,513, H100 NVL
# 1,671, H200 SXM 1,979, H200 NVL 1,671, GH200 1,979; dense is half of each. torch's names: "NVIDIA H100 80GB
# HBM3" (SXM), "NVIDIA H100 PCIe", "NVIDIA H100 NVL", "NVIDIA H200", "NVIDIA H200 NVL", "NVIDIA GH200 480GB".
PEAK_TFLOPS = [("H100 PCIe", 756.0), ("H100 NVL", 835.0), ("H200 NVL", 835.0), ("GH200", 989.0), ("H200", 989.0),
               ("H100", 989.0), ("A100", 312.0), ("L40S", 362.0), ("A10G", 125.0), ("L4", 121.0)]
GB = 1e9

TINY_LLAMA = {"model_type": "llama", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
              "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 256, "max_position_embeddings": 64,
              "tie_word_embeddings": True}
TINY_MOE = {"model_type": "qwen3_moe", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
            "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "num_experts": 8,
            "num_experts_per_tok": 2, "moe_intermediate_size": 32, "decoder_sparse_step": 1,
            "output_router_logits": True, "router_aux_loss_coef": 0.001, "vocab_size": 256,
            "max_position_embeddings": 64, "tie_word_embeddings": False}
TRAINING = {"bf16": True, "max_steps": 1000, "warmup_steps": 0, "lr_scheduler_type": "constant", "report_to": [],
            "max_grad_norm": 1.0}


# ---------------------------------------------------------------------------- set-up shared by the parts


def recipe_yaml(name: str) -> dict:
    import yaml

    return yaml.safe_load((ROOT / "recipes" / f"{name}.yaml").read_text())


def inflight(schedule: str, p: int, m: int, extra: int = 0, stage: int = 0) -> int:
    """The most microbatches stage ``stage`` holds between their forward and backward (from its action list)."""
    from hf_asyncpp.schedules.actions import ActionType
    from hf_asyncpp.schedules.records import get_schedule

    cur = peak = 0
    for a in get_schedule(schedule).actions(p, m, 3, extra_warmup=extra)[stage]:
        if a.type == ActionType.F:
            cur += 1
            peak = max(peak, cur)
        elif a.type == ActionType.B:
            cur -= 1
    return peak


def part1_specs(cpu: bool, only: set | None) -> list[dict]:
    """The models part 1 measures. The one call (``default``): the recipe's own first and last stages at its
    shape, the shape a user's GPU runs: stage 0 of smollm2-360m's 4 (its embedding and first layers; the plain side
    is transformers' base model with as many layers, its final norm the only extra) and stage 3 of 4 (its last
    layers, final norm, head and loss, the loss as training computes it: ``training.fused_loss``; the plain side is
    transformers' model with as many layers fed the hidden states, its own head and ``ForCausalLMLoss``), each with
    the microbatches its action list holds in flight. Then, by name or ``--models all``: whole models as one stage
    (moe-2b, moe-10b cut to 4 layers; the whole smollm2-360m only when named)."""
    if cpu:
        k0, k1 = inflight("2bw", 2, 4), inflight("2bw", 2, 4, stage=1)
        specs = [dict(name="tiny llama stage 0 of 2", key="stage0", config=TINY_LLAMA, mbs=2, seq=32, k=k0,
                      k_from="stage 0 of 2, 2bw, m=4", stage=(2, 0), default=True),
                 dict(name="tiny llama stage 1 of 2", key="last", config=TINY_LLAMA, mbs=2, seq=32, k=k1,
                      k_from="stage 1 of 2, 2bw, m=4", stage=(2, 1), fused_loss="auto", default=True),
                 dict(name="tiny llama", key="tiny-llama", config=TINY_LLAMA, mbs=2, seq=32, k=k0,
                      k_from="stage 0 of 2, 2bw, m=4"),
                 dict(name="tiny qwen3_moe", key="tiny-moe", config=TINY_MOE, mbs=2, seq=32, k=k0,
                      k_from="stage 0 of 2, 2bw, m=4")]
    else:
        r = recipe_yaml("smollm2-360m")
        pl, tr = r["pipeline"], r.get("training", {})
        p, m, ew = pl["num_stages"], pl["num_microbatches"], pl.get("extra_warmup", 0)
        ckpt = tr.get("gradient_checkpointing", False)
        specs = []
        for index, key in ((0, "smollm2-360m-stage0"), (p - 1, "smollm2-360m-last")):
            specs.append(dict(name=f"smollm2-360m stage {index} of {p}", key=key, config=dict(r["model"]["config"]),
                              mbs=pl["microbatch_size"], seq=r["data"]["seq_len"],
                              k=inflight(pl["schedule"], p, m, ew, stage=index),
                              k_from=f"stage {index} of smollm2-360m's {p}-stage {pl['schedule']}, m={m}, the recipe's "
                                     f"activation checkpointing {'on' if ckpt else 'off'}",
                              stage=(p, index), checkpointing=ckpt, fused_loss=tr.get("fused_loss", "auto"),
                              default=True))
        for rname, layers in (("smollm2-360m", None), ("moe-2b", 4), ("moe-10b", 4)):
            r = recipe_yaml(rname)
            cfg = dict(r["model"]["config"])
            if layers:
                cfg["num_hidden_layers"] = layers
            pl = r["pipeline"]
            p, m, ew = pl["num_stages"], pl["num_microbatches"], pl.get("extra_warmup", 0)
            specs.append(dict(name=rname + (f" ({layers} layers)" if layers else ""), key=rname, config=cfg,
                              mbs=pl["microbatch_size"], seq=r["data"]["seq_len"], k=inflight(pl["schedule"], p, m, ew),
                              k_from=f"stage 0 of {rname}'s {p}-stage {pl['schedule']}, m={m}",
                              # the whole 32 layers at a halved microbatch: host-bound for the plain model too (the
                              # 2026-11-26 run), so only when named; the recipe's stages are the fair shape
                              optional=rname == "smollm2-360m"))
    if not only:
        return [s for s in specs if s.get("default")]
    if "all" in only:
        return [s for s in specs if not s.get("optional")]
    return [s for s in specs if s["key"] in only or s["name"] in only]


def part2_recipe(cpu: bool, mbs: int | None) -> dict:
    if cpu:
        cfg, seq, opt = dict(TINY_MOE, num_hidden_layers=4), 32, {"name": "muon", "learning_rate": 1e-3,
                                                                    "delay_correction": "error_feedback"}
        pipe = {"num_microbatches": 4, "microbatch_size": mbs or 2, "extra_warmup": 2}
    else:
        r = recipe_yaml("moe-10b")
        cfg, seq, opt = dict(r["model"]["config"], num_hidden_layers=4), r["data"]["seq_len"], r["optimizer"]
        # stage 0 holds 2 + 6 = 8 microbatches, as stage 0 of moe-10b's 8 stages; microbatch 1 x 4096 so that both
        # stages (and the fp32 expert GEMM temporaries) fit on one 80 GB GPU
        pipe = {"num_microbatches": 8, "microbatch_size": mbs or 1, "extra_warmup": 6}
    return {"model": {"config": cfg}, "data": {"seq_len": seq},
            "pipeline": dict(pipe, schedule="2bw", num_stages=2, layers_per_stage=[2, 2], p2p_timeout_s=300.0),
            "optimizer": opt, "training": dict(TRAINING)}


def part3_recipe(cpu: bool) -> dict:
    if cpu:
        cfg, seq, mbs = TINY_LLAMA, 32, 2
    else:
        r = recipe_yaml("smollm2-360m")
        cfg, seq, mbs = r["model"]["config"], r["data"]["seq_len"], 4
    return {"model": {"config": dict(cfg)}, "data": {"seq_len": seq},
            "pipeline": {"schedule": "2bw", "num_stages": 1, "num_microbatches": 4, "microbatch_size": mbs},
            "optimizer": {"name": "muon", "learning_rate": 1e-3, "adamw_lr": 1e-3, "delay_correction": "error_feedback"},
            "training": dict(TRAINING)}


def peak_tflops(name: str) -> float | None:
    """The device's dense bf16 peak (``PEAK_TFLOPS``: the first key its name contains); None if unknown."""
    return next((tf for key, tf in PEAK_TFLOPS if key in name), None)


def device_info(cpu: bool) -> dict:
    import transformers

    info = {"torch": torch.__version__, "transformers": transformers.__version__, "cuda": not cpu}
    if not cpu:
        name = torch.cuda.get_device_name()
        info.update(device=name, capability=".".join(map(str, torch.cuda.get_device_capability())),
                    memory_gb=torch.cuda.get_device_properties(0).total_memory / GB, cuda_version=torch.version.cuda,
                    peak_tflops=peak_tflops(name))
    else:
        info.update(device=f"CPU ({os.cpu_count()} cores)", peak_tflops=None)
    return info


# ---------------------------------------------------------------------------- isolation: each part in processes


def _part(rank: int, world: int, fn_name: str, payload: dict) -> dict:
    """One process of a part (``isolated``): ``fn_name(rank, world, payload)``, its failure as the result's
    ``error``, and what it imported of the modules the GPU image lacks."""
    try:
        res = globals()[fn_name](rank, world, payload)
    except BaseException as e:  # noqa: BLE001 (reported as the part's row)
        res = {"error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()}
    res["absent_on_gpu_image"] = absent_imported()
    return json.loads(json.dumps(res, default=float))  # plain numbers, lists and string keys, as rendered


ABSENT_ON_GPU_IMAGE = ("datasets", "evaluate", "lm_eval")
ABSENT_SEEN: set = set()  # what the parts' processes imported of them (main() reports it)


def absent_imported() -> list[str]:
    """Modules the GPU image lacks that this process has imported (must stay empty: they would fail there)."""
    return sorted(m for m in ABSENT_ON_GPU_IMAGE if m in sys.modules)


def isolated(fn_name: str, payload: dict, world: int = 1, backend: str | None = None, timeout_s: float = 300) -> list[dict]:
    """Run ``fn_name(rank, world, payload)`` in ``world`` fresh processes (``hf_asyncpp.testing.run_workers``), every
    rank on the one GPU (or, on CPU, on no GPU at all); their results, or RuntimeError / TimeoutError (killed after
    ``timeout_s``: a hang guard)."""
    from hf_asyncpp.testing import WorkerError, run_workers

    # every rank on the one GPU (local_device reads LOCAL_RANK); on CPU, no GPU before the first CUDA call, so the
    # executor's local_device() is the CPU
    env = {"LOCAL_RANK": "0", **({"CUDA_VISIBLE_DEVICES": ""} if payload["cpu"] else {})}
    try:
        res = run_workers(_part, world, fn_name, payload, backend=backend, threads=payload["threads"], env=env,
                          device=None if payload["cpu"] else "cuda:0", timeout_s=timeout_s, name=fn_name)
    except WorkerError as e:  # a rank died or failed before its part ran: its error first, for the table's row
        last = next((tb.strip().splitlines()[-1] for tb in e.tracebacks if tb.strip()), str(e.__cause__))
        raise RuntimeError(f"{fn_name}: {last}\n{e}") from None
    ABSENT_SEEN.update(m for x in res for m in x.get("absent_on_gpu_image", []))
    errors = [f"rank {r}: {x['error']}" for r, x in enumerate(res) if "error" in x]
    if errors:
        tb = next((x.get("traceback", "") for x in res if "error" in x), "")
        raise RuntimeError("; ".join(errors) + ("\n" + tb if tb else ""))
    return res


# ---------------------------------------------------------------------------- timing


class Timer:
    """CUDA events on a GPU (one synchronize at the end of the region), ``perf_counter`` on CPU."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"

    def __enter__(self):
        if self.cuda:
            self.start, self.end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            self.start.record()
        else:
            self.t0 = time.perf_counter()
        return self

    def __exit__(self, *exc):
        if self.cuda:
            self.end.record()
            self.end.synchronize()
            self.seconds = self.start.elapsed_time(self.end) / 1e3
        else:
            self.seconds = time.perf_counter() - self.t0


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _reset_peak(device):
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def _peak(device) -> float | None:
    return torch.cuda.max_memory_allocated(device) / GB if device.type == "cuda" else None


def _free(device):
    import gc

    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def _oom(e: BaseException) -> bool:
    return isinstance(e, torch.cuda.OutOfMemoryError) or "out of memory" in str(e).lower()


def host_batches(batch: torch.Tensor, device: torch.device) -> torch.Tensor:
    """The batches on the host, pinned once where a GPU reads them (the executor's data path pins its batches): a
    copy from pageable memory with ``non_blocking=True`` is staged through a bounce buffer and can stall the stream;
    from pinned memory it is an asynchronous DMA. Without CUDA there is nothing to pin for (and torch cannot)."""
    return batch.pin_memory() if device.type == "cuda" else batch


# The SDPA backends a timed region may run: the fused kernels. The math kernel (bmm + softmax, 5-10x slower at 2048
# tokens) is not among them, so a call that only it could serve raises ("No available kernel") instead of running it
# silently. On CPU only the flash kernel (``_scaled_dot_product_flash_attention_for_cpu``) of these exists.
FUSED_SDPA = ("CUDNN_ATTENTION", "FLASH_ATTENTION", "EFFICIENT_ATTENTION")


def fused_attention_only():
    """``torch.nn.attention.sdpa_kernel`` with the fused backends only (``FUSED_SDPA``): the math kernel refused."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    return sdpa_kernel([getattr(SDPBackend, b) for b in FUSED_SDPA])


# aten's SDPA implementations (what the profiler names, eager or called from a compiled graph), most specific first,
# and the CUDA kernels' names that say the same (for a trace read by eye)
SDPA_OPS = (("_scaled_dot_product_flash_attention_for_cpu", "flash (CPU)"),
            ("_scaled_dot_product_cudnn_attention", "cuDNN"), ("_scaled_dot_product_flash_attention", "flash"),
            ("_scaled_dot_product_efficient_attention", "memory-efficient"), ("_efficient_attention", "memory-efficient"),
            ("_flash_attention", "flash"), ("_scaled_dot_product_attention_math", "math"))
SDPA_KERNELS = (("cudnn", "cuDNN"), ("flash_fwd", "flash"), ("flash_bwd", "flash"), ("fmha_cutlass", "memory-efficient"))


def sdpa_backends(names) -> list[str]:
    """The SDPA backends a profile's event names show ran (``SDPA_OPS``, then ``SDPA_KERNELS`` for kernel names
    whose op was not recorded); empty when none did (no attention, or the math kernel decomposed into the graph)."""
    found = []
    for name in names:
        low = name.lower()
        what = next((label for op, label in SDPA_OPS if op in name), None)
        if what is None and ("attention" in low or "sdpa" in low or "fmha" in low):
            what = next((label for key, label in SDPA_KERNELS if key in low), None)
        if what and what not in found:
            found.append(what)
    return found


def sdpa_kernels(fn, device: torch.device) -> str:
    """Which SDPA backend ``fn`` (one round) ran, read from a profile of it under ``fused_attention_only``: the
    backends' names, or a line saying none was seen."""
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with fused_attention_only(), profile(activities=acts) as prof:
        fn()
        _sync(device)
    found = sdpa_backends({e.name for e in prof.events()})
    return ", ".join(found) if found else "no fused attention op seen"


# ---------------------------------------------------------------------------- part 1: a stage vs the plain model


def active_params(model) -> tuple[int, float]:
    """(parameters, active parameters per token): every parameter that multiplies (an untied input embedding is a
    lookup), expert tensors weighted by top-k / experts."""
    cfg = model.config
    experts = getattr(cfg, "num_experts", None) or getattr(cfg, "num_local_experts", None) or getattr(cfg, "n_routed_experts", None)
    k = getattr(cfg, "num_experts_per_tok", None) or 1
    emb = model.get_input_embeddings().weight
    out = model.get_output_embeddings()
    tied = out is not None and out.weight is emb
    total, active = 0, 0.0
    for name, p in model.named_parameters():
        total += p.numel()
        if p is emb and not tied:
            continue
        active += p.numel() * (k / experts if experts and ".experts." in f".{name}." else 1.0)
    return total, active


def attention_flops_per_token(cfg, seq: int) -> float:
    """Attention's score and value FLOPs per token of a training step, ``12 L H Q T`` (torchtitan's
    ``get_num_flop_per_token``: layers, heads, head dim, sequence), which ``6 x active parameters`` leaves out."""
    heads = cfg.num_attention_heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
    return 12.0 * cfg.num_hidden_layers * heads * head_dim * seq


def _experts_dtype_probe(model, run) -> str | None:
    """Which dtype transformers' grouped GEMM got in one forward (and whether its kernel or its fallback ran)."""
    try:
        import transformers.integrations.moe as moe
    except ImportError:
        return None
    seen = set()
    orig = moe._grouped_mm

    def probe(input, weight, offs):
        if not moe._can_use_grouped_mm(input, weight, offs):
            kind = "transformers' fallback op (a GEMM per expert)"
        elif weight.device.type == "cuda" and weight.dtype != torch.bfloat16:
            kind = "torch grouped_mm, not bf16: torch's fallback (offs.cpu(), a GEMM per expert), not the CUTLASS kernel"
        else:
            kind = "torch grouped_mm"
        seen.add((str(input.dtype).removeprefix("torch."), str(weight.dtype).removeprefix("torch."), kind))
        return orig(input, weight, offs)

    moe._grouped_mm = probe
    try:
        with torch.no_grad():
            run()
    finally:
        moe._grouped_mm = orig
    if not seen:
        return None
    return ", ".join(f"experts GEMMs in {w}{f' (input {i} cast to {w})' if i != w else ''}: {kind}"
                     for i, w, kind in sorted(seen))


def _dynamo_counts() -> tuple[int, int, dict]:
    from torch._dynamo.utils import counters

    return (int(counters["stats"].get("unique_graphs", 0)), int(sum(counters["graph_break"].values())),
            dict(counters["graph_break"]))


def _break_reasons(before: dict, after: dict) -> list[str]:
    """The graph-break reasons new since ``before``: their first lines, most frequent first."""
    new = {k: v - before.get(k, 0) for k, v in after.items() if v > before.get(k, 0)}
    out = []
    for k, n in sorted(new.items(), key=lambda kv: -kv[1]):
        lines = [x.strip() for x in k.strip().splitlines() if x.strip()]
        why = next((x.removeprefix("Explanation:").strip() for x in lines if x.startswith("Explanation:")), "")
        why = why.replace("`", "'")
        out.append(f"{n}x {lines[0][:80]}" + (f": {why[:160]}" if why else ""))
    return out


def part1_models(rank: int, world: int, payload: dict) -> dict:
    """Each model of ``payload["specs"]`` in turn (a failure is the model's row)."""
    out = {"rows": [], "notes": [], "default_experts": {}}
    for spec in payload["specs"]:
        try:
            res = part1_model(spec, payload)
        except Exception as e:  # noqa: BLE001
            out["rows"].append({"model": spec["name"], "variant": "-", "error": _short(e)})
            continue
        out["rows"] += res["rows"]
        out["notes"] += [f"{spec['name']}: {n}" for n in res["notes"]]
        if res["default_experts"]:
            out["default_experts"][spec["name"]] = res["default_experts"]
    return out


def part1_model(spec: dict, payload: dict) -> dict:
    """One model: every variant, stage and plain, at the largest microbatch (<= the recipe's) that fits."""
    device = torch.device("cpu") if payload["cpu"] else torch.device("cuda", 0)
    mbs, notes = _fitting_mbs(spec, device), []
    if mbs != spec["mbs"]:
        notes.append(f"microbatch {mbs} x {spec['seq']} (the recipe's {spec['mbs']}: k = {spec['k']} of them would not "
                     "fit, by the planner's activation model x 2)")
    while True:
        try:
            return _part1_measure(spec, mbs, device, payload, notes)
        except Exception as e:  # noqa: BLE001
            if not _oom(e) or mbs == 1:
                raise
            notes.append(f"OOM at microbatch {mbs} x {spec['seq']}; halved")
        mbs //= 2  # out of the except block: the traceback (and the activations its frames hold) is gone
        _free(device)


def _fitting_mbs(spec: dict, device: torch.device) -> int:
    """The recipe's microbatch size, halved until 2 x fp32 weights + one gradient set + k microbatches of activations
    (the planner's values per token x 2 bytes x 2, margin for what it leaves out: fp32 expert GEMMs, the fp32
    logits of the loss) fit in 70% of the device."""
    if device.type != "cuda":
        return spec["mbs"]
    from transformers import AutoConfig, AutoModelForCausalLM

    from hf_asyncpp.model.fused_loss import use_fused_loss
    from hf_asyncpp.plan.memory import activation_bytes_per_token, activation_values_per_token

    kw = dict(spec["config"])
    config = AutoConfig.for_model(kw.pop("model_type"), **kw)
    with torch.device("meta"):
        meta = AutoModelForCausalLM.from_config(config)
    n = sum(p.numel() for p in meta.parameters())
    if spec.get("stage"):  # a pipeline stage: the planner's own figure for it (within 1% of a GPU's, benchmarks §4)
        from hf_asyncpp.partition import partition_model

        p, index = spec["stage"]
        layers = list(partition_model(meta, p, seq_len=spec["seq"])[index].layer_ids)
        last = index == p - 1
        per_token = activation_bytes_per_token(config, layers, last, bool(spec.get("checkpointing")),
                                               fused_loss=last and use_fused_loss(spec.get("fused_loss", "auto"),
                                                                                  meta)) / 4 * 2
        cap = 0.9 * torch.cuda.get_device_properties(device).total_memory
    else:  # a whole model: x 2 for what the planner leaves out (fp32 expert GEMMs, the loss's fp32 logits)
        per_token = activation_values_per_token(config, list(range(config.num_hidden_layers)), last=True) * 2 * 2
        cap = 0.7 * torch.cuda.get_device_properties(device).total_memory
    mbs = spec["mbs"]
    while mbs > 1 and 12 * n + spec["k"] * mbs * spec["seq"] * per_token > cap:  # 2 models, 1 gradient set
        mbs //= 2
    return mbs


def _part1_measure(spec: dict, mbs: int, device: torch.device, payload: dict, notes: list) -> dict:
    t_start = time.perf_counter()
    from torch.func import functional_call
    from torch.nn.utils.stateless import _reparametrize_module

    from hf_asyncpp.config.sections import ModelConfig
    from hf_asyncpp.model.build import autocast
    from hf_asyncpp.model.build import build_model, enable_activation_checkpointing
    from hf_asyncpp.partition import partition_model
    from hf_asyncpp.partition.plan import anatomy, get_module
    from hf_asyncpp.model.build import expert_stacks
    from hf_asyncpp.pipeline.versions import Versions, find_casts
    from hf_asyncpp.model.build import compile_counts, compile_layers
    from hf_asyncpp.model.fused_loss import use_fused_loss

    limit = "recompile_limit" if hasattr(torch._dynamo.config, "recompile_limit") else "cache_size_limit"
    setattr(torch._dynamo.config, limit, max(getattr(torch._dynamo.config, limit), 64))  # one entry per layer wrapper

    def build(layers: int | None = None):  # fp32 masters, as the trainer's
        torch.manual_seed(0)
        config = dict(spec["config"], **({"num_hidden_layers": layers} if layers else {}))
        return build_model(ModelConfig(config=config), device=device).train()

    # Two models with the same weights: the stage's is only ever run as a stage, as in the executor. (A plain forward
    # leaves transformers' output-recorder hooks on the router modules, which a stage shares; under torch.compile
    # their ContextVar.get breaks the graph.) A stage of a pipeline (``spec["stage"]``): the plain model is
    # transformers' base model with the stage's layers, run to its hidden states, the backward from a gradient as
    # the next stage would send it; for a last stage, transformers' model with the stage's layers fed the hidden
    # states (``inputs_embeds``), through its final norm, head and loss
    where = spec.get("stage")
    staged = build()
    if spec.get("checkpointing"):
        enable_activation_checkpointing(staged)  # before partitioning, as PipelineEngine
    # the last stage's loss as training computes it (training.fused_loss, PipelineEngine's use_fused_loss)
    fused = bool(where) and where[1] == where[0] - 1 and use_fused_loss(spec.get("fused_loss", "auto"), staged)
    stage = partition_model(staged, where[0] if where else 1, seq_len=spec["seq"],
                            fused_loss=fused)[where[1] if where else 0]
    first, last = stage.is_first, stage.is_last
    middle = not last  # no loss here: hidden states go on
    model = build(len(stage.layer_ids) if where else None)
    if spec.get("checkpointing"):
        model.gradient_checkpointing_enable()
    cfg, seq, k = model.config, spec["seq"], spec["k"]
    default_experts = getattr(cfg, "_experts_implementation", None)
    is_moe = ".experts." in "".join(f".{n}." for n, _ in model.named_parameters())
    versions = Versions(dict(stage.named_parameters()), lag=1)
    n_total, n_active = active_params(model)  # a last stage: its layers, final norm and head (the plain model's)
    if middle and where:  # what multiplies on a first stage: its layers (the embedding is a lookup, the head is elsewhere)
        n_active = float(sum(t.numel() for t in get_module(model, anatomy(model).layers).parameters()))
    if where:
        n_total = sum(t.numel() for t in stage.parameters())
    tokens = mbs * seq
    g = torch.Generator().manual_seed(1)
    # on the host, as the executor's batches, pinned once outside the timing (the executor's loader pins them), so
    # that the copies with non_blocking=True are asynchronous on both sides
    batch = host_batches(torch.randint(0, cfg.vocab_size, (k, mbs, seq), generator=g), device)
    # a later stage's input: the hidden states the previous stage sends, on the device already (received), fp32 as
    # HF's residual stream is under autocast; the backward computes their gradient, which goes back
    hidden = [] if first else [torch.randn(mbs, seq, cfg.hidden_size, generator=g).to(device).requires_grad_()
                               for _ in range(k)]
    ids_of = lambda i: batch[i].to(device, non_blocking=True)  # noqa: E731
    arg_of = lambda i, ids: ids if first else hidden[i]  # noqa: E731
    labelled = lambda ids: {"labels": ids} if last else None  # noqa: E731
    # training.bf16 as the executor runs it: the weights autocast would cast per microbatch and the expert stacks are
    # held by the version as one bf16 copy (find_casts, Versions.use_bf16, as PipelineEngine._forward); the forward
    # reads them, the gradients reach the fp32 leaves
    ids0 = ids_of(0)
    casts = find_casts(stage, versions.leaves_for(0), arg_of(0, ids0), labelled(ids0))
    versions.use_bf16(casts)
    leaves, compute = versions.leaves_for(0), versions.compute_for(0)
    stacks = len(casts & expert_stacks(stage))
    notes.append(f"built and set up in {time.perf_counter() - t_start:.0f} s (two models, the stage's casts)")
    notes.append(f"the stage holds {len(casts)} of its {len(leaves)} weights as the version's bf16 "
                 f"copies (training.bf16's weight versions{f', {stacks} of them MoE expert stacks' if stacks else ''}), "
                 "the rest read under autocast")
    if last and where:
        notes.append("the stage's loss: " + ("the fused linear cross-entropy (training.fused_loss: "
                                             f"{spec.get('fused_loss', 'auto')})" if fused else
                                             "transformers' head and ForCausalLMLoss")
                     + "; the plain model's: transformers' head and ForCausalLMLoss, fed the same hidden states")
    notes.append(f"host batches pinned: {'yes' if batch.is_pinned() else 'no (no CUDA: nothing to pin for)'}")

    def stage_forward():
        ids = ids_of(0)
        with autocast(True):
            functional_call(stage, compute, (arg_of(0, ids),), labelled(ids), strict=False)

    sent: dict = {}  # the gradients "the next stage" sends back, made once (the executor allocates none per round)

    def from_next(outs: list) -> list:
        if "stage" not in sent:
            sent["stage"] = [torch.randn_like(o) for o in outs]
        return sent["stage"]

    def stage_round():  # as PipelineEngine: k forwards (F), then k backwards (B), the loss / m on the last stage
        roots = []
        with _reparametrize_module(stage, compute, tie_weights=True, strict=False):  # once per version (_bind)
            for i in range(k):
                ids = ids_of(i)
                with autocast(True):
                    out = stage(arg_of(i, ids), **(labelled(ids) or {}))
                outs = [o for o in (out if isinstance(out, (tuple, list)) else (out,))
                        if o.is_floating_point() and o.requires_grad]
                roots.append((outs, from_next(outs)) if middle else ([out / k], None))
            versions.add_in_place.on = True  # no reducer hooks here (one replica)
            try:
                for outs, grads in roots:
                    torch.autograd.backward(outs, grads)
            finally:
                versions.add_in_place.on = False
        for leaf in leaves.values():  # REDUCE takes the gradients away
            leaf.grad = None
        for h in hidden:  # sent back to the previous stage
            h.grad = None

    def plain_call(m, i, ids):
        """The plain model at the stage's place: its base model to the hidden states (a first stage), or from the
        hidden states through its layers, norm, head and transformers' loss (a last stage), or whole."""
        if middle:
            return m.model(input_ids=ids, use_cache=False).last_hidden_state
        if first:
            return m(input_ids=ids, labels=ids, use_cache=False).loss / k
        return m(inputs_embeds=hidden[i], labels=ids, use_cache=False).loss / k

    def plain_round(m=model, cast=True):
        for i in range(k):
            ids = ids_of(i)
            with autocast(cast):
                out = plain_call(m, i, ids)
            if middle:
                sent.setdefault(("plain", out.dtype), torch.randn_like(out))
            out.backward(sent[("plain", out.dtype)] if middle else None)
        m.zero_grad(set_to_none=True)
        for h in hidden:
            h.grad = None

    def plain_forward(m, cast):
        ids = ids_of(0)
        with autocast(cast):
            plain_call(m, 0, ids)

    def host_syncs(fn) -> int | None:
        """Synchronizing CUDA calls in one round, as torch's sync debug mode reports them (the calling thread's)."""
        if device.type != "cuda":
            return None
        import warnings

        with warnings.catch_warnings(record=True) as caught, fused_attention_only():
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                fn()
            finally:
                torch.cuda.set_sync_debug_mode(0)
        return sum("synchroniz" in str(w.message) for w in caught)

    def measure(fn, warmup: int, first_seconds: list | None = None) -> tuple[float, float | None]:
        """tokens/s over the timed rounds and the peak memory; the warm-up's seconds (compile included) appended to
        ``first_seconds``. Every round under ``fused_attention_only``: the math SDPA kernel raises, never runs."""
        with fused_attention_only():
            t0 = time.perf_counter()
            for _ in range(warmup):
                fn()
            _sync(device)
            if first_seconds is not None:
                first_seconds.append(time.perf_counter() - t0)
            _reset_peak(device)
            with Timer(device) as t:
                for _ in range(payload["rounds"]):
                    fn()
        return payload["rounds"] * k * tokens / t.seconds, _peak(device)

    variants = [("eager", None, False)]
    if is_moe:
        variants = [("eager, experts eager", "eager", False), ("eager, experts grouped_mm", "grouped_mm", False)]
    if is_moe:  # contrast, not the executor's path: the plain model with bf16 weights, no autocast
        variants.append(("plain with bf16 weights, experts grouped_mm (contrast)", "grouped_mm", None))
    variants.append(("compiled layers" + (", experts grouped_mm" if is_moe else ""), "grouped_mm" if is_moe else None, True))
    rows, compiled = [], False
    for label, experts, compile_ in variants:
        t0 = time.perf_counter()
        if compile_ is None:
            rows.append(_contrast(model, label, experts, spec, mbs, n_total, n_active, measure, plain_round, plain_forward,
                                  host_syncs))
            rows[-1]["seconds"] = time.perf_counter() - t0
            _note_progress(payload, spec, rows, notes)
            _free(device)
            continue
        row = {"model": spec["name"], "variant": label, "mbs": mbs, "seq": seq, "k": k, "k_from": spec["k_from"],
               "params": n_total, "active": n_active, "attention_flops": attention_flops_per_token(cfg, seq)}
        try:
            if experts is not None:
                _set_experts(model, experts)
                _set_experts(staged, experts)
                if compile_:  # transformers' _can_use_grouped_mm: under dynamo only bf16 weights take torch's op
                    sides = []  # the stage reads its version's expert stacks (bf16), the plain model its own
                    for side, named in (("stage", compute.items()), ("plain", model.named_parameters())):
                        dtype = next((t.dtype for n, t in named if ".experts." in f".{n}." and t.ndim == 3), None)
                        if experts == "grouped_mm" and dtype is not None:
                            sides.append(f"{side}: compiled with {str(dtype).removeprefix('torch.')} expert stacks: "
                                         + ("torch grouped_mm" if dtype == torch.bfloat16 else
                                            "transformers' fallback op (a GEMM per expert)"))
                    if sides:
                        row["experts_note"] = "; ".join(sides)
                else:
                    probes = [(side, _experts_dtype_probe(m, run)) for side, m, run in
                              (("stage", staged, stage_forward), ("plain", model, lambda: plain_forward(model, True)))]
                    if any(p for _, p in probes):
                        row["experts_note"] = "; ".join(f"{side}: {p}" for side, p in probes if p)
            if compile_ and not compiled:  # as training compiles them (training.torch_compile): each decoder layer
                compile_layers(stage.decoder_layers(), payload["compile_backend"])  # the stage's layer wrappers
                compile_layers(get_module(model, stage._a.layers), payload["compile_backend"])
                compiled = True
            best, graphs, reasons = {}, {"stage": [0, 0], "plain": [0, 0]}, {"stage": [], "plain": []}
            warm = {"stage": [], "plain": []}
            fallbacks = compile_counts()["eager_fallbacks"]
            for _ in range(2):  # two interleaved repeats, each side's best
                for side, fn in (("stage", stage_round), ("plain", plain_round)):
                    g0, b0, r0 = _dynamo_counts()
                    tps, peak = measure(fn, 2 if compile_ else 1, warm[side])
                    g1, b1, r1 = _dynamo_counts()
                    graphs[side][0] += g1 - g0
                    graphs[side][1] += b1 - b0
                    reasons[side] += _break_reasons(r0, r1)
                    if tps > best.get(side, (0, None))[0]:
                        best[side] = (tps, peak)
            row.update(stage_tps=best["stage"][0], plain_tps=best["plain"][0], stage_peak_gb=best["stage"][1],
                       plain_peak_gb=best["plain"][1], stage_syncs=host_syncs(stage_round),
                       plain_syncs=host_syncs(plain_round), pinned=bool(batch.is_pinned()),
                       sdpa={"stage": sdpa_kernels(stage_round, device), "plain": sdpa_kernels(plain_round, device)})
            if compile_:
                row["compile"] = (f"{payload['compile_backend']}: stage {graphs['stage'][0]} graphs, "
                                  f"{graphs['stage'][1]} graph breaks; plain {graphs['plain'][0]} graphs, "
                                  f"{graphs['plain'][1]} graph breaks"
                                  + (f"; {compile_counts()['eager_fallbacks'] - fallbacks} functions left eager at "
                                     "the recompile limit" if compile_counts()["eager_fallbacks"] > fallbacks else ""))
                row["breaks"] = {side: r for side, r in reasons.items() if r}
                # the first warm-up (the first 2 rounds) holds the compilation; the second repeat's is warm
                row["compile_s"] = {side: max(0.0, w[0] - (w[1] if len(w) > 1 else 0.0)) for side, w in warm.items()}
        except Exception as e:  # noqa: BLE001
            if _oom(e):
                raise
            row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"
        row["seconds"] = time.perf_counter() - t0
        rows.append(row)
        _note_progress(payload, spec, rows, notes)
        _free(device)
    return {"rows": rows, "notes": notes, "default_experts": default_experts if is_moe else None}


def _contrast(model, label, experts, spec, mbs, n_total, n_active, measure, plain_round, plain_forward,
              host_syncs) -> dict:
    """The plain model with bf16 weights and no autocast: not the executor's path (fp32 masters under autocast)."""
    import copy

    row = {"model": spec["name"], "variant": label, "mbs": mbs, "seq": spec["seq"], "k": spec["k"],
           "k_from": spec["k_from"], "params": n_total, "active": n_active, "plain_only": True,
           "attention_flops": attention_flops_per_token(model.config, spec["seq"])}
    lo = None
    try:
        lo = copy.deepcopy(model).to(torch.bfloat16)
        _set_experts(lo, experts)
        probe = _experts_dtype_probe(lo, lambda: plain_forward(lo, False))
        if probe:
            row["experts_note"] = probe
        tps, peak = max((measure(lambda: plain_round(lo, cast=False), 1) for _ in range(2)), key=lambda x: x[0])
        row.update(plain_tps=tps, plain_peak_gb=peak, plain_syncs=host_syncs(lambda: plain_round(lo, cast=False)))
    except Exception as e:  # noqa: BLE001 (an OOM here is this row's: the executor's variants fitted)
        row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"
    finally:
        del lo
    return row


def _set_experts(model, impl: str) -> None:
    if hasattr(model, "set_experts_implementation"):
        model.set_experts_implementation(impl)
    else:
        model.config._experts_implementation = impl
    if getattr(model.config, "_experts_implementation", impl) != impl:
        raise RuntimeError(f"experts implementation {impl!r} not accepted (got {model.config._experts_implementation!r})")


def run_part1(args, cpu: bool, info: dict) -> dict:
    specs = part1_specs(cpu, set(args.models.split(",")) if args.models else None)
    if not specs:
        raise ValueError(f"--models {args.models}: no such model (smollm2-360m-stage0, smollm2-360m-last, all, "
                         "smollm2-360m, moe-2b, moe-10b)")
    rows, notes = [], []
    for group in ([specs] if cpu else [[s] for s in specs]):  # on a GPU each model in a fresh process
        with tempfile.TemporaryDirectory() as d:
            payload = {"cpu": cpu, "threads": args.threads, "specs": group, "rounds": args.rounds,
                       "compile_backend": args.compile_backend, "progress": os.path.join(d, "rows.pkl")}
            try:
                res = isolated("part1_models", payload, timeout_s=_timeout(args, 1, cpu, None if cpu else group[0]))[0]
                rows += res["rows"]
                notes += res["notes"] + [f"{name}: transformers' default experts implementation here is {impl!r}"
                                         for name, impl in res["default_experts"].items()]
            except Exception as e:  # noqa: BLE001 (a limit or a crash: the rows measured before it are kept)
                done = _progress(payload["progress"])
                rows += done["rows"] + [{"model": s["name"], "variant": "-", "error": _short(e)
                                         + (" (the rows above were measured before it)" if done["rows"] else "")}
                                        for s in group]
                notes += done["notes"]
    return {"rows": rows, "notes": notes}


def _note_progress(payload: dict, spec: dict, rows: list, notes: list) -> None:
    """The rows measured so far, where the parent reads them if the process is stopped (its time limit: a model
    whose build and compile take long keeps its eager rows)."""
    if not payload.get("progress"):
        return
    done = _progress(payload["progress"])
    done["rows"] = [r for r in done["rows"] if r["model"] != spec["name"]] + list(rows)
    done["notes"] = [n for n in done["notes"] if not n.startswith(f"{spec['name']}: ")] + \
        [f"{spec['name']}: {n}" for n in notes]
    tmp = payload["progress"] + ".tmp"
    with open(tmp, "wb") as f:
        pickle.dump(done, f)
    os.replace(tmp, payload["progress"])


def _progress(path: str) -> dict:
    try:
        with open(path, "rb") as f:
            return pickle.load(f)
    except (OSError, EOFError, pickle.UnpicklingError):
        return {"rows": [], "notes": []}


def render_part1(res: dict, info: dict) -> list[str]:
    peak = info.get("peak_tflops")
    out = ["| model | variant | microbatch | k in flight | stage tokens/s | plain tokens/s | stage / plain | "
           "stage TFLOP/s | stage MFU (fwd+bwd only) | plain MFU (fwd+bwd only) | stage peak GB | plain peak GB | "
           "host syncs per microbatch, stage / plain | notes |",
           "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in res["rows"]:
        if "error" in r and "plain_tps" not in r:
            out.append(f"| {r['model']} | {r['variant']} | | | FAILED: {_cell(r['error'])} | | | | | | | | | |")
            continue
        fl = 6 * r["active"] + r.get("attention_flops", 0.0)  # torchtitan's convention: attention counted
        s, p = r.get("stage_tps"), r["plain_tps"]
        mfu = lambda tps: f"{tps * fl / (peak * 1e12):.1%}" if (peak and tps) else "n/a"
        sdpa = r.get("sdpa") or {}
        attn = (f"SDPA {sdpa['stage']}" + (f" (plain {sdpa['plain']})" if sdpa.get("plain") != sdpa["stage"] else "")
                if sdpa.get("stage") else None)
        comp = (f"compile {r['compile_s']['stage']:.0f} s stage, {r['compile_s']['plain']:.0f} s plain"
                if r.get("compile_s") else None)
        note = "; ".join(x for x in (attn, r.get("compile"), comp, r.get("experts_note"), r.get("error")) if x)
        out.append(f"| {r['model']} | {r['variant']} | {r['mbs']} x {r['seq']} | {r['k']} | "
                   f"{_num(s)} | {_num(p)} | {f'{s / p:.3f}' if s else '-'} | "
                   f"{f'{s * fl / 1e12:.1f}' if s else f'({p * fl / 1e12:.1f} plain)'} | {mfu(s) if s else '-'} | {mfu(p)} | "
                   f"{_gb(r.get('stage_peak_gb'))} | {_gb(r.get('plain_peak_gb'))} | "
                   f"{_per(r.get('stage_syncs'), r['k'])} / {_per(r.get('plain_syncs'), r['k'])} | {_cell(note)} |")
    seen = {}
    for r in res["rows"]:
        if "active" in r:
            seen[r["model"]] = (r["params"], r["active"], r["k_from"])
    out += [""] + [f"- {m}: {_count(n)} parameters, {_count(a)} active per token (6 x active x tokens per fwd+bwd); "
                   f"k = {kf}" for m, (n, a, kf) in seen.items()]
    out.append("- MFU: forward + backward of the stage only, in torchtitan's convention (6 x active parameters + "
               "12 L H Q T attention FLOPs per token, over the device's dense bf16 peak); the optimizer step, the "
               "reduction, p2p and the schedule's bubble are outside it. SDPA: the backend the profiler saw run, every "
               "timed round restricted to " + "/".join(FUSED_SDPA) + " (the math kernel would raise). compile: "
               "seconds of the first compiled rounds beyond a warm round's (Dynamo and inductor)")
    secs = [f"{r['model']} / {r['variant']} {r['seconds']:.0f}s" for r in res["rows"] if "seconds" in r]
    if secs:
        out.append("- seconds per variant (build, compile, warm-up and timing): " + ", ".join(secs))
    for r in res["rows"]:
        for side, why in (r.get("breaks") or {}).items():
            out.append(f"- {r['model']}, {r['variant']}, {side}: graph breaks: " + "; ".join(f"`{_cell(x)}`" for x in why))
    for model in dict.fromkeys(r["model"] for r in res["rows"]):  # the MoE target: at least 0.9x the contrast
        stage = next((r.get("stage_tps") for r in res["rows"] if r["model"] == model
                      and r["variant"] == "eager, experts grouped_mm"), None)
        plain16 = next((r.get("plain_tps") for r in res["rows"] if r["model"] == model and r.get("plain_only")), None)
        if stage and plain16:
            out.append(f"- {model}: the stage (eager, experts grouped_mm: bf16 expert stacks) / the plain model with "
                       f"bf16 weights: {stage / plain16:.3f} (target: at least 0.9)")
    out += [f"- {n}" for n in res["notes"]]
    return out


# ---------------------------------------------------------------------------- part 2: 2 stages, memory vs planner


def part2_worker(rank: int, world: int, payload: dict) -> dict:
    from hf_asyncpp.config.recipe import recipe_from_dict
    from hf_asyncpp.model.build import build_model
    from hf_asyncpp.pipeline.executor import PipelineEngine
    from hf_asyncpp.topology import Topology

    r = recipe_from_dict(payload["recipe"])
    device = torch.device("cpu") if payload["cpu"] else torch.device("cuda", 0)
    torch.manual_seed(0)
    model = build_model(r.model)  # on the host, as the trainer does; the engine moves its stage only
    eng = PipelineEngine(r, model, Topology(rank=rank, world_size=world, num_stages=world), log=lambda *a: None)
    del model
    _free(device)
    m, mbs, seq, vocab = r.pipeline.num_microbatches, r.pipeline.microbatch_size, r.data.seq_len, eng.config.vocab_size
    g = torch.Generator().manual_seed(0)
    batches = lambda n: [torch.randint(0, vocab, (m, mbs, seq), generator=g) for _ in range(n)]
    eng.train_steps(batches(2), 0)  # warm-up: fills both 2BW versions
    _sync(device)
    dist.barrier()
    t0 = time.perf_counter()
    n = payload["steps"]
    res = eng.train_steps(batches(n), 2)
    _sync(device)
    dist.barrier()
    wall = time.perf_counter() - t0
    eng.track_memory = True  # after timing (a hook per saved tensor): the bytes the stage really holds
    eng.train_steps(batches(2), 2 + n)
    rep = eng.memory_report()
    out = {"stage": eng.topo.stage, "report": rep, "tokens_per_s": n * m * mbs * seq / wall, "wall": wall,
           "peak_inflight": eng.peak_inflight, "versions": eng.versions.peak,
           "max_allocated": torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None,
           "max_reserved": torch.cuda.max_memory_reserved(device) if device.type == "cuda" else None,
           "rss": _rss(), "losses": [x.loss for x in res if x.loss is not None] if rank == world - 1 else None}
    eng.close()
    if rank == 0:
        from hf_asyncpp.plan.memory import plan_memory
        from hf_asyncpp.plan.vocab import resolve_vocab_parallel

        _, plan, _ = plan_memory(r, vocab_parallel=resolve_vocab_parallel(r)[0])
        out["plan"] = [{"weights": s.weights, "grads": s.grads, "optimizer": s.optimizer, "ef": s.ef,
                        "activations": s.activations, "total": s.total, "inflight": s.inflight, "layers": s.layers,
                        "params": s.params} for s in plan]
    return out


def _rss() -> float:
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def run_part2(args, cpu: bool, info: dict) -> dict:
    recipe = part2_recipe(cpu, args.part2_mbs)
    payload = {"cpu": cpu, "threads": max(1, args.threads // 2), "recipe": recipe, "steps": args.steps}
    res = isolated("part2_worker", payload, world=2, backend="gloo", timeout_s=_timeout(args, 2, cpu))
    plan = res[0]["plan"]
    return {"stages": res, "plan": plan, "recipe": recipe}


def render_part2(res: dict, info: dict) -> list[str]:
    rc = res["recipe"]
    pl, cfg = rc["pipeline"], rc["model"]["config"]
    out = [f"{cfg['model_type']} h{cfg['hidden_size']}, {cfg.get('num_experts', 0)} experts top-"
           f"{cfg.get('num_experts_per_tok', 0)}, layers {pl['layers_per_stage']}, 2bw m = {pl['num_microbatches']}, "
           f"extra_warmup {pl['extra_warmup']}, microbatch {pl['microbatch_size']} x {rc['data']['seq_len']}, "
           f"{rc['optimizer']['name']} + {rc['optimizer'].get('delay_correction', 'none')}, bf16; both stages on "
           f"one device, gloo. Measured (memory_report) against planned (plan_memory):", "",
           "| stage | term | planned GB | measured GB | measured / planned |", "|---|---|---|---|---|"]
    for s, st in enumerate(res["stages"]):
        plan, rep = res["plan"][s], st["report"]
        for term in ("weights", "grads", "optimizer", "ef", "activations", "total"):
            p, m = plan[term], rep[term]
            out.append(f"| {s} | {term} | {p / GB:.3f} | {m / GB:.3f} | {m / p:.2f} |" if p else
                       f"| {s} | {term} | {p / GB:.3f} | {m / GB:.3f} | - |")
        if st["max_allocated"] is not None:
            out.append(f"| {s} | torch.cuda.max_memory_allocated (everything: + temporaries, workspaces) | "
                       f"{plan['total'] / GB:.3f} | {st['max_allocated'] / GB:.3f} | {st['max_allocated'] / plan['total']:.2f} |")
            out.append(f"| {s} | torch.cuda.max_memory_reserved | | {st['max_reserved'] / GB:.3f} | |")
        else:
            out.append(f"| {s} | max_memory_allocated | {plan['total'] / GB:.3f} | n/a (CPU; process peak RSS "
                       f"{st['rss'] / GB:.2f} GB) | |")
    out.append("")
    for s, st in enumerate(res["stages"]):
        out.append(f"- stage {s} (layers {res['plan'][s]['layers']}): {st['peak_inflight']} microbatches in flight "
                   f"(planned {res['plan'][s]['inflight']}), {st['versions']} weight versions, "
                   f"{st['tokens_per_s']:,.0f} tokens/s over the timed steps")
    return out


# ---------------------------------------------------------------------------- part 3: profiler


SYNC_CALLS = {"cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize", "cuStreamSynchronize",
              "cuCtxSynchronize", "cuEventSynchronize"}
GPU_CATS = {"kernel", "gpu_memcpy", "gpu_memset"}


def sync_sources_mode():
    """A dispatch mode naming the code behind each would-be host sync of the calling thread: ``.item()``/``float()``
    (``_local_scalar_dense``), ops whose output size depends on the data, device-to-host copies."""
    from torch.utils._python_dispatch import TorchDispatchMode

    data_dependent = {"aten::nonzero", "aten::masked_select", "aten::_unique2", "aten::unique_consecutive",
                      "aten::repeat_interleave"}
    here = os.path.abspath(__file__)

    class SyncSources(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.found: dict[tuple, int] = {}

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            name, kind = func._schema.name, None
            if name == "aten::_local_scalar_dense":
                kind = f".item() on a {args[0].device.type} tensor"
            elif name in data_dependent:
                kind = f"{name[6:]} (output size from the data) on {args[0].device.type}"
            elif name == "aten::_to_copy" and args[0].device.type == "cuda" and str(kwargs.get("device", "")) == "cpu":
                kind = "copy to the host" + (" (non_blocking)" if kwargs.get("non_blocking") else "")
            elif name == "aten::copy_" and args[1].device.type == "cuda" and args[0].device.type == "cpu":
                kind = "copy_ to the host"
            if kind:
                frames = [f for f in traceback.extract_stack()[:-1]
                          if f"{os.sep}torch{os.sep}" not in f.filename and os.path.abspath(f.filename) != here]
                f = frames[-1] if frames else None
                where = (f"{_rel(f.filename)}:{f.lineno} ({f.name}: {f.line.strip()[:90] if f.line else ''})"
                         if f else "?")
                self.found[(kind, where)] = self.found.get((kind, where), 0) + 1
            return func(*args, **kwargs)

    return SyncSources()


def _rel(path: str) -> str:
    for marker in ("site-packages" + os.sep, str(ROOT) + os.sep):
        if marker in path:
            return path.split(marker, 1)[1]
    return path


def part3_worker(rank: int, world: int, payload: dict) -> dict:
    from torch.profiler import ProfilerActivity, profile, record_function

    from hf_asyncpp.config.recipe import recipe_from_dict
    from hf_asyncpp.model.build import build_model
    from hf_asyncpp.pipeline.executor import PipelineEngine
    from hf_asyncpp.pipeline.gpu_timer import DEVICE_TIMED
    from hf_asyncpp.topology import Topology

    r = recipe_from_dict(payload["recipe"])
    device = torch.device("cpu") if payload["cpu"] else torch.device("cuda", 0)
    torch.manual_seed(0)
    eng = PipelineEngine(r, build_model(r.model), Topology(), log=lambda *a: None)
    for t, h in list(eng._handlers.items()):  # each action in a named range (run() reads the handlers at its start)
        def wrapped(a, w, h=h, name=f"action:{t.value}"):
            with record_function(name):
                h(a, w)
        eng._handlers[t] = wrapped
    m, mbs, seq = r.pipeline.num_microbatches, r.pipeline.microbatch_size, r.data.seq_len
    g = torch.Generator().manual_seed(0)
    batches = lambda n: [torch.randint(0, eng.config.vocab_size, (m, mbs, seq), generator=g) for _ in range(n)]
    eng.train_steps(batches(2), 0)
    _sync(device)
    steps = payload["steps"]
    # unprofiled first (the profiler doubles the host's time per op): the share of the wall time the device actions'
    # CUDA event spans cover (the engine's own GpuTimer), i.e. the GPU is not left waiting between actions
    before = {k: eng.action_seconds[k] for k in DEVICE_TIMED}
    t0 = time.perf_counter()
    eng.train_steps(batches(steps), 2)
    _sync(device)
    wall = time.perf_counter() - t0
    spans = sum(eng.action_seconds[k] - before[k] for k in DEVICE_TIMED)
    first = 2 + steps
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    kw = {}
    try:
        kw["experimental_config"] = torch._C._profiler._ExperimentalConfig(enable_cuda_sync_events=True)
    except (AttributeError, TypeError):
        pass
    with profile(activities=acts, **kw) as prof:
        with record_function("run"):
            eng.train_steps(batches(steps), first)
        _sync(device)  # outside "run": not one of the executor's syncs
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "trace.json")
        prof.export_chrome_trace(path)
        events = json.loads(Path(path).read_text())["traceEvents"]
    res = analyse_trace(events, steps, device.type == "cuda")
    res["unprofiled"] = {"wall_ms_per_step": 1e3 * wall / steps,
                         "event_busy": spans / wall if device.type == "cuda" else None}
    mode = sync_sources_mode()
    with mode:  # one more step, for where the syncs come from (this thread: not autograd's device thread)
        eng.train_steps(batches(1), first + steps)
    res["sources"] = sorted(([n, kind, where] for (kind, where), n in mode.found.items()), key=lambda x: -x[0])
    eng.close()
    return res


def analyse_trace(events: list[dict], steps: int, cuda: bool) -> dict:
    """Per action kind: count, host time, GPU time of the kernels it launched, host syncs; per step: syncs."""
    xs = [e for e in events if e.get("ph") == "X"]
    host = [e for e in xs if e.get("cat") == "user_annotation"]  # (the GPU-side copies are gpu_user_annotation)
    run = max((e for e in host if e.get("name") == "run"), key=lambda e: e.get("dur", 0))
    r0, r1 = run["ts"], run["ts"] + run["dur"]
    actions = sorted((e for e in host if str(e.get("name", "")).startswith("action:") and r0 <= e["ts"] <= r1),
                     key=lambda e: e["ts"])
    starts = [a["ts"] for a in actions]

    def owner(ts):  # the action whose range holds ts (any thread: backward kernels come from autograd's thread)
        i = bisect.bisect_right(starts, ts) - 1
        if i >= 0 and ts <= actions[i]["ts"] + actions[i]["dur"]:
            return actions[i]["name"][7:]
        return "(between actions)"

    kinds: dict[str, dict] = {}
    for a in actions:
        k = kinds.setdefault(a["name"][7:], {"count": 0, "host_us": 0.0, "gpu_us": 0.0, "syncs": 0, "d2h": 0, "item": 0})
        k["count"] += 1
        k["host_us"] += a["dur"]
    launch_owner, rt_syncs, cupti_syncs, d2h, items = {}, {}, {}, {}, {}
    for e in xs:
        if not (r0 <= e["ts"] <= r1):
            continue
        cat, name = e.get("cat", ""), e.get("name", "")
        if cat in ("cuda_runtime", "cuda_driver"):
            corr = (e.get("args") or {}).get("correlation")
            if corr is not None:
                launch_owner[corr] = owner(e["ts"])
            if name in SYNC_CALLS:
                rt_syncs[owner(e["ts"])] = rt_syncs.get(owner(e["ts"]), 0) + 1
        elif cat == "cuda_sync" and "wait" not in name.lower():  # CUPTI's own records of host-blocking syncs
            cupti_syncs[owner(e["ts"])] = cupti_syncs.get(owner(e["ts"]), 0) + 1
        elif cat == "cpu_op" and name in ("aten::_local_scalar_dense",):
            items[owner(e["ts"])] = items.get(owner(e["ts"]), 0) + 1
    # the runtime calls, or CUPTI's records where the runtime calls were filtered out of the trace
    syncs = rt_syncs if sum(rt_syncs.values()) >= sum(cupti_syncs.values()) else cupti_syncs
    busy, gpu_total, last = [], 0.0, r1
    for e in events:
        if e.get("ph") != "X" or e.get("cat") not in GPU_CATS:
            continue
        who = launch_owner.get((e.get("args") or {}).get("correlation"))
        if who is None:  # launched outside the run
            continue
        if who in kinds:
            kinds[who]["gpu_us"] += e["dur"]
        gpu_total += e["dur"]
        busy.append((e["ts"], e["ts"] + e["dur"]))
        last = max(last, e["ts"] + e["dur"])
        if e.get("cat") == "gpu_memcpy" and "DtoH" in e.get("name", ""):
            d2h[who] = d2h.get(who, 0) + 1
    for table, key in ((syncs, "syncs"), (d2h, "d2h"), (items, "item")):
        for who, n in table.items():
            kinds.setdefault(who, {"count": 0, "host_us": 0.0, "gpu_us": 0.0, "syncs": 0, "d2h": 0, "item": 0})[key] += n
    union, end = 0.0, -math.inf
    for a, b in sorted(busy):
        if b > end:
            union += b - max(a, end)
            end = b
    gpu_wall = last - r0  # the run's host time, or until its last kernel ends
    host_in_actions = sum(a["dur"] for a in actions)
    return {"steps": steps, "wall_us": run["dur"], "actions": len(actions), "kinds": kinds,
            "loop_us_per_action": (run["dur"] - host_in_actions) / max(1, len(actions)),
            "gpu_busy": union / gpu_wall if cuda else None, "gpu_us": gpu_total if cuda else None,
            "gpu_wall_us": gpu_wall if cuda else None,
            "syncs_per_step": sum(syncs.values()) / steps, "d2h_per_step": sum(d2h.values()) / steps,
            "item_per_step": sum(items.values()) / steps, "cuda": cuda}


def run_part3(args, cpu: bool, info: dict) -> dict:
    recipe = part3_recipe(cpu)
    payload = {"cpu": cpu, "threads": args.threads, "recipe": recipe, "steps": max(1, args.steps - 1)}
    res = isolated("part3_worker", payload, backend="gloo" if cpu else "nccl", timeout_s=_timeout(args, 3, cpu))[0]
    res["recipe"] = recipe
    return res


def render_part3(res: dict, info: dict) -> list[str]:
    rc = res["recipe"]
    cfg, pl = rc["model"]["config"], rc["pipeline"]
    cuda = res["cuda"]
    out = [f"{cfg['model_type']} h{cfg['hidden_size']} x {cfg['num_hidden_layers']} layers, 1 stage, 2bw m = "
           f"{pl['num_microbatches']}, microbatch {pl['microbatch_size']} x {rc['data']['seq_len']}, muon + EF, bf16; "
           f"{res['steps']} profiled steps, {res['actions']} actions:", "",
           "| action | per step | host ms each | GPU ms each (kernels it launched) | host / GPU | host syncs | D2H copies | "
           ".item()/float() |", "|---|---|---|---|---|---|---|---|"]
    order = ["F", "B", "SEND_ACT", "RECV_ACT", "SEND_GRAD", "RECV_GRAD", "REDUCE", "STEP", "(between actions)"]
    for name in sorted(res["kinds"], key=lambda n: order.index(n) if n in order else 99):
        k = res["kinds"][name]
        c = k["count"]
        host = f"{k['host_us'] / c / 1e3:.3f}" if c else "-"
        gpu = f"{k['gpu_us'] / c / 1e3:.3f}" if (c and cuda) else ("n/a" if not cuda else "-")
        ratio = f"{k['host_us'] / k['gpu_us']:.2f}" if (c and cuda and k["gpu_us"]) else "-"
        out.append(f"| {name} | {c / res['steps']:.1f} | {host} | {gpu} | {ratio} | {k['syncs'] / res['steps']:.1f} | "
                   f"{k['d2h'] / res['steps']:.1f} | {k['item'] / res['steps']:.1f} |")
    out += ["", f"- the executor's loop between actions (dispatch, clock, polls, yields): "
                f"{res['loop_us_per_action']:.1f} us per action",
            f"- per step: {res['syncs_per_step']:.1f} stream/device/event synchronizations, {res['d2h_per_step']:.1f} "
            f"device-to-host copies, {res['item_per_step']:.1f} .item()/float() calls"
            + ("" if cuda else " (CPU: no device, so no synchronization; the .item() calls are where a GPU would sync)")]
    un = res.get("unprofiled")
    if un:
        out.append(f"- without the profiler: {un['wall_ms_per_step']:.1f} ms per step"
                   + (f"; the device actions' CUDA event spans (F, B, STEP: the engine's GpuTimer) cover "
                      f"{un['event_busy']:.1%} of it (the GPU is not left waiting between actions; idle gaps inside an "
                      "action, a host slower than its kernels, are inside the spans: the profiled figure below sees "
                      "them)" if un.get("event_busy") is not None else ""))
    if cuda:
        out.append(f"- GPU busy {res['gpu_busy']:.1%} of the run (from its start to its last kernel's end, "
                   f"{res['gpu_wall_us'] / 1e3 / res['steps']:.1f} ms per step; host {res['wall_us'] / 1e3 / res['steps']:.1f} "
                   "ms per step)")
    if res.get("sources"):
        out += ["", "Where they come from (one step under a dispatch mode, the executor's thread; backward on a GPU runs "
                    "in autograd's device thread and is not seen):", "",
                "| per step | what | where |", "|---|---|---|"]
        out += [f"| {n} | {kind} | `{_cell(where)}` |" for n, kind, where in res["sources"]]
    return out


# ---------------------------------------------------------------------------- part 4: reducer vs compute stream


def part4_worker(rank: int, world: int, payload: dict) -> dict:
    from hf_asyncpp.pipeline.reducer import Reducer
    from hf_asyncpp.topology import Groups, Topology

    device = torch.device("cuda", 0)
    g = dist.new_group([0])  # NCCL, one rank: the collectives are real and take no time
    groups = Groups(dp=g, pipe=g)
    topo = Topology(rank=0, world_size=2, num_stages=2)  # stage 0 of 2, data-parallel size 1: every phase issued
    n, units = payload["n"], payload["units"]
    a = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    c = torch.empty(n, n, device=device, dtype=torch.bfloat16)
    unit = lambda: torch.mm(a, b, out=c)
    grads = {f"w{i}": torch.empty(payload["grad_numel"], device=device) for i in range(payload["grad_tensors"])}
    for _ in range(5):
        unit()
    with Timer(device) as t:
        for _ in range(20):
            unit()
    t_unit = t.seconds / 20
    with Timer(device) as t:
        torch.cuda._sleep(10_000_000)
    cycles_per_s = 10_000_000 / t.seconds
    delay = payload["delay_share"] * units * t_unit
    cycles = int(delay * cycles_per_s)
    out = {"t_unit_ms": t_unit * 1e3, "units": units, "delay_ms": delay * 1e3, "n": n,
           "grad_mb": payload["grad_tensors"] * payload["grad_numel"] * 4 / 1e6, "modes": {}}
    steps, warm = payload["steps"], 2
    for mode in ("none", "side", "compute", "none again"):
        red = Reducer(groups, topo, {}, 120.0, global_norm=True)
        for s in range(steps + warm):
            if s == warm:
                timer = Timer(device).__enter__()
            for i, gr in enumerate(grads.values()):  # the gradients come from the compute stream
                gr.fill_(float(s + i))
            red.submit(s, dict(grads))
            if mode == "side":  # a slow all-reduce: the side stream busy for `delay`
                with torch.cuda.stream(red.side):
                    torch.cuda._sleep(cycles)
            elif mode == "compute":  # a synchronous collective on the compute stream
                torch.cuda._sleep(cycles)
            for _ in range(units):  # the slack 2BW gives: m - p + 1 forward/backward pairs
                unit()
            _, norm = red.result(s)
        timer.__exit__(None, None, None)
        out["modes"][mode] = {"ms_per_step": timer.seconds / steps * 1e3, "side_stream": red.side is not None and
                              red.side != torch.cuda.current_stream(device), "norm": norm}
    return out


def run_part4(args, cpu: bool, info: dict) -> dict:
    if cpu:
        return {"skipped": "needs CUDA streams (the reducer issues on a side stream only on NCCL/CUDA)"}
    payload = {"cpu": False, "threads": args.threads, "n": 8192, "units": 8, "delay_share": 0.5, "steps": 10,
               "grad_tensors": 16, "grad_numel": 4 * 2**20}
    return isolated("part4_worker", payload, backend="nccl", timeout_s=_timeout(args, 4, cpu))[0]


def render_part4(res: dict, info: dict) -> list[str]:
    if "skipped" in res:
        return [f"Skipped: {res['skipped']}."]
    base = res["modes"]["none"]["ms_per_step"]
    unit_flops = 2 * res["n"] ** 3
    out = [f"Per step: gradients ({res['grad_mb']:.0f} MB in 16 tensors) submitted to the reducer, {res['units']} bf16 "
           f"{res['n']}x{res['n']} matmuls ({res['t_unit_ms']:.2f} ms each) on the compute stream, then result() "
           f"(the side stream joined, the norm read). Injected delay: {res['delay_ms']:.1f} ms "
           f"(torch.cuda._sleep), half the compute between submit and result.", "",
           "| delay | ms per step | compute TFLOP/s | vs no delay |", "|---|---|---|---|"]
    labels = {"none": "none", "side": "on the reducer's side stream (a slow all-reduce)",
              "compute": "on the compute stream (a synchronous collective on the default stream)",
              "none again": "none (repeat)"}
    for mode, r in res["modes"].items():
        tf = res["units"] * unit_flops / (r["ms_per_step"] / 1e3) / 1e12
        out.append(f"| {labels[mode]} | {r['ms_per_step']:.2f} | {tf:.0f} | {base / r['ms_per_step']:.3f} |")
    side = res["modes"]["side"]
    out += ["", f"- the reducer used a side stream: {'yes' if side['side_stream'] else 'NO'}; side-stream delay costs "
                f"{side['ms_per_step'] / base - 1:+.1%} per step, the same delay on the compute stream "
                f"{res['modes']['compute']['ms_per_step'] / base - 1:+.1%}"]
    return out


# ---------------------------------------------------------------------------- main


# Seconds a part's processes may run on a GPU; part 1 per model, each model in a process of its own. The one call
# (``DEFAULT_PARTS`` with part 1's default models) must end inside a 10-minute command with room for the start-up
# (imports, the CUDA context: about 20 s) and the render: its limits sum to ``call_budget(...)`` = 400 s, under
# ``CALL_BUDGET_S``. Measured on an H100 (2026-11-26): a smollm2-360m stage model, built, run eager and compiled at
# 16 x 2048, took 60-120 s; moe-10b's build and compile took more than 200 s.
PART1_TIMEOUTS = {"smollm2-360m-stage0": 200.0, "smollm2-360m-last": 200.0, "smollm2-360m": 240.0, "moe-2b": 200.0,
                  "moe-10b": 300.0}
TIMEOUTS = {1: 200.0, 2: 180.0, 3: 120.0, 4: 60.0, 5: 120.0}  # part 1: a model PART1_TIMEOUTS does not name
DEFAULT_PARTS = "1"  # the one call: part 1's default models (part1_specs: the recipe's first and last stage)
CALL_BUDGET_S = 540.0  # what one call's limits may sum to: 9 minutes of a 10-minute command
# the CPU mode's limit per part: a hang guard only, far above the 10-60 s a part takes on a quiet 2-core machine
# (a loaded one took part 1 past the 120 s this used to be, and a test failed on a machine's speed)
CPU_HANG_GUARD_S = 1800.0


def call_budget(parts: list[int], specs: list[dict]) -> float:
    """The seconds a GPU call's processes may take in all: each part's limit, part 1's per model."""
    return sum(sum(PART1_TIMEOUTS.get(s["key"], TIMEOUTS[1]) for s in specs) if part == 1 else TIMEOUTS[part]
               for part in parts)


def _timeout(args, part: int, cpu: bool, spec: dict | None = None) -> float:
    if args.timeout or cpu:
        return args.timeout or CPU_HANG_GUARD_S
    return PART1_TIMEOUTS.get(spec["key"], TIMEOUTS[1]) if spec else TIMEOUTS[part]


# ---------------------------------------------------------------------------- part 5: plan --measure on the device


def part5_worker(rank: int, world: int, payload: dict) -> dict:
    """``hf-asyncpp plan RECIPE --measure --device DEVICE --top 0`` in this process: its printed lines."""
    import contextlib
    import io

    from hf_asyncpp.cli import plan

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        rc = plan.main([payload["recipe"], "--measure", "--device", payload["device"], "--top", "0",
                        "--png", os.path.join(tempfile.gettempdir(), "bench-gpu-part5.png")])
    return {"rc": rc, "text": out.getvalue()}


def run_part5(args, cpu: bool, info: dict) -> dict:
    recipe = str(ROOT / "recipes" / ("cpu-tiny.yaml" if cpu else "smollm2-360m.yaml"))
    payload = {"cpu": cpu, "threads": args.threads, "recipe": recipe, "device": "cpu" if cpu else "cuda"}
    res = isolated("part5_worker", payload, timeout_s=_timeout(args, 5, cpu))[0]
    if res["rc"]:
        raise RuntimeError(f"plan --measure exited {res['rc']}: {res['text'][-400:]}")
    res["recipe"] = os.path.relpath(recipe, ROOT)
    return res


def render_part5(res: dict, info: dict) -> list[str]:
    text = res["text"]
    at = text.find("\nmeasured on")
    return [f"`hf-asyncpp plan {res['recipe']} --measure --top 0` on this device (layer by layer, one at a time, at the "
            "recipe's microbatch; F, B, I and W timed apart, I and W with torch's split backward as the executor's "
            "ZB-H1; the simulated lines use these costs per stage):", "", "```",
            (text[at + 1:] if at >= 0 else text).strip(), "```"]


RUNNERS = {1: run_part1, 2: run_part2, 3: run_part3, 4: run_part4, 5: run_part5}
RENDER = {1: render_part1, 2: render_part2, 3: render_part3, 4: render_part4, 5: render_part5}


def _short(e: BaseException) -> str:
    return f"{type(e).__name__}: {str(e).strip().splitlines()[0][:400] if str(e).strip() else ''}"


def _cell(s: str) -> str:
    return s.replace("|", "/").replace("\n", " ")


def _num(x) -> str:
    return "-" if x is None else f"{x:,.0f}"


def _per(n, k) -> str:
    return "n/a" if n is None else f"{n / k:.1f}"


def _count(n: float) -> str:
    return f"{n / 1e9:.2f}B" if n >= 1e9 else f"{n / 1e6:.1f}M" if n >= 1e5 else f"{n / 1e3:.1f}K"


def _gb(x) -> str:
    return "n/a" if x is None else f"{x:.2f}"


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cpu-tiny", action="store_true", help="tiny models on CPU (automatic without CUDA)")
    ap.add_argument("--parts", default=DEFAULT_PARTS, help="comma-separated (default 1: the one call; the rest: "
                    "--parts 2,3,4,5, and --parts 1 --models moe-2b,moe-10b)")
    ap.add_argument("--models", default=None, help="part 1: comma-separated keys (default smollm2-360m-stage0 and "
                    "smollm2-360m-last, the recipe's first and last stage; moe-2b, moe-10b; all: these four; "
                    "smollm2-360m: the whole model as one stage, only when named)")
    ap.add_argument("--rounds", type=int, default=None, help="part 1: timed rounds of k microbatches (default 5, CPU 2)")
    ap.add_argument("--steps", type=int, default=None, help="parts 2, 3: timed steps (default 3, CPU 2)")
    ap.add_argument("--part2-mbs", type=int, default=None, help="part 2: microbatch size (default: 1 on GPU, 2 on CPU)")
    ap.add_argument("--compile-backend", default=None, help="torch.compile backend (default inductor; CPU aot_eager)")
    ap.add_argument("--threads", type=int, default=None, help="torch threads per process (default: the cores, CPU 1)")
    ap.add_argument("--timeout", type=float, default=None,
                    help="seconds per part's processes (default on a GPU: PART1_TIMEOUTS per part-1 model, TIMEOUTS "
                         "per part; on CPU 1800, a hang guard)")
    ap.add_argument("--write", action="store_true", help="replace the gpu section of docs/benchmarks/gpu.md")
    ap.add_argument("--save", default=None,
                    help="keep the results in this file after each part (a run cut off keeps its finished parts)")
    ap.add_argument("--load", nargs="+", default=None,
                    help="run nothing: render (and with --write record) the parts saved by earlier --save runs")
    return ap.parse_args(argv)


def _saved(paths: list[str]) -> tuple[dict, dict, dict, list]:
    """Merge --save files (later files win per part): results, seconds, device info, the commands that made them."""
    results, seconds, info, commands = {}, {}, {}, []
    for path in paths:
        with open(path, "rb") as f:
            run = pickle.load(f)
        if info and run["info"].get("device") != info.get("device"):
            raise SystemExit(f"{path} was measured on {run['info'].get('device')}, the others on {info.get('device')}")
        for part, res in run["results"].items():
            if part == 1 and "rows" in res and "rows" in results.get(1, {}):  # part 1 run one model at a time
                results[1] = {"rows": results[1]["rows"] + res["rows"], "notes": results[1]["notes"] + res["notes"]}
                seconds[1] += run["seconds"][1]
            else:
                results[part], seconds[part] = res, run["seconds"][part]
        info, commands = run["info"], commands + [run["argv"]]
    return results, seconds, info, commands


def main(argv=None) -> dict:
    """Run the parts; returns {part: result or {"error": ...} or {"skipped": ...}} (bench/check_gpu.py)."""
    args = parse_args(argv)
    if args.load:
        results, seconds, info, commands = _saved(args.load)
        cpu = not info.get("cuda")
        if args.write and cpu:
            raise SystemExit("--write records a GPU run; these saved results are from a CPU run")
        text = render(results, seconds, info, cpu, commands[0] if len(commands) == 1 else None, commands)
        print(text)
        if args.write:
            from .report import write_section

            write_section("gpu", text)
        return {"results": results, "seconds": seconds, "info": info, "text": text, "absent_imported": []}
    cpu = args.cpu_tiny or not torch.cuda.is_available()
    if args.write and cpu:
        raise SystemExit("--write records a GPU run; a CPU run would replace the GPU numbers in docs/benchmarks/gpu.md")
    args.rounds = args.rounds or (2 if cpu else 5)
    args.steps = args.steps or (2 if cpu else 3)
    args.compile_backend = args.compile_backend or ("aot_eager" if cpu else "inductor")
    args.threads = args.threads or (1 if cpu else max(1, os.cpu_count() or 1))
    info = device_info(cpu)
    parts = [int(p) for p in args.parts.split(",") if p.strip()]
    if not cpu and not args.timeout:  # the limits of this call's processes, against one 10-minute command
        budget = call_budget(parts, part1_specs(False, set(args.models.split(",")) if args.models else None)
                             if 1 in parts else [])
        print(f"this call's time limits sum to {budget:.0f} s" + ("" if budget <= CALL_BUDGET_S else
              f", over the {CALL_BUDGET_S:.0f} s one 10-minute command leaves: split it"), flush=True)
    results, seconds = {}, {}
    ABSENT_SEEN.clear()
    for part in parts:
        t0 = time.perf_counter()
        print(f"part {part}: {PARTS[part]} ...", flush=True)
        try:
            results[part] = RUNNERS[part](args, cpu, info)
        except Exception as e:  # noqa: BLE001 (a failed part is a row; the others run)
            results[part] = {"error": _short(e), "detail": str(e)}
            print(f"part {part} FAILED: {e}", file=sys.stderr, flush=True)
        seconds[part] = time.perf_counter() - t0
        if args.save:  # after each part: a run cut off by its caller's time limit keeps what it finished
            with open(args.save, "wb") as f:
                pickle.dump({"results": results, "seconds": seconds, "info": info,
                             "argv": list(argv if argv is not None else sys.argv[1:])}, f)
    # the parts' processes (fresh: what this file imports); a caller's own imports (a test session) are its business
    absent = sorted(ABSENT_SEEN | (set(absent_imported()) if __name__ == "__main__" else set()))
    text = render(results, seconds, info, cpu, argv)
    if absent:
        text += (f"\n\nWARNING: imported {', '.join(absent)}, which the GPU image lacks: the GPU run would fail there.")
    print(text)
    if args.write:
        from .report import write_section

        write_section("gpu", text)
    return {"results": results, "seconds": seconds, "info": info, "text": text, "absent_imported": absent}


def render(results: dict, seconds: dict, info: dict, cpu: bool, argv, runs: list | None = None) -> str:
    """``runs``: the argument lists of the --save runs a --load merges (each part's command)."""
    if runs and len(runs) > 1:
        cmd = "; ".join("python -m bench.gpu " + " ".join(a) for a in runs) + " (each with --save; merged by --load)"
    else:
        cmd = "python -m bench.gpu" + (" " + " ".join(argv if argv is not None else sys.argv[1:])).rstrip()
    peak = f"{info['peak_tflops']:.0f} TFLOP/s dense bf16" if info.get("peak_tflops") else "unknown (MFU n/a)"
    head = [f"## GPU proof ({info['device']}{', tiny models' if cpu else ''})", "",
            f"Command: `{cmd}` ({time.strftime('%Y-%m-%d')}; torch {info['torch']}, transformers {info['transformers']}"
            + (f", CUDA {info.get('cuda_version')}, {info.get('memory_gb', 0):.0f} GB" if info.get("cuda") else "")
            + f"; peak {peak}). What each part measures and why: the docstring of `bench/gpu.py`.", "",
            "| part | what | status | seconds |", "|---|---|---|---|"]
    body = []
    for part, res in sorted(results.items()):
        status = "FAILED: " + _cell(res["error"]) if "error" in res else ("skipped: " + res["skipped"] if "skipped" in res else "ok")
        if part == 1 and "rows" in res and any("error" in r for r in res["rows"]):
            status = f"ok with {sum('error' in r for r in res['rows'])} failed rows"
        head.append(f"| {part} | {PARTS[part]} | {status} | {seconds[part]:.0f} |")
        body += ["", f"### {part}. {PARTS[part]}", ""]
        if "error" in res:
            body.append(f"FAILED: {_cell(res['error'])}")
            continue
        try:
            body += RENDER[part](res, info)
        except Exception as e:  # noqa: BLE001
            body.append(f"(could not render: {_short(e)})")
    return "\n".join(head + body)


if __name__ == "__main__":
    main()
