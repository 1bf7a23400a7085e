"""Starting the stage processes when no launcher did, so the documented command just works.

A recipe with p pipeline stages needs p processes. ``accelerate launch`` without a multi-process config (on a
CPU-only machine it starts one process), ``python scripts/pretrain.py`` and ``hf-asyncpp train`` all start one.
Then, rather than stopping, the trainer hands over to ``torch.distributed.run`` (torchrun's own code: rendezvous
on a free local port, one worker per stage, a dead worker ends the others): on CPU with gloo, on a machine with at
least p GPUs with NCCL, and with fewer GPUs than stages with gloo and the stages sharing the GPUs (NCCL refuses two
ranks on one GPU). A process started by a launcher (``WORLD_SIZE`` set: torchrun, ``accelerate launch`` with a
multi-process config, MPI) is used as it is; ``HF_ASYNCPP_NO_SPAWN=1`` turns the hand-over off (the trainer then
stops with the command to run). The processes started here report an error through ``failures.py``: the user sees
one ``error:`` line, the first cause, in place of one per rank and torchrun's own failure report.

SLURM's ``srun`` starts the tasks itself (one per GPU) but sets only ``SLURM_*`` variables, none of the ``RANK``,
``WORLD_SIZE``, ``MASTER_ADDR`` that ``torch.distributed`` reads: a task of an srun step with more than one task is
a launched rank too (:func:`slurm_step_tasks`), and :func:`adopt_slurm` fills torch's variables from SLURM's before
the process group is created (``trainer.train`` calls it first).
"""
from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import zlib
from collections.abc import Callable, Iterator, Mapping, MutableMapping
from pathlib import Path

import psutil
import torch
from torch.distributed import run as torchrun
from torch.distributed.elastic.multiprocessing.api import SignalException
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

from ..config.recipe import Recipe
from ..errors import LaunchError, RecipeError
from ..schedules.records import processes_per_pipeline
from ..storage.shipped import shipped_file
from ..supervision import CHECKED
from .failures import DEBUG_ENV, ERROR_DIR, finished, first_error, stop_record

log = logging.getLogger("hf_asyncpp")

NO_SPAWN = "HF_ASYNCPP_NO_SPAWN"
_TORCH_LAUNCHER_VARS = ("WORLD_SIZE", "LOCAL_RANK")  # torchrun, accelerate launch, or adopt_slurm already ran
_LAUNCHER_VARS = (*_TORCH_LAUNCHER_VARS, "OMPI_COMM_WORLD_SIZE", "PMI_SIZE")


def processes_needed(recipe: Recipe) -> int:
    """Processes per pipeline (1 for ``schedule: none``, where num_stages only shapes a simulated delay)."""
    return processes_per_pipeline(recipe.pipeline.schedule, recipe.pipeline.num_stages)


def started_by_launcher(env: Mapping[str, str] | None = None) -> bool:
    """Whether another program started this process as one rank of several: then it must not start its own."""
    env = os.environ if env is None else env
    return slurm_step_tasks(env) > 1 or any(v in env for v in _LAUNCHER_VARS)


def should_spawn(recipe: Recipe, env: Mapping[str, str] | None = None) -> bool:
    """Whether this one process starts the recipe's stage processes itself (nobody else started them)."""
    env = os.environ if env is None else env
    return processes_needed(recipe) > 1 and not started_by_launcher(env) and env.get(NO_SPAWN, "0") in ("", "0")


# ---------------------------------------------------------------------------- SLURM's srun as the launcher

SLURM_PORT_BASE = 20000
SLURM_PORT_SPAN = 10000
"""MASTER_PORT under srun: ``20000 + SLURM_JOB_ID % 10000``. Every task of the job computes the same port without
talking to the others; the range is unprivileged and below Linux's ephemeral ports (32768-60999), so an outgoing
connection cannot already hold it; two jobs share a port only if their ids differ by a multiple of 10000 and they
share the first node. Set MASTER_PORT to choose another (two concurrent srun steps of one job need that)."""


def slurm_step_tasks(env: Mapping[str, str]) -> int:
    """The number of tasks of the srun step this process is one of; 0 when it is not a task of an srun step or
    another launcher (torchrun, accelerate, MPI) started it, even inside an srun step.

    An srun step is told apart by ``SLURM_STEP_ID``: an ``sbatch`` script's own shell also has ``SLURM_NTASKS`` (the
    job's task count) and ``SLURM_PROCID=0``, but no step id, and a program it runs directly is one process, not
    one of N. ``SLURM_STEP_NUM_TASKS`` is the step's count even under ``srun --preserve-env``, which keeps the
    job's ``SLURM_NTASKS``. An MPI launcher under SLURM (``mpirun``, hydra) starts its daemons as an srun step of one
    task per node, so its ranks see that step's SLURM variables: ``OMPI_COMM_WORLD_SIZE``, or a ``PMI_SIZE`` other
    than the step's task count, leaves them to the MPI variables. srun's own PMI plugin (``--mpi=pmi2``) sets
    ``PMI_SIZE`` equal to the step's count, and then srun is the launcher."""
    if any(v in env for v in (*_TORCH_LAUNCHER_VARS, "OMPI_COMM_WORLD_SIZE")) or "SLURM_PROCID" not in env:
        return 0
    if "SLURM_STEP_ID" not in env and "SLURM_STEPID" not in env:
        return 0
    name = next((n for n in ("SLURM_STEP_NUM_TASKS", "SLURM_NTASKS", "SLURM_NPROCS") if env.get(n)), None)
    tasks = _slurm_int(env, name) if name else 1
    return tasks if env.get("PMI_SIZE", str(tasks)) == str(tasks) else 0


def _slurm_int(env: Mapping[str, str], name: str) -> int:
    """An integer SLURM variable; a LaunchError naming it when it is missing or not a number (a wrapper mangled it)."""
    raw = env.get(name, "")
    try:
        return int(raw)
    except ValueError:
        raise LaunchError(f"SLURM: {name}={raw!r} is missing or not an integer; run the training under srun unchanged, "
                          "or set RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and MASTER_PORT yourself") from None


def _split_top_level(text: str) -> list[str]:
    """Split a SLURM list at the commas outside brackets: ``a[1,3],b`` is ``a[1,3]`` and ``b``."""
    parts, depth, start = [], 0, 0
    for i, ch in enumerate(text):
        depth += ch == "["
        depth -= ch == "]"
        if depth < 0 or depth > 1:
            raise ValueError(f"unbalanced brackets in {text!r}")
        if ch == "," and depth == 0:
            parts.append(text[start:i])
            start = i + 1
    if depth:
        raise ValueError(f"unbalanced brackets in {text!r}")
    parts.append(text[start:])
    return [p for p in parts if p]


def _expand_host(pattern: str) -> list[str]:
    """One host pattern, ``gpu[001-003,007]`` or ``r[1-2]n[1-2]``, in SLURM's order; ranges keep their zero padding."""
    m = re.search(r"\[([^\[\]]*)\]", pattern)
    if m is None:
        return [pattern]
    values = []
    for item in m.group(1).split(","):
        lo, dash, hi = item.partition("-")
        if not lo.isdigit() or (dash and not hi.isdigit()):
            raise ValueError(f"{item!r} is not a number or a range of numbers in {pattern!r}")
        values += ([f"{n:0{len(lo)}d}" for n in range(int(lo), int(hi) + 1)] if dash else [lo])
    head, tails = pattern[:m.start()], _expand_host(pattern[m.end():])
    return [head + v + tail for v in values for tail in tails]


def expand_nodelist(nodelist: str) -> list[str]:
    """SLURM's compressed host list (``gpu[001-003,007],login1``) as host names, in order, done in Python so that
    no SLURM command is needed where the training runs; ValueError on a form it does not know."""
    return [host for part in _split_top_level(nodelist.strip()) for host in _expand_host(part)]


def _first_host(nodelist: str) -> str:
    """The first host of a SLURM node list: expanded in Python, else by ``scontrol show hostnames`` where it exists."""
    try:
        return expand_nodelist(nodelist)[0]
    except (ValueError, IndexError) as e:
        hosts = _scontrol_hostnames(nodelist)
        if hosts:
            return hosts[0]
        raise LaunchError(f"SLURM: cannot read the node list {nodelist!r} ({e}); set MASTER_ADDR to the host name of "
                          "the step's first node (where task 0 runs)") from None


def _scontrol_hostnames(nodelist: str) -> list[str]:
    """``scontrol show hostnames`` where SLURM's commands are installed, for a node list form Python does not read;
    empty when there is no scontrol or it fails."""
    scontrol = shutil.which("scontrol")
    if not scontrol:
        return []
    try:
        r = subprocess.run([scontrol, "show", "hostnames", nodelist], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return []
    return r.stdout.split() if r.returncode == 0 else []


def _expand_counts(counts: str) -> list[int]:
    """SLURM's per-node counts, ``2(x3),1`` = [2, 2, 2, 1]."""
    out = []
    for item in counts.split(","):
        m = re.fullmatch(r"\s*(\d+)(?:\(x(\d+)\))?\s*", item)
        if m is None:
            raise ValueError(item)
        out += [int(m.group(1))] * int(m.group(2) or 1)
    return out


def _tasks_on_this_node(env: Mapping[str, str], tasks: int) -> int:
    """LOCAL_WORLD_SIZE: this node's entry of the step's tasks per node, else an even share of the tasks."""
    node = _slurm_int(env, "SLURM_NODEID") if "SLURM_NODEID" in env else 0
    for name in ("SLURM_STEP_TASKS_PER_NODE", "SLURM_TASKS_PER_NODE"):
        try:
            counts = _expand_counts(env[name])
            return counts[node]
        except (KeyError, ValueError, IndexError):
            continue
    if env.get("SLURM_NTASKS_PER_NODE", "").isdigit():
        return int(env["SLURM_NTASKS_PER_NODE"])
    nodes = env.get("SLURM_STEP_NUM_NODES") or env.get("SLURM_NNODES") or "1"
    return max(1, tasks // max(1, int(nodes) if nodes.isdigit() else 1))


def slurm_master_port(job_id: str) -> int:
    """The rendezvous port of a job (see SLURM_PORT_BASE); a non-numeric id is hashed (crc32, stable)."""
    n = int(job_id) if job_id.isdigit() else zlib.crc32(job_id.encode())
    return SLURM_PORT_BASE + n % SLURM_PORT_SPAN


def slurm_mapping(env: Mapping[str, str]) -> dict[str, str]:
    """torch.distributed's variables for a task of an srun step with more than one task (empty otherwise): RANK from
    SLURM_PROCID, WORLD_SIZE from the step's task count, LOCAL_RANK from SLURM_LOCALID, LOCAL_WORLD_SIZE from the
    tasks on this node, and, only where the user did not set them, MASTER_ADDR (the step's first node, where srun
    puts task 0) and MASTER_PORT (from the job id: every task derives the same one)."""
    tasks = slurm_step_tasks(env)
    if tasks <= 1:
        return {}
    rank = _slurm_int(env, "SLURM_PROCID")
    if not 0 <= rank < tasks:
        raise LaunchError(f"SLURM: SLURM_PROCID={rank} is not a task of a {tasks}-task step; run under srun unchanged")
    out = {"RANK": str(rank), "WORLD_SIZE": str(tasks), "LOCAL_RANK": str(_slurm_int(env, "SLURM_LOCALID")),
           "LOCAL_WORLD_SIZE": str(_tasks_on_this_node(env, tasks))}
    if not env.get("MASTER_ADDR"):
        nodelist = env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST")
        if not nodelist:
            raise LaunchError("SLURM: no SLURM_STEP_NODELIST or SLURM_JOB_NODELIST to take MASTER_ADDR from; set "
                              "MASTER_ADDR to the host name of the step's first node")
        out["MASTER_ADDR"] = _first_host(nodelist)
    if not env.get("MASTER_PORT"):
        job = env.get("SLURM_JOB_ID") or env.get("SLURM_JOBID")
        if not job:
            raise LaunchError("SLURM: no SLURM_JOB_ID to derive MASTER_PORT from; set MASTER_PORT (the same on every task)")
        out["MASTER_PORT"] = str(slurm_master_port(job))
    return out


def adopt_slurm(env: MutableMapping[str, str] | None = None) -> dict[str, str]:
    """Under srun, set torch.distributed's variables from SLURM's (:func:`slurm_mapping`), so that accelerate's
    process group, the GPU choice (LOCAL_RANK) and the launcher watch see an ordinary launched rank; call it before
    the process group is created. Returns what it set (empty: not an srun step of several tasks, or a launcher
    already set them). Task 0 prints one line with the mapping."""
    env = os.environ if env is None else env
    mapping = slurm_mapping(env)
    if not mapping:
        return mapping
    env.update(mapping)
    if mapping["RANK"] == "0":
        nodes = env.get("SLURM_STEP_NUM_NODES") or env.get("SLURM_NNODES") or "?"
        addr = "" if "MASTER_ADDR" in mapping else " (set by you)"
        port = " (from SLURM_JOB_ID)" if "MASTER_PORT" in mapping else " (set by you)"
        print(f"hf_asyncpp: SLURM detected (job {env.get('SLURM_JOB_ID', '?')}, step {env.get('SLURM_STEP_ID', '?')}): "
              f"{mapping['WORLD_SIZE']} srun tasks on {nodes} node(s) as ranks: RANK=SLURM_PROCID, "
              f"WORLD_SIZE={mapping['WORLD_SIZE']}, LOCAL_RANK=SLURM_LOCALID, LOCAL_WORLD_SIZE={mapping['LOCAL_WORLD_SIZE']} "
              f"on this node, MASTER_ADDR={env['MASTER_ADDR']}{addr}, MASTER_PORT={env['MASTER_PORT']}{port}", flush=True)
    return mapping


def accelerate_config(n: int) -> Path | None:
    """The shipped accelerate config for n CPU processes (package data), if there is one."""
    path = shipped_file("accelerate_configs", f"cpu-{n}proc.yaml")
    return path if path.is_file() else None


@contextlib.contextmanager
def _environment(values: dict[str, str]) -> Iterator[None]:
    """``values`` in os.environ (which the started processes inherit) for the block, then as they were."""
    before = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in before.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


@contextlib.contextmanager
def _torchrun_quiet(quiet: bool) -> Iterator[None]:
    """Without --debug, torchrun's own reports of a failed worker (``failed (exitcode: 6)``, ``Sending process ...
    closing signal``) are left out: the workers' error says it once (failures.first_error)."""
    names = [n for n in logging.Logger.manager.loggerDict if n.startswith("torch.distributed.elastic")] if quiet else []
    levels = {n: logging.getLogger(n).level for n in names}
    for n in names:
        logging.getLogger(n).setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        for n, level in levels.items():
            logging.getLogger(n).setLevel(level)


CUDA_ALLOC = ("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
"""The CUDA caching allocator's setting for the ranks started here: segments that grow in place instead of a new
block per size, so the last stage's large transient logits and the optimizer's copies beside the in-flight
microbatches do not fragment the memory into out-of-memory errors (or halved microbatches) on an 80 GB part. A
value the user set is kept."""


def worker_env(recipe: Recipe, errors: str, debug: bool, gpus: int, environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """The variables the started ranks get on top of this process's environment (``environ``): the checked-recipe
    mark, where they leave their errors, torchrun's restart setting, ``OMP_NUM_THREADS=1`` unless the user set it
    (torchrun's own default for several processes, set here so that its 4-line banner announcing it is not printed
    on every run), and on CUDA (``gpus`` > 0) the allocator's :data:`CUDA_ALLOC` unless the user set one."""
    environ = os.environ if environ is None else environ
    env = {CHECKED: "1", ERROR_DIR: errors, **({DEBUG_ENV: "1"} if debug else {}), **RESTART_FIX}
    if "OMP_NUM_THREADS" not in environ:
        env["OMP_NUM_THREADS"] = "1"
    if gpus and CUDA_ALLOC[0] not in environ:
        env[CUDA_ALLOC[0]] = CUDA_ALLOC[1]
    return env


def spawn(recipe: Recipe, argv: list[str], debug: bool = False) -> int:
    """Run ``hf_asyncpp.cli.train argv`` on ``processes_needed(recipe)`` local processes, whose recipe the caller
    checked (run/preflight.py); their exit code, and a failure's one ``error:`` line."""
    n = processes_needed(recipe)
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    how = "gloo on CPU"
    if gpus:
        how = f"NCCL on {n} GPUs" if gpus >= n else f"gloo, {n} stages sharing {gpus} GPU{'s' if gpus > 1 else ''}"
        if gpus < n:
            os.environ["ACCELERATE_USE_CPU"] = "1"  # gloo process groups; the stages still compute on the GPU
    print(f"hf_asyncpp: pipeline.num_stages={n} needs {n} processes and 1 was started: starting {n} local processes "
          f"({how}; set {NO_SPAWN}=1 to launch them yourself)", flush=True)
    remove_stale_folders()  # of launchers killed before they could remove their own
    with tempfile.TemporaryDirectory(prefix=f"{ERRORS_PREFIX}{os.getpid()}-") as errors:
        relay = threading.current_thread() is threading.main_thread()  # SIGINT: this module's handler
        handled = torchrun_signals(recipe.training.stop_signals, sigint=not relay)
        # torchrun's own logs in the folder removed at the end (else one /tmp/torchelastic_* per run, never removed)
        args = torchrun.get_args_parser().parse_args(
            ["--standalone", f"--nproc_per_node={n}", f"--max-restarts={recipe.training.max_restarts}",
             f"--log-dir={Path(errors) / 'torchelastic'}", f"--signals-to-handle={','.join(handled)}",
             "--module", "hf_asyncpp.cli.train", *argv])
        with _environment(worker_env(recipe, errors, debug, gpus)), _torchrun_quiet(not debug), \
                _handlers_restored([*handled, "SIGINT"] if relay else handled):
            parent = accelerate_parent()  # its end becomes a stop: the first stop signal torchrun passes on
            on_parent_end = signal.Signals[next((n for n in recipe.training.stop_signals if n in handled), "SIGTERM")]
            try:
                if relay:
                    signal.signal(signal.SIGINT, _sigint_relay())
                with stop_with_parent(parent, on_parent_end):
                    torchrun.run(args)
            except ChildFailedError as e:  # the workers left their errors in `errors`
                line, code = first_error(e.failures, Path(errors))
                print(line, file=sys.stderr, flush=True)
                return code
            except SignalException as e:  # torchrun sent the signal on to the workers and waited for them to stop
                name = signal.Signals(e.sigval).name
                if (why := _parent_gone_line(parent, name)) is not None:
                    print(why, file=sys.stderr, flush=True)
                if finished(Path(errors)):  # it came after the run had finished: its own last line said so
                    print(f"hf_asyncpp: {name} arrived after the run had finished; nothing was stopped",
                          file=sys.stderr, flush=True)
                    return 0
                line, code = first_error({}, Path(errors))
                if name not in recipe.training.stop_signals and not any(Path(errors).glob("rank-*.json")):
                    # torchrun sent it on and the ranks died of it, saying nothing
                    line, code = (f"error: {name} ended the run unsaved: it is not one of training.stop_signals "
                                  f"({', '.join(recipe.training.stop_signals) or 'none'}); resume from the newest "
                                  "checkpoint with --training.resume_from_checkpoint=latest"), 128 + int(e.sigval)
                print(line, file=sys.stderr, flush=True)
                return code
        stopped = stop_record(Path(errors))  # stopped by a signal sent to the workers alone, under --max-restarts
    if stopped:
        print(stopped[0], file=sys.stderr, flush=True)
        return stopped[1]
    return 0


ERRORS_PREFIX = "hf_asyncpp-errors-"
"""The launcher's temporary folder (the ranks' error lines, torchrun's logs), named ``hf_asyncpp-errors-PID-*`` after
the launcher's pid, so that a later launcher can tell the folder of a launcher that is gone."""


def remove_stale_folders(root: str | os.PathLike | None = None) -> list[Path]:
    """Remove the temporary folders of launchers that were killed before they could remove them (``kill -9``, the
    OOM killer: the ``TemporaryDirectory`` cleanup never runs): this user's ``hf_asyncpp-errors-PID-*`` whose PID
    no longer runs. A PID reused meanwhile keeps its folder until that process ends; another user's folders and
    those of earlier versions (no pid in the name) are left alone. The folders removed."""
    removed = []
    for p in Path(root or tempfile.gettempdir()).glob(f"{ERRORS_PREFIX}*-*"):
        m = re.fullmatch(rf"{ERRORS_PREFIX}(\d+)-.+", p.name)
        try:
            if m is None or p.is_symlink() or p.stat().st_uid != os.getuid() or psutil.pid_exists(int(m.group(1))):
                continue
        except OSError:
            continue
        shutil.rmtree(p, ignore_errors=True)
        removed.append(p)
    return removed


RESTART_FIX = {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
"""torch 2.13: a worker group restarted by torchrun (``--max-restarts``) fails in gloo's ``connectFullMesh ...
Connection refused`` when the rendezvous store is shared with the workers (pytorch/pytorch#135712, #167288); with
the store not shared a restart resumes bitwise (docs/troubleshooting.md). Set for the torchrun started here; a user's
own torchrun needs it in its environment."""
TORCHRUN_SIGNALS = ("SIGTERM", "SIGINT", "SIGHUP", "SIGQUIT")
"""torchrun's own default ``--signals-to-handle``: the signals its agent catches, sends on to the workers and waits
(``--shutdown-timeout``) for them to end. Any other signal kills the launcher by its default action, and the
workers, whose launcher is gone, stop unsaved (supervision.watch_parent)."""

KEEP_IGNORED = ("SIGHUP",)
"""Signals left ignored when the launcher was started ignoring them: ``nohup`` ignores SIGHUP so that the run
outlives its terminal, and torchrun's agent would otherwise catch it again and send it on to the workers."""


def torchrun_signals(stop_signals: list[str], sigint: bool = True,
                     handler: Callable[[signal.Signals], object] = signal.getsignal) -> list[str]:
    """torchrun's ``--signals-to-handle`` for a run of these ``training.stop_signals``: the stop signals and
    torchrun's own (TORCHRUN_SIGNALS), less those of KEEP_IGNORED that ``handler`` (this process's) ignores, and
    less SIGINT when ``sigint`` is False (this module handles it: :func:`_sigint_relay`).

    It must be an argument: torch 2.13's ``launch_agent`` sets ``TORCHELASTIC_SIGNALS_TO_HANDLE`` from
    ``--signals-to-handle`` (default TORCHRUN_SIGNALS, or ``PET_SIGNALS_TO_HANDLE``), so a value put in that
    variable beforehand is overwritten, and a stop signal outside torchrun's defaults (SIGUSR1) would kill the
    launcher, unsaved."""
    names = dict.fromkeys([*stop_signals, *TORCHRUN_SIGNALS])
    return [name for name in names if (sigint or name != "SIGINT")
            and not (name in KEEP_IGNORED and handler(signal.Signals[name]) is signal.SIG_IGN)]


@contextlib.contextmanager
def _handlers_restored(names: list[str]) -> Iterator[None]:
    """This process's handlers of ``names`` put back after the block: torchrun's agent installs its own and leaves
    them, and a process that launches twice (a test suite, an embedding program) must start from the original ones
    (KEEP_IGNORED reads them)."""
    before = {signal.Signals[n]: signal.getsignal(signal.Signals[n]) for n in names}
    try:
        yield
    finally:
        for sig, handler in before.items():
            signal.signal(sig, handler if handler is not None else signal.SIG_DFL)


def _sigint_relay() -> Callable[[int, object], None]:
    """The launcher's SIGINT handler while torchrun runs. The first SIGINT does what torchrun's own handler does
    (raise SignalException: the agent sends SIGINT on to the workers, which save at an agreed step, and waits for
    them). A second one, a second Ctrl-C while they save, is sent on to each worker's process group at once (they
    are in their own sessions, so the terminal's Ctrl-C does not reach them), and each stops at once, unsaved
    (exit 130, cli/train.py). torchrun's handler would raise again instead, out of the agent's wait, and its
    clean-up would send SIGTERM and wait up to 30 s more, the second Ctrl-C unheeded."""
    hits = []

    def relay(signum: int, frame) -> None:
        hits.append(signum)
        if len(hits) == 1:
            raise SignalException(f"Process {os.getpid()} got signal: {signal.SIGINT}", sigval=signal.SIGINT)
        for child in psutil.Process().children():
            with contextlib.suppress(OSError, psutil.Error):
                if os.getpgid(child.pid) == child.pid:  # a worker: torchrun starts each in its own session
                    os.killpg(child.pid, signal.SIGINT)

    return relay


def accelerate_parent() -> int | None:
    """The pid of the ``accelerate launch`` that started this process with its one-process launcher, if it did.

    That launcher (``accelerate/commands/launch.py: simple_launcher``) only starts this process and waits: it passes
    no signal on, and a SIGTERM or SIGINT sent to it alone (``kill PID``, ``docker stop``) ends it at once while the
    run trains on unsupervised to its end. :func:`stop_with_parent` turns its death into a stop."""
    with contextlib.suppress(psutil.Error, OSError):
        parent = psutil.Process().parent()
        cmd = parent.cmdline() if parent is not None else []
        for i, word in enumerate(cmd):
            if word.endswith("accelerate.commands.launch") or (Path(word).name == "accelerate"
                                                               and "launch" in cmd[i + 1:i + 2]):
                return parent.pid
    return None


_PR_SET_PDEATHSIG = 1  # linux/prctl.h


@contextlib.contextmanager
def stop_with_parent(parent: int | None, signum: int) -> Iterator[bool]:
    """For the block, have the kernel send ``signum`` (a stop signal: torchrun passes it on, the ranks save and exit
    10) to this process when its parent ``parent`` ends (Linux's ``PR_SET_PDEATHSIG``: no thread, no polling); a
    parent already gone when it is set counts as ended. Yields whether it is set (False: no parent given, or not
    Linux). Unset after the block, so that a launcher ending later does not kill this process by the signal's
    default action once torchrun's handlers are gone."""
    libc = ctypes.CDLL(None, use_errno=True) if parent is not None and sys.platform.startswith("linux") else None
    armed = libc is not None and libc.prctl(_PR_SET_PDEATHSIG, int(signum), 0, 0, 0) == 0
    if armed and os.getppid() != parent:  # it ended before the request was in place
        os.kill(os.getpid(), signum)
    try:
        yield armed
    finally:
        if armed:
            libc.prctl(_PR_SET_PDEATHSIG, 0, 0, 0, 0)


def _parent_gone_line(parent: int | None, name: str) -> str | None:
    """The line saying why the run stopped when the ``accelerate launch`` above it ended (its own exit code, 143 or
    1, is what the shell saw: this process's own code reaches no one)."""
    if parent is None or os.getppid() == parent:
        return None
    return (f"hf_asyncpp: the accelerate launch that started this run (pid {parent}) ended, and it passes no signal "
            f"on: the run was stopped with {name} so that nothing trains unsupervised; start it with `hf-asyncpp train` "
            "to have signals and exit codes reach the run")


def launch_command(recipe: Recipe, recipe_path: str) -> str:
    """Commands that start the recipe's processes, valid from any directory."""
    n = processes_needed(recipe)
    path = Path(recipe_path).resolve() if Path(recipe_path).exists() else recipe_path
    cfg = accelerate_config(n)
    cpu = (f"accelerate launch --config_file {cfg} -m hf_asyncpp.cli.train {path}" if cfg else
           f"ACCELERATE_USE_CPU=1 accelerate launch --multi_gpu --num_processes {n} -m hf_asyncpp.cli.train {path}")
    slurm = (f"\n(under SLURM: srun with --ntasks a multiple of {n}, one task per GPU: srun --ntasks-per-node=<GPUs per "
             f"node> python -m hf_asyncpp.cli.train {path})" if "SLURM_JOB_ID" in os.environ else "")
    return (f"  hf-asyncpp train {path}   (starts the {n} processes itself unless {NO_SPAWN}=1)\n  {cpu}\n"
            f"(on {n} GPUs: accelerate launch --multi_gpu --num_processes {n} -m hf_asyncpp.cli.train {path}); "
            "note that on a CPU-only machine `accelerate launch --num_processes N` silently starts ONE process" + slurm)


def check_topology(recipe: Recipe, world_size: int, recipe_path: str = "RECIPE") -> None:
    p = processes_needed(recipe)
    if world_size % p != 0:
        raise RecipeError(
            f"pipeline.num_stages: {p} stages need a multiple of {p} processes, but {world_size} "
            f"{'was' if world_size == 1 else 'were'} started. Run:\n{launch_command(recipe, recipe_path)}")
