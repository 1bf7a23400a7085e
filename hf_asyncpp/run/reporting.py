"""What a run tells its user while it trains: metrics.jsonl, the trackers, the progress bar, the loss curve.

Only the main process writes. ``metrics.jsonl`` gets one record per step (``step, loss, learning_rate, grad_norm,
num_input_tokens_seen, tokens_per_s, applied, elapsed_s, train_s``: seconds since this process started training, when
the result arrived, and of those the seconds spent training, evaluations and checkpoints excluded, the clock of a
time-to-loss comparison; a single-process MoE run whose config sets ``output_router_logits`` adds
``router_aux_loss`` and ``expert_tokens``, the tokens each layer's router sent to each expert that step) and one per
evaluation (``eval_loss, eval_perplexity, eval_tokens``); a compiled run (``training.torch_compile``) one per drain point
(``compile``: Dynamo's counts per rank, :meth:`RunLog.compile_stats`). Where a number is one the HF
Trainer logs, it has the Trainer's name, so a script written for a Trainer's ``log_history`` reads ours. The trackers
and the log get the mean over each ``training.logging_steps`` interval, as the HF Trainer does (:func:`interval_log`).
Reporting never waits on the pipeline: records arrive as the engine yields them, so ``logging_steps`` changes nothing
in what is computed.
"""
from __future__ import annotations

import json
import logging
import os
import time
from pathlib import Path

import accelerate.utils
import torch
from tqdm.auto import tqdm
from accelerate.tracking import LOGGER_TYPE_TO_CLASS, get_available_trackers

from ..storage.names import LOSS_CURVE, METRICS
from ..storage.staging import BackgroundWriter
from ..config.recipe import Recipe, recipe_to_dict
from ..errors import RecipeError
from ..figures import pyplot
from ..storage.write import json_text, replace_file, write_file

log = logging.getLogger("hf_asyncpp")

PROJECT = "hf_asyncpp"
PROJECT_ENV = {"wandb": "WANDB_PROJECT", "comet_ml": "COMET_PROJECT_NAME"}
"""Each tracker's own variable for its project, read when ``training.project`` is unset (the Trainer's wandb users
set WANDB_PROJECT)."""
# peak dense bf16 TFLOP/s of one device, for train/mfu (training.peak_tflops overrides; no entry: no MFU)
PEAK_TFLOPS = {"H200": 989.0, "H100": 989.0, "A100": 312.0, "L40S": 362.0, "A10G": 125.0, "L4": 121.0}


def check_trackers(report_to: list[str]) -> list[str]:
    """The trackers to start: each must be one accelerate knows and have its package installed (accelerate would
    drop it with a debug log; a run the user thinks is tracked must not silently be untracked). ``all`` is the
    Trainer's value: every installed tracker (accelerate's own list of them)."""
    if "all" in report_to:
        return [str(t) for t in get_available_trackers()]
    names = [r for r in report_to if r != "none"]
    for name in names:
        if name not in LOGGER_TYPE_TO_CLASS:
            raise RecipeError(f"training.report_to: {name!r} is not a tracker; choose from "
                              f"{', '.join(sorted(LOGGER_TYPE_TO_CLASS))} (or none)")
        if not getattr(accelerate.utils, f"is_{name}_available")():
            raise RecipeError(f"training.report_to: {name!r} needs the package {name}, which is not installed: "
                              f"pip install {name} (or hf_asyncpp[{name}]), or remove it from training.report_to")
    return names


def tracker_project(project: str | None, trackers: list[str]) -> str:
    """The trackers' project: ``training.project``; unset, a started tracker's own variable where it is set
    (``PROJECT_ENV``: accelerate hands every tracker the project it is given, which would override it), else
    ``hf_asyncpp``."""
    if project:
        return project
    return next((os.environ[PROJECT_ENV[t]] for t in trackers if os.environ.get(PROJECT_ENV.get(t, ""))), PROJECT)


def model_flops_per_token(config, seq_len: int) -> float:
    """Training FLOPs per token, 6 N + 12 L H T (PaLM, appendix B): N parameters, L layers, H hidden, T sequence."""
    cfg = config.get_text_config() if hasattr(config, "get_text_config") else config
    from transformers import AutoModelForCausalLM  # heavy: the parameter count of the config, on the meta device

    with torch.device("meta"):
        n = sum(p.numel() for p in AutoModelForCausalLM.from_config(config).parameters())
    layers, hidden = getattr(cfg, "num_hidden_layers", 0) or 0, getattr(cfg, "hidden_size", 0) or 0
    return 6.0 * n + 12.0 * layers * hidden * seq_len


def device_peak_flops(override_tflops: float | None) -> float | None:
    if override_tflops:
        return override_tflops * 1e12
    if not torch.cuda.is_available():
        return None
    name = torch.cuda.get_device_name()
    return next((tf * 1e12 for key, tf in PEAK_TFLOPS.items() if key in name), None)


def compile_fallback_line(ranks: list[int]) -> str:
    """The one line said when ``torch.compile`` gave up on the decoder layers of ``ranks``: its cause and the fix."""
    limit = getattr(torch._dynamo.config, "recompile_limit", None) or getattr(torch._dynamo.config, "cache_size_limit")
    return (f"torch.compile: rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))} hit Dynamo's recompile "
            f"limit ({limit}): a guard of the compiled decoder layers failed call after call (a Python value that "
            "differs per layer or per microbatch), so Dynamo stopped compiling them and those calls now run eagerly; "
            "run with TORCH_LOGS=recompiles to see the guard and remove its cause, or set training.torch_compile: false")


def read_metrics(path: Path, whole_lines: bool = False) -> list[dict]:
    """The records of a metrics.jsonl (a missing file reads as none). A line that is not a JSON record (a run
    killed, or a disk filled, in the middle of writing it) is left out with a warning naming it. ``whole_lines``:
    read while the run appends (the checkpoint writer), so a last line without its newline is still being written
    and is left out without a word."""
    if not path.exists():
        return []
    rows = []
    text = path.read_text(errors="replace")
    if whole_lines:
        text = text[:text.rfind("\n") + 1]
    for number, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except ValueError:
            rec = None
        if not isinstance(rec, dict) or not isinstance(rec.get("step"), int):
            log.warning("%s line %d is not a whole record (a write cut short?); left out: %r", path, number, line[:80])
            continue
        rows.append(rec)
    return rows


def interval_log(rows: list[dict]) -> dict:
    """The log entry of one ``logging_steps`` interval of step records, as the HF Trainer makes it (a
    ``log_history`` entry): the mean loss and grad norm over its steps, the learning rate and the tokens seen at its
    last step; and that step's tokens_per_s."""
    def mean(key):
        values = [r[key] for r in rows if r.get(key) is not None]
        return sum(values) / len(values) if values else None

    last = rows[-1]
    entry = {"loss": mean("loss"), "grad_norm": mean("grad_norm"), "learning_rate": last["learning_rate"],
             "num_input_tokens_seen": last["num_input_tokens_seen"], "tokens_per_s": last["tokens_per_s"],
             "step": last["step"]}
    return {k: v for k, v in entry.items() if v is not None}


def log_history(records: list[dict], logging_steps: int, max_steps: int, step: int) -> list[dict]:
    """A run's log up to ``step`` as a Trainer's ``TrainerState.log_history``: an :func:`interval_log` entry per
    logging interval completed (what the trackers got) and every other record (evaluations) as it was written."""
    history, interval = [], []
    for rec in records:
        if rec["step"] > step:
            continue
        if "loss" not in rec:
            history.append(rec)
            continue
        interval.append(rec)
        if rec["step"] % logging_steps == 0 or rec["step"] == max_steps:
            history.append(interval_log(interval))
            interval = []
    return history


def plain_line(entry: dict, max_steps: int) -> str:
    """One interval in words, for a log file (a SLURM batch log) where a progress bar would be carriage returns."""
    parts = [f"loss {entry['loss']:.4f}", f"learning_rate {entry['learning_rate']:.3e}"]
    if "grad_norm" in entry:
        parts.append(f"grad_norm {entry['grad_norm']:.4f}")
    parts.append(f"tokens/s {entry['tokens_per_s']:,.0f}")
    return f"step {entry['step']}/{max_steps}: " + ", ".join(parts)


class RunLog:
    """Tracker keys are the HF Trainer's where the number is one it reports: ``train/loss``, ``train/learning_rate``,
    ``train/grad_norm``, ``train/num_input_tokens_seen``, ``eval/loss``; ours besides: ``train/tokens_per_s``,
    ``train/mfu`` (where the device's peak is known), ``eval/perplexity``, ``eval/tokens``. The tracker run is named
    ``training.run_name`` in the project ``training.project`` and continues on resume (its id is the run's, in the
    checkpoint). The progress bar is for a terminal; where stderr is none (a SLURM batch log) it is off and each
    logging interval is one log line instead."""

    def __init__(self, out: Path, recipe: Recipe, accelerator, state, tokens_per_step: int,
                 flops_per_token: float | None = None, writer: BackgroundWriter | None = None):
        self.path, self.recipe, self.accelerator = out / METRICS, recipe, accelerator
        self.writer = writer  # the checkpoint writer: records made while a save is in flight follow its commit
        self.main = accelerator.is_main_process
        self.tokens_per_step = tokens_per_step
        peak = device_peak_flops(recipe.training.peak_tflops)
        self.peak = peak * accelerator.num_processes if peak and flops_per_token else None
        self.flops_per_token = flops_per_token
        self.interval: list[dict] = []
        self.bar = None
        self.evaluated: set[int] = set()  # steps metrics.jsonl holds an evaluation of (a resume keeps those before it)
        self.compile_warned = False  # the recompile-limit warning is said once per run
        if self.main:
            self._truncate(state.step)
            t = recipe.training
            run_name = t.run_name or out.resolve().name
            project = tracker_project(t.project, check_trackers(t.report_to))
            accelerator.init_trackers(project, config=_flat(recipe), init_kwargs={
                "wandb": {"name": run_name, "id": state.run_id, "resume": "allow"},
                "mlflow": {"run_name": run_name}, "trackio": {"name": run_name}, "swanlab": {"experiment_name": run_name},
                "comet_ml": {"experiment_key": state.run_id}, "aim": {"run_hash": state.run_id}})
            self.bar = tqdm(total=t.max_steps, initial=state.step, desc="train", unit="step", dynamic_ncols=True,
                            disable=None)  # None: off where stderr is no terminal (tqdm's own test)
        self._start = time.perf_counter()
        self._train_s = 0.0  # training seconds up to the last step record (evaluations, checkpoints excluded)
        self.restart_clock()

    def _truncate(self, step: int) -> None:
        """On resume, drop records past the checkpoint so metrics.jsonl reads as one uninterrupted run."""
        keep = [r for r in read_metrics(self.path) if r["step"] <= step] if step else []
        self.evaluated = {r["step"] for r in keep if "eval_loss" in r}
        data = "".join(json_text(r) + "\n" for r in keep).encode()
        # a kill here leaves the old file or the new one, never half of one
        replace_file(self.path, lambda tmp: write_file(tmp, lambda f: f.write(data)))

    def _write(self, rec: dict) -> None:
        data = (json_text(rec) + "\n").encode()
        append = lambda: write_file(self.path, lambda f: f.write(data), append=True, fsync=False)  # noqa: E731
        if self.writer is None:
            append()
        else:  # after the save in flight, if any: a record never lands before the commit of an earlier save
            self.writer.in_order(append)

    def restart_clock(self) -> None:
        """Start measuring tokens/s afresh (after an evaluation or a checkpoint, which are not training time).

        A step's ``tokens_per_s`` is the rate since the clock started: results arrive a step or so after they are
        computed, sometimes two at once, so the time between two results is no measure of one step."""
        self._t0, self._steps = time.perf_counter(), 0
        self._train_base = self._train_s  # the time since the last step record was not training

    def step(self, result, tokens: int) -> None:
        """One step's result (every rank calls it; only the main process records)."""
        self._steps += 1
        if not self.main:
            return
        now = time.perf_counter()
        rate = self._steps * self.tokens_per_step / max(now - self._t0, 1e-9)
        self._train_s = self._train_base + now - self._t0
        rec = {"step": result.step + 1, "loss": result.loss, "learning_rate": result.lr, "grad_norm": result.grad_norm,
               "num_input_tokens_seen": tokens, "tokens_per_s": rate, "applied": result.applied, "elapsed_s": round(now - self._start, 4),
               "train_s": round(self._train_s, 4)}
        if result.skipped_nonfinite:
            rec["skipped_nonfinite"] = True
        if result.ef_lambda is not None:
            rec["ef_lambda"] = result.ef_lambda
        if result.router_aux_loss is not None:  # a MoE model's router balance (the single-process engine's)
            rec["router_aux_loss"] = result.router_aux_loss
            rec["expert_tokens"] = result.expert_tokens
        self._write(rec)
        self.interval.append(rec)
        self.bar.update(1)
        every = self.recipe.training.logging_steps or 1
        if rec["step"] % every == 0 or rec["step"] == self.recipe.training.max_steps:
            self._flush_interval()

    def _flush_interval(self) -> None:
        rows, self.interval = self.interval, []
        entry = interval_log(rows)
        summary = {f"train/{k}": v for k, v in entry.items() if k != "step"}  # as the Trainer's rewrite_logs names them
        if self.peak:
            summary["train/mfu"] = entry["tokens_per_s"] * self.flops_per_token / self.peak
        self.accelerator.log(summary, step=entry["step"])
        if self.bar.disable:
            log.info(plain_line(entry, self.recipe.training.max_steps))
        else:
            self.bar.set_postfix(loss=f"{entry['loss']:.3f}", tok_s=f"{entry['tokens_per_s']:.0f}")

    def eval(self, step: int, nll: float, tokens: int, res: dict, per_source: dict | None = None) -> dict:
        """One evaluation record per step: a run resumed at its end (to write an export a kill interrupted) measures
        the same weights again, and its second record would read as another evaluation. ``per_source``: a
        mixture's ``eval_loss/<source>``, in the same record (the trackers get ``eval/loss/<source>``)."""
        rec = {"step": step, "eval_loss": res["eval_loss"], "eval_perplexity": res["eval_perplexity"], "eval_tokens": tokens,
               **(per_source or {})}
        if self.main and step not in self.evaluated:
            self.evaluated.add(step)
            self._write(rec)
            self.accelerator.log({"eval/loss": rec["eval_loss"], "eval/perplexity": rec["eval_perplexity"],
                                  "eval/tokens": tokens, **{f"eval/{k[5:]}": v for k, v in (per_source or {}).items()}},
                                 step=step)
        return rec

    def compile_stats(self, step: int, per_rank: list[dict] | None) -> None:
        """What ``torch.compile`` has done on each rank so far (``model.build.compile_counts``, gathered at a drain
        point): one ``{"step", "compile": {count: [per rank]}}`` record, and one warning line the first time a rank
        hit the recompile limit, whose layers then run eagerly with nothing but Dynamo's own log line to say so."""
        if not self.main or not per_rank:
            return
        self._write({"step": step, "compile": {k: [c[k] for c in per_rank] for k in per_rank[0]}})
        hit = [r for r, c in enumerate(per_rank) if c["eager_fallbacks"]]
        if hit and not self.compile_warned:
            self.compile_warned = True
            log.warning(compile_fallback_line(hit))

    def record(self, step: int, rec: dict) -> None:
        """Other evaluation results of a step (e.g. ``eval/<task>/acc``): to ``metrics.jsonl`` and the trackers."""
        if self.main:
            self._write({"step": step, **rec})
            self.accelerator.log(rec, step=step)

    def abort(self) -> None:
        """The run failed: close the progress bar (nothing else is flushed)."""
        if self.bar is not None:
            self.bar.close()
            self.bar = None

    def close(self) -> None:
        if self.interval:
            self._flush_interval()
        if self.bar is not None:
            self.bar.close()

    def plot_loss(self) -> Path | None:
        """loss_curve.png from metrics.jsonl: the train loss per step and the evaluations."""
        plt = pyplot()

        rows = read_metrics(self.path)
        train_rows = [r for r in rows if "loss" in r]
        eval_rows = [r for r in rows if "eval_loss" in r]
        if not train_rows:
            return None
        fig, ax = plt.subplots(figsize=(7, 4))
        ax.plot([r["step"] for r in train_rows], [r["loss"] for r in train_rows], label="train loss", lw=1)
        if eval_rows:
            ax.plot([r["step"] for r in eval_rows], [r["eval_loss"] for r in eval_rows], "o-", label="eval loss")
        ax.set_xlabel("step")
        ax.set_ylabel("loss")
        ax.legend()
        ax.grid(alpha=0.3)
        path = self.path.parent / LOSS_CURVE
        fig.tight_layout()
        try:  # whole or not at all: the previous curve stays where this one cannot be written
            replace_file(path, lambda tmp: fig.savefig(tmp, dpi=100))
        finally:
            plt.close(fig)
        return path


def _flat(recipe: Recipe) -> dict:
    flat = {}
    for section, values in recipe_to_dict(recipe).items():
        for k, v in values.items():
            flat[f"{section}.{k}"] = v if isinstance(v, (int, float, str, bool)) else str(v)
    return flat
