"""matplotlib for files, never a window: every stage that draws gets pyplot from here (headless CI and servers)."""

from __future__ import annotations


def pyplot():
    """matplotlib.pyplot on the non-interactive Agg backend (imported on first use: drawing is optional work)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt
