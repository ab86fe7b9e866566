"""Collect one rollout: step the vector env, act batched over envs, fill the buffer.

Values and log-probs come from the same forward pass that picks the action, so
collection costs one policy pass per step. The policy acts in the main
process; env workers only step and render.

Time limits: the vector env runs in SAME_STEP autoreset mode, so the step that
ends an episode already returns the next episode's first observation, and the
final observation is in ``info["final_obs"]``. For a truncated (not terminated)
episode, its value is the bootstrap that GAE needs, as Stable-Baselines3 does;
a terminated one bootstraps with 0.

Memory: with ``chunk`` (the run's ``memory.infer_chunk_size``), both no-grad passes of a step,
acting and the truncated episodes' bootstrap values, run the encoders over at most ``chunk``
observations at a time (:meth:`ActorCritic.act`); the actions are still drawn in one call over
all envs, so the chunk size never changes what is sampled.
"""

from __future__ import annotations

import copy
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass

import gymnasium as gym
import numpy as np
import torch

from visppo.buffer import RolloutBuffer
from visppo.env_check import check_rollout_step, check_state, success_of
from visppo.envs import worker_errors
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
        for mine, theirs in zip(self.module.state_dict().values(), policy.state_dict().values(), strict=True):
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
    def start(cls, envs: gym.vector.VectorEnv, seed: int | list[int]) -> RolloutState:
        with worker_errors(envs, getattr(envs, "env_id", "?"), "reset"):
            obs, _ = envs.reset(seed=seed)
        n = envs.num_envs
        return cls(obs=obs, episode_return=np.zeros(n), episode_length=np.zeros(n, dtype=np.int64))


def to_torch(obs: dict[str, np.ndarray], device: torch.device) -> dict[str, torch.Tensor]:
    return {k: torch.as_tensor(v).to(device, non_blocking=True) for k, v in obs.items()}


def _stack_final(final_obs: np.ndarray, index: np.ndarray) -> dict[str, np.ndarray]:
    items = [final_obs[i] for i in index]
    return {k: np.stack([o[k] for o in items]) for k in items[0]}


def collect(envs: gym.vector.VectorEnv, policy: ActorCritic, buffer: RolloutBuffer,
            state: RolloutState, device: torch.device,
            autocast: AbstractContextManager | None = None, chunk: int = 0) -> list[dict[str, float]]:
    """Fill ``buffer`` with ``buffer.T`` steps of every env; returns the episodes that ended.

    Each ended episode is ``{"return", "length", "success"}`` (success is NaN
    when the env reports no ``is_success``). ``buffer.last_obs`` gets the
    observation after the last step, ``buffer.truncations`` the final
    observations of episodes cut by a time limit. ``chunk``: the most observations
    one no-grad pass sees (the run's ``memory.infer_chunk_size``; 0: all envs at once).
    """
    autocast = autocast or nullcontext()
    space = envs.single_action_space
    low, high = (space.low, space.high) if isinstance(space, gym.spaces.Box) else (None, None)
    episodes: list[dict[str, float]] = []
    env_id = getattr(envs, "env_id", "?")  # set by make_vector_env, for error messages
    buffer.truncations = []
    for t in range(buffer.T):
        with torch.inference_mode(), autocast:
            action, logp, value = policy.act(to_torch(state.obs, device), chunk=chunk)
        for key, arr in state.obs.items():
            buffer.obs[key][t].copy_(torch.from_numpy(arr))
        action = action.cpu()
        buffer.actions[t] = action
        buffer.logp[t] = logp.float().cpu()
        buffer.values[t] = value.float().cpu()
        env_action = action.numpy() if low is None else np.clip(action.numpy(), low, high)  # stored unclipped
        with worker_errors(envs, env_id, "step"):
            obs, reward, terminated, truncated, info = envs.step(env_action)
        check_rollout_step(env_id, reward, obs)
        buffer.rewards[t] = torch.as_tensor(reward, dtype=torch.float32)
        buffer.terminated[t] = torch.as_tensor(terminated)
        buffer.truncated[t] = torch.as_tensor(truncated)
        buffer.final_values[t] = 0.0
        bootstrap = np.flatnonzero(truncated & ~terminated)
        if bootstrap.size:
            final_np = _stack_final(info["final_obs"], bootstrap)
            check_state(env_id, final_np, bootstrap, "final state observation")  # its value is a bootstrap
            final = {k: torch.from_numpy(v) for k, v in final_np.items()}
            with torch.inference_mode(), autocast:
                final_value = policy.value(to_torch(final, device), chunk=chunk).float()
                buffer.final_values[t, torch.as_tensor(bootstrap)] = final_value.to(buffer.final_values.device)
            buffer.truncations.append((torch.as_tensor(t * buffer.N + bootstrap), final))
        episodes += _ended_episodes(state, reward, terminated | truncated, info, env_id)
        state.obs = obs
    buffer.last_obs = {k: torch.as_tensor(v).clone() for k, v in state.obs.items()}
    return episodes


def _ended_episodes(state: RolloutState, reward: np.ndarray, ended: np.ndarray, info: dict,
                    env_id: str = "?") -> list[dict]:
    """Add this step's reward to every env's running episode; return the episodes that ended."""
    state.episode_return += reward
    state.episode_length += 1
    episodes = []
    final_info = info.get("final_info", {})
    for i in np.flatnonzero(ended):
        success = float("nan")
        if "is_success" in final_info and final_info.get("_is_success", np.ones(1, bool))[i]:
            success = success_of(final_info["is_success"][i], env_id)
        episodes.append({"return": float(state.episode_return[i]), "length": int(state.episode_length[i]),
                         "success": success})
        state.episode_return[i] = 0.0
        state.episode_length[i] = 0
    return episodes
