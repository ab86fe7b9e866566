"""Reach: move a planar two-link arm's fingertip onto a red target disc.

Seen from straight above (``assets/reach.xml``). The joints are heavily
damped, so an action works like a joint-velocity command: a random policy
wanders over the workspace and a policy can stop on the target without
having to brake. Built to be learnt by pixel PPO in a few hundred thousand
steps: big target, thick links, targets always within reach, dense reward.

- Action: 2 motor commands in [-1, 1] (shoulder, elbow).
- ``state`` (``obs_mode="pixels_state"``), float32[4]: shoulder angle
  (wrapped to [-pi, pi)), elbow angle, shoulder and elbow velocities (rad/s).
  Proprioception only: the target is seen in the pixels, not given.
- Reward per step: ``-distance / 0.24`` (0.24 m = the arm's reach) plus 1 while
  the fingertip centre is inside the target disc (radius 0.04 m).
- ``info``: ``is_success`` (fingertip inside the target now), ``distance``.
  Episodes are not ended on success; the time limit (100 steps = 4 s) ends them.
"""

from __future__ import annotations

from typing import Any

from ._gl import ensure_headless_gl

ensure_headless_gl()  # before mujoco is imported

import mujoco  # noqa: E402
import numpy as np  # noqa: E402

from ._mujoco_task import MujocoTask, sample_annulus, wrap_angle  # noqa: E402


class ReachEnv(MujocoTask):
    """Planar two-link arm reaching a random target, observed from above."""

    ASSET = "reach.xml"
    DEFAULT_FRAME_SKIP = 4  # 4 x 10 ms = 0.04 s per step
    ARM_REACH = 0.24  # fingertip centre at full extension, metres
    TARGET_RADIUS = 0.04  # must match the target geom in reach.xml
    # Target centres: inside the reach, clear of the base; the elbow's +-2.8 rad
    # limit lets the fingertip come within 0.04 m of the shoulder.
    TARGET_RING = (0.08, 0.21)

    def _reset_task(self) -> None:
        rng = self.np_random
        self.data.qpos[:] = [rng.uniform(-np.pi, np.pi), rng.uniform(-2.5, 2.5)]
        mujoco.mj_kinematics(self.model, self.data)
        tip = self._body_xy("fingertip")
        # Never start on (or right next to) the target: success must be earned.
        while True:
            target = sample_annulus(rng, *self.TARGET_RING)
            if np.linalg.norm(target - tip) > 3 * self.TARGET_RADIUS:
                break
        self.data.mocap_pos[0, :2] = target

    def _distance(self) -> float:
        return float(np.linalg.norm(self._body_xy("fingertip") - self.data.mocap_pos[0, :2]))

    def _reward(self) -> float:
        distance = self._distance()
        return -distance / self.ARM_REACH + float(distance < self.TARGET_RADIUS)

    def _info(self) -> dict[str, Any]:
        distance = self._distance()
        return {"is_success": bool(distance < self.TARGET_RADIUS), "distance": distance}

    def _state(self) -> np.ndarray:
        qpos = self.data.qpos.copy()
        qpos[0] = wrap_angle(qpos[0])
        return np.concatenate([qpos, self.data.qvel])
