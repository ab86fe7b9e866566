"""visppo.train(...): the Python API (a config from a path, a dict or the defaults, keyword
overrides), and envs built in code (``env=``), whose runs load with visppo.load_policy anywhere."""

from __future__ import annotations

import functools
import json
import subprocess
import sys
import threading

import gymnasium as gym
import numpy as np
import pytest
from conftest import REPO, act_on, evaluate_recorded, tiny_kwargs

import visppo
import visppo.evaluate as evaluate_module
from visppo import envs
from visppo.api import make_config, nested_overrides
from visppo.config import load_config
from visppo.errors import ConfigError
from visppo_envs.dot import DotReachEnv


def test_a_code_env_that_renders_at_its_own_size_with_state(tmp_path, monkeypatch):
    """env= a callable: frames of 64x64 resized to env.image_size=48 and a state vector, in training,
    evaluation and Policy.act alike; policy.json lets the run load where the callable is unknown."""
    factory = functools.partial(DotReachEnv, image_size=64, obs_mode="pixels_state")
    kwargs = tiny_kwargs(tmp_path, env__state=True, env__max_episode_steps=50,  # the class has no time limit
                         ppo__total_steps=64, ppo__num_epochs=1)
    del kwargs["env__id"]  # env= gives the env
    run_dir = visppo.train(None, env=factory, **kwargs)
    assert run_dir == tmp_path / "run" and (run_dir / "checkpoints" / "latest.pt").is_file()
    cfg = load_config(run_dir / "config.yaml")
    assert cfg.env.id.startswith("code/DotReachEnv-v") and cfg.env.state
    spec = json.loads((run_dir / "policy.json").read_text())
    assert spec["image_size"] == 48 and spec["state_dim"] == 4 and spec["inputs"]["pixels"]["shape"][1:] == [3, 48, 48]
    episodes, _ = evaluate_recorded(monkeypatch, run_dir, episodes=1)
    first = episodes[0]["obs"][0]
    assert first["pixels"].shape == (64, 64, 3) and first["state"].shape == (4,)
    assert act_on(visppo.load_policy(run_dir), episodes) == 0.0
    monkeypatch.setattr(envs, "_CODE_ENVS", {})  # as in another process: the callable is unknown there
    assert act_on(visppo.load_policy(run_dir), episodes) == 0.0  # from policy.json, no env made
    with pytest.raises(ConfigError, match="built in code"):
        evaluate_module.evaluate(run_dir, episodes=1)


class StateOnly(gym.Env):
    """An env in code whose observations are not images: visppo renders it."""

    metadata = {"render_modes": ["rgb_array"], "render_fps": 10}

    def __init__(self, render_mode=None):
        self.render_mode = render_mode
        self.observation_space = gym.spaces.Box(-1, 1, (3,), np.float32)
        self.action_space = gym.spaces.Box(-1, 1, (1,), np.float32)

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        return np.zeros(3, np.float32), {}

    def step(self, action):
        return np.zeros(3, np.float32), 0.0, False, False, {}

    def render(self):
        return np.full((30, 40, 3), 7, np.uint8)


class Disconnects(DotReachEnv):
    """A robot whose link drops after 100 steps (after the first iteration and its checkpoint)."""

    steps = 0

    def step(self, action):
        Disconnects.steps += 1
        if Disconnects.steps > 100:
            raise RuntimeError("robot disconnected")
        return super().step(action)


KILLED_RUN = """
import os, signal, sys
import visppo, visppo.checkpoint as ck
from visppo_envs.dot import DotReachEnv
real = ck.save_checkpoint
def save_then_die(*args, **kwargs):  # a SIGKILL right after the first checkpoint: no handler runs
    real(*args, **kwargs)
    os.kill(os.getpid(), signal.SIGKILL)
ck.save_checkpoint = save_then_die
visppo.train(None, env=DotReachEnv, **eval(sys.argv[1]))
"""


def test_a_code_env_run_killed_without_warning_still_loads_anywhere(tmp_path):
    """policy.json is written as the run starts, not as it ends: a SIGKILL runs no handler."""
    kwargs = tiny_kwargs(tmp_path, env__max_episode_steps=50, env__vector="sync", run__checkpoint_every=1,
                         ppo__num_epochs=1)
    del kwargs["env__id"]
    res = subprocess.run([sys.executable, "-c", KILLED_RUN, repr(kwargs)], capture_output=True, text=True,
                         timeout=300, cwd=REPO)
    assert res.returncode == -9, res.stderr[-2000:]
    run_dir = tmp_path / "run"
    assert (run_dir / "checkpoints" / "latest.pt").is_file() and (run_dir / "policy.json").is_file()
    assert visppo.load_policy(run_dir) is not None  # no env made: this process never knew it
    (run_dir / "policy.json").unlink()  # as a run killed before policy.json was written at the start
    visppo.train(resume=run_dir, env=DotReachEnv, ppo__total_steps=192)
    assert (run_dir / "policy.json").is_file()


def test_a_code_env_run_that_fails_before_its_first_row_leaves_nothing(tmp_path):
    """As any new run: nothing to resume, so config.yaml, policy.json and the folder go."""
    kwargs = tiny_kwargs(tmp_path, env__max_episode_steps=50, env__vector="sync")
    del kwargs["env__id"]
    Disconnects.steps = 95  # the env check's step passes; the first rollout's fifth does not
    with pytest.raises(visppo.errors.EnvError, match="robot disconnected"):
        visppo.train(None, env=Disconnects, **kwargs)
    assert not (tmp_path / "run").exists()


def test_a_resume_refuses_a_config_beside_it(tmp_path):
    """The run's saved config is what a resume trains on: a config given too would be ignored."""
    with pytest.raises(ConfigError, match="resume= trains on the run's saved config"):
        visppo.train({"ppo": {"learning_rate": 0.5}}, resume=tmp_path / "run")


def test_a_code_env_run_that_fails_loads_anywhere_and_resumes_with_its_env(tmp_path, monkeypatch):
    """The run's checkpoints stay usable: policy.json is written though the run failed, the error
    says to resume with the Python call (the command line cannot build the env), and that call goes on."""
    kwargs = tiny_kwargs(tmp_path, env__max_episode_steps=50, env__vector="sync", run__checkpoint_every=1,
                         ppo__num_epochs=1)
    del kwargs["env__id"]
    Disconnects.steps = 0
    with pytest.raises(visppo.errors.EnvError, match="robot disconnected") as failed:
        visppo.train(None, env=Disconnects, **kwargs)
    run_dir = tmp_path / "run"
    assert f"visppo.train(resume='{run_dir}', env=<the env>)" in str(failed.value)
    assert (run_dir / "policy.json").is_file()
    with pytest.raises(ConfigError, match="built in code"):
        visppo.train(resume=run_dir)  # the env is needed again
    Disconnects.steps = -10**6  # reconnected
    assert visppo.train(resume=run_dir, env=Disconnects, ppo__total_steps=192) == run_dir
    assert visppo.checkpoint.load(run_dir / "checkpoints" / "latest.pt")["global_step"] == 192
    monkeypatch.setattr(envs, "_CODE_ENVS", {})  # as in another process
    assert visppo.load_policy(run_dir) is not None


def test_a_code_env_without_images_is_rendered_or_refused():
    cfg = make_config(None, {"env__image_size": 24, "env__state": True, "env__max_episode_steps": 5},
                      env=functools.partial(StateOnly, render_mode="rgb_array"))
    env = envs.make_env(cfg)
    obs, _ = env.reset(seed=0)
    assert obs["pixels"].shape == (3, 24, 24) and obs["state"].shape == (3,)
    for _ in range(5):
        obs, _, terminated, truncated, _ = env.step(np.zeros(1, np.float32))
    assert truncated and not terminated  # env.max_episode_steps applies to code envs too
    cfg = make_config(None, {}, env=StateOnly)  # render_mode None: nothing to see
    with pytest.raises(ConfigError, match="render_mode='rgb_array'"):
        envs.make_env(cfg)
    cfg = make_config(None, {}, env=lambda: "not an env")
    with pytest.raises(ConfigError, match="not a gymnasium env"):
        envs.make_env(cfg)
    # the env's own view and renderer: env.camera cannot reach them, and anti-aliasing is MuJoCo's
    cfg = make_config(None, {"env__camera": "top"}, env=functools.partial(StateOnly, render_mode="rgb_array"))
    with pytest.raises(ConfigError, match="env.camera=top"):
        envs.make_env(cfg)
    cfg = make_config(None, {"env__render_samples": 0}, env=functools.partial(StateOnly, render_mode="rgb_array"))
    with pytest.raises(ConfigError, match="MuJoCo envs only"):
        envs.make_env(cfg)


def test_code_envs_go_to_workers_only_when_they_pickle(monkeypatch):
    monkeypatch.setattr(envs, "usable_cpus", lambda: 8)
    lock = threading.Lock()

    def unpicklable():
        with lock:
            return DotReachEnv(image_size=24)

    picklable = functools.partial(DotReachEnv, image_size=24)
    kw = {"ppo__num_envs": 2, "env__image_size": 24}
    assert envs.use_async(make_config(None, kw, env=picklable))
    assert not envs.use_async(make_config(None, kw, env=unpicklable))  # auto: sync
    with pytest.raises(ConfigError, match="cannot be pickled"):
        envs.use_async(make_config(None, {**kw, "env__vector": "async"}, env=unpicklable))


def test_a_code_env_steps_in_worker_processes():
    """env.vector=async: each worker registers the callable it was sent, then builds its env."""
    cfg = make_config(None, {"ppo__num_envs": 2, "env__image_size": 24, "env__vector": "async"},
                      env=functools.partial(DotReachEnv, image_size=24))
    vec = envs.make_vector_env(cfg)
    try:
        assert isinstance(vec, gym.vector.AsyncVectorEnv)
        obs, _ = vec.reset(seed=[1, 2])
        assert obs["pixels"].shape == (2, 3, 24, 24)
        obs, *_ = vec.step(np.zeros((2, 2), np.float32))
        assert obs["pixels"].dtype == np.uint8
    finally:
        vec.close()


def test_config_from_a_path_a_dict_or_the_defaults_with_keyword_overrides():
    cfg = make_config(REPO / "configs" / "dot_reach.yaml", {"ppo__total_steps": 4096, "env__kwargs__speed": 0.2})
    assert (cfg.env.id, cfg.ppo.total_steps, cfg.env.kwargs, cfg.model.encoder) == \
        ("visppo/DotReach-v0", 4096, {"speed": 0.2}, "nature")
    cfg = make_config({"ppo": {"num_envs": 2, "minibatch_size": 32}}, {"ppo__num_steps": 16, "env__kwargs__name": "123"})
    assert (cfg.ppo.num_envs, cfg.ppo.num_steps, cfg.env.kwargs) == (2, 16, {"name": "123"})  # not parsed: a str
    # a path, a numpy number: the plain data config.yaml and the checkpoint keep; anything else is refused
    cfg = make_config(None, {"env__kwargs__xml": REPO / "x.xml", "env__kwargs__gain": np.float32(0.5),
                             "env__kwargs__goal": np.array([1, 2])})
    assert cfg.env.kwargs == {"xml": str(REPO / "x.xml"), "gain": 0.5, "goal": [1, 2]}
    assert type(cfg.env.kwargs["gain"]) is float and type(cfg.env.kwargs["goal"][0]) is int
    with pytest.raises(ConfigError, match=r"env\.kwargs\.robot=.*its type, object, is not plain data"):
        make_config(None, {"env__kwargs__robot": object()})
    assert make_config(None, {}).env.id == "visppo/Reach-v0"
    assert make_config(cfg, {"ppo__num_envs": 4}).ppo.num_envs == 4
    assert nested_overrides({"a__b__c": 1, "a__d": 2}) == {"a": {"b": {"c": 1}, "d": 2}}


@pytest.mark.parametrize("config, overrides, env, match", [
    (None, {"total_steps": 5}, None, "section__key"),
    (None, {"ppo__": 5}, None, "section__key"),
    (None, {"ppo__no_such_key": 5}, None, "unknown config key 'ppo.no_such_key'"),
    (None, {"ppo__num_envs": 0}, None, "ppo.num_envs"),
    ("no/such.yaml", {}, None, "not found"),
    (3, {}, None, "a YAML file's path, a dict"),
    (None, {"env__id": "visppo/DotReach-v0"}, DotReachEnv, "not both"),
    (None, {}, "visppo/DotReach-v0", "not callable"),
])
def test_bad_arguments_raise_one_config_error(config, overrides, env, match, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ConfigError, match=match):
        visppo.train(config, env=env, **overrides)
    assert not (tmp_path / "runs").exists()


def test_import_visppo_is_light_and_visppo_train_is_the_api_whatever_was_imported_first():
    code = ("import sys\n"
            "import visppo\n"
            "assert not {'torch', 'gymnasium', 'mujoco'} & set(sys.modules), sorted(sys.modules)\n"
            "import visppo.loop\n"  # the training loop's module first: the API's name is unchanged
            "from visppo.api import train\n"
            "assert visppo.train is train and visppo.load_policy.__module__ == 'visppo.deploy'\n")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=REPO)
    assert res.returncode == 0, res.stderr[-2000:]
