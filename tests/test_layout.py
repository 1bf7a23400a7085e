"""The package's import graph keeps its shape: no cycle, and the core never reaches evaluation, the card or the Hub.

The graph is read from the source with ``ast`` (every ``import`` and ``from ... import``, function-local ones
included, relative ones resolved), so an import hidden in a function to dodge a cycle counts like any other. The
core (the engines, the pipeline, the optimizers, the partitioner, the checkpoint layout) must not reach, directly
or through any chain of imports, the modules that evaluate a model, write its card, push it, or call the export:
``export.py`` sits under the engines only because it writes folders and nothing else.
"""
from __future__ import annotations

import ast
import shutil
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "hf_asyncpp"
CORE = ("hf_asyncpp.pipeline", "hf_asyncpp.optim", "hf_asyncpp.partition", "hf_asyncpp.engine", "hf_asyncpp.checkpoint")
ABOVE_CORE = ("hf_asyncpp.eval", "hf_asyncpp.evaluator", "hf_asyncpp.model_card", "hf_asyncpp.hub",
              "hf_asyncpp.trainer", "hf_asyncpp.checkpointer", "hf_asyncpp.cli")
"""Evaluation, the card, the Hub, and export's callers (the trainer, the checkpointer, the CLI)."""


def _within(name: str, prefixes) -> bool:
    return any(name == p or name.startswith(p + ".") for p in prefixes)


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


def core_violations(graph: dict[str, set[str]]) -> list[str]:
    """Every chain of imports from a core module to a module above it, as ``a -> b -> ... -> z``."""
    out = []
    for start in sorted(m for m in graph if _within(m, CORE)):
        seen, todo = {start: [start]}, [start]
        while todo:
            v = todo.pop()
            for w in sorted(graph.get(v, ())):
                if w not in seen:
                    seen[w] = seen[v] + [w]
                    todo.append(w)
        out += [" -> ".join(chain) for m, chain in sorted(seen.items()) if _within(m, ABOVE_CORE)]
    return out


def test_the_package_has_no_import_cycle():
    assert cycles(import_graph()) == []


def test_the_core_never_reaches_evaluation_the_card_or_the_hub():
    graph = import_graph()
    assert "hf_asyncpp.eval.tasks" in graph and "hf_asyncpp.pipeline.executor" in graph  # the walk sees the package
    assert core_violations(graph) == []


def test_export_writes_folders_and_imports_nothing_above_it():
    reach = import_graph()["hf_asyncpp.export"]
    assert not [m for m in reach if _within(m, ABOVE_CORE + ("hf_asyncpp.reporting",))], reach


def _copy_with(tmp_path: Path, module: str, line: str) -> dict[str, set[str]]:
    """The graph of a copy of the package with ``line`` added to ``module`` as a function-local import (at the top
    of its first function or method)."""
    root = tmp_path / "hf_asyncpp"
    shutil.copytree(PACKAGE, root, ignore=shutil.ignore_patterns("__pycache__"))
    path = root / module
    lines = path.read_text().splitlines(keepends=True)
    first = next(n for n in ast.walk(ast.parse("".join(lines))) if isinstance(n, ast.FunctionDef)).body[0]
    lines.insert(first.lineno - 1, " " * first.col_offset + line + "\n")
    path.write_text("".join(lines))
    ast.parse(path.read_text())  # still Python
    return import_graph(root)


def test_the_checks_catch_a_reintroduced_cycle_and_a_core_import(tmp_path):
    """The old shape comes back in three ways, each hidden in a function: the scorer reaching for the end of the run
    (a cycle), an engine importing the evaluator, and the folder writer importing the card (which pulls evaluation
    under every engine)."""
    graph = _copy_with(tmp_path / "a", "eval/downstream.py", "from ..evaluator import Evaluator  # noqa")
    assert any({"hf_asyncpp.eval.downstream", "hf_asyncpp.evaluator"} <= set(c) for c in cycles(graph))
    graph = _copy_with(tmp_path / "b", "pipeline/executor.py", "from ..evaluator import Evaluator  # noqa")
    assert "hf_asyncpp.pipeline.executor -> hf_asyncpp.evaluator" in core_violations(graph)
    graph = _copy_with(tmp_path / "c", "export.py", "from .model_card import card_writer  # noqa")
    assert "hf_asyncpp.engine -> hf_asyncpp.export -> hf_asyncpp.model_card" in core_violations(graph)
