"""The rollout buffer, GAE, and the minibatch / micro-batch index plan.

The buffer is preallocated once, ``[T, N, ...]``, and observations stay uint8:
a 9x84x84 stacked frame is 63 KB as uint8 and 254 KB as float32, so a rollout
of 8x128 such frames is 65 MB instead of 260 MB. When training runs on CUDA the
buffer sits in pinned host memory, so minibatches move with
``non_blocking=True`` while the previous micro-batch computes.
"""

from __future__ import annotations

import math
from collections.abc import Iterator

import gymnasium as gym
import numpy as np
import torch


def compute_gae(rewards: torch.Tensor, values: torch.Tensor, last_value: torch.Tensor,
                terminated: torch.Tensor, truncated: torch.Tensor, final_values: torch.Tensor,
                gamma: float, lam: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalised advantage estimation over a ``[T, N]`` rollout.

    Transition ``t`` ends its episode when ``terminated[t]`` or ``truncated[t]``.
    Its bootstrap is 0 when terminated, ``final_values[t]`` (the value of the
    final observation, which autoreset replaced) when truncated by a time limit,
    else the value of the next step (``values[t+1]``, or ``last_value`` after
    the last step). The lambda-trace is cut at every episode end.

    Returns ``(advantages, returns)`` with ``returns = advantages + values``.
    """
    T = rewards.shape[0]
    last_value = last_value.to(values.device)  # infer() returns host tensors; the buffer may be on a GPU
    terminated = terminated.to(values.dtype)
    truncated = truncated.to(values.dtype)
    ended = torch.clamp(terminated + truncated, max=1.0)
    advantages = torch.zeros_like(values)
    next_adv = torch.zeros_like(last_value)
    for t in reversed(range(T)):
        next_value = last_value if t == T - 1 else values[t + 1]
        next_value = torch.where(truncated[t] > 0, final_values[t], next_value) * (1.0 - terminated[t])
        delta = rewards[t] + gamma * next_value - values[t]
        next_adv = delta + gamma * lam * (1.0 - ended[t]) * next_adv
        advantages[t] = next_adv
    return advantages, advantages + values


def merge_moments(count: float, mean: float, var: float, batch_count: float, batch_mean: float,
                  batch_var: float) -> tuple[float, float, float]:
    """Count, mean and (population) variance of two samples together, from each one's
    (Chan et al.'s parallel rule); a ``count`` of 0 gives the batch's own."""
    total = count + batch_count
    if total == 0:
        return count, mean, var
    delta = batch_mean - mean
    m2 = var * count + batch_var * batch_count + delta**2 * count * batch_count / total
    return total, mean + delta * batch_count / total, m2 / total


def explained_variance(values: torch.Tensor, returns: torch.Tensor) -> float:
    """``1 - Var(returns - values) / Var(returns)``: how much of the rollout's return targets the
    critic predicted before the update (1 perfect, 0 no better than their mean, below 0 worse).
    A critic stuck near 0 leaves the advantages mostly noise. NaN when the targets do not vary."""
    var = float(torch.var(returns.float()))
    return float("nan") if var == 0 else 1.0 - float(torch.var((returns - values).float())) / var


class ReturnScale:
    """Running standard deviation of the discounted return, to scale rewards (``ppo.norm_reward``).

    Tasks differ in reward scale by orders of magnitude (a DMC episode sums up to 1000,
    Reach's about 15): unscaled, the value loss of a large-reward task dominates the
    clipped gradient and the critic's targets drift far from the head's initial scale.
    As Stable-Baselines3's ``VecNormalize(norm_reward=True)``: each env keeps its
    discounted return ``G <- gamma * G + r`` (reset to 0 after an episode ends), the
    variance of all ``G`` seen so far is tracked, and rewards are divided by its std
    (not centred: a shift would change which episodes' ends are good). Updated once per
    rollout from the whole rollout, so every sample of an iteration has the same scale.
    Unlike SB3, the scaled rewards are not clipped (SB3 clips them to +-10 by default).
    """

    def __init__(self, num_envs: int, gamma: float, epsilon: float = 1e-8):
        self.gamma, self.epsilon = gamma, epsilon
        self.running = torch.zeros(num_envs, dtype=torch.float64)
        """Each env's discounted return so far in its current episode."""
        self.count, self.mean, self.var = 1e-4, 0.0, 1.0  # as SB3's RunningMeanStd starts

    def discounted_returns(self, rewards: torch.Tensor, ended: torch.Tensor) -> torch.Tensor:
        """``[T, N]`` discounted returns of one rollout, carrying each env's running one on."""
        out = torch.empty(rewards.shape, dtype=torch.float64)
        for t in range(rewards.shape[0]):
            self.running = self.gamma * self.running + rewards[t].double()
            out[t] = self.running
            self.running = torch.where(ended[t], 0.0, self.running)
        return out

    def add(self, returns: torch.Tensor) -> None:
        """Merge a batch of returns into the running mean and variance (Chan et al.'s parallel rule)."""
        if returns.numel() == 0:
            return
        r = returns.double()
        self.count, self.mean, self.var = merge_moments(self.count, self.mean, self.var, r.numel(),
                                                        r.mean().item(), r.var(unbiased=False).item())

    @property
    def std(self) -> float:
        return math.sqrt(self.var + self.epsilon)

    def state_dict(self) -> dict:
        return {"running": self.running.clone(), "count": self.count, "mean": self.mean, "var": self.var}

    def load_state_dict(self, state: dict) -> None:
        self.running = state["running"].clone().double()
        self.count, self.mean, self.var = float(state["count"]), float(state["mean"]), float(state["var"])


class RolloutBuffer:
    """Preallocated ``[T, N, ...]`` storage for one iteration's rollout.

    Args:
        num_steps: T, steps per env.
        num_envs: N.
        obs_space: the vector env's single observation space (dict with "pixels" uint8).
        action_space: the single action space.
        pin_memory: allocate in pinned host memory (when training on CUDA).
        device: where the buffer lives: host memory by default, or the train
            device when ``memory.buffer_device=device`` and the probe says it fits.
        channels_last: store ``[C, H, W]`` image observations as ``[H, W, C]`` in
            memory (the tensors keep their ``[T, N, C, H, W]`` shape), so a gathered
            minibatch is already in the layout of a channels_last encoder instead of
            being transposed again for every minibatch of every epoch.
    """

    def __init__(self, num_steps: int, num_envs: int, obs_space: gym.spaces.Dict,
                 action_space: gym.Space, pin_memory: bool = False,
                 device: torch.device | str = "cpu", channels_last: bool = False):
        self.T, self.N = num_steps, num_envs
        self._staging: list[dict[str, torch.Tensor]] = [{}, {}]  # two pinned sets, used in turn
        self._staging_ready: list = [None, None]  # CUDA events: the copy out of each set is done
        self._turn = 0

        self.pinned = pin_memory and torch.device(device).type == "cpu"

        def alloc(shape: tuple[int, ...], dtype: torch.dtype, hwc: bool = False) -> torch.Tensor:
            if hwc:  # memory [T, N, H, W, C], seen as [T, N, C, H, W]
                c, h, w = shape
                return alloc((h, w, c), dtype).permute(0, 1, 4, 2, 3)
            t = torch.zeros((num_steps, num_envs, *shape), dtype=dtype, device=device)
            return t.pin_memory() if self.pinned else t

        self.obs: dict[str, torch.Tensor] = {}
        for key, space in obs_space.spaces.items():
            dtype = torch.uint8 if space.dtype == np.uint8 else torch.float32
            image = dtype == torch.uint8 and len(space.shape) == 3
            self.obs[key] = alloc(tuple(space.shape), dtype, hwc=channels_last and image)
        if isinstance(action_space, gym.spaces.Discrete):
            self.actions = alloc((), torch.long)
        else:
            self.actions = alloc(tuple(action_space.shape), torch.float32)
        self.logp = alloc((), torch.float32)
        self.values = alloc((), torch.float32)
        self.rewards = alloc((), torch.float32)
        self.terminated = alloc((), torch.bool)
        self.truncated = alloc((), torch.bool)
        self.final_values = alloc((), torch.float32)
        self.advantages = alloc((), torch.float32)
        self.returns = alloc((), torch.float32)
        self.last_obs: dict[str, torch.Tensor] = {}
        """The observation after the last step (host memory): GAE bootstraps from its value."""
        self.truncations: list[tuple[torch.Tensor, dict[str, torch.Tensor]]] = []
        """Per step with time-limit truncations: (flat indices, the final observations the
        autoreset replaced), so their bootstrap values can be recomputed with a newer critic."""

    @property
    def size(self) -> int:
        return self.T * self.N

    def nbytes(self) -> int:
        tensors = [*self.obs.values(), self.actions, self.logp, self.values, self.rewards,
                   self.terminated, self.truncated, self.final_values, self.advantages, self.returns]
        return sum(t.numel() * t.element_size() for t in tensors)

    def flat(self, tensor: torch.Tensor) -> torch.Tensor:
        """``[T, N, ...]`` -> ``[T * N, ...]``, a view (channels_last storage included)."""
        return tensor.view(self.size, *tensor.shape[2:])

    def flat_obs(self) -> dict[str, torch.Tensor]:
        return {k: self.flat(v) for k, v in self.obs.items()}

    def truncated_final_obs(self) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """Flat indices of the rollout's time-limit truncations and their final observations."""
        if not self.truncations:
            return torch.zeros(0, dtype=torch.long), {}
        index = torch.cat([i for i, _ in self.truncations])
        keys = self.truncations[0][1]
        return index, {k: torch.cat([obs[k] for _, obs in self.truncations]) for k in keys}

    def gather(self, index: torch.Tensor, device: torch.device) -> dict[str, torch.Tensor]:
        """Samples at flat ``index`` moved to ``device``; obs stay uint8 until the encoder.

        Towards CUDA from a pinned buffer, the samples are gathered into one of
        two pinned staging sets (a plain gather would land in pageable memory,
        which cannot copy asynchronously); the copy then overlaps the compute of
        the previous micro-batch, and a set is reused only once its copy is done.
        """
        sources = {f"obs.{k}": v for k, v in self.obs.items()}
        for name in ("actions", "logp", "values", "returns"):
            sources[name] = getattr(self, name)
        if not (self.pinned and device.type == "cuda"):
            index = index.to(self.rewards.device)
            return {k: self.flat(v)[index].to(device) for k, v in sources.items()}
        turn, self._turn = self._turn, 1 - self._turn
        if self._staging_ready[turn] is not None:
            self._staging_ready[turn].synchronize()
        staging, out = self._staging[turn], {}
        for key, src in sources.items():
            flat = self.flat(src)
            if key not in staging or staging[key].shape[0] < len(index):
                staging[key] = _pinned_like(flat, len(index))
            part = staging[key][: len(index)]
            torch.index_select(flat, 0, index, out=part)
            out[key] = part.to(device, non_blocking=True)
        self._staging_ready[turn] = torch.cuda.Event()
        self._staging_ready[turn].record()
        return out


def _pinned_like(flat: torch.Tensor, n: int) -> torch.Tensor:
    """Pinned ``[n, ...]`` in ``flat``'s memory layout (NCHW or channels_last)."""
    if flat.dim() == 4 and not flat.is_contiguous() and flat.is_contiguous(memory_format=torch.channels_last):
        c, h, w = flat.shape[1:]
        return torch.empty((n, h, w, c), dtype=flat.dtype, pin_memory=True).permute(0, 3, 1, 2)
    return torch.empty((n, *flat.shape[1:]), dtype=flat.dtype, pin_memory=True)


def obs_of(batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The observation dict inside a gathered batch."""
    return {k[4:]: v for k, v in batch.items() if k.startswith("obs.")}


def minibatches(size: int, minibatch_size: int, generator: torch.Generator) -> list[torch.Tensor]:
    """A random permutation of ``range(size)`` cut into minibatches (the last may be shorter)."""
    perm = torch.randperm(size, generator=generator)
    return list(torch.split(perm, minibatch_size))


def micro_batches(index: torch.Tensor, micro_batch_size: int) -> Iterator[torch.Tensor]:
    """Consecutive slices of a minibatch's indices; the last may be shorter."""
    yield from torch.split(index, micro_batch_size)
