"""Network health, logged every iteration: dead features and saturated tanh units.

A policy can stop learning with every loss finite and the critic fitting well: when the
encoder's features grow (the value loss, in return units, pulls them up), the heads' tanh
layers saturate and pass almost no gradient, and the policy's output stops depending on the
observation (measured on DeepMind Control reacher-easy from pixels; docs/learning.md). These
numbers make that visible in ``metrics.csv`` and TensorBoard (``health/...``) instead of in a
post-mortem.

``health/dead_features``: the fraction of the actor encoder's output units that are the same
on every sample of the probe batch (a ReLU that never fires). ``health/saturated_<part>``: the
fraction of tanh outputs with ``|y| > SATURATED`` in the actor head, the critic head, and the
encoders (shared trunk, state branch, a LayerNorm-tanh projection); NaN where a part has no tanh.
``health/mean_out_of_bounds``: for a Gaussian policy over bounded actions, the fraction of the
mean's entries beyond the bounds. The samples are clipped to the bounds, so there nearly every sample acts
the same and the mean gets almost no gradient back: a torque pinned at its limit. A bang-bang
policy that has learned pins its torques too, so it reads a policy's style more than its
failure. NaN for categorical policies, which cannot leave the bounds.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import gymnasium as gym
import numpy as np
import torch
from torch import nn

from visppo.policy import ActorCritic

SATURATED = 0.99
"""|tanh| above this passes under 2% of its gradient (1 - 0.99^2): the unit is stuck."""

PROBE_SAMPLES = 256
"""Samples of the rollout the statistics are measured on (spread evenly over it)."""

PARTS = ("actor", "critic", "encoder")
"""The policy's parts whose tanh units are counted; encoder covers critic_encoder too."""


def probe_index(size: int, samples: int = PROBE_SAMPLES) -> torch.Tensor:
    """``samples`` flat buffer indices spread evenly over a rollout of ``size`` (every env and step)."""
    return torch.linspace(0, size - 1, min(size, samples)).round().long().unique()


def _part(module_name: str) -> str:
    head = module_name.split(".")[0]
    return "encoder" if head in ("encoder", "critic_encoder") else head


@torch.no_grad()
def activation_health(policy: ActorCritic, batches: Iterable[tuple[dict[str, torch.Tensor], torch.Tensor]],
                      action_space: gym.Space | None = None) -> dict[str, float]:
    """The ``health/...`` scalars of ``policy`` over batches of observations and the actions taken
    there (``score_actions`` needs them to run both heads), scored one batch at a time: how they
    are split bounds the pass's memory and changes none of the scalars. ``action_space`` gives the
    bounds ``health/mean_out_of_bounds`` measures the Gaussian's mean against."""
    saturated: dict[str, list[torch.Tensor]] = {part: [] for part in PARTS}
    features: list[torch.Tensor] = []
    means: list[torch.Tensor] = []

    def count(name: str):
        def hook(module: nn.Module, inputs, output: torch.Tensor) -> None:
            saturated.setdefault(_part(name), []).append((output.float().abs() > SATURATED).flatten())
        return hook

    hooks = [m.register_forward_hook(count(name)) for name, m in policy.named_modules() if isinstance(m, nn.Tanh)]
    hooks.append(policy.encoder.register_forward_hook(lambda m, i, out: features.append(out.float())))
    hooks.append(policy.actor[-1].register_forward_hook(lambda m, i, out: means.append(out.float())))  # the mean
    try:
        for obs, actions in batches:
            policy.score_actions(obs, actions)
    finally:
        for h in hooks:
            h.remove()
    feats = torch.cat(features)
    out = {"health/dead_features": float((feats.amax(0) == feats.amin(0)).float().mean())}
    for part in PARTS:
        flags = saturated.get(part) or []
        out[f"health/saturated_{part}"] = float(torch.cat(flags).float().mean()) if flags else math.nan
    out["health/mean_out_of_bounds"] = _out_of_bounds(policy, torch.cat(means), action_space)
    return out


def _out_of_bounds(policy: ActorCritic, mean: torch.Tensor, space: gym.Space | None) -> float:
    """The fraction of a Gaussian mean's entries outside ``space``'s bounds, over the dimensions bounded on
    both sides (a half-bounded one is left out); NaN if none is."""
    if policy.discrete or not isinstance(space, gym.spaces.Box):
        return math.nan
    low = torch.as_tensor(np.asarray(space.low, np.float32).reshape(-1), device=mean.device)
    high = torch.as_tensor(np.asarray(space.high, np.float32).reshape(-1), device=mean.device)
    outside = (mean < low) | (mean > high)
    finite = torch.isfinite(low) & torch.isfinite(high)
    return float(outside[:, finite].float().mean()) if bool(finite.any()) else math.nan
