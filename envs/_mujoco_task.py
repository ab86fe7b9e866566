"""Shared machinery for visppo's MuJoCo camera tasks.

A task subclasses :class:`MujocoTask`, names its MJCF file in ``assets/`` and
implements four small hooks (``_reset_task``, ``_reward``, ``_info`` and
``_state``; ``_after_step`` is optional). Everything that is the same for every task lives here: loading
the model from the installed package, stepping the physics, one lazily created
``mujoco.Renderer`` per image size (of any size: :func:`new_renderer`), and assembling ``"pixels"`` or
``"pixels_state"`` observations.

A task with a ``"pixels_state"`` mode also sets ``STATE_HIGH``, the bound of
each state entry: the state space is ``Box(-STATE_HIGH, STATE_HIGH)`` and the
state is clipped into it (the bounds are chosen not to bind in practice).

Each MJCF file must define two cameras: ``policy`` (the fixed camera the
policy sees, framing the workspace closely) and ``view`` (a wider third-person
camera for evaluation videos), and actuators with ``ctrlrange="-1 1"``.
"""

from __future__ import annotations

import os
from abc import ABC, abstractmethod
from importlib import resources
from typing import Any, ClassVar

import numpy as np

from ._gl import ensure_headless_gl

ensure_headless_gl()

import gymnasium as gym  # noqa: E402
import mujoco  # noqa: E402
from gymnasium import spaces  # noqa: E402

OBS_MODES = ("pixels", "pixels_state")
POLICY_CAMERA = "policy"
VIEW_CAMERA = "view"


def load_model(asset: str) -> mujoco.MjModel:
    """Compile ``assets/<asset>`` from this package.

    Reading through ``importlib.resources`` (rather than a path relative to the
    repository) keeps this working from a wheel or a zipped install; the MJCF
    files use only builtin textures so the XML string is self-contained.
    """
    xml = resources.files(__package__).joinpath("assets", asset).read_text(encoding="utf-8")
    return mujoco.MjModel.from_xml_string(xml)


def new_renderer(model: mujoco.MjModel, height: int, width: int) -> mujoco.Renderer:
    """A ``mujoco.Renderer`` of ``height`` x ``width`` whatever the model's offscreen buffer size.

    MuJoCo refuses frames larger than that buffer (640x480 unless the MJCF sets ``<visual><global
    offwidth offheight>``), and videos ask for larger side views, so the buffer is grown while the
    renderer is made (its GL context reads the size then) and set back after: no other renderer of
    the model (dm_control's own included) gets a larger buffer, nor one a failed size left behind.
    """
    size = model.vis.global_
    before = int(size.offwidth), int(size.offheight)
    size.offwidth, size.offheight = max(before[0], int(width)), max(before[1], int(height))
    try:
        return mujoco.Renderer(model, int(height), int(width))
    except mujoco.FatalError as exc:
        if int(width) <= before[0] and int(height) <= before[1]:  # the model's own buffer: not the size
            gl = os.environ.get("MUJOCO_GL", "")
            hint = ("EGL needs libEGL and a GPU driver or Mesa: install them, or set MUJOCO_GL=osmesa"
                    if gl == "egl" else "set MUJOCO_GL=egl (headless, a GPU or Mesa) or MUJOCO_GL=osmesa, "
                    "or give glfw a DISPLAY")
            raise ValueError(f"cannot render with this OpenGL (MUJOCO_GL={gl or 'unset'}: {exc}): {hint}") from None
        raise ValueError(f"cannot render {width}x{height} frames with this OpenGL ({exc}): ask for a "
                         "smaller size") from None  # e.g. a side longer than the GL's largest framebuffer
    finally:
        size.offwidth, size.offheight = before


def wrap_angle(angle: np.ndarray | float) -> np.ndarray:
    """Map angles to [-pi, pi) so unlimited hinges give bounded state values."""
    return (np.asarray(angle) + np.pi) % (2 * np.pi) - np.pi


class MujocoTask(gym.Env, ABC):
    """A MuJoCo task observed through the MJCF camera ``policy``.

    Args:
        image_size: side of the square policy image, in pixels.
        obs_mode: ``"pixels"`` (observation is the uint8 ``(H, W, 3)`` frame) or
            ``"pixels_state"`` (``{"pixels": frame, "state": float32 vector}``;
            each task module's docstring gives the vector's layout).
        render_mode: ``"rgb_array"`` (``render()`` returns the policy's frame)
            or ``None``.
        frame_skip: physics steps per env step; ``None`` uses the task's
            ``DEFAULT_FRAME_SKIP``.

    Episodes end when gymnasium's ``TimeLimit`` (set at registration)
    truncates them, or earlier where a task's ``_terminated`` says so (Balance
    ends an episode once the pole has fallen).
    """

    metadata = {"render_modes": ["rgb_array"], "render_fps": 25}  # fps set per instance
    ASSET: ClassVar[str]
    DEFAULT_FRAME_SKIP: ClassVar[int] = 4
    STATE_HIGH: ClassVar[tuple[float, ...]]

    def __init__(
        self,
        image_size: int = 84,
        obs_mode: str = "pixels",
        render_mode: str | None = "rgb_array",
        frame_skip: int | None = None,
    ) -> None:
        if obs_mode not in OBS_MODES:
            raise ValueError(f"obs_mode must be one of {OBS_MODES}, got {obs_mode!r}")
        if render_mode not in (None, *self.metadata["render_modes"]):
            raise ValueError(f"unsupported render_mode {render_mode!r}")
        if int(image_size) < 1:
            raise ValueError(f"image_size must be positive, got {image_size}")
        self.image_size = int(image_size)
        self.obs_mode = obs_mode
        self.render_mode = render_mode
        self.frame_skip = self.DEFAULT_FRAME_SKIP if frame_skip is None else int(frame_skip)
        if self.frame_skip < 1:
            raise ValueError(f"frame_skip must be >= 1, got {frame_skip}")

        self.model = load_model(self.ASSET)
        self.data = mujoco.MjData(self.model)
        for cam in (POLICY_CAMERA, VIEW_CAMERA):
            if mujoco.mj_name2id(self.model, mujoco.mjtObj.mjOBJ_CAMERA, cam) < 0:
                raise ValueError(f"{self.ASSET} has no camera named {cam!r}")
        self.dt = self.model.opt.timestep * self.frame_skip
        # Per instance: the playback rate depends on frame_skip.
        self.metadata = {**type(self).metadata, "render_fps": int(round(1.0 / self.dt))}

        self.action_space = spaces.Box(-1.0, 1.0, (self.model.nu,), np.float32)
        pixels = spaces.Box(0, 255, (self.image_size, self.image_size, 3), np.uint8)
        if obs_mode == "pixels":
            self.observation_space: spaces.Space = pixels
        else:
            high = np.asarray(self.STATE_HIGH, dtype=np.float32)
            mujoco.mj_forward(self.model, self.data)
            if self._state().shape != high.shape:
                raise ValueError(f"{type(self).__name__}.STATE_HIGH does not match _state()")
            state = spaces.Box(-high, high, dtype=np.float32)
            self.observation_space = spaces.Dict({"pixels": pixels, "state": state})

        self._renderers: dict[tuple[int, int], mujoco.Renderer] = {}
        self._frame: np.ndarray | None = None  # last policy frame, returned by render()

    # ------------------------------------------------------------------ hooks
    @abstractmethod
    def _reset_task(self) -> None:
        """Randomise ``self.data`` (qpos, qvel, mocap) with ``self.np_random``."""

    def _after_step(self) -> None:
        """Update per-episode bookkeeping after the physics step (optional)."""

    @abstractmethod
    def _reward(self) -> float:
        """Dense reward for the state reached by the last step."""

    @abstractmethod
    def _info(self) -> dict[str, Any]:
        """Step info; must contain ``is_success`` (a Python bool)."""

    @abstractmethod
    def _state(self) -> np.ndarray:
        """Low-dimensional state for ``obs_mode="pixels_state"``."""

    def _terminated(self) -> bool:
        """Whether the state reached ends the episode (optional; never by default)."""
        return False

    def _apply_action(self, action: np.ndarray) -> None:
        """Turn an action (already clipped to [-1, 1]) into ``data.ctrl``."""
        self.data.ctrl[:] = action

    # ------------------------------------------------------------- gym API
    def reset(
        self, *, seed: int | None = None, options: dict[str, Any] | None = None
    ) -> tuple[Any, dict[str, Any]]:
        super().reset(seed=seed)
        mujoco.mj_resetData(self.model, self.data)
        self._reset_task()
        mujoco.mj_forward(self.model, self.data)
        return self._observation(), self._info()

    def step(self, action: np.ndarray) -> tuple[Any, float, bool, bool, dict[str, Any]]:
        action = np.asarray(action, dtype=np.float64).reshape(self.action_space.shape)
        self._apply_action(np.clip(action, -1.0, 1.0))
        mujoco.mj_step(self.model, self.data, nstep=self.frame_skip)
        # mj_step leaves positions/kinematics one substep stale; refresh them so
        # the reward and the rendered frame describe the same, current state.
        mujoco.mj_forward(self.model, self.data)
        self._after_step()
        reward = float(self._reward())
        return self._observation(), reward, bool(self._terminated()), False, self._info()

    def render(self) -> np.ndarray | None:
        """The policy camera's frame, identical to the last observation's pixels."""
        if self.render_mode is None:
            return None
        if self._frame is None:  # before the first reset
            return self._render_camera(POLICY_CAMERA, self.image_size, self.image_size)
        return self._frame.copy()

    def render_view(self, width: int = 480, height: int = 480) -> np.ndarray:
        """A larger third-person frame from the MJCF camera ``view``, for videos."""
        return self._render_camera(VIEW_CAMERA, height, width)

    def close(self) -> None:
        for renderer in self._renderers.values():
            renderer.close()
        self._renderers.clear()
        super().close()

    # ------------------------------------------------------------- helpers
    def _render_camera(self, camera: str, height: int, width: int) -> np.ndarray:
        key = (int(height), int(width))
        renderer = self._renderers.get(key)
        if renderer is None:
            renderer = self._renderers[key] = new_renderer(self.model, *key)
        renderer.update_scene(self.data, camera=camera)
        return renderer.render()

    def _observation(self) -> Any:
        self._frame = self._render_camera(POLICY_CAMERA, self.image_size, self.image_size)
        if self.obs_mode == "pixels":
            return self._frame
        high = self.observation_space["state"].high
        state = np.clip(self._state().astype(np.float32), -high, high)
        return {"pixels": self._frame, "state": state}

    def _body_xy(self, name: str) -> np.ndarray:
        """World x, y of a body's frame (after the last ``mj_forward``/``mj_step``)."""
        return self.data.body(name).xpos[:2].copy()


def sample_annulus(rng: np.random.Generator, r_min: float, r_max: float) -> np.ndarray:
    """A point uniformly distributed (by area) in the ring r_min <= |p| <= r_max."""
    radius = np.sqrt(rng.uniform(r_min**2, r_max**2))
    angle = rng.uniform(-np.pi, np.pi)
    return np.array([radius * np.cos(angle), radius * np.sin(angle)])


ARM_CONTROLS = ("cartesian", "joint")


class PlanarArmTask(MujocoTask):
    """A task for the two-link planar arm of ``reach.xml`` / ``push.xml``.

    The MJCF must have hinges ``shoulder`` and ``elbow`` driven by two motors
    with ``ctrlrange="-1 1"``, and a body ``fingertip``. The joints are heavily
    damped, so a motor command sets a joint velocity (``gear / damping`` rad/s
    at 1) and the arm stops when the command does.

    Args:
        control: ``"cartesian"`` (default): the action is the fingertip's
            velocity in the table plane, x then y (right and up in the policy
            image), ``TIP_SPEED`` m/s at 1 (less in poses where a joint would need
            more than ``gear / damping`` rad/s: the command is scaled down whole, keeping
            its direction); a damped least-squares inverse of
            the arm's Jacobian turns it into joint commands, as an end-effector
            controller on a real arm would. The same action moves the fingertip
            the same way in every arm pose, which makes the pixels-to-action
            map much easier to learn. ``"joint"``: the action drives the
            shoulder and elbow motors directly.

    ``state`` (``obs_mode="pixels_state"``), float32[4]: shoulder angle
    (wrapped to [-pi, pi)), elbow angle, shoulder and elbow velocities (rad/s).
    """

    TIP_SPEED = 0.5  # m/s of the fingertip at |action| = 1 (cartesian control), where no joint tops out
    DLS_DAMPING = 1e-3  # squared damping of the Jacobian inverse, m^2: tames singular poses
    STATE_HIGH = (np.pi, np.pi, 10.0, 10.0)  # the damped joints top out near 3 rad/s

    def __init__(
        self,
        image_size: int = 84,
        obs_mode: str = "pixels",
        render_mode: str | None = "rgb_array",
        frame_skip: int | None = None,
        control: str = "cartesian",
    ) -> None:
        if control not in ARM_CONTROLS:
            raise ValueError(f"control must be one of {ARM_CONTROLS}, got {control!r}")
        self.control = control
        super().__init__(image_size, obs_mode, render_mode, frame_skip)

    @property
    def _arm_qpos(self) -> slice:
        start = int(self.model.joint("shoulder").qposadr[0])
        return slice(start, start + 2)

    @property
    def _arm_dofs(self) -> slice:
        start = int(self.model.joint("shoulder").dofadr[0])
        return slice(start, start + 2)

    def _sample_arm_pose(self) -> None:
        """A random arm pose (any shoulder angle, elbow well inside its limits)."""
        self.data.qpos[self._arm_qpos] = [
            self.np_random.uniform(-np.pi, np.pi),
            self.np_random.uniform(-2.5, 2.5),
        ]

    def _apply_action(self, action: np.ndarray) -> None:
        if self.control == "joint":
            self.data.ctrl[:] = action
            return
        jacp = np.zeros((3, self.model.nv))
        mujoco.mj_jacBody(self.model, self.data, jacp, None, self.model.body("fingertip").id)
        jac = jacp[:2, self._arm_dofs]
        tip_velocity = self.TIP_SPEED * action
        joint_velocity = jac.T @ np.linalg.solve(
            jac @ jac.T + self.DLS_DAMPING * np.eye(2), tip_velocity
        )
        ctrl = joint_velocity / self._joint_speed()
        self.data.ctrl[:] = ctrl / max(1.0, float(np.abs(ctrl).max()))  # keep the direction

    def _joint_speed(self) -> np.ndarray:
        """Joint velocity (rad/s) a motor command of 1 settles at: gear / damping."""
        return self.model.actuator_gear[:, 0] / self.model.dof_damping[self._arm_dofs]

    def _state(self) -> np.ndarray:
        qpos = self.data.qpos[self._arm_qpos].copy()
        qpos[0] = wrap_angle(qpos[0])
        return np.concatenate([qpos, self.data.qvel[self._arm_dofs]])
