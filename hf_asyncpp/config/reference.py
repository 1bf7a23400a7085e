"""Every recipe field with its type, range, default and meaning, read from the dataclasses themselves.

``hf-asyncpp train --help`` prints it and ``scripts/recipe_reference.py`` writes docs/recipes.md from it, so neither
can drift from the code. A field's meaning is the docstring that follows it in the source (an attribute docstring,
which Python keeps only in the source text): the modules are read once, with ``ast``.
"""
from __future__ import annotations

import ast
import dataclasses
import inspect
import re
import typing
from dataclasses import dataclass

import yaml

from .names import FOREIGN_NAMES
from .recipe import Recipe, _type_name

__all__ = ["Field", "field_docs", "recipe_fields", "help_text"]

LINE = 120
"""Characters per line of the help text."""


@dataclass(frozen=True)
class Field:
    section: str
    name: str
    type: str
    """The type in words, with its range (``an integer (>= 1)``)."""
    default: typing.Any
    doc: str

    @property
    def dotted(self) -> str:
        return f"{self.section}.{self.name}"


def field_docs(source: str) -> dict[tuple[str, str], str]:
    """(class, field) -> the docstring that follows the field in the source (attribute docstrings)."""
    out = {}
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ClassDef):
            body = node.body
            for a, b in zip(body, body[1:]):
                if (isinstance(a, ast.AnnAssign) and isinstance(b, ast.Expr)
                        and isinstance(getattr(b, "value", None), ast.Constant)):
                    out[(node.name, a.target.id)] = " ".join(str(b.value.value).split())
    return out


def _range(meta) -> str:
    if not meta or (meta.get("lo") is None and meta.get("hi") is None):
        return ""
    lo = "" if meta.get("lo") is None else (f"> {meta['lo']}" if meta.get("lo_open") else f">= {meta['lo']}")
    hi = "" if meta.get("hi") is None else f"<= {meta['hi']}"
    return " (" + " and ".join(x for x in (lo, hi) if x) + ")"


def recipe_fields() -> list[Field]:
    """The recipe's fields, section by section, in declaration order."""
    sections = typing.get_type_hints(Recipe)
    docs = {}  # a section may live in another module (config/sections.py; config/optimizer.py)
    for path in {inspect.getsourcefile(sections[s.name]) for s in dataclasses.fields(Recipe)}:
        with open(path, encoding="utf-8") as fh:
            docs.update(field_docs(fh.read()))
    out = []
    for section in dataclasses.fields(Recipe):
        cls = sections[section.name]
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
            out.append(Field(section.name, f.name, _type_name(hints[f.name]) + _range(f.metadata), default,
                             docs.get((cls.__name__, f.name), "")))
    return out


def _cut(text: str, width: int) -> str:
    """``text`` cut at a word to ``width`` characters."""
    return text if len(text) <= width else text[:width - 3].rsplit(" ", 1)[0].rstrip(",;:") + "..."


def _first_sentence(doc: str) -> str:
    """A docstring's first sentence, without its RST markup (an ellipsis ``...`` ends none)."""
    return re.split(r"(?<![.\s])(?<!e\.g)(?<!i\.e)\.(?:\s|$)", doc.replace("``", ""), maxsplit=1)[0]


def as_typed(value) -> str:
    """A default as it is written on the command line (YAML: ``null``, ``true``, ``[tensorboard]``)."""
    text = yaml.safe_dump(value, default_flow_style=True, width=10**6).strip()
    return text[:-4].strip() if text.endswith("\n...") else text


def help_text(usage: str) -> str:
    """``hf-asyncpp train --help``: the usage, how overrides are written, and every field with its default."""
    lines = [usage, "",
             "Pretrain a transformers causal LM from a recipe (YAML; recipes/ has examples). Any field below can be",
             "overridden: --section.field=value or --section.field value (a YAML value: 50, 3e-4, true, [a, b],",
             "{key: value}); a bare --section.flag sets a true/false field to true. --debug shows the traceback",
             "behind an error: line. Names from the HF Trainer, run_clm and trl (--learning_rate, --block_size,",
             f"--dataset_name, ...; {len(FOREIGN_NAMES)} in all) are answered with the field that means the same here.",
             "", "fields (default; docs/recipes.md has each in full):"]
    fields = recipe_fields()
    width = min(max(len(f"--{f.dotted}={as_typed(f.default)}") for f in fields), 40)
    section = None
    for f in fields:
        if f.section != section:
            section = f.section
            lines.append(f"  {section}:")
        flag = f"--{f.dotted}={as_typed(f.default)}"
        what = _cut(f.type + (f": {_first_sentence(f.doc)}" if f.doc else ""), LINE - 6 - width)
        lines.append(f"    {flag:<{width}}  {what}" if len(flag) <= width else f"    {flag}\n    {'':<{width}}  {what}")
    return "\n".join(lines)
