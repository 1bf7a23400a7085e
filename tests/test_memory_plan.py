"""The planner's per-term memory against what the executor's stages really hold (bench/memory.py), for two of the
benchmark's configurations: bf16 with Muon + error feedback on 2BW (bf16 weight versions, no cast per in-flight
microbatch, the EF clone at STEP), and a MoE with activation checkpointing (the layer inputs the checkpoint keeps).

``bench.memory`` is imported as the package module it is (the repository root is on sys.path: tests/conftest.py);
its workers are spawned by ``hf_asyncpp.testing.run_workers``, with no time limit."""
import pytest

from bench.memory import TERMS, agreement, measured, predicted
from hf_asyncpp.cli.plan import main


@pytest.mark.parametrize("name", ["dense-bf16-2bw-muon-ef", "moe-bf16-ckpt-2bw"])
def test_planned_memory_within_10_percent_of_measured(name):
    pred, got = predicted(name), measured(name)
    for p, g in zip(pred, got):
        assert abs(agreement(p, g) - 1) < 0.10, (name, p, g)
        assert got[0]["ef_copy"] == pred[0]["ef_copy"] and all(g[t] >= 0 for t in TERMS)
    if name.startswith("dense-bf16"):
        # the versions hold the linear weights in bf16 beside the fp32 masters: 2 versions cost what 2 fp32 ones did,
        # and no microbatch holds a cast of its own
        assert all(g["casts"] == 0 for g in got)
        assert all(g["weights"] == p["weights"] for p, g in zip(pred, got))


def test_plan_takes_recipe_overrides_after_the_recipe(capsys):
    """`hf-asyncpp plan RECIPE --training.gradient_checkpointing=true` plans that recipe (argparse alone took the
    override for an unknown option); a stray option is still an error."""
    assert main(["recipes/cpu-tiny.yaml", "--top", "0"]) in (0, None)
    plain = capsys.readouterr().out
    assert main(["recipes/cpu-tiny.yaml", "--top", "0", "--training.gradient_checkpointing=true"]) in (0, None)
    checkpointed = capsys.readouterr().out
    assert plain != checkpointed and "fits" in checkpointed
    with pytest.raises(SystemExit):
        main(["recipes/cpu-tiny.yaml", "--bogus"])
