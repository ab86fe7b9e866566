"""DotReach: move a red dot onto a green target, seen as an RGB image.

A synthetic pixel task drawn with numpy, no MuJoCo: it steps at tens of
thousands of frames per second, so tests and the quickstart train a real
pixel policy on a CPU in little time. Episodes have a fixed length (the
registered time limit) and never terminate early, which makes rollouts of a
length that divides it start on fresh episodes every iteration.
"""

from __future__ import annotations

import gymnasium as gym
import numpy as np

_MOVES = np.array([[0, 0], [0, -1], [0, 1], [-1, 0], [1, 0]], dtype=np.float32)  # stay, up, down, left, right


class DotReachEnv(gym.Env):
    """Reward: 10x the decrease in distance to the target, +0.1 per step inside it.

    Args:
        image_size: side of the square RGB frame.
        obs_mode: "pixels" (uint8 HxWx3) or "pixels_state" (adds the dot's
            position and the last move as a float vector).
        discrete: 5 discrete moves instead of a 2-D continuous action in [-1, 1].
        speed: distance one unit action moves the dot, in units of the arena side.
        radius: success radius, in units of the arena side.
    """

    metadata = {"render_modes": ["rgb_array"], "render_fps": 20}

    def __init__(self, image_size: int = 64, obs_mode: str = "pixels", discrete: bool = False,
                 speed: float = 0.12, radius: float = 0.12, render_mode: str | None = "rgb_array"):
        if obs_mode not in ("pixels", "pixels_state"):
            raise ValueError(f"obs_mode must be pixels or pixels_state, got {obs_mode!r}")
        self.size, self.obs_mode, self.discrete = image_size, obs_mode, discrete
        self.speed, self.radius, self.render_mode = speed, radius, render_mode
        pixels = gym.spaces.Box(0, 255, (image_size, image_size, 3), np.uint8)
        if obs_mode == "pixels":
            self.observation_space = pixels
        else:
            state = gym.spaces.Box(-1.0, 1.0, (4,), np.float32)  # dot position, last move
            self.observation_space = gym.spaces.Dict({"pixels": pixels, "state": state})
        self.action_space = (gym.spaces.Discrete(5) if discrete
                             else gym.spaces.Box(-1.0, 1.0, (2,), np.float32))
        grid = (np.arange(image_size, dtype=np.float32) + 0.5) / image_size
        self._yy, self._xx = np.meshgrid(grid, grid, indexing="ij")
        self.dot = np.zeros(2, np.float32)
        self.target = np.zeros(2, np.float32)
        self.last_move = np.zeros(2, np.float32)

    def reset(self, *, seed: int | None = None, options: dict | None = None):
        super().reset(seed=seed)
        self.dot = self.np_random.uniform(0.1, 0.9, 2).astype(np.float32)
        self.target = self.np_random.uniform(0.15, 0.85, 2).astype(np.float32)
        self.last_move = np.zeros(2, np.float32)
        return self._obs(), {"is_success": self._inside()}

    def step(self, action):
        if self.discrete:
            move = _MOVES[int(action)]
        else:
            move = np.asarray(action, dtype=np.float32).reshape(2)
            # as MuJoCo does with a non-finite control: NaN moves nothing (and must not stay in the
            # dot's position for the rest of the episode); inf is clipped like any large action
            move = np.clip(np.nan_to_num(move, nan=0.0, posinf=1.0, neginf=-1.0), -1.0, 1.0)
        before = self._distance()
        self.dot = np.clip(self.dot + self.speed * move, 0.0, 1.0).astype(np.float32)
        self.last_move = move.astype(np.float32)
        inside = self._inside()
        reward = 10.0 * (before - self._distance()) + (0.1 if inside else 0.0)
        return self._obs(), float(reward), False, False, {"is_success": inside}

    def render(self) -> np.ndarray:
        img = np.full((self.size, self.size, 3), 30, np.uint8)
        for centre, colour, r in ((self.target, (40, 220, 60), self.radius),
                                  (self.dot, (230, 40, 40), 0.05)):
            mask = (self._xx - centre[0]) ** 2 + (self._yy - centre[1]) ** 2 <= r * r
            img[mask] = colour
        return img

    def _distance(self) -> float:
        return float(np.linalg.norm(self.dot - self.target))

    def _inside(self) -> bool:
        return self._distance() <= self.radius

    def _obs(self):
        pixels = self.render()
        if self.obs_mode == "pixels":
            return pixels
        return {"pixels": pixels, "state": np.concatenate([self.dot, self.last_move]).astype(np.float32)}
