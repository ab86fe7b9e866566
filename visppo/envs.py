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

import functools
import multiprocessing
import os
import re
import signal
import sys
import time
import warnings
from collections import deque
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import gymnasium as gym
import numpy as np

from visppo import env_process, seeding
from visppo.config import CODE_PREFIX, Config
from visppo.env_check import check_observation_space, env_errors, looks_like_image, raised
from visppo.env_process import EnvProcess, how_it_ended
from visppo.errors import ConfigError, EnvError, RunError
from visppo_envs._gl import ensure_headless_gl

SYNTHETIC_PREFIX = "visppo/Dot"
DMC_PREFIXES = ("dmc:", "dmc/")
"""``dmc:<domain>-<task>`` (alias) and ``dmc/<domain>-<task>-v0`` (registered): ``visppo_envs.dmc``."""
_CODE_ENVS: dict[str, Callable[..., gym.Env]] = {}


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


def chw_frame(pixels: np.ndarray, image_size: int | None) -> np.ndarray:
    """One HxWxC uint8 frame -> CxHxW, resized bilinearly (PIL) to ``image_size`` square first
    when it has another size (envs that render at their own size, a robot's camera)."""
    if image_size and pixels.shape[:2] != (image_size, image_size):
        from PIL import Image

        image = Image.fromarray(pixels[..., 0] if pixels.shape[-1] == 1 else pixels)  # PIL: gray is HxW
        resized = image.resize((image_size, image_size), Image.BILINEAR)
        pixels = np.asarray(resized).reshape(image_size, image_size, pixels.shape[-1])
    return np.transpose(pixels, (2, 0, 1)).copy()  # a copy even where a view would do: cameras reuse buffers


class FrameStack:
    """What the policy sees of an episode: its last ``k`` frames (CHW) stacked along channels, oldest
    first, the first frame repeated ``k`` times, and the state vector as float32 with ``keep_state``.

    :class:`PixelDict` packs the env's observations with it in training and evaluation, and
    :class:`visppo.deploy.Policy` packs a camera's frames with it, so both see the same arrays.
    """

    def __init__(self, k: int, keep_state: bool, image_size: int | None = None):
        self.k, self.keep_state, self.image_size = k, keep_state, image_size
        self.frames: deque[np.ndarray] = deque(maxlen=k)

    def first(self, obs) -> dict[str, np.ndarray]:
        """An episode's first observation: the stack is filled with its frame."""
        self.frames.clear()
        frame = self._frame(obs)
        for _ in range(self.k):
            self.frames.append(frame)
        return self._pack(obs)

    def next(self, obs) -> dict[str, np.ndarray]:
        """A later observation of the episode: its frame pushes out the oldest."""
        self.frames.append(self._frame(obs))
        return self._pack(obs)

    def _frame(self, obs) -> np.ndarray:
        return chw_frame(obs["pixels"] if isinstance(obs, dict) else obs, self.image_size)

    def _pack(self, obs) -> dict[str, np.ndarray]:
        out = {"pixels": np.concatenate(self.frames, axis=0)}
        if self.keep_state:
            out["state"] = np.array(obs["state"], dtype=np.float32).reshape(-1)  # a copy, as the frames
        return out


class PixelDict(gym.ObservationWrapper):
    """Image (HWC uint8) or dict {"pixels", "state"} -> {"pixels": CHW stacked k frames, "state"}."""

    def __init__(self, env: gym.Env, frame_stack: int, keep_state: bool, image_size: int | None = None,
                 name: str | None = None):
        super().__init__(env)
        space = env.observation_space
        name = name or (env.spec.id if env.spec else str(env))  # env.id as the user wrote it, for errors
        pix = check_observation_space(space, keep_state, name)
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
        self.stack = FrameStack(self.k, keep_state, self.resize)

    def reset(self, **kwargs):
        obs, info = self.env.reset(**kwargs)
        return self.stack.first(obs), info

    def observation(self, obs):
        return self.stack.next(obs)


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
        if seed is not None:  # a new stream starts at its first episode (gymnasium's reset contract)
            self.base_seed = seed
            self.episode = 0 if self._started else self.episode  # before any reset: a resume's index
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

    if env_id.startswith(CODE_PREFIX):
        if env_id not in _CODE_ENVS:
            raise ConfigError(f"env.id {env_id} is an env built in code by visppo.train(env=...) in another "
                              "process: pass the same callable again (visppo.train(env=...)), or give a "
                              "registered env with the same spaces (visppo eval RUN env.id=module:EnvId)")
        return env_id
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
        ids = sorted(k for k, spec in gym.registry.items() if (_entry_module(spec.entry_point) + ".").startswith(module + "."))
        more = f" and {len(ids) - 8} more" if len(ids) > 8 else ""
        found = f"it registers {', '.join(ids[:8])}{more}" if ids else "it registers no gymnasium id"
        raise ConfigError(f"env.id {env_id}: module '{module}' imported but did not register '{name}' ({found}): "
                          f"call gymnasium.register(id='{name}', ...) when it is imported, or fix the id")


def _entry_module(entry_point: Any) -> str:
    """The module of a registered entry point: ``"pkg.mod:Env"``, or a class or function (gymnasium's
    tutorial registers the class itself)."""
    if isinstance(entry_point, str):
        return entry_point.split(":")[0]
    return getattr(entry_point, "__module__", None) or ""


def make_env(cfg: Config, stream: int = seeding.TRAIN) -> gym.Env:
    """One env with visppo's observation layout (used by workers and by evaluation); its episodes
    are seeded in ``stream`` (:mod:`visppo.seeding`: training and evaluation seeds never meet)."""
    try:
        return _make_env(cfg, stream)
    except gym.error.Error as exc:
        raise ConfigError(f"env.id {cfg.env.id} cannot be made as configured: {str(exc).splitlines()[0]}"
                          ) from None
    except TypeError as exc:
        if refused_arguments(exc, entry=_entry_name(cfg.env.id)):
            raise ConfigError(f"env.id {cfg.env.id} refused its arguments ({exc}): check env.kwargs") from None
        first = (str(exc).strip().splitlines() or [""])[0]
        first = first.split(" was raised from the environment creator")[0]  # gymnasium's list of the kwargs
        raise EnvError(f"env {cfg.env.id}: its constructor raised TypeError ({first}): fix the env") from None


ARGUMENT_ERRORS = ("unexpected keyword argument", "required positional argument", "required keyword-only argument",
                   "positional argument but", "positional arguments but", "multiple values for argument")
"""Python's words for a call whose arguments do not fit the function (``inspect.signature``'s
binding errors read the same): gymnasium passes them on from the env's constructor."""


def refused_arguments(exc: TypeError, names: tuple[str, ...] = (), entry: str | None = None) -> bool:
    """Whether ``exc`` says the env's constructor refused its arguments (one of ``names``, when
    given: an unexpected keyword), rather than that its code raised a TypeError of its own. Read
    before the kwargs gymnasium appends (they name every argument); with ``entry`` (the entry
    point's name), only a refusal by that call counts, not one by a function it called."""
    text = str(exc).split(" was raised from the environment creator")[0]
    if entry is not None and not text.startswith((f"{entry}(", f"{entry}.__init__(")):
        return False
    if names:
        return any(f"unexpected keyword argument '{name}'" in text for name in names)
    return any(words in text for words in ARGUMENT_ERRORS)


def _entry_name(env_id: str) -> str | None:
    """The name Python's argument errors give the registered entry point of ``env_id`` (a class's
    or function's, or the part after ``:`` of a string), or None when it cannot be told."""
    try:
        gid = resolve_env_id(env_id)
        entry = gym.spec(gid.partition(":")[2] if ":" in gid else gid).entry_point  # module:EnvId: EnvId
    except Exception:  # noqa: BLE001 - unknown here: the words alone decide
        return None
    if isinstance(entry, str):
        return entry.rsplit(":", 1)[-1] or None
    return getattr(entry, "__qualname__", None)


def _make_env(cfg: Config, stream: int) -> gym.Env:
    e = cfg.env
    env_id = resolve_env_id(e.id)
    kwargs: dict[str, Any] = dict(e.kwargs)
    if _is_dmc(env_id):
        env = _make_dmc(cfg, env_id, kwargs)
        return SeededEpisodes(PixelDict(env, e.frame_stack, e.state, e.image_size, e.id), stream)
    if e.max_episode_steps:
        kwargs["max_episode_steps"] = e.max_episode_steps
    if env_id.startswith(CODE_PREFIX):
        env = _make_code_env(cfg, env_id, kwargs)
    elif _is_visppo_task(env_id):
        if e.camera not in ("", "policy"):
            raise ConfigError(f"env.camera={e.camera}: visppo's tasks see through their fixed camera 'policy' "
                              "(it frames the workspace); remove env.camera")
        env = gym.make(env_id, image_size=e.image_size,
                       obs_mode="pixels_state" if e.state else "pixels", **kwargs)
        if e.render_samples >= 0:
            set_render_samples(env, e.render_samples, env_id)
    elif runs_apart(cfg) and not env_process.in_worker:
        env = EnvProcess(functools.partial(_make_gymnasium, cfg, env_id, kwargs), e.id, worker_start_method())
    else:
        env = _make_gymnasium(cfg, env_id, kwargs)
    if e.action_repeat > 1:
        env = ActionRepeat(env, e.action_repeat)
    return SeededEpisodes(PixelDict(env, e.frame_stack, e.state, e.image_size, e.id), stream)


def _make_gymnasium(cfg: Config, env_id: str, kwargs: dict[str, Any]) -> gym.Env:
    """A gymnasium id: its rendered frames (env.pixels), else its own observations."""
    if cfg.env.pixels:
        return _make_rendered(cfg, env_id, kwargs)
    if cfg.env.camera:
        raise ConfigError(f"env.camera={cfg.env.camera}: with env.pixels=false the env's own observations choose "
                          "their camera: remove env.camera, or set env.pixels=true to train on rendered frames")
    env = gym.make(env_id, **kwargs)
    if cfg.env.render_samples >= 0:  # its image observations may come from a MuJoCo renderer too
        set_render_samples(env, cfg.env.render_samples, env_id)
    return env


def is_module_id(env_id: str) -> bool:
    """``module:EnvId``: a user's own env, whose module visppo imports."""
    return ":" in env_id and not _is_dmc(env_id) and not env_id.startswith(CODE_PREFIX)


def runs_apart(cfg: Config) -> bool:
    """Whether the env runs in processes of its own: a user's env (``module:EnvId``) unless
    ``env.vector=sync``. Its vector env steps in async workers (:func:`use_async`) and a single env
    (the start check, evaluation) in an :class:`EnvProcess`, so that a crash of its code (a
    segfault, ``os._exit``) ends as one error naming the env rather than as the run's silent end."""
    return is_module_id(cfg.env.id) and cfg.env.vector != "sync"


def register_code_env(factory: Callable[..., gym.Env], env_id: str | None = None) -> str:
    """Give ``factory`` (a callable that returns a gymnasium env, e.g. a class or a function) an id
    that :func:`make_env` builds by calling it, in place of ``gymnasium.make``; the same factory
    keeps its id. ``env_id``: the id it had in the parent (a worker process registers it again)."""
    for known, registered in _CODE_ENVS.items():
        if registered is factory and env_id in (None, known):
            return known
    if env_id is None:
        named = getattr(factory, "func", factory)  # functools.partial
        name = getattr(named, "__name__", None) or type(named).__name__
        name = re.sub(r"[^A-Za-z0-9_.]+", "_", name).strip("_") or "env"
        version = sum(1 for known in _CODE_ENVS if known.rsplit("-v", 1)[0] == f"{CODE_PREFIX}{name}")
        env_id = f"{CODE_PREFIX}{name}-v{version}"
    _CODE_ENVS[env_id] = factory
    return env_id


def code_env_pickles(env_id: str) -> bool:
    """Whether the env of ``env_id`` can be built in a worker process: a registered id, or a code env
    whose factory survives pickling (cloudpickle, as gymnasium's async vector env sends it)."""
    factory = _CODE_ENVS.get(env_id)
    if factory is None:
        return True
    import cloudpickle

    try:
        cloudpickle.loads(cloudpickle.dumps(factory))
    except Exception:
        return False
    return True


def _make_code_env(cfg: Config, env_id: str, kwargs: dict[str, Any]) -> gym.Env:
    """An env built in code: ``factory(**env.kwargs)`` under a TimeLimit of ``env.max_episode_steps``;
    its image observations as they are, else (with env.pixels) its rendered frames."""
    steps = kwargs.pop("max_episode_steps", 0)
    env = _CODE_ENVS[env_id](**kwargs)
    if not isinstance(env, gym.Env):
        raise ConfigError(f"env= for {env_id} returned a {type(env).__name__}, not a gymnasium env: give a "
                          "callable that returns one (e.g. the env's class)")
    if cfg.env.camera:
        env.close()
        raise ConfigError(f"env.camera={cfg.env.camera}: an env built in code renders its own view; choose the "
                          "camera where env= builds it and leave env.camera empty")
    if cfg.env.render_samples >= 0:  # before any frame is rendered, as for a registered id
        set_render_samples(env, cfg.env.render_samples, env_id)
    if steps:
        env = gym.wrappers.TimeLimit(env, steps)
    if looks_like_image(env.observation_space) or not cfg.env.pixels:
        return env  # PixelDict refuses observations that are not images, and CxHxW ones naming the transpose
    if env.render_mode != "rgb_array":
        env.close()
        raise ConfigError(f"the env of {env_id} observes no images and does not render frames (render_mode "
                          f"{env.render_mode!r}): build it with render_mode='rgb_array', or give image observations")
    return gym.wrappers.AddRenderObservation(env, render_only=not cfg.env.state,
                                             render_key="pixels", obs_key="state")


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
    if not env_process.in_worker:  # the learner's process (a sweep's child too), not a worker
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
    except TypeError as exc:  # envs that do not take a render size (the camera, asked for, must still be taken)
        if not refused_arguments(exc, ("width", "height"), entry=_entry_name(env_id)):
            raise  # the constructor's own TypeError: not run a second time
        try:
            env = gym.make(env_id, render_mode="rgb_array", **cam, **kwargs)
        except TypeError:
            if cam:
                raise ConfigError(f"env.camera={e.camera}: {e.id} takes no camera_name: remove env.camera") from None
            raise
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
    if env_id.startswith(CODE_PREFIX):
        resolve_env_id(env_id)
        return
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

    A user's env (``module:EnvId``) goes to workers whatever the CPUs (:func:`runs_apart`). An env
    built in code goes to workers only if its callable pickles; ``async`` refuses one that does not.
    """
    if runs_apart(cfg):
        return True
    if cfg.env.vector == "auto":
        rendered = cfg.ppo.num_envs > 1 and not cfg.env.id.startswith(SYNTHETIC_PREFIX)
        return rendered and usable_cpus() > 2 and code_env_pickles(cfg.env.id)
    if cfg.env.vector == "async" and not code_env_pickles(cfg.env.id):
        raise ConfigError(f"env.vector=async sends the env to worker processes, and the callable behind "
                          f"{cfg.env.id} cannot be pickled: use env.vector=sync (or auto), or a module-level "
                          "function or class")
    return cfg.env.vector == "async"


def _thunk(cfg: Config):
    factory = _CODE_ENVS.get(cfg.env.id)  # travels to a worker with the thunk
    path = list(sys.path)  # and this process's sys.path (the forkserver has the one of its start)
    creator = os.getpid()  # a SyncVectorEnv calls make() here: the learner, whatever process made it

    def make() -> gym.Env:
        if os.getpid() != creator:  # an AsyncVectorEnv's worker
            env_process.in_worker = True
            ignore_stop_signals()
            sys.path[:] = path
            if factory is not None:
                register_code_env(factory, cfg.env.id)
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


@functools.cache
def worker_start_method() -> str:
    """How env processes (async workers, an :class:`EnvProcess`) start: ``forkserver`` (forking
    after an EGL context hangs), else ``spawn``.

    The first call also sets this process's forkserver preload list (multiprocessing keeps one
    per process): the server, once it starts, imports the main module and this one, so that each
    worker forks with gymnasium and visppo loaded (1-2 s less per worker on a busy machine)."""
    if "forkserver" not in multiprocessing.get_all_start_methods():
        return "spawn"
    multiprocessing.get_context("forkserver").set_forkserver_preload(["__main__", __name__])
    return "forkserver"


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
        ctx = worker_start_method()
        envs = gym.vector.AsyncVectorEnv(fns, shared_memory=True, context=ctx, autoreset_mode=mode)
    else:
        envs = gym.vector.SyncVectorEnv(fns, autoreset_mode=mode)
    envs.env_id = cfg.env.id  # for error messages that name the env
    return envs


def close_vector_env(envs: gym.vector.VectorEnv, failing: bool = False) -> None:
    """Close the envs on the way out. An env whose close fails is a RunError naming it, unless the
    run is ``failing`` already (that error matters more); async workers that cannot be closed
    cleanly (one died, a step is pending) are let go: their pipes closed, they close their envs."""
    env_id = getattr(envs, "env_id", "?")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # gymnasium's notes on closing a vector env whose step failed
        try:
            with env_errors(env_id, "close"):
                envs.close()
        except RunError:
            if isinstance(envs, gym.vector.AsyncVectorEnv):
                _let_workers_go(envs)
            if not failing:
                raise


def _let_workers_go(envs: gym.vector.AsyncVectorEnv) -> None:
    """Close the pipes to ``envs``' workers: each then closes its env and ends (a worker ignores
    SIGTERM, see :func:`ignore_stop_signals`); one still alive 10 s later is killed."""
    for pipe in envs.parent_pipes:
        if pipe is not None:
            pipe.close()
    for process in envs.processes:
        process.join(timeout=10)
        if process.is_alive():
            process.kill()
            process.join()
    envs.closed = True  # nothing left for its __del__ to close


@contextmanager
def worker_errors(envs: gym.vector.VectorEnv, env_id: str, during: str) -> Iterator[None]:
    """Turn a dead or failing worker into an :class:`EnvError` naming the env and the call
    (``during``: "reset", "step").

    A worker that raises sends its exception back (gymnasium re-raises it here, and logs its
    traceback as a warning, which would bury the one line: silenced for this call alone);
    a worker process that dies (segfault, OOM kill) closes its pipe, which
    surfaces as EOFError / BrokenPipeError instead of a hang.
    """
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=r".*ERROR: ", category=UserWarning,
                                    module=r"gymnasium\.vector\.async_vector_env")
            yield
    except RunError:
        raise
    except (EOFError, BrokenPipeError, ConnectionResetError) as exc:
        processes = getattr(envs, "processes", [])
        deadline = time.monotonic() + 2  # a dying worker's exit code comes a moment after its pipe closes
        while all(p.exitcode is None for p in processes) and time.monotonic() < deadline:
            time.sleep(0.01)
        dead = [f"worker {i} {how_it_ended(p.exitcode)}" for i, p in enumerate(processes) if p.exitcode is not None]
        raise EnvError(f"env {env_id}: during {during}, {', '.join(dead) or f'a worker died ({type(exc).__name__})'}"
                       ) from None
    except (Exception, SystemExit) as exc:  # an in-process env's sys.exit too
        raise EnvError(f"env {env_id} failed during {during}: {raised(exc)}") from exc
