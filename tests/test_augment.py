import pytest
import torch
import torch.nn.functional as F

from visppo.augment import RandomShift, make_augmentation
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


def test_make_augmentation():
    assert make_augmentation("none", 4) is None
    assert isinstance(make_augmentation("shift", 3), RandomShift)
    with pytest.raises(ValueError):
        make_augmentation("crop", 4)


@pytest.mark.parametrize("overrides,key", [
    (["model.augment=shift"], "ppo.augment_loss"),
    (["ppo.augment_loss=true"], "model.augment"),
    (["model.augment=cutout", "ppo.augment_loss=true"], "model.augment"),
    (["model.augment=shift", "ppo.augment_loss=true", "model.shift_pad=0"], "model.shift_pad"),
])
def test_augmentation_config_is_checked(overrides, key):
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        load_config(None, overrides)
    cfg = load_config(None, ["model.augment=shift", "ppo.augment_loss=true"])
    assert cfg.ppo.augment_loss and cfg.model.shift_pad == 4

