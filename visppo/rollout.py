"""Collect one rollout: step the vector env, act batched over envs, fill the buffer.

Values and log-probs come from the same forward pass that picks the action, so
collection costs one policy pass per step. The policy acts in the main
process; env workers only step and render.

Time limits: the vector env runs in SAME_STEP autoreset mode, so the step that
ends an episode already returns the next episode's first observation, and the
final observation is in ``info["final_obs"]``. For a truncated (not terminated)
episode, its value is the bootstrap that GAE needs, as Stable-Baselines3 does;
a terminated one bootstraps with 0.
"""

from __future__ import annotations

import copy
from collections import deque
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass

import gymnasium as gym
import numpy as np
import torch

from visppo.buffer import RolloutBuffer
from visppo.envs import AlternatingHalves, worker_errors
from visppo.policy import ActorCritic


class ActingCopy:
    """The policy's copy on the rollout device, when rollout and training run on different devices.

    Synced from the trained policy once per iteration (never per step): the
    rollout then runs on its device with no cross-device traffic but the
    observations and actions. ``syncs`` counts the refreshes.
    """

    def __init__(self, policy: ActorCritic, device: torch.device):
        self.module = copy.deepcopy(policy).to(device).eval()
        self.module.requires_grad_(False)
        self.device = device
        self.syncs = 0

    @torch.no_grad()
    def sync(self, policy: ActorCritic) -> None:
        for mine, theirs in zip(self.module.state_dict().values(), policy.state_dict().values()):
            mine.copy_(theirs, non_blocking=True)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.syncs += 1


@dataclass
class RolloutState:
    """What carries over from one rollout to the next: the current observations
    and the running return and length of each env's unfinished episode."""

    obs: dict[str, np.ndarray]
    episode_return: np.ndarray
    episode_length: np.ndarray

    @classmethod
    def start(cls, envs: gym.vector.VectorEnv, seed: int) -> RolloutState:
        obs, _ = envs.reset(seed=seed)
        n = envs.num_envs
        return cls(obs=obs, episode_return=np.zeros(n), episode_length=np.zeros(n, dtype=np.int64))


def to_torch(obs: dict[str, np.ndarray], device: torch.device) -> dict[str, torch.Tensor]:
    return {k: torch.as_tensor(v).to(device, non_blocking=True) for k, v in obs.items()}


def _stack_final(final_obs: np.ndarray, index: np.ndarray) -> dict[str, np.ndarray]:
    items = [final_obs[i] for i in index]
    return {k: np.stack([o[k] for o in items]) for k in items[0]}


class _Group:
    """Envs stepped together: all of them, or one half of an :class:`AlternatingHalves`."""

    def __init__(self, envs: gym.vector.VectorEnv, part: slice, whole: gym.vector.VectorEnv, env_id: str):
        self.envs, self.part, self.whole, self.env_id = envs, part, whole, env_id
        self.actions: np.ndarray | None = None

    def send(self, actions: np.ndarray) -> None:
        if isinstance(self.envs, gym.vector.AsyncVectorEnv):
            with worker_errors(self.whole, self.env_id):
                self.envs.step_async(actions)
        else:
            self.actions = actions

    def receive(self) -> tuple:
        with worker_errors(self.whole, self.env_id):
            if isinstance(self.envs, gym.vector.AsyncVectorEnv):
                return self.envs.step_wait()
            return self.envs.step(self.actions)


def collect(envs: gym.vector.VectorEnv, policy: ActorCritic, buffer: RolloutBuffer,
            state: RolloutState, device: torch.device,
            autocast: AbstractContextManager | None = None) -> list[dict[str, float]]:
    """Fill ``buffer`` with ``buffer.T`` steps of every env; returns the episodes that ended.

    Each ended episode is ``{"return", "length", "success"}`` (success is NaN
    when the env reports no ``is_success``). With :class:`AlternatingHalves`
    (``rollout.overlap``) the halves are pipelined: the policy acts on one half
    while the other half's workers step and render, and each env still sees
    observation -> action -> step in order.
    """
    autocast = autocast or nullcontext()
    space = envs.single_action_space
    low = high = None
    if isinstance(space, gym.spaces.Box):
        low, high = space.low, space.high
    episodes: list[dict[str, float]] = []
    env_id = getattr(envs, "env_id", "?")  # set by make_vector_env, for error messages
    if isinstance(envs, AlternatingHalves):
        groups = [_Group(h, part, envs, env_id) for h, part in zip(envs.halves, envs.slices)]
    else:
        groups = [_Group(envs, slice(0, envs.num_envs), envs, env_id)]

    def act(t: int, part: slice) -> np.ndarray:
        obs = {key: arr[part] for key, arr in state.obs.items()}
        with torch.inference_mode(), autocast:
            action, logp, value = policy.act(to_torch(obs, device))
        for key, arr in obs.items():
            buffer.obs[key][t, part].copy_(torch.from_numpy(arr))
        action = action.cpu()
        buffer.actions[t, part] = action
        buffer.logp[t, part] = logp.float().cpu()
        buffer.values[t, part] = value.float().cpu()
        env_action = action.numpy()
        if low is not None:
            env_action = np.clip(env_action, low, high)  # the stored action stays unclipped
        return env_action

    def record(t: int, part: slice, result: tuple) -> None:
        obs, reward, terminated, truncated, info = result
        buffer.rewards[t, part] = torch.as_tensor(reward, dtype=torch.float32)
        buffer.terminated[t, part] = torch.as_tensor(terminated)
        buffer.truncated[t, part] = torch.as_tensor(truncated)
        buffer.final_values[t, part] = 0.0
        bootstrap = np.flatnonzero(truncated & ~terminated)
        if bootstrap.size:
            final = to_torch(_stack_final(info["final_obs"], bootstrap), device)
            with torch.inference_mode(), autocast:
                buffer.final_values[t, torch.as_tensor(part.start + bootstrap)] = policy.value(final).float().cpu()
        returns, lengths = state.episode_return[part], state.episode_length[part]  # views: updated in place
        returns += reward
        lengths += 1
        for i in np.flatnonzero(terminated | truncated):
            success = float("nan")
            final_info = info.get("final_info", {})
            if "is_success" in final_info and final_info.get("_is_success", np.ones(1, bool))[i]:
                success = float(final_info["is_success"][i])
            episodes.append({"return": float(returns[i]), "length": int(lengths[i]), "success": success})
            returns[i] = 0.0
            lengths[i] = 0
        for key, arr in obs.items():
            state.obs[key][part] = arr

    # Pipeline: a group's step stays in flight until the next group has acted and sent its own,
    # so with two halves one renders while the policy acts on the other; one group waits at once.
    in_flight: deque[tuple[int, _Group]] = deque()
    for t in range(buffer.T):
        for group in groups:
            group.send(act(t, group.part))
            in_flight.append((t, group))
            while len(in_flight) >= len(groups):
                step, done = in_flight.popleft()
                record(step, done.part, done.receive())
    while in_flight:
        step, done = in_flight.popleft()
        record(step, done.part, done.receive())
    return episodes
