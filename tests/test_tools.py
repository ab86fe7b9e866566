"""The benchmark scripts in tools/ run end to end on a tiny config (they are not imported by visppo)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
from conftest import tiny_overrides

ROOT = Path(__file__).resolve().parents[1]
TOOLS = ROOT / "tools"


def test_bench_prints_every_figure_and_writes_json(tmp_path):
    out = tmp_path / "bench.json"
    overrides = [o for o in tiny_overrides() if not o.startswith("run.")]
    proc = subprocess.run([sys.executable, str(TOOLS / "bench.py"), *overrides, "env.vector=sync",
                           "--repeats", "1", "--iterations", "2", "--steps", "64", "--json", str(out)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    for label in ("raw env, 1 process", "raw env, 2 async workers", "collection", "update",
                  "end to end", "per iteration", "peak memory"):
        assert label in proc.stdout, proc.stdout
    figures = json.loads(out.read_text())
    assert set(figures["raw_env_sps"]) == {"1 process", "2 async workers", "4 async workers"}
    assert all(v > 0 for v in figures["raw_env_sps"].values())
    for key in ("end_to_end_sps", "collect_sps", "update_samples_per_s", "peak_rss_bytes",
                "time/collect", "time/values", "time/update"):
        assert figures[key] > 0, key
    # the end-to-end rate cannot beat collection alone, and the ratio is against the fastest raw env
    assert figures["end_to_end_sps"] < figures["collect_sps"]
    assert abs(figures["ratio_to_raw"] - figures["end_to_end_sps"] / max(figures["raw_env_sps"].values())) < 1e-9


def test_bench_update_compares_a_plain_update_with_visppos_and_writes_json(tmp_path):
    out = tmp_path / "update.json"
    overrides = [o for o in tiny_overrides() if not o.startswith("run.")]
    proc = subprocess.run([sys.executable, str(TOOLS / "bench_update.py"), *overrides, "ppo.minibatch_size=16",
                           "--micro", "8,0", "--amp", "off", "--repeats", "2", "--json", str(out)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = json.loads(out.read_text())["rows"]
    # the plain baseline (NCHW, Adam's loop), then fused Adam alone, then the config's layout per micro-batch
    assert [(r["name"], r["channels_last"], r["fused_adam"], r["micro_batch_size"]) for r in rows] == [
        ("baseline", False, False, 16), ("fused Adam", False, True, 16),
        ("micro=8", True, True, 8), ("micro=mb", True, True, 16)]
    assert all(len(r["seconds"]) == 2 and r["samples_per_second"] > 0 and r["peak_bytes"] > 0 for r in rows)
    assert rows[0]["ratio"] == 1.0


def _fake_run(run_dir: Path, env_id: str, total: int, rows: list[tuple[int, float, float]], env: str = "") -> None:
    run_dir.mkdir(parents=True)
    (run_dir / "config.yaml").write_text(f"env:\n  id: {env_id}\n{env}ppo:\n  total_steps: {total}\n")
    lines = ["global_step,episode_return,episode_success,steps_per_second"]
    lines += [f"{s},{r},{ok},100.0" for s, r, ok in rows]
    (run_dir / "metrics.csv").write_text("\n".join(lines) + "\n")


def test_learning_table_takes_mean_and_std_over_seeds_at_each_step_count(tmp_path):
    out = tmp_path / "table"
    _fake_run(out / "reach" / "seed1", "visppo/Reach-v0", 2000, [(1000, 1.0, 0.0), (2000, 3.0, 0.5)])
    _fake_run(out / "reach" / "seed2", "visppo/Reach-v0", 2000, [(1000, 2.0, 0.0), (2000, 5.0, 1.0)])
    _fake_run(out / "short" / "seed1", "visppo/Push-v0", 2000, [(1000, 7.0, 0.0)])  # stopped early
    md = tmp_path / "table.md"
    proc = subprocess.run([sys.executable, str(TOOLS / "learning_table.py"), "table", str(out),
                           "--at", "1k", "2k", "--markdown", str(md), "--plot", str(tmp_path / "c.png")],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = [line for line in md.read_text().splitlines() if line.startswith("| reach") or line.startswith("| short")]
    assert rows[0].split(" | ")[2:6] == ["1,000", "2", "1.50 ± 0.71", "0.00 ± 0.00"]
    assert rows[1].split(" | ")[2:6] == ["2,000", "2", "4.00 ± 1.41", "0.75 ± 0.35"]
    assert rows[1].split(" | ")[8] == "0 ± 0"  # 2000 steps at 100 steps/s: 0.33 minutes
    assert len(rows) == 3  # the short run has no figure at 2k: its row is left out
    assert (tmp_path / "c.png").stat().st_size > 0
    proc = subprocess.run([sys.executable, str(TOOLS / "learning_table.py"), "table", str(out), "--at", "1k",
                           "--plot", str(tmp_path / "s.png"), "--column", "episode_success"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert (tmp_path / "s.png").read_bytes() != (tmp_path / "c.png").read_bytes()  # another column drawn


def test_learning_table_compares_variants_of_an_ablation_row_by_row(tmp_path):
    base, variant = tmp_path / "abl" / "base", tmp_path / "abl" / "norm_reward"
    _fake_run(base / "reach" / "seed1", "visppo/Reach-v0", 2000, [(1000, 1.0, 0.0), (2000, 3.0, 0.5)])
    _fake_run(variant / "reach" / "seed1", "visppo/Reach-v0", 2000, [(1000, 2.0, 0.0), (2000, 6.0, 1.0)])
    _fake_run(variant / "reach" / "seed2", "visppo/Reach-v0", 2000, [(1000, 2.0, 0.0), (2000, 8.0, 1.0)])
    _fake_run(base / "swingup" / "seed1", "dmc:cartpole-swingup", 2000, [(2000, 140.0, "")],
              env="  kwargs:\n    look: fast\n")
    md = tmp_path / "abl.md"
    proc = subprocess.run([sys.executable, str(TOOLS / "learning_table.py"), "table", str(base), str(variant),
                           "--at", "2k", "--markdown", str(md), "--plot", str(tmp_path / "abl.png")],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = [line.split(" | ") for line in md.read_text().splitlines() if line.startswith("| reach")]
    assert [(r[0], r[3], r[4]) for r in rows] == [("| reach (base)", "1", "3.00 ± 0.00"),
                                                  ("| reach (norm_reward)", "2", "7.00 ± 1.41")]
    swingup = [line for line in md.read_text().splitlines() if line.startswith("| swingup")]
    assert swingup[0].split(" | ")[1] == "`dmc:cartpole-swingup` (fast look)"  # the table says which look
    assert (tmp_path / "abl.png").stat().st_size > 0
    proc = subprocess.run([sys.executable, str(TOOLS / "learning_table.py"), "table", str(base),
                           str(tmp_path / "nowhere")], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and proc.stderr.startswith("error:") and "nowhere" in proc.stderr


def test_learning_table_per_seed_lists_each_seeds_return_in_seed_order(tmp_path):
    out = tmp_path / "abl" / "base"
    for seed, ret in ((10, 30.0), (2, 20.0), (1, 10.0)):  # seed10 sorts after seed2 as a number, not as text
        _fake_run(out / "swingup" / f"seed{seed}", "dmc:cartpole-swingup", 2000, [(2000, ret, "")])
    table = [sys.executable, str(TOOLS / "learning_table.py"), "table", str(out), "--at", "2k"]
    proc = subprocess.run([*table, "--per-seed"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    row = next(line for line in proc.stdout.splitlines() if line.startswith("| swingup")).split(" | ")
    assert row[4] == "20.00 ± 10.00 (10, 20, 30)"
    assert row[6] == ""  # no evaluation logged: the cell stays empty, with no seed list
    plain = subprocess.run(table, capture_output=True, text=True, timeout=120)
    assert "20.00 ± 10.00 |" in plain.stdout and "(10, 20, 30)" not in plain.stdout


def _tool(name: str):
    """tools/<name>.py as a module (tools/ is not a package)."""
    import importlib

    sys.path.insert(0, str(TOOLS))
    try:
        return importlib.import_module(name)
    finally:
        sys.path.remove(str(TOOLS))


def _learning_table():
    return _tool("learning_table")


def test_learning_table_run_skips_finished_runs_and_resumes_stopped_ones(tmp_path):
    learning_table = _learning_table()
    out, config = tmp_path / "t", Path("configs/dot_reach.yaml")
    done = learning_table.run_dir_of(out, config, 1)
    _fake_run(done, "visppo/DotReach-v0", 2000, [(2000, 1.0, 1.0)])
    assert learning_table.finished(done)
    stopped = learning_table.run_dir_of(out, config, 2)
    _fake_run(stopped, "visppo/DotReach-v0", 4000, [(2000, 1.0, 1.0)])
    (stopped / "checkpoints").mkdir()
    (stopped / "checkpoints" / "latest.pt").write_bytes(b"")
    assert not learning_table.finished(stopped)
    assert learning_table.command(config, 2, stopped, [])[-2:] == ["--resume", str(stopped)]
    fresh = learning_table.command(config, 3, learning_table.run_dir_of(out, config, 3), ["ppo.total_steps=64"])
    assert "train.seed=3" in fresh and "train.threads=1" in fresh and fresh[-1] == "ppo.total_steps=64"


def test_learning_table_puts_published_figures_beside_the_row_that_reaches_their_budget():
    """A 500k-step run of 1024-sample rollouts logs its last row at 500,736: that row, and no
    earlier one, stands beside the figures published at 500k agent steps."""
    learning_table = _learning_table()
    assert [m for m, *_ in learning_table.published_at("dmc:walker-walk", 500_736)] == ["SB3 PPO CnnPolicy", "DrQ-v2"]
    assert learning_table.published_at("dmc:walker-walk", 500_000)[1][1] == 766
    assert learning_table.published_at("dmc:walker-walk", 499_712) == []
    assert learning_table.published_at("dmc:walker-walk", 600_000) == []
    assert learning_table.published_at("visppo/Reach-v0", 500_736) == []


def _baselines():
    return _tool("baselines")


class _CountingEnv:
    """Reward = the action's first entry, 3 steps an episode, success when the return is positive;
    records the reset seeds."""

    def __init__(self):
        import gymnasium as gym

        self.action_space = gym.spaces.Box(-1.0, 1.0, (2,), np.float32)
        self.seeds, self.t = [], 0

    def reset(self, seed=None):
        self.seeds.append(seed)
        self.t, self.total = 0, 0.0
        return None, {}

    def step(self, action):
        self.t += 1
        self.total += float(action[0])
        return None, float(action[0]), False, self.t == 3, {"is_success": self.total > 0}


def test_baselines_sum_each_episodes_rewards_and_reset_episode_i_with_seed_plus_i():
    import numpy as np

    baselines = _baselines()
    env = _CountingEnv()
    actions = iter([np.array([a, 0.0]) for a in (0.5, -0.25, 0.5, -1.0, 0.0, 0.25)])
    results = baselines.episode_returns(env, lambda: next(actions), episodes=2, seed=7)
    assert results == [(0.75, True), (-0.75, False)] and env.seeds == [7, 8]
    table = baselines.report({"zero": [(0.0, None), (2.0, None)]})
    assert "| zero | 2 | 1.00 ± 1.00 | 0.00 | 2.00 |  |" in table


def test_baselines_runs_the_configs_env_and_refuses_bad_input(tmp_path):
    config = str(Path(__file__).resolve().parents[1] / "configs" / "dot_reach.yaml")
    proc = subprocess.run([sys.executable, str(TOOLS / "baselines.py"), config, "env.image_size=48",
                           "--episodes", "2"], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = [line for line in proc.stdout.splitlines() if line.startswith(("| random", "| zero"))]
    assert [row.split(" | ")[1] for row in rows] == ["2", "2"] and all(row.endswith("% |") for row in rows), proc.stdout
    for args, needle in ((["--episodes", "0"], "--episodes"), (["ppo.bogus=1"], "bogus")):
        proc = subprocess.run([sys.executable, str(TOOLS / "baselines.py"), config, *args],
                              capture_output=True, text=True, timeout=300)
        assert proc.returncode == 2 and proc.stderr.startswith("error:") and needle in proc.stderr, proc.stderr
        assert len(proc.stderr.strip().splitlines()) == 1, proc.stderr


