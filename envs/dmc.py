"""The DeepMind Control Suite from pixels, as gymnasium envs (optional: ``pip install -e ".[dmc]"``).

Importing this module registers every suite task as ``dmc/<domain>-<task>-v0``
(``dmc/cartpole-swingup-v0``, ``dmc/ball_in_cup-catch-v0``, ...) when
``dm_control`` imports, and registers nothing otherwise. visppo also reads
``dmc:<domain>-<task>`` (the ids of the DrQ / DrQ-v2 tables) as an alias:
:func:`gym_id` maps it to the registered id.

The env follows the published pixel protocol (DrQ, DrQ-v2): square frames from
camera 0 (camera 2 for ``quadruped``, as DrQ-v2), actions in [-1, 1] scaled to
the task's bounds, episodes of ``episode_frames`` (1000) suite steps, each
action repeated ``action_repeat`` times with one frame rendered per agent step,
and the reward summed over the repeated steps, so an episode's return is the
sum of the suite's rewards over its 1000 steps whatever the repeat. The suite
has no success signal, so ``info`` has no ``is_success``.

``look``: ``"published"`` renders the scene as the suite ships it (the frames
equal dm_control's own ``physics.render``); ``"fast"`` turns off shadows,
reflections and the skybox, several times cheaper on a software GL.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ._gl import ensure_headless_gl

ensure_headless_gl()

import gymnasium as gym  # noqa: E402
import mujoco  # noqa: E402
from gymnasium import spaces  # noqa: E402
from gymnasium.envs.registration import register, registry  # noqa: E402

from ._mujoco_task import new_renderer  # noqa: E402

NAMESPACE = "dmc"
ALIAS_PREFIX = "dmc:"
EPISODE_FRAMES = 1000
"""Suite steps per episode: every task of the suite runs 1000 control steps."""
LOOKS = ("published", "fast")
FAST_OFF = (mujoco.mjtRndFlag.mjRND_SHADOW, mujoco.mjtRndFlag.mjRND_REFLECTION, mujoco.mjtRndFlag.mjRND_SKYBOX)
"""Scene flags the fast look turns off."""
DEFAULT_CAMERA = {"quadruped": 2}
"""Camera per domain where the published protocol does not use camera 0 (DrQ-v2)."""
INSTALL_HINT = 'install the optional extra: pip install -e ".[dmc]" (dm-control and mujoco>=3.17,<4)'
UNLIMITED = 1e9
"""Action bounds at or beyond this (MuJoCo reports +-1e10 for an actuator without a control range)
are no bounds: the policy's [-1, 1] goes to such an actuator unscaled."""


class SuiteUnavailable(ImportError):
    """dm_control cannot be imported or cannot load a suite task here; the message says what to install."""


def is_dmc_id(env_id: str) -> bool:
    """``dmc:<domain>-<task>`` or ``dmc/<domain>-<task>-v0``."""
    return env_id.startswith((ALIAS_PREFIX, NAMESPACE + "/"))


def gym_id(env_id: str) -> str:
    """The registered id of a suite task: ``dmc:cartpole-balance`` -> ``dmc/cartpole-balance-v0``.

    Ids already in the ``dmc/`` namespace come back unchanged. A name that is
    not ``<domain>-<task>`` raises ValueError.
    """
    if env_id.startswith(NAMESPACE + "/"):
        return env_id
    if not env_id.startswith(ALIAS_PREFIX):
        raise ValueError(f"{env_id!r} is not a DeepMind Control id (dmc:<domain>-<task>)")
    name = env_id[len(ALIAS_PREFIX):]
    domain, _, task = name.partition("-")
    if not domain or not task:
        raise ValueError(f"{env_id!r} must name a domain and a task: dmc:<domain>-<task>, e.g. dmc:cartpole-swingup")
    return f"{NAMESPACE}/{name}-v0"


def _suite():
    try:
        from dm_control import suite
    except ImportError as exc:
        raise SuiteUnavailable(f"dm_control is not installed ({exc}): {INSTALL_HINT}") from None
    except Exception as exc:  # an import that breaks on an unsupported mujoco
        raise _unsupported("import dm_control.suite", exc) from None
    return suite


def _unsupported(what: str, exc: Exception) -> Exception:
    if int(mujoco.__version__.split(".")[0]) < 4:
        return exc
    # e.g. dm-control 1.0.50 reads MjModel.flex_vertedge, which mujoco 4 no longer has
    return SuiteUnavailable(f"dm_control cannot {what} with mujoco {mujoco.__version__} "
                            f"({type(exc).__name__}: {exc}): {INSTALL_HINT}")


def register_suite() -> list[str]:
    """Register every suite task as ``dmc/<domain>-<task>-v0``; the ids. Raises SuiteUnavailable."""
    suite = _suite()
    ids = []
    for domain, task in suite.ALL_TASKS:
        env_id = f"{NAMESPACE}/{domain}-{task}-v0"
        if env_id not in registry:
            # No TimeLimit: the env ends its own episodes after episode_frames suite steps, which
            # counts frames whatever the action repeat.
            register(id=env_id, entry_point="visppo_envs.dmc:DMCEnv", kwargs={"domain": domain, "task": task})
        ids.append(env_id)
    return ids


def suite_ids() -> list[str]:
    """Registered suite ids (empty when dm_control is missing)."""
    return sorted(k for k in registry if k.startswith(NAMESPACE + "/"))


def _load(domain: str, task: str, task_kwargs: dict[str, Any] | None):
    suite = _suite()
    # An infinite time limit: the env counts frames itself (episode_frames), so the limit may be changed.
    kwargs = {"time_limit": float("inf"), **(task_kwargs or {})}
    try:
        return suite.load(domain, task, task_kwargs=kwargs)
    except AttributeError as exc:
        raise _unsupported(f"load {domain}-{task}", exc) from None


class DMCEnv(gym.Env):
    """One DeepMind Control Suite task observed through a camera.

    Args:
        domain, task: the suite's names (``cartpole``, ``swingup``).
        image_size: side of the square frame, in pixels (84 in the published tables).
        obs_mode: ``"pixels"`` (uint8 ``(H, W, 3)``) or ``"pixels_state"``
            (``{"pixels", "state"}``; the state is the suite's observation
            dict flattened in its order, float32).
        render_mode: ``"rgb_array"`` (``render()`` returns the last frame) or ``None``.
        camera: camera index or name; ``None``: 0, or 2 for quadruped.
        look: ``"published"`` or ``"fast"`` (no shadows, reflections or skybox).
        action_repeat: suite steps per agent step (one frame rendered per agent step).
        episode_frames: suite steps per episode (1000 in the published protocol).
        task_kwargs: passed to the suite's task loader; not ``random``, which every reset replaces
            with a generator seeded from the episode's seed.
        environment: a dm_control-style env to wrap instead of loading ``domain``/``task``.
    """

    metadata = {"render_modes": ["rgb_array"], "render_fps": 50}  # fps set per instance

    def __init__(
        self,
        domain: str = "",
        task: str = "",
        image_size: int = 84,
        obs_mode: str = "pixels",
        render_mode: str | None = "rgb_array",
        camera: int | str | None = None,
        look: str = "published",
        action_repeat: int = 1,
        episode_frames: int = EPISODE_FRAMES,
        task_kwargs: dict[str, Any] | None = None,
        environment: Any = None,
    ) -> None:
        if obs_mode not in ("pixels", "pixels_state"):
            raise ValueError(f"obs_mode must be pixels or pixels_state, got {obs_mode!r}")
        if look not in LOOKS:
            raise ValueError(f"look must be one of {', '.join(LOOKS)}, got {look!r}")
        if render_mode not in (None, "rgb_array"):
            raise ValueError(f"unsupported render_mode {render_mode!r}")
        for name, value in (("image_size", image_size), ("action_repeat", action_repeat),
                            ("episode_frames", episode_frames)):
            if int(value) < 1:
                raise ValueError(f"{name} must be >= 1, got {value}")
        self.domain, self.task = domain, task
        self.image_size, self.obs_mode, self.render_mode, self.look = int(image_size), obs_mode, render_mode, look
        self.action_repeat, self.episode_frames = int(action_repeat), int(episode_frames)
        self._env = environment if environment is not None else _load(domain, task, task_kwargs)
        physics = self._env.physics
        self.model: mujoco.MjModel = physics.model.ptr  # visppo's env.render_samples sets its anti-aliasing
        self.data: mujoco.MjData = physics.data.ptr
        self.camera = self._camera(DEFAULT_CAMERA.get(domain, 0) if camera in (None, "") else camera)
        dt = float(self._env.control_timestep()) * self.action_repeat
        self.metadata = {**type(self).metadata, "render_fps": max(1, int(round(1.0 / dt)))}

        spec = self._env.action_spec()
        self._low = np.asarray(spec.minimum, np.float64) * np.ones(spec.shape)
        self._high = np.asarray(spec.maximum, np.float64) * np.ones(spec.shape)
        # an actuator without a control range (lqr's) reports MuJoCo's +-1e10: scaled onto that, the
        # policy's [-1, 1] would push by 1e9; such an actuator takes [-1, 1] as it is
        unlimited = ~((np.abs(self._low) < UNLIMITED) & (np.abs(self._high) < UNLIMITED))  # NaN and inf too
        self._low[unlimited], self._high[unlimited] = -1.0, 1.0
        self.action_space = spaces.Box(-1.0, 1.0, tuple(spec.shape), np.float32)
        pixels = spaces.Box(0, 255, (self.image_size, self.image_size, 3), np.uint8)
        if obs_mode == "pixels":
            self.observation_space: spaces.Space = pixels
        else:
            dim = sum(int(np.prod(s.shape)) for s in self._env.observation_spec().values())
            state = spaces.Box(-np.inf, np.inf, (dim,), np.float32)
            self.observation_space = spaces.Dict({"pixels": pixels, "state": state})
        self._renderers: dict[tuple[int, int, str], mujoco.Renderer] = {}  # made at the first frame
        self._frame: np.ndarray | None = None
        self.frames = 0  # suite steps in this episode

    def _camera(self, camera: int | str) -> int:
        if isinstance(camera, str) and not camera.lstrip("-").isdigit():
            index = mujoco.mj_name2id(self.model, mujoco.mjtObj.mjOBJ_CAMERA, camera)
            if index < 0:
                raise ValueError(f"{self.domain or 'the env'} has no camera named {camera!r}")
            return index
        index = int(camera)
        if not 0 <= index < self.model.ncam:
            raise ValueError(f"camera {index} out of range: {self.domain or 'the env'} has {self.model.ncam}")
        return index

    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None):
        super().reset(seed=seed)
        task = getattr(self._env, "task", None)
        if task is not None:  # the suite draws the initial state from its task's RandomState
            # 128 bits of the episode's seed: 31 folded distinct reset seeds into one start now and then
            task._random = np.random.RandomState(self.np_random.integers(2**32, size=4, dtype=np.uint32))
        timestep = self._env.reset()
        self.frames = 0
        return self._observation(timestep), {}

    def step(self, action: np.ndarray):
        action = np.clip(np.asarray(action, np.float64).reshape(self._low.shape), -1.0, 1.0)
        action = self._low + (action + 1.0) * 0.5 * (self._high - self._low)
        reward, terminated, truncated = 0.0, False, False
        for _ in range(self.action_repeat):
            timestep = self._env.step(action)
            self.frames += 1
            reward += float(timestep.reward or 0.0)
            terminated = timestep.last() and timestep.discount == 0.0
            truncated = not terminated and (timestep.last() or self.frames >= self.episode_frames)
            if terminated or truncated:
                break
        return self._observation(timestep), reward, terminated, truncated, {}

    def render(self) -> np.ndarray | None:
        """The last frame the policy saw."""
        if self.render_mode is None:
            return None
        if self._frame is None:
            return self._render(self.image_size, self.image_size, self.look)
        return self._frame.copy()

    def render_view(self, width: int = 480, height: int = 480) -> np.ndarray:
        """The policy's camera at a larger size and in the published look, for videos."""
        return self._render(height, width, "published")

    def close(self) -> None:
        for renderer in self._renderers.values():
            renderer.close()
        self._renderers.clear()
        self._env.close()
        super().close()

    def _render(self, height: int, width: int, look: str) -> np.ndarray:
        key = (int(height), int(width), look)
        renderer = self._renderers.get(key)
        if renderer is None:
            renderer = self._renderers[key] = new_renderer(self.model, int(height), int(width))
            if look == "fast":
                for flag in FAST_OFF:
                    renderer.scene.flags[flag] = 0
        renderer.update_scene(self.data, camera=self.camera)
        return renderer.render()

    def _observation(self, timestep) -> Any:
        self._frame = self._render(self.image_size, self.image_size, self.look)
        if self.obs_mode == "pixels":
            return self._frame
        state = np.concatenate([np.asarray(v, np.float64).reshape(-1) for v in timestep.observation.values()])
        return {"pixels": self._frame, "state": state.astype(np.float32)}


try:
    register_suite()
except SuiteUnavailable:
    pass  # gym_id still parses; visppo reports what to install when a dmc id is used


def measure_speed(name: str, look: str, image_size: int, frames: int, repeats: int,
                  samples: int = -1) -> tuple[float, float]:
    """(frames/s of rendering alone, agent steps/s at action repeat 2 with random actions): medians."""
    import statistics
    import time

    domain, task = name.split("-", 1)
    env = DMCEnv(domain, task, image_size=image_size, look=look, action_repeat=2)
    if samples >= 0:
        env.model.vis.quality.offsamples = samples
    env.action_space.seed(0)
    env.reset(seed=0)
    render, step = [], []
    for _ in range(repeats + 1):  # the first run is warm-up
        start = time.perf_counter()
        for _ in range(frames):
            env._render(image_size, image_size, look)
        render.append(frames / (time.perf_counter() - start))
        start = time.perf_counter()
        for _ in range(frames):
            if any(env.step(env.action_space.sample())[2:4]):
                env.reset()
        step.append(frames / (time.perf_counter() - start))
    env.close()
    return statistics.median(render[1:]), statistics.median(step[1:])


def main(argv: list[str] | None = None) -> None:
    """``python -m visppo_envs.dmc [TASK ...]``: render and step speed of each look."""
    import argparse

    parser = argparse.ArgumentParser(description="Frames/s of suite tasks in each look (random actions).")
    parser.add_argument("tasks", nargs="*", default=["cartpole-swingup", "walker-walk"])
    parser.add_argument("--image-size", type=int, default=84)
    parser.add_argument("--frames", type=int, default=200, help="frames (and agent steps) per timed run")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--samples", type=int, nargs="+", default=[-1],
                        help="anti-aliasing samples to try (-1: the suite's own)")
    args = parser.parse_args(argv)
    print("| task | look | anti-aliasing | render frames/s | agent steps/s (repeat 2) |")
    print("| --- | --- | --- | --- | --- |")
    for name in args.tasks:
        for look in LOOKS:
            for samples in args.samples:
                render, step = measure_speed(name, look, args.image_size, args.frames, args.repeats, samples)
                aa = "the suite's" if samples < 0 else str(samples)
                print(f"| {name} | {look} | {aa} | {render:.0f} | {step:.0f} |", flush=True)


if __name__ == "__main__":
    main()
