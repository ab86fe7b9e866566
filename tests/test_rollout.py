import gymnasium as gym
import numpy as np
import pytest
import torch

from visppo.buffer import RolloutBuffer
from visppo.envs import PixelDict
from visppo.rollout import RolloutState, collect


class Counter(gym.Env):
    """Frames filled with the step count; terminates at step ``terminate_at`` if set."""

    observation_space = gym.spaces.Box(0, 255, (4, 4, 3), np.uint8)
    action_space = gym.spaces.Box(-1, 1, (1,), np.float32)

    def __init__(self, terminate_at: int = 0):
        self.t, self.terminate_at, self.received = 0, terminate_at, []

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        self.t = 0
        return np.full((4, 4, 3), self.t, np.uint8), {}

    def step(self, action):
        self.received.append(np.asarray(action).copy())
        self.t += 1
        terminated = bool(self.terminate_at) and self.t == self.terminate_at
        return np.full((4, 4, 3), self.t, np.uint8), 1.0, terminated, False, {"is_success": self.t == 2}


class PixelValuePolicy:
    """value(obs) = the frame's pixel value: tells which observation the rollout bootstrapped with."""

    def act(self, obs, chunk=0):
        n = obs["pixels"].shape[0]
        value = obs["pixels"].float().mean(dim=(1, 2, 3))
        return torch.full((n, 1), 5.0), torch.zeros(n), value

    def value(self, obs, chunk=0):
        return obs["pixels"].float().mean(dim=(1, 2, 3))


def _envs(terminate_at=0, limit=3):
    made = []

    def make():
        env = Counter(terminate_at)
        made.append(env)
        return PixelDict(gym.wrappers.TimeLimit(env, limit), frame_stack=1, keep_state=False)

    envs = gym.vector.SyncVectorEnv([make], autoreset_mode=gym.vector.AutoresetMode.SAME_STEP)
    return envs, made


def test_truncation_bootstraps_with_the_final_observation():
    envs, _ = _envs(limit=3)
    buf = RolloutBuffer(7, 1, envs.single_observation_space, envs.single_action_space)
    state = RolloutState.start(envs, seed=0)
    episodes = collect(envs, PixelValuePolicy(), buf, state, torch.device("cpu"))
    trunc = buf.truncated[:, 0].tolist()
    assert trunc == [False, False, True, False, False, True, False]
    # the final frame of each episode shows 3; the reset frame that replaced it shows 0
    assert buf.final_values[2, 0].item() == 3.0 and buf.final_values[5, 0].item() == 3.0
    assert buf.values[3, 0].item() == 0.0  # the next step acts on the reset frame
    assert [e["return"] for e in episodes] == [3.0, 3.0] and [e["length"] for e in episodes] == [3, 3]
    assert all(e["success"] == 0.0 for e in episodes)  # is_success of the final step (t=3)


def test_termination_does_not_bootstrap():
    envs, _ = _envs(terminate_at=2, limit=10)
    buf = RolloutBuffer(4, 1, envs.single_observation_space, envs.single_action_space)
    collect(envs, PixelValuePolicy(), buf, RolloutState.start(envs, seed=0), torch.device("cpu"))
    assert buf.terminated[:, 0].tolist() == [False, True, False, True]
    assert not buf.truncated.any() and torch.all(buf.final_values == 0)


def test_actions_are_clipped_for_the_env_and_stored_unclipped():
    envs, made = _envs()
    buf = RolloutBuffer(2, 1, envs.single_observation_space, envs.single_action_space)
    collect(envs, PixelValuePolicy(), buf, RolloutState.start(envs, seed=0), torch.device("cpu"))
    assert buf.actions[:, 0, 0].tolist() == [5.0, 5.0]
    assert [float(a[0]) for a in made[0].received] == [1.0, 1.0]


def test_observations_carry_over_between_rollouts():
    envs, _ = _envs(limit=100)
    buf = RolloutBuffer(2, 1, envs.single_observation_space, envs.single_action_space)
    state = RolloutState.start(envs, seed=0)
    collect(envs, PixelValuePolicy(), buf, state, torch.device("cpu"))
    collect(envs, PixelValuePolicy(), buf, state, torch.device("cpu"))
    assert buf.obs["pixels"][:, 0, 0, 0, 0].tolist() == [2, 3]


def test_a_killed_env_worker_ends_the_rollout_with_a_clear_error():
    import os
    import signal

    from visppo.config import load_config
    from visppo.envs import make_vector_env
    from visppo.errors import RunError

    cfg = load_config(None, ["env.id=visppo/DotReach-v0", "ppo.num_envs=2", "env.vector=async"])
    envs = make_vector_env(cfg)
    try:
        buf = RolloutBuffer(4, 2, envs.single_observation_space, envs.single_action_space)
        state = RolloutState.start(envs, seed=0)
        os.kill(envs.processes[1].pid, signal.SIGKILL)
        envs.processes[1].join(timeout=10)
        with pytest.raises(RunError, match=r"visppo/DotReach-v0: during step, worker 1 died of signal SIGKILL"):
            collect(envs, PixelValuePolicy(), buf, state, torch.device("cpu"))
    finally:
        envs.close(terminate=True)


def test_an_env_that_raises_ends_the_rollout_with_a_clear_error():

    from visppo.errors import RunError

    class Broken(Counter):
        def step(self, action):
            raise ValueError("simulator exploded")

    envs = gym.vector.SyncVectorEnv([lambda: PixelDict(Broken(), 1, False)],
                                    autoreset_mode=gym.vector.AutoresetMode.SAME_STEP)
    envs.env_id = "Broken-v0"
    buf = RolloutBuffer(2, 1, envs.single_observation_space, envs.single_action_space)
    with pytest.raises(RunError, match="Broken-v0 failed during step: raised ValueError: simulator exploded"):
        collect(envs, PixelValuePolicy(), buf, RolloutState.start(envs, seed=0), torch.device("cpu"))


def test_acting_copy_equals_the_policy_after_sync_and_only_then():
    from visppo.config import ModelConfig
    from visppo.policy import ActorCritic
    from visppo.rollout import ActingCopy

    space = gym.spaces.Dict({"pixels": gym.spaces.Box(0, 255, (3, 48, 48), np.uint8)})
    policy = ActorCritic(space, gym.spaces.Box(-1, 1, (2,), np.float32), ModelConfig(feature_dim=16))
    acting = ActingCopy(policy, torch.device("cpu"))
    with torch.no_grad():
        for p in policy.parameters():
            p.add_(1.0)
    assert all(not torch.equal(a, b) for a, b in zip(acting.module.parameters(), policy.parameters()))
    acting.sync(policy)
    assert all(torch.equal(a, b) for a, b in zip(acting.module.parameters(), policy.parameters()))
    assert acting.syncs == 1
    assert all(not p.requires_grad for p in acting.module.parameters())


class ObsPolicy:
    """Deterministic: action, log-prob and value are functions of the frame, so two rollouts that
    see the same observations fill the same buffer, whatever order the envs are stepped in."""

    def __init__(self, act_dim: int, calls: list | None = None):
        self.act_dim, self.calls = act_dim, calls

    def act(self, obs, chunk=0):
        level = obs["pixels"].float().mean(dim=(1, 2, 3)) / 255.0
        if self.calls is not None:
            self.calls.append(f"act {level.shape[0]}")
        return (level[:, None] - 0.5).expand(-1, self.act_dim).clone(), level * 2, level * 3

    def value(self, obs, chunk=0):
        return obs["pixels"].float().mean(dim=(1, 2, 3)) / 255.0 * 3


def _collect_dot(vector: str):
    from visppo.config import load_config
    from visppo.envs import make_vector_env

    cfg = load_config(None, ["env.id=visppo/DotReach-v0", "ppo.num_envs=5", f"env.vector={vector}",
                             "env.max_episode_steps=4"])
    envs = make_vector_env(cfg)
    try:
        buf = RolloutBuffer(9, 5, envs.single_observation_space, envs.single_action_space)
        state = RolloutState.start(envs, seed=3)
        episodes = collect(envs, ObsPolicy(envs.single_action_space.shape[0]), buf, state, torch.device("cpu"))
        counts = envs.get_attr("episode")
        envs.set_attr("episode", [7, 8, 9, 10, 11])  # as a resume restores them
        assert tuple(envs.get_attr("episode")) == (7, 8, 9, 10, 11)
        return buf, episodes, state, counts
    finally:
        envs.close()


def test_envs_in_workers_fill_the_same_rollout_as_envs_in_this_process():
    plain, plain_eps, plain_state, plain_counts = _collect_dot("sync")
    workers, workers_eps, workers_state, workers_counts = _collect_dot("async")
    assert plain.truncated.any()  # episodes ended mid-rollout: bootstraps and resets are covered
    for name in ("actions", "logp", "values", "rewards", "terminated", "truncated", "final_values"):
        assert torch.equal(getattr(plain, name), getattr(workers, name)), name
    for key in plain.obs:
        assert torch.equal(plain.obs[key], workers.obs[key]), key
        assert torch.equal(plain.last_obs[key], workers.last_obs[key]), key
    assert plain_eps == workers_eps
    assert all(np.array_equal(plain_state.obs[k], workers_state.obs[k]) for k in plain_state.obs)
    assert np.array_equal(plain_state.episode_return, workers_state.episode_return)
    assert plain_counts == workers_counts  # per-env episode counters, which checkpoints save


def test_truncated_final_observations_are_kept_for_recomputing_their_bootstrap():
    buf, _, state, _ = _collect_dot("sync")
    index, final_obs = buf.truncated_final_obs()
    truncated = torch.nonzero(buf.flat(buf.truncated & ~buf.terminated)).flatten()
    assert len(truncated) and torch.equal(index.sort().values, truncated)
    # the stored frames are the ones the bootstrap values were computed from
    expected = ObsPolicy(2).value({k: v for k, v in final_obs.items()})
    torch.testing.assert_close(buf.flat(buf.final_values)[index], expected)
    for key, arr in state.obs.items():  # the observation after the last step, for GAE's bootstrap
        assert np.array_equal(buf.last_obs[key].numpy(), arr)


def _acting_policy(action_space: gym.Space, share_encoder: bool = True, obs_space: gym.Space | None = None):
    from visppo.config import ModelConfig
    from visppo.policy import ActorCritic

    torch.manual_seed(0)
    space = obs_space or gym.spaces.Dict({"pixels": gym.spaces.Box(0, 255, (3, 24, 24), np.uint8)})
    policy = ActorCritic(space, action_space, ModelConfig(feature_dim=16, hidden_dim=16, share_encoder=share_encoder))
    return policy.eval()


def _batch_sizes(policy) -> list[int]:
    """The batch sizes the policy's encoders see from now on."""
    seen: list[int] = []
    for enc in policy.encoders():
        enc.register_forward_pre_hook(lambda module, args: seen.append(args[0]["pixels"].shape[0]))
    return seen


def test_collect_runs_the_act_and_bootstrap_passes_in_chunks():
    """collect(chunk=2) over 5 envs whose episodes all end by time limit at once: every pass the
    policy runs (acting, the truncated episodes' bootstrap values) sees at most 2 observations,
    and the rollout equals the one-pass rollout drawn from the same seed."""
    from visppo.config import load_config
    from visppo.envs import make_vector_env

    cfg = load_config(None, ["env.id=visppo/DotReach-v0", "ppo.num_envs=5", "env.vector=sync",
                             "env.max_episode_steps=3", "env.image_size=24"])
    bufs, seen = [], []
    for chunk in (0, 2):
        envs = make_vector_env(cfg)
        try:
            policy = _acting_policy(envs.single_action_space, obs_space=envs.single_observation_space)
            if chunk:
                seen = _batch_sizes(policy)
            buf = RolloutBuffer(7, 5, envs.single_observation_space, envs.single_action_space)
            state = RolloutState.start(envs, seed=3)
            torch.manual_seed(11)
            collect(envs, policy, buf, state, torch.device("cpu"), chunk=chunk)
            bufs.append(buf)
        finally:
            envs.close()
    whole, chunked = bufs
    assert whole.truncated.sum() == 10  # two steps with five bootstraps each
    assert max(seen) == 2 and len(seen) == 7 * 3 + 2 * 3  # 7 act passes and 2 bootstraps, 3 chunks each
    for name in ("actions", "logp", "values", "final_values", "rewards"):
        torch.testing.assert_close(getattr(chunked, name), getattr(whole, name), rtol=1e-5, atol=1e-6, msg=name)
    assert torch.equal(chunked.obs["pixels"], whole.obs["pixels"])


class _NanAtTheTimeLimit(gym.Env):
    """Frames and a state; the episode is cut by a time limit after 2 steps, where the state is NaN
    (physics that blew up on the last step): only the final observation, which autoreset replaces,
    shows it."""

    observation_space = gym.spaces.Dict({"pixels": gym.spaces.Box(0, 255, (3, 8, 8), np.uint8),
                                         "state": gym.spaces.Box(-np.inf, np.inf, (2,), np.float32)})
    action_space = gym.spaces.Box(-1, 1, (1,), np.float32)

    def __init__(self, poisoned: bool):
        self.poisoned, self.t = poisoned, 0

    def _obs(self, nan: bool = False):
        return {"pixels": np.zeros((3, 8, 8), np.uint8), "state": np.full(2, np.nan if nan else 0.0, np.float32)}

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        self.t = 0
        return self._obs(), {}

    def step(self, action):
        self.t += 1
        return self._obs(self.poisoned and self.t == 2), 0.0, False, self.t == 2, {}


def test_a_non_finite_final_state_at_a_time_limit_names_the_env():
    """Its value would be the bootstrap of the cut episode: NaN advantages, then skipped steps."""
    from visppo.env_check import EnvError

    envs = gym.vector.SyncVectorEnv([lambda p=p: _NanAtTheTimeLimit(p) for p in (False, True)],
                                    autoreset_mode=gym.vector.AutoresetMode.SAME_STEP)
    try:
        buf = RolloutBuffer(3, 2, envs.single_observation_space, envs.single_action_space)
        state = RolloutState.start(envs, seed=0)
        with pytest.raises(EnvError, match="non-finite final state observation in env 1"):
            collect(envs, ObsPolicy(1), buf, state, torch.device("cpu"))
    finally:
        envs.close()
