"""``ValueNorm``: the critic's target statistics (``model.norm_value``), owned by the policy.

The critic's head learns normalised values; :meth:`ValueNorm.denormalize` maps its output
back to return units and :meth:`ValueNorm.scale` is what the value loss measures errors in.
The update calls :meth:`ValueNorm.update` once per rollout, before it learns that rollout's
returns; under torchrun the merged moments are every rank's (one all-reduce), so all ranks
keep the same statistics. The buffers are float64 and saved with the policy's weights.
"""

from __future__ import annotations

import torch
from torch import nn

from visppo import distributed
from visppo.buffer import merge_moments

OLD_NAMES = {"value_count": "count", "value_mean": "mean", "value_var": "var"}
"""Before ValueNorm the policy held these buffers itself: checkpoints saved then hold
``value_count``, ``value_mean``, ``value_var`` where they now hold ``value_norm.count``, ..."""


class ValueNorm(nn.Module):
    """Running count, mean and (biased) variance of the value targets."""

    def __init__(self):
        super().__init__()
        self.register_buffer("count", torch.zeros((), dtype=torch.float64))
        self.register_buffer("mean", torch.zeros((), dtype=torch.float64))
        self.register_buffer("var", torch.ones((), dtype=torch.float64))

    @torch.no_grad()
    def update(self, returns: torch.Tensor, across_ranks: bool = False) -> None:
        """Merge a rollout's value targets (every rank's, with ``across_ranks``) into the moments."""
        if across_ranks:
            mean, std, n = distributed.mean_std(returns)
            var = std * std * (n - 1) / n if n > 1 else 0.0
        else:
            r = returns.detach().double()
            mean, var, n = r.mean().item(), r.var(unbiased=False).item(), r.numel()
        count, mean, var = merge_moments(self.count.item(), self.mean.item(), self.var.item(), n, mean, var)
        self.count.fill_(count)
        self.mean.fill_(mean)
        self.var.fill_(var)

    def scale(self) -> torch.Tensor:
        """The targets' running std, floored at 1 (returns that barely vary, as before a sparse
        task's first reward, are not blown up); float32."""
        return self.var.sqrt().clamp(min=1.0).float()

    def normalize(self, values: torch.Tensor) -> torch.Tensor:
        """Values in return units -> what the head learns."""
        return (values - self.mean.float()) / self.scale()

    def denormalize(self, out: torch.Tensor) -> torch.Tensor:
        """The head's output -> values in return units."""
        return out * self.scale() + self.mean.float()


def renamed_old_keys(state: dict, prefix: str = "") -> dict:
    """A policy state dict with the keys of :data:`OLD_NAMES` (a checkpoint saved before
    ValueNorm) under their ``value_norm.*`` names; any other state dict comes back unchanged."""
    if not any(prefix + old in state for old in OLD_NAMES):
        return state
    return {(prefix + "value_norm." + OLD_NAMES[k[len(prefix):]]
             if k.startswith(prefix) and k[len(prefix):] in OLD_NAMES else k): v for k, v in state.items()}
