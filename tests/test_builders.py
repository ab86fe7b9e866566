"""builders: config -> the objects a run uses (here: the update's augmentation)."""

import torch

from visppo.augment import RandomShift
from visppo.builders import build_augmentation
from visppo.config import load_config


def _cfg(*overrides):
    return load_config(None, ["env.id=visppo/DotReach-v0", "ppo.augment_loss=true", *overrides])


def _draws(augment, n=16):
    offsets, _ = augment.draw_ahead(n)
    return offsets


def test_no_augmentation_builds_nothing():
    assert build_augmentation(load_config(None, ["model.augment=none"])) is None


def test_the_augmentation_is_the_configs_and_seeded_by_run_seed_and_rank():
    shift = build_augmentation(_cfg("model.augment=shift", "model.shift_pad=3"))
    assert isinstance(shift, RandomShift) and shift.pad == 3
    cfg = _cfg("model.augment=shift", "train.seed=5")
    same = [_draws(build_augmentation(cfg, rank=0)) for _ in range(2)]
    assert torch.equal(*same)  # a run, and its resumption's rebuild, draw the same shifts
    assert not torch.equal(same[0], _draws(build_augmentation(cfg, rank=1)))  # each rank its own
    assert not torch.equal(same[0], _draws(build_augmentation(_cfg("model.augment=shift", "train.seed=6"))))
    # not the minibatch order's stream, which is seeded with the run seed itself
    assert shift.generator.initial_seed() != torch.Generator().manual_seed(5).initial_seed()
