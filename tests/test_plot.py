"""visppo.plot: learning curves from runs' metrics.csv files."""

from __future__ import annotations

import math
from pathlib import Path

import imageio.v3 as iio
import numpy as np
import pytest
from conftest import one_error_line, run_main

import visppo.plot as plot_module
from visppo.errors import ConfigError, UserError
from visppo.metrics import Logger
from visppo.plot import moving_average, plot_runs, read_metrics

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _run(path, rows: int, seed: int = 0):
    """A run directory whose metrics.csv is written by visppo's own Logger, as training writes it."""
    path.mkdir(parents=True)
    logger = Logger(path, rows * 64, tensorboard=False, progress=False)
    rng = np.random.default_rng(seed)
    for i in range(1, rows + 1):
        early = i < 3  # no episode has ended yet: training logs nan
        logger.log(i * 64, {"iteration": i, "episodes": 0 if early else 2,
                            "episode_return": math.nan if early else i * 0.1 + rng.normal(),
                            "episode_success": math.nan if early else min(1.0, i / rows)})
    logger.close()
    return path


def _check_png(path):
    data = path.read_bytes()
    assert data[:8] == PNG_MAGIC
    image = iio.imread(path)
    assert image.ndim == 3 and image.shape[0] > 100 and image.shape[1] > 100
    assert image.std() > 0  # something was drawn


def test_one_and_two_runs(tmp_path):
    a, b = _run(tmp_path / "run-a", 30), _run(tmp_path / "run-b", 12, seed=1)
    out = plot_runs([a], tmp_path / "plots" / "one.png")
    assert out == tmp_path / "plots" / "one.png"
    _check_png(out)
    two = plot_runs([a, b], tmp_path / "plots" / "two.png", smooth=5)
    _check_png(two)
    assert sorted(p.name for p in (tmp_path / "plots").iterdir()) == ["one.png", "two.png"]  # no temp files


def test_suffix_picks_format(tmp_path):
    a = _run(tmp_path / "run", 5)
    assert plot_runs([a], tmp_path / "curves") == tmp_path / "curves.png"
    _check_png(tmp_path / "curves.png")
    assert plot_runs([a], tmp_path / "curves.pdf").read_bytes()[:4] == b"%PDF"
    with pytest.raises(ConfigError, match="cannot write a plot"):
        plot_runs([a], tmp_path / "curves.xyz")


def test_pgf_without_latex_is_refused_before_anything_is_drawn(tmp_path, monkeypatch):
    """matplotlib writes .pgf through LaTeX: without it, one error, not a traceback after the plot."""
    import visppo.plot

    a = _run(tmp_path / "run", 5)
    monkeypatch.setattr(visppo.plot.shutil, "which", lambda name: None)
    with pytest.raises(ConfigError, match=r"cannot write a plot as '\.pgf'"):
        plot_runs([a], tmp_path / "curves.pgf")
    assert not (tmp_path / "curves.pgf").exists()
    monkeypatch.setattr(visppo.plot.shutil, "which", lambda name: "/usr/bin/" + name)
    visppo.plot.check_format(tmp_path / "curves.pgf")  # with LaTeX: allowed


def test_runs_without_metrics(tmp_path):
    (tmp_path / "bare").mkdir()
    with pytest.raises(ConfigError, match="bare has no metrics.csv"):
        plot_runs([tmp_path / "bare"], tmp_path / "out.png")
    with pytest.raises(ConfigError, match="not found"):
        plot_runs([tmp_path / "missing"], tmp_path / "out.png")
    (tmp_path / "fresh").mkdir()
    (tmp_path / "fresh" / "metrics.csv").write_text("")
    with pytest.raises(ConfigError, match="metrics"):
        plot_runs([tmp_path / "fresh"], tmp_path / "out.png")
    (tmp_path / "fresh" / "metrics.csv").write_text("global_step,episode_return,episode_success\n")
    with pytest.raises(ConfigError, match="no rows yet"):
        plot_runs([tmp_path / "fresh"], tmp_path / "out.png")
    assert not (tmp_path / "out.png").exists()


def test_nan_only_success_and_partial_line(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.csv").write_text(
        "global_step,episode_return,episode_success\n"
        "64,nan,nan\n128,1.5,nan\n192,2.5,nan\n256,3")  # a live run mid-write
    assert read_metrics(run)["global_step"].tolist() == [64, 128, 192]
    with (run / "metrics.csv").open("a") as f:
        f.write(",0.")  # every cell there now, the last one cut short: still not data
    metrics = read_metrics(run)
    assert metrics["global_step"].tolist() == [64, 128, 192]
    _check_png(plot_runs([run], tmp_path / "out.png"))


def test_moving_average_ignores_nan():
    values = np.array([1.0, math.nan, 3.0, 5.0, math.nan, math.nan, math.nan])
    np.testing.assert_allclose(moving_average(values, 3), [1, 1, 2, 4, 4, 5, math.nan])
    np.testing.assert_allclose(moving_average(values, 1), values)


def test_an_unreadable_metrics_file_is_one_error_line_saying_it_cannot_be_read(tmp_path, monkeypatch, capsys):
    """Not the CLI's catch-all "cannot write ..." with exit 1 (permissions are faked: root reads anything)."""
    run = _run(tmp_path / "run", 3)
    open_path = Path.open

    def refuse(self, *args, **kwargs):
        if self.name == "metrics.csv":
            raise PermissionError(13, "Permission denied", str(self))
        return open_path(self, *args, **kwargs)

    monkeypatch.setattr(Path, "open", refuse)
    with pytest.raises(ConfigError, match=r"metrics\.csv cannot be read \(Permission denied\)"):
        read_metrics(run)
    code, err = run_main(capsys, "plot", run, "--out", tmp_path / "p.png")
    assert code == 2 and "cannot write" not in one_error_line(err, "metrics.csv", "cannot be read")
    assert not (tmp_path / "p.png").exists()


@pytest.mark.parametrize("under", ["afile", "afile/deeper"])
def test_out_under_a_file_is_refused_before_anything_is_drawn(tmp_path, monkeypatch, capsys, under):
    run = _run(tmp_path / "run", 3)
    (tmp_path / "afile").write_text("mine")

    def drawn(*args, **kwargs):
        raise AssertionError("drawn before the output path was checked")

    monkeypatch.setattr(plot_module, "_draw_panel", drawn)
    out = tmp_path / under / "p.png"
    with pytest.raises(UserError, match=r"afile is not a directory"):
        plot_runs([run], out)
    code, err = run_main(capsys, "plot", run, "--out", out)
    assert code == 2 and one_error_line(err, "plot output", "afile")
    assert (tmp_path / "afile").read_text() == "mine"


def _lines_by_panel(tmp_path, monkeypatch, csv_text: str, smooth: int):
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.csv").write_text(csv_text)
    figures = []
    monkeypatch.setattr(plot_module, "save_figure", lambda fig, out, dpi="figure": figures.append(fig))
    plot_module.plot_runs([run], tmp_path / "out.png", smooth=smooth)
    (fig,) = figures
    panels = {}
    for ax in fig.axes[:2]:
        curve = [line for line in ax.get_lines() if line.get_label() == "run"]
        raw = [line for line in ax.get_lines() if not line.get_label().startswith("run")]
        panels[ax.get_ylabel()] = (curve, raw)
    return panels


def test_each_panel_draws_its_own_column_sorted_by_step_and_smoothed(tmp_path, monkeypatch):
    """Kills: a panel reading another column (success drawn from episode_return), rows drawn in file
    order instead of by global_step, and the raw values drawn as the curve instead of their moving average.
    The existing plot tests check only that a PNG with something in it was written."""
    panels = _lines_by_panel(tmp_path, monkeypatch, "global_step,episode_return,episode_success\n"
                             "192,30,0.75\n64,10,0.25\n128,20,0.5\n256,40,1.0\n", smooth=2)
    (ret_curve,), (ret_raw,) = panels["episode return"]
    (suc_curve,), (suc_raw,) = panels["success rate"]
    for line in (ret_curve, ret_raw, suc_curve, suc_raw):
        assert line.get_xdata().tolist() == [64, 128, 192, 256]
    assert ret_raw.get_ydata().tolist() == [10, 20, 30, 40]
    assert ret_curve.get_ydata().tolist() == [10, 15, 25, 35]  # trailing mean of 2
    assert suc_raw.get_ydata().tolist() == [0.25, 0.5, 0.75, 1.0]
    assert suc_curve.get_ydata().tolist() == [0.25, 0.375, 0.625, 0.875]
