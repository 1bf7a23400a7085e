"""A run with sharded experts through the real launcher (``accelerate launch``, 2 CPU processes: 1 stage x 2
replicas, ``pipeline.expert_parallel: 2``): it trains, evaluates, saves, exports and checks its export, and its
checkpoint resumes with the experts sharded and with every expert on every replica, onto the same losses."""
from __future__ import annotations

import pytest
import yaml

from support import FIXTURE, launch, losses

QWEN3_MOE = {"model_type": "qwen3_moe", "hidden_size": 32, "intermediate_size": 64, "num_attention_heads": 4,
             "num_key_value_heads": 2, "max_position_embeddings": 64, "num_hidden_layers": 2, "head_dim": 8,
             "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32, "output_router_logits": True,
             "router_aux_loss_coef": 0.02}


def test_a_launched_run_with_sharded_experts_saves_exports_and_resumes(tmp_path):
    out = tmp_path / "run"
    recipe = tmp_path / "moe.yaml"
    recipe.write_text(yaml.safe_dump({
        "model": {"config": QWEN3_MOE, "vocab_size": 320},
        "data": {"train_files": [str(FIXTURE)], "eval_files": [str(FIXTURE)], "seq_len": 32, "eval_blocks": 5},
        "pipeline": {"schedule": "2bw", "num_stages": 1, "num_microbatches": 2, "microbatch_size": 2,
                     "expert_parallel": 2},
        "optimizer": {"name": "muon", "learning_rate": 0.01, "delay_correction": "error_feedback"},
        "training": {"output_dir": str(out), "max_steps": 6, "logging_steps": 1, "save_steps": 3, "report_to": [],
                     "export": True},
    }))
    code, text = launch(recipe)
    assert code == 0, text[-3000:]
    assert "exported" in text and (out / "export" / "config.json").exists(), text[-3000:]
    straight = losses(out)
    assert len(straight) == 6
    for ep in (2, 1):
        again = tmp_path / f"resumed-ep{ep}"
        code, text = launch(recipe, f"--training.output_dir={again}", f"--pipeline.expert_parallel={ep}",
                            f"--training.resume_from_checkpoint={out}/checkpoint-0000003", "--training.export=false")
        assert code == 0, text[-3000:]
        if ep == 2:
            assert losses(again) == straight[3:]
        else:
            assert losses(again) == pytest.approx(straight[3:], rel=1e-5)
