"""Typed recipe: YAML -> nested dataclasses, strictly validated.

Field names follow ``transformers.TrainingArguments`` where one exists, so HF
users can read a recipe without a manual. Every error names the dotted field and
what is allowed, because a typo in a 10-hour run's recipe should cost seconds.
"""
from __future__ import annotations

import codecs
import dataclasses
import difflib
import json
import logging
import os
import types
import typing
from dataclasses import dataclass, field
from typing import Any, Literal, Union

import yaml

from ..errors import RecipeError
from ..schedules.records import (NO_PIPELINE, SCHEDULES, get_schedule, get_simulated_delay, one_step_delay,
                                 pipelined)
from ..storage.write import write_file
from ..supervision import CHECKED, is_main_rank
from .names import FOREIGN_NAMES
from .optimizer import EF_LEARNED, OptimizerConfig
from .sections import ALTERNATIVES, DataConfig, EvalConfig, HubConfig, ModelConfig, PipelineConfig, TrainingConfig

log = logging.getLogger("hf_asyncpp")

__all__ = ["Recipe", "load_recipe", "recipe_from_dict", "recipe_to_dict", "apply_overrides", "save_recipe"]


@dataclass(kw_only=True)
class Recipe:
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    pipeline: PipelineConfig = field(default_factory=PipelineConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    training: TrainingConfig = field(default_factory=TrainingConfig)
    hub: HubConfig = field(default_factory=HubConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)

    @property
    def tokens_per_step(self) -> int:
        p = self.pipeline
        return p.num_microbatches * p.microbatch_size * self.data.seq_len


# ---------------------------------------------------------------- conversion


def _type_name(tp) -> str:
    origin = typing.get_origin(tp)
    if origin is Literal:
        return "one of " + ", ".join(repr(a) for a in typing.get_args(tp))
    if origin in (Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        inner = " or ".join(_type_name(a) for a in args)
        return f"{inner} or null" if len(args) < len(typing.get_args(tp)) else inner
    if origin is list:
        return f"a list of {_type_name(typing.get_args(tp)[0])}"
    if origin is dict or tp is dict:
        return "a mapping"
    return {int: "an integer", float: "a number", str: "a string", bool: "true or false"}.get(tp, str(tp))


def _got(value: Any) -> str:
    """How an error names a wrong value: a quoted number or boolean (``max_steps: "5"``) is a string to YAML, which
    the value's ``repr`` alone does not make plain."""
    if isinstance(value, str):
        try:
            plain = yaml.safe_load(value)
        except yaml.YAMLError:
            plain = value
        if isinstance(plain, (bool, int, float)):
            return f"the string {value!r} (quoted in the YAML: remove the quotes)"
    return repr(value)


def _convert(value: Any, tp, where: str):
    origin = typing.get_origin(tp)
    if origin in (Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None and type(None) in args:
            return None
        errors = []
        for a in args:
            if a is type(None):
                continue
            try:
                return _convert(value, a, where)
            except RecipeError as e:
                errors.append(e)
        raise RecipeError(f"{where}: expected {_type_name(tp)}, got {_got(value)}")
    if origin is Literal:
        allowed = typing.get_args(tp)
        # YAML reads `simulate_delay: 1` as an int; the allowed values are strings.
        cand = str(value) if isinstance(value, (int, str)) and not isinstance(value, bool) else value
        if cand not in allowed:
            raise RecipeError(f"{where}: {value!r} is not allowed; choose one of {', '.join(map(repr, allowed))}")
        return cand
    if origin is list:
        (inner,) = typing.get_args(tp)
        if isinstance(value, (str, int, float)) and not isinstance(value, bool) and inner is str:
            value = [value]  # `report_to: tensorboard` is a common shorthand
        if not isinstance(value, (list, tuple)):
            raise RecipeError(f"{where}: expected {_type_name(tp)}, got {_got(value)}")
        return [_convert(v, inner, f"{where}[{i}]") for i, v in enumerate(value)]
    if tp is dict or origin is dict:
        if not isinstance(value, dict):
            raise RecipeError(f"{where}: expected a mapping, got {value!r}")
        return dict(value)
    if tp is bool:
        if not isinstance(value, bool):
            raise RecipeError(f"{where}: expected true or false, got {_got(value)}")
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise RecipeError(f"{where}: expected an integer, got {_got(value)}")
        return value
    if tp is float:
        if isinstance(value, str):  # YAML 1.1 reads `3e-4` as a string
            try:
                value = float(value)
            except ValueError:
                pass
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise RecipeError(f"{where}: expected a number, got {_got(value)}")
        return float(value)
    if tp is str:
        if not isinstance(value, str):
            raise RecipeError(f"{where}: expected a string, got {value!r}")
        return value
    if dataclasses.is_dataclass(tp):
        return _build(tp, value, where)
    raise TypeError(f"unsupported recipe type {tp} at {where}")


def _check_range(value, meta, where):
    if value is None or isinstance(value, str) or not meta or "lo" not in meta:
        return  # a Literal alternative of a numeric field (ef_lambda: auto) has no range
    lo, hi, lo_open = meta["lo"], meta["hi"], meta["lo_open"]
    bad = (lo is not None and (value <= lo if lo_open else value < lo)) or (hi is not None and value > hi)
    if bad:
        lo_s = "" if lo is None else (f"> {lo}" if lo_open else f">= {lo}")
        hi_s = "" if hi is None else f"<= {hi}"
        allowed = " and ".join(s for s in (lo_s, hi_s) if s)
        raise RecipeError(f"{where}: {value!r} is out of range; allowed: {allowed}")


def _build(cls, data, where: str):
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise RecipeError(f"{where or 'recipe'}: expected a mapping of fields, got {data!r}")
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - set(fields))
    if unknown:
        raise RecipeError(_unknown_field(where, unknown[0], fields))
    kwargs = {}
    for name, value in data.items():
        dotted = f"{where}.{name}" if where else name
        kwargs[name] = _convert(value, hints[name], dotted)
        _check_range(kwargs[name], fields[name].metadata, dotted)
    return cls(**kwargs)


STOP_SIGNALS_ALLOWED = ("SIGTERM", "SIGINT", "SIGUSR1", "SIGUSR2", "SIGHUP", "SIGQUIT")


def _unknown_field(where: str, name: str, fields, *, flag: bool = False) -> str:
    """The error for ``name``, not a field of section ``where`` ("": the top level): the field that means the same
    when it is another tool's name (``FOREIGN_NAMES``) or a field of another section, else the closest field and the
    allowed ones. ``flag``: names written as on the command line (``--data.seq_len``)."""
    dash = "--" if flag else ""
    full = f"{dash}{where + '.' if where else ''}{name}"
    if name in FOREIGN_NAMES:
        whose, here, note = FOREIGN_NAMES[name]
        whose += "'" if whose.endswith("s") else "'s"
        if here is None:
            return f"{full}: {whose} name; {note}"
        return f"{full}: {whose} name; here it is {dash}{here}{f' ({note})' if note else ''}"
    elsewhere = [f"{dash}{s.name}.{name}" for s in dataclasses.fields(Recipe) if s.name != where
                 and name in {f.name for f in dataclasses.fields(typing.get_type_hints(Recipe)[s.name])}]
    if elsewhere:
        return f"{full}: unknown field{' of ' + where if where else ''}; here it is {' or '.join(elsewhere)}"
    near = difflib.get_close_matches(name, list(fields), n=1, cutoff=0.75)
    return (f"{full}: unknown field;{f' did you mean {near[0]!r}?' if near else ''} allowed fields"
            f"{' of ' + where if where else ''}: " + ", ".join(sorted(fields)))


def _cross_checks(r: Recipe) -> None:
    """Constraints between fields, named by the field a user would change."""
    if (r.model.config is None) == (r.model.name_or_path is None):
        both = "; both are set: remove one (--model.config=null removes the recipe's)" if r.model.config is not None else ""
        raise RecipeError(f"model: give exactly one of model.config (random init) or model.name_or_path{both}")
    if r.model.config is not None and "model_type" not in r.model.config:
        raise RecipeError("model.config.model_type: missing; give a transformers model_type such as 'llama'")
    bad = [n for n in r.training.stop_signals if n not in STOP_SIGNALS_ALLOWED]
    if bad:
        raise RecipeError(f"training.stop_signals: {', '.join(map(repr, bad))} cannot be caught for a safe stop; choose from "
                          f"{', '.join(STOP_SIGNALS_ALLOWED)} ([] keeps the signals' default)")
    p = r.pipeline
    delay = get_simulated_delay(r.optimizer.simulate_delay)
    o = r.optimizer
    if not pipelined(p.schedule) and p.num_stages != 1 and not delay.per_stage and o.ef_lambda != EF_LEARNED:
        raise RecipeError(f"pipeline.num_stages: {p.num_stages} needs a pipeline schedule; set pipeline.schedule to one of {', '.join(SCHEDULES)}")
    record = get_schedule(p.schedule) if pipelined(p.schedule) else None
    if record is not None and not record.runs_in_executor:
        raise RecipeError(f"pipeline.schedule: {p.schedule!r} holds {record.stages_per_rank} stages per process, and the "
                          f"executor runs one stage per process: interleaved and V-shaped schedules are planner-only for "
                          f"now (hf-asyncpp plan compares them with these for any recipe); train with one of "
                          f"{', '.join(SCHEDULES)}")
    if record is not None and record.split_backward and r.training.compiles():
        raise RecipeError(f"pipeline.schedule: {p.schedule!r} with training.torch_compile on (unset: on where a GPU "
                          f"trains) runs each compiled layer's whole backward twice, in I and in W (the compiled "
                          f"backward computes every gradient); use pipeline.schedule: 1f1b or 2bw, or set "
                          f"training.torch_compile: false")
    if p.schedule in SCHEDULES:  # the schedule's own constraints (m >= p for 2bw, ...), named by their knob
        try:
            SCHEDULES[p.schedule].check(p.num_stages, p.num_microbatches, p.extra_warmup)
        except ValueError as e:
            raise RecipeError(_knob(str(e))) from None
    if p.split is not None and len(p.split) != p.num_stages:
        raise RecipeError(f"pipeline.layers_per_stage: {len(p.layers_per_stage)} entries for {p.num_stages} stages; give one per stage")
    one_step = one_step_delay(p.schedule, o.simulate_delay)
    if o.ef_lambda == EF_LEARNED and (o.delay_correction != "error_feedback" or not one_step):
        raise RecipeError("optimizer.ef_lambda: learned needs optimizer.delay_correction: error_feedback under a one-step "
                          f"delay (pipeline.schedule: 2bw, or optimizer.simulate_delay: 1); here the schedule is "
                          f"{p.schedule!r} and simulate_delay {o.simulate_delay!r}")
    if o.fused and o.name != "adamw":
        raise RecipeError(f"optimizer.fused: true is torch's fused AdamW kernel; it needs optimizer.name: adamw, not "
                          f"{o.name!r} (allowed with fused: adamw)")
    if o.shard_across_replicas and o.ef_lambda == EF_LEARNED:
        raise RecipeError("optimizer.shard_across_replicas: true does not support optimizer.ef_lambda: learned (its "
                          "cosine spans every tensor of the stage); use a number or 'auto', or do not shard")
    if o.delay_start_step and not one_step:
        raise RecipeError(f"optimizer.delay_start_step: {o.delay_start_step} starts a one-step delay late; it needs "
                          f"pipeline.schedule: 2bw (or simulate_delay: 1 with schedule none), not {p.schedule!r}")
    if delay.delayed and pipelined(p.schedule):
        raise RecipeError(
            f"optimizer.simulate_delay: {r.optimizer.simulate_delay!r} is a single-process research mode; "
            f"use it with pipeline.schedule {NO_PIPELINE!r} (the {p.schedule!r} schedule produces its delay for real)"
        )
    t = r.training
    if isinstance(t.resume_from_checkpoint, bool):  # the Trainer's boolean: true resumes the newest checkpoint
        t.resume_from_checkpoint = "latest" if t.resume_from_checkpoint else None
    if isinstance(t.warmup_steps, float) and t.warmup_steps >= 1 and not t.warmup_steps.is_integer():
        raise RecipeError(f"training.warmup_steps: {t.warmup_steps} is neither a number of steps (an integer) nor a "
                          "fraction of max_steps (below 1)")
    if isinstance(t.warmup_steps, float) and t.warmup_steps >= 1:
        t.warmup_steps = int(t.warmup_steps)
    if t.warmup_ratio is not None:
        if t.warmup_steps:
            raise RecipeError("training.warmup_ratio: deprecated and given together with training.warmup_steps; "
                              f"keep only warmup_steps: {t.warmup_ratio} (a number below 1 is a fraction of max_steps)")
        _say_once(f"training.warmup_ratio is deprecated (as in transformers 5): write warmup_steps: {t.warmup_ratio} "
                  "(a number below 1 is a fraction of max_steps)")
    if t.lr_scheduler_type == "constant" and (t.warmup_steps or t.warmup_ratio):
        _say_once("training.lr_scheduler_type: constant has no warm-up (transformers' meaning); the warm-up is "
                  "ignored. For a warm-up use lr_scheduler_type: constant_with_warmup")
    if r.hub.push_to_hub and not r.hub.hub_model_id:
        raise RecipeError("hub.hub_model_id: required when hub.push_to_hub is true (e.g. 'user/my-model')")
    if r.data.train_files is not None and r.data.dataset is not None:
        raise RecipeError("data: give data.train_files or data.dataset, not both: remove one (--data.dataset=null "
                          "removes the recipe's)")
    _check_encoding(r.data.encoding)


_ASCII = bytes(range(128))


def _check_encoding(name: str) -> None:
    """``data.encoding`` is a text codec that reads ASCII bytes as ASCII: the file screening and datasets' json
    builder find lines, JSON syntax and NUL bytes by their bytes, before decoding (UTF-16 or EBCDIC would break both)."""
    try:
        codecs.lookup(name)
        keeps_ascii = _ASCII.decode(name) == _ASCII.decode("ascii")
    except (LookupError, ValueError):  # an unknown name; a codec of bytes to bytes (base64) or text to text (rot13)
        raise RecipeError(f"data.encoding: {name!r} is not a text encoding Python knows; give a codec name such as "
                          "utf-8, latin-1 or cp1252") from None
    if not keeps_ascii:
        raise RecipeError(f"data.encoding: {name!r} does not read ASCII bytes as ASCII, which reading lines and JSON "
                          f"needs; convert the files to UTF-8 (e.g. iconv -f {name} -t utf-8) and leave data.encoding unset")


def recipe_from_dict(data: dict) -> Recipe:
    r = _build(Recipe, data, "")
    _cross_checks(r)
    return r


def recipe_to_dict(r: Recipe) -> dict:
    return dataclasses.asdict(r)


def _parse_scalar(text: str):
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError:
        return text


def apply_overrides(data: dict, overrides: list[str]) -> dict:
    """Apply command-line overrides to a raw recipe dict: ``--section.field=value`` or ``--section.field value``
    (values parsed as YAML; a bare ``--section.flag`` is true for a true/false field), as the HF Trainer's
    ``HfArgumentParser`` and torchtitan read them. Each names a field of the recipe or a key inside a mapping field
    (``--model.config.hidden_size``); another name is an error naming the field meant, before anything else is read.
    A field given here replaces its alternative in the file (:func:`_yield_to_command_line`)."""
    data = json.loads(json.dumps(data))  # deep copy of plain data
    given = set()
    for key, value in _pairs(overrides):
        parts = key.split(".")
        node = data
        for part in parts[:-1]:
            nxt = node.setdefault(part, {})
            if not isinstance(nxt, dict):
                raise RecipeError(f"override --{key}: {part} is not a section")
            node = nxt
        node[parts[-1]] = _parse_scalar(value)
        given.add(key)
    _yield_to_command_line(data, given)
    return data


def split_overrides(argv: list[str]) -> tuple[list[str], list[str]]:
    """(the tool's own arguments, the recipe overrides) of a command line that mixes them (``hf-asyncpp plan``,
    ``compare``): an override is a ``--`` option whose name has a dot (``--training.max_steps=5`` or
    ``--training.max_steps 5``, the value then the next argument unless that is an option), as ``train`` reads
    them; the tools' own options have no dot in their names, so argparse never sees an override's value."""
    own, overrides, i = [], [], 0
    while i < len(argv):
        arg = argv[i]
        if arg.startswith("--") and "." in arg.partition("=")[0]:
            overrides.append(arg)
            if "=" not in arg and i + 1 < len(argv) and not argv[i + 1].startswith("--"):
                i += 1
                overrides.append(argv[i])
        else:
            own.append(arg)
        i += 1
    return own, overrides


def _pairs(args: list[str]) -> list[tuple[str, str]]:
    """(dotted field, value text) of each override. A ``--field`` without ``=`` takes the next argument as its value
    unless that is another ``--`` option or there is none: then it is ``true`` for a true/false field (as
    ``--bf16`` is for the Trainer) and an error naming the field otherwise, never a silent default."""
    out, i = [], 0
    while i < len(args):
        arg = args[i]
        if not arg.startswith("--"):
            raise RecipeError(f"override {arg!r}: expected --section.field=value or --section.field value, e.g. "
                              "--training.max_steps=50")
        key, eq, value = arg[2:].partition("=")
        tp = _field_type(key)
        if not eq:
            if i + 1 < len(args) and not args[i + 1].startswith("--"):
                i += 1
                value = args[i]
            elif _takes_bool(tp):
                value = "true"
            else:
                kind = f" ({_type_name(tp)})" if tp is not None else ""
                raise RecipeError(f"--{key}: no value given{kind}; write --{key}=VALUE or --{key} VALUE")
        out.append((key, value))
        i += 1
    return out


def _field_type(key: str):
    """The type of the recipe field a dotted key names; None for a key inside a mapping field (``model.config.*``,
    whose keys the model's config class checks: ``run/preflight.py``). An unknown name is an error naming the field
    meant (:func:`_unknown_field`), written as on the command line."""
    cls, where, parts = Recipe, "", key.split(".")
    for i, part in enumerate(parts):
        names = [f.name for f in dataclasses.fields(cls)]
        if part not in names:
            raise RecipeError(_unknown_field(where, part, names, flag=True))
        tp = typing.get_type_hints(cls)[part]
        where = f"{where}.{part}" if where else part
        if i == len(parts) - 1:
            return tp
        if dataclasses.is_dataclass(tp):
            cls = tp
        elif any(a is dict or typing.get_origin(a) is dict for a in (typing.get_args(tp) or (tp,))):
            return None
        else:
            raise RecipeError(f"override --{key}: {where} is a field ({_type_name(tp)}), not a section")
    return None


def _takes_bool(tp) -> bool:
    """Whether a field's type admits true/false (``bool``, ``Optional[bool]``, ``resume_from_checkpoint``'s union)."""
    return tp is bool or bool in typing.get_args(tp)


def _yield_to_command_line(data: dict, given: set[str]) -> None:
    """Of two alternative fields (``ALTERNATIVES``), one given on the command line replaces the recipe file's other:
    ``--model.name_or_path=my-model`` over a random-init recipe means "train my-model", not "give both"."""
    for section, a, b in ALTERNATIVES:
        node = data.get(section)
        for mine, other in ((a, b), (b, a)):
            if (isinstance(node, dict) and f"{section}.{mine}" in given and f"{section}.{other}" not in given
                    and node.get(mine) is not None and node.get(other) is not None):
                del node[other]
                _say_once(f"--{section}.{mine} replaces the recipe's {section}.{other} (a recipe gives one of the two)")


_SAID: set[str] = set()


def _say_once(message: str) -> None:
    """A warning about the recipe said by one process of a run, once: the process that starts the ranks (it loads
    the recipe twice: the command, then the checks), or rank 0 under an outside launcher."""
    if is_main_rank() and not os.environ.get(CHECKED) and message not in _SAID:
        _SAID.add(message)
        log.warning(message)


def load_recipe(path: str | os.PathLike, overrides: list[str] | None = None) -> Recipe:
    try:
        with open(path) as f:
            data = yaml.safe_load(f) or {}
    except FileNotFoundError:
        raise RecipeError(f"recipe file {str(path)!r} not found") from None
    except IsADirectoryError:
        raise RecipeError(f"recipe file {str(path)!r} is a folder; give the recipe's YAML file (e.g. "
                          "recipes/cpu-tiny.yaml)") from None
    except UnicodeDecodeError as e:
        raise RecipeError(f"recipe file {str(path)!r} is not UTF-8 text ({e.reason} at byte {e.start}); "
                          "save it as UTF-8") from None
    except yaml.YAMLError as e:
        raise RecipeError(f"recipe file {str(path)!r} is not valid YAML: {e}") from None
    if not isinstance(data, dict):
        raise RecipeError(f"recipe file {str(path)!r} holds a YAML {type(data).__name__}, not a mapping of sections "
                          "(model:, data:, training:, ...); see recipes/cpu-tiny.yaml")
    return recipe_from_dict(apply_overrides(data, overrides or []))


def save_recipe(r: Recipe, path: str | os.PathLike) -> None:
    """Write the resolved recipe (every default filled in) next to the run's outputs."""
    text = yaml.safe_dump(recipe_to_dict(r), sort_keys=False)
    write_file(path, lambda f: f.write(text.encode("utf-8")))


def _knob(message: str) -> str:
    """A schedule record's message, led by the recipe field a user would change."""
    if "extra_warmup" in message:
        return message if message.startswith("pipeline.") else f"pipeline.extra_warmup: {message}"
    return f"pipeline.num_microbatches: {message}"
