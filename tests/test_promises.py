"""The package's written promises, each checked where it can break: file names spelled in
one home, every write through ``storage``, no schedule vocabulary outside ``pipeline/``, weight versions held and
released by construction, the recipe's Error-Feedback lambda on resume, one non-finite rule and one resume resolver.

The source checks walk the package's AST; each detector is first shown a snippet that breaks its promise, so a
check that silently stopped finding anything fails too. Allow-lists name each exception and why it is one.
"""
from __future__ import annotations

import ast
import copy
import json
import os
import re
import typing
from pathlib import Path

import pytest
import torch

from hf_asyncpp.engine import finite_step
from hf_asyncpp.errors import NonFiniteError
from hf_asyncpp.optim import install_error_feedback
from hf_asyncpp.pipeline import stage_state
from hf_asyncpp.pipeline.versions import Versions
from hf_asyncpp.run import checkpointer
from hf_asyncpp.schedules.records import NO_PIPELINE, SCHEDULES, SIMULATED_DELAYS, VIRTUAL_SCHEDULES
from hf_asyncpp.storage import checkpoint_io as ckpt
from hf_asyncpp.storage.names import (FINAL_EVAL, LOSS_CURVE, MANIFEST, METRICS, MODEL_FILE, OPTIMIZER_FILE, PROFILE,
                                      RECIPE_FILE, RUN_STATE, TIMELINE, TRAINER_STATE)

PACKAGE = Path(ckpt.__file__).resolve().parent.parent


def _sources() -> dict[str, ast.Module]:
    """Every module of the package by its path inside it (``pipeline/executor.py``)."""
    return {p.relative_to(PACKAGE).as_posix(): ast.parse(p.read_text(), str(p)) for p in sorted(PACKAGE.rglob("*.py"))}


def _docstrings(tree: ast.AST) -> set[int]:
    """ids of the string constants that are docstrings or bare string statements (prose, not code)."""
    return {id(n.value) for n in ast.walk(tree) if isinstance(n, ast.Expr) and isinstance(n.value, ast.Constant)}


# ---------------------------------------------------------------------------- 1. file names in one home

HOMES = {v: "storage/names.py" for v in (MANIFEST, RUN_STATE, TRAINER_STATE, MODEL_FILE,
                                        OPTIMIZER_FILE, RECIPE_FILE, METRICS, FINAL_EVAL,
                                        LOSS_CURVE, PROFILE, TIMELINE)}
"""The names of a checkpoint's files and of the run folder's outputs live in storage/names.py. Not here: ``config.json`` and ``tokenizer.json`` (transformers' and tokenizers' own names, also
in exported folders), and folder names."""
NAME_EXCEPTIONS = {
    ("model/export.py", MODEL_FILE): "an exported HF folder's weights: transformers' SAFE_WEIGHTS_NAME, which "
                                    "names.MODEL_FILE happens to equal",
}


def _name_literals(sources: dict[str, ast.Module]) -> set[tuple[str, str]]:
    found = set()
    for path, tree in sources.items():
        prose = _docstrings(tree)
        for n in ast.walk(tree):
            if isinstance(n, ast.Constant) and isinstance(n.value, str) and id(n) not in prose and n.value in HOMES \
                    and HOMES[n.value] != path:
                found.add((path, n.value))
    return found


def test_file_names_are_spelled_only_in_their_home():
    bad = _name_literals({"engine.py": ast.parse('ckpt.save_tensors(tmp / "model.safetensors", sd)')})
    assert bad == {("engine.py", "model.safetensors")}  # the detector sees a stray name
    found = _name_literals(_sources())
    stray = {(p, v) for p, v in found if (p, v) not in NAME_EXCEPTIONS}
    assert not stray, f"spell these through their home's constant ({HOMES}): {sorted(stray)}"
    unused = set(NAME_EXCEPTIONS) - {(p, v) for p, v in found}
    assert not unused, f"allowed exceptions no longer needed; remove them from NAME_EXCEPTIONS: {sorted(unused)}"


# ---------------------------------------------------------------------------- 2. every write through storage

WRITE_EXCEPTIONS = {
    ("storage/write.py", "open"): "the edge itself: open_for_write, which write_file writes through (and tests fake)",
    ("storage/write.py", "write_text"): "a probe of whether training.output_dir is writable: its failure is the answer, "
                                    "turned into a RecipeError naming the field",
    ("storage/write.py", "os.open"): "the run lock (lock_output_dir): flock needs a file descriptor; its record is a "
                                     "few bytes, and a failure to open it is a RecipeError naming the file",
    ("cli/compare.py", "open"): "a log file handed to a child process as its stdout: the child writes the bytes",
    ("testing.py", "open"): "a spawned worker's traceback, into the harness's temp folder: no run's file",
}


def _writes(sources: dict[str, ast.Module]) -> set[tuple[str, str]]:
    """(module, kind) of each write that bypasses storage: open() in a write/append mode, Path.write_text/bytes,
    json/yaml dumped into a file object."""
    found = set()
    for path, tree in sources.items():
        for n in ast.walk(tree):
            if not isinstance(n, ast.Call):
                continue
            f = n.func
            name = f.attr if isinstance(f, ast.Attribute) else f.id if isinstance(f, ast.Name) else None
            if name in ("write_text", "write_bytes"):
                found.add((path, name))
            elif name == "open" and not (isinstance(f, ast.Attribute) and ast.unparse(f.value) == "os"):
                # open(path, mode) / io.open(path, mode); Path.open(mode)
                pos = 0 if isinstance(f, ast.Attribute) and ast.unparse(f.value) not in ("io", "builtins") else 1
                mode = [k.value for k in n.keywords if k.arg == "mode"] or n.args[pos:pos + 1]
                if mode and (not isinstance(mode[0], ast.Constant) or set(str(mode[0].value)) & set("wax+")):
                    found.add((path, "open"))
            elif name == "open":  # os.open(path, flags)
                if any(w in ast.unparse(n) for w in ("O_WRONLY", "O_RDWR", "O_CREAT", "O_APPEND")):
                    found.add((path, "os.open"))
            elif name in ("dump", "safe_dump") and isinstance(f, ast.Attribute) and ast.unparse(f.value) in ("json", "yaml") \
                    and (len(n.args) > 1 or any(k.arg == "stream" for k in n.keywords)):
                found.add((path, f"{ast.unparse(f.value)}.{name}"))
    return found


def test_every_write_goes_through_storage():
    snippet = ast.parse('with open(p, "w") as f:\n    json.dump(x, f)\nPath(p).write_text("x")\nopen(p, "rb")\n'
                        'yaml.safe_dump(d, f)\nyaml.safe_dump(d)\nos.open(p, os.O_RDONLY)\nPath(p).open("a")')
    assert _writes({"x.py": snippet}) == {("x.py", k) for k in ("open", "json.dump", "write_text", "yaml.safe_dump")}
    found = _writes(_sources())
    bypass = found - set(WRITE_EXCEPTIONS)
    assert not bypass, f"write these through storage.write_file (a full disk must name the file): {sorted(bypass)}"
    unused = set(WRITE_EXCEPTIONS) - found
    assert not unused, f"allowed exceptions no longer needed; remove them from WRITE_EXCEPTIONS: {sorted(unused)}"


def test_the_run_reports_are_written_whole_or_not_at_all(tmp_path, monkeypatch):
    """``pipeline_profile.json``, ``pipeline_timeline.png`` and ``loss_curve.png`` go through ``replace_file``: a
    writer that fails midway (a full disk at the write edge, a ``savefig`` cut short) leaves the previous file as it
    was and no temporary one beside it; a process that trained no step writes no profile over a measured one."""
    import errno

    from matplotlib.figure import Figure

    from hf_asyncpp.config.sections import PipelineConfig
    from hf_asyncpp.errors import WriteError
    from hf_asyncpp.plan.profile import write_report
    from hf_asyncpp.run.reporting import RunLog
    from hf_asyncpp.storage import write as storage

    pipeline = PipelineConfig(schedule="2bw", num_stages=2, num_microbatches=2)
    measured = [{"stage": s, "seconds": {"F": 0.02, "B": 0.04, "STEP": 0.01, "RECV_ACT": 0.005},
                 "counts": {"F": 8, "B": 8, "STEP": 4, "RECV_ACT": 8}} for s in (0, 1)]
    old = {PROFILE: b'{"measured": "before"}', TIMELINE: b"old timeline", LOSS_CURVE: b"old curve"}
    for name, data in old.items():
        (tmp_path / name).write_bytes(data)
    (tmp_path / METRICS).write_text('{"step": 1, "loss": 5.0}\n{"step": 2, "loss": 4.0}\n')

    def kept():
        assert {n: (tmp_path / n).read_bytes() for n in old} == old
        assert sorted(p.name for p in tmp_path.iterdir()) == sorted([*old, METRICS]), "a temporary file was left"

    def full_disk(path, append=False):  # the write edge: half the bytes land, then ENOSPC
        f = open(path, "ab" if append else "wb")
        real = f.write

        def write(data):
            real(bytes(memoryview(data).cast("B"))[: len(data) // 2])
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        f.write = write
        return f

    with monkeypatch.context() as m:
        m.setattr(storage, "open_for_write", full_disk)
        with pytest.raises(WriteError, match=PROFILE):
            write_report(tmp_path, measured, pipeline, 1.0)
    kept()

    def cut_short(self, fname, *args, **kwargs):  # a library writer that dies midway through its file
        Path(fname).write_bytes(b"\x89PNG half")
        raise OSError(errno.EIO, os.strerror(errno.EIO))

    monkeypatch.setattr(Figure, "savefig", cut_short)
    with pytest.raises(WriteError, match=TIMELINE):
        write_report(tmp_path, measured, pipeline, 1.0)
    old[PROFILE] = (tmp_path / PROFILE).read_bytes()  # the profile itself was written, whole
    assert json.loads(old[PROFILE])["schedule"] == "2bw"
    kept()
    runlog = RunLog.__new__(RunLog)  # only its path: plot_loss reads metrics.jsonl beside the curve
    runlog.path = tmp_path / METRICS
    with pytest.raises(WriteError, match=LOSS_CURVE):
        runlog.plot_loss()
    kept()
    monkeypatch.undo()
    idle = [{**st, "counts": {}, "seconds": {}} for st in measured]  # a resume at the end: no step trained
    assert write_report(tmp_path, idle, pipeline, 1.0) is None
    kept()
    assert write_report(tmp_path, measured, pipeline, 1.0) is not None and runlog.plot_loss() == tmp_path / LOSS_CURVE
    assert (tmp_path / TIMELINE).read_bytes()[:4] == (tmp_path / LOSS_CURVE).read_bytes()[:4] == b"\x89PNG"


# ---------------------------------------------------------------------------- 3. schedule vocabulary in pipeline/

VOCABULARY = set(SCHEDULES) | {NO_PIPELINE} | set(SIMULATED_DELAYS)
SUBJECTS = re.compile(r"schedule|simulate_delay|\bmode\b")  # not delay_correction, whose "none" is its own
VOCABULARY_EXCEPTIONS = {
}


def _strings(node: ast.AST) -> set[str]:
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return {node.value}
    if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
        return set().union(*map(_strings, node.elts)) if node.elts else set()
    return set()


def _vocabulary_switches(sources: dict[str, ast.Module]) -> set[tuple[str, int, str]]:
    """Comparisons of a schedule / simulated-delay value with one of their names, and tables keyed by those names,
    outside pipeline/ (the records' home)."""
    found = set()
    for path, tree in sources.items():
        if path.startswith("pipeline/"):
            continue
        for n in ast.walk(tree):
            if isinstance(n, ast.Compare):
                sides = [n.left, *n.comparators]
                names = set().union(*map(_strings, sides)) & VOCABULARY
                subject = " ".join(ast.unparse(s) for s in sides if not _strings(s))
                if names and SUBJECTS.search(subject):
                    found.add((path, n.lineno, ast.unparse(n)))
            elif isinstance(n, ast.Dict):
                keys = set().union(*(_strings(k) for k in n.keys if k is not None)) if n.keys else set()
                if len(keys & (VOCABULARY - {"0", "1"})) >= 1 and len(keys & VOCABULARY) >= 2:
                    found.add((path, n.lineno, ast.unparse(n)[:60]))
    return found


def test_no_module_outside_pipeline_switches_on_a_schedule_or_delay_name():
    snippet = ast.parse('if recipe.pipeline.schedule == "none": pass\nif cfg.simulate_delay != "pipedream": pass\n'
                        'lags = {"pipedream": a, "1": b}.get(mode)\nif env.get("RANK") == "0": pass')
    assert len(_vocabulary_switches({"x.py": snippet})) == 3
    found = [f for f in _vocabulary_switches(_sources()) if Path(f[0]).name not in VOCABULARY_EXCEPTIONS]
    assert not found, ("ask the records in schedules/records.py (pipelined, processes_per_pipeline, "
                       f"get_simulated_delay) instead of comparing names: {sorted(found)}")


def test_the_recipe_types_spell_the_records_names():
    """The recipe's ``Literal`` types are what a user may write; the records are what the code knows. They must be one
    vocabulary: a schedule added to ``SCHEDULES`` and not to the recipe (or the reverse) fails here."""
    from hf_asyncpp.config.optimizer import OptimizerConfig
    from hf_asyncpp.config.sections import PipelineConfig

    assert set(typing.get_args(typing.get_type_hints(PipelineConfig)["schedule"])) == (
        set(SCHEDULES) | set(VIRTUAL_SCHEDULES) | {NO_PIPELINE})
    assert set(typing.get_args(typing.get_type_hints(OptimizerConfig)["simulate_delay"])) == set(SIMULATED_DELAYS)


def test_simulated_delays_are_the_schedules_lags():
    assert [SIMULATED_DELAYS[n].lags(4) for n in ("0", "1", "pipedream")] == [[0] * 4, [1] * 4, [3, 2, 1, 0]]
    assert [SIMULATED_DELAYS[n].delayed for n in ("0", "1", "pipedream")] == [False, True, True]


# ---------------------------------------------------------------------------- 4. versions held by construction

def test_a_version_hold_is_released_exactly_once():
    w = torch.nn.Parameter(torch.zeros(2))
    versions = Versions({"w": w}, lag=0)
    hold = versions.hold(0)
    assert versions.inflight[0] == 1
    with pytest.raises(RuntimeError, match="never released"):
        versions.check_released()  # a drain point with a forward whose backward never released it
    hold.release()
    versions.check_released()
    with pytest.raises(RuntimeError, match="released twice"):
        hold.release()
    assert versions.inflight[0] == 0  # the second release changed nothing


def test_only_versions_changes_the_inflight_counts():
    found = []
    for path, tree in _sources().items():
        for n in ast.walk(tree):
            targets = n.targets if isinstance(n, ast.Assign) else [n.target] if isinstance(n, ast.AugAssign) else []
            for t in targets:
                text = ast.unparse(t)  # the simulator's own per-stage inflight counts are not Versions'
                if "inflight[" in text and path != "pipeline/versions.py" and ("versions" in text or "executor" in path):
                    found.append((path, n.lineno, ast.unparse(n)))
    assert not found, f"take a Versions.hold(v) and release it instead: {found}"


# ---------------------------------------------------------------------------- 5. the recipe's EF lambda on resume

def test_a_resumed_stage_uses_the_recipes_ef_lambda(tmp_path):
    torch.manual_seed(0)
    stage = torch.nn.Linear(3, 2)

    def parts(module, lam):
        opt = install_error_feedback(torch.optim.SGD(module.parameters(), lr=0.1), lam)
        return opt, torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0), Versions(dict(module.named_parameters()), 0)

    opt, sched, versions = parts(stage, 0.5)
    for _ in range(2):
        stage(torch.randn(4, 3)).square().sum().backward()
        opt.step()
        opt.zero_grad()
    stage_state.save_stage(tmp_path, 0, stage, opt, sched, versions, {})
    resumed = copy.deepcopy(stage)
    opt2, sched2, versions2 = parts(resumed, 0.25)  # the recipe changed optimizer.ef_lambda
    stage_state.load_stage(tmp_path, resumed, opt2, sched2, versions2)
    assert opt2.error_feedback["lam"] == 0.25
    saved = {id(p): t for p, t in opt.error_feedback["prev"].items()}
    assert all(torch.equal(opt2.error_feedback["prev"][p2], saved[id(p)])
               for p, p2 in zip(stage.parameters(), resumed.parameters()))
    # the single-process path: the optimizer's own state dict, which carries the writer's lambda
    opt3, _, _ = parts(copy.deepcopy(stage), 0.25)
    opt3.load_state_dict(opt.state_dict())
    assert opt3.error_feedback["lam"] == 0.25


# ---------------------------------------------------------------------------- 6. one rule, one resolver

def test_one_non_finite_rule():
    assert finite_step(3, 1.0, "stop", loss=2.0)
    assert not finite_step(3, float("nan"), "skip")
    assert not finite_step(3, 1.0, "skip", loss=float("inf"))
    with pytest.raises(NonFiniteError, match=r"step 3: non-finite .*training.on_nonfinite: stop"):
        finite_step(2, float("inf"), "stop")  # the engines' 0-based index; metrics.jsonl's (1-based) step in words
    found = [(p, n.lineno) for p, tree in _sources().items() for n in ast.walk(tree)
             if isinstance(n, ast.Attribute) and n.attr == "isfinite"]
    # storage/write.py's json_text writes a non-finite number as null (JSON has no NaN): it decides no step
    assert {p for p, _ in found} - {"storage/write.py"} == {"engine.py"}, \
        f"decide a step's finiteness with engine.finite_step: {found}"


def test_one_resume_resolver():
    assert not hasattr(ckpt, "resolve_resume")  # folder.choose_resume verifies and picks
    assert not hasattr(checkpointer, "resume")  # Checkpointer.resume restores
    defined = [n.name for tree in _sources().values() for n in ast.walk(tree)
               if isinstance(n, ast.FunctionDef) and n.name in ("choose_resume", "resolve_resume", "resume")]
    assert sorted(defined) == ["choose_resume", "resume"], defined


# ---------------------------------------------------------------------------- history stays out of the code

HISTORY = re.compile(r"\b[Ii]ssues? #?\d+\b|\b[Rr]eview(?:'s|s)?\b|shared/reviews")
HISTORY_HOMES = {"docs/benchmarks/log.md",  # the dated lab notebook: history is what it holds
                 "tests/test_promises.py"}  # this check and its own examples


def _history_citations(root: Path) -> list[str]:
    found = []
    for folder in ("hf_asyncpp", "tests", "bench", "scripts", "docs"):
        for path in sorted((root / folder).rglob("*")):
            rel = path.relative_to(root).as_posix()
            if path.suffix not in (".py", ".md") or rel in HISTORY_HOMES:
                continue
            for i, line in enumerate(path.read_text().splitlines(), 1):
                if HISTORY.search(line):
                    found.append(f"{rel}:{i}: {line.strip()[:80]}")
    return found


def test_no_code_or_doc_cites_an_issue_or_a_review(tmp_path):
    """A reader cannot follow "issue 14" or "the review's E2": say the fact. Only the dated log keeps history."""
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "x.md").write_text("the model of issue 14\nthe review's E2\nissues a collective\n")
    assert [f.split(":")[1] for f in _history_citations(tmp_path)] == ["1", "2"]
    found = _history_citations(PACKAGE.parent)
    assert not found, "say the fact instead:\n" + "\n".join(found)
