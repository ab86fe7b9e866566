"""An env checked once, before any run directory is made: its spaces, one reset and one step.
(A leaf: imports nothing of visppo but its errors; the env is built by the caller's ``make_env``.)

:func:`validate_spaces` is what visppo can act in (beside :func:`visppo.config.validate`, which
checks the config alone): an image observation (alone, or ``"pixels"`` in a Dict with an
optional ``"state"`` Box) and a flat float Box or a Discrete action space.
:func:`check_env` builds one env as training does, checks its spaces, resets it and steps it
once, and names the first defect as a :class:`ConfigError` (the env is the user's input: exit 2,
nothing written). Errors of an env during a run are :class:`EnvError` (:func:`env_errors`), and so
is a crash of the process a user's env runs in (:mod:`visppo.env_process`), in the check too.
"""

from __future__ import annotations

import math
import numbers
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import gymnasium as gym
import numpy as np

from visppo.errors import ConfigError, EnvDied, EnvError, RunError, UserError

FIX = "fix the env (or its env.kwargs)"


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return f"{type(exc).__name__}: {text.splitlines()[0][:200]}" if text else type(exc).__name__


# --------------------------------------------------------------------------- spaces


IMAGE_CHANNELS = (1, 3, 4)
"""Channels of a frame visppo takes, last (HxWxC): gray, RGB, RGBA (videos show the RGB)."""


def _pixels(space: Any) -> Any:
    """The image part of an observation space: its "pixels" in a Dict, else the space itself."""
    return space["pixels"] if isinstance(space, gym.spaces.Dict) and "pixels" in space.spaces else space


def _is_uint8_3d(space: Any) -> bool:
    return isinstance(space, gym.spaces.Box) and space.dtype == np.uint8 and len(space.shape) == 3


def looks_like_image(space: Any) -> bool:
    """A uint8 Box of three axes in any layout (or a Dict holding one under "pixels"): an env's own
    frames, which :func:`check_observation_space` takes (HxWxC) or refuses naming what to change,
    rather than frames to render in their place."""
    return _is_uint8_3d(_pixels(space))


def is_image_space(space: Any) -> bool:
    """An image as cameras and gymnasium's renderers give it, channels last (a uint8 HxWxC Box, C in
    :data:`IMAGE_CHANNELS`), or a Dict holding one under "pixels": what :func:`visppo.envs.chw_frame`
    transposes for the network."""
    pix = _pixels(space)
    return _is_uint8_3d(pix) and pix.shape[-1] in IMAGE_CHANNELS


def is_channel_first(space: Any) -> bool:
    """A uint8 CxHxW image (or a Dict holding one under "pixels"), as some envs and wrappers give
    frames: visppo refuses it with the transpose to make rather than reading its rows as channels."""
    pix = _pixels(space)
    return _is_uint8_3d(pix) and pix.shape[0] in IMAGE_CHANNELS and pix.shape[-1] not in IMAGE_CHANNELS


def _layout_error(space: Any, env_name: str) -> ConfigError:
    """What to change of a 3-D uint8 observation that is not HxWxC with 1, 3 or 4 channels."""
    shape = _pixels(space).shape
    if is_channel_first(space):
        return ConfigError(f"env {env_name}: its image observation has shape {shape}, channels first (CxHxW): "
                           f"visppo takes HxWxC frames; transpose them in the env (np.transpose(frame, (1, 2, 0)), "
                           f"and its observation space to shape {(shape[1], shape[2], shape[0])})")
    return ConfigError(f"env {env_name}: its image observation has shape {shape}, {shape[-1]} channels last: "
                       "visppo takes HxWxC frames of 1 (gray), 3 (RGB) or 4 (RGBA) channels; give the env's "
                       "frames one of those")


def check_observation_space(space: Any, keep_state: bool, env_name: str) -> gym.spaces.Box:
    """The image space of an env's observations (HxWxC uint8 Box, alone or under "pixels" of a
    Dict, with a "state" Box when ``keep_state``); else a ConfigError saying what to change."""
    if not isinstance(space, gym.spaces.Space):
        raise ConfigError(f"env {env_name}: its observation_space is a {type(space).__name__}, not a gymnasium "
                          f"space: {FIX}")
    if isinstance(space, gym.spaces.Dict) and "pixels" not in space.spaces:
        raise ConfigError(f"env {env_name}: its Dict observation has no 'pixels' key (it has "
                          f"{', '.join(map(repr, space.spaces))}): name the camera image 'pixels' (and the "
                          "vector 'state'), or set env.pixels=true to render frames")
    if looks_like_image(space) and not is_image_space(space):
        raise _layout_error(space, env_name)
    if not is_image_space(space):
        raise ConfigError(
            f"env {env_name}: its observation {space} is not an image (uint8 HxWxC): set env.pixels=true to "
            "render frames, or pick an env with image observations")
    pix = space["pixels"] if isinstance(space, gym.spaces.Dict) else space
    if keep_state:
        if not isinstance(space, gym.spaces.Dict) or "state" not in space.spaces:
            raise ConfigError(f"env.state=true but {env_name} gives no state vector")
        if not isinstance(space["state"], gym.spaces.Box):
            raise ConfigError(f"env {env_name}: its 'state' observation is {space['state']}, not a Box of numbers: "
                              f"{FIX}, or set env.state=false")
    return pix


def check_action_space(space: Any, env_name: str) -> None:
    """A flat float Box (a Gaussian acts in it) or a Discrete starting at 0 (a categorical)."""
    if isinstance(space, gym.spaces.Box):
        if len(space.shape) != 1 or not np.issubdtype(space.dtype, np.floating):
            raise ConfigError(f"env {env_name}: its action space {space} is not a flat float vector: visppo's "
                              "Gaussian acts in a 1-D float Box (flatten the env's actions, e.g. with "
                              "gymnasium.wrappers.ReshapeAction, or make its dtype float32)")
        return
    if isinstance(space, gym.spaces.Discrete):
        if int(space.start) != 0:
            raise ConfigError(f"env {env_name}: its action space {space} starts at {space.start}: visppo acts "
                              "with 0 .. n-1 (give the env Discrete(n) with start=0)")
        return
    kind = type(space).__name__ if isinstance(space, gym.spaces.Space) else f"a {type(space).__name__}"
    raise ConfigError(f"env {env_name}: action space {space if isinstance(space, gym.spaces.Space) else kind} "
                      "is not supported: use Box (a 1-D float vector) or Discrete")


def validate_spaces(observation_space: Any, action_space: Any, cfg) -> None:
    """What visppo can act in, for ``cfg`` (its env.state)."""
    name = cfg.env.id
    check_observation_space(observation_space, cfg.env.state, name)
    check_action_space(action_space, name)


# --------------------------------------------------------------------------- one reset, one step


def _own_env(env: gym.Env) -> gym.Env:
    """The env below visppo's own wrappers (the one gymnasium made), whose outputs are the user's."""
    while isinstance(env, gym.Wrapper) and type(env).__module__ == "visppo.envs":
        env = env.env
    return env


def _check_obs(obs: Any, space: gym.Space, name: str, where: str) -> None:
    """An observation fits its space's layout: the same keys, shapes and dtype kinds; finite state."""
    parts = obs if isinstance(space, gym.spaces.Dict) else {"": obs}
    spaces = space.spaces if isinstance(space, gym.spaces.Dict) else {"": space}
    if not isinstance(parts, dict):
        raise ConfigError(f"env {name}: {where} returned a {type(obs).__name__} observation for its Dict "
                          f"observation space: {FIX}")
    for key, sub in spaces.items():
        label = f"observation '{key}'" if key else "observation"
        if key not in parts:
            raise ConfigError(f"env {name}: {where} returned no {label}: {FIX}")
        if not isinstance(sub, gym.spaces.Box):
            continue
        try:
            value = np.asarray(parts[key])
        except Exception as exc:  # noqa: BLE001 - anything that is not an array is the env's defect
            raise ConfigError(f"env {name}: {where} returned an {label} that is not an array ({_first_line(exc)}): "
                              f"{FIX}") from None
        if value.shape != sub.shape:
            raise ConfigError(f"env {name}: {where} returned an {label} of shape {value.shape}, its space "
                              f"says {sub.shape}: {FIX}")
        if sub.dtype == np.uint8 and value.dtype != np.uint8:
            raise ConfigError(f"env {name}: {where} returned an {label} of dtype {value.dtype}, its space "
                              f"says uint8: {FIX}")
        if not np.issubdtype(value.dtype, np.number) and value.dtype != np.bool_:
            raise ConfigError(f"env {name}: {where} returned an {label} of dtype {value.dtype}, not numbers: {FIX}")
        if np.issubdtype(value.dtype, np.floating) and not np.isfinite(value).all():
            raise ConfigError(f"env {name}: {where} returned a non-finite {label} "
                              f"({value[~np.isfinite(value)].flat[0]}): {FIX}")


def _is_flag(value: Any) -> bool:
    """True or False (numpy's too, and 0 / 1)."""
    if isinstance(value, np.ndarray) and value.shape == ():
        value = value.item()
    return isinstance(value, (bool, np.bool_)) or (isinstance(value, numbers.Integral) and value in (0, 1))


def check_reward(reward: Any, name: str, where: str, error=ConfigError) -> None:
    """A reward is one finite real number."""
    if isinstance(reward, np.ndarray) and reward.size == 1:
        reward = reward.reshape(()).item()
    if not isinstance(reward, numbers.Real) or isinstance(reward, (bool, np.bool_)):
        raise error(f"env {name}: {where} returned a reward of type {type(reward).__name__} ({str(reward)[:40]}), "
                    f"not a number: {FIX}")
    if not math.isfinite(float(reward)):
        raise error(f"env {name}: {where} returned a non-finite reward ({reward}): {FIX}")


def check_success(info: Any, name: str, where: str, error=ConfigError) -> None:
    """``info["is_success"]``, when there, is a bool (or 0 / 1)."""
    if isinstance(info, dict) and "is_success" in info:
        value = info["is_success"]
        if not _is_flag(value):
            raise error(f"env {name}: {where} returned info['is_success']={value!r}: it must be True or False")


def check_env(cfg, make_env: Callable[[Any], gym.Env], seed: int = 0) -> None:
    """Build one env with ``make_env(cfg)`` (:func:`visppo.envs.make_env`: as training builds them),
    check its spaces, reset it once and step it once with a sampled action; the first defect found
    is a ConfigError naming the env and what is wrong."""
    name = cfg.env.id
    with warnings.catch_warnings():  # gymnasium's checker warns of what this names as one line (and
        warnings.simplefilter("ignore")  # warns again, once per env, when the run's envs start)
        _check_env(cfg, name, seed, make_env)


def _check_env(cfg, name: str, seed: int, make_env) -> None:
    try:
        env = make_env(cfg)
    except (UserError, EnvDied):  # the process it runs in died (visppo.env_process): a run error
        raise
    except EnvError as exc:  # its constructor's own TypeError (visppo.envs.make_env): bad input, as any other's
        raise ConfigError(str(exc)) from None
    except (Exception, SystemExit) as exc:  # noqa: BLE001 - the user's constructor
        raise ConfigError(f"env {name} could not be made: its constructor {raised(exc)}: {FIX}") from None
    try:
        own = _own_env(env)
        validate_spaces(own.observation_space, env.action_space, cfg)
        _check_reset(own, name, seed)
        _check_step(own, name)
    finally:
        try:
            env.close()
        except (Exception, SystemExit):  # noqa: BLE001 - a defect already reported matters more
            pass


def raised(exc: BaseException) -> str:
    """What an env's call did, for an error line: "raised ValueError: ...", "called sys.exit(3)"."""
    if isinstance(exc, SystemExit):
        return f"called sys.exit({exc.code})"
    return f"raised {_first_line(exc)}"


def _check_reset(env: gym.Env, name: str, seed: int) -> None:
    try:
        out = env.reset(seed=seed)
    except RunError:
        raise
    except (Exception, SystemExit) as exc:  # noqa: BLE001
        raise ConfigError(f"env {name}: reset() {raised(exc)}: {FIX}") from None
    if not (isinstance(out, tuple) and len(out) == 2):
        raise ConfigError(f"env {name}: reset() returned a {type(out).__name__}"
                          f"{f' of {len(out)}' if isinstance(out, tuple) else ''}, not (observation, info): {FIX}")
    obs, info = out
    if not isinstance(info, dict):
        raise ConfigError(f"env {name}: reset() returned info of type {type(info).__name__}, not a dict: {FIX}")
    _check_obs(obs, env.observation_space, name, "reset()")


def _check_step(env: gym.Env, name: str) -> None:
    try:
        out = env.step(env.action_space.sample())
    except RunError:
        raise
    except (Exception, SystemExit) as exc:  # noqa: BLE001
        raise ConfigError(f"env {name}: step() {raised(exc)}: {FIX}") from None
    if not (isinstance(out, tuple) and len(out) == 5):
        raise ConfigError(f"env {name}: step() returned a {type(out).__name__}"
                          f"{f' of {len(out)}' if isinstance(out, tuple) else ''}, not (observation, reward, "
                          f"terminated, truncated, info): {FIX}")
    obs, reward, terminated, truncated, info = out
    check_reward(reward, name, "step()")
    for label, flag in (("terminated", terminated), ("truncated", truncated)):
        if not _is_flag(flag):
            raise ConfigError(f"env {name}: step() returned {label}={flag!r} ({type(flag).__name__}), "
                              f"not a bool: {FIX}")
    if not isinstance(info, dict):
        raise ConfigError(f"env {name}: step() returned info of type {type(info).__name__}, not a dict: {FIX}")
    check_success(info, name, "step()")
    _check_obs(obs, env.observation_space, name, "step()")


# --------------------------------------------------------------------------- during a run


@contextmanager
def env_errors(env_id: str, during: str) -> Iterator[None]:
    """An env that raises (or calls ``sys.exit``) while visppo drives it in this process, e.g.
    during an evaluation: one :class:`EnvError` naming the env and what it raised."""
    try:
        yield
    except (UserError, RunError):
        raise
    except (Exception, SystemExit) as exc:  # noqa: BLE001
        raise EnvError(f"env {env_id} failed during {during}: {raised(exc)}") from None


def check_rollout_step(env_id: str, reward: np.ndarray, obs: dict[str, np.ndarray]) -> None:
    """A vector env's step during a rollout: finite rewards (a ``None`` reward arrives as NaN) and a
    finite state vector, else an EnvError naming the env (rather than a divergence later)."""
    bad = ~np.isfinite(reward)
    if bad.any():
        i = int(np.flatnonzero(bad)[0])
        raise EnvError(f"env {env_id} returned a non-finite reward ({reward[i]}) in env {i} (a reward of None "
                       f"reads as nan): {FIX}")
    check_state(env_id, obs)


def check_state(env_id: str, obs: dict[str, np.ndarray], envs: np.ndarray | None = None,
                what: str = "state observation") -> None:
    """A batch of observations (of the vector env's ``envs``, default 0..n-1) has a finite state
    vector, else an EnvError naming the env."""
    state = obs.get("state")
    if state is not None and not np.isfinite(state).all():
        i = int(np.flatnonzero(~np.isfinite(state).all(axis=tuple(range(1, state.ndim))))[0])
        raise EnvError(f"env {env_id} returned a non-finite {what} in env "
                       f"{i if envs is None else int(envs[i])}: {FIX}")


def success_of(value: Any, env_id: str) -> float:
    """An ended episode's ``info["is_success"]`` as 0.0 / 1.0; anything but a bool is an EnvError."""
    if not _is_flag(value):
        raise EnvError(f"env {env_id} returned info['is_success']={value!r}: it must be True or False")
    return float(value)
