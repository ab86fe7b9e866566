"""ActorCritic: an encoder, a Gaussian or categorical actor, and a value head.

Three entry points and nothing else: ``act`` (sample at collection time),
``score_actions`` (log-prob, entropy and value of stored actions, for the loss) and
``value`` (for bootstrapping). Distributions are built in float32 even under
autocast: log-probs feed a ratio ``exp(new - old)`` that low precision would
distort. The policy owns its Gaussian's log-std, a learned parameter.

Box actions take a Gaussian, unbounded: ``rollout.collect`` clips its samples to the bounds before the
env sees them, the buffer keeps them unclipped.
"""

from __future__ import annotations

import gymnasium as gym
import numpy as np
import torch
from torch import nn
from torch.distributions import Categorical, Distribution, Normal

from visppo.config import ModelConfig
from visppo.encoders import ObsEncoder, load_encoder_weights
from visppo.env_check import check_action_space

Obs = dict[str, torch.Tensor]


def _init(layer: nn.Linear, gain: float) -> nn.Linear:
    nn.init.orthogonal_(layer.weight, gain)
    nn.init.zeros_(layer.bias)
    return layer


def _mlp(in_dim: int, hidden: int, out_dim: int, out_gain: float) -> nn.Sequential:
    return nn.Sequential(_init(nn.Linear(in_dim, hidden), np.sqrt(2)), nn.Tanh(),
                         _init(nn.Linear(hidden, out_dim), out_gain))


class ActorCritic(nn.Module):
    def __init__(self, obs_space: gym.spaces.Dict, action_space: gym.Space, cfg: ModelConfig):
        super().__init__()
        check_action_space(action_space, "given to ActorCritic")  # env_check owns what visppo acts in
        pixel_shape = tuple(obs_space["pixels"].shape)
        state_dim = int(np.prod(obs_space["state"].shape)) if "state" in obs_space.spaces else 0

        def encoder() -> ObsEncoder:
            return ObsEncoder(pixel_shape, state_dim, cfg.feature_dim, cfg.state_hidden_dim, cfg.encoder,
                              resize=cfg.resize, checkpointing=cfg.encoder_checkpointing,
                              shared_layers=cfg.shared_layers, shared_dim=cfg.hidden_dim,
                              keypoints=(cfg.keypoints, cfg.keypoint_stride))

        self.encoder = encoder()
        self.critic_encoder = None if cfg.share_encoder else encoder()
        self.discrete = isinstance(action_space, gym.spaces.Discrete)
        if self.discrete:
            act_dim = int(action_space.n)
        else:  # a flat float Box
            act_dim = int(action_space.shape[0])
            self.log_std = nn.Parameter(torch.full((act_dim,), float(cfg.init_log_std)))
        feat = self.encoder.out_dim
        self.actor = _mlp(feat, cfg.hidden_dim, act_dim, 0.01)
        self.critic = _mlp(feat, cfg.hidden_dim, 1, 1.0)
        self.encoder_name = cfg.encoder

    def encoders(self) -> list[ObsEncoder]:
        return [self.encoder] + ([self.critic_encoder] if self.critic_encoder is not None else [])

    def encoder_parameters(self) -> list[nn.Parameter]:
        return [p for enc in self.encoders() for p in enc.parameters()]

    def trunk_parameters(self) -> list[nn.Parameter]:
        """The encoders' pixel trunks: what pretrained weights fill, freezing freezes, encoder_lr_scale scales."""
        return [p for enc in self.encoders() for p in enc.trunk_parameters()]

    def load_encoder_weights(self, spec: str) -> None:
        """Load ``model.encoder_weights`` (none | imagenet | PATH) into the encoders; ConfigError if it does not fit."""
        load_encoder_weights(self.encoders(), spec, self.encoder_name)

    def _features(self, obs: Obs, chunk: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """(actor's, critic's) features: the same tensor when the encoder is shared. ``chunk``: the
        encoders see at most that many observations at a time (0: all), so a no-grad pass over many
        envs holds one chunk's activations; the features themselves are a few hundred numbers each."""
        actor = _chunked(self.encoder, obs, chunk)
        return actor, actor if self.critic_encoder is None else _chunked(self.critic_encoder, obs, chunk)

    def _value(self, critic_feats: torch.Tensor) -> torch.Tensor:
        """The value in return units. The head's last layer runs in fp32: bf16 would round returns
        of ~100 to 0.5."""
        hidden = self.critic[:-1](critic_feats)
        with torch.autocast(hidden.device.type, enabled=False):
            return self.critic[-1](hidden.float()).squeeze(-1)

    def _dist(self, actor_feats: torch.Tensor) -> Distribution:
        """Categorical (discrete) or a Normal per dimension. The head's last layer runs in fp32, as
        the value's: a bf16 mean or logit would be rounded before the log-prob is taken."""
        hidden = self.actor[:-1](actor_feats)
        with torch.autocast(hidden.device.type, enabled=False):
            out = self.actor[-1](hidden.float())
        if self.discrete:
            return Categorical(logits=out, validate_args=False)
        return Normal(out, self.log_std.float().exp().expand_as(out), validate_args=False)

    def _log_prob(self, dist: Distribution, action: torch.Tensor) -> torch.Tensor:
        return dist.log_prob(action) if self.discrete else dist.log_prob(action).sum(-1)

    def _entropy(self, dist: Distribution) -> torch.Tensor:
        return dist.entropy() if self.discrete else dist.entropy().sum(-1)

    def act(self, obs: Obs, deterministic: bool = False, chunk: int = 0):
        """Sample actions (a Gaussian's unclipped) with their log-probs and the values, for collection.
        Deterministic: the mode of a categorical, the mean of a Gaussian. ``chunk``: the encoders'
        most observations per pass (0: all); the actions are drawn in one call over the whole batch
        whatever it is, as a chunked draw would take other samples from the same RNG state."""
        actor_feats, critic_feats = self._features(obs, chunk)
        dist = self._dist(actor_feats)
        if deterministic:
            action = dist.probs.argmax(-1) if self.discrete else dist.mean
        else:
            action = dist.sample()
        return action, self._log_prob(dist, action), self._value(critic_feats)

    def score_actions(self, obs: Obs, action: torch.Tensor):
        """Log-prob, entropy and value of given actions, with gradients, for the loss."""
        actor_feats, critic_feats = self._features(obs)
        dist = self._dist(actor_feats)
        return self._log_prob(dist, action), self._entropy(dist), self._value(critic_feats)

    def value(self, obs: Obs, chunk: int = 0) -> torch.Tensor:
        """The values alone (the critic's encoder only); ``chunk`` as in :meth:`act`."""
        return self._value(_chunked(self.encoder if self.critic_encoder is None else self.critic_encoder, obs, chunk))


def _chunked(encoder: nn.Module, obs: Obs, chunk: int) -> torch.Tensor:
    """``encoder(obs)``, over at most ``chunk`` observations at a time (0: all at once)."""
    n = len(next(iter(obs.values())))
    if not 0 < chunk < n:
        return encoder(obs)
    return torch.cat([encoder({k: v[i:i + chunk] for k, v in obs.items()}) for i in range(0, n, chunk)])
