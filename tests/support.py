"""What the test modules share, so that no test module imports another: paths, the tiny models and recipes, the run
helpers (a trainer run's losses, the accelerate launcher), the pipeline-against-single-process harness and the
checkpoint damage helpers. ``dist_utils.py`` (gloo workers) and ``conftest.py`` (fixtures) are the other two."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

from dist_utils import free_port

TASK_DIR = Path(__file__).resolve().parent / "fixtures" / "tasks"
TASK_FILES = {t: str(TASK_DIR / f"{t}.jsonl") for t in ("arc_easy", "arc_challenge", "mmlu", "piqa", "hellaswag")}
"""Local task files in each Hub dataset's record format (tests/test_downstream.py, tests/test_lm_eval_parity.py)."""


def task_requests(task_files: dict[str, str], limit: int | None = None) -> dict[str, list[tuple[list, int]]]:
    """{task: [(the (context, continuation) pairs lm-eval scores for a document, the correct one's index)]}, documents
    in file order (MMLU: subject by subject, as the fixture file is sorted), rendered by lm-eval from its own task
    YAMLs: the texts the test models learn, and the requests the tests score directly."""
    from hf_asyncpp.eval.lm_eval import load_tasks

    out = {}
    for t, f in task_files.items():
        tasks = load_tasks([t], {t: f}, limit).loaded["tasks"]
        out[t] = []
        for name in sorted(tasks):
            task = tasks[name]
            task.build_all_requests(limit=limit, rank=0, world_size=1)
            by_doc = {}
            for inst in sorted(task.instances, key=lambda i: (i.doc_id, i.idx)):
                by_doc.setdefault(inst.doc_id, []).append(tuple(inst.args))
            for doc_id, pairs in sorted(by_doc.items()):
                out[t].append((pairs, int(task.doc_to_target(task.eval_docs[doc_id]))))
    return out

ROOT = Path(__file__).resolve().parent.parent
FIXTURES = ROOT / "tests" / "fixtures"
FIXTURE = FIXTURES / "sotu_slice.jsonl"  # 41 documents of the default corpus (~100 KB)

# ---------------------------------------------------------------------------- tiny models

DIMS = dict(hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
"""The dimensions of the tiny transformers (the layer count, vocabulary and family extras vary with the test)."""


def tiny_llama(layers: int = 2, **extra) -> dict:
    """A tiny llama's config as a recipe's ``model.config``."""
    return {"model_type": "llama", **DIMS, "num_hidden_layers": layers, **extra}


# one family table for the partition, evaluation and stage-builder tests: 4 layers, vocabulary 128
BASE = dict(**DIMS, num_hidden_layers=4, vocab_size=128)
MOE_AUX = dict(output_router_logits=True, router_aux_loss_coef=0.05)
ARCHS = {
    "llama": dict(tie_word_embeddings=True),
    "llama_untied": dict(tie_word_embeddings=False),
    "mistral": dict(sliding_window=8),
    "qwen2": dict(use_sliding_window=True, sliding_window=8, max_window_layers=2),
    "qwen3": dict(head_dim=8, tie_word_embeddings=True),
    "gemma2": dict(head_dim=8, sliding_window=8, final_logit_softcapping=30.0, attn_logit_softcapping=50.0),
    "gemma3_text": dict(head_dim=8, sliding_window=8, sliding_window_pattern=2),
    "phi3": dict(pad_token_id=0, eos_token_id=1, bos_token_id=1),
    "gpt2": dict(n_embd=32, n_layer=4, n_head=4, n_positions=64, bos_token_id=0, eos_token_id=0, resid_pdrop=0.0,
                 embd_pdrop=0.0, attn_pdrop=0.0),
    "olmo2": dict(pad_token_id=0, eos_token_id=1, bos_token_id=1),
    "mixtral": dict(num_local_experts=4, num_experts_per_tok=2, **MOE_AUX),
    "mixtral_tied": dict(num_local_experts=4, num_experts_per_tok=2, tie_word_embeddings=True, **MOE_AUX),
    # layer 0 dense: a first stage with no router still sends (zero) router statistics
    "qwen2_moe": dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=32,
                      mlp_only_layers=[0], **MOE_AUX),
    "qwen3_moe": dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, head_dim=8, **MOE_AUX),
    "olmoe": dict(num_experts=4, num_experts_per_tok=2, bos_token_id=0, eos_token_id=0, pad_token_id=0, **MOE_AUX),
    "deepseek_v3": dict(num_key_value_heads=4, n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                        first_k_dense_replace=1, kv_lora_rank=16, q_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8,
                        v_head_dim=8, n_group=1, topk_group=1, output_router_logits=True),
    "gpt_oss": dict(num_local_experts=4, num_experts_per_tok=2, sliding_window=8, head_dim=8, rope_scaling=None, **MOE_AUX),
    # beyond the list: non-trivial embedding / logit multipliers, an embedding dropout from the pp plan
    "granite": dict(embedding_multiplier=3.0, logits_scaling=4.0, residual_multiplier=0.5, attention_multiplier=0.3),
    "granitemoe": dict(num_local_experts=4, num_experts_per_tok=2, embedding_multiplier=3.0, logits_scaling=4.0, **MOE_AUX),
    "cohere": dict(logit_scale=0.5, pad_token_id=0, bos_token_id=0, eos_token_id=0),
    "gpt_neox": dict(pad_token_id=0, bos_token_id=0, eos_token_id=0),
}
MODEL_TYPE = {"llama_untied": "llama", "mixtral_tied": "mixtral"}


def make_config(arch: str, **overrides):
    """The transformers config of ``ARCHS[arch]`` (tiny: :data:`BASE`)."""
    from transformers import AutoConfig

    kw = {**BASE, **ARCHS[arch], **overrides}
    if arch == "gpt2":
        kw = {k: v for k, v in kw.items() if k in ARCHS["gpt2"] or k == "vocab_size"}
    return AutoConfig.for_model(MODEL_TYPE.get(arch, arch), **kw)


def make_model(arch: str, **overrides):
    """The tiny model of ``ARCHS[arch]``, initialized from seed 0, in float32."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(make_config(arch, **overrides)).float()


# ---------------------------------------------------------------------------- a single-process trainer run


def tiny(out: Path, **overrides) -> dict:
    """The tiny trainer recipe (2-layer llama, the fixture corpus, 6 steps) as a dict; ``section__field=value``
    overrides a field."""
    files = sorted(str(p) for p in FIXTURES.glob("*.jsonl")) or sorted(str(p) for p in FIXTURES.glob("*.txt"))
    assert files, "tests/fixtures holds the corpus slice"
    d = {
        "model": {"config": tiny_llama(2, tie_word_embeddings=True), "vocab_size": 320},
        "data": {"train_files": files, "eval_files": files[:1], "seq_len": 32, "shuffle_buffer": 50, "eval_blocks": 8},
        "pipeline": {"num_microbatches": 2, "microbatch_size": 2},
        "optimizer": {"name": "adamw", "learning_rate": 0.003},
        "training": {"output_dir": str(out), "max_steps": 6, "logging_steps": 2, "save_steps": 3, "report_to": [],
                     "export": False},
    }
    for key, value in overrides.items():
        section, field = key.split("__")
        d.setdefault(section, {})[field] = value
    return d


def recipe_file(tmp_path: Path, out: Path, **overrides) -> str:
    """The tiny recipe (``tiny``) written to a YAML file beside ``out``: what a user's command line reads."""
    path = tmp_path / f"{out.name}.yaml"
    path.write_text(yaml.safe_dump(tiny(out, **overrides)))
    return str(path)


ERROR_TABLE = "HF_ASYNCPP_ERROR_TABLE"
"""A file that :func:`record_errors` appends the ``error:`` lines the tests meet to, when set (``scripts/
error_table.py`` sets it, runs the bad-input tests and writes docs/troubleshooting.md's table from the file)."""


def record_errors(entry: str, code: int, output: str) -> None:
    """Note each ``error:`` line of ``output`` with its exit code, the entry point that printed it and the test that
    met it, when ``ERROR_TABLE`` is set (one JSON line per error line, appended whole: the xdist workers share it)."""
    path = os.environ.get(ERROR_TABLE)
    if not path:
        return
    test = os.environ.get("PYTEST_CURRENT_TEST", "").rsplit(" ", 1)[0]
    for line in output.splitlines():
        if line.startswith("error:"):
            record = json.dumps({"line": line, "code": code, "entry": entry, "test": test}) + "\n"
            fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
            try:
                os.write(fd, record.encode())
            finally:
                os.close(fd)


def run_main(capsys, *argv) -> tuple[int, str]:
    """``hf-asyncpp train ARGV`` in this process (no launcher): its exit code and stderr."""
    from hf_asyncpp.cli.train import main  # support is imported by spawned workers: the CLI only where used

    code = main(list(argv))
    err = capsys.readouterr().err
    record_errors("hf-asyncpp train (one process, no stages started)", code, err)
    return code, err


def train_steps(out: Path) -> list[int]:
    """The steps ``out/metrics.jsonl`` records a training loss for (read as a resume reads it)."""
    from hf_asyncpp.run.reporting import read_metrics  # as run_main: only where used

    return [r["step"] for r in read_metrics(out / "metrics.jsonl") if "loss" in r]


def losses(out: Path) -> list[float]:
    """The training losses a run logged to ``out/metrics.jsonl``, step by step."""
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return [r["loss"] for r in rows if "loss" in r]


# ---------------------------------------------------------------------------- the real launcher


def write_recipe(path: Path, out: Path, **training) -> Path:
    """The pipelined launch recipe (4-layer llama, 2 stages, 2BW + Muon + EF, 8 steps) written to ``path``."""
    recipe = {
        "model": {"config": tiny_llama(4, tie_word_embeddings=True), "vocab_size": 320},
        "data": {"train_files": [str(FIXTURE)], "eval_files": [str(FIXTURE)], "seq_len": 32, "eval_blocks": 4},
        "pipeline": {"schedule": "2bw", "num_stages": 2, "num_microbatches": 2, "microbatch_size": 2},
        "optimizer": {"name": "muon", "learning_rate": 0.01, "delay_correction": "error_feedback"},
        "training": {"output_dir": str(out), "max_steps": 8, "logging_steps": 2, "save_steps": 4, "report_to": [],
                     "export": False, **training},
    }
    path.write_text(yaml.safe_dump(recipe))
    return path


def launch(recipe: Path, *overrides: str, wait=True, procs=2):
    """``accelerate launch scripts/pretrain.py RECIPE OVERRIDES`` on ``procs`` CPU processes: (return code, output),
    or the process when not ``wait``."""
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(ROOT / f"recipes/accelerate/cpu-{procs}proc.yaml"),
           "--main_process_port", str(free_port()), str(ROOT / "scripts/pretrain.py"), str(recipe), *overrides]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_EVALUATE_OFFLINE": "1", "HF_HUB_OFFLINE": "1"}
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    if not wait:
        return proc
    out, _ = proc.communicate(timeout=600)
    return proc.returncode, out


# ---------------------------------------------------------------------------- pipeline against the single-process reference

LLAMA = tiny_llama(4, vocab_size=128, tie_word_embeddings=True)
MIXTRAL = {"model_type": "mixtral", **DIMS, "intermediate_size": 32, "num_hidden_layers": 4, "vocab_size": 128,
           "num_local_experts": 4, "num_experts_per_tok": 2, "output_router_logits": True,
           "router_aux_loss_coef": 0.02, "tie_word_embeddings": False}
LLAMA_UNTIED = {**LLAMA, "tie_word_embeddings": False}
# the router aux loss is a per-batch statistic, so data parallelism (the mean of per-replica aux losses)
# equals the global batch only without it: the data-parallel MoE case turns it off
MIXTRAL_NO_AUX = {**MIXTRAL, "output_router_logits": False}
STEPS, SEQ = 4, 16
# families whose stages carry more than the hidden state (tests/test_runtime_families.py, tests/test_recipes.py):
# Gemma-3n's per-layer embeddings; Zamba's hybrid layers 1 and 3 run one shared block, so with 2 stages each holds a
# copy (as with the tied embeddings)
GEMMA3N = {"model_type": "gemma3n_text", **DIMS, "num_hidden_layers": 4, "head_dim": 8, "vocab_size": 128,
           "vocab_size_per_layer_input": 128, "hidden_size_per_layer_input": 8, "num_kv_shared_layers": 0,
           "sliding_window": 8}
ZAMBA = {"model_type": "zamba", **DIMS, "num_hidden_layers": 4, "num_key_value_heads": 4, "vocab_size": 128,
         "mamba_d_state": 8, "layers_block_type": ["linear_attention", "hybrid"] * 2}


def make_recipe(arch, schedule, stages, m, mbs, opt="adamw", ef=False, delay="0", extra=0, clip=0.5, lam=1.0, start=0,
                vocab=False, checkpointing=False):
    from hf_asyncpp.config.recipe import recipe_from_dict

    return recipe_from_dict({
        "model": {"config": dict(arch)},
        "data": {"seq_len": SEQ},
        "pipeline": {"schedule": schedule, "num_stages": stages, "num_microbatches": m, "microbatch_size": mbs,
                     "extra_warmup": extra, "vocab_parallel": vocab},
        "optimizer": {"name": opt, "learning_rate": 0.01, "delay_correction": "error_feedback" if ef else "none",
                      "simulate_delay": delay, "ns_dtype": "float32", "adam_epsilon": 1e-6, "ef_lambda": lam,
                      "ef_lambda_lr": 0.5, "delay_start_step": start},  # a large lambda step: 8 steps show it
        # float32 Newton-Schulz and a non-tiny Adam epsilon: bf16 rounding and g/sqrt(v) of near-zero gradients
        # would amplify summation-order noise (data-parallel mean vs global batch) past the 1e-5 tolerance
        "training": {"max_steps": 8, "warmup_ratio": 0.25, "max_grad_norm": clip, "report_to": [],
                     "gradient_checkpointing": checkpointing},
    })


def make_batches(n, m, mbs, seed):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 128, (m, mbs, SEQ), generator=g) for _ in range(n)]


def build(recipe):
    from hf_asyncpp.model.build import build_model

    torch.manual_seed(0)
    return build_model(recipe.model)


def reference(recipe, batches):
    """Single-process run with the delay semantics the pipeline must reproduce."""
    from hf_asyncpp.engine import LocalEngine
    from hf_asyncpp.topology import Topology

    eng = LocalEngine(recipe, build(recipe), Topology(), log=lambda *a: None)
    results = eng.train_steps(batches, 0)
    return results, {k: v.cpu().clone() for k, v in eng.full_state_dict().items()}


def pipeline_worker(rank, world, scenarios):
    from hf_asyncpp.topology import Topology
    from hf_asyncpp.pipeline.executor import PipelineEngine

    out = []
    for recipe, replica_batches in scenarios:
        topo = Topology(rank=rank, world_size=world, num_stages=recipe.pipeline.num_stages)
        eng = PipelineEngine(recipe, build(recipe), topo, log=lambda *a: None)
        batches = replica_batches[topo.dp_rank]
        half = len(batches) // 2  # two chunks: the pipeline drains in between, numerics must not notice
        res = eng.train_steps(batches[:half], 0) + eng.train_steps(batches[half:], half)
        sd = eng.full_state_dict()
        out.append((res, sd, eng.versions.peak))
        eng.close()
    return out


def scenario(arch, schedule, stages, m, mbs, opt, ef, dp=1, seed=0, extra=0, clip=0.5, lam=1.0, start=0, vocab=False,
             checkpointing=False):
    """(pipeline recipe, per-replica batches, reference recipe, reference batches): the reference runs the
    schedule's delay semantics on one process and the replicas' batches concatenated. ``vocab``: the pipeline's
    output layer cut over its stages (``pipeline.vocab_parallel``); the reference is the whole model."""
    rec = make_recipe(arch, schedule, stages, m, mbs, opt, ef, extra=extra, clip=clip, lam=lam, start=start,
                      vocab=vocab, checkpointing=checkpointing)
    replica = [make_batches(STEPS, m, mbs, seed + 100 * d) for d in range(dp)]
    delay = {"2bw": "1", "pipedream": "pipedream"}.get(schedule, "0")
    # the learned lambda is one per stage: the reference is told the stages (its lambda groups)
    ref_stages = stages if schedule == "pipedream" or lam == "learned" else 1
    ref_rec = make_recipe(arch, "none", ref_stages, m, mbs * dp, opt, ef, delay, clip=clip, lam=lam, start=start)
    ref_batches = [torch.cat([replica[d][k] for d in range(dp)], dim=1) for k in range(STEPS)]
    return rec, replica, ref_rec, ref_batches


def check_export(sd, recipe, tmp_dir):
    """The merged pipeline weights export to an HF folder whose from_pretrained logits equal the stages' chain."""
    from hf_asyncpp.model.export import export_hf_model

    out = export_hf_model(sd, build(recipe).config, tmp_dir)
    assert_reload_equals_stages(out, recipe, sd)


def assert_reload_equals_stages(folder, recipe, sd):
    """from_pretrained(folder) gives the logits of the trained weights ``sd`` chained through the recipe's stages."""
    from transformers import AutoModelForCausalLM

    from hf_asyncpp.partition import partition_model

    model = build(recipe)
    model.load_state_dict({k: v for k, v in sd.items() if k in model.state_dict()}, strict=False)
    reloaded = AutoModelForCausalLM.from_pretrained(folder).eval()
    stages = partition_model(model.eval(), recipe.pipeline.num_stages)
    ids = torch.randint(0, 128, (2, SEQ))
    with torch.no_grad():
        a = stages[0](ids)
        for st in stages[1:-1]:
            a = st(a)
        torch.testing.assert_close(reloaded(ids).logits, stages[-1](a), rtol=1e-5, atol=1e-5)


def check_against_reference(scenarios, results, tol=1e-5, export_dir=None):
    """Each :func:`scenario`'s pipeline results (losses, lrs, grad norms, weights, versions held) equal its
    single-process reference's."""
    for n, ((rec, _, ref_rec, ref_batches), (res, sd, peak)) in enumerate(zip(scenarios, results)):
        if export_dir is not None and rec.pipeline.schedule in ("2bw", "gpipe"):
            check_export(sd, rec, export_dir / f"export-{n}")
        ref_res, ref_sd = reference(ref_rec, ref_batches)
        name = f"{rec.model.config['model_type']}/tied={rec.model.config.get('tie_word_embeddings')}/{rec.pipeline.schedule}/{rec.optimizer.name}/ef={rec.optimizer.delay_correction}/lam={rec.optimizer.ef_lambda}"
        # after N steps both have applied N updates; step k logs the loss, grad norm and lr of the same batch
        # and the same update in both (a stage-local norm, pipedream without clipping, is not logged)
        assert len(res) == len(ref_res) == STEPS, name
        torch.testing.assert_close(torch.tensor([r.loss for r in res]), torch.tensor([r.loss for r in ref_res]),
                                   rtol=tol, atol=1e-6, msg=name)
        assert [r.lr for r in res] == pytest.approx([r.lr for r in ref_res], rel=1e-12), name
        norms = [(a.grad_norm, b.grad_norm) for a, b in zip(res, ref_res) if a.grad_norm is not None]
        assert len(norms) == (STEPS if rec.training.max_grad_norm or rec.pipeline.schedule != "pipedream" else 0), name
        assert [a for a, _ in norms] == pytest.approx([b for _, b in norms], rel=1e-4), name
        assert [r.applied for r in res] == [r.applied for r in ref_res] == [True] * STEPS, name
        # ef_lambda: learned: the pipeline logs the mean of its stages' lambdas as the reference does
        lams, ref_lams = [r.ef_lambda for r in res], [r.ef_lambda for r in ref_res]
        assert (lams == ref_lams == [None] * STEPS) if ref_lams[0] is None else lams == pytest.approx(ref_lams, rel=1e-6), name
        assert set(sd) >= {k for k in ref_sd if k != "lm_head.weight"}, name
        for k, v in ref_sd.items():
            if k in sd:
                # atol 1e-5 (an update is ~1e-2 here): Adam/Muon turn summation-order noise of near-zero
                # gradients into 1e-6..1e-5 weight noise; a wrong version, lr or delay is 1000x that. On a GPU
                # (CUDA kernels reduce in other orders) one embedding element of 4096 was seen 1.7e-5 off
                torch.testing.assert_close(sd[k], v, rtol=tol, atol=1e-5 if not torch.cuda.is_available() else 5e-5, msg=lambda m, k=k, name=name: f"{name}: {k}: {m}")
        assert peak <= {"2bw": 2, "pipedream": rec.pipeline.num_stages}.get(rec.pipeline.schedule, 1), name


# ---------------------------------------------------------------------------- damaged checkpoints


def flip(path: Path) -> None:
    """Copy 64 bytes from one place of the file to another: the size stays, the structure mostly too."""
    data = bytearray(path.read_bytes())
    n = len(data)
    src, dst = n // 4, n // 2
    width = min(64, n // 4) or 1
    chunk = bytes(data[src:src + width]) if data[src:src + width] != data[dst:dst + width] else bytes(b ^ 0xFF for b in data[dst:dst + width])
    data[dst:dst + width] = chunk
    path.write_bytes(bytes(data))


def truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def assert_each_damage_is_named(good, kinds, tmp_path) -> None:
    """A byte flip and a truncation of each file kind in a copy of ``good``: verification reports exactly that file
    (and says "truncated" only for the truncation)."""
    from hf_asyncpp.storage import checkpoint_io as ckpt

    for kind in kinds:
        for damage in (flip, truncate):
            copy = tmp_path / f"{damage.__name__}-{kind.replace('/', '-')}"
            shutil.copytree(good, copy)
            damage(copy / kind)
            problems = ckpt.verify(copy)
            assert len(problems) == 1 and problems[0].startswith(str(copy / kind)), (kind, damage, problems)
            assert ("truncated" in problems[0]) == (damage is truncate)
