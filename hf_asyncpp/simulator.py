"""Run schedule action lists without processes: deadlocks, FIFO order, timelines, bubbles, memory.

Each stage executes its list in order. Compute actions take their cost; sends are asynchronous and
cost nothing to the sender; a receive waits until the matching send happened plus ``comm`` latency.
The same simulator draws the timeline pictures and feeds the planner, so every schedule is judged by
one clock.
"""
from __future__ import annotations

from collections import defaultdict, deque
from dataclasses import dataclass, field

from .schedules import Action, Op, version_lag

COMPUTE = {Op.F: "forward", Op.B: "backward", Op.STEP: "step", Op.REDUCE: "reduce"}
_SEND_OF = {Op.RECV_ACT: Op.SEND_ACT, Op.RECV_GRAD: Op.SEND_GRAD}


class ScheduleError(RuntimeError):
    """A deadlock, an out-of-order receive, or a microbatch not forwarded/backwarded exactly once."""


@dataclass
class Costs:
    forward: float | list[float] = 1.0
    backward: float | list[float] = 1.0
    step: float = 0.0
    reduce: float = 0.0
    comm: float = 0.0

    def of(self, op: Op, stage: int) -> float:
        v = {Op.F: self.forward, Op.B: self.backward, Op.STEP: self.step, Op.REDUCE: self.reduce}.get(op, 0.0)
        return v[stage] if isinstance(v, (list, tuple)) else v


@dataclass
class SimResult:
    timeline: list[list[tuple[float, float, Action]]]  # per stage: (start, end, action) of compute actions
    makespan: float
    bubble: float  # idle share of stage-time over the whole run
    steady_bubble: float  # idle share between the end of the first step and the start of the last
    throughput: float  # microbatches per unit time
    peak_inflight: list[int] = field(default_factory=list)  # forwarded, not yet backwarded
    peak_versions: list[int] = field(default_factory=list)  # weight versions held at once


def _grid(actions, ptr, reason) -> str:
    lines = []
    for s, acts in enumerate(actions):
        cur = acts[ptr[s]] if ptr[s] < len(acts) else "done"
        lines.append(f"stage {s}: ... {' '.join(map(str, acts[max(0, ptr[s] - 3):ptr[s]]))} [{cur}] <-- {reason.get(s, 'done')}")
    return "\n".join(lines)


def simulate(actions: list[list[Action]], costs: Costs | None = None, schedule: str | None = None,
             num_microbatches: int | None = None) -> SimResult:
    costs = costs or Costs()
    p = len(actions)
    ptr, clock = [0] * p, [0.0] * p
    sent: dict[tuple, deque] = defaultdict(deque)  # (src, dst, op) -> (step, mb, time)
    timeline: list[list] = [[] for _ in range(p)]
    inflight, peak_inflight = [0] * p, [0] * p
    seen: dict[tuple, int] = defaultdict(int)
    versions_live: list[dict[int, int]] = [defaultdict(int) for _ in range(p)]
    latest, peak_versions = [0] * p, [1] * p
    fwd_version: dict[tuple, int] = {}
    progress = True
    while progress:
        progress = False
        for s in range(p):
            while ptr[s] < len(actions[s]):
                a = actions[s][ptr[s]]
                if a.type in _SEND_OF:
                    q = sent[(a.peer, s, _SEND_OF[a.type])]
                    if not q:
                        break  # blocked on a receive
                    k, i, t = q[0]
                    if (k, i) != (a.step, a.microbatch):
                        raise ScheduleError(f"stage {s}: {a} but the next message from stage {a.peer} is {k}.{i} "
                                            f"(receives out of send order)\n" + _grid(actions, ptr, {s: "out of order"}))
                    q.popleft()
                    clock[s] = max(clock[s], t + costs.comm)
                elif a.type in (Op.SEND_ACT, Op.SEND_GRAD):
                    sent[(s, a.peer, a.type)].append((a.step, a.microbatch, clock[s]))
                else:
                    start = clock[s]
                    clock[s] += costs.of(a.type, s)
                    timeline[s].append((start, clock[s], a))
                    if a.type == Op.F:
                        seen[("F", s, a.step, a.microbatch)] += 1
                        fwd_version[(s, a.step, a.microbatch)] = a.version
                        inflight[s] += 1
                        versions_live[s][a.version] += 1
                        peak_inflight[s] = max(peak_inflight[s], inflight[s])
                    elif a.type == Op.B:
                        seen[("B", s, a.step, a.microbatch)] += 1
                        if fwd_version.get((s, a.step, a.microbatch)) != a.version:
                            raise ScheduleError(f"stage {s}: {a} uses another version than its forward")
                        inflight[s] -= 1
                        versions_live[s][a.version] -= 1
                    elif a.type == Op.STEP:
                        latest[s] += 1
                    lag = version_lag(schedule, s, p) if schedule else 0
                    held = {v for v, c in versions_live[s].items() if c > 0} | {v for v in range(max(0, latest[s] - lag), latest[s] + 1)}
                    peak_versions[s] = max(peak_versions[s], len(held))
                ptr[s] += 1
                progress = True
    if any(ptr[s] < len(actions[s]) for s in range(p)):
        blocked = {s: "blocked: nothing was sent" for s in range(p) if ptr[s] < len(actions[s])}
        raise ScheduleError("deadlock\n" + _grid(actions, ptr, blocked))
    for key, n in seen.items():
        if n != 1:
            raise ScheduleError(f"{key[0]} of step {key[2]} microbatch {key[3]} ran {n} times on stage {key[1]}")
    fwd = {(k, i) for (op, s, k, i) in seen if op == "F" and s == 0}
    for s in range(p):
        for op in ("F", "B"):
            mine = {(k, i) for (o, st, k, i) in seen if o == op and st == s}
            if mine != fwd:
                raise ScheduleError(f"stage {s}: {op} covers {len(mine)} microbatches, stage 0 forwards {len(fwd)}")
    makespan = max(clock) if p else 0.0
    busy = [sum(e - b for b, e, _ in tl) for tl in timeline]
    bubble = 1 - sum(busy) / (makespan * p) if makespan else 0.0
    steady = _steady_bubble(timeline, makespan)
    return SimResult(timeline, makespan, bubble, steady, len(fwd) / makespan if makespan else 0.0, peak_inflight, peak_versions)


def _steady_bubble(timeline, makespan) -> float:
    """Idle share inside [every stage has finished its first step's work, the last step's work starts]."""
    steps = sorted({a.step for tl in timeline for _, _, a in tl})
    if len(steps) < 3:
        return float("nan")
    first, last = steps[0], steps[-1]
    t0 = max(max(e for _, e, a in tl if a.step == first) for tl in timeline)
    t1 = min(min(b for b, _, a in tl if a.step == last and a.type == Op.F) for tl in timeline)
    if t1 <= t0:
        return float("nan")
    busy = 0.0
    for tl in timeline:
        busy += sum(max(0.0, min(e, t1) - max(b, t0)) for b, e, _ in tl)
    return 1 - busy / ((t1 - t0) * len(timeline))


COLORS = {Op.F: "#4C9BE8", Op.B: "#F2A541", Op.STEP: "#6CC070", Op.REDUCE: "#B07CC6"}


def plot_timeline(result: SimResult, path: str, title: str = "") -> str:
    """A row per stage: forward, backward, optimizer step and reduction in distinct colors; white is idle."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    p = len(result.timeline)
    fig, ax = plt.subplots(figsize=(max(8, min(24, result.makespan / 2)), 0.6 * p + 1.4))
    for s, tl in enumerate(result.timeline):
        for b, e, a in tl:
            if e - b <= 0:
                ax.plot([b, b], [s - 0.4, s + 0.4], color=COLORS[a.type], lw=2)
                continue
            ax.barh(s, e - b, left=b, height=0.8, color=COLORS[a.type], edgecolor="black", linewidth=0.3)
            if a.type in (Op.F, Op.B) and e - b >= 0.6:
                ax.text((b + e) / 2, s, f"{a.step}.{a.microbatch}", ha="center", va="center", fontsize=6)
    ax.set_yticks(range(p))
    ax.set_yticklabels([f"stage {s}" for s in range(p)])
    ax.invert_yaxis()
    ax.set_xlabel("time")
    ax.set_xlim(0, result.makespan)
    legend = [Patch(color=COLORS[o], label=n) for o, n in ((Op.F, "forward"), (Op.B, "backward"), (Op.STEP, "optimizer step"), (Op.REDUCE, "reduce"))]
    legend.append(Patch(facecolor="white", edgecolor="black", label="idle"))
    ax.legend(handles=legend, loc="upper center", bbox_to_anchor=(0.5, -0.35 if p < 4 else -0.2), ncol=5, fontsize=8, frameon=False)
    ax.set_title(f"{title}  bubble {result.bubble:.1%}" + ("" if result.steady_bubble != result.steady_bubble else f", steady state {result.steady_bubble:.1%}"))
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
