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

from visppo.config import CODE_PREFIX, Config, build_config, names_a_file, read_config_file, to_dict
from visppo.envs import register_code_env
from visppo.errors import ConfigError


def train(config: str | os.PathLike | Mapping | Config | None = None, *,
          env: Callable[..., gym.Env] | None = None, resume: str | os.PathLike | None = None,
          **overrides: Any) -> Path:
    """Train a policy; returns its run directory.

    ``config``: a YAML file's path, a dict in the YAML's layout (``{"ppo": {"total_steps": 4096}}``),
    a :class:`visppo.config.Config`, or None for the defaults. ``overrides``: ``section__key=value``.
    ``env``: a callable returning a gymnasium env, used in place of ``gymnasium.make``.
    ``resume``: a run directory (or one of its ``checkpoints/iter_N.pt``) to go on from, as
    ``visppo train --resume`` does, with only the overrides a resume takes; a run on an env built
    in code needs that env again (``env=``), since no other process can build it.
    Bad input raises :class:`visppo.errors.UserError` (a config: its ConfigError; a checkpoint that
    cannot be resumed: CheckpointError) before anything is written.
    """
    from visppo.loop import train as run_loop

    ckpt = None
    if resume is not None:
        if config is not None:  # the CLI refuses a CONFIG beside --resume alike
            raise ConfigError("resume= trains on the run's saved config: give only the overrides a resume "
                              "takes (e.g. ppo__total_steps=...), not config")
        cfg, ckpt = resume_config(resume, overrides, env)
    else:
        cfg = make_config(config, overrides, env)
    return run_loop(cfg, resume=ckpt)  # a run on an env built in code writes policy.json as it starts


def resume_config(run: str | os.PathLike, overrides: Mapping[str, Any],
                  env: Callable[..., gym.Env] | None) -> tuple[Config, dict]:
    """The config and checkpoint to resume ``run`` with (:func:`visppo.checkpoint.load_for_resume`);
    a run on an env built in code gets ``env`` under the id it trained with."""
    from visppo.checkpoint import load_for_resume, resume_paths, trained_env_id

    if isinstance(run, (str, os.PathLike)) and not names_a_file(run) and not Path(run).is_dir():
        raise ConfigError(f"resume={str(run)!r} is not a run directory or checkpoint")
    items = [f"{'.'.join(name.split('__'))}={_dotlist_value(value)}" for name, value in overrides.items()]
    run_dir, latest = resume_paths(run)
    saved_id = trained_env_id(run_dir)
    if saved_id.startswith(CODE_PREFIX):
        if env is None or not callable(env):
            raise ConfigError(f"{run_dir} trained on an env built in code ({saved_id}): give it again, "
                              f"visppo.train(resume={str(run)!r}, env=<the env>)")
        register_code_env(env, env_id=saved_id)
    elif env is not None:
        raise ConfigError(f"{run_dir} trained on {saved_id}, not on an env built in code: resume it without env=")
    return load_for_resume(run, items)


def _dotlist_value(value: Any) -> str:
    """A resume override's value as the command line writes it (numbers, booleans, strings)."""
    if isinstance(value, bool):
        return str(value).lower()
    return str(value)


def make_config(config: Any, overrides: Mapping[str, Any], env: Callable[..., gym.Env] | None = None) -> Config:
    """The validated config of ``visppo.train``'s arguments."""
    data, source = _config_data(config)
    given = nested_overrides(overrides)
    data = plain(merge(data, given))
    if given:  # an error names where to look: the file (or dict), or the keywords
        source = f"{source} or the keyword overrides"
    if env is not None:
        if not callable(env):
            raise ConfigError(f"env={env!r} is not callable: give a callable that returns a gymnasium env (its "
                              "class, a function), or name a registered id with env__id=...")
        if isinstance(given.get("env"), Mapping) and "id" in given["env"]:
            raise ConfigError("give env= (an env built in code) or env__id= (a registered id), not both")
        data = merge(data, {"env": {"id": register_code_env(env)}})
    return build_config(data, source=source)


def plain(value: Any, key: str = "") -> Any:
    """``value`` as the plain data config.yaml and a checkpoint keep (str, int, float, bool, None,
    lists, dicts): a path becomes its string, a numpy (or torch) number or array its Python number
    or list; anything else is a ConfigError naming the key (it would be written, then refused when
    the run is read back)."""
    if isinstance(value, Mapping):
        return {k: plain(v, f"{key}.{k}" if key else str(k)) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [plain(v, key) for v in value]
    if isinstance(value, os.PathLike):
        return os.fspath(value)
    if hasattr(value, "tolist") and hasattr(value, "shape"):  # numpy and torch numbers and arrays
        return plain(value.tolist(), key)
    if value is None or isinstance(value, (str, int, float, bool)):
        return value
    raise ConfigError(f"{key}={value!r}: its type, {type(value).__name__}, is not plain data that config.yaml and the "
                      "checkpoint can keep: give a str, number, bool, list or dict")


def _config_data(config: Any) -> tuple[dict, str]:
    if config is None:
        return {}, "the defaults"
    if isinstance(config, Config):
        return to_dict(config), "the Config given"
    if isinstance(config, Mapping):
        return merge({}, config), "the config dict"
    if isinstance(config, (str, os.PathLike)):
        path = Path(config)
        if not names_a_file(path):
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
