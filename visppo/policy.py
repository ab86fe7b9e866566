"""ActorCritic: an encoder, a Gaussian, Beta or categorical actor, and a value head.

Three entry points and nothing else: ``act`` (sample at collection time),
``score_actions`` (log-prob, entropy and value of stored actions, for the loss) and
``value`` (for bootstrapping); ``score_actions_augmented`` is ``score_actions`` plus
what the DrAC terms of the update need, and ``score_actions_aux`` is ``score_actions`` plus
each sample's error on the auxiliary heads that are on (reconstruction, model.recon_size;
inverse dynamics, model.invdyn; reward prediction, model.reward_head). Distributions are built in float32 even under
autocast: log-probs feed a ratio ``exp(new - old)`` that low precision would
distort. ``augment`` (a RandomShift or RandomRotate, or None) is used by the update only.

Box actions take a Gaussian (``model.action_dist=normal``: unbounded; the env clips, the
buffer keeps the unclipped sample) or a Beta per dimension (``beta``: its support is the
action bounds, so no sample is ever clipped and the mean cannot leave them; Chou et al.
2017). The Beta's actions are stored in env units; log-prob and entropy include the map
``a = low + (high - low) x`` from the unit interval, so they are densities in env units.
"""

from __future__ import annotations

import gymnasium as gym
import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from torch.distributions import Beta, Categorical, Distribution, Independent, Normal

from visppo.augment import make_augmentation
from visppo.config import ConfigError, ModelConfig
from visppo.encoders import ObsEncoder, load_encoder_weights

Obs = dict[str, torch.Tensor]
_BETA_EPS = 1e-6  # a float32 Beta sample can be exactly 0 or 1, where its log-density is infinite


def _init(layer: nn.Linear, gain: float) -> nn.Linear:
    nn.init.orthogonal_(layer.weight, gain)
    nn.init.zeros_(layer.bias)
    return layer


def _mlp(in_dim: int, hidden: int, out_dim: int, out_gain: float) -> nn.Sequential:
    return nn.Sequential(_init(nn.Linear(in_dim, hidden), np.sqrt(2)), nn.Tanh(),
                         _init(nn.Linear(hidden, out_dim), out_gain))


def recon_target(pixels: torch.Tensor, size: int, motion: float = 0.0) -> torch.Tensor:
    """What the reconstruction head predicts from uint8 stacked RGB frames ``[B, 3F, H, W]``: the
    frames average-pooled to ``size`` x ``size``, in [0, 1]; with ``motion`` > 0 also each frame's
    change from the one before it, times ``motion``. The change is zero except where something
    moved, so it weights the robot's own body, a few pixels of a whole-frame loss (reacher's
    fingertip is 3 pixels of 84x84), by ``motion`` squared against the static scene."""
    target = F.adaptive_avg_pool2d(pixels.float(), size).div_(255.0)
    if motion:
        frames = target.unflatten(1, (-1, 3))
        target = torch.cat([target, (frames[:, 1:] - frames[:, :-1]).flatten(1, 2).mul_(motion)], dim=1)
    return target


def recon_error(recon: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Each sample's squared error summed over its whole target (a sum, not a mean: its gradient on
    a shared encoder must not vanish beside the value loss's, which is in return units)."""
    return (recon.float() - target).square().flatten(1).sum(1)


def _aux_head(in_dim: int, hidden: int, out_dim: int) -> nn.Sequential:
    """An auxiliary head (decoder, inverse dynamics, reward): one ReLU layer, PyTorch's default init."""
    return nn.Sequential(nn.Linear(in_dim, hidden), nn.ReLU(), nn.Linear(hidden, out_dim))


class ActorCritic(nn.Module):
    def __init__(self, obs_space: gym.spaces.Dict, action_space: gym.Space, cfg: ModelConfig):
        super().__init__()
        pixel_shape = tuple(obs_space["pixels"].shape)
        state_dim = int(np.prod(obs_space["state"].shape)) if "state" in obs_space.spaces else 0

        def encoder(pixels: tuple[int, int, int] | None, state: int) -> ObsEncoder:
            return ObsEncoder(pixels, state, cfg.feature_dim, cfg.state_hidden_dim, cfg.encoder,
                              resize=cfg.resize, checkpointing=cfg.encoder_checkpointing,
                              shared_layers=cfg.shared_layers, shared_dim=cfg.hidden_dim,
                              keypoints=(cfg.keypoints, cfg.keypoint_stride, cfg.keypoint_norm))

        if cfg.privileged_critic:  # asymmetric: the actor the frames only, the critic the state only
            if not state_dim:
                raise ConfigError("model.privileged_critic needs the env's state vector: set env.state=true")
            self.encoder = encoder(pixel_shape, 0)
            self.critic_encoder = encoder(None, state_dim)
        else:
            self.encoder = encoder(pixel_shape, state_dim)
            self.critic_encoder = None if cfg.share_encoder else encoder(pixel_shape, state_dim)
        self.detach_actor = cfg.detach_actor
        self.discrete = isinstance(action_space, gym.spaces.Discrete)
        self.beta = cfg.action_dist == "beta"
        if self.discrete:
            act_dim = int(action_space.n)
            if self.beta:
                raise ConfigError("model.action_dist=beta needs a continuous (Box) action space: set it to normal")
        elif isinstance(action_space, gym.spaces.Box):
            act_dim = int(np.prod(action_space.shape))
            if self.beta:
                self._init_beta_bounds(action_space)
            else:  # with a schedule (model.final_log_std) the optimizer leaves it alone: schedule_log_std sets it
                self.log_std = nn.Parameter(torch.full((act_dim,), float(cfg.init_log_std)),
                                            requires_grad=cfg.final_log_std is None)
        else:
            raise ValueError(f"action space {action_space} is not supported: use Box or Discrete")
        feat = self.encoder.out_dim
        self.actor = _mlp(feat, cfg.hidden_dim, 2 * act_dim if self.beta else act_dim, 0.01)
        self.critic = _mlp(feat if self.critic_encoder is None else self.critic_encoder.out_dim, cfg.hidden_dim, 1, 1.0)
        self.norm_value = cfg.norm_value
        if cfg.norm_value:  # the value targets' running moments (ppo.update_value_norm), saved with the weights
            self.register_buffer("value_count", torch.zeros((), dtype=torch.float64))
            self.register_buffer("value_mean", torch.zeros((), dtype=torch.float64))
            self.register_buffer("value_var", torch.ones((), dtype=torch.float64))
        self.recon_motion = cfg.recon_motion
        # the target's shape from recon_target itself (frames, then their changes with recon_motion): one source
        self.recon_shape = tuple(recon_target(torch.zeros(1, *pixel_shape, dtype=torch.uint8),
                                              max(cfg.recon_size, 1), cfg.recon_motion).shape[1:])
        self.decoder = None
        if cfg.recon_size:  # an auxiliary head: the update only; never acts
            self.decoder = _aux_head(feat, cfg.hidden_dim, int(np.prod(self.recon_shape)))
        self.invdyn = None
        if cfg.invdyn:  # an auxiliary head: the update only; never acts
            if self.discrete:
                raise ConfigError("model.invdyn needs a continuous (Box) action space: set it to false")
            self.invdyn = _aux_head(feat, cfg.hidden_dim, act_dim)
        self.reward_head = None
        if cfg.reward_head:  # an auxiliary head: the update only; never acts
            self.reward_head = _aux_head(feat, cfg.hidden_dim, 1)
        self.encoder_name = cfg.encoder
        self.augment = make_augmentation(cfg.augment, cfg.shift_pad, cfg.rotate_degrees)  # last: it draws its seed

    def _init_beta_bounds(self, space: gym.spaces.Box) -> None:
        """The affine map from the Beta's unit interval to the action bounds, as buffers (saved with the weights)."""
        low, high = space.low.reshape(-1).astype(np.float64), space.high.reshape(-1).astype(np.float64)
        if not (np.isfinite(low).all() and np.isfinite(high).all() and (high > low).all()):
            raise ConfigError("model.action_dist=beta needs finite action bounds (low < high): "
                              "set model.action_dist=normal")
        self.register_buffer("action_low", torch.as_tensor(low, dtype=torch.float32))
        self.register_buffer("action_range", torch.as_tensor(high - low, dtype=torch.float32))

    def encoders(self) -> list[ObsEncoder]:
        return [self.encoder] + ([self.critic_encoder] if self.critic_encoder is not None else [])

    def encoder_parameters(self) -> list[nn.Parameter]:
        return [p for enc in self.encoders() for p in enc.parameters()]

    def trunk_parameters(self) -> list[nn.Parameter]:
        """The encoders' pixel trunks: what pretrained weights fill, freezing freezes, encoder_lr_scale scales."""
        return [p for enc in self.encoders() for p in enc.trunk_parameters()]

    def load_encoder_weights(self, spec: str) -> None:
        """Load ``model.encoder_weights`` (none | imagenet | PATH) into the encoders; ConfigError if it does not fit."""
        load_encoder_weights([e for e in self.encoders() if e.pixels is not None], spec, self.encoder_name)

    def _features(self, obs: Obs) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(actor's, critic's, the actor encoder's own) features: the first is the last detached
        with detach_actor, the last is what an auxiliary head (the decoder) trains the encoder by."""
        feats = self.encoder(obs)
        critic_feats = feats if self.critic_encoder is None else self.critic_encoder(obs)
        # detached: the same numbers; the policy loss's gradient stops at the actor head
        return (feats.detach() if self.detach_actor else feats), critic_feats, feats

    def _value(self, critic_feats: torch.Tensor) -> torch.Tensor:
        """The value in return units. The head's last layer runs in fp32: bf16 would round returns
        of ~100 to 0.5; with norm_value its output is a normalised value, mapped back here."""
        hidden = self.critic[:-1](critic_feats)
        with torch.autocast(hidden.device.type, enabled=False):
            out = self.critic[-1](hidden.float()).squeeze(-1)
            return out * self.value_scale() + self.value_mean.float() if self.norm_value else out

    def value_scale(self) -> torch.Tensor | float:
        """What the value loss divides value errors by: the targets' running std with norm_value
        (floored at 1, so returns that barely vary, as before a sparse task's first reward, are
        not blown up), else 1."""
        if not self.norm_value:
            return 1.0
        return self.value_var.sqrt().clamp(min=1.0).float()

    def _dist(self, actor_feats: torch.Tensor) -> Distribution:
        return self._dist_of(self.actor(actor_feats).float())

    def _dist_of(self, out: torch.Tensor) -> Distribution:
        """Categorical (discrete), a Normal per dimension, or a Beta over the unit interval per dimension
        as one event (``Independent``), its concentrations ``1 + softplus``: >= 1, so it is unimodal."""
        if self.discrete:
            return Categorical(logits=out, validate_args=False)
        if self.beta:
            c1, c0 = (1.0 + F.softplus(out)).chunk(2, dim=-1)
            return Independent(Beta(c1, c0, validate_args=False), 1, validate_args=False)
        return Normal(out, self.log_std.float().exp().expand_as(out), validate_args=False)

    def _log_prob(self, dist: Distribution, action: torch.Tensor) -> torch.Tensor:
        if self.discrete:
            return dist.log_prob(action)
        if self.beta:  # the density in env units: the unit interval's, divided by the map's Jacobian
            unit = ((action.float() - self.action_low) / self.action_range).clamp(_BETA_EPS, 1.0 - _BETA_EPS)
            return dist.log_prob(unit) - self.action_range.log().sum()
        return dist.log_prob(action).sum(-1)

    def _entropy(self, dist: Distribution) -> torch.Tensor:
        if self.discrete:
            return dist.entropy()
        if self.beta:
            return dist.entropy() + self.action_range.log().sum()
        return dist.entropy().sum(-1)

    def act(self, obs: Obs, deterministic: bool = False, noise: torch.Tensor | None = None):
        """Sample actions (a Gaussian's unclipped) with their log-probs and the values, for collection.
        Deterministic: the mode of a categorical, the mean of a Gaussian or a Beta. ``noise``
        (``[batch, action_dim]``, unit variance; a Gaussian policy only): the sample is ``mean + std *
        noise`` instead of a fresh draw, for noise correlated in time (``visppo.noise``)."""
        actor_feats, critic_feats, _ = self._features(obs)
        dist = self._dist(actor_feats)
        if deterministic:
            action = dist.probs.argmax(-1) if self.discrete else dist.mean
        elif noise is not None:
            if self.discrete or self.beta:
                raise ValueError("act(noise=...) needs a Gaussian policy (model.action_dist=normal, Box actions)")
            action = dist.mean + dist.stddev * noise.to(dist.mean.device, dist.mean.dtype)
        else:
            action = dist.sample()
        if self.beta:
            action = self.action_low + self.action_range * action
        return action, self._log_prob(dist, action), self._value(critic_feats)

    def score_actions(self, obs: Obs, action: torch.Tensor):
        """Log-prob, entropy and value of given actions, with gradients, for the loss."""
        return self._scored(*self._features(obs)[:2], action)

    def _scored(self, actor_feats: torch.Tensor, critic_feats: torch.Tensor, action: torch.Tensor):
        dist = self._dist(actor_feats)
        return self._log_prob(dist, action), self._entropy(dist), self._value(critic_feats)

    def score_actions_augmented(self, obs: Obs, aug_obs: Obs, action: torch.Tensor):
        """``score_actions`` on ``obs``, plus for the DrAC terms: its distribution, and the distribution and
        value on ``aug_obs``. One pass of every module over both stacked (no layer mixes samples, so it
        equals two passes; and memory trackers see each module once).

        Returns ``(logp, entropy, value, dist, aug_dist, aug_value)``.
        """
        n = action.shape[0]
        actor_feats, critic_feats, _ = self._features({k: torch.cat([obs[k], aug_obs[k]]) for k in obs})
        out, values = self.actor(actor_feats).float(), self._value(critic_feats)
        dist, aug_dist = self._dist_of(out[:n]), self._dist_of(out[n:])
        return self._log_prob(dist, action), self._entropy(dist), values[:n], dist, aug_dist, values[n:]

    def score_actions_aux(self, obs: Obs, action: torch.Tensor, prev_action: torch.Tensor | None = None,
                          prev_reward: torch.Tensor | None = None):
        """``score_actions`` plus each sample's error on the auxiliary heads that are on, all reading
        the actor encoder's features (not detached, even with detach_actor), in float32:
        ``recon_loss``: the decoder predicts ``recon_target`` (the stacked frames average-pooled to
        model.recon_size, with model.recon_motion their changes too); ``recon_error``.
        ``invdyn_loss`` (given ``prev_action``): the inverse-dynamics head predicts the action executed
        just before the newest frame; the squared difference summed over action dimensions.
        ``reward_loss`` (given ``prev_reward``): the reward head predicts the reward the step into the
        newest frame earned; the squared difference.
        Returns ``(logp, entropy, value, {name: per-sample error})``."""
        target = None
        if self.decoder is not None:  # first: the frames' float copy is freed before the encoder's activations exist
            with torch.no_grad():
                target = recon_target(obs["pixels"], self.recon_shape[-1], self.recon_motion)
        actor_feats, critic_feats, feats = self._features(obs)
        errors = {}
        if target is not None:
            recon = self.decoder(feats).float().view(-1, *self.recon_shape)
            with torch.autocast(recon.device.type, enabled=False):
                errors["recon_loss"] = recon_error(recon, target)
        if self.invdyn is not None and prev_action is not None:
            predicted = self.invdyn(feats).float()
            with torch.autocast(predicted.device.type, enabled=False):
                errors["invdyn_loss"] = (predicted - prev_action.float()).square().sum(1)
        if self.reward_head is not None and prev_reward is not None:
            predicted = self.reward_head(feats).float().squeeze(-1)
            with torch.autocast(predicted.device.type, enabled=False):
                errors["reward_loss"] = (predicted - prev_reward.float()).square()
        return (*self._scored(actor_feats, critic_feats, action), errors)

    def value(self, obs: Obs) -> torch.Tensor:
        return self._value(self.encoder(obs) if self.critic_encoder is None else self.critic_encoder(obs))
