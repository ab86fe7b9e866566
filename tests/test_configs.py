"""Every YAML recipe in configs/ loads, validates, and means what it says."""

import importlib.util
from pathlib import Path

import pytest
import yaml

from visppo.config import load_config, read_config_file, to_dict
from visppo.envs import check_env_id
from visppo.errors import ConfigError

CONFIGS = sorted((Path(__file__).resolve().parents[1] / "configs").glob("*.yaml"))


def _flatten(data: dict, prefix: str = "") -> dict:
    out = {}
    for key, value in data.items():
        if isinstance(value, dict) and not (prefix == "env." and key == "kwargs"):
            out.update(_flatten(value, f"{prefix}{key}."))
        else:
            out[prefix + key] = value
    return out


@pytest.mark.parametrize("path", CONFIGS, ids=[p.name for p in CONFIGS])
def test_config_loads_with_every_value_it_sets(path):
    cfg = load_config(path)
    if not (cfg.env.id.startswith("dmc:") and importlib.util.find_spec("dm_control") is None):
        check_env_id(cfg.env.id)  # a registered task (DeepMind Control ones need the dmc extra)
    written = _flatten(read_config_file(path))  # with its base's keys
    resolved = _flatten(to_dict(cfg))
    assert written, f"{path.name} sets nothing"
    for key, value in written.items():
        got = resolved[key]
        if key == "train.amp" and value is False:  # YAML 1.1 reads a bare `off` as false
            value = "off"
        assert got == value or (isinstance(value, (int, float)) and got == pytest.approx(value)), (key, value, got)
    assert cfg.ppo.minibatch_size <= cfg.rollout_size


def _first_frame(path: Path, seed: int):
    from visppo.envs import make_vector_env

    envs = make_vector_env(load_config(path, ["env.vector=sync", "ppo.num_envs=1", "ppo.minibatch_size=64"]))
    try:
        obs, _ = envs.reset(seed=seed)
        return obs["pixels"][0, -3:].astype(int)  # the newest frame, CHW
    finally:
        envs.close()


def test_the_topdown_reacher_config_shows_the_target_bigger_and_keeps_the_arm_in_view():
    """reacher_pixels_topdown.yaml moves the camera and otherwise keeps reacher_pixels.yaml's
    keys but the learner's it names (3 frames, std 0.135, keypoints, 8 envs, 10 epochs, a 300k
    budget): the red target covers several times the pixels it covers in Reacher-v5's own view, and the arm's whole reach
    (0.21 m) stays in frame (no arm pixel on the border whatever the start)."""
    configs = Path(CONFIGS[0]).parent
    stock, top = configs / "reacher_pixels.yaml", configs / "reacher_pixels_topdown.yaml"
    own = {"env.frame_stack": 3, "model.init_log_std": -2.0, "ppo.total_steps": 307200,
           "model.encoder": "spatial_softmax", "ppo.num_envs": 8, "ppo.num_epochs": 10}
    top_keys = _flatten(yaml.safe_load(top.read_text()))
    assert {k: top_keys[k] for k in own} == own
    assert _flatten(yaml.safe_load(stock.read_text())) == {
        k: v for k, v in top_keys.items() if k != "env.kwargs" and k not in own} | {
            "env.frame_stack": 1, "ppo.total_steps": 1000000, "model.encoder": "nature",
            "ppo.num_envs": 2, "ppo.num_epochs": 4}
    for seed in range(3):
        frames = [_first_frame(path, seed) for path in (stock, top)]
        sizes = [int(((r > g + 50) & (r > b + 50)).sum()) for r, g, b in frames]
        assert sizes[1] >= 2 * max(sizes[0], 2), (seed, sizes)
        r, _, b = frames[1]
        arm = b > r + 20  # the arm is blue on a grey floor
        assert arm.sum() > 20 and not (arm[0].any() or arm[-1].any() or arm[:, 0].any() or arm[:, -1].any())


DMC_TASKS = [p for p in CONFIGS if p.name.startswith("dmc_")]


def test_every_dmc_task_config_is_the_one_recipe_and_its_env_id():
    """One recipe for the suite (issue 56): a task's file sets env.id over configs/dmc.yaml, nothing else."""
    names = {p.stem.removeprefix("dmc_") for p in DMC_TASKS}
    assert names >= {"reacher_easy", "cartpole_balance", "cartpole_swingup", "finger_spin", "walker_walk",
                     "cheetah_run", "ball_in_cup_catch", "finger_turn_easy", "walker_run", "reacher_hard"}
    recipe = _flatten(read_config_file(DMC_TASKS[0].parent / "dmc.yaml"))
    for path in DMC_TASKS:
        own = yaml.safe_load(path.read_text())
        assert own.keys() == {"base", "env"} and own["base"] == "dmc.yaml" and own["env"].keys() == {"id"}, path.name
        assert path.stem == "dmc_" + own["env"]["id"].removeprefix("dmc:").replace("-", "_")
        assert _flatten(read_config_file(path)) == recipe | {"env.id": own["env"]["id"]}


def test_a_base_file_is_merged_under_the_config_and_its_errors_are_named(tmp_path):
    (tmp_path / "a.yaml").write_text("ppo:\n  num_epochs: 7\n  num_envs: 4\nenv:\n  frame_stack: 2\n")
    (tmp_path / "b.yaml").write_text("base: a.yaml\nppo:\n  num_envs: 2\n")
    cfg = load_config(tmp_path / "b.yaml")
    assert (cfg.ppo.num_epochs, cfg.ppo.num_envs, cfg.env.frame_stack) == (7, 2, 2)
    # a section whose keys are all commented out keeps the base's, as "ppo: {}" does
    (tmp_path / "c.yaml").write_text("base: a.yaml\nppo:\n  # num_envs: 2\nenv:\n")
    cfg = load_config(tmp_path / "c.yaml")
    assert (cfg.ppo.num_epochs, cfg.ppo.num_envs, cfg.env.frame_stack) == (7, 4, 2)
    (tmp_path / "loop.yaml").write_text("base: loop.yaml\n")
    (tmp_path / "missing.yaml").write_text("base: nowhere.yaml\n")
    for name, words in [("loop.yaml", "loop"), ("missing.yaml", "is not a file")]:
        with pytest.raises(ConfigError, match=words):
            load_config(tmp_path / name)


def test_the_dmc_recipe_is_a_starting_point_for_any_env():
    """configs/dmc.yaml passes no suite-only constructor argument: with another env.id it builds
    and steps that env (the README's advice for a task of your own)."""
    from visppo.envs import make_vector_env

    cfg = load_config(CONFIGS[0].parent / "dmc.yaml", ["env.id=visppo/DotReach-v0", "env.vector=sync",
                                                      "ppo.num_envs=1", "ppo.minibatch_size=64"])
    assert dict(cfg.env.kwargs) == {}
    envs = make_vector_env(cfg)
    try:
        obs, _ = envs.reset(seed=0)
        assert obs["pixels"].shape == (1, 9, 84, 84)  # 3 stacked RGB frames at the recipe's size
        envs.step(envs.action_space.sample())
    finally:
        envs.close()
