"""Build the vector env the policy acts in: camera frames as uint8 CHW, stacked.

Every env is wrapped into one observation layout, a dict
``{"pixels": uint8[C*k, H, W], "state": float32[d]}`` ("state" only with
``env.state``), so the buffer and the policy have one code path. Frames are
transposed and stacked inside the workers, where it costs nothing to the
learner. Vector envs use gymnasium's SAME_STEP autoreset: the step that ends an
episode returns the next episode's first observation and puts the final one in
``info["final_obs"]``, which the rollout needs to bootstrap truncated episodes.
"""

from __future__ import annotations

import multiprocessing
import os
import signal
from collections import deque
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import gymnasium as gym
import numpy as np

from visppo import seeding
from visppo.config import Config
from visppo.env_check import check_observation_space
from visppo.errors import ConfigError, RunError
from visppo_envs._gl import ensure_headless_gl

SYNTHETIC_PREFIX = "visppo/Dot"
DMC_PREFIXES = ("dmc:", "dmc/")
"""``dmc:<domain>-<task>`` (alias) and ``dmc/<domain>-<task>-v0`` (registered): ``visppo_envs.dmc``."""


class ActionRepeat(gym.Wrapper):
    """Repeat each action ``repeat`` times, summing rewards, stopping at episode end."""

    def __init__(self, env: gym.Env, repeat: int):
        super().__init__(env)
        self.repeat = repeat

    def step(self, action):
        total = 0.0
        for _ in range(self.repeat):
            obs, reward, terminated, truncated, info = self.env.step(action)
            total += float(reward)
            if terminated or truncated:
                break
        return obs, total, terminated, truncated, info


class PixelDict(gym.ObservationWrapper):
    """Image (HWC uint8) or dict {"pixels", "state"} -> {"pixels": CHW stacked k frames, "state"}."""

    def __init__(self, env: gym.Env, frame_stack: int, keep_state: bool, image_size: int | None = None):
        super().__init__(env)
        space = env.observation_space
        pix = check_observation_space(space, keep_state, env.spec.id if env.spec else str(env))
        h, w, c = pix.shape
        self.resize = image_size if image_size and (h, w) != (image_size, image_size) else None
        if self.resize:  # envs that render at their own size (e.g. 600x400 classic control)
            h = w = self.resize
        self.k = frame_stack
        spaces = {"pixels": gym.spaces.Box(0, 255, (c * self.k, h, w), np.uint8)}
        self.keep_state = keep_state
        if keep_state:
            st = space["state"]
            spaces["state"] = gym.spaces.Box(-np.inf, np.inf, (int(np.prod(st.shape)),), np.float32)
        self.observation_space = gym.spaces.Dict(spaces)
        self.frames: deque[np.ndarray] = deque(maxlen=self.k)

    def reset(self, **kwargs):
        obs, info = self.env.reset(**kwargs)
        self.frames.clear()
        frame = self._frame(obs)
        for _ in range(self.k):
            self.frames.append(frame)
        return self._pack(obs), info

    def observation(self, obs):
        self.frames.append(self._frame(obs))
        return self._pack(obs)

    def _frame(self, obs) -> np.ndarray:
        pix = obs["pixels"] if isinstance(obs, dict) else obs
        if self.resize:
            from PIL import Image

            pix = np.asarray(Image.fromarray(pix).resize((self.resize, self.resize), Image.BILINEAR))
        return np.ascontiguousarray(np.transpose(pix, (2, 0, 1)))

    def _pack(self, obs) -> dict[str, np.ndarray]:
        out = {"pixels": np.concatenate(self.frames, axis=0)}
        if self.keep_state:
            out["state"] = np.asarray(obs["state"], dtype=np.float32).reshape(-1)
        return out


class SeededEpisodes(gym.Wrapper):
    """Seed every episode from (base seed, episode index, stream), so episodes are reproducible.

    The first ``reset(seed=s)`` sets the base; each later reset (autoreset
    included) reseeds the env with :func:`visppo.seeding.episode_seed` of the base,
    the episode's index and the env's stream (training or evaluation, whose
    seeds are disjoint). A resumed run sets ``episode`` from the checkpoint before
    its first reset, and its envs then replay exactly the episodes the
    interrupted run would have started.
    """

    def __init__(self, env: gym.Env, stream: int = seeding.TRAIN):
        super().__init__(env)
        self.stream = stream
        self.base_seed: int | None = None
        self.episode = 0  # index of the current (or, before the first reset, the next) episode
        self._started = False

    def reset(self, *, seed: int | None = None, options: dict | None = None):
        if seed is not None:
            self.base_seed = seed
        elif self._started:
            self.episode += 1
        self._started = True
        episode_seed = None
        if self.base_seed is not None:
            episode_seed = seeding.episode_seed(self.base_seed, self.episode, self.stream)
        return self.env.reset(seed=episode_seed, options=options)


def _is_visppo_task(env_id: str) -> bool:
    return env_id.startswith("visppo/")


def _is_dmc(env_id: str) -> bool:
    """A DeepMind Control id (checked without importing ``visppo_envs.dmc``, which imports dm_control)."""
    return env_id.startswith(DMC_PREFIXES)


def resolve_env_id(env_id: str) -> str:
    """The id to give ``gymnasium.make``, after importing what registers it; ConfigError if it cannot.

    - ``dmc:<domain>-<task>`` (the published tables' ids) -> ``dmc/<domain>-<task>-v0``,
      registered by ``visppo_envs.dmc`` when dm_control imports.
    - ``module:EnvId`` (gymnasium's convention): ``module`` is imported here, so that an
      import failure or an id the module does not register is a one-line error; the id is
      returned unchanged and gymnasium imports the module again (a no-op) in each worker.
    - anything else is returned unchanged (``visppo/*`` ids are registered by ``visppo_envs``).
    """
    import visppo_envs  # noqa: F401  registers visppo/* ids

    if _is_dmc(env_id):
        return _resolve_dmc(env_id)
    if ":" in env_id:
        module, _, name = env_id.partition(":")
        _import_env_module(env_id, module, name)
    return env_id


def _resolve_dmc(env_id: str) -> str:
    _preload_for_render()  # importing dm_control makes an EGL display (it loads Mesa's LLVM)
    from visppo_envs import dmc

    try:
        gid = dmc.gym_id(env_id)
        dmc.register_suite()
    except ValueError as exc:
        raise ConfigError(f"env.id: {exc}") from None
    except dmc.SuiteUnavailable as exc:
        raise ConfigError(f"env.id {env_id} needs the DeepMind Control Suite: {exc}") from None
    if gid not in gym.registry:
        domain = gid.split("/", 1)[1].split("-", 1)[0]
        same = [i.split("/", 1)[1][:-3] for i in dmc.suite_ids() if i.startswith(f"dmc/{domain}-")]
        known = ", ".join(same) if same else ", ".join(sorted({i[4:].split("-")[0] for i in dmc.suite_ids()}))
        raise ConfigError(f"env.id {env_id}: the suite has no such task ({'its ' + domain + ' tasks' if same else 'domains'}: "
                          f"{known}); use dmc:<domain>-<task>")
    return gid


def _import_env_module(env_id: str, module: str, name: str) -> None:
    import importlib

    if not module or not name:
        raise ConfigError(f"env.id '{env_id}' must look like module:EnvId (e.g. my_robot.envs:Arm-v0)")
    try:
        importlib.import_module(module)
    except Exception as exc:
        first = (str(exc).strip().splitlines() or [""])[0]
        raise ConfigError(f"env.id {env_id}: cannot import module '{module}' ({type(exc).__name__}: {first}): "
                          "install its package or put its folder on PYTHONPATH") from None
    if name not in gym.registry:
        ids = sorted(k for k, spec in gym.registry.items() if isinstance(spec.entry_point, str)
                     and (spec.entry_point.split(":")[0] + ".").startswith(module + "."))
        more = f" and {len(ids) - 8} more" if len(ids) > 8 else ""
        found = f"it registers {', '.join(ids[:8])}{more}" if ids else "it registers no gymnasium id"
        raise ConfigError(f"env.id {env_id}: module '{module}' imported but did not register '{name}' ({found}): "
                          f"call gymnasium.register(id='{name}', ...) when it is imported, or fix the id")


def make_env(cfg: Config, stream: int = seeding.TRAIN) -> gym.Env:
    """One env with visppo's observation layout (used by workers and by evaluation); its episodes
    are seeded in ``stream`` (:mod:`visppo.seeding`: training and evaluation seeds never meet)."""
    try:
        return _make_env(cfg, stream)
    except gym.error.Error as exc:
        raise ConfigError(f"env.id {cfg.env.id} cannot be made as configured: {str(exc).splitlines()[0]}"
                          ) from None
    except TypeError as exc:
        raise ConfigError(f"env.id {cfg.env.id} refused its arguments ({exc}): check env.kwargs") from None


def _make_env(cfg: Config, stream: int) -> gym.Env:
    e = cfg.env
    env_id = resolve_env_id(e.id)
    kwargs: dict[str, Any] = dict(e.kwargs)
    if _is_dmc(env_id):
        env = _make_dmc(cfg, env_id, kwargs)
        return SeededEpisodes(PixelDict(env, e.frame_stack, e.state, e.image_size), stream)
    if e.max_episode_steps:
        kwargs["max_episode_steps"] = e.max_episode_steps
    if _is_visppo_task(env_id):
        if e.camera not in ("", "policy"):
            raise ConfigError(f"env.camera={e.camera}: visppo's tasks see through their fixed camera 'policy' "
                              "(it frames the workspace); remove env.camera")
        env = gym.make(env_id, image_size=e.image_size,
                       obs_mode="pixels_state" if e.state else "pixels", **kwargs)
        if e.render_samples >= 0:
            set_render_samples(env, e.render_samples, env_id)
    elif e.pixels:
        env = _make_rendered(cfg, env_id, kwargs)
    else:
        env = gym.make(env_id, **kwargs)
    if e.action_repeat > 1:
        env = ActionRepeat(env, e.action_repeat)
    return SeededEpisodes(PixelDict(env, e.frame_stack, e.state, e.image_size), stream)


def _make_dmc(cfg: Config, env_id: str, kwargs: dict[str, Any]) -> gym.Env:
    """A suite task: the env repeats actions itself and renders one frame per agent step.

    ``env.action_repeat`` goes to the env rather than to :class:`ActionRepeat`, which would
    render every repeated step's frame only to drop it (rendering is the cost here), and
    ``env.max_episode_steps`` counts suite steps (frames), 1000 by default, whatever the repeat.
    """
    from visppo_envs import dmc

    e = cfg.env
    _preload_for_render()
    kwargs.setdefault("action_repeat", e.action_repeat)
    kwargs.setdefault("episode_frames", e.max_episode_steps or dmc.EPISODE_FRAMES)
    if e.camera:
        kwargs.setdefault("camera", e.camera)
    try:
        env = gym.make(env_id, image_size=e.image_size, obs_mode="pixels_state" if e.state else "pixels",
                       **kwargs)
    except dmc.SuiteUnavailable as exc:
        raise ConfigError(f"env.id {e.id} needs the DeepMind Control Suite: {exc}") from None
    except ValueError as exc:
        raise ConfigError(f"env.id {e.id}: {exc} (check env.camera and env.kwargs)") from None
    if e.render_samples >= 0:
        set_render_samples(env, e.render_samples, e.id)
    # The rate of suite steps, as for envs under ActionRepeat: evaluation videos divide it by the repeat.
    env.metadata = {**env.metadata, "render_fps": env.unwrapped.metadata["render_fps"] * e.action_repeat}
    return env


def _preload_for_render() -> None:
    ensure_headless_gl()
    if multiprocessing.parent_process() is None:  # the learner's process, not a worker
        preload_before_gl()


def _make_rendered(cfg: Config, env_id: str, kwargs: dict[str, Any]) -> gym.Env:
    """A gymnasium env that renders (``render_mode="rgb_array"``), its frames as observations."""
    e = cfg.env
    _preload_for_render()
    cam = {}
    if e.camera:
        cam = {"camera_name": e.camera}
    try:
        env = gym.make(env_id, render_mode="rgb_array", width=e.image_size, height=e.image_size,
                       **cam, **kwargs)
    except TypeError:  # envs that do not take a render size
        env = gym.make(env_id, render_mode="rgb_array", **kwargs)
    if e.camera:
        check_camera(env, e.camera, e.id)
    if e.render_samples >= 0:  # before AddRenderObservation renders its first frame
        set_render_samples(env, e.render_samples, env_id)
    if env.render_mode != "rgb_array" or "rgb_array" not in env.metadata.get("render_modes", []):
        env.close()
        raise ConfigError(f"env.id {e.id} cannot render camera frames (no rgb_array render mode): "
                          "pick an env that renders, or one with image observations and env.pixels=false")
    return gym.wrappers.AddRenderObservation(env, render_only=not e.state,
                                             render_key="pixels", obs_key="state")


def check_camera(env: gym.Env, camera: str, env_id: str) -> None:
    """``env.camera`` must name a camera of the env's MuJoCo model: gymnasium's renderer falls
    back to its free camera for an unknown name, silently training on another view."""
    import mujoco

    model = getattr(env.unwrapped, "model", None)
    if not isinstance(model, mujoco.MjModel):
        env.close()
        raise ConfigError(f"env.camera applies to MuJoCo envs (and dmc ids), and {env_id} is not one: "
                          "remove env.camera")
    if mujoco.mj_name2id(model, mujoco.mjtObj.mjOBJ_CAMERA, camera) < 0:
        names = [mujoco.mj_id2name(model, mujoco.mjtObj.mjOBJ_CAMERA, i) for i in range(model.ncam)]
        names = [n for n in names if n]
        env.close()
        has = f"its cameras: {', '.join(names)}" if names else "it has no named camera"
        raise ConfigError(f"env.camera={camera}: {env_id} has no camera of that name ({has}); fix the name "
                          "or remove env.camera for the default view")


def set_render_samples(env: gym.Env, samples: int, env_id: str) -> None:
    """Set the multisample anti-aliasing of a MuJoCo env's offscreen renderer.

    MuJoCo reads ``vis.quality.offsamples`` when it builds the GL context,
    which gymnasium and visppo's tasks do at the first render, so this must run
    before it. On a software GL (Mesa llvmpipe) 4x MSAA is most of the cost of
    an 84x84 frame.
    """
    import mujoco

    model = getattr(env.unwrapped, "model", None)
    if not isinstance(model, mujoco.MjModel):
        env.close()
        raise ConfigError(f"env.render_samples applies to MuJoCo envs only, and {env_id} is not one: "
                          "remove it (or set -1)")
    model.vis.quality.offsamples = samples


def check_env_id(env_id: str) -> None:
    """Refuse an unknown id early, before any worker starts."""
    name = resolve_env_id(env_id).split(":", 1)[-1]  # module:EnvId -> EnvId
    if name not in gym.registry:
        raise ConfigError(f"env.id '{env_id}' is not a registered gymnasium id: check the spelling, "
                          "install the package that registers it, or name it as module:EnvId")


def usable_cpus() -> int:
    """CPUs this process may run on (its affinity mask, e.g. a container's limit)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def use_async(cfg: Config) -> bool:
    """``env.vector=auto``: worker processes for rendered envs when there are more than 2 CPUs.

    On 2 CPUs the workers cannot render while the learner acts on a core of its
    own, and every step's round trip through their pipes costs more than their
    parallelism saves (measured: docs/performance.md).
    """
    if cfg.env.vector == "auto":
        rendered = cfg.ppo.num_envs > 1 and not cfg.env.id.startswith(SYNTHETIC_PREFIX)
        return rendered and usable_cpus() > 2
    return cfg.env.vector == "async"


def _thunk(cfg: Config):
    def make() -> gym.Env:
        if multiprocessing.parent_process() is not None:
            ignore_stop_signals()
        return make_env(cfg)
    return make


def ignore_stop_signals() -> None:
    """In a worker process: leave SIGINT / SIGTERM to the learner. A Ctrl-C reaches the whole
    process group, and the learner needs its workers alive to write the final checkpoint; a
    worker still ends when the learner does (its pipe closes)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)


def preload_before_gl() -> None:
    """Import ``torch._dynamo`` before this process makes a GL context.

    The first optimizer imports it, and it loads triton's LLVM; loaded after
    Mesa's llvmpipe (the first headless EGL context, e.g. gymnasium's renderer
    building the check env below), the two LLVMs collide and the process
    segfaults (seen here with Reacher-v5 from pixels). Workers never build an
    optimizer, so only the parent pays for the import.
    """
    import torch._dynamo  # noqa: F401


def make_vector_env(cfg: Config, num_envs: int | None = None) -> gym.vector.VectorEnv:
    """``num_envs`` copies with SAME_STEP autoreset, async in forkserver workers when it pays."""
    check_env_id(cfg.env.id)
    preload_before_gl()
    n = num_envs or cfg.ppo.num_envs
    if use_async(cfg):
        make_env(cfg).close()  # fail here, with a clear error, rather than in n workers
    fns = [_thunk(cfg) for _ in range(n)]
    mode = gym.vector.AutoresetMode.SAME_STEP
    if use_async(cfg):
        ctx = "forkserver" if "forkserver" in multiprocessing.get_all_start_methods() else "spawn"
        envs = gym.vector.AsyncVectorEnv(fns, shared_memory=True, context=ctx, autoreset_mode=mode)
    else:
        envs = gym.vector.SyncVectorEnv(fns, autoreset_mode=mode)
    envs.env_id = cfg.env.id  # for error messages that name the env
    return envs


@contextmanager
def worker_errors(envs: gym.vector.VectorEnv, env_id: str) -> Iterator[None]:
    """Turn a dead or failing worker into a :class:`RunError` naming the env.

    A worker that raises sends its exception back (gymnasium re-raises it here);
    a worker process that dies (segfault, OOM kill) closes its pipe, which
    surfaces as EOFError / BrokenPipeError instead of a hang.
    """
    try:
        yield
    except RunError:
        raise
    except (EOFError, BrokenPipeError, ConnectionResetError) as exc:
        dead = [f"worker {i} (exit code {p.exitcode})" for i, p in enumerate(getattr(envs, "processes", []))
                if p.exitcode is not None]
        raise RunError(f"env {env_id}: {', '.join(dead) or 'a worker'} died during step "
                       f"({type(exc).__name__}); the last checkpoint is intact") from None
    except (Exception, SystemExit) as exc:  # an in-process env's sys.exit too
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        raise RunError(f"env {env_id} failed during step: {type(exc).__name__}: {first[:200]}") from exc
