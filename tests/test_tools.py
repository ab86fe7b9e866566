"""The benchmark scripts in tools/ run end to end on a tiny config (they are not imported by visppo)."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
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


def test_grad_share_sends_each_loss_term_only_where_it_can_flow(tmp_path):
    """The policy term's gradient never reaches the critic's own encoder or head, the value term's
    never the actor's: a tool that mislabels its groups or mixes the terms up fails here."""
    from visppo.config import load_config
    from visppo.train import train

    runs = {}
    for name, extra in {"shared": {}, "separate": {"model.share_encoder": False},
                        "detached": {"model.detach_actor": True}}.items():
        runs[name] = train(load_config(None, tiny_overrides(tmp_path / name, **extra)))
    out = tmp_path / "share.json"
    proc = subprocess.run([sys.executable, str(TOOLS / "grad_share.py"), str(runs["shared"]), "--minibatches", "2",
                           "--json", str(out)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "| encoder |" in proc.stdout and "clip factor" in proc.stdout
    shared = json.loads(out.read_text())
    assert shared["encoder/policy"] > 0 and shared["encoder/value"] > 0
    assert shared["actor head/value"] == 0 and shared["critic head/policy"] == 0
    assert shared["actor head/policy"] > 0 and shared["critic head/value"] > 0
    assert 0 < shared["clip factor"] <= 1

    gs = _tool("grad_share")
    separate = _measure(gs, runs["separate"])
    assert separate["encoder (actor's)/value"] == 0 and separate["encoder (critic's)/policy"] == 0
    assert separate["encoder (actor's)/policy"] > 0 and separate["encoder (critic's)/value"] > 0
    detached = _measure(gs, runs["detached"])
    assert detached["encoder/policy"] == 0 and detached["encoder/value"] > 0

    bad = subprocess.run([sys.executable, str(TOOLS / "grad_share.py"), str(tmp_path / "nowhere")],
                         capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and bad.stderr.startswith("error:") and "nowhere" in bad.stderr


def _measure(gs, run_dir):
    import torch

    from visppo.evaluate import load_policy, resolve_checkpoint

    policy, cfg, _ = load_policy(resolve_checkpoint(run_dir))
    policy.train()
    torch.manual_seed(0)
    buffer = gs.rollout(policy, cfg, seed=0)
    return gs.measure(policy, cfg, buffer, 2, torch.Generator().manual_seed(0))


def test_grad_share_scales_rewards_as_a_norm_reward_run_does(tmp_path):
    import torch

    from visppo.config import load_config
    from visppo.evaluate import load_policy, resolve_checkpoint
    from visppo.train import train

    run = train(load_config(None, tiny_overrides(tmp_path, **{"ppo.norm_reward": True})))
    gs = _tool("grad_share")
    policy, cfg, _ = load_policy(resolve_checkpoint(run))
    rewards = {}
    for var in (None, 3.0):
        torch.manual_seed(0)
        scale = None if var is None else {"running": torch.zeros(2), "count": 10.0, "mean": 0.0, "var": var}
        rewards[var] = gs.rollout(policy, cfg, seed=0, reward_scale=scale).rewards.clone()
    assert rewards[None].abs().sum() > 0
    torch.testing.assert_close(rewards[3.0], rewards[None] / (3.0 + 1e-8) ** 0.5)


def test_grad_share_measures_a_run_whose_log_std_is_scheduled_not_learned(tmp_path):
    """configs/push.yaml schedules the log-std (model.final_log_std): that parameter has no gradient,
    and the tool measures the others instead of failing on it."""
    import torch

    from visppo.config import load_config
    from visppo.evaluate import load_policy, resolve_checkpoint
    from visppo.train import train

    run = train(load_config(None, tiny_overrides(tmp_path, **{"model.final_log_std": -1.0})))
    policy, _, _ = load_policy(resolve_checkpoint(run))
    assert not policy.log_std.requires_grad
    groups = _tool("grad_share").parameter_groups(policy)
    assert all(q is not policy.log_std for qs in groups.values() for q in qs)
    proc = subprocess.run([sys.executable, str(TOOLS / "grad_share.py"), str(run), "--minibatches", "1"],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "| actor head |" in proc.stdout and torch.isfinite(policy.log_std).all()


@pytest.mark.parametrize("term,overrides,head,title", [
    ("recon", {"model.recon_size": 8, "ppo.recon_coef": 1.0}, "decoder", "reconstruction term"),
    ("invdyn", {"model.invdyn": True, "ppo.invdyn_coef": 1.0, "env.frame_stack": 2}, "inverse-dynamics head",
     "inverse-dynamics term"),
    ("reward", {"model.reward_head": True, "ppo.reward_coef": 1.0}, "reward head", "reward-prediction term"),
])
def test_grad_share_measures_an_auxiliary_term_where_it_flows(tmp_path, term, overrides, head, title):
    """With an auxiliary loss on, a tiny run trains (its metrics log the term) and reloads, and the
    term's gradient reaches the encoder and its own head, never the actor's or critic's head; the
    RL terms never reach that head."""
    import csv

    from visppo.config import load_config
    from visppo.train import train

    run = train(load_config(None, tiny_overrides(tmp_path, **overrides)))
    logged = [float(r[f"loss/{term}_loss"]) for r in csv.DictReader(open(run / "metrics.csv"))]
    assert logged and all(np.isfinite(logged))
    got = _measure(_tool("grad_share"), run)
    assert got[f"encoder/{term}"] > 0 and got[f"{head}/{term}"] > 0
    assert got[f"actor head/{term}"] == 0 and got[f"critic head/{term}"] == 0
    assert got[f"{head}/policy"] == 0 and got[f"{head}/value"] == 0
    proc = subprocess.run([sys.executable, str(TOOLS / "grad_share.py"), str(run), "--minibatches", "1"],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert title in proc.stdout and f"| {head} |" in proc.stdout


def test_grad_share_reads_shifted_frames_for_an_augment_loss_run(tmp_path):
    """ppo.augment_loss: the tool measures the gradient on shifted frames, as the update takes it."""
    import torch

    from visppo.config import load_config
    from visppo.evaluate import load_policy, resolve_checkpoint
    from visppo.train import train

    run = train(load_config(None, tiny_overrides(tmp_path, **{"model.augment": "shift", "ppo.augment_loss": True})))
    gs = _tool("grad_share")
    policy, cfg, _ = load_policy(resolve_checkpoint(run))
    torch.manual_seed(0)
    buffer = gs.rollout(policy, cfg, seed=0)
    got = {}
    for shifted in (True, False):
        cfg.ppo.augment_loss = shifted
        before = policy.augment.generator.get_state()
        got[shifted] = gs.measure(policy, cfg, buffer, 2, torch.Generator().manual_seed(0))
        assert torch.equal(policy.augment.generator.get_state(), before) != shifted  # draws used iff shifted
    assert got[True]["encoder/policy"] != got[False]["encoder/policy"]


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


def test_feature_probe_reads_linear_positions_and_not_noise():
    probe = _tool("feature_probe").ridge_probe
    rng = np.random.default_rng(0)
    groups = np.repeat(np.arange(40), 10)
    feats = rng.normal(size=(400, 16))
    linear = feats[:, :2] @ np.array([[0.3, -0.1], [0.2, 0.4]]) + 0.05
    noise = rng.normal(size=(400, 2))
    r2, rmse = probe(feats, np.c_[linear, noise], groups, lam=1.0)
    assert (r2[:2] > 0.99).all() and (rmse[:2] < 0.01).all(), r2
    assert (r2[2:] < 0.1).all(), r2  # unrelated to the features: no better than the mean
    # held out by group: a value constant within a group and unrelated to the features is not learnt
    per_group = rng.normal(size=40)[groups]
    assert probe(feats, per_group[:, None], groups, lam=1.0)[0][0] < 0.1
    # a unit dead on the training episodes (a ReLU never on) and alive on the held-out ones is
    # left out, not standardised into huge values
    dead = feats.copy()
    dead[:, 5] = np.where(groups >= 30, 5.0, 1e-6 * rng.normal(size=400))
    assert (probe(dead, linear, groups, lam=1.0)[0] > 0.99).all()
    with pytest.raises(ValueError, match="two groups"):
        probe(feats, linear, np.zeros(400, int))


def test_feature_probe_runs_on_a_checkpoint_and_refuses_unknown_geoms(tmp_path):
    from visppo.config import load_config
    from visppo.train import train

    run = train(load_config(None, tiny_overrides(tmp_path, **{"env.id": "visppo/Reach-v0"})))
    cmd = [sys.executable, str(TOOLS / "feature_probe.py"), str(run), "--episodes", "8", "--steps", "6"]
    proc = subprocess.run([*cmd, "--geoms", "target", "fingertip"], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = [line.split() for line in proc.stdout.splitlines() if "R^2" in line]
    assert [r[0] for r in rows] == ["target.x", "target.y", "fingertip.x", "fingertip.y",
                                    "target-fingertip.x", "target-fingertip.y"], proc.stdout
    assert all(math.isfinite(float(r[2])) and float(r[2]) <= 1.0 for r in rows)
    for args, needle in ((["--geoms", "nosuch"], "no geom nosuch"), (["--geoms", "target", "ppo.lr=1"], "ppo.lr=1")):
        bad = subprocess.run([*cmd, *args], capture_output=True, text=True, timeout=300)
        assert bad.returncode == 2 and bad.stderr.startswith("error:") and needle in bad.stderr, bad.stderr
        assert len(bad.stderr.strip().splitlines()) == 1, bad.stderr


def test_episode_trace_plays_episodes_and_reads_the_distance(tmp_path):
    from visppo.config import load_config
    from visppo.train import train

    run = train(load_config(None, tiny_overrides(tmp_path, **{"env.id": "visppo/Reach-v0"})))
    cmd = [sys.executable, str(TOOLS / "episode_trace.py"), str(run), "--episodes", "2"]
    proc = subprocess.run([*cmd, "--geoms", "fingertip", "target"], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = [line.split() for line in proc.stdout.splitlines() if line.startswith("ep ")]
    assert len(rows) == 2, proc.stdout
    for r in rows:
        start, low, last = (float(r[r.index(k) + 1]) for k in ("start", "min", "quarter"))
        assert 0 <= low <= min(start, last) and math.isfinite(float(r[3])), r
    # the two episodes are reset with seeds 5000 and 5001: different targets
    assert rows[0][8:10] != rows[1][8:10], proc.stdout
    for args, needle in ((["--geoms", "nosuch", "target"], "no geom nosuch"),
                         (["--geoms", "fingertip", "target", "ppo.lr=1"], "ppo.lr=1")):
        bad = subprocess.run([*cmd, *args], capture_output=True, text=True, timeout=300)
        assert bad.returncode == 2 and bad.stderr.startswith("error:") and needle in bad.stderr, bad.stderr
        assert len(bad.stderr.strip().splitlines()) == 1, bad.stderr


STATE_LAYERS = """
import runpy, torch
m = runpy.run_path("tools/state_ppo.py", run_name="state_ppo")
torch.manual_seed(0)
two = m["StatePolicy"](6, 2)
torch.manual_seed(0)
first, second = m["_layer"](6, 256, 2 ** 0.5), m["_layer"](256, 256, 2 ** 0.5)
assert torch.equal(two.encoder[0].weight, first.weight) and torch.equal(two.encoder[2].weight, second.weight)
three = m["StatePolicy"](6, 2, layers=3)
assert [l.in_features for l in three.encoder[::2]] == [6, 256, 256] and len(two.encoder) == 4
dist, value = three(torch.randn(5, 6))
assert dist.mean.shape == (5, 2) and value.shape == (5,)
print("ok")
"""


def test_state_ppo_layers_sets_the_shared_trunks_depth_and_two_keeps_its_draws():
    env = _run_state_script(STATE_LAYERS)
    bad = subprocess.run([sys.executable, str(TOOLS / "state_ppo.py"), "dmc:reacher-easy", "--layers", "0"],
                         capture_output=True, text=True, timeout=120, cwd=ROOT, env=env)
    assert bad.returncode == 2 and bad.stderr.startswith("error:") and "--layers" in bad.stderr, bad.stderr


def test_state_ppo_refuses_an_id_without_a_state_vector_and_suite_flags_on_gymnasium():
    for args, needle in ((["visppo/Reach-v0"], "not a flat vector"), (["Nope-v9"], "Nope-v9"),
                         (["Reacher-v5", "--drop", "x"], "give a dmc id")):
        proc = subprocess.run([sys.executable, str(TOOLS / "state_ppo.py"), *args],
                              capture_output=True, text=True, timeout=120)
        assert proc.returncode == 2, proc.stderr
        assert proc.stderr.startswith("error:") and needle in proc.stderr and len(proc.stderr.splitlines()) == 1


STATE_GYM = """
import runpy, numpy as np, torch
m = runpy.run_path("tools/state_ppo.py", run_name="state_ppo")
a, b = m["GymStateEnv"]("Reacher-v5", 7, 1), m["GymStateEnv"]("Reacher-v5", 7, 1)
assert np.array_equal(a.reset(), b.reset())  # seeded: evaluation episodes are the same every time
torch.manual_seed(0)
for env_id, ends in (("Reacher-v5", "truncated"), ("InvertedPendulum-v5", "terminated")):
    envs = [m["GymStateEnv"](env_id, i, 1) for i in range(2)]
    obs = np.stack([e.reset() for e in envs])
    policy = m["StatePolicy"](obs.shape[1], envs[0].action_dim, init_log_std=1.0)
    roll, _ = m["collect"](policy, envs, obs, 64, 0.99, 0.95, [], None)
    other = "terminated" if ends == "truncated" else "truncated"
    assert roll[ends].sum() >= 2 and roll[other].sum() == 0, (env_id, roll[ends].sum(), roll[other].sum())
    if ends == "truncated":  # Reacher-v5's 50-step limit, bootstrapped from the final state's value
        assert roll["truncated"][49].tolist() == [1.0, 1.0] and (roll["final_values"][49] != 0).all()
    else:  # the pole fell: no bootstrap, the return is the rewards to the end
        t, i = [int(x) for x in roll["terminated"].nonzero()[0]]
        assert roll["final_values"][t, i] == 0 and torch.isclose(roll["returns"][t, i], roll["rewards"][t, i])
print("ok")
"""


def test_state_ppo_runs_gymnasium_state_envs_with_their_time_limits_and_terminations():
    """A gymnasium id goes through gymnasium.make: Reacher-v5's time limit is bootstrapped, a
    falling pendulum's termination is not."""
    env = {**os.environ, "MUJOCO_GL": "disable"}
    proc = subprocess.run([sys.executable, "-c", STATE_GYM], capture_output=True, text=True, timeout=300,
                          cwd=ROOT, env=env)
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr[-2000:]


def _run_state_script(script: str) -> dict[str, str]:
    """Run a check of tools/state_ppo.py's pieces in a fresh process (nothing rendered); it prints
    ok. Returns the environment it ran with, for the CLI calls that follow."""
    pytest.importorskip("dm_control", reason='needs pip install -e ".[dmc]"')
    env = {**os.environ, "MUJOCO_GL": "disable"}
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300,
                          cwd=ROOT, env=env)
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr[-2000:]
    return env


STATE_SWAP = """
import runpy, numpy as np
m = runpy.run_path("tools/state_ppo.py", run_name="state_ppo")
swapped, full = m["StateEnv"]("dmc:reacher-easy", 3, 2, ("to_target",), ("target",)), m["StateEnv"]("dmc:reacher-easy", 3, 2)
s, f = swapped.reset(), full.reset()
xpos = swapped.env.physics.named.data.geom_xpos
assert s.shape == (7,) and f.shape == (6,), (s.shape, f.shape)
assert np.allclose(s[:2], f[:2]) and np.allclose(s[2:4], f[4:6])  # joint angles, velocities kept
assert np.allclose(s[4:], xpos["target"]) and np.abs(s[4:6]).max() > 0.04  # the target where a camera sees it
assert np.allclose(f[2:4], (xpos["target"] - xpos["finger"])[:2], atol=1e-5)  # what --drop took away
print("ok")
"""


def test_state_ppo_can_swap_the_target_vector_for_the_targets_world_position():
    """--drop to_target --add-geom target: reacher's state then holds what the frames hold (the target's
    position, the arm's angles), not the fingertip-to-target difference; unknown names are refused."""
    env = _run_state_script(STATE_SWAP)
    for flag, name in (("--drop", "to_targt"), ("--add-geom", "fingertip")):
        bad = subprocess.run([sys.executable, str(TOOLS / "state_ppo.py"), "dmc:reacher-easy", flag, name],
                             capture_output=True, text=True, timeout=300, env=env)
        assert bad.returncode == 2 and bad.stderr.startswith("error:") and repr(name) in bad.stderr, bad.stderr


STATE_NOISE = """
import runpy, numpy as np, torch
m = runpy.run_path("tools/state_ppo.py", run_name="state_ppo")
from visppo.noise import ColoredNoise
envs = [m["StateEnv"]("dmc:reacher-easy", 3, 2)]
obs = np.stack([e.reset() for e in envs])
torch.manual_seed(0)
policy = m["StatePolicy"](obs.shape[1], 2)
noise, same = ColoredNoise(0.5, 1, 2, 500, 0), ColoredNoise(0.5, 1, 2, 500, 0)
roll, _ = m["collect"](policy, envs, obs.copy(), 4, 0.99, 0.95, [], noise)
with torch.no_grad():
    dist, _ = policy(roll["obs"][:, 0])
expected = dist.mean + dist.stddev * torch.stack([same.sample()[0] for _ in range(4)])
assert torch.allclose(roll["actions"][:, 0], expected, atol=1e-5), (roll["actions"][:, 0], expected)
print("ok")
"""


STATE_BLUR = """
import runpy, numpy as np
m = runpy.run_path("tools/state_ppo.py", run_name="state_ppo")
blurred, exact = m["StateEnv"]("dmc:reacher-easy", 3, 2, blur={"to_target": 0.05}), m["StateEnv"]("dmc:reacher-easy", 3, 2)
diffs = []
for k in range(200):
    b, e = (blurred.reset(), exact.reset()) if k == 0 else (blurred.step(np.zeros(2))[0], exact.step(np.zeros(2))[0])
    diffs.append(b - e)
diffs = np.array(diffs)
assert np.allclose(diffs[:, :2], 0) and np.allclose(diffs[:, 4:], 0)  # joint angles, velocities exact
assert 0.04 < diffs[:, 2:4].std() < 0.06 and abs(diffs[:, 2:4].mean()) < 0.01  # the vector, blurred
print("ok")
"""


def test_state_ppo_blurs_only_the_named_entry_by_the_given_std():
    """--blur to_target=0.05: the fingertip-to-target vector read to 0.05 m, the rest exact."""
    env = _run_state_script(STATE_BLUR)
    for bad_arg, needle in (("to_target", "KEY=STD"), ("tgt=0.1", "'tgt'")):
        bad = subprocess.run([sys.executable, str(TOOLS / "state_ppo.py"), "dmc:reacher-easy", "--blur", bad_arg],
                             capture_output=True, text=True, timeout=300, env=env)
        assert bad.returncode == 2 and bad.stderr.startswith("error:") and needle in bad.stderr, bad.stderr


def test_state_ppo_acts_mean_plus_std_times_the_colored_noise():
    """--noise-beta: the rollout's actions are the Gaussian's mean plus its std times each env's
    ColoredNoise, in the noise's order (the trainer's model.noise_beta, screened here)."""
    _run_state_script(STATE_NOISE)


def test_state_ppo_trains_on_the_suites_state_and_evaluates_full_episodes(tmp_path):
    pytest.importorskip("dm_control", reason='needs pip install -e ".[dmc]"')
    out = tmp_path / "state.json"
    proc = subprocess.run([sys.executable, str(TOOLS / "state_ppo.py"), "dmc:cartpole-balance", "--steps", "512",
                           "--num-envs", "2", "--num-steps", "128", "--epochs", "2", "--eval-every", "256",
                           "--json", str(out)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = json.loads(out.read_text())["evaluations"]
    assert [r["step"] for r in rows] == [256, 512]
    # cartpole-balance pays at most 1 per frame: a 1000-frame episode returns at most 1000, and an
    # untrained policy that starts upright still earns a good share of it
    assert all(100 < r["eval_return"] <= 1000 for r in rows)
    assert all(len(r["log_std"]) == 1 for r in rows)  # one action dimension: the cart's force
    assert rows[1]["train_return"] is None  # no 1000-frame episode finishes in 256 steps per env


def _dot_frames(n: int, seed: int = 0):
    """Frames of a 4x4 white square at a random place, and its (x, y) in [-1, 1]."""
    rng = np.random.default_rng(seed)
    pos = rng.uniform(-1, 1, (n, 2)).astype(np.float32)
    frames = np.zeros((n, 3, 36, 36), np.uint8)
    for k, (x, y) in enumerate(pos):
        col, row = int(round((x + 1) / 2 * 29)) + 3, int(round((1 - y) / 2 * 29)) + 3
        frames[k, :, row - 2:row + 2, col - 2:col + 2] = 255
    return frames, pos


def test_position_fit_learns_a_position_the_frames_show_and_not_one_they_hide():
    from visppo.config import load_config

    fit = _tool("position_fit").fit
    cfg = load_config(None, ["model.encoder=nature", "env.image_size=36", "model.feature_dim=64"])
    frames, pos = _dot_frames(400)
    group = np.arange(400) // 20  # 20 "episodes", the last 4 held out
    _, (train_r2, test_r2) = fit(cfg, frames, pos, group, 300, "none", report=lambda *a: None)
    assert test_r2.min() > 0.9 and train_r2.min() > 0.9
    hidden = np.random.default_rng(1).permutation(pos)  # positions the frames do not show
    _, (_, test_r2) = fit(cfg, frames, hidden, group, 300, "none", report=lambda *a: None)
    assert test_r2.max() < 0.3


def test_position_fit_reconstruction_trains_the_encoder_without_labels_then_freezes_it():
    import torch

    from visppo.config import load_config

    tool = _tool("position_fit")
    cfg = load_config(None, ["model.encoder=nature", "env.image_size=36", "model.feature_dim=64"])
    frames, pos = _dot_frames(400)
    losses = []
    torch.manual_seed(0)
    x = torch.from_numpy(frames)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # 1,800 small steps: two threads beside a busy process can be 20x slower
    try:
        _reconstruction_checks(tool, cfg, frames, pos, x, losses)
    finally:
        torch.set_num_threads(threads)


def _reconstruction_checks(tool, cfg, frames, pos, x, losses) -> None:
    import torch

    from visppo.encoders import build_pixel_encoder

    tool.reconstruct(build_pixel_encoder("nature", (3, 36, 36), 64), x, torch.arange(320), 12, 600, None,
                     torch.Generator().manual_seed(0), progress=losses.append, every=100)
    first, last = (float(m.rsplit(" ", 1)[1]) for m in (losses[0], losses[-1]))
    assert len(losses) == 6 and last < 0.5 * first, losses  # the reconstruction learns
    group = np.arange(400) // 20
    encoder, (_, test_r2) = tool.fit(cfg, frames, pos, group, 300, "none", report=lambda *a: None, recon_size=12,
                                     recon_updates=600, progress=lambda msg: None)
    assert test_r2.min() > 0.8, test_r2  # its frozen features hold the dot's position
    assert not isinstance(encoder, torch.nn.Identity)  # --save writes the pixel encoder
    assert all(not p.requires_grad for p in encoder.parameters())  # frozen for the head's stage


def test_position_fit_turns_targets_with_the_frames():
    import torch

    turn_xy = _tool("position_fit").turn_xy
    out = turn_xy(torch.tensor([[1.0, 0.0, 0.0, 2.0]]), torch.tensor([math.pi / 2], dtype=torch.float64))
    torch.testing.assert_close(out, torch.tensor([[0.0, 1.0, -2.0, 0.0]]), atol=1e-6, rtol=0)


def test_position_fit_runs_on_a_config_and_refuses_bad_input(tmp_path):
    cmd = [sys.executable, str(TOOLS / "position_fit.py"), "configs/reach.yaml", "--episodes", "3", "--steps", "4",
           "--updates", "2", "--save", str(tmp_path / "enc.pt")]
    proc = subprocess.run([*cmd, "--geoms", "fingertip", "target"], capture_output=True, text=True, timeout=300,
                          cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "fingertip-target.x" in proc.stdout and "held-out" in proc.stdout, proc.stdout
    assert (tmp_path / "enc.pt").is_file()
    for args, needle in ((["--geoms", "nosuch"], "no geom nosuch"), (["--geoms", "target", "bogus"], "bogus"),
                         (["--geoms", "target", "--recon-size", "999"], "--recon-size must be at most env.image_size"),
                         (["--geoms", "target", "--recon-motion", "2", "env.frame_stack=1"], "--recon-motion needs env.frame_stack")):
        bad = subprocess.run([*cmd, *args], capture_output=True, text=True, timeout=300, cwd=ROOT)
        assert bad.returncode == 2 and bad.stderr.startswith("error:") and needle in bad.stderr, bad.stderr
        assert len(bad.stderr.strip().splitlines()) == 1, bad.stderr
