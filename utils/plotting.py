"""matplotlib for files, never a window: every stage that draws gets pyplot from here (headless CI and servers)."""

from __future__ import annotations

from pathlib import Path


def pyplot():
    """matplotlib.pyplot on the non-interactive Agg backend (imported on first use: drawing is optional work)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save_png(fig, path, dpi: int = 110, colors: int = 64) -> Path:
    """Write `fig` as a palette PNG (`colors` colours, a third of the bytes of matplotlib's RGBA file for line and
    bar charts) and close it. Parent folders are created."""
    import io

    from PIL import Image

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=dpi)
    pyplot().close(fig)
    buf.seek(0)
    Image.open(buf).convert("RGB").quantize(colors=colors).save(path, format="PNG", optimize=True)
    return path
