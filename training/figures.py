"""Figures drawn off-screen (matplotlib's Agg backend, so they work on a machine without a
display; matplotlib is imported only when a figure is drawn): the helper every figure of the
package uses, and a training run's per-epoch curves (``curves.png``)."""
from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import BinaryIO

DPI = 110


@contextmanager
def figure(path: Path | BinaryIO, *grid, **kwargs) -> Iterator[tuple]:
    """``plt.subplots(*grid, **kwargs)`` on the Agg backend; on leaving the block the figure is
    laid out, saved to ``path`` (a file object: as PNG) and closed (closed on an error too)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(*grid, **kwargs)
    try:
        yield fig, axes
        fig.tight_layout()
        fig.savefig(path, dpi=DPI)
    finally:
        plt.close(fig)


def plot_curves(curves: dict, path: Path | BinaryIO) -> None:
    """Per epoch: mean train loss; top-1 of each head and τ at the 8-node tree on each
    evaluation table (held-out solid, dev dashed); the selected epoch marked."""
    epochs = curves["epochs"]
    xs = [e["epoch"] for e in epochs]
    selected = (curves.get("selection") or {}).get("epoch")
    with figure(path, 1, 3, figsize=(15, 4.2)) as (fig, (loss, top1, tau)):
        loss.plot(xs, [e["train_loss"] for e in epochs], "o-", ms=3)
        loss.set_title("train loss (epoch mean)")
        for index, name in enumerate(sorted({n for e in epochs for n in e["eval"]})):
            style = "o-" if index == 0 else "s--"
            rows = [(e["epoch"], e["eval"][name]) for e in epochs if name in e["eval"]]
            heads = len(rows[0][1]["top1"] or [])
            for h in range(heads):
                top1.plot([x for x, _ in rows], [s["top1"][h] for _, s in rows], style, ms=3, color=f"C{h}",
                          label=f"{name} head {h + 1}")
            tau.plot([x for x, _ in rows], [s["tau"] for _, s in rows], style, ms=3,
                     label=f"{name} ({rows[0][1]['tree']})")
        top1.set_title("teacher-forced top-1 per head")
        tau.set_title("τ at the 8-node tree")
        for ax in (loss, top1, tau):
            ax.set_xlabel("epoch")
            if selected is not None:
                ax.axvline(selected, color="grey", lw=0.8, ls=":")
        top1.legend(fontsize=7)
        tau.legend(fontsize=7)
