"""The PPO update, memory-bounded: chunked no-grad passes and accumulated micro-batches.

Two memory knobs (:class:`MemorySizes`), neither of which changes the maths:

- ``chunk`` (``memory.infer_chunk_size``): every no-grad pass (bootstrap
  values, recomputed ``logp_old`` and values) runs over at most this many
  samples at a time (:func:`infer`); collection's acting pass runs its encoders
  in chunks of the same size (``rollout.collect``).
- ``micro`` (``memory.micro_batch_size``): each minibatch's backward runs in
  slices of this many samples. A slice's loss is ``sum(per-sample loss) /
  minibatch_size``, so the summed gradients are the minibatch's gradient, also
  when the last slice is shorter. Everything that is a statistic *of the
  minibatch* (advantage normalisation, approx-KL for early stopping, clip
  fraction) is computed over the whole minibatch, never per slice. One clip and
  one optimizer step per minibatch.

An out-of-memory error in a pass of the update (:func:`infer`, a micro-batch) halves the size
concerned and retries the same chunk or minibatch (:func:`with_oom_backoff`): the result is the
same. The acting pass does not back off.

Under torchrun every rank accumulates its own minibatch's gradient locally;
then one all-reduce per minibatch averages the gradients, the minibatch
statistics and an out-of-memory flag over the ranks
(:func:`visppo.distributed.reduce_minibatch`), so every rank steps, skips,
stops early or backs off alike.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TypeVar

import torch
from torch import nn

from visppo import distributed
from visppo.buffer import (
    RolloutBuffer,
    compute_gae,
    micro_batches,
    minibatches,
    obs_of,
)
from visppo.config import PPOConfig
from visppo.memory import is_oom
from visppo.policy import ActorCritic, Obs
from visppo.precision import Precision

T = TypeVar("T")
STATS = ("policy_loss", "value_loss", "entropy", "approx_kl", "clip_frac")
"""Per-minibatch statistics of the PPO loss (means over the minibatch)."""

# --------------------------------------------------------------------------- memory sizes, OOM back-off


@dataclass
class MemorySizes:
    """The two memory knobs in effect; an out-of-memory error halves one for the rest of the run."""

    micro: int
    chunk: int

    def halve(self, which: str) -> None:
        size = getattr(self, which)
        setattr(self, which, size // 2)
        name = {"micro": "memory.micro_batch_size", "chunk": "memory.infer_chunk_size"}[which]
        warnings.warn(f"out of memory at {name}={size}: retrying with {size // 2} for the rest of the run",
                      RuntimeWarning, stacklevel=3)
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


class PeerOutOfMemory(MemoryError):
    """Another rank ran out of memory in this minibatch: every rank backs off together."""


def with_oom_backoff(attempt: Callable[[], T], sizes: MemorySizes, which: str,
                     cleanup: Callable[[], None] | None = None) -> T:
    """``attempt()`` until it fits: an out-of-memory error runs ``cleanup``, halves ``sizes.<which>``
    and tries again. Any other error, or an OOM at size 1, propagates."""
    while True:
        try:
            return attempt()
        except Exception as exc:
            if cleanup is not None:
                cleanup()
            if not is_oom(exc) or getattr(sizes, which) <= 1:
                raise
            sizes.halve(which)


# --------------------------------------------------------------------------- no-grad passes


@torch.inference_mode()
def infer(policy: ActorCritic, obs: Obs, actions: torch.Tensor | None, sizes: MemorySizes,
          device: torch.device, precision: Precision) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Values (and log-probs of ``actions`` if given) of flat ``obs``, ``sizes.chunk`` at a time.

    Inputs may live on the host; each chunk moves to ``device`` alone, so peak
    memory is one chunk's activations whatever the rollout size. Outputs are
    float32 on the CPU.
    """
    n = next(iter(obs.values())).shape[0]
    values = torch.empty(n, dtype=torch.float32)
    logp = torch.empty(n, dtype=torch.float32) if actions is not None else None

    def chunk_from(start: int) -> int:
        stop = min(start + sizes.chunk, n)
        chunk = {k: v[start:stop].to(device, non_blocking=device.type == "cuda") for k, v in obs.items()}
        with precision.autocast():
            if actions is None:
                values[start:stop] = policy.value(chunk).float().cpu()
            else:
                lp, _, v = policy.score_actions(chunk, actions[start:stop].to(device))
                values[start:stop] = v.float().cpu()
                logp[start:stop] = lp.float().cpu()  # type: ignore[index]
        return stop

    start = 0
    while start < n:
        start = with_oom_backoff(lambda: chunk_from(start), sizes, "chunk")
    return values, logp


def compute_values(policy: ActorCritic, buffer: RolloutBuffer, setup: UpdateSetup,
                   recompute_logp_old: bool = False) -> torch.Tensor:
    """After collection: the bootstrap value of the observation after the last step (and, when
    asked, ``buffer.logp`` again in the update's precision), chunked. Returns ``last_value``."""
    if recompute_logp_old:
        _, logp = infer(policy, buffer.flat_obs(), buffer.flat(buffer.actions), setup.sizes,
                        setup.device, setup.precision)
        buffer.logp.copy_(logp.view(buffer.T, buffer.N))
    last_value, _ = infer(policy, buffer.last_obs, None, setup.sizes, setup.device, setup.precision)
    return last_value


def recompute_advantages(policy: ActorCritic, buffer: RolloutBuffer, setup: UpdateSetup) -> None:
    """Refresh every value GAE uses with the current critic (chunked): the rollout's values, the
    bootstrap values of time-limit truncations, the last observation's; then advantages and returns.
    ``buffer.values`` stays the rollout's: the clipped value loss is anchored there, as the ratio
    is anchored at the rollout's log-probs."""
    values, _ = infer(policy, buffer.flat_obs(), None, setup.sizes, setup.device, setup.precision)
    values = values.view(buffer.T, buffer.N).to(buffer.values.device)
    index, final_obs = buffer.truncated_final_obs()
    if len(index):
        final_values, _ = infer(policy, final_obs, None, setup.sizes, setup.device, setup.precision)
        buffer.flat(buffer.final_values)[index] = final_values.to(buffer.final_values.device)
    last_value, _ = infer(policy, buffer.last_obs, None, setup.sizes, setup.device, setup.precision)
    buffer.advantages[:], buffer.returns[:] = compute_gae(
        buffer.rewards, values, last_value, buffer.terminated, buffer.truncated,
        buffer.final_values, setup.ppo.gamma, setup.ppo.gae_lambda)


# --------------------------------------------------------------------------- the loss


def ppo_loss(new_logp: torch.Tensor, old_logp: torch.Tensor, advantages: torch.Tensor,
             new_values: torch.Tensor, old_values: torch.Tensor, returns: torch.Tensor,
             entropy: torch.Tensor, clip_coef: float, clip_value: bool, value_coef: float,
             entropy_coef: float) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Per-sample PPO loss (clipped surrogate + value + entropy), not reduced.

    The caller reduces with ``sum() / minibatch_size`` so that micro-batches
    add up to the minibatch mean. Also returns per-sample statistics (detached)
    whose sums over the minibatch give its mean losses, approx-KL and clip fraction.
    """
    log_ratio = new_logp - old_logp
    ratio = log_ratio.exp()
    pg = -torch.min(ratio * advantages, ratio.clamp(1 - clip_coef, 1 + clip_coef) * advantages)
    v_err = (new_values - returns) ** 2
    if clip_value:
        clipped = old_values + (new_values - old_values).clamp(-clip_coef, clip_coef)
        v_err = torch.max(v_err, (clipped - returns) ** 2)
    v_loss = 0.5 * v_err
    loss = pg + value_coef * v_loss - entropy_coef * entropy
    with torch.no_grad():
        stats = {
            "policy_loss": pg.detach(),
            "value_loss": v_loss.detach(),
            "entropy": entropy.detach(),
            "approx_kl": (ratio - 1) - log_ratio,  # the low-variance estimator (Schulman)
            "clip_frac": ((ratio - 1).abs() > clip_coef).float(),
        }
    return loss, stats


def normalize_advantages(adv: torch.Tensor, across_ranks: bool = False) -> torch.Tensor:
    """``(adv - mean) / (std + 1e-8)`` with the mean and unbiased std of the whole minibatch (never
    of a micro-batch); ``across_ranks``: of the minibatch over all ranks (one all-reduce)."""
    if not across_ranks:
        return (adv - adv.mean()) / (adv.std() + 1e-8) if len(adv) > 1 else adv
    mean, std, count = distributed.mean_std(adv)
    return (adv - mean) / (std + 1e-8) if count > 1 else adv


# --------------------------------------------------------------------------- the update


@dataclass
class UpdateSetup:
    """How to update, apart from the data: the maths, the memory sizes, where and in what precision.

    ``generator`` draws the minibatch order; ``before_step(optimizer)`` runs before every
    optimizer step (the encoder freeze schedule); ``across_ranks``: under torchrun, minibatch
    gradients and statistics are averaged over the ranks.
    """

    ppo: PPOConfig
    sizes: MemorySizes
    device: torch.device
    precision: Precision
    generator: torch.Generator = field(default_factory=torch.Generator)
    before_step: Callable[[torch.optim.Optimizer], None] | None = None
    across_ranks: bool = False


@dataclass
class UpdateResult:
    """What one iteration's update did; losses are means over the minibatches that stepped."""

    policy_loss: float = math.nan
    value_loss: float = math.nan
    entropy: float = math.nan
    approx_kl: float = math.nan
    clip_frac: float = math.nan
    grad_norm: float = math.nan
    stop_kl: float = math.nan
    """The approx-KL of the minibatch that stopped the update early (NaN: no early stop)."""
    optimizer_steps: int = 0
    skipped_steps: int = 0
    """Minibatches whose gradient was not finite: no step taken."""
    trailing_skips: int = 0
    """Non-finite steps since the last good one (the divergence guard counts these across updates)."""

    @property
    def early_stopped(self) -> bool:
        return not math.isnan(self.stop_kl)

    def losses(self) -> dict[str, float]:
        """The loss terms and minibatch statistics, for the metrics (``loss/<name>``)."""
        return {name: getattr(self, name) for name in (*STATS, "grad_norm", "stop_kl")}


def minibatch_gradient(policy: ActorCritic, buffer: RolloutBuffer, mb: torch.Tensor,
                       advantages: torch.Tensor, setup: UpdateSetup) -> dict[str, torch.Tensor]:
    """Accumulate the gradient of the minibatch ``mb`` into ``.grad``, ``setup.sizes.micro``
    samples per backward; no collective communication.

    ``advantages`` are the minibatch's (already normalised over the whole
    minibatch). Returns the minibatch's mean loss terms, approx-KL and clip fraction
    (0-d tensors: no host sync per minibatch unless asked).
    """
    cfg, precision, n = setup.ppo, setup.precision, len(mb)
    sums: dict[str, torch.Tensor] = {}
    offset = 0
    for micro in micro_batches(mb, setup.sizes.micro):
        batch = buffer.gather(micro, setup.device)
        obs, actions, stop = obs_of(batch), batch["actions"], offset + len(micro)
        with precision.autocast():
            new_logp, entropy, new_values = policy.score_actions(obs, actions)
        loss, stats = ppo_loss(new_logp, batch["logp"], advantages[offset:stop].to(setup.device),
                               new_values, batch["values"], batch["returns"], entropy, cfg.clip_coef,
                               cfg.clip_value, cfg.value_coef, cfg.entropy_coef)
        loss = loss.sum() / n  # the minibatch mean, split over micro-batches
        (precision.scaler.scale(loss) if precision.scaler else loss).backward()
        for k, v in stats.items():
            sums[k] = sums.get(k, 0.0) + v.sum().float()
        offset = stop
    return {k: v / n for k, v in sums.items()}


def reduced_minibatch_gradient(policy: ActorCritic, optimizer: torch.optim.Optimizer,
                               buffer: RolloutBuffer, mb: torch.Tensor, advantages: torch.Tensor,
                               setup: UpdateSetup) -> dict[str, float]:
    """The minibatch's gradient in ``.grad`` and its statistics, averaged over the ranks when
    ``setup.across_ranks``; backs off on out-of-memory (on every rank at once)."""
    params = [p for p in policy.parameters() if p.requires_grad]

    def attempt() -> dict[str, float]:
        optimizer.zero_grad(set_to_none=True)
        try:
            means = minibatch_gradient(policy, buffer, mb, advantages, setup)
            failed = False
        except Exception as exc:
            if not (setup.across_ranks and is_oom(exc)):
                raise
            optimizer.zero_grad(set_to_none=True)  # this rank's part is void; the others must know
            means, failed = {k: torch.zeros(()) for k in STATS}, True
        if not setup.across_ranks:
            return {k: float(v) for k, v in means.items()}
        averaged, anyone_failed = distributed.reduce_minibatch(params, means, failed)
        if anyone_failed:
            raise PeerOutOfMemory("out of memory on at least one rank in this minibatch")
        return averaged

    return with_oom_backoff(attempt, setup.sizes, "micro",
                            cleanup=lambda: optimizer.zero_grad(set_to_none=True))


def optimizer_step(optimizer: torch.optim.Optimizer, params: list[nn.Parameter],
                   setup: UpdateSetup) -> float:
    """Unscale (fp16), clip, step; a non-finite gradient norm skips the step. Returns the norm."""
    scaler = setup.precision.scaler
    if scaler is not None:
        scaler.unscale_(optimizer)
    grad_norm = float(nn.utils.clip_grad_norm_(params, setup.ppo.max_grad_norm))
    if not math.isfinite(grad_norm):  # never let a NaN/inf step into the weights
        optimizer.zero_grad(set_to_none=True)
    else:
        if setup.before_step is not None:
            setup.before_step(optimizer)
        if scaler is not None:
            scaler.step(optimizer)
        else:
            optimizer.step()
    if scaler is not None:
        scaler.update()  # also after a skip: inf gradients are how fp16's scale calibrates
    return grad_norm


def update(policy: ActorCritic, optimizer: torch.optim.Optimizer, buffer: RolloutBuffer,
           setup: UpdateSetup) -> UpdateResult:
    """``ppo.num_epochs`` passes over the buffer in minibatches, each accumulated over micro-batches,
    clipped and stepped once. With ``ppo.target_kl``, a minibatch whose approx-KL exceeds 1.5x the
    target is not stepped and the update stops (Stable-Baselines3's rule)."""
    cfg = setup.ppo
    params = [p for p in policy.parameters() if p.requires_grad]
    result, totals = UpdateResult(), {}
    for epoch in range(cfg.num_epochs):
        if cfg.recompute_advantages and epoch > 0:
            recompute_advantages(policy, buffer, setup)
        advantages = buffer.flat(buffer.advantages)
        for mb in minibatches(buffer.size, cfg.minibatch_size, setup.generator):
            adv = normalize_advantages(advantages[mb], setup.across_ranks) if cfg.norm_adv else advantages[mb]
            means = reduced_minibatch_gradient(policy, optimizer, buffer, mb, adv, setup)
            if cfg.target_kl and means["approx_kl"] > 1.5 * cfg.target_kl:
                optimizer.zero_grad(set_to_none=True)
                result.stop_kl = means["approx_kl"]
                return _averaged(result, totals)
            grad_norm = optimizer_step(optimizer, params, setup)
            if not math.isfinite(grad_norm):
                result.skipped_steps += 1
                if setup.precision.scaler is None or not all(map(math.isfinite, means.values())):
                    result.trailing_skips += 1  # with fp16, inf gradients alone are the scaler's calibration
                continue
            result.optimizer_steps += 1
            result.trailing_skips = 0
            for k, v in {**means, "grad_norm": grad_norm}.items():
                totals[k] = totals.get(k, 0.0) + v
    return _averaged(result, totals)


def _averaged(result: UpdateResult, totals: dict[str, float]) -> UpdateResult:
    for k, v in totals.items():
        setattr(result, k, v / result.optimizer_steps)
    return result
