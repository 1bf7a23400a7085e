"""Draw a schedule's timeline (simulated or measured) as a PNG: a row per stage, where the bubbles are."""
from __future__ import annotations

import math

from ..figures import pyplot
from .actions import ActionType
from .simulator import SimResult

__all__ = ["plot_timeline"]

T = ActionType

_COLORS = {T.F: ("#3D7DD8", "#8DB7EE"), T.B: ("#E8871E", "#F5C07A"), T.I: ("#E8871E", "#F5C07A"),
           T.W: ("#B8336A", "#E08DB0"), T.STEP: ("#3A9E4F", "#3A9E4F")}
_IDLE, _REDUCE = "#D9D9D9", "#8E44AD"


def plot_timeline(timeline, path: str, title: str = "") -> str:
    """Draw a ``SimResult`` (or its per-stage ``timeline``) as a PNG: a row per stage (per rank where ranks hold several
    stages), forward / backward
    (two shades alternating by step, labelled ``step.microbatch``), optimizer step, reduction posts, idle."""
    plt = pyplot()
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch

    res = timeline if isinstance(timeline, SimResult) else None
    tls = res.timeline if res else timeline
    p = len(tls)
    end = max((iv.end for tl in tls for iv in tl), default=0.0) or 1.0
    busy = sum(iv.end - iv.start for tl in tls for iv in tl)
    unit = min((iv.end - iv.start for tl in tls for iv in tl if iv.action.type in (T.F, T.B, T.I, T.W)
                and iv.end > iv.start), default=end)
    width = min(24.0, max(8.0, 0.26 * end / unit))  # about a quarter inch for the shortest forward/backward
    fig, ax = plt.subplots(figsize=(width, 0.5 * p + 1.5))
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
            ax.broken_barh(spans, (s - 0.4, 0.8), facecolors=color, edgecolor="black", linewidth=0.4)
    if reduces:
        ax.vlines([b for b, _ in reduces], [s - 0.42 for _, s in reduces], [s + 0.42 for _, s in reduces],
                  color=_REDUCE, lw=1.5)
    row = "rank" if any(iv.action.stage is not None for tl in tls for iv in tl) else "stage"  # several stages each
    ax.set_yticks(range(p), [f"{row} {s}" for s in range(p)])
    ax.invert_yaxis()
    ax.set_xlim(0, end)
    ax.set_xlabel("time")
    split = any(iv.action.type == T.W for tl in tls for iv in tl)
    whole = any(iv.action.type == T.B for tl in tls for iv in tl)  # DualPipeV runs both
    backward = ("backward (B) or to the input (I)" if whole else "backward to the input (I)") if split else "backward"
    handles = [Patch(color=_COLORS[T.F][0], label="forward (step.microbatch)"),
               Patch(color=_COLORS[T.B][0], label=backward),
               *([Patch(color=_COLORS[T.W][0], label="weight gradient (W)")] if split else []),
               Patch(color=_COLORS[T.STEP][0], label="optimizer step (S k)"),
               Line2D([], [], color=_REDUCE, lw=1.5, label="reduction posted"), Patch(color=_IDLE, label="idle")]
    ax.legend(handles=handles, loc="upper center", bbox_to_anchor=(0.5, -1.15 / (0.5 * p + 1.5)), ncol=len(handles),
              fontsize=8, frameon=False)
    stats = f"bubble {1 - busy / (p * end):.1%}"
    if res is not None and not math.isnan(res.steady_bubble):
        stats += f", steady state {res.steady_bubble:.1%}"
    ax.set_title(f"{title}  ({stats})" if title else stats, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
