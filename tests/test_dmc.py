"""DeepMind Control Suite from pixels (``visppo_envs.dmc``).

The wrapper's logic (ids, spaces, action scaling, action repeat, 1000-frame episodes, seeding,
the two looks) is tested on a fake suite env built on a tiny MuJoCo model, so it runs without
dm_control; the tests at the end load real suite tasks and skip where dm_control is missing
(CI installs only ``.[test]``; ``pip install -e ".[dmc]"`` runs them).
"""

from __future__ import annotations

import sys
import warnings
from types import SimpleNamespace
from typing import NamedTuple

import gymnasium as gym
import mujoco
import numpy as np
import pytest
from conftest import train_short
from gymnasium.utils.env_checker import check_env

from visppo import envs as envs_module
from visppo.config import load_config
from visppo.envs import check_env_id, make_env, preload_before_gl
from visppo.errors import ConfigError
from visppo.evaluate import run_episode
from visppo.video import video_fps

# Importing visppo_envs.dmc imports dm_control (where installed), which opens an EGL display and
# so loads Mesa's LLVM; torch's compiler stack must be loaded first (see preload_before_gl).
preload_before_gl()
from visppo_envs import dmc  # noqa: E402
from visppo_envs.dmc import DMCEnv  # noqa: E402

BALL_XML = """
<mujoco>
  <asset><texture name="sky" type="skybox" builtin="gradient" rgb1=".4 .6 .8" rgb2="0 0 0" width="32" height="32"/></asset>
  <worldbody>
    <light pos="0 0 3" dir="0 0 -1" castshadow="true"/>
    <camera name="side" pos="0 -1.6 0.5" xyaxes="1 0 0 0 0.3 1"/>
    <camera name="top" pos="0 0 2" xyaxes="1 0 0 0 1 0"/>
    <geom type="plane" size="1 1 0.1" rgba=".5 .5 .5 1"/>
    <body name="ball" pos="0 0 0.1">
      <joint name="x" type="slide" axis="1 0 0" damping="1"/>
      <geom type="sphere" size="0.1" rgba="1 0 0 1"/>
    </body>
  </worldbody>
  <actuator><motor joint="x" gear="5" ctrlrange="-2 2"/></actuator>
</mujoco>
"""


class TimeStep(NamedTuple):
    step_type: int  # 0 first, 1 mid, 2 last (dm_env.StepType)
    reward: float | None
    discount: float | None
    observation: dict

    def last(self) -> bool:
        return self.step_type == 2


class FakeSuiteEnv:
    """The part of a dm_control suite env the wrapper uses: reward 1 per step, ends after ``limit``."""

    def __init__(self, limit: int = 10_000, terminate_at: int | None = None):
        self.model = mujoco.MjModel.from_xml_string(BALL_XML)
        self.data = mujoco.MjData(self.model)
        self.physics = SimpleNamespace(model=SimpleNamespace(ptr=self.model), data=SimpleNamespace(ptr=self.data))
        self.task = SimpleNamespace(_random=np.random.RandomState(0))
        self.limit, self.terminate_at, self.t = limit, terminate_at, 0
        self.actions: list[np.ndarray] = []

    def action_spec(self):
        return SimpleNamespace(shape=(1,), minimum=np.array([-2.0]), maximum=np.array([2.0]))

    def observation_spec(self):
        return {"position": SimpleNamespace(shape=(1,)), "velocity": SimpleNamespace(shape=())}

    def control_timestep(self) -> float:
        return 0.01

    def reset(self) -> TimeStep:
        mujoco.mj_resetData(self.model, self.data)
        self.data.qpos[0] = self.task._random.uniform(-0.5, 0.5)
        mujoco.mj_forward(self.model, self.data)
        self.t = 0
        return TimeStep(0, None, None, self._obs())

    def step(self, action) -> TimeStep:
        self.actions.append(np.array(action))
        self.data.ctrl[:] = action
        mujoco.mj_step(self.model, self.data)
        self.t += 1
        terminal = self.t == self.terminate_at
        last = terminal or self.t >= self.limit
        return TimeStep(2 if last else 1, 1.0, 0.0 if terminal else 1.0, self._obs())

    def _obs(self) -> dict:
        return {"position": self.data.qpos.copy(), "velocity": float(self.data.qvel[0])}

    def close(self) -> None:
        pass


def fake_env(**kwargs) -> DMCEnv:
    fake_kwargs = {k: kwargs.pop(k) for k in ("limit", "terminate_at") if k in kwargs}
    return DMCEnv("fake", "ball", environment=FakeSuiteEnv(**fake_kwargs), **kwargs)


# ------------------------------------------------------------------ ids


@pytest.mark.parametrize("alias, registered", [
    ("dmc:cartpole-balance", "dmc/cartpole-balance-v0"),
    ("dmc:ball_in_cup-catch", "dmc/ball_in_cup-catch-v0"),
    ("dmc:cartpole-swingup_sparse", "dmc/cartpole-swingup_sparse-v0"),
    ("dmc/walker-walk-v0", "dmc/walker-walk-v0"),
])
def test_dmc_aliases_map_to_registered_ids(alias, registered):
    assert dmc.is_dmc_id(alias) and dmc.gym_id(alias) == registered


@pytest.mark.parametrize("bad", ["dmc:cartpole", "dmc:-balance", "dmc:"])
def test_a_dmc_id_without_domain_and_task_is_refused(bad):
    with pytest.raises(ValueError, match="domain and a task"):
        dmc.gym_id(bad)
    with pytest.raises(ConfigError, match=r"dmc:<domain>-<task>"):
        check_env_id(bad)


def test_without_dm_control_a_dmc_id_names_the_extra_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "dm_control", None)  # import dm_control now raises ImportError
    with pytest.raises(ConfigError, match=r'pip install -e "\.\[dmc\]"'):
        check_env_id("dmc:cartpole-balance")
    with pytest.raises(ConfigError, match="DeepMind Control"):
        make_env(load_config(None, ["env.id=dmc:cartpole-balance"]))


# ------------------------------------------------------------------ the wrapper, on a fake suite env


def test_the_wrapper_passes_gymnasium_check_env():
    for obs_mode in ("pixels", "pixels_state"):
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            warnings.filterwarnings("ignore", message=".*infinity")  # the suite's state is unbounded
            check_env(fake_env(obs_mode=obs_mode, image_size=48), skip_render_check=True)  # no spec


def test_spaces_are_frames_actions_in_unit_box_and_the_flattened_state():
    env = fake_env(obs_mode="pixels_state", image_size=48)
    assert env.action_space == gym.spaces.Box(-1, 1, (1,), np.float32)
    assert env.observation_space["pixels"] == gym.spaces.Box(0, 255, (48, 48, 3), np.uint8)
    assert env.observation_space["state"].shape == (2,)  # position (1,) + velocity ()
    obs, info = env.reset(seed=0)
    assert obs["pixels"].shape == (48, 48, 3) and obs["state"].dtype == np.float32
    assert info == {} and "is_success" not in env.step(np.zeros(1))[4]  # the suite has no success


def test_actions_in_unit_box_are_scaled_to_the_tasks_bounds():
    env = fake_env(image_size=36)
    env.reset(seed=0)
    for a in (-1.0, 0.0, 0.5, 1.0, 3.0):
        env.step(np.array([a], np.float32))
    assert np.allclose(np.concatenate(env._env.actions), [-2.0, 0.0, 1.0, 2.0, 2.0])  # clipped, then scaled


@pytest.mark.parametrize("repeat, agent_steps", [(1, 20), (2, 10), (3, 7), (8, 3)])
def test_an_episode_is_its_frames_whatever_the_action_repeat(repeat, agent_steps):
    """20 suite steps: agent steps = ceil(20 / repeat), the last one cut short; return = sum over frames."""
    env = fake_env(image_size=36, action_repeat=repeat, episode_frames=20)
    env.reset(seed=0)
    total, steps, truncated = 0.0, 0, False
    while not truncated:
        _, reward, terminated, truncated, _ = env.step(np.zeros(1))
        total, steps = total + reward, steps + 1
        assert not terminated
    assert (steps, env.frames, total, len(env._env.actions)) == (agent_steps, 20, 20.0, 20)


def test_the_suites_own_last_step_ends_the_episode_as_truncation_or_termination():
    env = fake_env(image_size=36, limit=5)
    env.reset(seed=0)
    results = [env.step(np.zeros(1))[2:4] for _ in range(5)]
    assert results[-1] == (False, True) and all(r == (False, False) for r in results[:-1])
    env = fake_env(image_size=36, terminate_at=3, action_repeat=2)
    env.reset(seed=0)
    assert env.step(np.zeros(1))[2:4] == (False, False)
    assert env.step(np.zeros(1))[2:4] == (True, False) and env.frames == 3  # discount 0: terminal


def test_reset_seeds_the_tasks_initial_state():
    env = fake_env(image_size=48)
    first = [env.reset(seed=s)[0] for s in (1, 1, 2)]
    assert np.array_equal(first[0], first[1]) and not np.array_equal(first[0], first[2])


def test_distinct_reset_seeds_give_the_task_distinct_random_streams():
    """Training's and evaluation's reset seeds are disjoint (visppo.seeding); the task's own
    RandomState must not fold them together. Before, it took 31 bits of each: training seed
    1296320671 and evaluation seed 4159548789 drew the same initial state."""
    env = fake_env(image_size=48)
    streams = []
    for seed in (1296320671, 4159548789, 1296320671):
        env.reset(seed=seed)
        streams.append(env._env.task._random.randint(2**31, size=8))
    assert not np.array_equal(streams[0], streams[1]) and np.array_equal(streams[0], streams[2])


def test_the_fast_look_drops_shadows_reflections_and_skybox():
    published, fast = fake_env(image_size=48), fake_env(image_size=48, look="fast")
    a, b = published.reset(seed=0)[0], fast.reset(seed=0)[0]
    flags = fast._renderers[(48, 48, "fast")].scene.flags
    assert [flags[f] for f in dmc.FAST_OFF] == [0, 0, 0]
    assert [published._renderers[(48, 48, "published")].scene.flags[f] for f in dmc.FAST_OFF] == [1, 1, 1]
    assert a.shape == b.shape and not np.array_equal(a, b)
    assert b[:4].max() == 0 and a[:4].mean() > 20  # no skybox: the sky above the floor is black


def test_frames_larger_than_the_models_offscreen_buffer_render():
    """The fake's MJCF keeps MuJoCo's 640x480 offscreen buffer: a 640x640 camera and side view
    render all the same (the same scene as at half size), and the model's buffer is left as it was."""
    env = fake_env(image_size=640)
    obs, _ = env.reset(seed=0)
    view = env.render_view(width=640, height=640)
    assert obs.shape == view.shape == (640, 640, 3) and np.array_equal(view, obs)
    half = env.render_view(width=320, height=320).astype(float)
    assert np.abs(view.reshape(320, 2, 320, 2, 3).mean(axis=(1, 3)) - half).mean() < 1 < half.std()
    buffer = env.model.vis.global_
    assert (buffer.offwidth, buffer.offheight) == (640, 480)
    with pytest.raises(ValueError, match=r"cannot render 100000x64 frames .*: ask for a smaller size"):
        env.render_view(width=100_000, height=64)
    assert env.render_view(width=48, height=40).shape == (40, 48, 3)  # a failed size leaves nothing behind
    env.close()


def test_a_gl_that_cannot_render_at_all_is_not_blamed_on_the_size(monkeypatch):
    """A missing or broken OpenGL fails at any size: the message names MUJOCO_GL, not the size."""
    env = fake_env()
    env.reset(seed=0)

    def no_gl(*args, **kwargs):
        raise mujoco.FatalError("an OpenGL platform library has not been loaded into this process")

    monkeypatch.setattr(mujoco, "Renderer", no_gl)
    monkeypatch.setenv("MUJOCO_GL", "glfw")
    with pytest.raises(ValueError, match=r"cannot render with this OpenGL \(MUJOCO_GL=glfw: .*set MUJOCO_GL=egl") as info:
        env.render_view(width=48, height=40)
    assert "smaller size" not in str(info.value)
    monkeypatch.setenv("MUJOCO_GL", "egl")  # already EGL: what it needs, or osmesa
    with pytest.raises(ValueError, match=r"MUJOCO_GL=egl: .*EGL needs libEGL .*MUJOCO_GL=osmesa"):
        env.render_view(width=48, height=40)
    with pytest.raises(ValueError, match=r"cannot render 100000x64 frames .*: ask for a smaller size"):
        env.render_view(width=100_000, height=64)
    env.close()


def test_camera_by_index_or_name_and_bad_ones_refused():
    assert fake_env().camera == 0 and fake_env(camera="top").camera == 1 and fake_env(camera="1").camera == 1
    with pytest.raises(ValueError, match="no camera named"):
        fake_env(camera="nope")
    with pytest.raises(ValueError, match="out of range"):
        fake_env(camera=2)
    with pytest.raises(ValueError, match="look must be"):
        fake_env(look="pretty")


# ------------------------------------------------------------------ through visppo, on the fake


@pytest.fixture
def fake_suite(monkeypatch):
    """``dmc:fake-ball`` registered as if dm_control were there, its env the fake."""
    def register_suite():
        if "dmc/fake-ball-v0" not in gym.registry:
            gym.register("dmc/fake-ball-v0", entry_point="visppo_envs.dmc:DMCEnv",
                         kwargs={"domain": "fake", "task": "ball"})
        return ["dmc/fake-ball-v0"]

    made: list[FakeSuiteEnv] = []

    def load(domain, task, task_kwargs):
        made.append(FakeSuiteEnv(limit=10_000))
        return made[-1]

    monkeypatch.setattr(dmc, "register_suite", register_suite)
    monkeypatch.setattr(dmc, "_load", load)
    yield made
    gym.registry.pop("dmc/fake-ball-v0", None)


class ZeroPolicy:
    """What run_episode needs of a policy: act() -> (action batch, _, _)."""

    def act(self, batch, deterministic=False):
        import torch

        return torch.zeros(1, 1), None, None


def test_visppo_gives_the_env_the_action_repeat_and_a_1000_frame_episode(fake_suite):
    cfg = load_config(None, ["env.id=dmc:fake-ball", "env.action_repeat=2", "env.frame_stack=3",
                             "env.image_size=36", "env.kwargs.look=fast"])
    check_env_id(cfg.env.id)
    env = make_env(cfg)
    assert env.observation_space["pixels"].shape == (9, 36, 36)
    assert not any(isinstance(w, envs_module.ActionRepeat) for w in _wrappers(env))  # the env repeats
    total, length, success = run_episode(env, ZeroPolicy(), seed=0, deterministic=True, device="cpu")
    assert (length, total, success) == (500, 1000.0, None)  # `visppo eval`'s return: 1000 frames of reward 1
    assert len(fake_suite[-1].actions) == 1000 and env.unwrapped.action_repeat == 2
    assert env.unwrapped.metadata["render_fps"] == 50  # one frame per agent step: 2 x 0.01 s
    assert video_fps(env, cfg.env.action_repeat) == 50  # evaluation videos play in real time


def test_max_episode_steps_counts_frames_for_dmc(fake_suite):
    cfg = load_config(None, ["env.id=dmc:fake-ball", "env.action_repeat=4", "env.max_episode_steps=10",
                             "env.image_size=36"])
    total, length, _ = run_episode(make_env(cfg), ZeroPolicy(), seed=0, deterministic=True, device="cpu")
    assert (length, total) == (3, 10.0)


def test_an_unknown_suite_task_lists_the_domains_tasks(fake_suite):
    with pytest.raises(ConfigError, match=r"no such task \(its fake tasks: fake-ball\)"):
        check_env_id("dmc:fake-bowl")
    with pytest.raises(ConfigError, match=r"domains: .*\bfake\b"):
        check_env_id("dmc:cartpol-balance")


def test_render_samples_and_camera_reach_the_dmc_env(fake_suite):
    cfg = load_config(None, ["env.id=dmc:fake-ball", "env.render_samples=0", "env.camera=top",
                             "env.image_size=36", "env.kwargs.look=fast"])
    env = make_env(cfg)
    assert env.unwrapped.model.vis.quality.offsamples == 0
    assert env.unwrapped.camera == 1 and env.unwrapped.look == "fast"
    with pytest.raises(ConfigError, match="no camera named"):
        make_env(load_config(None, ["env.id=dmc:fake-ball", "env.camera=nope"]))


def _wrappers(env):
    while isinstance(env, gym.Wrapper):
        yield env
        env = env.env


# ------------------------------------------------------------------ real suite tasks (dm_control)


@pytest.fixture
def suite():
    pytest.importorskip("dm_control", reason='needs pip install -e ".[dmc]"')
    dmc.register_suite()


def test_the_published_tasks_are_registered(suite):
    for name in ("cartpole-balance", "cartpole-swingup", "reacher-easy", "finger-spin", "walker-walk",
                 "cheetah-run"):
        check_env_id(f"dmc:{name}")
        assert f"dmc/{name}-v0" in gym.registry


def test_an_actuator_without_a_control_range_takes_the_action_unscaled(suite):
    """lqr's actuators report MuJoCo's +-1e10 as bounds: scaled onto them, 0.1 pushed with 1e9."""
    env = dmc.DMCEnv("lqr", "lqr_2_1", image_size=32)
    env.reset(seed=0)
    env.step(np.full(env.action_space.shape, 0.1, np.float32))
    assert np.allclose(env._env.physics.data.ctrl, 0.1)
    env.close()


def test_the_published_look_is_dm_controls_own_render(suite):
    env = gym.make("dmc/cartpole-swingup-v0").unwrapped
    frame, _ = env.reset(seed=0)
    assert frame.shape == (84, 84, 3) and env.camera == 0
    assert np.array_equal(frame, env._env.physics.render(84, 84, camera_id=0))
    env.close()


def test_a_suite_episode_is_1000_frames_and_returns_their_reward_sum(suite):
    """Constant actions at repeat 2 and at repeat 1 see the same 1000 frames: the same return."""
    base = ["env.id=dmc:cartpole-swingup", "env.image_size=36", "env.kwargs.look=fast"]
    results = []
    for repeat in (1, 2):
        env = make_env(load_config(None, [*base, f"env.action_repeat={repeat}"]))
        obs, _ = env.reset(seed=3)
        total, steps, done = 0.0, 0, False
        while not done:
            obs, reward, terminated, truncated, info = env.step(np.array([0.3], np.float32))
            total, steps, done = total + reward, steps + 1, terminated or truncated
        results.append((steps, env.unwrapped.frames, round(total, 6), terminated, "is_success" in info))
        env.close()
    assert results[0][1:] == results[1][1:] and results[1][:2] == (500, 1000)
    assert results[0][0] == 1000 and results[0][3:] == (False, False)


def test_quadruped_looks_through_camera_2_as_drq_v2(suite):
    env = gym.make("dmc/quadruped-walk-v0").unwrapped
    assert env.camera == 2 and env.action_space.shape == (12,)
    env.close()


# ------------------------------------------- short training runs (pytest -m slow)
# The random policy's return per task, fast look, 10 episodes (`python tools/baselines.py
# configs/dmc_<task>.yaml env.kwargs.look=fast`). A zero action earns 756 on cartpole-balance (the
# unpushed pole swings all the way round and lingers near the top), 22 on walker-walk, about 0 on the others.
RANDOM_RETURN = {
    "cartpole_balance": 346, "cartpole_swingup": 46, "reacher_easy": 32,
    "finger_spin": 0.8, "walker_walk": 37, "cheetah_run": 7.2,
}


@pytest.mark.slow
@pytest.mark.timeout(1800)
@pytest.mark.parametrize("task, steps, above", [
    ("cartpole_swingup", 51_200, 30), ("reacher_easy", 51_200, 30), ("cheetah_run", 51_200, 5),
    ("finger_spin", 102_400, 30), ("walker_walk", 61_440, 10), ("cartpole_balance", 256_000, 50),
])
def test_dmc_training_rises_above_random(suite, task, steps, above, tmp_path):
    """``configs/dmc_<task>.yaml`` on the fast look, seed 1: the training return (mean of the last
    100 episodes) ends at least ``above`` over the random policy's. Margins sit below what the
    per-task configs of 2026-11 reached at that budget (docs/dmc.md). cartpole-balance needs the longest: its
    training return passes the random policy's only from about 60k steps (docs/dmc.md)."""
    returns = train_short(f"dmc_{task}.yaml", steps, tmp_path, ("env.kwargs.look=fast",))
    assert returns[-1] > RANDOM_RETURN[task] + above, returns[-5:]
