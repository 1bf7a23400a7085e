"""What each of p = 4 ranks reads and holds at start and at resume (CPU, one process per rank, one at a time).

Per rank, in a fresh process, each peak RSS (``VmHWM``, reset through ``/proc/self/clear_refs``) reported above the
RSS the process held right before. **start**: the full build as the trainer does today (the seeded fp32 model on
every rank, then partitioned, its stage kept), and the stage-local start from a ``save_pretrained`` folder
(``modeling.meta_model``, partitioned, ``load_stage_pretrained`` reading only the stage's tensors by name).
**resume**: ``stage_state.load_stage`` into the stage from a 4-stage checkpoint (the same split), from a 2-stage one
(another split, read by name), and, for comparison, as ``load_stage`` did before it read by name: every stage's
files read whole and held together, then the same restore. A resume's peak includes what the stage keeps after
the load (Adam's two moments, the EF buffers and 2BW's older version: about 4x its tensors). Bytes are counted at
the checkpoint read edge (``checkpoint.bytes_read``).

    python -m bench.stage_local [--hidden 512] [--layers 8] [--vocab 32000] [--write]
"""
from __future__ import annotations

import argparse
import gc
import multiprocessing as mp
import tempfile
import time
from pathlib import Path

import torch

from hf_asyncpp.storage import checkpoint_io as ckpt
from hf_asyncpp.optim.ef import KEY as EF_KEY, ef_state_by_name, ef_state_from_names, install_error_feedback
from hf_asyncpp.config.sections import ModelConfig
from hf_asyncpp.model.build import load_stage_pretrained, materialise_stage, meta_model
from hf_asyncpp.partition import partition_model
from hf_asyncpp.pipeline import stage_state
from hf_asyncpp.pipeline.versions import Versions
from hf_asyncpp.storage.names import optimizer_of, stage_weight_files, versions_of

P = 4
MB = 1 << 20


def config(args):
    from transformers import AutoConfig

    return AutoConfig.for_model("llama", hidden_size=args.hidden, intermediate_size=args.hidden * 8 // 3,
                                num_hidden_layers=args.layers, num_attention_heads=8, num_key_value_heads=4,
                                vocab_size=args.vocab, max_position_embeddings=512, tie_word_embeddings=False)


def model_config(args) -> ModelConfig:
    cfg = {k: v for k, v in config(args).to_dict().items() if not k.startswith("_") and k not in (
        "transformers_version", "architectures", "dtype", "torch_dtype")}
    return ModelConfig(config=cfg)


def full_model(args):
    """The whole-model start (the trainer's fallback, and its start before stage-local random init): the seeded full
    fp32 build on every rank."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config(args), dtype=torch.float32)


def parts(stage):
    """AdamW + Error Feedback, a scheduler, and 2BW's versions (lag 1)."""
    opt = install_error_feedback(torch.optim.AdamW(stage.parameters(), lr=1e-3), 0.5)
    return opt, torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0), Versions(dict(stage.named_parameters()), 1)


def write_checkpoint(args, p: int, folder: Path) -> None:
    """A p-stage checkpoint after one step: weights, an older version and optimizer state (moments, EF) per stage."""
    folder.mkdir(parents=True)
    for i, stage in enumerate(partition_model(full_model(args), p, seq_len=64)):
        opt, sched, versions = parts(stage)
        for prm in stage.parameters():
            prm.grad = torch.randn_like(prm) * 1e-3
        opt.step()
        versions.buffers[0] = {n: t.detach().clone() for n, t in stage.named_parameters()}
        versions.latest = 1
        stage_state.save_stage(folder, i, stage, opt, sched, versions, {"nonfinite_skipped": 0})


def status(field: str) -> int:
    """``VmHWM`` / ``VmRSS`` of this process, bytes."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise KeyError(field)


def load_every_file(path: Path, stage, optimizer, scheduler, versions) -> None:
    """``stage_state.load_stage`` as it was before it read by name: every stage's weights, versions and optimizer
    file read whole and held together, then this stage's part taken (the same restore as today's)."""
    weights, older, by_name, ef_by_name = {}, {}, {}, {}
    for f in stage_weight_files(path):
        weights.update(ckpt.load_tensors(f))
        if versions_of(f).exists():
            older.update(ckpt.load_tensors(versions_of(f)))
        meta = ckpt.load_state(optimizer_of(f))
        osd, names = meta["optimizer"], meta["param_names"]
        by_name.update({n: osd["state"][i] for i, n in enumerate(names) if i in osd["state"]})
        ef_by_name.update(ef_state_by_name(osd, names))
    stage.load_state_dict({k: weights[k] for k in stage.state_dict()}, strict=True)
    sd, names = optimizer.state_dict(), stage_state.param_names(stage, optimizer)
    sd["state"] = {i: by_name[n] for i, n in enumerate(names) if n in by_name}
    sd[EF_KEY] = ef_state_from_names(ef_by_name, names)
    optimizer.load_state_dict(sd)
    params = dict(stage.named_parameters())
    versions.load(meta["latest_version"], {k: t for k, t in older.items() if k.split("/", 1)[1] in params})


def rank(args, r: int, same: str, other: str, pretrained: str, queue) -> None:
    torch.set_num_threads(1)
    meta_model(ModelConfig(name_or_path=pretrained))  # imports the model's code: not counted as the build's
    base = status("VmRSS")
    Path("/proc/self/clear_refs").write_text("5")
    ckpt.bytes_read(reset=True)
    local = partition_model(meta_model(ModelConfig(name_or_path=pretrained)), P, seq_len=64)[r]
    load_stage_pretrained(local, pretrained)
    out = {"local": (ckpt.bytes_read(), status("VmHWM") - base)}
    del local
    gc.collect()
    base = status("VmRSS")
    Path("/proc/self/clear_refs").write_text("5")
    torch.manual_seed(0)
    meta = meta_model(model_config(args))
    drawn = partition_model(meta, P, seq_len=64)[r]
    materialise_stage(drawn, meta, model_config(args))  # the trainer's start for a random init
    out["random_local"] = status("VmHWM") - base
    del drawn, meta
    gc.collect()
    base = status("VmRSS")
    Path("/proc/self/clear_refs").write_text("5")
    stage = partition_model(full_model(args), P, seq_len=64)[r]  # the other stages are dropped with the list
    gc.collect()
    out.update({"start_peak": status("VmHWM") - base,
                "stage_bytes": sum(x.numel() * x.element_size() for x in stage.state_dict().values())})
    for key, how in (("same", same), ("other", other), ("before", same)):
        opt, sched, versions = parts(stage)
        gc.collect()
        base = status("VmRSS")
        Path("/proc/self/clear_refs").write_text("5")  # resets VmHWM to the current RSS
        ckpt.bytes_read(reset=True)
        t = time.perf_counter()
        if key == "before":
            load_every_file(Path(how), stage, opt, sched, versions)
        else:
            stage_state.load_stage(Path(how), stage, opt, sched, versions, stage_index=r)
        out[key] = (ckpt.bytes_read(), status("VmHWM") - base, time.perf_counter() - t)
        del opt, sched, versions
    queue.put((r, out))


def main():
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--write", action="store_true")
    args = ap.parse_args()
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        same, other = Path(tmp) / "p4", Path(tmp) / "p2"
        write_checkpoint(args, P, same)
        write_checkpoint(args, 2, other)
        size4 = sum(f.stat().st_size for f in same.iterdir())
        size2 = sum(f.stat().st_size for f in other.iterdir())
        pretrained = Path(tmp) / "pretrained"
        full_model(args).save_pretrained(pretrained)
        size_pre = sum(f.stat().st_size for f in pretrained.iterdir())
        ctx, rows = mp.get_context("spawn"), {}
        for r in range(P):
            q = ctx.Queue()
            proc = ctx.Process(target=rank, args=(args, r, str(same), str(other), str(pretrained), q))
            proc.start()
            got = q.get()
            proc.join()
            rows[got[0]] = got[1]
    n = sum(x.numel() for x in full_model(args).parameters())
    head = ("| rank | stage tensors | start, whole-model build: peak | start, random init, stage-local: peak | "
            "start, pretrained, stage-local: read / peak | "
            "resume, same split (4 stages): read / peak | resume, 2 -> 4 stages: read / peak | "
            "before (every file whole): read / peak |")
    lines = [head, "|" + "---|" * 8]
    for r in range(P):
        o = rows[r]
        cell = lambda k: f"{o[k][0] / MB:.0f} MB / {o[k][1] / MB:.0f} MB"  # noqa: E731
        lines.append(f"| {r} | {o['stage_bytes'] / MB:.0f} MB | {o['start_peak'] / MB:.0f} MB | "
                     f"{o['random_local'] / MB:.0f} MB | {cell('local')} | "
                     f"{cell('same')} | {cell('other')} | {cell('before')} |")
    table = "\n".join(lines)
    print(table)
    print(f"checkpoint sizes: 4 stages {size4 / MB:.0f} MB, 2 stages {size2 / MB:.0f} MB, pretrained folder "
          f"{size_pre / MB:.0f} MB; model {n / 1e6:.1f}M parameters")
    if args.write:
        from .report import write_section
        write_section("stage-local", f"""## Stage-local start and resume: what each rank reads and holds (p = 4, CPU)

Command: `python -m bench.stage_local --hidden {args.hidden} --layers {args.layers} --vocab {args.vocab} --write`
({time.strftime('%Y-%m-%d')}). Llama, hidden {args.hidden}, {args.layers} layers, vocab {args.vocab}, untied:
{n / 1e6:.1f}M parameters ({4 * n / MB:.0f} MB fp32). Each rank runs in its own process, one at a time. The
checkpoints hold one step of AdamW + Error Feedback and 2BW's older weight version: {size4 / MB:.0f} MB for 4 stages,
{size2 / MB:.0f} MB for 2. **Read**: bytes through the checkpoint read edge (`checkpoint.bytes_read`); **peak
above**: the rise of the peak RSS (`VmHWM`, reset through `/proc/self/clear_refs`) over the RSS the rank held before
the load, including what the stage keeps after it (Adam's moments, the EF buffers, 2BW's older version: about 4x the
stage's tensors). **Before**: the same restore after reading every stage's files whole and holding them together,
as `load_stage` did before it read by name. **Start, whole-model build**: what every rank did for a random init
before, and still does where a stage cannot be built alone (the seeded fp32 model, then its stage): each peaks at
about the whole model whatever its stage. **Start, random init, stage-local**: what the trainer does now
(`meta_model`, partition, `materialise_stage`: only the stage's tensors drawn, the whole model's values;
`model/seeded_init.py`). **Start,
pretrained, stage-local**: `meta_model` + partition + `load_stage_pretrained` from a `save_pretrained` folder of the
same model ({size_pre / MB:.0f} MB, which a full `from_pretrained` reads whole on every rank): only the stage's tensors.

{table}

On the same split a rank reads exactly its own three files; on another split it reads, by name, only its tensors
(and their older version) and the optimizer files of the old stages that held them. Before, every rank read and held
every stage's files: the whole checkpoint per rank.
""")


if __name__ == "__main__":
    main()
