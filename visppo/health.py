"""Network health, logged every iteration: dead features and saturated tanh units.

A policy can stop learning with every loss finite and the critic fitting well: when the
encoder's features grow (the value loss, in return units, pulls them up), the heads' tanh
layers saturate and pass almost no gradient, and the policy's output stops depending on the
observation. On DeepMind Control reacher-easy from pixels (README, "Saturated heads") the
shipped network after 389k agent steps had 68% of its 256 ReLU features dead on every frame
and 95% of both heads' tanh units past 0.99 in magnitude. These numbers make that visible in
``metrics.csv`` and TensorBoard (``health/...``) instead of in a post-mortem.

``health/dead_features``: the fraction of the actor encoder's output units that are the same
on every sample of the probe batch (a ReLU that never fires). ``health/saturated_<part>``: the
fraction of tanh outputs with ``|y| > SATURATED`` in the actor head, the critic head, and the
encoders (shared trunk, state branch, a LayerNorm-tanh projection); NaN where a part has no tanh.
"""

from __future__ import annotations

import math

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
def activation_health(policy: ActorCritic, obs: dict[str, torch.Tensor], actions: torch.Tensor) -> dict[str, float]:
    """The ``health/...`` scalars of ``policy`` on a batch of observations (and the actions taken
    there, which ``score_actions`` needs to run both heads)."""
    saturated: dict[str, list[torch.Tensor]] = {part: [] for part in PARTS}
    features: list[torch.Tensor] = []

    def count(name: str):
        def hook(module: nn.Module, inputs, output: torch.Tensor) -> None:
            saturated.setdefault(_part(name), []).append((output.float().abs() > SATURATED).flatten())
        return hook

    hooks = [m.register_forward_hook(count(name)) for name, m in policy.named_modules() if isinstance(m, nn.Tanh)]
    hooks.append(policy.encoder.register_forward_hook(lambda m, i, out: features.append(out.float())))
    try:
        policy.score_actions(obs, actions)
    finally:
        for h in hooks:
            h.remove()
    feats = features[0]
    out = {"health/dead_features": float((feats.amax(0) == feats.amin(0)).float().mean())}
    for part in PARTS:
        flags = saturated.get(part) or []
        out[f"health/saturated_{part}"] = float(torch.cat(flags).float().mean()) if flags else math.nan
    return out
