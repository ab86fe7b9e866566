"""Learning curves of one or more runs: episode return and success rate against agent steps
(``global_step``: frames / ``env.action_repeat``).

Reads each run's ``metrics.csv`` (the columns ``global_step``,
``episode_return`` and ``episode_success``; ``nan`` where no episode ended yet,
or where the env reports no success) and draws both panels with every run
overlaid. The figure is built with matplotlib's object API on an Agg canvas,
so it never needs a display and never changes pyplot's global backend; it is
written to a temporary file and renamed into place.
"""

from __future__ import annotations

import csv
import io
import math
import shutil
from pathlib import Path

import numpy as np

from visppo.atomic import atomic_write, check_writable
from visppo.errors import ConfigError
from visppo.metrics import complete_text

PANELS = (("episode_return", "episode return"), ("episode_success", "success rate"))


def read_metrics(run_dir: Path) -> dict[str, np.ndarray]:
    """``{column: float array}`` from ``run_dir/metrics.csv``, rows sorted by ``global_step``.

    Unparsable cells become NaN; a row whose ``global_step`` cannot be read (a
    line being written by a live run) is skipped.
    """
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise ConfigError(f"run directory {run_dir} not found: give the directory a `visppo train` run wrote")
    path = run_dir / "metrics.csv"
    if not path.is_file():
        raise ConfigError(f"{run_dir} has no metrics.csv: give a run directory written by `visppo train` "
                          "(it holds config.yaml, metrics.csv and checkpoints/)")
    try:
        reader = csv.reader(io.StringIO(complete_text(path), newline=""))
        header = next(reader, None)
        rows = list(reader)
    except (UnicodeDecodeError, csv.Error) as exc:
        raise ConfigError(f"{path} is not a CSV file visppo wrote ({type(exc).__name__}): give the "
                          "directory of a visppo run") from None
    except OSError as exc:  # unreadable (permissions, a special file): not the CLI's "cannot write"
        raise ConfigError(f"{path} cannot be read ({exc.strerror or exc}): make it readable or give "
                          "another run directory") from None
    if not header or "global_step" not in header:
        raise ConfigError(f"{path} has no global_step column: it is not a visppo metrics file")
    columns: dict[str, list[float]] = {name: [] for name in header}
    for row in rows:
        if len(row) != len(header):
            continue
        try:
            step = float(row[header.index("global_step")])
        except ValueError:
            continue
        if not math.isfinite(step):
            continue
        for name, cell in zip(header, row):
            columns[name].append(_float(cell))
    if not columns["global_step"]:
        raise ConfigError(f"{path} has no rows yet: let the run log at least one iteration, then plot again")
    order = np.argsort(np.asarray(columns["global_step"]), kind="stable")
    return {name: np.asarray(values, dtype=float)[order] for name, values in columns.items()}


def _float(cell: str) -> float:
    try:
        return float(cell)
    except ValueError:
        return float("nan")


def moving_average(values: np.ndarray, window: int) -> np.ndarray:
    """Trailing mean over the last ``window`` points, ignoring NaN; NaN where the window has none."""
    values = np.asarray(values, dtype=float)
    if window <= 1 or values.size == 0:
        return values.copy()
    finite = np.isfinite(values)
    sums = np.concatenate([[0.0], np.cumsum(np.where(finite, values, 0.0))])
    counts = np.concatenate([[0], np.cumsum(finite)])
    idx = np.arange(values.size)
    lo = np.maximum(0, idx + 1 - window)
    total, count = sums[idx + 1] - sums[lo], counts[idx + 1] - counts[lo]
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(count > 0, total / np.maximum(count, 1), np.nan)


def _labels(run_dirs: list[Path]) -> list[str]:
    """Each run's directory name; with the parent's name too where two names clash."""
    names = [p.resolve().name or str(p) for p in run_dirs]
    return [f"{p.resolve().parent.name}/{n}" if names.count(n) > 1 else n for p, n in zip(run_dirs, names)]


def check_format(out: Path) -> None:
    """A ConfigError unless matplotlib can write an image with ``out``'s suffix."""
    import matplotlib
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    kinds = dict(FigureCanvasAgg(Figure()).get_supported_filetypes())  # a copy: matplotlib's own dict
    if shutil.which(matplotlib.rcParams["pgf.texsystem"]) is None:  # matplotlib writes pgf through LaTeX
        kinds.pop("pgf", None)
    if out.suffix[1:].lower() not in kinds:
        raise ConfigError(f"cannot write a plot as '{out.suffix}': use one of "
                          f"{', '.join('.' + k for k in sorted(kinds))}")


def plot_runs(run_dirs: list[Path], out: Path, smooth: int = 10) -> Path:
    """Draw return and success rate against agent steps for ``run_dirs`` into ``out``; returns the path.

    The format follows ``out``'s suffix (``.png`` when it has none, which is
    then appended). Curves are moving averages over ``smooth`` logged points,
    drawn over the faint raw values.
    """
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    run_dirs = [Path(p) for p in run_dirs]
    if not run_dirs:
        raise ConfigError("no run directories given: name at least one run directory to plot")
    if smooth < 1:
        raise ConfigError(f"smooth must be at least 1 logged point, got {smooth}")
    out = Path(out)
    if out.is_dir():
        raise ConfigError(f"--out {out} is a directory: give a file name, e.g. {out / 'curves.png'}")
    if not out.suffix:
        out = out.with_suffix(".png")
    check_writable(out, "plot")
    check_format(out)
    fig = Figure(figsize=(11, 4), layout="constrained")
    FigureCanvasAgg(fig)  # the figure's canvas, which savefig draws on
    data = [read_metrics(d) for d in run_dirs]  # every error before anything is drawn or written

    axes = fig.subplots(1, 2)
    for ax, (column, title) in zip(axes, PANELS):
        _draw_panel(ax, column, title, data, _labels(run_dirs), smooth)
    axes[0].legend(loc="best", fontsize="small")
    save_figure(fig, out, dpi=120)
    return out


def save_figure(fig, out: Path, dpi: float | str = "figure") -> None:
    """Write ``fig`` as an image whole or not at all (:func:`visppo.atomic.atomic_write`), in the
    format of ``out``'s suffix (:func:`check_format`)."""
    atomic_write(Path(out), lambda f: fig.savefig(f, format=Path(out).suffix[1:].lower(), dpi=dpi), binary=True)


def _draw_panel(ax, column: str, title: str, data: list[dict], labels: list[str], smooth: int) -> None:
    """One metric of every run: faint raw values under their moving average."""
    from matplotlib.ticker import EngFormatter

    drawn = False
    for i, (metrics, label) in enumerate(zip(data, labels)):
        colour = f"C{i % 10}"
        steps, values = metrics["global_step"], metrics.get(column)
        if values is None or not np.isfinite(values).any():
            ax.plot([], [], color=colour, label=f"{label} (no data)")
            continue
        keep = np.isfinite(values)
        if smooth > 1:
            ax.plot(steps[keep], values[keep], color=colour, alpha=0.25, linewidth=1)
        ax.plot(steps, moving_average(values, smooth), color=colour, linewidth=2, label=label,
                marker="o" if keep.sum() == 1 else None)
        drawn = True
    if not drawn:
        ax.text(0.5, 0.5, f"no {title} logged", transform=ax.transAxes, ha="center", va="center", color="0.4")
    if column == "episode_success":
        ax.set_ylim(-0.03, 1.03)
    ax.set_xlabel("agent steps (global_step)")
    ax.set_ylabel(title)
    ax.set_title(title + (f" (moving average of {smooth})" if smooth > 1 else ""))
    ax.xaxis.set_major_formatter(EngFormatter())
    ax.grid(True, alpha=0.3)
