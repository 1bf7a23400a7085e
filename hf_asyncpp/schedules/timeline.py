"""Draw a schedule's timeline (simulated or measured) as a PNG: a row per stage, where the bubbles are; or one
steady step of it with each stage's busy and idle shares (what ``hf-asyncpp plan`` draws for a recipe's dozens of
microbatches, where the whole run would be a blur)."""
from __future__ import annotations

import math

from ..figures import pyplot
from .actions import ActionType
from .simulator import Interval, SimResult

__all__ = ["plot_steady_step", "plot_timeline", "steady_step", "step_shares", "step_timeline"]

T = ActionType

_COLORS = {T.F: ("#3D7DD8", "#8DB7EE"), T.B: ("#E8871E", "#F5C07A"), T.I: ("#E8871E", "#F5C07A"),
           T.W: ("#B8336A", "#E08DB0"), T.STEP: ("#3A9E4F", "#3A9E4F"), T.VOCAB: ("#14A38B", "#7FD6C4")}
_IDLE, _REDUCE = "#D9D9D9", "#8E44AD"


def plot_timeline(timeline, path: str, title: str = "") -> str:
    """Draw a ``SimResult`` (or its per-stage ``timeline``) as a PNG: a row per stage (per rank where ranks hold several
    stages), forward / backward
    (two shades alternating by step, labelled ``step.microbatch``), optimizer step, reduction posts, idle."""
    plt = pyplot()
    res = timeline if isinstance(timeline, SimResult) else None
    tls = res.timeline if res else timeline
    p = len(tls)
    end = max((iv.end for tl in tls for iv in tl), default=0.0) or 1.0
    busy = sum(iv.end - iv.start for tl in tls for iv in tl)
    width = min(24.0, max(8.0, 0.26 * end / _shortest(tls, end)))  # about a quarter inch for the shortest F/B
    fig, ax = plt.subplots(figsize=(width, 0.5 * p + 1.5))
    _draw_rows(ax, tls, end, width)
    _legend(ax, tls, -1.15 / (0.5 * p + 1.5))
    stats = f"bubble {1 - busy / (p * end):.1%}"
    if res is not None and not math.isnan(res.steady_bubble):
        stats += f", steady state {res.steady_bubble:.1%}"
    ax.set_title(f"{title}  ({stats})" if title else stats, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def steady_step(res: SimResult) -> tuple[float, float] | None:
    """The window of one steady step: from the first stage's first forward of a middle step to its first forward of
    the next step (a flushed schedule's fill and drain inside it), or None with fewer than two steps to measure it
    between."""
    starts: dict[int, float] = {}
    for iv in res.timeline[0]:
        if iv.action.type == T.F and iv.action.step not in starts:
            starts[iv.action.step] = iv.start
    steps = sorted(starts)
    if len(steps) < 2:
        return None
    k = steps[(len(steps) - 1) // 2]
    after = steps[steps.index(k) + 1]
    return starts[k], starts[after]


def plot_steady_step(res: SimResult, path: str, title: str = "") -> str:
    """One steady step of a simulated run as a PNG a person can read, whatever the microbatch count: the step's
    window of the timeline (left) and, per stage, the shares of that window spent on forward, backward, weight
    gradients and the optimizer step, and idle (right), where an unequal split shows as unequal bars. A run of fewer
    than two steps is drawn whole (:func:`plot_timeline`)."""
    window = steady_step(res)
    if window is None:
        return plot_timeline(res, path, title)
    tls = step_timeline(res, window)
    p = len(tls)
    plt = pyplot()
    height = max(3.0, 0.42 * p + 1.8)
    fig, (ax, bx) = plt.subplots(1, 2, figsize=(16, height), gridspec_kw={"width_ratios": (3.2, 1)}, sharey=True)
    span = window[1] - window[0]
    _draw_rows(ax, tls, span, 16 * 3.2 / 4.2)
    ax.set_xlabel("time within one steady step")
    left = [0.0] * p
    for kind, shares in step_shares(tls, span).items():
        color = _COLORS[_KINDS[kind][0]][0]
        if any(shares):
            bx.barh(range(p), shares, left=left, height=0.8, color=color, linewidth=0)
            left = [a + b for a, b in zip(left, shares)]
    bx.barh(range(p), [max(0.0, 1 - x) for x in left], left=left, height=0.8, color=_IDLE, linewidth=0)
    for s, busy in enumerate(left):
        bx.text(1.02, s, f"idle {max(0.0, 1 - busy):.0%}", va="center", fontsize=8.5)
    bx.set_xlim(0, 1.3)
    bx.set_xticks([0, 0.5, 1], ["0", "50%", "100%"])
    bx.set_title("share of the step, per row", fontsize=9.5)
    bx.tick_params(labelleft=False)
    _legend(ax, tls, -0.6 / (height - 1.2))  # 0.6 inch under the axis (about 1.2 inches shorter than the figure)
    idle = 1 - sum(left) / p
    ax.set_title(f"{title}  (one steady step: {idle:.1%} idle; whole run: bubble {res.bubble:.1%} = fill/drain "
                 f"{res.fill_drain:.1%} + imbalance {res.imbalance:.1%})" if title else f"{idle:.1%} idle", fontsize=10,
                 loc="left")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


_KINDS = {"forward": (T.F,), "backward": (T.B, T.I), "weight gradient": (T.W,), "vocabulary shard": (T.VOCAB,),
          "optimizer step": (T.STEP,)}


def step_timeline(res: SimResult, window: tuple[float, float]) -> list[list[Interval]]:
    """Each row's intervals inside ``window``, cut at its edges and shifted to start at 0."""
    t0, t1 = window
    return [[Interval(max(iv.start, t0) - t0, min(iv.end, t1) - t0, iv.action) for iv in tl
             if iv.end > t0 and iv.start < t1 or iv.action.type == T.REDUCE and t0 <= iv.start < t1]
            for tl in res.timeline]


def step_shares(tls: list[list[Interval]], span: float) -> dict[str, list[float]]:
    """Per kind of work (forward, backward, weight gradient, VOCAB pass, optimizer step), each row's share of ``span`` spent on
    it; what the rows do not spend is idle."""
    return {kind: [sum(iv.end - iv.start for iv in tl if iv.action.type in types) / span for tl in tls]
            for kind, types in _KINDS.items()}


def _shortest(tls, end: float) -> float:
    """The shortest forward or backward of the timeline (what the figure's width is sized for)."""
    return min((iv.end - iv.start for tl in tls for iv in tl if iv.action.type in (T.F, T.B, T.I, T.W)
                and iv.end > iv.start), default=end)


def _draw_rows(ax, tls, end: float, width: float) -> None:
    """The rows of a timeline on ``ax``: idle behind, the actions in their colours (labelled where there is room),
    the reduction posts; y ticks naming the stages or ranks, x from 0 to ``end``; ``width`` is the axis' inches."""
    p = len(tls)
    one_mb = all(iv.action.microbatch in (0, None) for tl in tls for iv in tl)  # pipedream: label steps only
    ax.barh(range(p), [end] * p, left=0, height=0.8, color=_IDLE, linewidth=0)
    # one collection per stage and colour and one for the reduction marks: a bar or a line per action took
    # seconds for the thousands of actions of a planned 16-stage run
    reduces: list[tuple[float, int]] = []
    for s, tl in enumerate(tls):
        bars: dict[str, list[tuple[float, float]]] = {}
        for b, e, a in tl:
            if a.type == T.REDUCE:
                reduces.append((b, s))
            elif a.type in _COLORS and e > b:
                bars.setdefault(_COLORS[a.type][a.step % 2], []).append((b, e - b))
                label = (f"S{a.step}" if a.type == T.STEP else f"{a.step}" if one_mb else f"{a.step}.{a.microbatch}")
                if (e - b) * width / end < 0.06 * len(label) + 0.04:
                    continue  # no room for the label
                ax.text((b + e) / 2, s, label, ha="center", va="center", fontsize=6.5,
                        color="white" if a.type == T.STEP or a.step % 2 == 0 else "black")
        for color, spans in bars.items():
            ax.broken_barh(spans, (s - 0.4, 0.8), facecolors=color, edgecolor="black",
                           linewidth=0.4 if len(spans) * 0.03 < width else 0.0)  # edges would blacken dense rows
    if reduces:
        ax.vlines([b for b, _ in reduces], [s - 0.42 for _, s in reduces], [s + 0.42 for _, s in reduces],
                  color=_REDUCE, lw=1.5)
    row = "rank" if any(iv.action.stage is not None for tl in tls for iv in tl) else "stage"  # several stages each
    ax.set_yticks(range(p), [f"{row} {s}" for s in range(p)])
    ax.invert_yaxis()
    ax.set_xlim(0, end)
    ax.set_xlabel("time")


def _legend(ax, tls, below: float) -> None:
    """The colours' legend under ``ax`` (``below``: its offset in axis heights), naming only the kinds drawn."""
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch

    split = any(iv.action.type == T.W for tl in tls for iv in tl)
    whole = any(iv.action.type == T.B for tl in tls for iv in tl)  # DualPipeV runs both
    backward = ("backward (B) or to the input (I)" if whole else "backward to the input (I)") if split else "backward"
    vocab = any(iv.action.type == T.VOCAB for tl in tls for iv in tl)
    handles = [Patch(color=_COLORS[T.F][0], label="forward (step.microbatch)"),
               Patch(color=_COLORS[T.B][0], label=backward),
               *([Patch(color=_COLORS[T.W][0], label="weight gradient (W)")] if split else []),
               *([Patch(color=_COLORS[T.VOCAB][0], label="vocabulary shard (VOCAB)")] if vocab else []),
               Patch(color=_COLORS[T.STEP][0], label="optimizer step (S k)"),
               Line2D([], [], color=_REDUCE, lw=1.5, label="reduction posted"), Patch(color=_IDLE, label="idle")]
    ax.legend(handles=handles, loc="upper center", bbox_to_anchor=(0.5, below), ncol=len(handles), fontsize=8,
              frameon=False)
