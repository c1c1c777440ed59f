"""What every report figure shares: the lazy matplotlib import, the figure size, the styling of
axes and legends, and saving to a PNG.

Matplotlib is imported on the first figure only (with the non-interactive Agg backend), so
importing :mod:`dpfy.report` or starting the ``dpfy`` command never loads it.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

#: Size of one panel, in inches (width, height).
PANEL_SIZE = (6.4, 4.0)
#: Resolution of the saved PNG, in dots per inch.
DPI = 120
#: Font size of legends, in points.
LEGEND_FONTSIZE = 8
#: Opacity of grid lines (0 transparent, 1 opaque).
GRID_ALPHA = 0.3


def pyplot() -> Any:
    """``matplotlib.pyplot`` on the Agg backend (no display needed), imported on first use."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def new_figure(
    panels: int = 1, *, panel_size: tuple[float, float] = PANEL_SIZE
) -> tuple[Figure, list[Axes]]:
    """A figure of ``panels`` side-by-side axes, each ``panel_size`` inches, at :data:`DPI`."""
    width, height = panel_size
    fig, axes = pyplot().subplots(
        1, panels, figsize=(width * panels, height), dpi=DPI, squeeze=False
    )
    return fig, list(axes[0])


def grid(ax: Axes, *, which: str = "major", axis: str = "both") -> None:
    """Light grid lines on ``ax`` (``which``: major/minor/both ticks; ``axis``: x/y/both)."""
    ax.grid(alpha=GRID_ALPHA, which=which, axis=axis)  # type: ignore[arg-type]


def legend(
    ax: Axes,
    handles: Sequence[Any] | None = None,
    labels: Sequence[str] | None = None,
    **options: Any,
) -> None:
    """A legend at :data:`LEGEND_FONTSIZE` with each label once (first handle wins).

    ``handles``/``labels`` default to those of ``ax`` (pass both to merge twin axes).
    """
    if handles is None or labels is None:
        handles, labels = ax.get_legend_handles_labels()
    unique: dict[str, Any] = {}
    for handle, label in zip(handles, labels, strict=True):
        unique.setdefault(label, handle)
    ax.legend(list(unique.values()), list(unique.keys()), fontsize=LEGEND_FONTSIZE, **options)


def save(fig: Figure, path: str | Path) -> Path:
    """Lay out ``fig``, write it to ``path`` (parent folders created), close it; the path."""
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(out)
    pyplot().close(fig)
    return out
