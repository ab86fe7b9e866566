import csv

import pytest
import torch
from conftest import tiny_overrides

from visppo.config import load_config
from visppo.loop import train


def _final_params(run_dir):
    ckpt = torch.load(run_dir / "checkpoints" / "latest.pt", weights_only=True)
    # 2 iterations x 2 epochs x 3 minibatches (50 samples in 20, 20, 10): the runs did train
    assert int(ckpt["optimizer"]["state"][0]["step"]) == 12
    return ckpt["model"]


def test_memory_knobs_do_not_change_the_trained_parameters(tmp_path):
    """Same run, different micro-batch and chunk sizes (dividing and not, or found by the probe,
    which builds a policy of its own and must leave the run's RNG as it was): same parameters."""
    common = dict(**{"ppo.num_steps": 25, "ppo.minibatch_size": 20, "ppo.total_steps": 100,
                     "ppo.recompute_logp_old": "true", "ppo.recompute_advantages": "true",
                     "ppo.clip_value": "true", "train.deterministic": "true"})
    runs = {}
    for name, micro, chunk in [("whole", 0, 1024), ("split", 6, 7), ("even", 10, 25), ("auto", "auto", "auto")]:
        cfg = load_config(None, tiny_overrides(tmp_path / name, **common, **{
            "memory.micro_batch_size": micro, "memory.infer_chunk_size": chunk, "memory.budget": "1GiB"}))
        runs[name] = _final_params(train(cfg))
    ref = runs.pop("whole")
    for name, params in runs.items():
        for key in ref:
            torch.testing.assert_close(params[key], ref[key], rtol=1e-4, atol=1e-6,
                                       msg=f"{name}: {key} differs")


def test_run_directory_layout(tmp_path):
    cfg = load_config(None, tiny_overrides(tmp_path, **{"run.tensorboard": "true", "run.checkpoint_every": 2,
                                                        "run.eval_every": 2, "run.eval_episodes": 1}))
    run_dir = train(cfg)
    assert (run_dir / "config.yaml").is_file()
    assert list(run_dir.glob("events.out.tfevents.*"))
    rows = list(csv.DictReader((run_dir / "metrics.csv").open()))
    assert [int(r["global_step"]) for r in rows] == [64, 128]
    ckpt = torch.load(run_dir / "checkpoints" / "latest.pt", weights_only=True)
    assert {"model", "optimizer", "config", "global_step", "iteration", "rng"} <= ckpt.keys()
    assert ckpt["global_step"] == 128 and ckpt["config"]["ppo"]["num_envs"] == 2
    assert (run_dir / "checkpoints" / "iter_000002.pt").is_file()
    assert [p.name for p in (run_dir / "videos").iterdir()] == ["iter_000002.mp4"]
    assert rows[0]["eval/return"] == "nan" and rows[-1]["eval/return"] != "nan"
    assert all(float(r["value/explained_variance"]) <= 1.0 for r in rows)
    for key in ("health/dead_features", "health/saturated_actor", "health/saturated_critic",
                "health/mean_out_of_bounds"):
        assert all(0.0 <= float(r[key]) <= 1.0 for r in rows), key


@pytest.mark.timeout(900)
def test_learns_the_synthetic_task(tmp_path):
    """PPO from pixels on DotReach: the return rises clearly above a random policy's."""
    cfg = load_config(None, [f"run.dir={tmp_path / 'run'}", "run.progress=false", "env.id=visppo/DotReach-v0",
                             "env.image_size=64",
                             "run.tensorboard=false", "ppo.total_steps=30000", "train.device=cpu"])
    rows = list(csv.DictReader((train(cfg) / "metrics.csv").open()))
    untrained = float(rows[0]["episode_return"])  # the first iteration's episodes: the initial policy
    last = sum(float(r["episode_return"]) for r in rows[-5:]) / 5  # rolling mean of 100 episodes
    assert last > untrained + 1.5, (untrained, last)


def test_split_devices_act_with_a_copy_synced_once_per_iteration(tmp_path, monkeypatch):
    """rollout.device != train.device: collect uses the copy; one sync per iteration, not per step."""
    import visppo.loop as train_module
    from visppo.rollout import ActingCopy

    real_resolve = train_module.resolve_device
    # two distinct CPU device objects stand in for cpu + cuda
    monkeypatch.setattr(train_module, "resolve_device",
                        lambda name, key="train.device": torch.device("cpu", 0) if name == "cpu" else real_resolve(name, key))
    syncs, acted_with = [], []
    real_sync, real_collect = ActingCopy.sync, train_module.collect

    def counting_sync(self, policy):
        real_sync(self, policy)
        syncs.append(self.syncs)
        for mine, theirs in zip(self.module.parameters(), policy.parameters()):
            assert torch.equal(mine, theirs)

    def spying_collect(envs, policy, *args, **kwargs):
        acted_with.append(policy)
        return real_collect(envs, policy, *args, **kwargs)

    monkeypatch.setattr(ActingCopy, "sync", counting_sync)
    monkeypatch.setattr(train_module, "collect", spying_collect)
    cfg = load_config(None, tiny_overrides(tmp_path, **{"rollout.device": "cpu", "train.device": "auto"}))
    train(cfg)
    assert syncs == [1, 2]  # 2 iterations of 32 steps each
    assert len({id(p) for p in acted_with}) == 1 and not any(p.training for p in acted_with)


def test_divergence_guard_skips_bad_steps_then_stops_keeping_the_last_good_checkpoint(tmp_path, monkeypatch):
    import math

    import visppo.checkpoint as ckpt_module
    import visppo.ppo as ppo_module
    from visppo.errors import RunError

    poisoned = {"on": False}
    real_loss, real_save = ppo_module.ppo_loss, ckpt_module.save_checkpoint

    def maybe_nan_loss(*args, **kwargs):
        loss, stats = real_loss(*args, **kwargs)
        return (loss * float("nan"), stats) if poisoned["on"] else (loss, stats)

    def save_then_poison(*args):
        path = real_save(*args)
        poisoned["on"] = True  # every step after the first checkpoint is non-finite
        return path

    monkeypatch.setattr(ppo_module, "ppo_loss", maybe_nan_loss)
    monkeypatch.setattr(ckpt_module, "save_checkpoint", save_then_poison)
    cfg = load_config(None, tiny_overrides(tmp_path, **{"run.checkpoint_every": 1, "ppo.total_steps": 640,
                                                        "train.max_bad_steps": 5}))
    with pytest.raises(RunError, match="diverged: 8 optimizer steps in a row"):
        train(cfg)  # 4 skipped steps per iteration: stops at the end of the second bad iteration
    ckpt = torch.load(tmp_path / "run" / "checkpoints" / "latest.pt", weights_only=True)
    assert ckpt["iteration"] == 2  # skipped steps left the weights as they were: still good
    assert all(torch.isfinite(v).all() for v in ckpt["model"].values() if v.is_floating_point())
    rows = list(csv.DictReader((tmp_path / "run" / "metrics.csv").open()))
    assert [int(r["skipped_steps"]) for r in rows] == [0, 4, 4][: len(rows)] and not math.isnan(
        float(rows[0]["loss/value_loss"]))


def test_a_run_survives_injected_ooms_and_matches_a_run_started_at_the_smaller_size(tmp_path, monkeypatch):
    """OOM above micro-batch 8: the run halves 32 -> 16 -> 8, goes on, and ends like a run at 8."""
    from visppo.policy import ActorCritic

    real_evaluate = ActorCritic.score_actions

    def evaluate_or_oom(self, obs, actions):
        if torch.is_grad_enabled() and len(actions) > 8:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 1.00 GiB")
        return real_evaluate(self, obs, actions)

    common = {"ppo.minibatch_size": 32, "train.deterministic": "true"}
    ref = _final_params_of(train(load_config(None, tiny_overrides(tmp_path / "at8", **common,
                                                                  **{"memory.micro_batch_size": 8}))))
    monkeypatch.setattr(ActorCritic, "score_actions", evaluate_or_oom)
    with pytest.warns(RuntimeWarning, match="out of memory"):
        run = train(load_config(None, tiny_overrides(tmp_path / "oom", **common,
                                                     **{"memory.micro_batch_size": 32})))
    ckpt = torch.load(run / "checkpoints" / "latest.pt", weights_only=True)
    assert ckpt["memory_sizes"]["micro"] == 8  # kept for the rest of the run, and saved
    for key, value in ref.items():
        torch.testing.assert_close(ckpt["model"][key], value, rtol=1e-4, atol=1e-6, msg=key)


def _final_params_of(run_dir):
    return torch.load(run_dir / "checkpoints" / "latest.pt", weights_only=True)["model"]


def test_phase_times_are_logged_and_profile_records_one_iteration(tmp_path):
    import gzip
    import json

    cfg = load_config(None, tiny_overrides(tmp_path, **{"ppo.total_steps": 256, "train.profile": True}))
    run_dir = train(cfg)
    rows = list(csv.DictReader((run_dir / "metrics.csv").open()))
    assert len(rows) == 4
    for phase in ("collect", "values", "update"):
        assert all(float(r[f"time/{phase}"]) > 0 for r in rows), phase
    assert float(rows[0]["time/log"]) == 0.0 and all(float(r["time/log"]) > 0 for r in rows[1:])  # the previous iteration's
    for r in rows:  # the phases are the iteration: their sum is the time steps/s was measured over
        span = 64 / float(r["steps_per_second"])
        phases = sum(float(r[f"time/{p}"]) for p in ("collect", "values", "update", "log"))
        assert 0.8 * span <= phases <= span + 1e-3, (phases, span)  # clocks read microseconds apart
    traces = list((run_dir / "profile").glob("*.pt.trace.json*"))
    assert len(traces) == 1
    raw = traces[0].read_bytes()
    names = {e.get("name") for e in json.loads(gzip.decompress(raw) if traces[0].suffix == ".gz" else raw)["traceEvents"]}
    assert {"collect", "values", "update", "log"} <= names


def test_norm_reward_hands_the_update_the_same_rewards_whatever_the_task_scale():
    """Rewards 1000x larger give the same scaled rewards (GAE and the value loss then see the
    same numbers); scaled rewards have about unit discounted-return std. Each env's running return
    restarts after every episode end, a time-limit truncation as well as a termination, also in
    the return it carries into the next rollout."""
    import gymnasium as gym
    import numpy as np

    from visppo import distributed
    from visppo.buffer import ReturnScale, RolloutBuffer
    from visppo.loop import scale_rewards

    space = gym.spaces.Dict({"pixels": gym.spaces.Box(0, 255, (3, 8, 8), np.uint8)})
    act = gym.spaces.Box(-1, 1, (2,), np.float32)
    gen = torch.Generator().manual_seed(0)
    rewards = torch.rand(64, 4, generator=gen)
    ends = torch.rand(64, 4, generator=gen) > 0.95
    truncated = ends & (torch.rand(64, 4, generator=gen) > 0.5)
    terminated = ends & ~truncated
    truncated[-1, 0] = True  # an env whose last step is a truncation: nothing carried on
    ends = terminated | truncated
    assert terminated.sum() >= 3 and truncated.sum() >= 3
    scaled, scales = [], []
    for factor in (1.0, 1000.0):
        buf = RolloutBuffer(64, 4, space, act)
        buf.rewards[:] = rewards * factor
        buf.terminated[:] = terminated
        buf.truncated[:] = truncated
        scale = ReturnScale(4, 0.99)
        scale_rewards(buf, scale, distributed.Context.from_env())
        scaled.append(buf.rewards.clone())
        scales.append(scale)
    assert torch.allclose(scaled[0], scaled[1], rtol=1e-4)
    ref = ReturnScale(4, 0.99)
    ref.add(ref.discounted_returns(rewards, ends))
    torch.testing.assert_close(scaled[0], rewards / ref.std)
    torch.testing.assert_close(scales[0].running, ref.running)
    assert scales[0].running[0] == 0.0
    check = ReturnScale(4, 0.99)
    assert check.discounted_returns(scaled[0], ends).std().item() == pytest.approx(1.0, rel=0.05)


def test_the_log_std_is_learned(tmp_path):
    cfg = load_config(None, tiny_overrides(tmp_path, **{"model.init_log_std": -0.5}))
    final = torch.load(train(cfg) / "checkpoints" / "latest.pt", weights_only=True)["model"]["log_std"]
    assert not torch.allclose(final, torch.full_like(final, -0.5))


def test_a_flat_critic_is_reported_once_after_20_iterations_in_a_row():
    from types import SimpleNamespace

    from visppo.loop import warn_if_flat_critic

    said = []
    run = SimpleNamespace(flat_critic=0, logger=SimpleNamespace(message=said.append))
    for fit in [0.0] * 19 + [0.5] + [0.0] * 19:  # a fitting iteration restarts the count
        warn_if_flat_critic(run, fit)
    assert said == []
    for fit in [-0.0002] + [0.0] * 30:
        warn_if_flat_critic(run, fit)
    assert len(said) == 1 and said[0].startswith("warning: ") and "ppo.norm_reward=true" in said[0]




@pytest.mark.cuda
@pytest.mark.parametrize("recompute", ["false", "true"])
def test_a_rollout_buffer_on_the_gpu_trains(tmp_path, recompute):
    """``memory.buffer_device=device``: bootstrap values (host tensors from the chunked passes)
    meet a buffer on the GPU in collection, GAE and recomputed advantages; episodes of 8 steps
    put time-limit truncations in every rollout."""
    params = {}
    for place in ("device", "cpu"):  # the buffer's place is a memory knob: the same parameters
        cfg = load_config(None, tiny_overrides(tmp_path / place, **{
            "train.device": "cuda", "memory.buffer_device": place, "env.max_episode_steps": 8,
            "ppo.recompute_advantages": recompute, "train.deterministic": "true"}))
        params[place] = torch.load(train(cfg) / "checkpoints" / "latest.pt", weights_only=True)["model"]
    for key, value in params["cpu"].items():
        torch.testing.assert_close(params["device"][key], value, rtol=1e-4, atol=1e-6, msg=key)


def test_fp16_calibration_skips_are_not_counted_as_divergence_in_an_update_without_a_good_step():
    """The scaler's inf-gradient skips (not in ``trailing_skips``) count toward
    ``train.max_bad_steps`` neither after a good step nor in an update that had none."""
    from types import SimpleNamespace

    from visppo.loop import check_divergence
    from visppo.ppo import UpdateResult

    run = SimpleNamespace(bad_in_a_row=0, cfg=SimpleNamespace(train=SimpleNamespace(max_bad_steps=10)))
    calibrating = UpdateResult(optimizer_steps=0, skipped_steps=4, trailing_skips=0)
    for _ in range(3):
        check_divergence(run, calibrating)
    assert run.bad_in_a_row == 0
    check_divergence(run, UpdateResult(optimizer_steps=0, skipped_steps=4, trailing_skips=3))
    check_divergence(run, UpdateResult(optimizer_steps=0, skipped_steps=4, trailing_skips=4))
    assert run.bad_in_a_row == 7  # non-finite losses: counted across updates


def test_the_loop_computes_gae_with_the_configs_gamma_and_lambda(tmp_path, monkeypatch):
    """What the update gets is GAE of the rollout with ppo.gamma and ppo.gae_lambda (in that order),
    and the logged explained variance is the critic's on those returns."""
    import visppo.loop as loop
    from visppo.buffer import compute_gae, explained_variance

    seen, real_values, real_update = [], loop.compute_values, loop.update

    def values_spy(*args):
        seen.append({"last_value": real_values(*args)})
        return seen[-1]["last_value"]

    def update_spy(policy, optimizer, buffer, setup):
        seen[-1].update({k: getattr(buffer, k).clone() for k in (
            "rewards", "values", "terminated", "truncated", "final_values", "advantages", "returns")})
        return real_update(policy, optimizer, buffer, setup)

    monkeypatch.setattr(loop, "compute_values", values_spy)
    monkeypatch.setattr(loop, "update", update_spy)
    cfg = load_config(None, tiny_overrides(tmp_path, **{"ppo.gamma": 0.9, "ppo.gae_lambda": 0.5,
                                                         "env.max_episode_steps": 20}))
    rows = list(csv.DictReader((train(cfg) / "metrics.csv").open()))
    assert len(seen) == len(rows) == 2
    for b, row in zip(seen, rows, strict=True):
        assert bool(b["terminated"].any() or b["truncated"].any())  # episode ends inside the rollout
        adv, ret = compute_gae(b["rewards"], b["values"], b["last_value"], b["terminated"], b["truncated"],
                               b["final_values"], 0.9, 0.5)
        torch.testing.assert_close(b["advantages"], adv)
        torch.testing.assert_close(b["returns"], ret)
        assert float(row["value/explained_variance"]) == pytest.approx(
            explained_variance(b["values"], b["returns"]), rel=1e-4, abs=1e-6)


def test_the_loop_acts_in_chunks_of_the_inference_chunk_size(tmp_path, monkeypatch):
    import visppo.loop as loop

    chunks, real = [], loop.collect
    monkeypatch.setattr(loop, "collect", lambda *a, **k: (chunks.append(k.get("chunk")), real(*a, **k))[1])
    train(load_config(None, tiny_overrides(tmp_path, **{"memory.infer_chunk_size": 1})))
    assert chunks == [1, 1]


def test_the_episodes_column_counts_every_episode_since_the_previous_row(tmp_path):
    """run.log_every=2, episodes of 16 steps, 2 envs x 32 steps: 4 episodes end every iteration, 8 a row."""
    cfg = load_config(None, tiny_overrides(tmp_path, **{"run.log_every": 2, "ppo.total_steps": 256,
                                                        "env.max_episode_steps": 16}))
    rows = list(csv.DictReader((train(cfg) / "metrics.csv").open()))
    assert [int(r["iteration"]) for r in rows] == [2, 4]
    assert [int(float(r["episodes"])) for r in rows] == [8, 8]


def test_the_optimizer_step_columns_count_every_step_since_the_previous_row(tmp_path):
    """run.log_every=2: 2 epochs x 2 minibatches a rollout, 4 optimizer steps an iteration, 8 a row."""
    cfg = load_config(None, tiny_overrides(tmp_path, **{"run.log_every": 2, "ppo.total_steps": 256,
                                                        "ppo.target_kl": 0}))
    rows = list(csv.DictReader((train(cfg) / "metrics.csv").open()))
    assert [int(r["iteration"]) for r in rows] == [2, 4]
    assert [(int(float(r["optimizer_steps"])), int(float(r["skipped_steps"]))) for r in rows] == [(8, 0), (8, 0)]


def test_every_periodic_evaluation_gets_a_row_whatever_log_every_is(tmp_path):
    """run.log_every=2, run.eval_every=3 over 4 iterations: rows at 2, 3 (its evaluation), 4 (the last)."""
    cfg = load_config(None, tiny_overrides(tmp_path, **{"run.log_every": 2, "run.eval_every": 3,
                                                        "run.eval_episodes": 1, "run.eval_video": "false",
                                                        "ppo.total_steps": 256}))
    rows = list(csv.DictReader((train(cfg) / "metrics.csv").open()))
    assert [int(r["iteration"]) for r in rows] == [2, 3, 4]
    assert [r["eval/return"] == "nan" for r in rows] == [True, False, False]


def test_a_row_s_speed_and_phase_times_cover_every_iteration_since_the_previous_row(tmp_path, monkeypatch):
    """run.log_every=2 over 4 iterations: each row's steps/s and time/* sum the laps of its two
    iterations. A fake clock whose ticks grow makes every lap's wall time differ, so the last lap
    alone could not give the same figures."""
    import itertools
    from types import SimpleNamespace

    import visppo.metrics as metrics

    ticks = itertools.accumulate(itertools.count(1))  # 1, 3, 6, 10, ...: one tick per clock reading
    monkeypatch.setattr(metrics, "time", SimpleNamespace(perf_counter=lambda: float(next(ticks))))
    laps, real_lap = [], metrics.PhaseTimer.lap
    monkeypatch.setattr(metrics.PhaseTimer, "lap", lambda self: laps.append(real_lap(self)) or laps[-1])
    cfg = load_config(None, tiny_overrides(tmp_path, **{"run.log_every": 2, "ppo.total_steps": 256}))
    rows = list(csv.DictReader((train(cfg) / "metrics.csv").open()))
    assert [int(r["iteration"]) for r in rows] == [2, 4] and len(laps) == 4
    for row, covered in zip(rows, (laps[:2], laps[2:])):
        wall = sum(w for _, w in covered)
        assert float(row["steps_per_second"]) * wall == pytest.approx(2 * 64)  # the row's span: 2 rollouts
        phases = {k[5:]: float(v) for k, v in row.items() if k.startswith("time/")}
        assert phases == pytest.approx({k: sum(s.get(k, 0.0) for s, _ in covered) for k in phases})
        assert sum(phases.values()) <= wall
