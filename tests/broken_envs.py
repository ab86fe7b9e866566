"""A user's env with one chosen defect, for the tests of visppo's env check (``env.id=broken_envs:Broken-v0``).

``env.kwargs.defect`` picks the defect and ``env.kwargs.at`` the step (counted over the env's life,
resets included) from which it shows; ``defect=none`` is a healthy 48x48 env with a 2-D Box action.
"""

from __future__ import annotations

import ctypes
import sys

import gymnasium as gym
import numpy as np

SIZE = 48
DEFECTS = (
    "none",
    # the constructor
    "init_raises", "init_exits", "init_typeerror",
    # spaces
    "obs_not_image", "obs_dict_no_pixels", "obs_float_pixels", "obs_state_not_box", "action_multidiscrete",
    "action_2x2", "action_int_box", "action_discrete_start", "action_multibinary", "action_not_a_space",
    "obs_not_a_space",
    # reset
    "reset_raises", "reset_not_tuple", "reset_obs_wrong_shape", "reset_obs_wrong_dtype", "reset_info_not_dict",
    "reset_state_nan",
    # step
    "step_raises", "step_not_tuple", "step_four_tuple", "step_reward_none", "step_reward_nan", "step_reward_inf",
    "step_reward_str", "step_reward_array", "step_obs_wrong_shape", "step_state_nan", "step_state_inf",
    "step_terminated_str", "step_info_not_dict", "step_success_str", "step_exits",
)
CRASHES = ("step_segfaults",)
"""Defects that end the process the env runs in (no exception to catch): only for a ``visppo train``
subprocess, never for an env stepped in the test's own process."""


class BrokenEnv(gym.Env):
    metadata = {"render_modes": []}

    def __init__(self, defect: str = "none", at: int = 0, state: bool = True):
        if defect not in DEFECTS + CRASHES:
            raise ValueError(f"unknown defect {defect}")
        self.defect, self.at, self.calls = defect, at, 0
        if self._now("init_raises"):
            raise RuntimeError("cannot reach the robot arm")
        if self._now("init_exits"):
            sys.exit(3)
        if self._now("init_typeerror"):  # a bug of its own, not an argument it refuses
            self.gain = None * 2
        pixels = gym.spaces.Box(0, 255, (SIZE, SIZE, 3), np.uint8)
        spaces = {"pixels": pixels, "state": gym.spaces.Box(-np.inf, np.inf, (3,), np.float32)}
        if defect == "obs_not_image":
            self.observation_space = gym.spaces.Box(-1, 1, (5,), np.float32)
        elif defect == "obs_dict_no_pixels":
            self.observation_space = gym.spaces.Dict({"image": pixels, "state": spaces["state"]})
        elif defect == "obs_float_pixels":
            self.observation_space = gym.spaces.Dict({**spaces, "pixels": gym.spaces.Box(0, 1, (SIZE, SIZE, 3))})
        elif defect == "obs_state_not_box":
            self.observation_space = gym.spaces.Dict({**spaces, "state": gym.spaces.Discrete(3)})
        elif defect == "obs_not_a_space":
            self.observation_space = {"pixels": (SIZE, SIZE, 3)}
        else:
            self.observation_space = gym.spaces.Dict(spaces)
        self.action_space = {
            "action_multidiscrete": gym.spaces.MultiDiscrete([3, 3]),
            "action_2x2": gym.spaces.Box(-1, 1, (2, 2), np.float32),
            "action_int_box": gym.spaces.Box(-1, 1, (2,), np.int64),
            "action_discrete_start": gym.spaces.Discrete(3, start=1),
            "action_multibinary": gym.spaces.MultiBinary(2),
            "action_not_a_space": "two floats",
        }.get(defect, gym.spaces.Box(-1, 1, (2,), np.float32))
        self.t = 0

    def _now(self, defect: str) -> bool:
        return self.defect == defect and self.calls >= self.at

    def _obs(self) -> dict:
        pixels = np.full((SIZE, SIZE, 3), 10 * (self.t % 20), np.uint8)
        state = np.array([self.t, 0.0, 1.0], np.float32)
        return {"pixels": pixels, "state": state}

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        self.t = 0
        now = self.calls >= self.at
        self.calls += 1
        obs = self._obs()
        if now and self.defect == "reset_raises":
            raise ValueError("the arm is not at home")
        if now and self.defect == "reset_not_tuple":
            return obs
        if now and self.defect == "reset_obs_wrong_shape":
            obs["pixels"] = np.zeros((SIZE // 2, SIZE, 3), np.uint8)
        if now and self.defect == "reset_obs_wrong_dtype":
            obs["pixels"] = obs["pixels"].astype(np.float64)
        if now and self.defect == "reset_state_nan":
            obs["state"][1] = np.nan
        if now and self.defect == "reset_info_not_dict":
            return obs, None
        return obs, {}

    def step(self, action):
        self.t += 1
        now = self.calls >= self.at
        self.calls += 1
        obs, reward, terminated, truncated, info = self._obs(), float(-abs(np.asarray(action)).sum()), False, self.t >= 20, {}
        if truncated:
            info["is_success"] = self.t % 2 == 0
        if not now:
            return obs, reward, terminated, truncated, info
        d = self.defect
        if d == "step_raises":
            raise RuntimeError("joint 3 over its torque limit")
        if d == "step_exits":
            sys.exit(3)
        if d == "step_segfaults":
            ctypes.string_at(0)  # reads address 0: SIGSEGV
        if d == "step_not_tuple":
            return obs
        if d == "step_four_tuple":
            return obs, reward, terminated, info
        if d == "step_reward_none":
            reward = None
        elif d == "step_reward_nan":
            reward = float("nan")
        elif d == "step_reward_inf":
            reward = float("inf")
        elif d == "step_reward_str":
            reward = "high"
        elif d == "step_reward_array":
            reward = np.ones(3)
        elif d == "step_obs_wrong_shape":
            obs["pixels"] = np.zeros((SIZE, SIZE // 2, 3), np.uint8)
        elif d == "step_state_nan":
            obs["state"][0] = np.nan
        elif d == "step_state_inf":
            obs["state"][0] = np.inf
        elif d == "step_terminated_str":
            terminated = "no"
        elif d == "step_info_not_dict":
            info = [1]
        elif d == "step_success_str":
            truncated, info = True, {"is_success": "yes"}
        return obs, reward, terminated, truncated, info


gym.register(id="Broken-v0", entry_point="broken_envs:BrokenEnv", max_episode_steps=200)
gym.register(id="BrokenUnchecked-v0", entry_point="broken_envs:BrokenEnv", max_episode_steps=200,
             disable_env_checker=True)  # without gymnasium's passive checker: visppo's own checks alone
