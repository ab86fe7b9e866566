import math

import pytest
import torch
import torch.nn.functional as F
from torch.distributions import Categorical, Normal

from visppo.augment import RandomRotate, RandomShift, drac_loss, make_augmentation
from visppo.config import load_config
from visppo.errors import ConfigError


def _frames(n=4, c=6, side=16, seed=0):
    return torch.randint(0, 256, (n, c, side, side), dtype=torch.uint8,
                         generator=torch.Generator().manual_seed(seed))


def test_shift_equals_replicate_pad_and_crop():
    """DrQ's definition: pad by `pad` replicating the border, crop back at the drawn offset."""
    aug = RandomShift(pad=4, seed=0)
    x = _frames()
    offsets = aug.draw(len(x))
    out = aug.apply(x, offsets)
    assert out.dtype == torch.uint8 and out.shape == x.shape
    padded = F.pad(x.float(), (4, 4, 4, 4), mode="replicate")
    for i, (dy, dx) in enumerate(offsets.tolist()):
        ref = padded[i, :, dy:dy + 16, dx:dx + 16]
        assert torch.equal(out[i].float(), ref)


def test_shift_is_the_same_for_all_stacked_frames_and_bounded():
    aug = RandomShift(pad=2, seed=1)
    x = _frames(8, 3).repeat(1, 3, 1, 1)  # three identical frames per sample
    out = aug(x)
    assert torch.equal(out[:, 0:3], out[:, 3:6]) and torch.equal(out[:, 0:3], out[:, 6:9])
    offsets = aug.draw(1000)
    assert offsets.min() >= 0 and offsets.max() <= 4 and len(offsets.unique()) == 5
    centre = torch.full((len(x), 2), 2)
    assert torch.equal(aug.apply(x, centre), x)  # offset == pad: no shift
    cl = x.contiguous(memory_format=torch.channels_last)
    torch.testing.assert_close(aug.apply(cl, centre), x)


def test_draws_are_reproducible_and_saved_in_the_state_dict():
    a, b = RandomShift(4, seed=7), RandomShift(4, seed=7)
    assert torch.equal(a.draw(10), b.draw(10))
    ahead, state = a.draw_ahead(5)
    assert torch.equal(a.draw(5), ahead)  # draw_ahead does not advance the generator
    assert torch.equal(a.generator.get_state(), state)
    saved = a.state_dict()
    first = a.draw(6)
    c = RandomShift(4, seed=123)
    c.load_state_dict(saved)
    assert torch.equal(c.draw(6), first)
    torch.manual_seed(3)
    d = RandomShift(4)
    torch.manual_seed(3)
    assert torch.equal(RandomShift(4).draw(4), d.draw(4))  # seeded from torch's RNG at construction


def test_rotate_by_0_is_the_identity_and_by_90_is_rot90_for_every_stacked_frame():
    aug = RandomRotate(seed=0)
    x = _frames(3, 9, side=12)
    assert torch.equal(aug.apply(x, torch.zeros(3)), x)
    quarter = torch.full((3,), math.pi / 2)
    # a positive angle turns the picture as rot90(k=1) does (counter-clockwise as displayed);
    # the reacher test in test_dmc.py checks that this sense is the arm's on the task
    assert torch.equal(aug.apply(x, quarter), torch.rot90(x, k=1, dims=(2, 3)))
    cl = x.contiguous(memory_format=torch.channels_last)
    assert torch.equal(aug.apply(cl, quarter), torch.rot90(x, k=1, dims=(2, 3)))
    assert torch.equal(aug.apply(x, -quarter), torch.rot90(x, k=-1, dims=(2, 3)))
    mixed = aug.apply(x, torch.tensor([0.0, math.pi / 2, 0.3]))  # one angle per sample, all its frames
    assert torch.equal(mixed[0], x[0]) and torch.equal(mixed[1], torch.rot90(x[1], k=1, dims=(1, 2)))
    same = aug.apply(x[2:3, :3].repeat(1, 3, 1, 1), torch.tensor([0.3]))
    assert torch.equal(same[:, :3], same[:, 3:6]) and torch.equal(same[:, :3], same[:, 6:])


def test_rotate_keeps_a_centred_disc_and_blackens_the_corners():
    x = torch.full((1, 3, 21, 21), 200, dtype=torch.uint8)
    out = RandomRotate(seed=0).apply(x, torch.tensor([math.pi / 4]))
    assert out.dtype == torch.uint8 and out[0, :, 10, 10].tolist() == [200] * 3
    assert out[0, :, 0, 0].tolist() == [0] * 3  # outside the turned frame


def test_rotate_draws_are_bounded_reproducible_and_saved():
    a, b = RandomRotate(30, seed=5), RandomRotate(30, seed=5)
    angles = a.draw(2000)
    assert torch.equal(angles, b.draw(2000))
    assert angles.abs().max() <= math.radians(30) and angles.min() < -0.4 and angles.max() > 0.4
    saved = a.state_dict()
    first = a.draw(4)
    c = RandomRotate(30, seed=1)
    c.load_state_dict(saved)
    assert torch.equal(c.draw(4), first)


def test_make_augmentation():
    assert make_augmentation("none", 4) is None
    assert isinstance(make_augmentation("shift", 3), RandomShift)
    assert make_augmentation("rotate", 3, 45.0).degrees == 45.0
    with pytest.raises(ValueError):
        make_augmentation("crop", 4)


def test_drac_loss_is_zero_without_difference_and_pulls_only_the_augmented_side():
    loc = torch.randn(5, 2, requires_grad=True)
    v = torch.randn(5, requires_grad=True)
    dist = Normal(loc, torch.ones(5, 2))
    reg, stats = drac_loss(dist, v, Normal(loc, torch.ones(5, 2)), v)
    torch.testing.assert_close(reg, torch.zeros(5))
    aug_loc = loc.detach().clone().requires_grad_(True)
    aug_v = (v.detach() + 1.0).requires_grad_(True)
    shifted = aug_loc + 0.5
    reg, stats = drac_loss(dist, v, Normal(shifted, torch.ones(5, 2)), aug_v)
    # KL of unit-variance Gaussians: 0.5 * |mu1 - mu2|^2 per dim, summed; value term 1
    torch.testing.assert_close(stats["drac_policy"], torch.full((5,), 0.25))
    torch.testing.assert_close(stats["drac_value"], torch.ones(5))
    reg.sum().backward()
    assert loc.grad is None and v.grad is None  # targets on the original frames are detached
    assert aug_loc.grad is not None and aug_v.grad is not None
    logits = torch.randn(4, 3)
    reg, stats = drac_loss(Categorical(logits=logits), torch.zeros(4), Categorical(logits=logits), torch.zeros(4))
    torch.testing.assert_close(reg, torch.zeros(4), atol=1e-6, rtol=0)


@pytest.mark.parametrize("overrides,key", [
    (["model.augment=shift"], "ppo.drac_coef"),
    (["ppo.drac_coef=0.1"], "model.augment"),
    (["model.augment=cutout", "ppo.drac_coef=0.1"], "model.augment"),
    (["model.augment=shift", "ppo.drac_coef=0.1", "model.shift_pad=0"], "model.shift_pad"),
    (["ppo.augment_loss=true"], "model.augment"),
    (["model.augment=shift", "ppo.drac_coef=0.1", "ppo.augment_loss=true"], "ppo.augment_loss"),
])
def test_augmentation_config_is_checked(overrides, key):
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        load_config(None, overrides)
    assert load_config(None, ["model.augment=shift", "ppo.drac_coef=0.1"]).model.shift_pad == 4
    assert load_config(None, ["model.augment=shift", "ppo.augment_loss=true"]).ppo.augment_loss


def test_gaussian_kl_matches_torch_and_keeps_small_differences():
    g = torch.Generator().manual_seed(0)
    p = Normal(torch.randn(5, 3, generator=g), torch.rand(5, 3, generator=g) + 0.2)
    q = Normal(torch.randn(5, 3, generator=g), torch.rand(5, 3, generator=g) + 0.2)
    _, stats = drac_loss(p, torch.zeros(5), q, torch.zeros(5))
    torch.testing.assert_close(stats["drac_policy"], torch.distributions.kl_divergence(p, q).sum(-1))
    near = Normal(torch.tensor([[1e-4]]), torch.tensor([[0.6]]))  # float32 KL of torch rounds this to 0
    _, stats = drac_loss(near, torch.zeros(1), Normal(torch.zeros(1, 1), torch.tensor([[0.6]])), torch.zeros(1))
    torch.testing.assert_close(stats["drac_policy"], torch.tensor([0.5 * (1e-4 / 0.6) ** 2]))


