"""Shared fixtures: small configs that train in seconds on a CPU."""

from __future__ import annotations

import csv
import math
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import torch._dynamo  # noqa: F401  before any test makes a GL context (see envs.preload_before_gl)
import yaml

import visppo_envs  # noqa: F401  selects EGL before a test module's own `import mujoco` (one file run alone)
from visppo.config import load_config

# two test processes (pytest -n 2 in pyproject.toml) of one thread each fill a 2-core machine;
# alone (-n 0, or -p no:xdist) a process takes both cores.
torch.set_num_threads(1 if os.environ.get("PYTEST_XDIST_WORKER") else 2)

REPO = Path(__file__).resolve().parents[1]


@pytest.hookimpl(tryfirst=True)  # before xdist's own, which reads the groups
def pytest_collection_modifyitems(config, items):
    """Tests marked ``cuda`` skip without a GPU and form one xdist group (``--dist loadgroup``),
    so one test process runs them all, in turn: two processes on one GPU would read each other's
    memory as their own (the CUDA context measurement and tools/validate_probe.py read the
    device-wide use). Within the group, the ones that measure in child processes
    (``cuda_children``) run first, before this process has made a CUDA context of its own."""
    for item in items:
        if item.get_closest_marker("cuda"):
            item.add_marker(pytest.mark.xdist_group("cuda"))
            if not torch.cuda.is_available():
                item.add_marker(pytest.mark.skip(reason="needs CUDA"))
    items.sort(key=lambda item: 0 if item.get_closest_marker("cuda_children") else 1)  # stable


@pytest.fixture(autouse=True, scope="session")
def _own_cache_home(tmp_path_factory):
    """The tests' caches (the measured CUDA context) go to a folder of their own, never the
    user's; torchvision's weights are still looked for where they were (``TORCH_HOME``)."""
    saved = {k: os.environ.get(k) for k in ("XDG_CACHE_HOME", "TORCH_HOME")}
    os.environ["TORCH_HOME"] = torch.hub.get_dir().removesuffix("/hub")
    os.environ["XDG_CACHE_HOME"] = str(tmp_path_factory.mktemp("cache_home"))
    yield
    for k, v in saved.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


def tiny_overrides(tmp_path=None, **extra) -> list[str]:
    """A DotReach run small enough for a unit test: 2 envs x 32 steps, 48x48 frames."""
    base = {
        "env.id": "visppo/DotReach-v0",
        "ppo.num_envs": 2, "ppo.num_steps": 32, "ppo.minibatch_size": 32, "ppo.num_epochs": 2,
        "ppo.total_steps": 128, "model.feature_dim": 32, "model.hidden_dim": 32, "env.image_size": 48,
        "train.amp": "off", "train.device": "cpu", "run.progress": False,
        "run.tensorboard": False,
    }
    if tmp_path is not None:
        base["run.dir"] = str(tmp_path / "run")
    base.update(extra)
    return [f"{k}={v}" for k, v in base.items()]


@pytest.fixture
def tiny_cfg(tmp_path):
    return load_config(None, tiny_overrides(tmp_path))


def setup_of(cfg, micro, chunk=1024, generator=None, device=torch.device("cpu"), precision=None, **kw):
    """An :class:`UpdateSetup` for tests: fp32 on the CPU unless told; ``micro`` may be MemorySizes."""
    from visppo.ppo import MemorySizes, UpdateSetup
    from visppo.precision import Precision

    sizes = micro if isinstance(micro, MemorySizes) else MemorySizes(int(micro), int(chunk or 1024))
    return UpdateSetup(cfg, sizes, device, precision or Precision(device),
                       generator if generator is not None else torch.Generator(), **kw)


def update_with(policy, optimizer, buffer, cfg, micro, chunk, generator, **kw):
    """``ppo.update`` with the setup built from sizes and a generator (test shorthand)."""
    from visppo.ppo import update

    return update(policy, optimizer, buffer, setup_of(cfg, micro, chunk, generator, **kw))


def infer_with(policy, obs, actions, chunk):
    """``ppo.infer`` in fp32 on the CPU; ``chunk`` may be MemorySizes."""
    from visppo.ppo import MemorySizes, infer
    from visppo.precision import Precision

    cpu = torch.device("cpu")
    sizes = chunk if isinstance(chunk, MemorySizes) else MemorySizes(0, int(chunk))
    return infer(policy, obs, actions, sizes, cpu, Precision(cpu))


def run_main(capsys, *args) -> tuple[int, str]:
    """``visppo ARGS`` in this process: (exit code, what it wrote to stderr)."""
    from visppo.cli import main

    try:
        code = main([str(a) for a in args])
    except SystemExit as exc:
        code = exc.code
    return code, capsys.readouterr().err


def one_error_line(err: str, *needles: str) -> str:
    """Assert ``err`` is exactly one ``error:`` line containing each needle; return it."""
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    for needle in needles:
        assert needle in lines[0], (needle, err)
    return lines[0]


def train_short(config: str | None, steps: int, tmp_path: Path, overrides: tuple[str, ...] = ()) -> list[float]:
    """Train ``configs/<config>`` (None: the default task) for ``steps`` steps through the
    CLI, seed 1; the logged training returns (mean of the last 100 episodes, per iteration).

    The learning rate is not annealed, so the run follows the first ``steps`` of the full
    config's run rather than a compressed copy of it. ``overrides`` go after the config's.
    """
    run_dir = tmp_path / "run"
    config_args = [str(REPO / "configs" / config)] if config else []
    cmd = [sys.executable, "-m", "visppo", "train", *config_args, *overrides, f"ppo.total_steps={steps}",
           "ppo.anneal_lr=false", f"run.dir={run_dir}", "run.progress=false", "run.tensorboard=false",
           "run.checkpoint_every=1000", "train.seed=1", "train.threads=1"]
    subprocess.run(cmd, check=True, cwd=tmp_path, timeout=3600)
    with (run_dir / "metrics.csv").open() as f:
        returns = [float(row["episode_return"]) for row in csv.DictReader(f)]
    return [r for r in returns if math.isfinite(r)]


class Recorder:
    """Wraps a gymnasium env in place (``env.env``): what it gives and what it is given, per episode."""

    def __init__(self, env):
        self.env, self.episodes = env, []

    def __getattr__(self, name):
        return getattr(self.env, name)

    def reset(self, **kwargs):
        obs, info = self.env.reset(**kwargs)
        self.episodes.append({"obs": [obs], "actions": []})
        return obs, info

    def step(self, action):
        out = self.env.step(action)
        self.episodes[-1]["actions"].append(np.array(action, copy=True))
        self.episodes[-1]["obs"].append(out[0])
        return out


def evaluate_recorded(monkeypatch, run_dir, episodes: int = 2) -> tuple[list[dict], list[dict]]:
    """``visppo eval RUN --deterministic``'s code path, recorded: per episode, the raw observations
    the env gave (below visppo's wrappers: frames as a camera gives them) and the packed ones the
    policy read (stacked CHW frames), with the actions evaluation took."""
    import visppo.evaluate as evaluate_module
    from visppo.envs import PixelDict

    raw, packed = [], []
    make_env = evaluate_module.make_env

    def recorded(cfg, stream=0):
        env = make_env(cfg, stream)
        inner = env
        while not isinstance(inner, PixelDict):
            inner = inner.env
        inner.env = Recorder(inner.env)
        raw.append(inner.env)
        env.env = Recorder(env.env)  # below SeededEpisodes, above PixelDict
        packed.append(env.env)
        return env

    with monkeypatch.context() as patch:
        patch.setattr(evaluate_module, "make_env", recorded)
        result = evaluate_module.evaluate(run_dir, episodes=episodes, deterministic=True)
    played = [i for i, r in enumerate(raw) if r.episodes]  # loading the policy made an env too, for its spaces
    assert result["episodes"] == episodes and len(played) == 1
    assert [len(e["actions"]) for e in raw[played[0]].episodes] == result["lengths"]
    return raw[played[0]].episodes, packed[played[0]].episodes


def tiny_kwargs(tmp_path, **extra) -> dict:
    """conftest's tiny run as visppo.train keyword arguments (section__key=value, Python values)."""
    items = (item.split("=", 1) for item in tiny_overrides(tmp_path))
    kwargs = {key.replace(".", "__"): yaml.safe_load(value) for key, value in items}
    kwargs.update(extra)
    return kwargs


def act_on(policy, episodes: list[dict]) -> float:
    """Feed each recorded episode to ``Policy.act``; the largest difference from evaluation's actions."""
    worst = 0.0
    for episode in episodes:
        policy.reset()
        for obs, taken in zip(episode["obs"], episode["actions"], strict=False):
            action = policy.act(obs)
            assert np.shape(action) == np.shape(taken)
            worst = max(worst, float(np.max(np.abs(np.asarray(action, np.float64) - taken))))
    return worst
