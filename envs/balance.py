"""Balance: keep a pole upright on a cart by pushing the cart along a rail.

A cart-pole seen from the side (``assets/balance.xml``). One frame shows the
pole's angle but not its angular velocity, so a pixel policy needs stacked
frames (``env.frame_stack`` >= 2) to solve it. With ``swingup=True`` the pole
starts hanging down and must first be swung up.

- Action: 1 cart force command in [-1, 1] (10 N at 1).
- ``state`` (``obs_mode="pixels_state"``), float32[4]: cart position (m),
  pole angle from upright (rad, wrapped to [-pi, pi)), cart velocity, pole
  angular velocity. This is the full physical state.
- Reward per step, in [0, 0.1]: ``0.1 x (1 + cos(angle)) / 2`` (upright) times
  ``(1 + centred) / 2`` where ``centred = max(0, 1 - (x / 0.8)^2)``. The 0.1
  keeps returns (at most 50) on the scale of Reach's and Push's, as visppo
  does not normalise rewards.
- ``info``: ``is_success`` (the pole has been within 0.2 rad (11 deg) of
  upright for each of the last 50 steps, i.e. one second), ``upright_steps``
  (length of that streak). No early termination; the time limit (500 steps =
  10 s) ends episodes.
"""

from __future__ import annotations

from typing import Any

from ._gl import ensure_headless_gl

ensure_headless_gl()  # before mujoco is imported

import numpy as np  # noqa: E402

from ._mujoco_task import MujocoTask, wrap_angle  # noqa: E402


class BalanceEnv(MujocoTask):
    """Cart-pole balance (or swing-up) from a side camera."""

    ASSET = "balance.xml"
    DEFAULT_FRAME_SKIP = 2  # 2 x 10 ms = 0.02 s per step
    RAIL_LIMIT = 0.8  # must match the slider range in balance.xml
    UPRIGHT_ANGLE = 0.2  # rad: "upright" for is_success
    SUCCESS_STEPS = 50  # consecutive upright steps for is_success (1 s)
    REWARD_SCALE = 0.1  # per-step reward for upright and centred
    # state bounds: x (rail +-0.8, soft limit), angle, cart and pole velocities
    STATE_HIGH = (1.0, np.pi, 10.0, 50.0)

    def __init__(
        self,
        image_size: int = 84,
        obs_mode: str = "pixels",
        render_mode: str | None = "rgb_array",
        frame_skip: int | None = None,
        swingup: bool = False,
    ) -> None:
        self.swingup = bool(swingup)
        self._upright_steps = 0
        super().__init__(image_size, obs_mode, render_mode, frame_skip)

    def _reset_task(self) -> None:
        rng = self.np_random
        if self.swingup:
            x, angle = rng.normal(0.0, 0.01), np.pi + rng.normal(0.0, 0.01)
        else:  # near upright: falls in about a second if nothing is done
            x, angle = rng.uniform(-0.1, 0.1), rng.uniform(-0.1, 0.1)
        self.data.qpos[:] = [x, angle]
        self.data.qvel[:] = rng.normal(0.0, 0.01, size=2)
        self._upright_steps = 0

    def _after_step(self) -> None:
        upright = abs(self._angle()) < self.UPRIGHT_ANGLE
        self._upright_steps = self._upright_steps + 1 if upright else 0

    def _angle(self) -> float:
        return float(wrap_angle(self.data.qpos[1]))

    def _reward(self) -> float:
        upright = (1.0 + np.cos(self.data.qpos[1])) / 2.0
        centred = max(0.0, 1.0 - (self.data.qpos[0] / self.RAIL_LIMIT) ** 2)
        return float(self.REWARD_SCALE * upright * (1.0 + centred) / 2.0)

    def _info(self) -> dict[str, Any]:
        return {
            "is_success": self._upright_steps >= self.SUCCESS_STEPS,
            "upright_steps": self._upright_steps,
        }

    def _state(self) -> np.ndarray:
        return np.array([self.data.qpos[0], self._angle(), self.data.qvel[0], self.data.qvel[1]])
