"""Fine-tuning pretrained encoders (issue 6): weights, freezing, lr groups, BatchNorm, checkpointing,
micro-batching with a ResNet."""

import re

import gymnasium as gym
import numpy as np
import pytest
import torch
import torchvision
from conftest import setup_of, tiny_overrides, update_with

from visppo.buffer import RolloutBuffer
from visppo.builders import build_optimizer, build_policy
from visppo.config import ModelConfig, PPOConfig, load_config
from visppo.encoders import FreezeSchedule
from visppo.errors import ConfigError
from visppo.loop import train
from visppo.policy import ActorCritic
from visppo.ppo import minibatch_gradient

CPU = torch.device("cpu")
BOX = gym.spaces.Box(-1, 1, (2,), np.float32)


def _space(c=3, side=32, state=False):
    spaces = {"pixels": gym.spaces.Box(0, 255, (c, side, side), np.uint8)}
    if state:
        spaces["state"] = gym.spaces.Box(-np.inf, np.inf, (3,), np.float32)
    return gym.spaces.Dict(spaces)


def _cfg(side=32, **model):
    overrides = [f"model.{k}={v}" for k, v in model.items()]
    return load_config(None, overrides + [f"env.image_size={side}", "model.feature_dim=16",
                                          "model.hidden_dim=16", "train.device=cpu", "train.amp=off"])


def _setup(encoder="nature", side=48, c=3, T=4, N=2, seed=0, state=True, **model):
    """A policy and a filled buffer of T*N samples, as tests/test_ppo.py does."""
    torch.manual_seed(seed)
    obs_space = _space(c, side, state)
    policy = ActorCritic(obs_space, BOX, ModelConfig(encoder=encoder, feature_dim=16, hidden_dim=16, **model))
    buf = RolloutBuffer(T, N, obs_space, BOX)
    g = torch.Generator().manual_seed(seed)
    buf.obs["pixels"].copy_(torch.randint(0, 256, buf.obs["pixels"].shape, generator=g, dtype=torch.uint8))
    if state:
        buf.obs["state"].normal_(generator=g)
    with torch.no_grad():
        action, logp, value = policy.act({k: buf.flat(v) for k, v in buf.obs.items()})
    buf.actions.copy_(action.view(buf.actions.shape))
    buf.logp.copy_(logp.view(T, N) + 0.05 * torch.randn(T, N, generator=g))
    buf.values.copy_(value.view(T, N))
    buf.advantages.normal_(generator=g)
    buf.returns.copy_(buf.values + buf.advantages)
    return policy, buf


def _snapshot(params):
    return [p.detach().clone() for p in params]


def _same(a, b):
    return all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


def _head_params(policy):
    trunk = {id(p) for p in policy.trunk_parameters()}
    return [p for p in policy.parameters() if id(p) not in trunk]


# --------------------------------------------------------------------------- weights


def test_torchvision_state_dict_loads_through_encoder_weights(tmp_path):
    torch.manual_seed(1)
    net = torchvision.models.resnet18(weights=None)  # built here, never downloaded
    with torch.no_grad():
        net.bn1.running_mean.normal_()  # buffers load too
    path = tmp_path / "resnet18.pth"
    torch.save(net.state_dict(), path)
    cfg = _cfg(encoder="resnet18", encoder_weights=path, share_encoder=False)
    policy = build_policy(cfg, _space(6), BOX, CPU)
    source = net.state_dict()
    for enc in policy.encoders():  # actor's and critic's encoders alike
        got = enc.pixels.net.state_dict()
        assert got.keys() == {k for k in source if not k.startswith("fc.")}  # the head is dropped
        for key, value in got.items():
            assert torch.equal(value, source[key]), key


def test_encoder_part_of_a_visppo_checkpoint_loads_on_another_task(tmp_path):
    torch.manual_seed(2)
    src = ActorCritic(_space(6), BOX, ModelConfig(encoder="resnet18", feature_dim=16, hidden_dim=16))
    path = tmp_path / "latest.pt"
    torch.save({"model": src.state_dict(), "optimizer": {}, "config": {}, "global_step": 0}, path)
    cfg = _cfg(encoder="resnet18", encoder_weights=path)
    policy = build_policy(cfg, _space(6, state=True), gym.spaces.Discrete(3), CPU)  # other heads
    expected = src.encoder.pixels.state_dict()
    got = policy.encoder.pixels.state_dict()
    assert got.keys() == expected.keys() and any(k.startswith("proj.") for k in got)
    for key in got:
        assert torch.equal(got[key], expected[key]), key


def test_mismatched_weights_are_refused_with_the_keys_listed(tmp_path):
    state = torchvision.models.resnet18(weights=None).state_dict()
    del state["layer1.0.conv1.weight"]
    state["extra.weight"] = torch.zeros(1)
    state["layer4.1.bn2.weight"] = torch.zeros(7)
    path = tmp_path / "bad.pth"
    torch.save(state, path)
    cfg = _cfg(encoder="resnet18", encoder_weights=path)
    pattern = (r"missing keys: layer1\.0\.conv1\.weight.*unexpected keys: extra\.weight.*"
               r"shape mismatch.*layer4\.1\.bn2\.weight \(7,\) vs \(512,\)")
    with pytest.raises(ConfigError, match=pattern):
        build_policy(cfg, _space(), BOX, CPU)
    torch.save(torchvision.models.resnet34(weights=None).state_dict(), path)
    with pytest.raises(ConfigError, match=r"unexpected keys: layer1\.2\..*more\)"):
        build_policy(cfg, _space(), BOX, CPU)


def test_unreadable_or_missing_weights_file(tmp_path):
    (tmp_path / "notes.txt").write_text("not weights")
    with pytest.raises(ConfigError, match="weights_only"):
        build_policy(_cfg(encoder="resnet18", encoder_weights=tmp_path / "notes.txt"), _space(), BOX, CPU)
    with pytest.raises(ConfigError, match="not a file"):
        build_policy(_cfg(encoder="resnet18", encoder_weights=tmp_path / "gone.pth"), _space(), BOX, CPU)


def test_a_weights_file_that_cannot_be_read_says_so(tmp_path, monkeypatch):
    """Permissions are faked (root reads anything)."""
    path = tmp_path / "w.pth"
    torch.save(torchvision.models.resnet18(weights=None).state_dict(), path)

    def refuse(f, *args, **kwargs):
        raise PermissionError(13, "Permission denied", str(f))

    monkeypatch.setattr(torch, "load", refuse)
    with pytest.raises(ConfigError, match=r"w\.pth cannot be read \(Permission denied\)"):
        build_policy(_cfg(encoder="resnet18", encoder_weights=path), _space(), BOX, CPU)


def test_imagenet_weights_come_from_the_local_cache_only(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCH_HOME", str(tmp_path / "torch_home"))
    cfg = _cfg(encoder="resnet18", encoder_weights="imagenet")  # the config loads without the file
    expected = tmp_path / "torch_home" / "hub" / "checkpoints" / "resnet18-f37072fd.pth"
    with pytest.raises(ConfigError, match=re.escape(str(expected))):
        build_policy(cfg, _space(), BOX, CPU)
    torch.manual_seed(3)
    net = torchvision.models.resnet18(weights=None)
    expected.parent.mkdir(parents=True)
    torch.save(net.state_dict(), expected)  # as torchvision's downloader would leave it
    policy = build_policy(cfg, _space(), BOX, CPU)
    for key, value in policy.encoder.pixels.net.state_dict().items():
        assert torch.equal(value, net.state_dict()[key]), key


def test_weights_saved_before_batchnorm_counted_its_steps_load(tmp_path, monkeypatch):
    """torchvision's ResNet-18/34 ImageNet files predate ``num_batches_tracked``: they load all the same."""
    monkeypatch.setenv("TORCH_HOME", str(tmp_path / "torch_home"))
    torch.manual_seed(4)
    net = torchvision.models.resnet18(weights=None)
    old = {k: v for k, v in net.state_dict().items() if not k.endswith("num_batches_tracked")}
    path = tmp_path / "torch_home" / "hub" / "checkpoints" / "resnet18-f37072fd.pth"
    path.parent.mkdir(parents=True)
    torch.save(old, path)
    policy = build_policy(_cfg(encoder="resnet18", encoder_weights="imagenet"), _space(), BOX, CPU)
    loaded = policy.encoder.pixels.net.state_dict()
    assert all(torch.equal(loaded[k], v) for k, v in old.items() if not k.startswith("fc."))
    del old["conv1.weight"]  # anything else missing is still refused
    torch.save(old, path)
    with pytest.raises(ConfigError, match="missing keys: conv1.weight"):
        build_policy(_cfg(encoder="resnet18", encoder_weights="imagenet"), _space(), BOX, CPU)


@pytest.mark.parametrize("overrides,key", [
    (["model.encoder=nature", "model.encoder_weights=imagenet"], "model.encoder_weights"),
    (["model.encoder=vgg11"], "model.encoder"),
    (["model.encoder=nature", "model.resize=224"], "model.resize"),
    (["model.encoder=nature", "model.encoder_checkpointing=true"], "model.encoder_checkpointing"),
    (["model.encoder_lr_scale=-1"], "model.encoder_lr_scale"),
    (["model.encoder=resnet18", "env.image_size=16"], "model.encoder"),
])
def test_finetuning_config_is_checked(overrides, key):
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        load_config(None, overrides)


# --------------------------------------------------------------------------- freezing and lr groups


def test_frozen_encoder_does_not_move_then_trains():
    policy, buf = _setup()
    opt = torch.optim.AdamW(policy.parameters(), lr=1e-3, weight_decay=0.1)  # decay would move it too
    freeze = FreezeSchedule(policy.encoders(), 2, opt)
    trunk, heads = _snapshot(policy.trunk_parameters()), _snapshot(_head_params(policy))
    cfg = PPOConfig(num_epochs=1, minibatch_size=4)  # 8 samples: 2 optimizer steps per update
    res = update_with(policy, opt, buf, cfg, 4, 8, torch.Generator().manual_seed(0),
                 before_step=freeze)
    assert res.optimizer_steps == 2
    assert _same(trunk, policy.trunk_parameters())
    assert all(not torch.equal(a, b) for a, b in zip(heads, _head_params(policy), strict=True))
    assert not any(p in opt.state for p in policy.trunk_parameters())  # no Adam moments for it
    assert not freeze.frozen and not policy.encoder.pixels.frozen
    # a resumed run reads the steps taken from the optimizer
    assert FreezeSchedule(policy.encoders(), 3, opt).frozen
    assert not FreezeSchedule(policy.encoders(), 2, opt).frozen
    update_with(policy, opt, buf, cfg, 4, 8, torch.Generator().manual_seed(1),
           before_step=freeze)
    assert all(not torch.equal(a, b) for a, b in zip(trunk, policy.trunk_parameters(), strict=True))
    assert int(opt.state[policy.trunk_parameters()[0]]["step"]) == 2  # fresh Adam state at thaw


def test_encoder_lr_is_scaled_in_its_own_param_group():
    cfg = _cfg(side=48, encoder="nature", encoder_lr_scale=0.1)
    policy = build_policy(cfg, _space(3, 48), BOX, CPU)
    opt = build_optimizer(cfg, policy)
    heads, trunk = opt.param_groups
    assert trunk["lr"] == pytest.approx(0.1 * heads["lr"]) and heads["lr"] == cfg.ppo.learning_rate
    assert {id(p) for p in trunk["params"]} == {id(p) for p in policy.trunk_parameters()}
    assert len(heads["params"]) + len(trunk["params"]) == len(list(policy.parameters()))
    assert len(build_optimizer(_cfg(side=48), policy).param_groups) == 1


def test_training_from_a_checkpoint_frozen_then_thawed_with_a_scaled_annealed_lr(tmp_path):
    """Run A trains a Nature CNN; run B fine-tunes A's encoder: frozen for 6 of its 8 steps, trunk lr x0.1."""
    run_a = train(load_config(None, tiny_overrides(tmp_path / "a")))
    source = torch.load(run_a / "checkpoints" / "latest.pt", weights_only=True)["model"]
    cfg = load_config(None, tiny_overrides(tmp_path / "b", **{
        "model.encoder_weights": run_a / "checkpoints" / "latest.pt", "model.freeze_encoder_updates": 6,
        "model.encoder_lr_scale": 0.1, "train.seed": 5}))
    ckpt = torch.load(train(cfg) / "checkpoints" / "latest.pt", weights_only=True)
    heads, trunk = ckpt["optimizer"]["param_groups"]
    # annealed: iteration 2 of 2 runs at half the initial lr, in both groups
    assert heads["lr"] == pytest.approx(0.5 * cfg.ppo.learning_rate)
    assert trunk["lr"] == pytest.approx(0.1 * heads["lr"])
    state = ckpt["optimizer"]["state"]
    assert int(state[heads["params"][0]]["step"]) == 8  # 2 iterations x 2 epochs x 2 minibatches
    assert {int(state[i]["step"]) for i in trunk["params"]} == {2}  # frozen for the first 6
    model = ckpt["model"]
    assert any(not torch.equal(model[k], source[k]) for k in source if k.startswith("encoder.pixels.convs"))


# --------------------------------------------------------------------------- BatchNorm, checkpointing, micro-batches


def test_batchnorm_statistics_do_not_move_during_training():
    policy, buf = _setup("resnet18", 32, T=2, N=2, state=False)
    policy.train()
    bns = [m for m in policy.modules() if isinstance(m, torch.nn.BatchNorm2d)]
    stats = _snapshot([t for m in bns for t in (m.running_mean, m.running_var, m.num_batches_tracked)])
    conv = policy.encoder.pixels.net.layer1[0].conv1.weight.detach().clone()
    opt = torch.optim.Adam(policy.parameters(), lr=1e-3)
    update_with(policy, opt, buf, PPOConfig(num_epochs=1, minibatch_size=4), 2, 4,
           torch.Generator().manual_seed(0))
    assert _same(stats, [t for m in bns for t in (m.running_mean, m.running_var, m.num_batches_tracked)])
    assert not torch.equal(conv, policy.encoder.pixels.net.layer1[0].conv1.weight)


def _grads(policy, buf, mb, micro, cfg):
    policy.zero_grad(set_to_none=True)
    adv = buf.flat(buf.advantages)[mb]
    adv = (adv - adv.mean()) / (adv.std() + 1e-8)
    stats = minibatch_gradient(policy, buf, mb, adv, setup_of(cfg, micro))
    return {n: p.grad.clone() for n, p in policy.named_parameters() if p.grad is not None}, stats


def _assert_same_grads(a, b, rtol=1e-5, atol=1e-6):
    assert a.keys() == b.keys() and len(a) > 10
    for name in a:
        torch.testing.assert_close(a[name], b[name], rtol=rtol, atol=atol, msg=name)


def test_checkpointing_gives_the_same_gradients_in_the_update(monkeypatch):
    import visppo.encoders as encoders

    real, calls = encoders.checkpoint, []
    monkeypatch.setattr(encoders, "checkpoint", lambda *a, **k: (calls.append(1), real(*a, **k))[1])
    mb = torch.arange(4)
    grads = []
    for checkpointing in (False, True):
        policy, buf = _setup("resnet18", 32, c=6, T=2, N=2, encoder_checkpointing=checkpointing)
        calls.clear()
        grads.append(_grads(policy, buf, mb, 4, PPOConfig(entropy_coef=0.01))[0])
        assert (len(calls) > 1) == checkpointing  # the config reaches the encoder
    _assert_same_grads(*grads)


def test_accumulated_gradient_equals_full_minibatch_gradient_resnet():
    policy, buf = _setup("resnet18", 32, T=4, N=2)
    cfg = PPOConfig(clip_value=True, entropy_coef=0.01)
    mb = torch.randperm(buf.size, generator=torch.Generator().manual_seed(1))[:7]
    full, full_stats = _grads(policy, buf, mb, 7, cfg)
    acc, acc_stats = _grads(policy, buf, mb, 3, cfg)
    _assert_same_grads(full, acc, atol=1e-7)
    for k in full_stats:
        assert float(acc_stats[k]) == pytest.approx(float(full_stats[k]), rel=1e-5, abs=1e-7), k


def test_an_encoder_lr_scale_of_zero_freezes_the_trunk_for_good(tmp_path):
    """Scale 0: the trunk stays as loaded and takes no part in the update: no gradient (so none in
    the gradient-norm clip) and no Adam state, as while freeze_encoder_updates holds it."""
    run_a = train(load_config(None, tiny_overrides(tmp_path / "a")))
    source = torch.load(run_a / "checkpoints" / "latest.pt", weights_only=True)["model"]
    cfg = load_config(None, tiny_overrides(tmp_path / "b", **{
        "model.encoder_weights": run_a / "checkpoints" / "latest.pt", "model.encoder_lr_scale": 0.0}))
    ckpt = torch.load(train(cfg) / "checkpoints" / "latest.pt", weights_only=True)
    heads, trunk = ckpt["optimizer"]["param_groups"]
    assert trunk["params"] and not any(i in ckpt["optimizer"]["state"] for i in trunk["params"])
    assert all(i in ckpt["optimizer"]["state"] for i in heads["params"])
    trunk_keys = [k for k in source if k.startswith("encoder.pixels.convs")]
    assert trunk_keys and all(torch.equal(ckpt["model"][k], source[k]) for k in trunk_keys)


@pytest.mark.parametrize("content, match", [
    ({"proj.0.bias": [0.0, 1.0]}, r"entry 'proj\.0\.bias' holds a list"),
    ({0: torch.zeros(3)}, r"entry 0 holds a Tensor"),
    ({"model": {"encoder.pixels.proj.0.bias": "zeros"}, "iteration": 3}, r"'model' entry is not a state dict"),
    ({"conv1.weight": torch.tensor([1.0, float("nan")])}, r"holds non-finite weights \(conv1\.weight\)"),
])
def test_a_weights_file_that_is_not_a_state_dict_is_one_config_error(tmp_path, content, match):
    """Not a RuntimeError from load_state_dict, nor an AttributeError on a key that is not a string,
    nor NaN weights that the first rollout would blame on the env."""
    path = tmp_path / "bad.pth"
    torch.save(content, path)
    with pytest.raises(ConfigError, match=match):
        build_policy(_cfg(encoder="resnet18", encoder_weights=path), _space(), BOX, CPU)
