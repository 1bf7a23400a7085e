"""Figures: matplotlib off screen, set up in one place for every plot the package and its benchmarks draw."""
from __future__ import annotations

__all__ = ["pyplot"]


def pyplot():
    """matplotlib's ``pyplot`` on the Agg backend (no display on a training node or a CI runner), imported when a
    figure is drawn: matplotlib takes about a second to import, which a command that draws nothing should not pay."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt
