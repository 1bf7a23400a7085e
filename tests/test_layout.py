"""The package's import graph keeps its floors: no cycle, no import that climbs, and a pure schedule floor.

The graph is read from the source with ``ast`` (every ``import`` and ``from ... import``, function-local ones
included, relative ones resolved), so an import hidden in a function to dodge a cycle counts like any other. Each
top-level module and folder of ``hf_asyncpp/`` is a unit on one floor of ``LAYERS`` (docs/how-it-works.md draws
the same tree); a unit imports only units on lower floors. So the core (storage, the model, the partitioner, the
optimizers, the engines, the pipeline) never reaches evaluation, a run's components, the launcher or the CLI.
"""
from __future__ import annotations

import ast
import importlib.util
import re
import shutil
import sys
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "hf_asyncpp"
LAYERS = (
    ("errors", "figures", "offline"),  # leaves: every user-facing error; matplotlib set up once; the Hub reachable?
    ("schedules",),  # schedules as data and their simulator (no torch but in PURE_TORCH, inside a function)
    ("storage", "topology", "supervision"),  # the disk; where a process sits; a rank never outlives its launcher
    ("config",),  # the recipe
    ("data", "model", "launch"),  # files -> blocks; the model built, scored, exported; starting processes, one error line
    ("partition",),  # stages of any causal LM
    ("optim",),  # Muon, AdamW, EF, the delay references (their parameter groups ask the partition plan)
    ("plan", "engine"),  # what a recipe will cost, nothing run; the engine protocol and the single-process engine
    ("pipeline",),  # the runtime: one stage's executor and its helpers
    ("eval",),  # perplexity and zero-shot tasks
    ("run",),  # one training run: the trainer, the components it wires, the checks before it starts
    ("testing",),  # the worker-process helper of the tests and benchmarks: imported by nothing in the package
    ("cli",),  # the commands; cli/train.py is the one entry point of a training process
    ("__main__",),
)
"""Floors of the package, lowest first. The root ``hf_asyncpp/__init__.py`` (the version, ``RecipeError`` and two lazy
names) is no floor: any unit may read ``__version__``."""
FLOOR = {unit: i for i, units in enumerate(LAYERS) for unit in units}
PURE = "schedules"
PURE_ALLOWED = {"matplotlib"}  # the timeline's drawing, imported where it draws
"""The schedule floor is pure Python: the recipe's checks, the planner and ``hf-asyncpp timeline`` import it cheaply."""
PURE_TORCH = "torch_orders.py"
"""The floor's one module that imports torch, inside the function that builds torch's virtual-stage orders: importing
the floor imports no torch."""


def unit(module: str) -> str:
    """``hf_asyncpp.pipeline.executor`` -> ``pipeline``; the root package -> ``__init__``."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def modules(root: Path) -> dict[str, Path]:
    """{dotted name: file} of the package's modules (folders without ``__init__.py``, e.g. the metric scripts that
    ``evaluate`` loads by path, are not modules of the package)."""
    out = {}
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root.parent).with_suffix("")
        if not all((root.parent / Path(*rel.parts[:i]) / "__init__.py").is_file() for i in range(1, len(rel.parts))):
            continue
        parts = rel.parts[:-1] if rel.name == "__init__" else rel.parts
        out[".".join(parts)] = path
    return out


def _resolve(name: str, known: dict[str, Path]) -> str | None:
    while name and name not in known:  # `from .export import shard_file`: the module, not the function
        name = name.rpartition(".")[0]
    return name or None


def import_graph(root: Path = PACKAGE) -> dict[str, set[str]]:
    """{module: the package's modules it imports}."""
    known = modules(root)
    graph = {}
    for name, path in known.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        targets = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets.update(_resolve(a.name, known) for a in node.names)
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    parent = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                    base = ".".join(parent + ([node.module] if node.module else []))
                for a in node.names:  # `from . import checkpoint` names a module; `from .x import f` a name in one
                    targets.add(_resolve(f"{base}.{a.name}", known) if f"{base}.{a.name}" in known else _resolve(base, known))
        graph[name] = {t for t in targets if t and t != name}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan), each as a sorted list."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def upward_imports(graph: dict[str, set[str]]) -> list[str]:
    """Every import from a unit to one on its own floor or above, as ``a -> b``."""
    out = []
    for a, targets in sorted(graph.items()):
        ua = unit(a)
        if ua == "__init__":
            continue
        for b in sorted(targets):
            ub = unit(b)
            if ub not in (ua, "__init__") and FLOOR[ub] >= FLOOR[ua]:
                out.append(f"{a} -> {b}")
    return out


def third_party_imports(root: Path, folder: str) -> set[str]:
    """Top-level names of what the modules of ``folder`` import from outside the package and the standard library
    (but torch inside a function of :data:`PURE_TORCH`)."""
    found = set()
    for path in sorted((root / folder).rglob("*.py")):
        tree = ast.parse(path.read_text(), str(path))
        in_functions = {id(n) for f in ast.walk(tree) if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef))
                        for n in ast.walk(f)} if path.name == PURE_TORCH else set()
        for node in ast.walk(tree):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import) else
                     [node.module] if isinstance(node, ast.ImportFrom) and not node.level else [])
            tops = {n.split(".")[0] for n in names if n and n.split(".")[0] not in sys.stdlib_module_names}
            found.update(tops - {"torch"} if id(node) in in_functions else tops)
    return found - {"hf_asyncpp", "__future__"}


def test_every_unit_has_a_floor():
    units = {unit(m) for m in import_graph()} - {"__init__"}
    assert units <= set(FLOOR), f"place these in LAYERS (and in docs/how-it-works.md): {sorted(units - set(FLOOR))}"
    assert set(FLOOR) <= units, f"LAYERS names units that no longer exist: {sorted(set(FLOOR) - units)}"


def test_the_package_has_no_import_cycle():
    assert cycles(import_graph()) == []


def test_no_import_climbs_a_floor():
    graph = import_graph()
    assert "hf_asyncpp.eval.lm_eval" in graph and "hf_asyncpp.pipeline.executor" in graph  # the walk sees the package
    assert upward_imports(graph) == []


def test_the_schedule_floor_is_pure_python():
    assert third_party_imports(PACKAGE, PURE) <= PURE_ALLOWED
    assert (PACKAGE / PURE / PURE_TORCH).is_file()


def _copy_with(tmp_path: Path, module: str, line: str) -> tuple[Path, dict[str, set[str]]]:
    """A copy of the package with ``line`` added to ``module`` as a function-local import (at the top of its first
    function or method), and the copy's graph."""
    root = tmp_path / "hf_asyncpp"
    shutil.copytree(PACKAGE, root, ignore=shutil.ignore_patterns("__pycache__"))
    path = root / module
    lines = path.read_text().splitlines(keepends=True)
    first = next(n for n in ast.walk(ast.parse("".join(lines))) if isinstance(n, ast.FunctionDef)).body[0]
    lines.insert(first.lineno - 1, " " * first.col_offset + line + "\n")
    path.write_text("".join(lines))
    ast.parse(path.read_text())  # still Python
    return root, import_graph(root)


def test_the_checks_catch_a_cycle_a_climb_and_torch_in_the_schedules(tmp_path):
    """The old shapes come back, each hidden in a function: the scorer reaching for the end of the run (a cycle and
    a climb), the executor importing the evaluator (a climb), the recipe reaching into the launcher (a climb), and
    torch in the schedule floor (and at the top of its one module that imports torch in a function)."""
    _, graph = _copy_with(tmp_path / "a", "eval/downstream.py", "from ..run.evaluator import Evaluator  # noqa")
    assert any({"hf_asyncpp.eval.downstream", "hf_asyncpp.run.evaluator"} <= set(c) for c in cycles(graph))
    assert "hf_asyncpp.eval.downstream -> hf_asyncpp.run.evaluator" in upward_imports(graph)
    _, graph = _copy_with(tmp_path / "b", "pipeline/executor.py", "from ..run.evaluator import Evaluator  # noqa")
    assert upward_imports(graph) == ["hf_asyncpp.pipeline.executor -> hf_asyncpp.run.evaluator"]
    _, graph = _copy_with(tmp_path / "c", "launch/spawn.py", "from ..run import trainer  # noqa")
    assert upward_imports(graph) == ["hf_asyncpp.launch.spawn -> hf_asyncpp.run.trainer"]
    root, _ = _copy_with(tmp_path / "d", "schedules/records.py", "import torch  # noqa")
    assert third_party_imports(root, PURE) - PURE_ALLOWED == {"torch"}
    root = tmp_path / "e" / "hf_asyncpp"  # torch at the top of the one module allowed it inside a function
    shutil.copytree(PACKAGE, root, ignore=shutil.ignore_patterns("__pycache__"))
    assert third_party_imports(root, PURE) <= PURE_ALLOWED
    (root / PURE / PURE_TORCH).write_text("import torch  # noqa\n" + (root / PURE / PURE_TORCH).read_text())
    assert third_party_imports(root, PURE) - PURE_ALLOWED == {"torch"}


# ---------------------------------------------------------------------------- the dependencies, declared

NOT_IMPORTED = {"tensorboard": "the shipped recipes' tracker, imported by accelerate's TensorBoardTracker",
                "zstandard": ".zst corpora: fsspec's zstd codec imports it when such a file is opened"}
"""Distributions ``install_requires`` names that the package never imports itself, each with why it is there."""


def _name(requirement: str) -> str:
    """A requirement's distribution name, normalized as PEP 503 does (``PyYAML`` -> ``pyyaml``)."""
    return re.sub(r"[-_.]+", "-", re.match(r"[A-Za-z0-9_.-]+", requirement).group()).lower()


def setup_requirements() -> tuple[list[str], dict[str, list[str]]]:
    """``install_requires`` and ``extras_require`` as setup.py writes them (literals, read with ``ast``)."""
    call = next(n for n in ast.walk(ast.parse((PACKAGE.parent / "setup.py").read_text()))
                if isinstance(n, ast.Call) and getattr(n.func, "id", None) == "setup")
    kw = {k.arg: ast.literal_eval(k.value) for k in call.keywords if k.arg in ("install_requires", "extras_require")}
    return kw["install_requires"], kw["extras_require"]


def test_every_third_party_import_is_declared_in_setup_py():
    """Each distribution the package imports is declared (not left for another package to pull in), and each hard
    requirement is imported or says why it is there; the import names map to distributions as the installed
    environment maps them (``yaml`` -> PyYAML)."""
    from importlib.metadata import packages_distributions

    requires, extras = setup_requirements()
    hard = {_name(r) for r in requires}
    optional = {_name(r) for rs in extras.values() for r in rs}
    dists = packages_distributions()
    imported = {_name(d) for module in third_party_imports(PACKAGE, "") for d in dists.get(module, [module])}
    assert {"torch", "transformers", "numpy", "pyyaml"} <= imported  # the walk and the mapping see the package
    assert sorted(imported - hard - optional) == [], "declare these in setup.py's install_requires"
    assert sorted(hard - imported - set(NOT_IMPORTED)) == [], "no longer imported: remove from install_requires"
    assert set(NOT_IMPORTED) <= hard


def test_setup_py_ranges_start_at_tested_versions():
    """Every requirement of setup.py (but the test tools) has a lower bound, and the versions the suite passed with
    (constraints.txt) satisfy it: an install that follows setup.py can get what was tested."""
    from packaging.requirements import Requirement

    requires, extras = setup_requirements()
    pins = {_name(line): line.split("==")[1].strip() for line in (PACKAGE.parent / "constraints.txt").read_text().splitlines()
            if "==" in line and not line.startswith("#")}
    for text in [*requires, *extras["eval"]]:
        req = Requirement(text)
        assert any(s.operator == ">=" for s in req.specifier), f"setup.py: {text} has no lower bound"
        pin = pins.get(_name(text))
        assert pin is not None and req.specifier.contains(pin), f"setup.py: {text} excludes the tested {pin}"


# ---------------------------------------------------------------------------- the maps, kept true

def _package_map():
    """scripts/package_map.py, loaded by path (scripts/ is no package)."""
    spec = importlib.util.spec_from_file_location("package_map", PACKAGE.parent / "scripts" / "package_map.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_every_folder_table_names_exactly_its_modules():
    pm = _package_map()
    wrong = {}
    for folder in pm.packages(PACKAGE):
        named = set(pm.table(pm.docstring(folder / "__init__.py")))
        if named != pm.modules(folder):
            wrong[folder.relative_to(PACKAGE.parent).as_posix()] = {
                "not in the table": sorted(pm.modules(folder) - named), "no such module": sorted(named - pm.modules(folder))}
    assert not wrong, f"fix the table in each folder's __init__.py docstring: {wrong}"
    assert set(pm.table(pm.docstring(PACKAGE / "__init__.py"))) == set(FLOOR), "the root table and LAYERS disagree"


def test_the_table_reader_sees_a_missing_and_a_stray_row(tmp_path):
    pm = _package_map()
    (tmp_path / "a.py").write_text("")
    (tmp_path / "b.py").write_text("")
    (tmp_path / "__init__.py").write_text('"""Two modules.\n\n=====  ====\n``a``  one\n``c``  gone\n       more\n=====  ====\n"""')
    assert pm.table(pm.docstring(tmp_path / "__init__.py")) == {"a": "one", "c": "gone more"}
    assert pm.modules(tmp_path) == {"a", "b"}


def test_the_docs_tree_is_the_generated_one():
    pm = _package_map()
    text = pm.DOC.read_text()
    assert pm.replace_in(text, pm.render()) == text, "regenerate it: python scripts/package_map.py --write"


def test_the_bench_index_lists_every_script():
    bench = PACKAGE.parent / "bench"
    scripts = {p.stem for p in bench.glob("*.py") if p.name != "__init__.py"}
    index = ast.get_docstring(ast.parse((bench / "__init__.py").read_text()))
    listed = {m.group(1) for m in re.finditer(r"^    ([a-z_]+)\s{2,}\S", index, re.M)}
    assert listed == scripts, (f"bench/__init__.py's index: add {sorted(scripts - listed)}, "
                               f"remove {sorted(listed - scripts)}")
    for name in scripts - {"report"}:  # each with the command that runs it
        assert f"bench.{name}" in index or f"bench/{name}.py" in index, name
