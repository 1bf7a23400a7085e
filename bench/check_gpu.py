"""bench/gpu.py must not rot between GPU runs: its CPU mode runs the same code paths at a tiny size, and every part
must produce its numbers (not only not crash). Part 4 needs CUDA streams: on CPU it must say so, on a GPU it runs.

The bench's own checks, run by pytest as a command (the test suite runs them so: tests/test_gpu_bench.py):

    python -m pytest -q bench/check_gpu.py

No check here judges speed by the clock: a part's time limit is a hang guard only, far above the 10-60 s a part
takes on a quiet 2-core machine (the bench's old 120 s limit on part 1 failed on a loaded machine)."""
import argparse
import math

import pytest
import torch

from bench import gpu

HANG_GUARD_S = 1800  # per part: only a part that hangs reaches it


@pytest.fixture(scope="module")
def tiny():
    return gpu.main(["--cpu-tiny", "--parts", "1,2,3,4,5", "--models", "all", "--timeout", str(HANG_GUARD_S)])


def test_every_part_ran(tiny):
    res = tiny["results"]
    assert set(res) == {1, 2, 3, 4, 5}
    for part in (1, 2, 3, 5):
        assert "error" not in res[part], res[part]
    assert "CUDA" in res[4]["skipped"]


def test_nothing_the_gpu_image_lacks_is_imported(tiny):
    """The GPU machine has torch, transformers and accelerate but not datasets/evaluate: neither this process nor any
    part's process may import them."""
    assert tiny["absent_imported"] == []


def test_part1_stage_vs_plain_rows(tiny):
    rows = tiny["results"][1]["rows"]
    by_model = {}
    for r in rows:
        assert "error" not in r, r
        by_model.setdefault(r["model"], []).append(r)
    assert set(by_model) == {"tiny llama stage 0 of 2", "tiny llama stage 1 of 2", "tiny llama", "tiny qwen3_moe"}
    # the recipe's own stage: a pipeline's first stage, its hidden states go on; what multiplies there is its layer
    # (1 of the 2), not the embedding or the head, and the plain model is the base model with as many layers
    stage0, whole = by_model["tiny llama stage 0 of 2"][0], by_model["tiny llama"][0]
    assert 0.3 * whole["active"] < stage0["active"] < 0.6 * whole["active"], (stage0["active"], whole["active"])
    assert stage0["attention_flops"] == whole["attention_flops"] / 2
    # the last stage: its layer, the final norm and the (tied) head multiply: the whole model's but stage 0's layer
    last = by_model["tiny llama stage 1 of 2"]
    assert last[0]["active"] == whole["active"] - stage0["active"], (last[0]["active"], whole["active"])
    assert last[0]["attention_flops"] == whole["attention_flops"] / 2
    assert {r["variant"] for r in last} == {"eager", "compiled layers"}
    assert last[0]["k"] == gpu.inflight("2bw", 2, 4, stage=1) == 1
    for model, rs in by_model.items():
        measured = [r for r in rs if not r.get("plain_only")]
        assert any("compile" in r for r in measured), f"{model}: no compiled variant"
        for r in measured:
            assert r["stage_tps"] > 0 and r["plain_tps"] > 0
            assert math.isfinite(r["stage_tps"] / r["plain_tps"])
            assert r["k"] == (1 if "stage 1" in model else 2) and r["active"] > 0
            # every timed round ran under the fused-SDPA restriction; the profiler saw CPU's flash kernel on both sides
            assert r["sdpa"] == {"stage": "flash (CPU)", "plain": "flash (CPU)"}, r
            assert r["pinned"] is False  # no CUDA: nothing to pin for (on a GPU: True, host_batches)
            if "compile" in r:
                assert set(r["compile_s"]) == {"stage", "plain"} and min(r["compile_s"].values()) >= 0
    moe = {r["variant"]: r for r in by_model["tiny qwen3_moe"]}
    assert {"eager, experts eager", "eager, experts grouped_mm", "compiled layers, experts grouped_mm"} <= set(moe)
    assert moe["eager, experts grouped_mm"]["active"] < moe["eager, experts grouped_mm"]["params"]  # top-2 of 8 experts
    contrast = [r for r in by_model["tiny qwen3_moe"] if r.get("plain_only")]
    assert contrast and contrast[0]["plain_tps"] > 0 and "bfloat16" in contrast[0]["experts_note"]
    # the stage's versions hold the expert stacks in bf16: its grouped GEMMs are bf16 (the plain model's, fp32 masters
    # under autocast, are not)
    note = moe["eager, experts grouped_mm"]["experts_note"]
    assert "stage: experts GEMMs in bfloat16" in note and "float32: torch grouped_mm" in note.split("plain:")[1], note
    assert "stage: compiled with bfloat16 expert stacks" in moe["compiled layers, experts grouped_mm"]["experts_note"]


def test_part1_last_stage_runs_the_training_loss_path(tiny):
    """The last stage computes its loss as training does (training.fused_loss: auto: the fused loss for Llama), the
    plain model its own head and ForCausalLMLoss from the same hidden states; the host batches' pinning is noted."""
    notes = tiny["results"][1]["notes"]
    assert any(n.startswith("tiny llama stage 1 of 2: the stage's loss: the fused linear cross-entropy") for n in notes)
    assert "tiny llama stage 1 of 2: host batches pinned: no (no CUDA: nothing to pin for)" in notes
    assert "SDPA flash (CPU)" in tiny["text"] and "MFU (fwd+bwd only)" in tiny["text"]


def test_the_one_gpu_call_fits_its_budget():
    """``python -m bench.gpu`` with its defaults is the one GPU call: the recipe's first and last stage at its 16 x
    2048, part 1 only, its processes' limits well under the 540 s that one 10-minute command leaves. The rest of the
    bench splits into calls that fit too."""
    args = gpu.parse_args([])
    parts = [int(p) for p in args.parts.split(",")]
    specs = gpu.part1_specs(False, None)
    assert parts == [1] and args.models is None
    assert [s["key"] for s in specs] == ["smollm2-360m-stage0", "smollm2-360m-last"]
    assert [s["stage"] for s in specs] == [(4, 0), (4, 3)] and {(s["mbs"], s["seq"]) for s in specs} == {(16, 2048)}
    assert specs[1]["fused_loss"] == "auto" and specs[1]["k"] < specs[0]["k"]
    budget = gpu.call_budget(parts, specs)
    assert budget == 400 and budget <= gpu.CALL_BUDGET_S - 120, budget
    assert gpu.call_budget([2, 3, 4, 5], []) <= gpu.CALL_BUDGET_S
    assert gpu.call_budget([1], gpu.part1_specs(False, {"moe-2b", "moe-10b"})) <= gpu.CALL_BUDGET_S


def test_peak_table_matches_the_slower_variants_first():
    names = {"NVIDIA H100 80GB HBM3": 989.0, "NVIDIA H100 PCIe": 756.0, "NVIDIA H100 NVL": 835.0, "NVIDIA H200": 989.0,
             "NVIDIA H200 NVL": 835.0, "NVIDIA GH200 480GB": 989.0, "NVIDIA A100-SXM4-80GB": 312.0, "Unknown": None}
    assert {n: gpu.peak_tflops(n) for n in names} == names


def test_the_math_attention_kernel_is_refused():
    """Inside the bench's timed region a call only the math kernel serves raises; the fused ones run. Backends are
    read off profiler names (aten ops, or CUDA kernel names)."""
    import torch.nn.functional as F

    q = torch.randn(1, 2, 8, 16)
    with gpu.fused_attention_only():
        assert not torch.backends.cuda.math_sdp_enabled()
        F.scaled_dot_product_attention(q, q, q, is_causal=True)  # CPU's flash kernel
        with pytest.raises(RuntimeError):  # value head dim != query's: only the math kernel takes it
            F.scaled_dot_product_attention(q, q, torch.randn(1, 2, 8, 24), is_causal=True)
    assert torch.backends.cuda.math_sdp_enabled()  # restored after
    assert gpu.sdpa_backends(["aten::_scaled_dot_product_cudnn_attention",
                              "cudnn_generated_fort_native_sdpa_sm90_flash_fprop_wgmma_f16_knob_3"]) == ["cuDNN"]
    assert gpu.sdpa_backends(["aten::_scaled_dot_product_flash_attention_backward",
                              "void pytorch_flash::flash_fwd_kernel<Flash_fwd_kernel_traits<64>>"]) == ["flash"]
    assert gpu.sdpa_backends(["fmha_cutlassF_bf16_aligned_64x64_rf_sm80"]) == ["memory-efficient"]
    assert gpu.sdpa_backends(["aten::bmm", "aten::_softmax", "aten::mm"]) == []


def test_part2_memory_rows_for_both_stages(tiny):
    res = tiny["results"][2]
    assert [s["stage"] for s in res["stages"]] == [0, 1]
    assert len(res["plan"]) == 2
    for s, st in enumerate(res["stages"]):
        rep, plan = st["report"], res["plan"][s]
        for term in ("weights", "grads", "optimizer", "ef", "activations", "total"):
            assert rep[term] > 0 and plan[term] > 0, (s, term)
            assert math.isfinite(rep[term] / plan[term])
        assert st["tokens_per_s"] > 0
    assert res["stages"][0]["peak_inflight"] == res["plan"][0]["inflight"] == 4  # m=4, extra_warmup=2 at p=2
    assert "| 1 | activations |" in tiny["text"]


def test_part3_per_action_overhead(tiny):
    res = tiny["results"][3]
    kinds = res["kinds"]
    for a in ("F", "B", "REDUCE", "STEP"):
        assert kinds[a]["count"] > 0 and kinds[a]["host_us"] > 0, a
    assert kinds["F"]["count"] == kinds["B"]["count"] == 4 * res["steps"]
    assert math.isfinite(res["loop_us_per_action"]) and res["loop_us_per_action"] >= 0
    # no code of the stage's reads a value back (where a GPU would sync, the dispatch mode names it): not the mask
    # probe, the grad norm, the optimizer or the report. The profiler's count may hold reads inside a kernel: on CPU
    # torch's fused AdamW reads its step counters from host memory (on CUDA it reads them on the device)
    assert res["sources"] == [], res["sources"]
    assert res["item_per_step"] >= 0
    # the unprofiled steps: their wall time; the event spans' share needs CUDA (None on CPU)
    assert res["unprofiled"]["wall_ms_per_step"] > 0 and res["unprofiled"]["event_busy"] is None


def test_part5_plan_measures_f_i_w_on_the_device(tiny):
    text = tiny["results"][5]["text"]
    assert "measured on cpu" in text and " zbh1:" in text and " I [" in text and " W [" in text, text[-2000:]


def test_report_names_every_part(tiny):
    text = tiny["text"]
    for part, what in gpu.PARTS.items():
        assert f"### {part}. {what}" in text
    assert "FAILED" not in text


def test_a_failing_part_is_a_row_and_the_rest_run(monkeypatch):
    def boom(args, cpu, info):
        raise RuntimeError("injected")

    monkeypatch.setitem(gpu.RUNNERS, 1, boom)
    monkeypatch.setitem(gpu.RUNNERS, 4, lambda args, cpu, info: {"skipped": "not here"})
    out = gpu.main(["--cpu-tiny", "--parts", "1,4"])
    assert out["results"][1]["error"] == "RuntimeError: injected"
    assert out["results"][4] == {"skipped": "not here"}
    assert "| 1 | stage vs plain | FAILED: RuntimeError: injected |" in out["text"]


def test_part1_keeps_the_rows_measured_before_its_limit(monkeypatch):
    """A model's process stopped by its time limit (moe-10b's build and compile once took all of its 200 s) keeps
    the rows it had measured, then says why the rest is missing."""
    def stopped(fn_name, payload, **kwargs):
        spec = payload["specs"][0]
        gpu._note_progress(payload, spec, [{"model": spec["name"], "variant": "eager", "stage_tps": 1.0}], ["built"])
        raise TimeoutError(f"{fn_name}: no result after 200s (killed)")

    monkeypatch.setattr(gpu, "isolated", stopped)
    args = argparse.Namespace(models=None, threads=1, rounds=1, compile_backend="aot_eager", timeout=None)
    res = gpu.run_part1(args, True, {})
    specs = gpu.part1_specs(True, None)
    first = specs[0]["name"]
    assert res["rows"][0] == {"model": first, "variant": "eager", "stage_tps": 1.0}
    assert all("no result after 200s" in r["error"] for r in res["rows"][1:]) and len(res["rows"]) == 1 + len(specs)
    assert "the rows above were measured before it" in res["rows"][1]["error"] and res["notes"] == [f"{first}: built"]


def test_write_refuses_a_cpu_run():
    with pytest.raises(SystemExit, match="GPU run"):
        gpu.main(["--cpu-tiny", "--write"])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA streams")
def test_part4_reducer_keeps_the_compute_stream_free():
    res = gpu.main(["--parts", "4"])["results"][4]
    assert "error" not in res, res
    modes = res["modes"]
    assert modes["side"]["side_stream"]
    assert modes["side"]["ms_per_step"] < 1.1 * modes["none"]["ms_per_step"]
    assert modes["compute"]["ms_per_step"] > 1.2 * modes["none"]["ms_per_step"]


def test_trace_analysis_of_a_cuda_trace():
    """The GPU branch of part 3 without a GPU: kernels are attributed to the action that launched them (whatever
    thread launched them), host syncs and device-to-host copies to the action that made them."""
    X = lambda cat, name, ts, dur, tid=1, corr=None: {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur,
                                                       "tid": tid, **({"args": {"correlation": corr}} if corr else {})}
    events = [
        X("user_annotation", "run", 0, 1000),
        X("gpu_user_annotation", "run", 5, 2000, tid=7),  # the GPU-side copy must not be taken for the run
        X("user_annotation", "action:F", 10, 100), X("user_annotation", "action:B", 200, 300),
        X("user_annotation", "action:STEP", 600, 200),
        X("cuda_runtime", "cudaLaunchKernel", 20, 5, corr=1), X("kernel", "gemm", 30, 400, tid=7, corr=1),
        X("cuda_runtime", "cudaLaunchKernel", 250, 5, tid=2, corr=2),  # backward: autograd's thread
        X("kernel", "gemm_bwd", 430, 500, tid=7, corr=2),
        X("cuda_runtime", "cudaMemcpyAsync", 650, 5, corr=3), X("gpu_memcpy", "Memcpy DtoH (Device -> Pageable)", 940, 2,
                                                                   tid=7, corr=3),
        X("cuda_runtime", "cudaStreamSynchronize", 656, 290), X("cpu_op", "aten::_local_scalar_dense", 650, 300),
        X("cuda_runtime", "cudaLaunchKernel", 1500, 5, corr=4), X("kernel", "after", 1600, 10, tid=7, corr=4),
    ]
    res = gpu.analyse_trace(events, steps=1, cuda=True)
    k = res["kinds"]
    assert (k["F"]["gpu_us"], k["B"]["gpu_us"], k["STEP"]["gpu_us"]) == (400, 500, 2)
    assert (k["STEP"]["syncs"], k["STEP"]["d2h"], k["STEP"]["item"]) == (1, 1, 1)
    assert k["F"]["syncs"] == k["B"]["syncs"] == 0
    assert res["syncs_per_step"] == res["d2h_per_step"] == 1
    assert res["loop_us_per_action"] == pytest.approx((1000 - 600) / 3)
    assert res["gpu_wall_us"] == 1000 and res["gpu_busy"] == pytest.approx((930 - 30 + 2) / 1000)  # "after" is outside
    res.update(recipe=gpu.part3_recipe(True), sources=[[2, ".item() on a cuda tensor", "x.py:1 (f: y)"]])
    text = "\n".join(gpu.render_part3(res, {}))
    assert "| STEP | 1.0 | 0.200 | 0.002 | 100.00 | 1.0 | 1.0 | 1.0 |" in text and "GPU busy 90.2%" in text


def test_gpu_results_render():
    """The GPU-only columns (MFU, CUDA peak memory, part 4) render from results shaped as a GPU run makes them."""
    info = {"device": "NVIDIA H100 80GB HBM3", "torch": "2.x", "transformers": "5.x", "cuda": True, "peak_tflops": 989.0,
            "cuda_version": "12.8", "memory_gb": 85.0}
    row = {"model": "m", "variant": "eager", "mbs": 2, "seq": 2048, "k": 4, "k_from": "x", "params": 362e6,
           "active": 362e6, "stage_tps": 1e5, "plain_tps": 1.05e5, "stage_peak_gb": 40.0, "plain_peak_gb": 12.0,
           "stage_syncs": 8, "plain_syncs": 4, "seconds": 3.0}
    p1 = "\n".join(gpu.render_part1({"rows": [row], "notes": []}, info))
    assert "| 217.2 | 22.0% | 23.1% |" in p1 and "| 2.0 / 1.0 |" in p1  # 6 x 362M x 1e5 / 989e12; syncs per microbatch
    rep = {"weights": 2e9, "grads": 2e9, "optimizer": 1e9, "ef": 1e9, "activations": 4e9, "total": 10e9}
    plan = dict(rep, activations=2e9, total=8e9, inflight=8, layers="0-1", params=5e8)
    stages = [{"stage": s, "report": rep, "tokens_per_s": 1e4, "peak_inflight": 8, "versions": 2, "max_allocated": 12e9,
               "max_reserved": 14e9, "rss": 1e9} for s in (0, 1)]
    p2 = "\n".join(gpu.render_part2({"stages": stages, "plan": [plan, plan], "recipe": gpu.part2_recipe(False, None)}, info))
    assert "| 0 | activations | 2.000 | 4.000 | 2.00 |" in p2 and "max_memory_allocated" in p2 and "| 1.50 |" in p2
    modes = {m: {"ms_per_step": t, "side_stream": True, "norm": 1.0}
             for m, t in (("none", 20.0), ("side", 20.2), ("compute", 30.0), ("none again", 20.1))}
    p4 = "\n".join(gpu.render_part4({"t_unit_ms": 2.5, "units": 8, "delay_ms": 10.0, "n": 8192, "grad_mb": 268.0,
                                     "modes": modes}, info))
    assert "| 0.990 |" in p4 and "| 0.667 |" in p4 and "side stream: yes" in p4
    row16 = dict(row, variant="compiled layers", sdpa={"stage": "cuDNN", "plain": "flash"},
                 compile_s={"stage": 41.0, "plain": 30.0})
    p1 = "\n".join(gpu.render_part1({"rows": [row16], "notes": []}, dict(info, peak_tflops=gpu.peak_tflops("NVIDIA H200 NVL"))))
    assert "SDPA cuDNN (plain flash)" in p1 and "compile 41 s stage, 30 s plain" in p1
    assert "| 217.2 | 26.0% | 27.3% |" in p1  # 6 x 362M x 1e5 over 835 TFLOP/s, an H200 NVL's, not 989
    text = gpu.render({1: {"rows": [row], "notes": []}}, {1: 5.0}, info, False, ["--write"])
    assert "## GPU proof (NVIDIA H100 80GB HBM3)" in text and "`python -m bench.gpu --write`" in text
