"""The Python API behind ``visppo.train(...)``: a config from a path, a dict or the defaults, keyword
overrides, and an env built in code.

Overrides are keyword arguments named ``section__key`` (two underscores for each dot of
``section.key``): ``ppo__total_steps=4096``, ``env__kwargs__look="fast"``. Their values are Python
values, not strings to parse. They go over the config, which goes over the defaults.

``env`` is a callable that returns a gymnasium env (a class, a function, a ``functools.partial``);
visppo calls it in place of ``gymnasium.make`` for every env copy, training's and
evaluation's, and wraps what it returns as it wraps any env (frame stack, action repeat,
seeded episodes; ``env__max_episode_steps=N`` adds a time limit, which an env whose episodes
never end by themselves needs, or its evaluation episodes never end). Its image observations
are used as they are (uint8 HxWxC, or a dict with ``"pixels"`` and ``"state"``); an env that
observes no images is rendered (it must be built with ``render_mode="rgb_array"``). The run's ``env.id`` is then ``code/<name>-v<n>``, a name
this process alone knows, so the run directory also gets ``policy.json`` (what the policy
reads and how it acts), with which :func:`visppo.load_policy` loads its policy anywhere.
Worker processes (``env.vector``) get the callable only if it pickles; otherwise the envs
step in this process.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import gymnasium as gym

from visppo.config import Config, build_config, read_config_file, to_dict
from visppo.deploy import write_spec
from visppo.envs import register_code_env
from visppo.errors import ConfigError, Stopped


def train(config: str | os.PathLike | Mapping | Config | None = None, *,
          env: Callable[..., gym.Env] | None = None, **overrides: Any) -> Path:
    """Train a policy; returns its run directory.

    ``config``: a YAML file's path, a dict in the YAML's layout (``{"ppo": {"total_steps": 4096}}``),
    a :class:`visppo.config.Config`, or None for the defaults. ``overrides``: ``section__key=value``.
    ``env``: a callable returning a gymnasium env, used in place of ``gymnasium.make``.
    Bad input raises :class:`visppo.config.ConfigError` before anything is written.
    """
    cfg = make_config(config, overrides, env)
    from visppo.loop import default_run_dir
    from visppo.loop import train as run_loop

    if env is not None and not cfg.run.dir:
        cfg.run.dir = str(default_run_dir(cfg))  # known now: policy.json goes there even if stopped
    try:
        run_dir = run_loop(cfg)
    except Stopped:
        if env is not None and (Path(cfg.run.dir) / "checkpoints").is_dir():
            write_spec(Path(cfg.run.dir), cfg)
        raise
    if env is not None:
        write_spec(run_dir, cfg)
    return run_dir


def make_config(config: Any, overrides: Mapping[str, Any], env: Callable[..., gym.Env] | None = None) -> Config:
    """The validated config of ``visppo.train``'s arguments."""
    data, source = _config_data(config)
    given = nested_overrides(overrides)
    data = merge(data, given)
    if env is not None:
        if not callable(env):
            raise ConfigError(f"env={env!r} is not callable: give a callable that returns a gymnasium env (its "
                              "class, a function), or name a registered id with env__id=...")
        if isinstance(given.get("env"), Mapping) and "id" in given["env"]:
            raise ConfigError("give env= (an env built in code) or env__id= (a registered id), not both")
        data = merge(data, {"env": {"id": register_code_env(env)}})
    return build_config(data, source=source)


def _config_data(config: Any) -> tuple[dict, str]:
    if config is None:
        return {}, "the defaults"
    if isinstance(config, Config):
        return to_dict(config), "the Config given"
    if isinstance(config, Mapping):
        return merge({}, config), "the config dict"
    if isinstance(config, (str, os.PathLike)):
        path = Path(config)
        if not path.is_file():
            raise ConfigError(f"config file {path} not found: give the path of a YAML file (see configs/), a dict "
                              "or None")
        return read_config_file(path), str(path)
    raise ConfigError(f"config must be a YAML file's path, a dict, a Config or None, not a {type(config).__name__}")


def nested_overrides(overrides: Mapping[str, Any]) -> dict:
    """``{"ppo__total_steps": 4096}`` -> ``{"ppo": {"total_steps": 4096}}``."""
    out: dict = {}
    for name, value in overrides.items():
        parts = name.split("__")
        if len(parts) < 2 or not all(parts):
            raise ConfigError(f"visppo.train({name}=...): name an override section__key, e.g. ppo__total_steps=4096 "
                              "for ppo.total_steps")
        out = merge(out, _nest(parts, value))
    return out


def _nest(parts: list[str], value: Any) -> dict:
    return {parts[0]: _nest(parts[1:], value) if len(parts) > 1 else value}


def merge(base: Mapping, over: Mapping) -> dict:
    """``over``'s keys over ``base``'s; nested mappings merge, other values replace (copies, not views)."""
    out = {k: merge({}, v) if isinstance(v, Mapping) else v for k, v in base.items()}
    for key, value in over.items():
        if isinstance(value, Mapping):
            out[key] = merge(out[key] if isinstance(out.get(key), Mapping) else {}, value)
        else:
            out[key] = value
    return out
