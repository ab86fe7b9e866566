"""Reach: move a planar two-link arm's fingertip onto a red target disc.

Seen from straight above (``assets/reach.xml``). Built to be learnt by pixel
PPO in a few hundred thousand steps: a big target and thick links on a plain
floor, targets always within reach, a dense reward, and by default fingertip
velocity actions (see :class:`~visppo_envs._mujoco_task.PlanarArmTask`), so
"move toward the red disc" is the same action in every arm pose.

- Action, float32[2] in [-1, 1]: fingertip velocity x, y (``control=
  "cartesian"``, up to 0.5 m/s at 1: slower in poses where a joint would
  need more than its top speed, the direction kept) or shoulder and elbow
  motor commands (``control="joint"``).
- ``state`` (``obs_mode="pixels_state"``), float32[4]: shoulder angle (wrapped
  to [-pi, pi)), elbow angle, shoulder and elbow velocities (rad/s).
  Proprioception only: the target is seen in the pixels, not given.
- Reward per step: ``20 x`` the decrease in fingertip-target distance (metres)
  plus 0.1 while the fingertip centre is inside the target disc (radius
  0.04 m). The progress term rewards each action for what it did, which needs
  no accurate critic to learn from (unlike ``-distance``), and sums to 20x the
  distance covered (the fingertip starts 0.27 m from the target on average:
  about 5 per episode); staying on the target adds 0.1 a step, at most 10.
- ``info``: ``is_success`` (fingertip inside the target now), ``distance``.
  Episodes are not ended on success; the time limit (100 steps = 4 s) ends them.
"""

from __future__ import annotations

from typing import Any

from ._gl import ensure_headless_gl

ensure_headless_gl()  # before mujoco is imported

import mujoco  # noqa: E402
import numpy as np  # noqa: E402

from ._mujoco_task import PlanarArmTask, sample_annulus  # noqa: E402


class ReachEnv(PlanarArmTask):
    """Planar two-link arm reaching a random target, observed from above."""

    ASSET = "reach.xml"
    DEFAULT_FRAME_SKIP = 4  # 4 x 10 ms = 0.04 s per step
    TARGET_RADIUS = 0.04  # must match the target geom in reach.xml
    PROGRESS_SCALE = 20.0  # reward per metre the fingertip gets closer
    INSIDE_BONUS = 0.1  # reward per step on the target
    # Target centres: inside the 0.24 m reach, clear of the base (the elbow's
    # +-2.8 rad limit keeps the fingertip at least 0.04 m from the shoulder).
    TARGET_RING = (0.08, 0.21)

    _last_distance = 0.0  # fingertip-target distance after the previous step

    def _reset_task(self) -> None:
        self._sample_arm_pose()
        mujoco.mj_kinematics(self.model, self.data)
        tip = self._body_xy("fingertip")
        # Never start on (or right next to) the target: success must be earned.
        while True:
            target = sample_annulus(self.np_random, *self.TARGET_RING)
            if np.linalg.norm(target - tip) > 3 * self.TARGET_RADIUS:
                break
        self.data.mocap_pos[0, :2] = target
        self._last_distance = float(np.linalg.norm(target - tip))

    def _distance(self) -> float:
        return float(np.linalg.norm(self._body_xy("fingertip") - self.data.mocap_pos[0, :2]))

    def _reward(self) -> float:
        distance = self._distance()
        progress, self._last_distance = self._last_distance - distance, distance
        return self.PROGRESS_SCALE * progress + self.INSIDE_BONUS * (distance < self.TARGET_RADIUS)

    def _info(self) -> dict[str, Any]:
        distance = self._distance()
        return {"is_success": bool(distance < self.TARGET_RADIUS), "distance": distance}
