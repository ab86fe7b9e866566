"""tools/sb3_dmc.py: SB3's PPO on a visppo env writes a run folder the learning table reads."""

import importlib.util
import json
import sys
from pathlib import Path

import pytest
import yaml

from visppo import seeding

TOOLS = Path(__file__).resolve().parents[1] / "tools"


def _tool():
    spec = importlib.util.spec_from_file_location("sb3_dmc", TOOLS / "sb3_dmc.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["sb3_dmc"] = module
    spec.loader.exec_module(module)
    return module


def test_sb3_trains_on_visppo_env_and_is_evaluated_on_the_evaluation_stream(tmp_path, monkeypatch):
    pytest.importorskip("stable_baselines3", reason="the sb3 comparison needs stable-baselines3")
    from visppo.config import load_config

    tool = _tool()
    seen = []
    original = tool.make_env
    monkeypatch.setattr(tool, "make_env", lambda cfg, stream=seeding.TRAIN: (seen.append(stream), original(cfg, stream))[1])
    cfg = load_config(None, ["env.id=visppo/DotReach-v0", "env.max_episode_steps=20"])
    out = tmp_path / "run"
    result = tool.train(cfg, seed=3, steps=64, num_envs=2, out=out, eval_episodes=2,
                        n_steps=32, batch_size=32, n_epochs=1)
    assert seen == [seeding.TRAIN, seeding.TRAIN, seeding.EVAL]
    saved = json.loads((out / "final_eval.json").read_text())
    assert saved["mean_return"] == pytest.approx(result["mean_return"]) and len(saved["returns"]) == 2
    assert all(length == 20 for length in saved["lengths"])
    config = yaml.safe_load((out / "config.yaml").read_text())
    assert (config["ppo"]["total_steps"], config["train"]["seed"], config["env"]["id"]) == (64, 3, "visppo/DotReach-v0")
    rows = (out / "metrics.csv").read_text().splitlines()
    assert rows[0] == "global_step,episode_return" and rows[-1].startswith("64,")
    ran = json.loads((out / "sb3.json").read_text())  # what SB3 ran with, not visppo's ppo.* keys
    assert (ran["n_steps"], ran["batch_size"], ran["n_epochs"], ran["n_envs"]) == (32, 32, 1, 2)
    assert (ran["learning_rate"], ran["clip_range"], ran["target_kl"]) == (3e-4, 0.2, None)  # SB3's defaults


def test_bad_arguments_exit_2_and_write_nothing(tmp_path, capsys):
    tool = _tool()
    assert tool.main([str(TOOLS.parent / "configs" / "dot_reach.yaml"), "--steps", "0", "--out", str(tmp_path / "x")]) == 2
    assert capsys.readouterr().err.startswith("error:") and not (tmp_path / "x").exists()
    (tmp_path / "y").mkdir()
    assert tool.main([str(TOOLS.parent / "configs" / "dot_reach.yaml"), "--out", str(tmp_path / "y")]) == 2
    (tmp_path / "file").write_text("")  # a folder under a file: refused before any training
    assert tool.main([str(TOOLS.parent / "configs" / "dot_reach.yaml"), "--out", str(tmp_path / "file" / "run")]) == 2
    assert "not a directory" in capsys.readouterr().err


def test_a_crash_while_writing_metrics_leaves_no_half_file_for_the_learning_table(tmp_path):
    """The row that cannot be written (a key not in the header) stops the write after the header and
    the first row: metrics.csv is then absent, not a half file the learning table would read."""
    tool = _tool()
    path = tmp_path / "metrics.csv"
    with pytest.raises(ValueError, match="fields not in fieldnames"):
        tool.write_metrics(path, [{"global_step": 64, "episode_return": 1.0}, {"global_step": 128, "bogus": 2.0}])
    assert list(tmp_path.iterdir()) == []
    tool.write_metrics(path, [{"global_step": 64, "episode_return": 1.0}])
    assert path.read_text().splitlines() == ["global_step,episode_return", "64,1.0"]
