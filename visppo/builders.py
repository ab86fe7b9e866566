"""Turn a config into the objects a run needs: device, seeds, policy, optimizer.

Training, evaluation, the probe and the benchmarks all build through here, so
a policy is built the same way wherever it is used.
"""

from __future__ import annotations

import math
import os
import random
from types import SimpleNamespace

import gymnasium as gym
import numpy as np
import torch

from visppo.config import TORCHVISION_ENCODERS, Config
from visppo.errors import ConfigError
from visppo.memory import format_bytes
from visppo.policy import ActorCritic


def initialised_gpus() -> list[int]:
    """The GPUs whose RNG a ``torch.random.fork_rng`` must keep: ``torch.manual_seed`` reseeds every
    GPU's generator too, so whatever seeds or draws inside must not move a run's streams on."""
    return list(range(torch.cuda.device_count())) if torch.cuda.is_initialized() else []


def resolve_device(name: str, key: str = "train.device") -> torch.device:
    """``auto`` -> cuda when available, else cpu; a CUDA device without CUDA is a ConfigError."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"{key}={name} but CUDA is not available here: use {key}=cpu or auto")
    if device.type == "cuda" and device.index is not None and device.index >= torch.cuda.device_count():
        raise ConfigError(f"{key}={name} but this machine has {torch.cuda.device_count()} GPU(s): "
                          f"use {key}=cuda:0 .. cuda:{torch.cuda.device_count() - 1}, cuda or auto")
    return device


SIZE_KEYS = {"ppo.num_steps": 64, "ppo.num_envs": 8, "env.image_size": 84, "env.frame_stack": 1,
             "model.hidden_dim": 256, "model.feature_dim": 256, "model.state_hidden_dim": 64}
"""The keys memory grows with, and their defaults (to say which one is out of scale)."""
SQUARED = ("env.image_size", "model.hidden_dim")
"""Keys that memory grows with as their square."""


class _Shapes(dict):
    """What :class:`ActorCritic` reads of an observation space, its entries' shapes, without the
    bounds arrays a gym Box of a frame allocates (gigabytes for the absurd sizes refused here)."""

    @property
    def spaces(self) -> dict:
        return self


def policy_parameters(cfg: Config) -> int:
    """The policy's parameter count for the config's frames, built on the meta device (nothing is
    allocated). The env is not made yet, so its state and action sizes count as 32 and 8: a few
    thousand weights either way."""
    e = cfg.env
    obs = _Shapes(pixels=SimpleNamespace(shape=(3 * e.frame_stack, e.image_size, e.image_size)))
    if e.state:
        obs["state"] = SimpleNamespace(shape=(32,))
    with torch.device("meta"):
        policy = ActorCritic(obs, gym.spaces.Box(-1, 1, (8,), np.float32), cfg.model)
    return sum(p.numel() for p in policy.parameters())


def memory_needs(cfg: Config, buffer_device: torch.device, device: torch.device) -> list[tuple]:
    """(what, bytes at least, on which device, the keys it grows with) for the big allocations."""
    e, p, m = cfg.env, cfg.ppo, cfg.model
    frame = 3 * e.image_size ** 2 * e.frame_stack if e.pixels else 0
    # a torchvision backbone pools its features: its size does not grow with the frames'
    grows_with_frames = () if m.encoder in TORCHVISION_ENCODERS else ("env.image_size",)
    return [("the rollout buffer", p.num_steps * p.num_envs * (frame + 64), buffer_device,
             ("ppo.num_steps", "ppo.num_envs", "env.image_size", "env.frame_stack")),
            ("the envs' frames", 4 * p.num_envs * frame, torch.device("cpu"),
             ("ppo.num_envs", "env.image_size", "env.frame_stack")),
            ("the policy and its optimizer", 16 * policy_parameters(cfg), device,  # fp32 weights, gradients, Adam's two
             ("model.hidden_dim", "model.feature_dim", "model.state_hidden_dim", *grows_with_frames))]


def check_memory(cfg: Config, buffer_device: torch.device, device: torch.device) -> None:
    """Refuse sizes that cannot fit in the machine's memory, before anything is allocated: one
    line naming the key out of scale and the bytes it would need. Compared with all of the
    device's memory (not what is free), so only the absurd is refused; the rest is the probe's job."""
    for what, need, where, keys in memory_needs(cfg, buffer_device, device):
        have = total_memory(where)
        if have and need > have:
            values = {k: getattr(getattr(cfg, k.split(".")[0]), k.split(".")[1]) for k in keys}
            scale = {k: (v / SIZE_KEYS[k]) ** (2 if k in SQUARED else 1) for k, v in values.items()}
            key = max(scale, key=scale.get)
            sizes = ", ".join(f"{k}={v}" for k, v in values.items())
            raise ConfigError(f"{key}={values[key]} is too large: {what} would need {format_bytes(need)} "
                              f"({sizes}), more than the {format_bytes(have)} of {where.type} memory here; "
                              f"lower {key}")


def total_memory(device: torch.device) -> int:
    """Bytes of memory of ``device`` (the machine's RAM for the CPU); 0 when unknown."""
    try:
        if device.type == "cuda":
            return torch.cuda.get_device_properties(device).total_memory
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, RuntimeError, AssertionError):
        return 0


def seed_everything(seed: int, deterministic: bool, device: torch.device) -> None:
    """Seed python, numpy and torch; with ``deterministic`` on CUDA, also pin cuDNN/cuBLAS.

    The CPU kernels visppo uses are deterministic already, and
    ``torch.use_deterministic_algorithms`` costs a heavy import of the compiler
    stack, so it is only switched on for CUDA.
    """
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    if deterministic and device.type == "cuda":
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True, warn_only=True)
        torch.backends.cudnn.benchmark = False


def build_policy(cfg: Config, obs_space: gym.spaces.Dict, action_space: gym.Space, device: torch.device,
                 load_weights: bool = True) -> ActorCritic:
    """The policy on ``device`` (channels_last when ``train.channels_last``), its encoders filled
    with ``model.encoder_weights`` unless ``load_weights`` is false (a checkpoint's state dict
    is loaded over it anyway)."""
    policy = ActorCritic(obs_space, action_space, cfg.model)
    if load_weights:
        policy.load_encoder_weights(cfg.model.encoder_weights)
    policy = policy.to(device)
    if cfg.train.channels_last:
        policy = policy.to(memory_format=torch.channels_last)
    return policy


def frozen_steps(cfg: Config) -> float:
    """Optimizer steps the encoders' trunks stay frozen: ``model.freeze_encoder_updates``, or for
    good with ``model.encoder_lr_scale=0``, whose trunk never moves (a zero lr alone would still
    backprop through it, and count it in the gradient clip)."""
    return math.inf if cfg.model.encoder_lr_scale == 0 else cfg.model.freeze_encoder_updates


def build_optimizer(cfg: Config, policy: ActorCritic) -> torch.optim.Adam:
    """Adam; with ``model.encoder_lr_scale`` != 1 the encoder trunks get their own param group at
    ``lr * scale``. Every group keeps its ``initial_lr``, which annealing scales, so the ratio holds.

    Fused: one kernel updates every parameter, where torch's CPU default loops over them (the
    same update up to float rounding; the timing is in docs/performance.md)."""
    lr, scale = cfg.ppo.learning_rate, cfg.model.encoder_lr_scale
    trunk = {id(p) for p in policy.trunk_parameters()} if scale != 1.0 else set()
    groups = [{"params": [p for p in policy.parameters() if id(p) not in trunk], "lr": lr, "initial_lr": lr}]
    if trunk:
        groups.append({"params": policy.trunk_parameters(), "lr": lr * scale, "initial_lr": lr * scale})
    return torch.optim.Adam(groups, lr=lr, eps=cfg.ppo.adam_eps, fused=True)


def anneal_lr(optimizer: torch.optim.Optimizer, iteration: int, num_iterations: int) -> None:
    """Linear decay to 0 over the run, per group from its ``initial_lr`` (keeps encoder_lr_scale)."""
    for group in optimizer.param_groups:
        group["lr"] = group["initial_lr"] * (1.0 - (iteration - 1) / num_iterations)
