"""The PPO update, memory-bounded: chunked no-grad passes and accumulated micro-batches.

Two memory knobs, neither of which changes the maths:

- ``infer_chunk_size``: every no-grad pass (bootstrap values, recomputed
  ``logp_old`` and values) runs over at most this many samples at a time.
- ``micro_batch_size``: each minibatch's backward runs in slices of this many
  samples. A slice's loss is ``sum(per-sample loss) / minibatch_size``, so the
  summed gradients are the minibatch's gradient, also when the last slice is
  shorter. Everything that is a statistic *of the minibatch* (advantage
  normalisation, approx-KL for early stopping, clip fraction) is computed over
  the whole minibatch, never per slice. One clip and one optimizer step per
  minibatch.

Under torchrun, ``update`` gets a DistributedDataParallel wrapper of :class:`Evaluate`
(``ddp``) and every rank runs it on its own rollout: micro-batches before a minibatch's
last run under ``no_sync()``, so gradients are all-reduced once per optimizer step, and
the minibatch statistics above are those of all ranks' minibatches together
(:mod:`visppo.distributed`).
"""

from __future__ import annotations

import math
import warnings
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass

import torch
from torch import nn

from visppo import distributed
from visppo.buffer import RolloutBuffer, compute_gae, micro_batches, minibatches, obs_of
from visppo.config import PPOConfig
from visppo.memory import is_oom
from visppo.policy import ActorCritic, Obs

# --------------------------------------------------------------------------- precision


@dataclass
class Precision:
    """Mixed-precision settings for one device: autocast dtype (None = fp32) and fp16 scaler."""

    device: torch.device
    dtype: torch.dtype | None = None
    scaler: torch.amp.GradScaler | None = None

    def autocast(self) -> AbstractContextManager:
        if self.dtype is None:
            return nullcontext()
        return torch.autocast(self.device.type, dtype=self.dtype)


def cpu_has_fast_bf16() -> bool:
    """True when the CPU has native bf16 matmul units (AVX512-BF16 or AMX)."""
    try:
        flags = open("/proc/cpuinfo").read()
    except OSError:
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags


def resolve_precision(amp: str, device: torch.device) -> Precision:
    """``train.amp`` -> Precision. ``auto``: bf16 where the hardware does it fast, else fp32."""
    if amp == "auto":
        if device.type == "cuda":
            amp = "bf16" if torch.cuda.is_bf16_supported() else "fp16"
        else:
            amp = "bf16" if cpu_has_fast_bf16() else "off"
    if amp == "off":
        return Precision(device)
    if amp == "fp16":
        if device.type != "cuda":
            raise ValueError("train.amp=fp16 needs a CUDA device: use bf16 or off on the CPU")
        return Precision(device, torch.float16, torch.amp.GradScaler("cuda"))
    return Precision(device, torch.bfloat16)


# --------------------------------------------------------------------------- memory sizes


@dataclass
class MemorySizes:
    """The two memory knobs in effect. An out-of-memory error halves the one concerned for
    the rest of the run (the retried pass gives the same result: sizes never change the maths)."""

    micro: int
    chunk: int

    def halve(self, which: str, exc: BaseException) -> None:
        size = getattr(self, which)
        if size <= 1 or not is_oom(exc):
            raise exc
        setattr(self, which, size // 2)
        name = {"micro": "memory.micro_batch_size", "chunk": "memory.infer_chunk_size"}[which]
        warnings.warn(f"out of memory at {name}={size}: retrying with {size // 2} for the rest of the run",
                      RuntimeWarning, stacklevel=3)
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


def _sizes(chunk: int | MemorySizes) -> MemorySizes:
    return chunk if isinstance(chunk, MemorySizes) else MemorySizes(micro=0, chunk=int(chunk))


# --------------------------------------------------------------------------- no-grad passes


def _slice(obs: Obs, start: int, stop: int, device: torch.device) -> Obs:
    nb = device.type == "cuda"
    return {k: v[start:stop].to(device, non_blocking=nb) for k, v in obs.items()}


@torch.inference_mode()
def score(policy: ActorCritic, obs: Obs, actions: torch.Tensor | None, chunk_size: int | MemorySizes,
          device: torch.device, precision: Precision | None = None
          ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Values (and log-probs of ``actions`` if given) of flat ``obs``, ``chunk_size`` at a time.

    Inputs may live on the host; each chunk moves to ``device`` alone, so peak
    memory is one chunk's activations whatever the rollout size. Outputs are
    float32 on the CPU. Given :class:`MemorySizes`, an out-of-memory error
    halves ``sizes.chunk`` and retries the same chunk.
    """
    sizes = _sizes(chunk_size)
    autocast = precision.autocast() if precision else nullcontext()
    n = next(iter(obs.values())).shape[0]
    values = torch.empty(n, dtype=torch.float32)
    logp = torch.empty(n, dtype=torch.float32) if actions is not None else None
    start = 0
    while start < n:
        stop = min(start + sizes.chunk, n)
        try:
            chunk = _slice(obs, start, stop, device)
            with autocast:
                if actions is None:
                    values[start:stop] = policy.value(chunk).float().cpu()
                else:
                    lp, _, v = policy.evaluate(chunk, actions[start:stop].to(device))
                    values[start:stop] = v.float().cpu()
                    logp[start:stop] = lp.float().cpu()  # type: ignore[index]
        except Exception as exc:  # noqa: BLE001  re-raised unless it is an OOM
            sizes.halve("chunk", exc)
            continue
        start = stop
    return values, logp


def score_rollout(policy: ActorCritic, buffer: RolloutBuffer, last_obs: Obs, cfg: PPOConfig,
                  chunk_size: int | MemorySizes, device: torch.device, precision: Precision) -> None:
    """After collection: bootstrap value of the last observation (and ``logp_old`` again if
    ``cfg.recompute_logp_old``), chunked; then GAE into ``buffer.advantages`` / ``returns``."""
    last_value, _ = score(policy, last_obs, None, chunk_size, device, precision)
    if cfg.recompute_logp_old:
        flat_obs = {k: buffer.flat(v) for k, v in buffer.obs.items()}
        _, logp = score(policy, flat_obs, buffer.flat(buffer.actions), chunk_size, device, precision)
        buffer.logp.copy_(logp.view(buffer.T, buffer.N))
    adv, ret = compute_gae(buffer.rewards, buffer.values, last_value, buffer.terminated,
                           buffer.truncated, buffer.final_values, cfg.gamma, cfg.gae_lambda)
    buffer.advantages.copy_(adv)
    buffer.returns.copy_(ret)


def recompute_advantages(policy: ActorCritic, buffer: RolloutBuffer, last_obs: Obs, cfg: PPOConfig,
                         chunk_size: int | MemorySizes, device: torch.device, precision: Precision) -> None:
    """Refresh ``buffer.values``, advantages and returns with the current critic (chunked)."""
    values, _ = score(policy, {k: buffer.flat(v) for k, v in buffer.obs.items()}, None,
                      chunk_size, device, precision)
    buffer.values.copy_(values.view(buffer.T, buffer.N))
    last_value, _ = score(policy, last_obs, None, chunk_size, device, precision)
    adv, ret = compute_gae(buffer.rewards, buffer.values, last_value, buffer.terminated,
                           buffer.truncated, buffer.final_values, cfg.gamma, cfg.gae_lambda)
    buffer.advantages.copy_(adv)
    buffer.returns.copy_(ret)


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


# --------------------------------------------------------------------------- the update


class Evaluate(nn.Module):
    """``forward`` is ``policy.evaluate`` (``evaluate_augmented`` given ``aug_obs``): the module
    DistributedDataParallel wraps, since DDP reduces the gradients of passes through ``forward`` only."""

    def __init__(self, policy: ActorCritic):
        super().__init__()
        self.policy = policy

    def forward(self, obs: Obs, actions: torch.Tensor, aug_obs: Obs | None = None):
        if aug_obs is None:
            return self.policy.evaluate(obs, actions)
        return self.policy.evaluate_augmented(obs, aug_obs, actions)


def minibatch_gradient(policy: ActorCritic, buffer: RolloutBuffer, mb: torch.Tensor,
                       advantages: torch.Tensor, cfg: PPOConfig, micro_batch_size: int,
                       device: torch.device, precision: Precision, ddp: nn.Module | None = None
                       ) -> dict[str, torch.Tensor]:
    """Accumulate the gradient of the minibatch ``mb`` into ``.grad``, one micro-batch at a time.

    ``advantages`` are the minibatch's (already normalised over the whole
    minibatch). Returns the minibatch's mean loss terms, approx-KL and clip fraction
    (0-d tensors, so that no host sync happens per minibatch unless asked).

    With ``cfg.drac_coef`` and ``policy.augment``: the PPO loss stays on the
    original frames; each micro-batch also runs on its augmented frames (on the
    device, in the same forward pass) for the DrAC terms. The minibatch's augmentation draws are made
    at once before the split, so micro-batching does not change them.

    ``ddp`` (DistributedDataParallel over ``Evaluate(policy)``): the forward passes go through
    it, all but the last micro-batch under ``no_sync()``: one all-reduce of the summed gradient.
    """
    from visppo.augment import drac_loss

    n = len(mb)
    sums: dict[str, torch.Tensor] = {}
    offset = 0
    augment = getattr(policy, "augment", None) if cfg.drac_coef else None
    if augment is not None:  # drawn ahead, committed at the end: an OOM retry draws the same shifts
        draws, rng_after = augment.draw_ahead(n)
    micros = list(micro_batches(mb, micro_batch_size))
    for i, micro in enumerate(micros):
        accumulate_only = ddp.no_sync() if ddp is not None and i < len(micros) - 1 else nullcontext()
        with accumulate_only:  # forward and backward: only the minibatch's last backward all-reduces
            batch = buffer.gather(micro, device)
            micro_adv = advantages[offset:offset + len(micro)].to(device)
            obs = obs_of(batch)
            with precision.autocast():
                if augment is None:
                    new_logp, entropy, new_values = _evaluate(policy, ddp, obs, batch["actions"])
                else:
                    aug_obs = augment.augment_obs(obs, draws[offset:offset + len(micro)])
                    new_logp, entropy, new_values, dist, aug_dist, aug_values = _evaluate(
                        policy, ddp, obs, batch["actions"], aug_obs)
            offset += len(micro)
            loss, stats = ppo_loss(new_logp, batch["logp"], micro_adv, new_values, batch["values"],
                                   batch["returns"], entropy, cfg.clip_coef, cfg.clip_value,
                                   cfg.value_coef, cfg.entropy_coef)
            if augment is not None:
                reg, reg_stats = drac_loss(dist, new_values, aug_dist, aug_values)
                loss = loss + cfg.drac_coef * reg
                stats.update(reg_stats)
            loss = loss.sum() / n  # the minibatch mean, split over micro-batches
            (precision.scaler.scale(loss) if precision.scaler else loss).backward()
        for k, v in stats.items():
            sums[k] = sums.get(k, 0.0) + v.sum().float()
    if augment is not None:
        augment.generator.set_state(rng_after)
    return {k: v / n for k, v in sums.items()}  # tensors: no device sync here


def _evaluate(policy: ActorCritic, ddp: nn.Module | None, obs: Obs, actions: torch.Tensor,
              aug_obs: Obs | None = None):
    if ddp is not None:
        return ddp(obs, actions, aug_obs)  # through DDP's forward, or no gradient would be reduced
    if aug_obs is None:
        return policy.evaluate(obs, actions)
    return policy.evaluate_augmented(obs, aug_obs, actions)


def normalize_advantages(adv: torch.Tensor, ddp: nn.Module | None = None) -> torch.Tensor:
    """``(adv - mean) / (std + 1e-8)`` with the mean and unbiased std of the whole minibatch (never
    of a micro-batch); with ``ddp``, of the minibatch over all ranks (one all-reduce)."""
    if ddp is None:
        return (adv - adv.mean()) / (adv.std() + 1e-8) if len(adv) > 1 else adv
    mean, std, count = distributed.mean_std(adv)
    return (adv - mean) / (std + 1e-8) if count > 1 else adv


@dataclass
class UpdateResult:
    """What one iteration's update did, averaged over the minibatches that stepped."""

    stats: dict[str, float]
    optimizer_steps: int
    skipped_steps: int
    early_stopped: bool
    trailing_skips: int = 0
    """Non-finite steps since the last good one (the divergence guard counts these across updates)."""


def update(policy: ActorCritic, optimizer: torch.optim.Optimizer, buffer: RolloutBuffer,
           cfg: PPOConfig, micro_batch_size: int | MemorySizes, infer_chunk_size: int | None,
           device: torch.device, precision: Precision, generator: torch.Generator,
           last_obs: Obs | None = None, before_step=None, ddp: nn.Module | None = None) -> UpdateResult:
    """``cfg.num_epochs`` passes over the buffer in minibatches, each accumulated over micro-batches.

    ``before_step(optimizer)`` runs before every optimizer step (e.g. to freeze
    the encoder); ``last_obs`` is needed only with ``cfg.recompute_advantages``.
    Given :class:`MemorySizes` (then ``infer_chunk_size`` is ignored), an
    out-of-memory error clears the partial gradients, halves ``sizes.micro``
    and retries the same minibatch.

    ``ddp``: DistributedDataParallel over ``Evaluate(policy)``, when every rank runs this
    update on its own rollout. A minibatch is then ``cfg.minibatch_size`` samples of each
    rank; its gradient is averaged over the ranks, its advantages normalised and its
    statistics (approx-KL for early stopping too) taken over all of them, so every rank
    steps, skips or stops alike.
    """
    sizes = (micro_batch_size if isinstance(micro_batch_size, MemorySizes)
             else MemorySizes(int(micro_batch_size), int(infer_chunk_size or 1024)))
    params = [p for p in policy.parameters() if p.requires_grad]
    totals: dict[str, float] = {}
    steps = skipped = trailing = 0
    early_stopped = False
    for epoch in range(cfg.num_epochs):
        if cfg.recompute_advantages and epoch > 0:
            recompute_advantages(policy, buffer, last_obs, cfg, sizes, device, precision)
        advantages = buffer.flat(buffer.advantages)
        for mb in minibatches(buffer.size, cfg.minibatch_size, generator):
            adv = advantages[mb]
            if cfg.norm_adv:
                adv = normalize_advantages(adv, ddp)
            while True:
                optimizer.zero_grad(set_to_none=True)
                try:
                    means = minibatch_gradient(policy, buffer, mb, adv, cfg, sizes.micro, device, precision, ddp)
                    break
                except Exception as exc:  # noqa: BLE001  re-raised unless it is an OOM
                    optimizer.zero_grad(set_to_none=True)  # drop the partial gradients
                    sizes.halve("micro", exc)
            mb_stats = ({k: float(v) for k, v in means.items()} if ddp is None
                        else distributed.mean_over_ranks(means))  # same size on every rank: the global mean
            if cfg.target_kl and mb_stats["approx_kl"] > 1.5 * cfg.target_kl:
                optimizer.zero_grad(set_to_none=True)
                early_stopped = True  # SB3's rule: this minibatch's step is not taken
                totals["stop_kl"] = mb_stats["approx_kl"]
                break
            if precision.scaler:
                precision.scaler.unscale_(optimizer)
            grad_norm = nn.utils.clip_grad_norm_(params, cfg.max_grad_norm)
            if not torch.isfinite(grad_norm):
                skipped += 1  # never let a NaN/inf step into the weights
                loss_finite = all(math.isfinite(v) for v in mb_stats.values())
                if precision.scaler is None or not loss_finite:
                    trailing += 1  # with fp16, inf gradients alone are the scaler's calibration
                optimizer.zero_grad(set_to_none=True)
                if precision.scaler:
                    precision.scaler.update()
                continue
            if before_step is not None:
                before_step(optimizer)
            if precision.scaler:
                precision.scaler.step(optimizer)
                precision.scaler.update()
            else:
                optimizer.step()
            steps += 1
            trailing = 0
            mb_stats["grad_norm"] = float(grad_norm)
            _accumulate(totals, mb_stats)
        if early_stopped:
            break
    count = totals.pop("_count", 1.0) or 1.0
    stop_kl = totals.pop("stop_kl", None)
    stats = {k: v / count for k, v in totals.items()}
    if stop_kl is not None:
        stats["stop_kl"] = stop_kl
    return UpdateResult(stats, steps, skipped, early_stopped, trailing)


def _accumulate(totals: dict[str, float], stats: dict[str, float]) -> None:
    for k, v in stats.items():
        totals[k] = totals.get(k, 0.0) + v
    totals["_count"] = totals.get("_count", 0.0) + 1
