import gymnasium as gym
import numpy as np
import pytest
import torch
from conftest import infer_with, setup_of, tiny_overrides, update_with

from visppo.buffer import RolloutBuffer
from visppo.config import ModelConfig, PPOConfig
from visppo.policy import ActorCritic
from visppo.ppo import minibatch_gradient, ppo_loss
from visppo.precision import resolve_precision

CPU = torch.device("cpu")


def _spaces(state=True, discrete=False):
    spaces = {"pixels": gym.spaces.Box(0, 255, (6, 64, 64), np.uint8)}
    if state:
        spaces["state"] = gym.spaces.Box(-np.inf, np.inf, (3,), np.float32)
    return gym.spaces.Dict(spaces), gym.spaces.Discrete(4) if discrete else gym.spaces.Box(-1, 1, (2,), np.float32)


def _setup(state=True, discrete=False, T=6, N=4, seed=0, share=True, encoder="nature"):
    torch.manual_seed(seed)
    obs_space, act_space = _spaces(state, discrete)
    policy = ActorCritic(obs_space, act_space, ModelConfig(feature_dim=32, hidden_dim=32, share_encoder=share,
                                                          encoder=encoder))
    buf = RolloutBuffer(T, N, obs_space, act_space)
    g = torch.Generator().manual_seed(seed)
    buf.obs["pixels"].copy_(torch.randint(0, 256, buf.obs["pixels"].shape, generator=g, dtype=torch.uint8))
    if state:
        buf.obs["state"].normal_(generator=g)
    with torch.no_grad():
        flat = {k: buf.flat(v) for k, v in buf.obs.items()}
        action, logp, value = policy.act(flat)
    buf.actions.copy_(action.view(buf.actions.shape))
    buf.logp.copy_(logp.view(T, N) + 0.05 * torch.randn(T, N, generator=g))  # a slightly stale policy
    buf.values.copy_(value.view(T, N))
    buf.advantages.normal_(generator=g)
    buf.returns.copy_(buf.values + buf.advantages)
    buf.rewards.uniform_(0, 2, generator=g)
    return policy, buf


@pytest.mark.parametrize("encoder", ["nature", "spatial_softmax"])
@pytest.mark.parametrize("chunk", [1, 5, 8, 24, 1000])
def test_chunked_score_equals_unchunked(chunk, encoder):
    policy, buf = _setup(encoder=encoder)
    flat = {k: buf.flat(v) for k, v in buf.obs.items()}
    actions = buf.flat(buf.actions)
    with torch.no_grad():
        ref_logp, _, ref_v = policy.score_actions(flat, actions)
    v, lp = infer_with(policy, flat, actions, chunk)
    torch.testing.assert_close(v, ref_v, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(lp, ref_logp, rtol=1e-5, atol=1e-6)
    v_only, none = infer_with(policy, flat, None, chunk)
    assert none is None
    torch.testing.assert_close(v_only, ref_v, rtol=1e-5, atol=1e-6)


def _grads(policy, buf, mb, micro, cfg):
    policy.zero_grad(set_to_none=True)
    adv = buf.flat(buf.advantages)[mb]
    adv = (adv - adv.mean()) / (adv.std() + 1e-8)
    stats = minibatch_gradient(policy, buf, mb, adv, setup_of(cfg, micro))
    return {n: p.grad.clone() for n, p in policy.named_parameters() if p.grad is not None}, stats


def _reference_grads(policy, buf, mb, cfg):
    """The minibatch's gradient written out directly: one forward over all of it, the mean loss."""
    policy.zero_grad(set_to_none=True)
    adv = buf.flat(buf.advantages)[mb]
    adv = (adv - adv.mean()) / (adv.std() + 1e-8)
    obs = {k: buf.flat(v)[mb] for k, v in buf.obs.items()}
    new_logp, entropy, new_values = policy.score_actions(obs, buf.flat(buf.actions)[mb])
    loss, stats = ppo_loss(new_logp, buf.flat(buf.logp)[mb], adv, new_values, buf.flat(buf.values)[mb],
                           buf.flat(buf.returns)[mb], entropy, cfg.clip_coef, cfg.clip_value,
                           cfg.value_coef, cfg.entropy_coef)
    loss.mean().backward()
    grads = {n: p.grad.clone() for n, p in policy.named_parameters() if p.grad is not None}
    return grads, {k: v.mean() for k, v in stats.items()}


@pytest.mark.parametrize("micro", [1, 4, 5, 7, 20])
@pytest.mark.parametrize("discrete,share,encoder", [
    (False, True, "nature"), (True, False, "nature"), (False, True, "spatial_softmax")])
def test_accumulated_gradient_equals_full_minibatch_gradient(micro, discrete, share, encoder):
    policy, buf = _setup(discrete=discrete, share=share, encoder=encoder)
    cfg = PPOConfig(clip_value=True, entropy_coef=0.01, clip_coef=0.05)  # a tight clip: both branches taken
    mb = torch.randperm(buf.size, generator=torch.Generator().manual_seed(1))[:20]
    full, full_stats = _reference_grads(policy, buf, mb, cfg)
    assert 0 < float(full_stats["clip_frac"]) < 1
    acc, acc_stats = _grads(policy, buf, mb, micro, cfg)
    assert full.keys() == acc.keys() and len(full) > 4
    for name in full:
        torch.testing.assert_close(acc[name], full[name], rtol=1e-5, atol=1e-7, msg=name)
    for k in full_stats:  # minibatch statistics are over the whole minibatch, not per slice
        assert float(acc_stats[k]) == pytest.approx(float(full_stats[k]), rel=1e-5, abs=1e-7)


def test_ppo_loss_matches_hand_computation():
    new_logp = torch.tensor([0.0, np.log(1.5), np.log(0.5)], dtype=torch.float32)
    old_logp = torch.zeros(3)
    adv = torch.tensor([1.0, 1.0, -2.0])
    v_new, v_old, ret = torch.tensor([1.0, 0.0, 2.0]), torch.tensor([0.0, 0.0, 0.0]), torch.tensor([2.0, 1.0, 0.0])
    ent = torch.tensor([0.5, 0.5, 0.5])
    loss, stats = ppo_loss(new_logp, old_logp, adv, v_new, v_old, ret, ent, clip_coef=0.2,
                           clip_value=False, value_coef=0.5, entropy_coef=0.1)
    # ratio 1, 1.5 (clipped to 1.2 with A>0), 0.5 (A<0: min(-1, -1.6) = -1.6 -> pg 1.6)
    pg = torch.tensor([-1.0, -1.2, 1.6])
    v = 0.5 * torch.tensor([1.0, 1.0, 4.0])
    torch.testing.assert_close(loss, pg + 0.5 * v - 0.1 * ent)
    assert stats["clip_frac"].tolist() == [0.0, 1.0, 1.0]
    # Schulman's estimator (r - 1) - log r: 0, 0.5 - log 1.5, -0.5 + log 2
    assert stats["approx_kl"].tolist() == pytest.approx([0.0, 0.5 - np.log(1.5), -0.5 + np.log(2)], abs=1e-6)
    # value clipping: new value 2 moved 2 from old 0, clipped to 0.2 -> error max((2-0)^2, (0.2-0)^2)
    loss_c, stats_c = ppo_loss(new_logp, old_logp, adv, v_new, v_old, ret, ent, 0.2, True, 0.5, 0.1)
    assert stats_c["value_loss"].tolist() == pytest.approx([0.5 * 3.24, 0.5 * 1.0, 0.5 * 4.0])


def test_update_early_stops_on_target_kl_without_stepping():
    policy, buf = _setup()
    buf.logp.add_(3.0)  # a very stale policy: huge KL on the first minibatch
    before = [p.detach().clone() for p in policy.parameters()]
    opt = torch.optim.Adam(policy.parameters(), lr=1e-3)
    res = update_with(policy, opt, buf, PPOConfig(num_epochs=2, minibatch_size=8, target_kl=0.01), 8, 8, torch.Generator().manual_seed(0))
    assert res.early_stopped and res.optimizer_steps == 0
    assert all(torch.equal(a, b) for a, b in zip(before, policy.parameters()))


def test_update_steps_once_per_minibatch_and_changes_parameters():
    policy, buf = _setup()
    opt = torch.optim.Adam(policy.parameters(), lr=1e-3)
    before = [p.detach().clone() for p in policy.parameters()]
    res = update_with(policy, opt, buf, PPOConfig(num_epochs=2, minibatch_size=10), 3, 7, torch.Generator().manual_seed(0))
    assert res.optimizer_steps == 2 * 3  # 24 samples in minibatches of 10, 10, 4; two epochs
    assert any(not torch.equal(a, b) for a, b in zip(before, policy.parameters()))


def test_a_channels_last_buffer_gives_the_same_update():
    """Only where the frames sit in memory changes: a channels_last model sees the same input."""
    policy, buf = _setup()
    policy = policy.to(memory_format=torch.channels_last)
    cl = RolloutBuffer(buf.T, buf.N, *_spaces(), channels_last=True)
    for name in ("actions", "logp", "values", "advantages", "returns"):
        getattr(cl, name).copy_(getattr(buf, name))
    for key in buf.obs:
        cl.obs[key].copy_(buf.obs[key])
    start = {k: v.clone() for k, v in policy.state_dict().items()}
    params = []
    for b in (buf, cl):
        policy.load_state_dict(start)
        opt = torch.optim.Adam(policy.parameters(), lr=1e-3)
        update_with(policy, opt, b, PPOConfig(num_epochs=2, minibatch_size=10), 5, 7, torch.Generator().manual_seed(0))
        params.append([p.detach().clone() for p in policy.parameters()])
    assert all(torch.equal(a, b) for a, b in zip(*params))


def test_update_skips_non_finite_steps():
    policy, buf = _setup()
    buf.returns[0, 0] = float("nan")
    opt = torch.optim.Adam(policy.parameters(), lr=1e-3)
    before = [p.detach().clone() for p in policy.parameters()]
    res = update_with(policy, opt, buf, PPOConfig(num_epochs=1, minibatch_size=24), 24, 24, torch.Generator().manual_seed(0))
    assert res.skipped_steps == 1 and res.optimizer_steps == 0
    assert all(torch.equal(a, b) for a, b in zip(before, policy.parameters()))


@pytest.mark.cuda
def test_fp16_on_cuda_uses_a_grad_scaler():
    p = resolve_precision("fp16", torch.device("cuda"))
    assert p.dtype == torch.float16 and p.scaler is not None


class _OOMAbove:
    """Wraps a policy: score_actions() raises an out-of-memory error for batches above ``limit``."""

    def __init__(self, policy, limit):
        self.policy, self.limit, self.calls = policy, limit, []

    def __getattr__(self, name):
        return getattr(self.policy, name)

    def score_actions(self, obs, actions):
        self.calls.append(len(actions))
        if len(actions) > self.limit:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return self.policy.score_actions(obs, actions)


def test_oom_in_the_update_halves_the_micro_batch_and_gives_the_same_update():
    from visppo.ppo import MemorySizes

    policy, buf = _setup()
    ref_policy, _ = _setup()
    cfg = PPOConfig(num_epochs=1, minibatch_size=24)
    # SGD: the parameters move by the gradient itself. Adam divides by sqrt(v), which turns the
    # rounding of a near-zero gradient into a visible step (seen: 1 element in 36864 off by 2e-5)
    opt = torch.optim.SGD(policy.parameters(), lr=1e-2)
    ref_opt = torch.optim.SGD(ref_policy.parameters(), lr=1e-2)
    sizes = MemorySizes(micro=24, chunk=24)
    with pytest.warns(RuntimeWarning, match="out of memory"):
        update_with(_OOMAbove(policy, 8), opt, buf, cfg, sizes, None,
               torch.Generator().manual_seed(0))
    assert sizes.micro == 6  # 24 -> 12 -> 6, kept for the rest of the run
    update_with(ref_policy, ref_opt, buf, cfg, 24, 24, torch.Generator().manual_seed(0))
    moved = False
    for a, b, start in zip(policy.parameters(), ref_policy.parameters(), _setup()[0].parameters()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)  # micro-batch sums: rounding only
        moved |= not torch.equal(a, start)
    assert moved


def test_oom_in_a_no_grad_pass_halves_the_chunk_and_loses_nothing():
    from visppo.ppo import MemorySizes

    policy, buf = _setup()
    flat = {k: buf.flat(v) for k, v in buf.obs.items()}
    actions = buf.flat(buf.actions)
    ref_v, ref_lp = infer_with(policy, flat, actions, 24)
    sizes = MemorySizes(micro=8, chunk=24)
    with pytest.warns(RuntimeWarning):
        v, lp = infer_with(_OOMAbove(policy, 5), flat, actions, sizes)
    assert sizes.chunk == 3
    torch.testing.assert_close(v, ref_v, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(lp, ref_lp, rtol=1e-5, atol=1e-6)


def test_other_errors_are_not_swallowed_as_oom():
    from visppo.ppo import MemorySizes

    policy, buf = _setup()

    class Broken(_OOMAbove):
        def score_actions(self, obs, actions):
            raise RuntimeError("shape mismatch")

    with pytest.raises(RuntimeError, match="shape mismatch"):
        update_with(Broken(policy, 0), torch.optim.Adam(policy.parameters()), buf, PPOConfig(num_epochs=1),
               MemorySizes(8, 8), None, torch.Generator().manual_seed(0))


def test_recompute_advantages_refreshes_the_bootstrap_values_of_truncations():
    """After the critic moved, the values of the truncated episodes' final frames are recomputed
    too, not taken from the acting pass."""
    from visppo.buffer import compute_gae
    from visppo.ppo import recompute_advantages

    policy, buf = _setup()
    g = torch.Generator().manual_seed(5)
    final = {k: v[:2].clone() for k, v in buf.flat_obs().items()}
    final["pixels"] = torch.randint(0, 256, final["pixels"].shape, generator=g, dtype=torch.uint8)
    buf.truncated[1, 0] = buf.truncated[4, 3] = True
    buf.truncations = [(torch.tensor([1 * buf.N + 0]), {k: v[:1] for k, v in final.items()}),
                       (torch.tensor([4 * buf.N + 3]), {k: v[1:] for k, v in final.items()})]
    buf.final_values.fill_(123.0)  # stale: what the acting pass would have left
    buf.last_obs = {k: v[-buf.N:].clone() for k, v in buf.flat_obs().items()}
    buf.rewards.normal_(generator=g)
    buf.values += 1.0  # the rollout's values, apart from the current critic's
    rollout_values = buf.values.clone()
    cfg = PPOConfig(gamma=0.9, gae_lambda=0.8)
    recompute_advantages(policy, buf, setup_of(cfg, 8, 5))
    assert torch.equal(buf.values, rollout_values)  # the clipped value loss's anchor stays the rollout's
    with torch.no_grad():
        expected_final = policy.value(final)
        values = policy.value(buf.flat_obs()).view(buf.T, buf.N)
        last = policy.value(buf.last_obs)
    torch.testing.assert_close(buf.final_values[1, 0], expected_final[0])
    torch.testing.assert_close(buf.final_values[4, 3], expected_final[1])
    adv, ret = compute_gae(buf.rewards, values, last, buf.terminated, buf.truncated, buf.final_values,
                           0.9, 0.8)
    torch.testing.assert_close(buf.advantages, adv)
    torch.testing.assert_close(buf.returns, ret)


def test_an_oom_on_another_rank_backs_off_every_rank_together(monkeypatch):
    """Under torchrun, a rank that did not run out of memory still halves its micro-batch and redoes
    the minibatch when the one all-reduce says another rank did."""
    import visppo.distributed as distributed
    from visppo.ppo import MemorySizes

    policy, buf = _setup()
    calls = []

    def reduce_minibatch(params, stats, failed):
        calls.append(failed)
        anyone_failed = len(calls) == 1  # the first minibatch failed on a peer
        return {k: float(v) for k, v in stats.items()}, anyone_failed

    monkeypatch.setattr(distributed, "reduce_minibatch", reduce_minibatch)
    monkeypatch.setattr(distributed, "mean_std", lambda x: (float(x.mean()), float(x.std()), len(x)))
    sizes = MemorySizes(micro=24, chunk=24)
    opt = torch.optim.SGD(policy.parameters(), lr=1e-2)
    with pytest.warns(RuntimeWarning, match="out of memory at memory.micro_batch_size=24"):
        res = update_with(policy, opt, buf, PPOConfig(num_epochs=1, minibatch_size=24), sizes, None,
                          torch.Generator().manual_seed(0), across_ranks=True)
    assert sizes.micro == 12 and calls == [False, False] and res.optimizer_steps == 1


@pytest.mark.parametrize("recompute", [False, True])
def test_compute_values_rescores_logp_old_only_when_asked(recompute):
    from visppo.ppo import compute_values

    policy, buf = _setup()
    buf.logp.fill_(7.0)  # not what any policy gives: only a recomputation replaces it
    buf.last_obs = {k: v[-buf.N:].clone() for k, v in buf.flat_obs().items()}
    last = compute_values(policy, buf, setup_of(PPOConfig(), 8, 5), recompute_logp_old=recompute)
    with torch.no_grad():
        logp, _, _ = policy.score_actions(buf.flat_obs(), buf.flat(buf.actions))
        torch.testing.assert_close(last, policy.value(buf.last_obs))
    if recompute:
        torch.testing.assert_close(buf.flat(buf.logp), logp)
    else:
        assert bool((buf.logp == 7.0).all())


@pytest.mark.parametrize("recompute", [False, True])
def test_update_recomputes_advantages_before_every_epoch_but_the_first(recompute, monkeypatch):
    import visppo.ppo as ppo

    policy, buf = _setup()
    buf.last_obs = {k: v[-buf.N:].clone() for k, v in buf.flat_obs().items()}
    calls = []
    real = ppo.recompute_advantages
    monkeypatch.setattr(ppo, "recompute_advantages", lambda *a: (calls.append(1), real(*a)))
    cfg = PPOConfig(num_epochs=3, minibatch_size=12, recompute_advantages=recompute)
    update_with(policy, torch.optim.Adam(policy.parameters(), lr=1e-3), buf, cfg, 8, 8,
                torch.Generator().manual_seed(0))
    assert len(calls) == (2 if recompute else 0)


@pytest.mark.parametrize("factor,steps", [(1.2, True), (1.6, False)])
def test_target_kl_stops_above_one_and_a_half_times_the_target(factor, steps):
    """SB3's rule: a minibatch whose approx-KL is between the target and 1.5x it still steps."""
    from visppo.buffer import minibatches

    policy, buf = _setup()
    buf.logp.add_(0.3)  # a stale policy: a clear KL on the first minibatch
    first = minibatches(buf.size, 8, torch.Generator().manual_seed(0))[0]
    adv = buf.flat(buf.advantages)[first]
    kl = float(minibatch_gradient(policy, buf, first, (adv - adv.mean()) / (adv.std() + 1e-8),
                                  setup_of(PPOConfig(), 8))["approx_kl"])
    assert kl > 0.01
    res = update_with(policy, torch.optim.SGD(policy.parameters(), lr=1e-3), buf,
                      PPOConfig(num_epochs=1, minibatch_size=8, target_kl=kl / factor), 8, 8,
                      torch.Generator().manual_seed(0))
    assert (res.optimizer_steps >= 1) == steps
    if not steps:
        assert res.stop_kl == pytest.approx(kl, rel=1e-5)


@pytest.mark.parametrize("norm_adv", [True, False])
def test_advantages_are_normalised_over_each_minibatch(norm_adv, monkeypatch):
    """``ppo.norm_adv``: every minibatch's gradient is handed its advantages centred and scaled by
    that minibatch's own mean and unbiased std (not the rollout's); off: the raw ones."""
    import visppo.ppo as ppo

    policy, buf = _setup()
    buf.advantages.mul_(3.0).add_(2.0)  # far from mean 0, std 1: normalised and raw differ clearly
    flat = buf.flat(buf.advantages).clone()
    seen = []
    real = ppo.minibatch_gradient

    def recording(policy, buffer, mb, advantages, setup):
        seen.append((mb.clone(), advantages.clone()))
        return real(policy, buffer, mb, advantages, setup)

    monkeypatch.setattr(ppo, "minibatch_gradient", recording)
    update_with(policy, torch.optim.SGD(policy.parameters(), lr=1e-3), buf,
                PPOConfig(num_epochs=2, minibatch_size=10, norm_adv=norm_adv), 3, 8,
                torch.Generator().manual_seed(0))
    assert [len(mb) for mb, _ in seen] == [10, 10, 4] * 2
    for mb, adv in seen:
        a = flat[mb]
        expected = (a - a.mean()) / (a.std() + 1e-8) if norm_adv else a
        torch.testing.assert_close(adv, expected, rtol=1e-6, atol=1e-6)


def test_a_gradient_norm_above_max_grad_norm_is_clipped_to_it():
    """One SGD step (lr eta) on a minibatch whose gradient norm |g| exceeds ``ppo.max_grad_norm``
    moves the parameters by ``-eta * g * max_grad_norm / |g|``; the result reports |g|, the norm
    before clipping."""
    policy, buf = _setup()
    cfg = PPOConfig(num_epochs=1, minibatch_size=buf.size, max_grad_norm=0.1)
    full, _ = _reference_grads(policy, buf, torch.arange(buf.size), cfg)
    norm = float(torch.linalg.vector_norm(torch.stack([g.norm() for g in full.values()])))
    assert norm > 5 * cfg.max_grad_norm
    policy.zero_grad(set_to_none=True)
    before = {n: p.detach().clone() for n, p in policy.named_parameters()}
    eta = 0.5
    res = update_with(policy, torch.optim.SGD(policy.parameters(), lr=eta), buf, cfg, 7, 8,
                      torch.Generator().manual_seed(0))
    assert res.optimizer_steps == 1 and res.grad_norm > cfg.max_grad_norm
    assert res.grad_norm == pytest.approx(norm, rel=1e-5)
    for name, p in policy.named_parameters():
        expected = -eta * full[name] * cfg.max_grad_norm / norm if name in full else torch.zeros_like(p)
        torch.testing.assert_close(p.detach() - before[name], expected, rtol=1e-4, atol=1e-7,
                                   msg=lambda m, name=name: f"{name}: {m}")


def _fp16_update(scaler, cfg, micro=3):
    """``update`` on the CPU in fp32 with or without a GradScaler, with the optimizer visppo builds
    (fused Adam); the parameters after it, the result and the optimizer."""
    from visppo.builders import build_optimizer
    from visppo.config import load_config
    from visppo.ppo import update
    from visppo.precision import Precision

    policy, buf = _setup()
    optimizer = build_optimizer(load_config(None, tiny_overrides()), policy)
    res = update(policy, optimizer, buf, setup_of(cfg, micro, generator=torch.Generator().manual_seed(0),
                                                  precision=Precision(CPU, None, scaler)))
    return [p.detach().clone() for p in policy.parameters()], res, optimizer


def test_a_grad_scaler_gives_the_unscaled_update():
    """fp16's loss scaling changes nothing but the numbers' range: with a GradScaler, visppo's fused
    Adam over uneven micro-batches (3, 3, 3, 1) takes the steps it takes without one, and the
    clipped norm is the true one: the gradient is unscaled once, before clipping."""
    cfg = PPOConfig(num_epochs=1, minibatch_size=10, max_grad_norm=2.0)  # norms 1.9, 3.3, 1.3: one clips
    plain, plain_res, _ = _fp16_update(None, cfg)
    scaler = torch.amp.GradScaler("cpu")
    scaled, scaled_res, _ = _fp16_update(scaler, cfg)
    assert scaler.get_scale() == 65536.0  # no overflow: the scale the comparison ran under
    assert scaled_res.optimizer_steps == plain_res.optimizer_steps == 3 and scaled_res.skipped_steps == 0
    assert scaled_res.grad_norm == pytest.approx(plain_res.grad_norm, rel=1e-6)
    for a, b in zip(scaled, plain, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)


def test_a_grad_scaler_skips_an_overflowing_step_and_lowers_the_scale(monkeypatch):
    """An infinite gradient under a GradScaler is skipped: no step (parameters and Adam's state as
    they were), counted in ``skipped_steps`` but not as divergence, and the scale halved."""
    import visppo.ppo as ppo

    real = ppo.ppo_loss

    def overflowing(*args, **kwargs):
        loss, stats = real(*args, **kwargs)
        return loss * float("inf"), stats

    monkeypatch.setattr(ppo, "ppo_loss", overflowing)
    start = [p.detach().clone() for p in _setup()[0].parameters()]
    scaler = torch.amp.GradScaler("cpu")
    params, res, optimizer = _fp16_update(scaler, PPOConfig(num_epochs=1, minibatch_size=24), micro=7)
    assert res.skipped_steps == 1 and res.optimizer_steps == 0 and res.trailing_skips == 0
    assert all(torch.equal(a, b) for a, b in zip(params, start, strict=True))
    assert not optimizer.state  # Adam's moments and step count untouched
    assert scaler.get_scale() == 65536.0 * scaler.get_backoff_factor()
