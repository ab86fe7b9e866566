"""Push: the planar arm pushes a red puck onto a green goal disc.

The arm, camera and look are Reach's (``assets/push.xml``), but only the
finger touches the puck (the links pass over it). The puck slides freely in
the plane and stops soon after it is let go (damped slide joints), so a policy
can nudge it step by step; a ring fence keeps it where the finger can always
get behind it.

- Action, float32[2] in [-1, 1]: fingertip velocity x, y (``control=
  "cartesian"``, the default, up to 0.5 m/s at 1) or shoulder and elbow motor
  commands (``control="joint"``); see :class:`~visppo_envs._mujoco_task.PlanarArmTask`.
- ``state`` (``obs_mode="pixels_state"``), float32[4]: shoulder angle
  (wrapped to [-pi, pi)), elbow angle, shoulder and elbow velocities (rad/s).
  Proprioception only: puck and goal are seen in the pixels, not given.
- Reward per step: ``10 x`` the decrease in the distance from the fingertip
  to the *pushing spot* (the point behind the puck, on the far side from the
  goal, where the finger touches the puck: ``puck - 0.06 m x unit(goal -
  puck)``, sliding to the puck centre as the puck gets within 0.05 m of the
  goal) plus ``20 x`` the decrease in puck-goal distance (metres), plus 0.1
  while the puck is on the goal. Progress terms (as in Reach) reward each
  action for what it did: the first brings the finger behind the puck, the
  second, weighted more, rewards moving the puck to the goal. Both are
  differences of a potential, so they shape learning without changing which
  behaviour is best. The first used to lead to the puck centre, which paid a
  finger for arriving from any side, including the goal's, where its next
  move pushes the puck away. The finger's distance to the spot is measured
  *around* the puck (the shortest path that keeps the finger's centre 0.06 m
  from the puck's, :func:`distance_around_disc`): measured in a straight line,
  a finger on the goal's side was 0.12 m from the spot, and every way round
  the puck first led away from it, so trained policies parked there (docs/learning.md).
- ``info``: ``is_success`` (puck centre within 0.05 m of the goal centre, i.e.
  on the goal disc), ``puck_to_goal``, ``tip_to_puck``, ``tip_to_spot``. No early termination;
  the time limit (200 steps = 8 s) ends episodes.
"""

from __future__ import annotations

from typing import Any

from ._gl import ensure_headless_gl

ensure_headless_gl()  # before mujoco is imported

import mujoco  # noqa: E402
import numpy as np  # noqa: E402

from ._mujoco_task import PlanarArmTask, sample_annulus  # noqa: E402


def distance_around_disc(a: np.ndarray, b: np.ndarray, centre: np.ndarray, radius: float) -> float:
    """Length of the shortest path from ``a`` to ``b`` that does not enter the disc.

    A straight line where it clears the disc; otherwise the two tangent segments
    and the arc between them (a point inside the disc counts as on its rim).
    Continuous in ``a`` and ``b``, so progress along it is a smooth reward.
    """
    ra, rb = (max(float(np.linalg.norm(p - centre)), radius) for p in (a, b))
    if radius <= 0.0 or _segment_clears_disc(a, b, centre, radius):
        return float(np.linalg.norm(a - b))
    va, vb = a - centre, b - centre
    cos = float(va @ vb) / max(float(np.linalg.norm(va) * np.linalg.norm(vb)), 1e-12)
    angle = float(np.arccos(np.clip(cos, -1.0, 1.0)))
    arc = angle - np.arccos(min(1.0, radius / ra)) - np.arccos(min(1.0, radius / rb))
    tangents = np.sqrt(ra**2 - radius**2) + np.sqrt(rb**2 - radius**2)
    return float(tangents + radius * max(arc, 0.0))


def _segment_clears_disc(a: np.ndarray, b: np.ndarray, centre: np.ndarray, radius: float) -> bool:
    """Whether the segment a-b stays outside the open disc."""
    ab = b - a
    t = float(np.clip((centre - a) @ ab / max(float(ab @ ab), 1e-12), 0.0, 1.0))
    return float(np.linalg.norm(a + t * ab - centre)) >= radius - 1e-12


class PushEnv(PlanarArmTask):
    """Planar two-link arm pushing a puck onto a goal, observed from above."""

    ASSET = "push.xml"
    DEFAULT_FRAME_SKIP = 4  # 4 x 10 ms = 0.04 s per step
    GOAL_RADIUS = 0.05  # must match the goal geom in push.xml
    TIP_PROGRESS_SCALE = 10.0  # reward per metre the finger gets closer to the pushing spot
    CONTACT_DISTANCE = 0.06  # puck radius 0.035 + finger radius 0.025 (push.xml)
    PUCK_PROGRESS_SCALE = 20.0  # reward per metre the puck gets closer to the goal
    ON_GOAL_BONUS = 0.1  # reward per step with the puck on the goal
    # Puck and goal centres, inside the fence (radius 0.185 m) where the finger
    # can get round the puck to push it in any direction (the finger reaches
    # from 0.02 m to 0.24 m from the shoulder).
    PUCK_RING = (0.07, 0.14)
    GOAL_RING = (0.05, 0.13)
    PUCK_TO_GOAL = (0.08, 0.20)  # start distance range, so every episode needs a push

    _last_distances = (0.0, 0.0)  # (tip_to_spot, puck_to_goal) after the previous step

    def _reset_task(self) -> None:
        rng = self.np_random
        puck = self._puck_qpos
        while True:  # rejection sampling: no finger-puck overlap, goal at a useful distance
            self._sample_arm_pose()
            self.data.qpos[puck] = sample_annulus(rng, *self.PUCK_RING)
            goal = sample_annulus(rng, *self.GOAL_RING)
            mujoco.mj_forward(self.model, self.data)
            gap = np.linalg.norm(goal - self.data.qpos[puck])
            if self.data.ncon == 0 and self.PUCK_TO_GOAL[0] <= gap <= self.PUCK_TO_GOAL[1]:
                break
        self.data.mocap_pos[0, :2] = goal
        self._last_distances = self._distances()

    @property
    def _puck_qpos(self) -> slice:
        start = int(self.model.joint("puck_x").qposadr[0])
        return slice(start, start + 2)

    def _pushing_spot(self) -> np.ndarray:
        """Where the finger touches the puck to push it straight at the goal."""
        puck = self._body_xy("puck")
        to_goal = self.data.mocap_pos[0, :2] - puck
        dist = float(np.linalg.norm(to_goal))
        # Near the goal the direction turns fast (and is undefined at the centre):
        # shrink the offset with the distance there, so the spot moves smoothly.
        offset = self.CONTACT_DISTANCE * min(1.0, dist / self.GOAL_RADIUS)
        return puck - offset * to_goal / max(dist, 1e-9)

    def _distances(self) -> tuple[float, float]:
        """(fingertip to pushing spot around the puck, puck to goal), metres."""
        puck = self._body_xy("puck")
        spot = self._pushing_spot()
        radius = min(self.CONTACT_DISTANCE, float(np.linalg.norm(spot - puck)))
        tip_to_spot = distance_around_disc(self._body_xy("fingertip"), spot, puck, radius)
        puck_to_goal = float(np.linalg.norm(self._body_xy("puck") - self.data.mocap_pos[0, :2]))
        return tip_to_spot, puck_to_goal

    def _reward(self) -> float:
        tip_to_spot, puck_to_goal = self._distances()
        last_tip_to_spot, last_puck_to_goal = self._last_distances
        self._last_distances = (tip_to_spot, puck_to_goal)
        return (
            self.TIP_PROGRESS_SCALE * (last_tip_to_spot - tip_to_spot)
            + self.PUCK_PROGRESS_SCALE * (last_puck_to_goal - puck_to_goal)
            + self.ON_GOAL_BONUS * (puck_to_goal < self.GOAL_RADIUS)
        )

    def _info(self) -> dict[str, Any]:
        tip_to_spot, puck_to_goal = self._distances()
        tip_to_puck = float(np.linalg.norm(self._body_xy("fingertip") - self._body_xy("puck")))
        return {
            "is_success": bool(puck_to_goal < self.GOAL_RADIUS),
            "puck_to_goal": puck_to_goal,
            "tip_to_puck": tip_to_puck,
            "tip_to_spot": tip_to_spot,
        }
