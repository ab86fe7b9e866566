"""tools/learning_table.py as code: its functions and main(), on synthetic run folders (config.yaml,
metrics.csv, final_eval.json) and on tiny real runs of configs/dot_reach.yaml."""

from __future__ import annotations

import importlib
import json
import math
import sys
from pathlib import Path

import numpy as np
import pytest
from conftest import one_error_line, tiny_overrides

ROOT = Path(__file__).resolve().parents[1]
TOOLS = ROOT / "tools"


def load_tool(name: str):
    """tools/<name>.py as a module (tools/ is not a package)."""
    if str(TOOLS) not in sys.path:
        sys.path.insert(0, str(TOOLS))
    return importlib.import_module(name)


lt = load_tool("learning_table")


def fake_run(run_dir: Path, env_id: str, total: int, rows: list[tuple], look: str | None = None,
             final: float | None = None, episodes: int = 10, success: float | None = None) -> None:
    """A run folder as visppo train and eval leave it: config.yaml, metrics.csv, final_eval.json."""
    run_dir.mkdir(parents=True)
    kwargs = f"  kwargs:\n    look: {look}\n" if look else ""
    (run_dir / "config.yaml").write_text(f"env:\n  id: {env_id}\n{kwargs}ppo:\n  total_steps: {total}\n")
    lines = ["global_step,episode_return,episode_success,steps_per_second"]
    lines += [f"{s},{r},{ok},100.0" for s, r, ok in rows]
    (run_dir / "metrics.csv").write_text("\n".join(lines) + "\n")
    if final is not None:
        (run_dir / "final_eval.json").write_text(json.dumps({"mean_return": final, "episodes": episodes,
                                                             "success_rate": success}))


def table(capsys, *args) -> tuple[int, str, str]:
    code = lt.main(["table", *map(str, args)])
    out = capsys.readouterr()
    return code, out.out, out.err


def rows_of(text: str, prefix: str) -> list[list[str]]:
    return [line.split(" | ") for line in text.splitlines() if line.startswith(f"| {prefix}")]


# --------------------------------------------------------------------------- the training-curve table


def test_table_takes_mean_and_std_over_seeds_at_each_step_count(tmp_path, capsys):
    out = tmp_path / "table"
    fake_run(out / "reach" / "seed1", "visppo/Reach-v0", 2000, [(1000, 1.0, 0.0), (2000, 3.0, 0.5)])
    fake_run(out / "reach" / "seed2", "visppo/Reach-v0", 2000, [(1000, 2.0, 0.0), (2000, 5.0, 1.0)])
    fake_run(out / "short" / "seed1", "visppo/Push-v0", 2000, [(1000, 7.0, 0.0)])  # stopped early
    md = tmp_path / "table.md"
    code, text, err = table(capsys, out, "--at", "1k", "2k", "--markdown", md, "--plot", tmp_path / "c.png")
    assert code == 0, err
    assert md.read_text() == text  # --markdown writes what is printed
    rows = rows_of(text, "reach") + rows_of(text, "short")
    assert rows[0][2:6] == ["1,000", "2", "1.50 ± 0.71", "0.00 ± 0.00"]
    assert rows[1][2:6] == ["2,000", "2", "4.00 ± 1.41", "0.75 ± 0.35"]
    assert rows[1][8] == "0 ± 0"  # 2000 steps at 100 steps/s: 0.33 minutes
    assert len(rows) == 3  # the short run has no figure at 2k: its row is left out
    assert "Final policy" not in text and "IQM" not in text  # no final_eval.json: no final table
    assert (tmp_path / "c.png").stat().st_size > 0
    code, _, err = table(capsys, out, "--at", "1k", "--plot", tmp_path / "s.png", "--column", "episode_success")
    assert code == 0, err
    assert (tmp_path / "s.png").read_bytes() != (tmp_path / "c.png").read_bytes()  # another column drawn


def test_table_compares_variants_of_an_ablation_row_by_row(tmp_path, capsys):
    base, variant = tmp_path / "abl" / "base", tmp_path / "abl" / "norm_reward"
    fake_run(base / "reach" / "seed1", "visppo/Reach-v0", 2000, [(1000, 1.0, 0.0), (2000, 3.0, 0.5)])
    fake_run(variant / "reach" / "seed1", "visppo/Reach-v0", 2000, [(1000, 2.0, 0.0), (2000, 6.0, 1.0)])
    fake_run(variant / "reach" / "seed2", "visppo/Reach-v0", 2000, [(1000, 2.0, 0.0), (2000, 8.0, 1.0)])
    fake_run(base / "swingup" / "seed1", "dmc:cartpole-swingup", 2000, [(2000, 140.0, "")], look="fast")
    code, text, err = table(capsys, base, variant, "--at", "2k", "--plot", tmp_path / "abl.png")
    assert code == 0, err
    assert [(r[0], r[3], r[4]) for r in rows_of(text, "reach")] == [
        ("| reach (base)", "1", "3.00"), ("| reach (norm_reward)", "2", "7.00 ± 1.41")]
    assert rows_of(text, "swingup")[0][1] == "`dmc:cartpole-swingup` (fast look)"  # the table says which look
    assert (tmp_path / "abl.png").stat().st_size > 0


def test_plot_wraps_panels_into_rows(tmp_path, capsys):
    import matplotlib.image

    out = tmp_path / "table"
    for i in range(lt.PANELS_PER_ROW + 2):  # one full row and two panels of the next
        fake_run(out / f"task{i}" / "seed1", "visppo/Reach-v0", 2000, [(1000, 1.0, 0.0), (2000, float(i), 0.0)])
    code, _, err = table(capsys, out, "--at", "2k", "--plot", tmp_path / "w.png")
    assert code == 0, err
    height, width = matplotlib.image.imread(tmp_path / "w.png").shape[:2]
    assert (width, height) == (round(4.5 * lt.PANELS_PER_ROW * 110), round(3.5 * 2 * 110))


def test_a_seed_still_training_does_not_cut_the_others_curves_short():
    """The band runs to the longest run; past a shorter one's last row, the seeds that got there."""
    import numpy as np
    from matplotlib.figure import Figure

    ax = Figure().subplots()
    long = [{"global_step": float(s), "r": float(s)} for s in range(0, 500_001, 50_000)]
    short = [{"global_step": float(s), "r": float(s) + 10} for s in (0, 1024, 2048)]
    lt._band(ax, [long, short], "r", "")
    [line] = ax.get_lines()
    x, y = line.get_data()
    assert x[-1] == 500_000 and y[-1] == 500_000  # the long seed alone at its end
    assert y[0] == 5  # both seeds at the start
    assert np.isfinite(y).all()


def test_a_crash_while_writing_the_markdown_or_the_plot_keeps_the_old_file_whole(tmp_path, capsys, monkeypatch):
    """--markdown and --plot go through visppo.atomic: a write that dies part way (here a full disk
    at the markdown's flush, a savefig that stops half way) leaves the previous file as it was."""
    import os

    from matplotlib.figure import Figure

    out = tmp_path / "table"
    fake_run(out / "reach" / "seed1", "visppo/Reach-v0", 2000, [(1000, 1.0, 0.0), (2000, 3.0, 0.5)])
    md, png = tmp_path / "t.md", tmp_path / "p.png"
    md.write_text("old table\n")
    png.write_bytes(b"old image")

    def half_a_figure(self, fname, **kwargs):
        with open(fname, "wb") if isinstance(fname, (str, os.PathLike)) else fname as f:
            f.write(b"\x89PNG half")
        raise RuntimeError("killed mid-write")

    monkeypatch.setattr(Figure, "savefig", half_a_figure)
    with pytest.raises(RuntimeError, match="killed mid-write"):
        lt.main(["table", str(out), "--at", "2k", "--markdown", str(md), "--plot", str(png)])
    assert png.read_bytes() == b"old image" and md.read_text().startswith("| config |")  # the table came first
    md.write_text("old table\n")

    def full_disk(fd):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "fsync", full_disk)
    with pytest.raises(OSError, match="No space left"):
        lt.main(["table", str(out), "--at", "2k", "--markdown", str(md)])
    assert md.read_text() == "old table\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["p.png", "t.md", "table"]  # no temporary file left


def test_table_per_seed_lists_each_seeds_return_in_seed_order(tmp_path, capsys):
    out = tmp_path / "abl" / "base"
    for seed, ret in ((10, 30.0), (2, 20.0), (1, 10.0)):  # seed10 sorts after seed2 as a number, not as text
        fake_run(out / "swingup" / f"seed{seed}", "dmc:cartpole-swingup", 2000, [(2000, ret, "")],
                 final=ret + 1)
    code, text, err = table(capsys, out, "--at", "2k", "--per-seed", "--reps", "100")
    assert code == 0, err
    curve, final = rows_of(text, "swingup")
    assert curve[4] == "20.00 ± 10.00 (1: 10, 2: 20, 10: 30)"
    assert curve[6] == ""  # no periodic evaluation logged: the cell stays empty, with no seed list
    assert final[6] == "21.00 ± 10.00 (1: 11, 2: 21, 10: 31)"
    code, text, _ = table(capsys, out, "--at", "2k", "--reps", "100")
    assert "20.00 ± 10.00 |" in text and "10: 30" not in text


def test_only_seed_folders_are_seeds_and_one_seed_twice_is_refused(tmp_path, capsys):
    """A run moved aside beside the others (seed2_old) is not a third seed; seed1 and seed01 are one."""
    out = tmp_path / "t"
    for name, ret in (("seed1", 10.0), ("seed3", 30.0), ("seed2_old", 99.0)):
        fake_run(out / "swingup" / name, "dmc:cartpole-swingup", 2000, [(2000, ret, "")], final=ret)
    code, text, err = table(capsys, out, "--at", "2k", "--per-seed", "--reps", "100")
    assert code == 0, err
    curve, final = rows_of(text, "swingup")
    assert curve[3] == "2" and curve[4] == "20.00 ± 14.14 (1: 10, 3: 30)"
    fake_run(out / "swingup" / "seed01", "dmc:cartpole-swingup", 2000, [(2000, 5.0, "")], final=5.0)
    code, _, err = table(capsys, out, "--at", "2k")
    assert code == 2 and one_error_line(err, "seed01", "seed1", "one seed twice")


@pytest.mark.parametrize("change, needle", [
    ({"deterministic": False}, "is not the final evaluation (deterministic=False"),
    ({"seed": 7}, "seed=7"),
    ({"env_overrides": ["env.kwargs.look=published"]}, "evaluated in a changed env (env.kwargs.look=published)"),
    ({"env_id": "dmc:cheetah-run"}, "evaluated dmc:cheetah-run, where the run trained on dmc:cartpole-swingup"),
    ({"global_step": 1024}, "evaluated step 1,024, before the run's ppo.total_steps 2,000"),
])
def test_an_evaluation_that_is_not_the_final_policys_is_refused(tmp_path, capsys, change, needle):
    """A hand-run `visppo eval RUN --json RUN/final_eval.json` of another checkpoint, look or
    stream must not stand in the final table as the final policy's."""
    run = tmp_path / "t" / "swingup" / "seed1"
    fake_run(run, "dmc:cartpole-swingup", 2000, [(2000, 1.0, "")], final=1.0)
    good = {"mean_return": 1.0, "episodes": 10, "deterministic": True, "seed": 0, "env_overrides": [],
            "env_id": "dmc:cartpole-swingup", "global_step": 2048}
    (run / "final_eval.json").write_text(json.dumps(good))
    assert table(capsys, tmp_path / "t", "--at", "2k", "--reps", "100")[0] == 0
    (run / "final_eval.json").write_text(json.dumps({**good, **change}))
    code, _, err = table(capsys, tmp_path / "t", "--at", "2k")
    assert code == 2 and one_error_line(err, "final_eval.json", needle)


def test_seeds_of_one_row_with_another_look_or_budget_are_refused(tmp_path, capsys):
    out = tmp_path / "t"
    fake_run(out / "swingup" / "seed1", "dmc:cartpole-swingup", 2000, [(2000, 1.0, "")], look="fast", final=1.0)
    fake_run(out / "swingup" / "seed2", "dmc:cartpole-swingup", 2000, [(2000, 1.0, "")], final=1.0)
    code, _, err = table(capsys, out, "--at", "2k")
    assert code == 2 and one_error_line(err, "differ in look (fast and published)", "one row of the table is one")
    fake_run(out / "balance" / "seed1", "dmc:cartpole-balance", 2000, [(2000, 1.0, "")], look="fast")
    fake_run(out / "balance" / "seed2", "dmc:cartpole-balance", 4000, [(4000, 1.0, "")], look="fast")
    (out / "swingup").rename(tmp_path / "away")
    code, _, err = table(capsys, out, "--at", "2k")
    assert code == 2 and one_error_line(err, "differ in ppo.total_steps (2000 and 4000)")


def test_published_figures_stand_beside_the_row_that_reaches_their_budget():
    """A 500k-step run of 1024-sample rollouts logs its last row at 500,736: that row, and no
    earlier one, stands beside the figures published at 500k agent steps."""
    assert [m for m, *_ in lt.published_at("dmc:walker-walk", 500_736)] == ["SB3 PPO CnnPolicy", "DrQ-v2"]
    assert lt.published_at("dmc:walker-walk", 500_000)[1][1] == 766
    assert lt.published_at("dmc:walker-walk", 499_712) == []
    assert lt.published_at("dmc:walker-walk", 600_000) == []
    assert lt.published_at("visppo/Reach-v0", 500_736) == []


def test_published_holds_the_ten_tasks_of_mrq_table_6():
    expected = {"reacher-easy": (113, 938), "cartpole-balance": (353, 993), "cartpole-swingup": (596, 864),
                "finger-spin": (241, 860), "walker-walk": (47, 766), "cheetah-run": (155, 728),
                "ball_in_cup-catch": (105, 909), "finger-turn_easy": (189, 503), "walker-run": (39, 546),
                "reacher-hard": (10, 705)}
    got = {env.removeprefix("dmc:"): tuple(s for _, s, _ in lt.published_at(env, 500_000)) for env in lt.PUBLISHED}
    assert got == expected
    assert all(src == "MR.Q, Table 6" for f in lt.PUBLISHED.values() for _, _, src in f[500_000])


def test_table_reads_a_run_that_logged_no_speed_as_tools_sb3_dmc_writes_it(tmp_path, capsys):
    run = tmp_path / "sb3" / "dmc_walker_walk" / "seed1"
    run.mkdir(parents=True)
    (run / "config.yaml").write_text("env:\n  id: dmc:walker-walk\nppo:\n  total_steps: 4096\n")
    (run / "metrics.csv").write_text("global_step,episode_return\n2048,10.0\n4096,30.0\n")
    (run / "final_eval.json").write_text(json.dumps({"mean_return": 25.0, "episodes": 10}))
    code, text, err = table(capsys, tmp_path / "sb3", "--at", "4096", "--reps", "50")
    assert code == 0, err
    curve, final = rows_of(text, "dmc_walker_walk")
    assert curve[2:5] == ["4,096", "1", "30.00"] and curve[8] == ""  # no speed logged: no minutes
    assert final[6] == "25.00"


# --------------------------------------------------------------------------- the final-policy table and the IQM


# 4 DMC tasks x 2 seeds, by hand: sorted 10 20 30 40 50 60 70 1000; the IQM drops the lowest and the
# highest quarter (2 scores each) and averages 30 40 50 60: 45. The plain mean would be 160.
IQM_SCORES = {"dmc_cartpole_swingup": ("dmc:cartpole-swingup", (10.0, 1000.0)),
              "dmc_walker_walk": ("dmc:walker-walk", (20.0, 70.0)),
              "dmc_finger_spin": ("dmc:finger-spin", (60.0, 30.0)),
              "dmc_reacher_hard": ("dmc:reacher-hard", (40.0, 50.0))}


def dmc_runs(out: Path, scores=IQM_SCORES, look: str | None = "fast") -> None:
    for task, (env_id, finals) in scores.items():
        for seed, final in enumerate(finals, start=1):
            fake_run(out / task / f"seed{seed}", env_id, 500_000, [(250_880, final / 2, ""), (500_736, final, "")],
                     look=look, final=final)


def test_final_table_gives_mean_std_seeds_look_budget_and_the_published_figures(tmp_path, capsys):
    out = tmp_path / "table"
    dmc_runs(out)
    fake_run(out / "reach" / "seed1", "visppo/Reach-v0", 4000, [(4096, 5.0, 1.0)], final=7.5, episodes=3,
             success=2 / 3)
    fake_run(out / "reach" / "seed2", "visppo/Reach-v0", 4000, [(2048, 5.0, 1.0)])  # not finished: no final
    md = tmp_path / "t.md"
    code, text, err = table(capsys, out, "--at", "500k", "--reps", "200", "--markdown", md)
    assert code == 0, err
    assert md.read_text() == text
    final = {r[0].removeprefix("| "): r for r in rows_of(text, "") if r[2] in ("fast", "default")}
    assert final["dmc_cartpole_swingup"][1:7] == ["`dmc:cartpole-swingup`", "fast", "500,000", "2", "10",
                                                  "505.00 ± 700.04"]
    assert final["dmc_cartpole_swingup"][7:9] == [  # the suite reports no success: that cell stays empty
        "", "SB3 PPO CnnPolicy 596 (MR.Q, Table 6); DrQ-v2 864 (MR.Q, Table 6) |"]
    assert final["dmc_reacher_hard"][6] == "45.00 ± 7.07" and "DrQ-v2 705" in final["dmc_reacher_hard"][8]
    # no look in the config: the default look; one seed evaluated of two; its own episode count
    assert final["reach"][1:9] == ["`visppo/Reach-v0`", "default", "4,000", "1", "3", "7.50", "0.67",
                                   " |"]
    # the curve table is still there, beside it
    assert rows_of(text, "dmc_walker_walk")[0][2:5] == ["500,000", "2", "45.00 ± 35.36"]


def test_iqm_is_the_interquartile_mean_over_tasks_and_seeds_with_a_bootstrap_interval(tmp_path, capsys):
    out = tmp_path / "table"
    dmc_runs(out)
    fake_run(out / "reach" / "seed1", "visppo/Reach-v0", 4000, [(4096, 5.0, 1.0)], final=900.0)
    final = lt.final_results([out])
    [summary] = lt.iqm_summary(final, reps=2000)
    assert summary["iqm"] == pytest.approx(45.0)  # by hand, above; a plain mean would be 160
    assert sorted(summary["tasks"]) == sorted(IQM_SCORES) and summary["seeds"] == ["seed1", "seed2"]
    assert summary["left_out"] == ["reach"]  # not on the suite's 0-1000 scale: not in the IQM
    lo, hi = summary["ci"]
    assert 10 <= lo < 45 < hi <= 65 and hi - lo > 10  # seeds resampled within each task reach 65 at most
    assert summary["scores"].shape == (2, 4)  # runs x tasks, as rliable takes them
    again = lt.iqm_summary(final, reps=2000)[0]
    assert again["ci"] == summary["ci"]  # the bootstrap is seeded: the same table twice

    code, text, err = table(capsys, out, "--at", "500k", "--reps", "2000")
    assert code == 0, err
    line = next(line for line in text.splitlines() if line.startswith("IQM"))
    assert line.startswith("IQM over 4 DMC task(s) x 2 seed(s) (seed1, seed2), raw returns (0-1000): **45.0** "
                           f"[95% CI {lo:.1f}, {hi:.1f}] (stratified bootstrap, 2,000 reps, rliable)"), line
    assert line.endswith("left out (no common scale): reach"), line


def test_one_seed_per_task_gets_no_interval_rather_than_a_zero_width_one(tmp_path, capsys):
    out = tmp_path / "table"
    dmc_runs(out, {task: (env_id, finals[:1]) for task, (env_id, finals) in IQM_SCORES.items()})
    code, text, err = table(capsys, out, "--at", "500k", "--reps", "200")
    assert code == 0, err
    line = next(line for line in text.splitlines() if line.startswith("IQM"))
    assert line.startswith("IQM over 4 DMC task(s) x 1 seed(s) (seed1), raw returns (0-1000): **") and "CI" not in line
    assert "(no interval: one seed per task leaves the stratified bootstrap nothing to resample)" in line, line


def test_goal_line_counts_tasks_above_the_ppo_row_and_sets_the_mean_beside_the_published_means(tmp_path, capsys):
    """Task means 505, 45, 45, 45 against PPO 596, 47, 241, 10 (MR.Q, Table 6): above on reacher-hard
    only; mean 160 against PPO's 223.5 and DrQ-v2's 798.75, half way 511.1. Reach has no published row."""
    out = tmp_path / "table"
    dmc_runs(out)
    fake_run(out / "reach" / "seed1", "visppo/Reach-v0", 4000, [(4096, 5.0, 1.0)], final=900.0)
    code, text, err = table(capsys, out, "--at", "500k", "--reps", "200")
    assert code == 0, err
    [line] = [line for line in text.splitlines() if line.startswith("Against the published rows")]
    assert line == ("Against the published rows, 4 task(s): above SB3 PPO CnnPolicy on 1 of 4 (not on "
                    "dmc_cartpole_swingup, dmc_finger_spin, dmc_walker_walk); mean of the task means 160.0 "
                    "against SB3 PPO CnnPolicy 223.5, DrQ-v2 798.8 (half way from the first to the last: 511.1)")


def test_iqm_of_twelve_scores_drops_three_at_each_end_and_uses_the_common_seeds(tmp_path):
    """4 tasks x 3 seeds: the 25% trimmed mean drops 3 scores at each end. A fourth seed that only
    one task has is not in the IQM (the matrix is runs x tasks, the same seeds in every task)."""
    scores = {f"t{i}": (f"dmc:task-{i}", tuple(float(v) for v in vals)) for i, vals in enumerate(
        [(0, 1, 2), (3, 4, 5), (6, 7, 8), (9, 10, 11)])}
    out = tmp_path / "t"
    dmc_runs(out, scores, look=None)
    fake_run(out / "t0" / "seed4", "dmc:task-0", 500_000, [(500_736, 1.0, "")], final=5000.0)
    [summary] = lt.iqm_summary(lt.final_results([out]), reps=500)
    assert summary["seeds"] == ["seed1", "seed2", "seed3"]
    assert summary["iqm"] == pytest.approx(np.mean([3, 4, 5, 6, 7, 8]))  # 0 1 2 and 9 10 11 dropped
    assert lt.final_results([out])[0]["look"] == "published"  # a suite task without a look: the suite's own


def test_each_variant_gets_its_own_iqm(tmp_path, capsys):
    base, variant = tmp_path / "abl" / "base", tmp_path / "abl" / "epochs10"
    dmc_runs(base)
    dmc_runs(variant, {task: (env, tuple(2 * s for s in finals)) for task, (env, finals) in IQM_SCORES.items()})
    summaries = {s["variant"]: s for s in lt.iqm_summary(lt.final_results([base, variant]), reps=200)}
    assert summaries["base"]["iqm"] == pytest.approx(45.0)
    assert summaries["epochs10"]["iqm"] == pytest.approx(90.0)
    code, text, err = table(capsys, base, variant, "--at", "500k", "--reps", "200")
    assert code == 0, err
    assert [line.split(" over")[0] for line in text.splitlines() if line.startswith("IQM")] == [
        "IQM (base)", "IQM (epochs10)"]


def test_table_without_rliable_still_prints_and_says_the_iqm_needs_it(tmp_path, capsys, monkeypatch):
    out = tmp_path / "table"
    dmc_runs(out)
    monkeypatch.setitem(sys.modules, "rliable", None)  # import rliable: ImportError
    monkeypatch.setitem(sys.modules, "rliable.library", None)
    code, text, err = table(capsys, out, "--at", "500k")
    assert code == 0, err
    assert rows_of(text, "dmc_walker_walk")[1][6] == "45.00 ± 35.36"
    assert text.splitlines()[-1].startswith("IQM: not computed, it needs rliable")


def test_iqm_says_so_when_no_dmc_task_or_no_common_seed(tmp_path):
    out = tmp_path / "t"
    fake_run(out / "reach" / "seed1", "visppo/Reach-v0", 4000, [(4096, 5.0, 1.0)], final=7.5)
    [summary] = lt.iqm_summary(lt.final_results([out]), reps=10)
    assert math.isnan(summary["iqm"]) and "no DeepMind Control task" in lt.iqm_line(summary)
    fake_run(out / "a" / "seed1", "dmc:walker-walk", 4000, [(4096, 5.0, "")], final=1.0)
    fake_run(out / "b" / "seed2", "dmc:walker-run", 4000, [(4096, 5.0, "")], final=2.0)
    [summary] = lt.iqm_summary(lt.final_results([out]), reps=10)
    assert math.isnan(summary["iqm"]) and "share no evaluated seed" in lt.iqm_line(summary)


def test_two_configs_of_one_dmc_task_in_a_variant_are_refused_not_counted_twice(tmp_path, capsys):
    """The IQM takes one score per task and seed: a second config of cartpole-swingup (same env.id,
    same look) in the same folder is another method, not another task."""
    out = tmp_path / "table"
    dmc_runs(out)
    dmc_runs(out, {"dmc_cartpole_swingup_lr": ("dmc:cartpole-swingup", (500.0, 600.0))})
    with pytest.raises(lt.UsageError, match="dmc_cartpole_swingup and dmc_cartpole_swingup_lr are the same"):
        lt.iqm_summary(lt.final_results([out]), reps=10)
    md = tmp_path / "t.md"
    code, text, err = table(capsys, out, "--at", "500k", "--reps", "10", "--markdown", md)
    assert code == 2 and text == "" and not md.exists()
    one_error_line(err, "dmc_cartpole_swingup_lr", "dmc:cartpole-swingup, fast look", "count twice")
    # the same env in another look is another task
    dmc_runs(tmp_path / "b", {"dmc_cartpole_swingup_lr": ("dmc:cartpole-swingup", (500.0, 600.0))}, look=None)
    dmc_runs(tmp_path / "b", look="fast")
    [summary] = lt.iqm_summary(lt.final_results([tmp_path / "b"]), reps=10)
    assert len(summary["tasks"]) == 5


# --------------------------------------------------------------------------- bad input


@pytest.mark.parametrize("args, needle", [
    (["--at", "abc"], "'abc' is not a step count"),
    (["--at", "0"], "must be positive"),
    (["--at", "1e400"], "'1e400' is not a step count"),
    (["--at", "infk"], "'infk' is not a step count"),
    (["--reps", "0"], "--reps"),
    (["--bogus"], "unknown arguments --bogus"),
    (["--column", "nope", "--plot", "{tmp}/p.png"], "--column nope"),
    (["--markdown", "{tmp}/nowhere/t.md"], "does not exist"),
    (["--plot", "{tmp}/p.xyz"], "--plot"),
    (["--markdown", "{tmp}"], "is a folder"),
])
def test_table_refuses_bad_input_with_one_error_line_and_writes_nothing(tmp_path, capsys, args, needle):
    out = tmp_path / "t"
    fake_run(out / "reach" / "seed1", "visppo/Reach-v0", 2000, [(2000, 3.0, 0.5)])
    args = [a.replace("{tmp}", str(tmp_path)) for a in args]
    before = sorted(tmp_path.rglob("*"))
    code, text, err = table(capsys, out, "--markdown", tmp_path / "t.md", *args)
    assert code == 2 and text == ""
    one_error_line(err, needle)
    assert sorted(tmp_path.rglob("*")) == before  # no table, no plot


def test_table_refuses_folders_that_are_not_run_folders(tmp_path, capsys):
    code, _, err = table(capsys, tmp_path / "nowhere")
    assert code == 2 and one_error_line(err, "nowhere", "is not a folder")
    (tmp_path / "empty").mkdir()
    code, _, err = table(capsys, tmp_path / "empty")
    assert code == 2 and one_error_line(err, "holds no runs")
    run = tmp_path / "t" / "reach" / "seed1"
    fake_run(run, "visppo/Reach-v0", 2000, [(2000, 3.0, 0.5)])
    (run / "config.yaml").unlink()
    code, _, err = table(capsys, tmp_path / "t")
    assert code == 2 and one_error_line(err, "seed1 has metrics.csv but no config.yaml")
    for variant in ("a", "b"):  # two variants in folders of one name would merge into one
        fake_run(tmp_path / variant / "runs" / "reach" / "seed1", "visppo/Reach-v0", 2000, [(2000, 3.0, 0.5)])
    code, _, err = table(capsys, tmp_path / "a" / "runs", tmp_path / "b" / "runs")
    assert code == 2 and one_error_line(err, "two folders are named runs", "rename")
    fake_run(tmp_path / "u" / "reach" / "seed1", "visppo/Reach-v0", 2000, [(2000, 3.0, 0.5)])
    (tmp_path / "u" / "reach" / "seed1" / "final_eval.json").write_text("{not json")
    code, _, err = table(capsys, tmp_path / "u")
    assert code == 2 and one_error_line(err, "final_eval.json is not a visppo eval --json file")


@pytest.mark.parametrize("args, needle", [
    (["configs/dot_reach.yaml", "--parallel", "0"], "--parallel must be at least 1"),
    (["configs/dot_reach.yaml", "--eval-episodes", "0"], "--eval-episodes must be at least 1"),
    (["configs/nosuch.yaml"], "configs/nosuch.yaml"),
    (["configs/dot_reach.yaml", "ppo.bogus=1"], "bogus"),
    (["configs/dot_reach.yaml", "train.seed=4"], "train.seed=4"),
    (["configs/dot_reach.yaml", "configs/../configs/dot_reach.yaml"], "share a name"),
    (["configs/dmc.yaml", "configs/dmc_cartpole_swingup.yaml"], "train the same DMC task (dmc:cartpole-swingup"),
    (["configs/dot_reach.yaml", "--seeds", "x"], "--seeds"),
    (["configs/dot_reach.yaml", "--keep", "{out}"], "is --out itself"),
    ([], "the following arguments are required"),
])
def test_run_refuses_bad_input_with_one_error_line_and_starts_nothing(tmp_path, capsys, monkeypatch, args,
                                                                     needle):
    monkeypatch.chdir(ROOT)
    out = tmp_path / "out"
    args = [a.format(out=out) for a in args]
    try:
        code = lt.main(["run", *args, "--out", str(out)])
    except SystemExit as exc:  # argparse's own errors
        code = exc.code
    captured = capsys.readouterr()
    assert code == 2 and captured.out == ""
    one_error_line(captured.err, needle)
    assert not out.exists()


# --------------------------------------------------------------------------- run: tiny real runs


def test_run_goes_seed_by_seed_so_a_stopped_table_covers_every_config(tmp_path):
    a, b = tmp_path / "a.yaml", tmp_path / "b.yaml"
    order = [(d.parent.name, d.name) for d, _ in lt.jobs([a, b], [1, 2], tmp_path / "out", [], 10)]
    assert order == [("a", "seed1"), ("b", "seed1"), ("a", "seed2"), ("b", "seed2")]


def test_run_skips_finished_runs_resumes_stopped_ones_and_evaluates_finished_ones(tmp_path):
    out, config = tmp_path / "t", Path("configs/dot_reach.yaml")
    done = lt.run_dir_of(out, config, 1)
    fake_run(done, "visppo/DotReach-v0", 2000, [(2000, 1.0, 1.0)], final=1.0)
    assert lt.finished(done)
    stopped = lt.run_dir_of(out, config, 2)
    fake_run(stopped, "visppo/DotReach-v0", 4000, [(2000, 1.0, 1.0)])
    (stopped / "checkpoints").mkdir()
    (stopped / "checkpoints" / "latest.pt").write_bytes(b"")
    assert not lt.finished(stopped)
    unevaluated = lt.run_dir_of(out, config, 3)
    fake_run(unevaluated, "visppo/DotReach-v0", 2000, [(2048, 1.0, 1.0)])
    todo = dict(lt.jobs([config], [1, 2, 3, 4], out, ["ppo.total_steps=64"], episodes=5))
    assert done not in todo  # finished and evaluated: nothing to do
    resume, evaluate = todo[stopped]
    # with the command's keys a resume takes (a run moved to another machine goes on with its devices)
    assert resume[3:] == ["train", "--resume", str(stopped), "train.threads=1", "run.progress=false",
                          "ppo.total_steps=64"]
    assert evaluate[3:] == ["eval", str(stopped), "--episodes", "5", "--deterministic", "--seed", "0",
                            "--json", str(stopped / "final_eval.json")]
    assert [c[3] for c in todo[unevaluated]] == ["eval"]  # finished, no final_eval.json: evaluated only
    fresh = todo[lt.run_dir_of(out, config, 4)][0]
    assert "train.seed=4" in fresh and "train.threads=1" in fresh and fresh[-1] == "ppo.total_steps=64"


def test_run_trains_then_evaluates_the_final_policy_and_evaluates_a_finished_run_again_if_asked(
        tmp_path, capsys, monkeypatch):
    """A tiny DotReach run: trained, then `visppo eval --deterministic --seed 0` writes its
    final_eval.json; with the file removed, the next `run` evaluates it again (the same figures:
    a deterministic policy on evaluation stream 0) without training; then nothing is left to do."""
    monkeypatch.chdir(ROOT)
    monkeypatch.setattr(lt, "POLL_SECONDS", 0.2)
    out = tmp_path / "t"
    overrides = [o for o in tiny_overrides() if not o.startswith("run.")]
    run = ["run", "configs/dot_reach.yaml", *overrides, "--seeds", "1", "--out", str(out), "--parallel", "1",
           "--eval-episodes", "2"]
    assert lt.main(run) == 0, (out / "dot_reach" / "seed1.log").read_text()
    started = [line for line in capsys.readouterr().out.splitlines() if line.startswith("start:")]
    assert [line.split()[4] for line in started] == ["train", "eval"]
    run_dir = out / "dot_reach" / "seed1"
    first = json.loads((run_dir / "final_eval.json").read_text())
    assert first["episodes"] == 2 and first["deterministic"] is True and first["seed"] == 0
    assert first["global_step"] == 128  # the final policy, after the whole budget
    metrics = (run_dir / "metrics.csv").read_text()

    (run_dir / "final_eval.json").unlink()
    assert lt.main(run) == 0
    started = [line for line in capsys.readouterr().out.splitlines() if line.startswith("start:")]
    assert [line.split()[4] for line in started] == ["eval"]
    assert (run_dir / "metrics.csv").read_text() == metrics  # not trained again
    again = json.loads((run_dir / "final_eval.json").read_text())
    assert again["returns"] == first["returns"]

    assert lt.main(run) == 0
    assert "start:" not in capsys.readouterr().out  # finished and evaluated: nothing to do
    assert lt.main([*run, "ppo.learning_rate=0.125"]) == 2  # another recipe into the same --out
    captured = capsys.readouterr()
    assert "start:" not in captured.out
    one_error_line(captured.err, f"{run_dir} was started with ppo.learning_rate=", "this command gives 0.125")
    code, text, err = table(capsys, out, "--at", "128", "--reps", "100")
    assert code == 0, err
    [final] = [r for r in rows_of(text, "dot_reach") if r[2] == "default"]
    assert final[3:7] == ["128", "1", "2", f"{first['mean_return']:.2f}"]  # one seed: no spread shown


def test_keep_copies_each_evaluated_run_and_a_later_run_skips_what_was_kept(tmp_path, capsys, monkeypatch):
    """--keep: the evaluated run's config.yaml, metrics.csv and final_eval.json are copied to
    KEEP/<config>/seed<S>; with the run folders gone (a new machine), the same command starts
    nothing for the kept seed and trains only the new one; `table` reads the kept folder."""
    monkeypatch.chdir(ROOT)
    monkeypatch.setattr(lt, "POLL_SECONDS", 0.2)
    out, keep = tmp_path / "t", tmp_path / "kept"
    overrides = [o for o in tiny_overrides() if not o.startswith("run.")]
    run = ["run", "configs/dot_reach.yaml", *overrides, "--out", str(out), "--parallel", "1",
           "--eval-episodes", "2", "--keep", str(keep)]
    assert lt.main([*run, "--seeds", "1"]) == 0, (out / "dot_reach" / "seed1.log").read_text()
    assert "kept: " in capsys.readouterr().out
    copy = keep / "dot_reach" / "seed1"
    assert sorted(p.name for p in copy.iterdir()) == ["config.yaml", "final_eval.json", "metrics.csv"]
    for name in lt.KEPT:
        assert (copy / name).read_bytes() == (out / "dot_reach" / "seed1" / name).read_bytes()

    import shutil
    shutil.rmtree(out)
    assert lt.main([*run, "--seeds", "1", "2"]) == 0
    started = [line.split() for line in capsys.readouterr().out.splitlines() if line.startswith("start:")]
    assert [(s[4], s[-1] if s[4] == "eval" else next(a for a in s if a.startswith("train.seed="))) for s in started] \
        == [("train", "train.seed=2"), ("eval", str(out / "dot_reach" / "seed2" / "final_eval.json"))]
    assert not (out / "dot_reach" / "seed1").exists()  # kept: not trained again
    assert (keep / "dot_reach" / "seed2" / "final_eval.json").is_file()
    code, text, err = table(capsys, keep, "--at", "128", "--reps", "100")
    assert code == 0, err
    [final] = [r for r in rows_of(text, "dot_reach") if r[2] == "default"]
    assert final[4] == "2"  # both seeds, read from the kept copies


def test_keep_copies_a_run_evaluated_before_keep_was_given(tmp_path):
    out, keep, config = tmp_path / "t", tmp_path / "kept", Path("configs/dot_reach.yaml")
    fake_run(lt.run_dir_of(out, config, 1), "visppo/DotReach-v0", 2000, [(2000, 1.0, 1.0)], final=1.0)
    assert lt.run_all([config], [1], out, 1, [], keep=keep) == 0
    assert lt.kept(keep, config, 1)
    assert lt.jobs([config], [1], out, [], 10, keep) == []


def test_value_at_a_step_reads_the_iteration_that_crossed_it():
    """Rows every 1,024 steps: 250k is crossed at 250,880, not read from 254,976 (2% past) nor from
    249,856 (before it); a periodic column not logged there gives its last value before; a run that
    ended short by under 2% gives its last row."""
    rows = [{"global_step": float(s), "episode_return": float(s // 1024), "eval/return": math.nan,
             "steps_per_second": 1024.0 / 60} for s in range(1024, 256_000, 1024)]
    rows[240]["eval/return"] = 7.0  # logged at 246,784 only
    assert lt.value_at(rows, "episode_return", 250_000) == 245  # 250,880 = 245 x 1,024
    assert lt.value_at(rows, "eval/return", 250_000) == 7.0
    assert lt.value_at(rows, "episode_return", 256_000) == rows[-1]["episode_return"]
    assert math.isnan(lt.value_at(rows, "episode_return", 270_000))
    assert lt.wall_minutes(rows, 250_000) == pytest.approx(245)  # a minute per row, up to the crossing


def test_the_iqm_interval_is_the_same_every_time_it_is_printed(tmp_path):
    """rliable resamples with numpy's global RNG: the tool seeds it (and leaves the caller's as it was)."""
    out = tmp_path / "table"
    dmc_runs(out)
    final = lt.final_results([out])
    np.random.seed(1)
    first = lt.iqm_summary(final, reps=300)[0]["ci"]
    after = np.random.random()
    np.random.seed(2)
    assert lt.iqm_summary(final, reps=300)[0]["ci"] == first
    np.random.seed(1)
    lt.iqm_summary(final, reps=300)
    assert np.random.random() == after


def test_the_iqm_line_names_the_runs_it_leaves_out(tmp_path):
    out = tmp_path / "table"
    dmc_runs(out)
    fake_run(out / "dmc_walker_walk" / "seed3", "dmc:walker-walk", 500_000, [(500_736, 5.0, "")], look="fast",
             final=5.0)
    [summary] = lt.iqm_summary(lt.final_results([out]), reps=100)
    assert summary["seeds"] == ["seed1", "seed2"] and summary["unused_runs"] == ["dmc_walker_walk seed3"]
    assert "1 run(s) (dmc_walker_walk seed3)" in lt.iqm_line(summary)


def test_a_run_resumed_with_an_allowed_override_still_matches_but_another_budget_does_not(tmp_path, monkeypatch):
    """A resume may change train.threads, run.* or the devices (config.RESUMABLE) and rewrites
    config.yaml: that run is still this command's; one with another ppo.total_steps or train.amp is not."""
    from visppo.config import load_config, to_yaml

    monkeypatch.chdir(ROOT)
    out, config = tmp_path / "t", Path("configs/dot_reach.yaml")
    run_dir = lt.run_dir_of(out, config, 1)
    run_dir.mkdir(parents=True)
    cfg = load_config(config, lt.run_overrides(1, run_dir, []))
    cfg.train.threads, cfg.run.log_every, cfg.train.device = 2, 5, "cpu"
    (run_dir / "config.yaml").write_text(to_yaml(cfg))
    lt.check_existing_runs([config], [1], out, ["train.device=auto"])
    with pytest.raises(lt.UsageError, match="was started with train.amp="):  # one table, one precision
        lt.check_existing_runs([config], [1], out, ["train.amp=bf16"])
    cfg.ppo.total_steps *= 2
    (run_dir / "config.yaml").write_text(to_yaml(cfg))
    with pytest.raises(lt.UsageError, match="was started with ppo.total_steps="):
        lt.check_existing_runs([config], [1], out, [])
    # a kept copy is held to the same: run would skip its seed and the table would mix two settings
    keep = tmp_path / "kept"
    keep.mkdir()
    (out / "dot_reach").rename(keep / "dot_reach")
    lt.check_existing_runs([config], [1], out, [])  # without --keep, nothing under --out
    with pytest.raises(lt.UsageError, match=r"kept.*was started with ppo.total_steps="):
        lt.check_existing_runs([config], [1], out, [], keep)


def test_the_iqm_line_names_the_runs_left_out_when_the_tasks_share_no_seed():
    summary = {"variant": "", "tasks": ["a", "b"], "seeds": [], "left_out": [], "iqm": math.nan,
               "ci": (math.nan, math.nan), "reps": 10, "unused_runs": ["a seed1", "b seed2"]}
    assert "2 run(s) (a seed1, b seed2)" in lt.iqm_line(summary)


def test_a_run_whose_last_row_outran_its_checkpoint_is_not_finished(tmp_path):
    """Training writes the last row, then the last checkpoint: a kill between them leaves a run to
    resume, not an earlier checkpoint to evaluate as the final policy."""
    import torch

    run = tmp_path / "seed1"
    fake_run(run, "visppo/DotReach-v0", 2048, [(1024, 1.0, 1.0), (2048, 2.0, 1.0)])
    (run / "checkpoints").mkdir()
    torch.save({"global_step": 1024}, run / "checkpoints" / "latest.pt")
    assert not lt.finished(run)
    torch.save({"global_step": 2048}, run / "checkpoints" / "latest.pt")
    assert lt.finished(run)


def test_a_last_line_a_kill_cut_short_is_not_read(tmp_path, capsys):
    run = tmp_path / "t" / "reach" / "seed1"
    fake_run(run, "visppo/Reach-v0", 4096, [(2048, 5.0, 1.0)])
    with (run / "metrics.csv").open("a") as f:
        f.write("4096,12")  # cut from 123.5
    assert [r["global_step"] for r in lt.read_rows(run)] == [2048.0]
    empty = tmp_path / "t" / "reach" / "seed2"
    fake_run(empty, "visppo/Reach-v0", 4096, [])  # a header only: killed before its first row
    code, _, err = table(capsys, tmp_path / "t", "--at", "2k", "--plot", tmp_path / "p.png")
    assert code == 0, err
    assert (tmp_path / "p.png").is_file()
