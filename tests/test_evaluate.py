"""visppo.evaluate: episodes from a real checkpoint, their videos, and checkpoints that must be refused."""

from __future__ import annotations

import json
import math
import os

import gymnasium as gym
import imageio.v3 as iio
import numpy as np
import pytest
import torch
from conftest import Recorder, tiny_overrides
from PIL import Image

from visppo.checkpoint import CheckpointError
from visppo.config import load_config
from visppo.errors import ConfigError, UserError
from visppo.evaluate import evaluate, format_result
from visppo.loop import train

EPISODE_LENGTH = 50  # visppo/DotReach-v0's registered time limit
IMAGE_SIZE = 48  # tiny_overrides' env.image_size


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    """A real run: the tiny DotReach training of conftest (2 iterations, ~15 s)."""
    cfg = load_config(None, tiny_overrides(tmp_path_factory.mktemp("evaluate")))
    return train(cfg)


@pytest.fixture(scope="module")
def ckpt(run_dir):
    return torch.load(run_dir / "checkpoints" / "latest.pt", weights_only=True)


def test_evaluate_run_dir_and_file(run_dir, tmp_path):
    json_path = tmp_path / "out" / "result.json"
    result = evaluate(run_dir, episodes=3, deterministic=True, json_path=json_path)
    assert result["episodes"] == 3
    assert result["checkpoint"] == str(run_dir / "checkpoints" / "latest.pt")
    assert result["global_step"] == 128
    assert result["lengths"] == [EPISODE_LENGTH] * 3 and result["mean_length"] == EPISODE_LENGTH
    # DotReach: 10x the distance gained (|.| < 10 * sqrt(2)) + 0.1 per step inside the target
    assert all(-15 < r < 10 * math.sqrt(2) + 0.1 * EPISODE_LENGTH for r in result["returns"])
    assert result["mean_return"] == pytest.approx(np.mean(result["returns"]))
    assert result["std_return"] == pytest.approx(np.std(result["returns"]))
    assert all(isinstance(s, bool) for s in result["successes"])
    assert result["success_rate"] == pytest.approx(np.mean(result["successes"]))
    assert json.loads(json_path.read_text()) == result
    assert [p.name for p in json_path.parent.iterdir()] == ["result.json"]  # no temp file left
    line = format_result(result)
    assert "±" in line and "3 episodes" in line and "success" in line

    from_file = evaluate(run_dir / "checkpoints" / "latest.pt", episodes=3, deterministic=True)
    assert from_file["returns"] == result["returns"]  # same checkpoint, same seed


def test_evaluation_is_repeatable(run_dir):
    a = evaluate(run_dir, episodes=2, deterministic=True, seed=5)
    b = evaluate(run_dir, episodes=2, deterministic=True, seed=5)
    c = evaluate(run_dir, episodes=2, deterministic=True, seed=6)
    assert a["returns"] == b["returns"]
    assert a["returns"] != c["returns"]  # other seeds place dot and target elsewhere
    torch.manual_seed(0)
    s1 = evaluate(run_dir, episodes=2, seed=5)
    torch.manual_seed(123)  # the caller's RNG state does not matter ...
    s2 = evaluate(run_dir, episodes=2, seed=5)
    assert s1["returns"] == s2["returns"]  # ... sampling is seeded by `seed`
    assert s1["deterministic"] is False and a["deterministic"] is True


def test_evaluation_episodes_are_reset_with_evaluation_stream_seeds(run_dir, monkeypatch):
    """Episode i of evaluation seed s starts from episode_seed(s, i, EVAL): never a training episode."""
    import visppo.evaluate as evaluate_module
    from visppo import seeding

    seeds, real = [], evaluate_module.make_env

    def recording_make_env(cfg, *args):
        env = real(cfg, *args)
        inner = env.env  # below SeededEpisodes: the seeds the task itself is reset with
        reset = inner.reset
        inner.reset = lambda *, seed=None, options=None: (seeds.append(seed), reset(seed=seed, options=options))[1]
        return env

    monkeypatch.setattr(evaluate_module, "make_env", recording_make_env)
    evaluate(run_dir, episodes=3, deterministic=True, seed=5)
    assert seeds == [seeding.episode_seed(5, i, seeding.EVAL) for i in range(3)]
    assert {seeding.stream_of(s) for s in seeds} == {seeding.EVAL}


class StubPolicy(torch.nn.Module):
    """What run_episodes needs of a policy; ``act`` fails as a network of the wrong shape does, or
    returns a zero action for DotReach."""

    def __init__(self, fails: bool):
        super().__init__()
        self.fails = fails

    def act(self, batch, deterministic=False):
        if self.fails:
            raise RuntimeError("mat1 and mat2 shapes cannot be multiplied (1x32 and 64x32)")
        return torch.zeros(1, 2), None, None


def test_a_policys_error_during_evaluation_is_its_own_and_an_envs_is_the_envs(monkeypatch):
    """Only what the env's reset and step raise reads as the env's (EnvError): a shape mismatch
    inside the network is a bug of the policy, and must not send the user to fix their env."""
    from visppo.errors import EnvError
    from visppo.evaluate import run_episodes
    from visppo_envs.dot import DotReachEnv

    cfg = load_config(None, tiny_overrides())
    with pytest.raises(RuntimeError, match="shapes cannot be multiplied") as err:
        run_episodes(StubPolicy(fails=True), cfg, episodes=1)
    assert not isinstance(err.value, EnvError)

    def step(self, action):
        raise ValueError("joint 3 over its torque limit")

    monkeypatch.setattr(DotReachEnv, "step", step)
    with pytest.raises(EnvError, match="env visppo/DotReach-v0 failed during evaluation: raised ValueError: joint 3"):
        run_episodes(StubPolicy(fails=False), cfg, episodes=1)


def test_an_evaluation_episode_of_an_env_without_a_time_limit_ends_in_an_error(monkeypatch):
    """gymnasium registers envs without one; evaluating a policy that never ends the episode hung."""
    import gymnasium as gym

    from visppo.errors import EnvError
    from visppo.evaluate import run_episodes

    monkeypatch.setitem(gym.registry, "NoLimitDot-v0", gym.envs.registration.EnvSpec(
        "NoLimitDot-v0", entry_point="visppo_envs.dot:DotReachEnv"))
    monkeypatch.setattr("visppo.evaluate.EPISODE_STEP_CAP", 30)
    cfg = load_config(None, tiny_overrides(**{"env.id": "NoLimitDot-v0"}))
    with pytest.raises(EnvError, match="did not end in 30 steps: the env has no time limit; set env.max_episode_steps"):
        run_episodes(StubPolicy(fails=False), cfg, episodes=1)
    cfg = load_config(None, tiny_overrides(**{"env.id": "NoLimitDot-v0", "env.max_episode_steps": 40}))
    assert run_episodes(StubPolicy(fails=False), cfg, episodes=1)["lengths"] == [40]  # a limit: no cap below it


def test_video_mp4_frames_and_size(run_dir, tmp_path):
    video = tmp_path / "videos" / "eval.mp4"
    result = evaluate(run_dir, episodes=2, deterministic=True, video=video)
    assert result["video"] == str(video)
    frames = iio.imread(video, index=None)
    # one frame per observation: each episode's reset frame plus one per step
    assert frames.shape[0] == sum(result["lengths"]) + result["episodes"] == 2 * (EPISODE_LENGTH + 1)
    scale = math.ceil(256 / IMAGE_SIZE)  # nearest-neighbour upscale to >= 256 px; DotReach has no view
    assert frames.shape[1:] == (IMAGE_SIZE * scale, IMAGE_SIZE * scale, 3) == (288, 288, 3)
    assert frames.max() > 100  # not blank: the red dot and green target are there
    assert sorted(p.name for p in video.parent.iterdir()) == ["eval.mp4"]


def test_video_gif(run_dir, tmp_path):
    video = tmp_path / "eval.gif"
    result = evaluate(run_dir, episodes=1, deterministic=True, video=video)
    assert result["video"] == str(video)
    with Image.open(video) as im:
        assert im.size == (288, 288)
        # Pillow merges identical consecutive GIF frames (adding their durations):
        # count the frames by total duration, 50 ms each at DotReach's 20 fps.
        durations = []
        for i in range(im.n_frames):
            im.seek(i)
            durations.append(im.info["duration"])
    assert sum(durations) == 50 * (EPISODE_LENGTH + 1)
    assert iio.imread(video, index=0).shape[:2] == (288, 288)


def test_env_overrides_change_the_env_and_nothing_else(run_dir, tmp_path):
    base = evaluate(run_dir, episodes=2, deterministic=True)
    assert base["env_overrides"] == []
    json_path = tmp_path / "short.json"
    short = evaluate(run_dir, episodes=2, deterministic=True, env_overrides=["env.max_episode_steps=20"],
                     json_path=json_path)
    assert short["lengths"] == [20, 20] and base["lengths"] == [EPISODE_LENGTH] * 2
    assert short["env_overrides"] == ["env.max_episode_steps=20"]
    assert json.loads(json_path.read_text())["env_overrides"] == ["env.max_episode_steps=20"]
    assert "(env.max_episode_steps=20):" in format_result(short)
    # the checkpoint's own config is untouched: evaluating it again gives the first figures
    assert evaluate(run_dir, episodes=2, deterministic=True)["returns"] == base["returns"]


@pytest.mark.parametrize("override", ["ppo.learning_rate=1.0", "model.feature_dim=8", "env.frame_stack"])
def test_non_env_overrides_are_refused_before_running(run_dir, tmp_path, override):
    json_path = tmp_path / "r.json"
    with pytest.raises(ConfigError, match="evaluation overrides change the env only") as info:
        evaluate(run_dir, episodes=1, env_overrides=[override], json_path=json_path)
    assert "\n" not in str(info.value) and not json_path.exists()


def test_env_override_that_changes_what_the_policy_sees_is_refused(run_dir):
    with pytest.raises(ConfigError, match="no longer fit the trained policy") as info:
        evaluate(run_dir, episodes=1, env_overrides=["env.frame_stack=2"])  # 6 input channels, not 3
    assert "env.frame_stack=2" in str(info.value) and "\n" not in str(info.value)
    with pytest.raises(ConfigError, match="env.max_episode_steps"):  # a bad value names its key
        evaluate(run_dir, episodes=1, env_overrides=["env.max_episode_steps=-3"])


def _save(tmp_path, obj, name="edited.pt"):
    path = tmp_path / name
    torch.save(obj, path)
    return path


def test_other_architecture_is_refused(ckpt, tmp_path):
    # a config that builds a wider encoder than the weights in the file
    wider = {**ckpt, "config": {**ckpt["config"], "model": {**ckpt["config"]["model"], "feature_dim": 64}}}
    with pytest.raises(CheckpointError, match="another architecture") as info:
        evaluate(_save(tmp_path, wider), episodes=1)
    assert "encoder.pixels.proj.0.weight" in str(info.value) and "\n" not in str(info.value)

    model = dict(ckpt["model"])
    model.pop("critic.2.bias")
    model["extra.weight"] = torch.zeros(3)
    model["actor.0.weight"] = torch.zeros(7, 7)
    with pytest.raises(CheckpointError, match="another architecture") as info:
        evaluate(_save(tmp_path, {**ckpt, "model": model}), episodes=1)
    msg = str(info.value)
    for key in ("missing keys: critic.2.bias", "unexpected keys: extra.weight", "actor.0.weight (7, 7)"):
        assert key in msg


RETIRED_TENSORS = {  # what checkpoints of the features removed on 2026-12-03 (issue 55) held besides
    "decoder.0.weight": (32, 32), "decoder.2.bias": (27,),  # model.recon_size
    "invdyn.0.weight": (32, 32), "invdyn.2.bias": (2,),  # model.invdyn
    "reward_head.0.weight": (32, 32), "reward_head.2.bias": (1,),  # model.reward_head
    "encoder.pixels.kp_count": (), "encoder.pixels.kp_mean": (64,), "encoder.pixels.kp_m2": (64,),  # keypoint_norm
    "critic_encoder.state.0.weight": (64, 4), "critic_encoder.state.0.bias": (64,),  # model.privileged_critic
    "value_norm.count": (), "value_norm.mean": (), "value_norm.var": (),  # model.norm_value (2026-12-06)
}


def test_an_old_checkpoint_with_retired_keys_and_heads_evaluates_resumes_and_gives_weights(ckpt, run_dir, tmp_path):
    """A checkpoint saved before issue 55's removals: its config holds the removed keys at their old
    defaults and its state dict tensors of removed heads. Both are dropped: it evaluates as the
    same policy, resumes, and fills model.encoder_weights."""
    import shutil

    from visppo.builders import build_policy
    from visppo.checkpoint import load_for_resume
    from visppo.config import REMOVED
    from visppo.envs import make_env
    from visppo.evaluate import load_policy

    config = {section: dict(values) if isinstance(values, dict) else values for section, values in ckpt["config"].items()}
    for key, (default, _) in REMOVED.items():
        section, name = key.split(".")
        config[section][name] = default
    model = {**ckpt["model"], **{k: torch.zeros(shape) for k, shape in RETIRED_TENSORS.items()}}
    old = {**ckpt, "config": config, "model": model}
    policy, _, _ = load_policy(_save(tmp_path, old, "old.pt"))
    assert policy.state_dict().keys() == ckpt["model"].keys()
    for key, value in ckpt["model"].items():
        assert torch.equal(policy.state_dict()[key], value), key
    assert evaluate(tmp_path / "old.pt", episodes=1)["episodes"] == 1

    copy = tmp_path / "run"
    shutil.copytree(run_dir, copy)
    torch.save(old, copy / "checkpoints" / "latest.pt")
    cfg, resume = load_for_resume(copy, [f"ppo.total_steps={ckpt['global_step'] + 64}"])
    assert train(cfg, resume=resume) == copy
    assert torch.load(copy / "checkpoints" / "latest.pt", weights_only=True)["global_step"] == ckpt["global_step"] + 64

    cfg = load_config(None, tiny_overrides(tmp_path, **{"model.encoder_weights": tmp_path / "old.pt"}))
    env = make_env(cfg)
    try:
        filled = build_policy(cfg, env.observation_space, env.action_space, torch.device("cpu"))
    finally:
        env.close()
    for key, value in filled.encoder.pixels.state_dict().items():
        assert torch.equal(value, ckpt["model"][f"encoder.pixels.{key}"]), key


@pytest.mark.parametrize("section,name,value", [("ppo", "drac_coef", 0.1), ("model", "final_log_std", -1.6),
                                                ("model", "rotate_degrees", 90.0), ("model", "augment", "rotate"),
                                                ("model", "augment", "shift"), ("ppo", "augment_loss", True)])
def test_an_old_checkpoint_that_used_a_retired_key_is_refused_with_its_line(ckpt, run_dir, tmp_path, capsys,
                                                                           section, name, value):
    """A checkpoint whose stored config used a key (or value) removed on 2026-12-03 is refused, by
    eval and resume alike, with the one line that says it was removed and what can be done with a
    checkpoint (not "delete the key": its saved config is not the user's to edit); at the old
    defaults it loads (the test above)."""
    import shutil

    from visppo.checkpoint import load_for_resume
    from visppo.cli import main

    config = {k: dict(v) if isinstance(v, dict) else v for k, v in ckpt["config"].items()}
    config[section][name] = value
    path = _save(tmp_path, {**ckpt, "config": config}, "old.pt")
    removed = rf"trained with {section}[.]{name}={value}: {section}[.]{name} .* was removed on 2026-12-03 .*"
    with pytest.raises(UserError, match=removed + "act with the visppo version that trained it"):
        evaluate(path, episodes=1)  # CheckpointError: the stored config cannot be used
    code, err = main(["eval", str(path), "--episodes", "1"]), capsys.readouterr().err
    assert code == 2 and err.startswith("error: ") and err.count("\n") == 1 and "was removed" in err, err
    assert "delete the key" not in err
    copy = tmp_path / "run"
    shutil.copytree(run_dir, copy)
    torch.save({**ckpt, "config": config}, copy / "checkpoints" / "latest.pt")
    with pytest.raises(UserError, match=removed + "the run cannot go on, and a new run trains without it") as info:
        load_for_resume(copy, [])
    assert "delete the key" not in str(info.value)


def test_a_checkpoint_trained_with_norm_value_still_acts_but_does_not_resume(ckpt, run_dir, tmp_path, capsys):
    """model.norm_value (removed on 2026-12-06) changed only how the critic learned: a checkpoint
    trained with it (its config says true, its state holds the statistics, under their names
    before and after ValueNorm) evaluates and loads as the same acting policy. Resuming it would
    train its normalised critic on raw targets: refused, with what still works."""
    import shutil

    from visppo.checkpoint import load_for_resume
    from visppo.evaluate import load_policy

    config = {k: dict(v) if isinstance(v, dict) else v for k, v in ckpt["config"].items()}
    config["model"]["norm_value"] = True
    for names in (("value_norm.count", "value_norm.mean", "value_norm.var"), ("value_count", "value_mean", "value_var")):
        old = {**ckpt, "config": config, "model": {**ckpt["model"], **{k: torch.ones(()) for k in names}}}
        path = _save(tmp_path, old, "normed.pt")
        policy, _, _ = load_policy(path)
        for key, value in ckpt["model"].items():
            assert torch.equal(policy.state_dict()[key], value), key
        assert evaluate(path, episodes=1)["episodes"] == 1
    copy = tmp_path / "run"
    shutil.copytree(run_dir, copy)
    torch.save(old, copy / "checkpoints" / "latest.pt")
    (copy / "config.yaml").write_text((copy / "config.yaml").read_text().replace("model:\n", "model:\n  norm_value: true\n", 1))
    with pytest.raises(UserError, match=r"trained with model[.]norm_value=True, which was removed on 2026-12-06 "
                                        r"\(docs/recipe[.]md\): the run cannot go on; its policy still evaluates"):
        load_for_resume(copy, [])


def test_missing_and_non_run_dirs(tmp_path):
    with pytest.raises(CheckpointError, match="not found"):
        evaluate(tmp_path / "nope", episodes=1)
    (tmp_path / "empty").mkdir()
    with pytest.raises(CheckpointError, match=r"not a run directory \(no checkpoints/latest.pt\)"):
        evaluate(tmp_path / "empty", episodes=1)


def test_corrupt_checkpoint(run_dir, tmp_path):
    data = (run_dir / "checkpoints" / "latest.pt").read_bytes()
    path = tmp_path / "truncated.pt"
    path.write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match="corrupt"):
        evaluate(path, episodes=1)
    text = tmp_path / "text.pt"
    text.write_text("not a checkpoint\n")
    with pytest.raises(CheckpointError):
        evaluate(text, episodes=1)


class _Payload:
    """Unpickling this runs a shell command."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


def test_malicious_pickle_is_refused(ckpt, tmp_path):
    marker = tmp_path / "MARKER"
    path = _save(tmp_path, {**ckpt, "model": {"evil": _Payload(marker)}}, "evil.pt")
    with pytest.raises(CheckpointError, match="refused"):
        evaluate(path, episodes=1)
    assert not marker.exists()
    # the payload is live: an unsafe load would have run it
    torch.load(path, weights_only=False)
    assert marker.exists()


def test_bad_outputs_fail_before_running(run_dir, tmp_path):
    with pytest.raises(UserError, match="must end in"):
        evaluate(run_dir, episodes=1, video=tmp_path / "video.txt")
    with pytest.raises(UserError, match="at least 1"):
        evaluate(run_dir, episodes=0)
    assert list(tmp_path.iterdir()) == []


def test_crash_leaves_no_video(run_dir, tmp_path, monkeypatch):
    import visppo.evaluate as ev

    real, calls = ev.compose_frame, []

    def failing(*args, **kwargs):
        calls.append(1)
        if len(calls) > 20:
            raise KeyboardInterrupt
        return real(*args, **kwargs)

    monkeypatch.setattr(ev, "compose_frame", failing)
    video = tmp_path / "eval.mp4"
    with pytest.raises(KeyboardInterrupt):
        evaluate(run_dir, episodes=1, video=video)
    assert list(tmp_path.iterdir()) == []  # neither eval.mp4 nor its temp file


def test_gif_when_ffmpeg_is_missing(run_dir, tmp_path, monkeypatch):
    import visppo.video

    monkeypatch.setattr(visppo.video, "ffmpeg_available", lambda: False)
    with pytest.warns(RuntimeWarning, match="ffmpeg"):
        result = evaluate(run_dir, episodes=1, deterministic=True, video=tmp_path / "eval.mp4")
    assert result["video"] == str(tmp_path / "eval.gif")
    assert [p.name for p in tmp_path.iterdir()] == ["eval.gif"]


@pytest.mark.cuda
def test_evaluation_leaves_the_gpus_random_state_as_it_found_it(run_dir):
    """A periodic evaluation in a GPU run must not reseed the generator the rollout samples from."""
    torch.cuda.init()
    torch.cuda.manual_seed_all(123)
    before = torch.cuda.get_rng_state()
    evaluate(run_dir, episodes=1, seed=5)
    assert torch.equal(torch.cuda.get_rng_state(), before)


# --------------------------------------------------------------------------- what an evaluation counts


class FixedAction(torch.nn.Module):
    """What run_episodes needs of a policy: ``act`` returns ``action`` and records its ``deterministic``."""

    def __init__(self, action):
        super().__init__()
        self.action, self.asked = torch.tensor([action], dtype=torch.float32), []

    def act(self, batch, deterministic=False):
        self.asked.append(deterministic)
        return self.action.clone(), None, None


def _recording(monkeypatch):
    """Patch evaluation's make_env: a Recorder between SeededEpisodes and PixelDict (what the env is given)."""
    import visppo.evaluate as evaluate_module

    recorders, real = [], evaluate_module.make_env

    def make_env(cfg, *args):
        env = real(cfg, *args)
        env.env = Recorder(env.env)
        recorders.append(env.env)
        return env

    monkeypatch.setattr(evaluate_module, "make_env", make_env)
    return recorders


def test_evaluation_asks_for_the_mode_and_steps_the_env_within_the_action_bounds(tmp_path, monkeypatch):
    """A deterministic evaluation acts with the distribution's mode, and an action outside the Box (a
    Gaussian's mean or sample is unbounded) reaches the env clipped, as in training and deployment."""
    from visppo.evaluate import run_episodes

    recorders = _recording(monkeypatch)
    cfg = load_config(None, tiny_overrides(tmp_path, **{"env.max_episode_steps": 5}))
    policy = FixedAction([5.0, -5.0])
    result = run_episodes(policy, cfg, episodes=1, deterministic=True)
    actions = np.stack(recorders[0].episodes[0]["actions"])
    assert result["lengths"] == [5] and actions.shape == (5, 2)
    assert np.all(actions == np.array([1.0, -1.0], np.float32))  # DotReach's Box is [-1, 1]^2
    assert policy.asked == [True] * 5


class KnownEpisodes(gym.Env):
    """Episode n (0, 1, 2) lasts n + 2 steps with rewards 1, 10, 100, ... and ends terminated (even n)
    or truncated (odd n); its final step reports is_success True, nothing, False; the steps before
    report the opposite of the final verdict (True where the final step says nothing)."""

    metadata = {"render_modes": []}
    observation_space = gym.spaces.Box(0, 255, (16, 16, 3), np.uint8)
    action_space = gym.spaces.Box(-1, 1, (1,), np.float32)
    FINAL = (True, None, False)

    def __init__(self):
        self.episode, self.t = -1, 0

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        self.episode, self.t = self.episode + 1, 0
        return np.zeros((16, 16, 3), np.uint8), {}

    def step(self, action):
        self.t += 1
        final = self.FINAL[self.episode % 3]
        end = self.t == self.episode + 2
        info = ({} if final is None else {"is_success": final}) if end else {"is_success": final is not True}
        obs = np.full((16, 16, 3), self.t, np.uint8)
        return obs, float(10 ** (self.t - 1)), end and self.episode % 2 == 0, end and self.episode % 2 == 1, info


gym.register("visppo_tests/KnownEpisodes-v0", entry_point=KnownEpisodes)


def test_evaluation_counts_each_episodes_return_length_and_final_success(tmp_path):
    """Every step's reward, the final one included, in the return; every step in the length; success
    from the final step's info only, over the episodes that report it (None where one does not)."""
    from visppo.evaluate import run_episodes

    cfg = load_config(None, tiny_overrides(tmp_path, **{"env.id": "visppo_tests/KnownEpisodes-v0",
                                                        "env.pixels": False, "env.image_size": 16}))
    result = run_episodes(FixedAction([0.0]), cfg, episodes=3, deterministic=True)
    assert result["returns"] == [11.0, 111.0, 1111.0]
    assert result["lengths"] == [2, 3, 4] and result["mean_length"] == 3.0
    assert result["mean_return"] == pytest.approx(411.0)
    assert result["successes"] == [True, None, False]
    assert result["success_rate"] == 0.5  # of the 2 episodes that report it
