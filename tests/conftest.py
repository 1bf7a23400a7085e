import os
import sys

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("HF_EVALUATE_OFFLINE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# every distributed test (spawned or launched) transfers under NCCL's ordering rule (hf_asyncpp/pipeline/nccl_order.py):
# a post order that would hang on GPUs fails here
os.environ.setdefault("HF_ASYNCPP_P2P", "nccl-order")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import pytest  # noqa: E402
import torch  # noqa: E402
from support import TASK_FILES, task_requests  # noqa: E402

torch.set_num_threads(1)


@pytest.fixture(scope="session")
def folders(tmp_path_factory):
    """Three exported models: one trained on the fixtures' correct answers, one half-trained (step 60: its acc_norm
    picks differ from the old with-delimiter definition on arc_easy, arc_challenge and hellaswag), one untrained."""
    from hf_asyncpp.model.export import export_hf_model
    from hf_asyncpp.data.tokenizer import train_tokenizer
    from transformers import AutoConfig, AutoModelForCausalLM

    root = tmp_path_factory.mktemp("models")
    # each fixture document's prompt and correct continuation, as lm-eval renders them
    texts = ["".join(pairs[label]) for docs in task_requests(TASK_FILES).values() for pairs, label in docs]
    corpus = root / "answers.txt"
    corpus.write_text("\n".join(texts * 3) + "\n")
    tok = train_tokenizer([str(corpus)], 300)
    cfg = AutoConfig.for_model("llama", hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                               num_key_value_heads=2, vocab_size=len(tok), max_position_embeddings=128,
                               eos_token_id=tok.eos_token_id, bos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    torch.manual_seed(0)
    untrained = AutoModelForCausalLM.from_config(cfg)
    trained = AutoModelForCausalLM.from_config(cfg)
    trained.load_state_dict(untrained.state_dict())
    opt = torch.optim.AdamW(trained.parameters(), lr=3e-3)
    enc = [tok(x, add_special_tokens=False)["input_ids"] + [tok.eos_token_id] for x in texts]
    half = None
    for step in range(300):
        if step == 60:
            half = {k: v.clone() for k, v in trained.state_dict().items()}
        batch = [enc[(step * 8 + j) % len(enc)] for j in range(8)]
        w = max(map(len, batch))
        ids = torch.tensor([b + [tok.pad_token_id] * (w - len(b)) for b in batch])
        labels = torch.tensor([b + [-100] * (w - len(b)) for b in batch])
        trained(input_ids=ids, labels=labels).loss.backward()
        opt.step()
        opt.zero_grad()
    out = {}
    for name, sd in (("trained", trained.state_dict()), ("half", half), ("untrained", untrained.state_dict())):
        out[name] = str(export_hf_model(sd, cfg, root / name, tokenizer=tok))
    return out



@pytest.fixture(autouse=True)
def _recipe_warnings_said_afresh():
    """A recipe warning is said once per process (the process that starts the ranks loads the recipe twice); each
    test is a run of its own, so each starts with nothing said."""
    from hf_asyncpp.config import recipe as config

    config._SAID.clear()
    yield


# ---------------------------------------------------------------------------- tiers

TIERS = {
    "unit": ("test_autosplit", "test_bring_your_own", "test_config", "test_data", "test_delay", "test_mixture", "test_evaluation",
             "test_expert_parallel_plan",
             "test_export", "test_failures", "test_fused_loss", "test_layout", "test_model_config", "test_optim", "test_partition",
             "test_partition_sweep", "test_promises", "test_run_lock", "test_schedules", "test_stop_points",
             "test_virtual_stages", "test_vocab_plan"),
    "distributed": ("test_bf16_versions", "test_checkpointing", "test_compiled", "test_expert_parallel_memory",
                    "test_host_overhead", "test_nccl_order",
                    "test_recipes", "test_recv_wait", "test_reducer", "test_runtime", "test_runtime_families",
                    "test_sharding", "test_stage_local", "test_vocab_parallel", "test_zero_bubble", "test_expert_parallel"),
    "e2e": ("test_async_save", "test_cli_inputs", "test_cluster_launch", "test_data_path", "test_downstream", "test_gpu_bench",
            "test_launch", "test_lm_eval_parity", "test_lose_nothing", "test_memory_plan", "test_packaging",
            "test_paper_regime", "test_preflight", "test_reliability", "test_reliability_launch", "test_reliability_rest",
            "test_resume_changes", "test_expert_parallel_launch",
            "test_hangs", "test_honest_outputs", "test_no_damage", "test_readme", "test_safety", "test_stop_signals",
            "test_trainer"),
}
"""Each test file's tier, by what its tests start: ``unit`` starts no process and no training run (pure Python: the
schedules, the recipe, the optimizers, the partitioner; the inner loop, ``pytest -m unit``), ``distributed`` spawns
gloo ranks, ``e2e`` trains (in the test's process or launched), starts a launcher, a subprocess or pip. The README's
test command runs them all."""
TIER_OF = {name: tier for tier, names in TIERS.items() for name in names}


def pytest_configure(config):
    for tier in TIERS:
        config.addinivalue_line("markers", f"{tier}: the {tier} tier (tests/conftest.py TIERS)")


def pytest_ignore_collect(collection_path, config):
    """``-m unit`` (one tier alone) does not even import the other tiers' files: collecting them costs half a minute."""
    tier = TIER_OF.get(collection_path.stem)
    chosen = (config.option.markexpr or "").strip()
    if tier is not None and chosen in TIERS and tier != chosen:
        return True
    return None


def pytest_collection_modifyitems(config, items):
    for item in items:
        name = item.path.stem
        if name not in TIER_OF:
            raise pytest.UsageError(f"{item.path.name} has no tier: add it to TIERS in tests/conftest.py")
        item.add_marker(getattr(pytest.mark, TIER_OF[name]))
