"""Image augmentation for the update, and the DrAC regularisers that use it.

Random shift (DrQ, Kostrikov et al. 2020; DrQ-v2): pad each frame by ``pad``
pixels replicating its border, then crop back at a random offset. Done here
by clamped indexing on uint8 frames, on whatever device they are on, with the
same shift for all stacked frames of one sample.

Feeding augmented frames straight into the PPO ratio is unsound (``logp_old``
was computed on the frames the policy acted on). DrAC (Raileanu et al. 2021)
keeps the PPO loss on the original observations and adds two regularisers
that make the policy and the value invariant to the augmentation:
``KL(pi(.|o) || pi(.|aug(o)))`` and ``(V(aug(o)) - V(o))^2``, with the
targets on ``o`` detached. ``ppo.minibatch_gradient`` applies them to the
update's micro-batches only; acting and the no-grad score passes never see an
augmented frame.

``ppo.augment_loss`` is the other use, RAD's (Laskin et al. 2020): every loss reads the
shifted frames, drawn afresh per minibatch, against the ``logp_old`` of the frames the
policy acted on: the ratio then mixes two inputs, as above, so its clipping also measures
how far a shift moves the policy. Cheap (no second pass); measured, not assumed. The
denominator must stay the acting pass's, the probability the action was drawn with.
Recomputing it on the shifted frames starts the ratio at 1 but weights actions drawn on the
plain frames as if drawn on the shifted ones, and the update diverged (docs/learning.md).

Random rotation (``model.augment=rotate``): each sample's frames turned by one angle about
the image centre, nearest pixel, uint8 in and out, the corners outside the turned frame black.
It is sound only where the task is symmetric under that turn: the camera looks straight down
the axis of a rotation that leaves dynamics, reward and the actions' meaning unchanged, as
DeepMind Control's reacher (camera 0 above the arm's base, joint torques, a target drawn at a
uniform angle; ``tests/test_dmc.py`` renders it turned and compares). Then a turned frame
is a frame of a real state, the stored action is a real action from it, and RAD's use
(``ppo.augment_loss``, the acting pass's ``logp_old``) is an exact importance ratio: the turn
adds data instead of regularising. On a task without the symmetry it teaches a wrong policy.

Random draws come from the module's own ``torch.Generator``, seeded by
``builders.build_augmentation`` and saved in each rank's checkpoint state, so a resumed run
draws the same shifts; a minibatch's
shifts are drawn at once, before it is split into micro-batches, so
micro-batching does not change them.
"""

from __future__ import annotations

import math

import torch
from torch import nn
from torch.distributions import Categorical, Distribution, Normal, kl_divergence

AUGMENTATIONS = ("none", "shift", "rotate")


class RandomShift(nn.Module):
    """Random shifts of up to ``pad`` pixels each way, border pixels replicated."""

    def __init__(self, pad: int = 4, seed: int | None = None):
        super().__init__()
        self.pad = int(pad)
        if seed is None:  # reproducible under torch.manual_seed, independent afterwards
            seed = int(torch.randint(0, 2**62, (1,)).item())
        self.generator = torch.Generator().manual_seed(seed)

    def draw(self, n: int) -> torch.Tensor:
        """``[n, 2]`` offsets (rows, columns) in ``[0, 2 * pad]``, on the CPU."""
        offsets, after = self.draw_ahead(n)
        self.generator.set_state(after)
        return offsets

    def draw_ahead(self, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``draw(n)`` without advancing the generator: the offsets and the generator state after them
        (``self.generator.set_state`` it once the draws are used for good)."""
        ahead = torch.Generator()
        ahead.set_state(self.generator.get_state())
        offsets = torch.randint(0, 2 * self.pad + 1, (n, 2), generator=ahead)
        return offsets, ahead.get_state()

    def apply(self, pixels: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
        """Shift ``[B, C, H, W]`` frames (any dtype) by the given ``[B, 2]`` offsets, on their device."""
        b, _, h, w = pixels.shape
        device = pixels.device
        offsets = offsets.to(device) - self.pad
        rows = (torch.arange(h, device=device)[None] + offsets[:, :1]).clamp_(0, h - 1)  # [B, H]
        cols = (torch.arange(w, device=device)[None] + offsets[:, 1:]).clamp_(0, w - 1)  # [B, W]
        batch = torch.arange(b, device=device)[:, None, None]
        out = pixels.permute(0, 2, 3, 1)[batch, rows[:, :, None], cols[:, None, :]]  # [B, H, W, C]
        return out.permute(0, 3, 1, 2)  # NCHW in channels_last layout

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        return self.apply(pixels, self.draw(pixels.shape[0]))

    def augment_obs(self, obs: dict[str, torch.Tensor], offsets: torch.Tensor) -> dict[str, torch.Tensor]:
        """The observation dict with its pixels shifted (other entries untouched)."""
        return {**obs, "pixels": self.apply(obs["pixels"], offsets)}

    def get_extra_state(self) -> torch.Tensor:
        return self.generator.get_state()

    def set_extra_state(self, state: torch.Tensor) -> None:
        self.generator.set_state(state.cpu())

    def extra_repr(self) -> str:
        return f"pad={self.pad}"


class RandomRotate(RandomShift):
    """Random turns of up to ``degrees`` either way about the image centre (same interface as RandomShift:
    ``draw`` gives ``[n]`` angles in radians)."""

    def __init__(self, degrees: float = 180.0, seed: int | None = None):
        super().__init__(0, seed)
        self.degrees = float(degrees)

    def draw_ahead(self, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        ahead = torch.Generator()
        ahead.set_state(self.generator.get_state())
        limit = math.radians(self.degrees)
        angles = (torch.rand(n, generator=ahead, dtype=torch.float64) * 2 - 1) * limit
        return angles, ahead.get_state()

    def apply(self, pixels: torch.Tensor, angles: torch.Tensor) -> torch.Tensor:
        """Turn ``[B, C, H, W]`` frames (any dtype) by ``[B]`` angles (radians; positive turns the picture
        counter-clockwise), on their device. Nearest pixel: no blur, so the turned frames are as sharp
        as the ones the policy acts on (a 1-pixel arm stays 1 pixel), and 2.5x faster than bilinear."""
        b, c, h, w = pixels.shape
        device = pixels.device
        cos = angles.to(device, torch.float32).cos()[:, None, None]
        sin = angles.to(device, torch.float32).sin()[:, None, None]
        y = (torch.arange(h, device=device, dtype=torch.float32) - (h - 1) / 2)[None, :, None]
        x = (torch.arange(w, device=device, dtype=torch.float32) - (w - 1) / 2)[None, None, :]
        rows = (cos * y + sin * x + (h - 1) / 2).round_().long()  # [B, H, W]: where each output pixel comes from
        cols = (cos * x - sin * y + (w - 1) / 2).round_().long()
        inside = ((rows >= 0) & (rows < h) & (cols >= 0) & (cols < w)).view(b, h * w, 1)
        index = (rows.clamp_(0, h - 1) * w + cols.clamp_(0, w - 1)).view(b, h * w)
        flat = pixels.permute(0, 2, 3, 1).reshape(b, h * w, c)  # free for channels_last frames
        out = flat[torch.arange(b, device=device)[:, None], index] * inside.to(pixels.dtype)
        return out.view(b, h, w, c).permute(0, 3, 1, 2)  # NCHW in channels_last layout

    def extra_repr(self) -> str:
        return f"degrees={self.degrees:g}"


Augmentation = RandomShift  # RandomRotate is one too: draw_ahead, apply, augment_obs, generator


def make_augmentation(name: str, pad: int, degrees: float = 180.0, seed: int | None = None) -> Augmentation | None:
    """``model.augment`` -> the module, or None for ``none``; ``seed`` seeds its draws."""
    if name == "none":
        return None
    if name == "shift":
        return RandomShift(pad, seed)
    if name == "rotate":
        return RandomRotate(degrees, seed)
    raise ValueError(f"unknown augmentation {name!r}: use one of {' | '.join(AUGMENTATIONS)}")


def _detached(dist: Distribution) -> Distribution:
    if isinstance(dist, Categorical):
        return Categorical(logits=dist.logits.detach(), validate_args=False)
    if isinstance(dist, Normal):
        return Normal(dist.loc.detach(), dist.scale.detach(), validate_args=False)
    raise TypeError(f"DrAC does not support {type(dist).__name__}")


def _normal_kl(p: Normal, q: Normal) -> torch.Tensor:
    """KL(p || q) per dimension, without torch's ``var_ratio + t - 1 - log(var_ratio)``, which rounds
    a small mean difference to 0 in float32 (the usual case: both policies nearly agree)."""
    d = p.scale.log() - q.scale.log()
    return 0.5 * (torch.expm1(2 * d) - 2 * d) + 0.5 * ((p.loc - q.loc) / q.scale) ** 2


def drac_loss(dist: Distribution, values: torch.Tensor, aug_dist: Distribution,
              aug_values: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Per-sample DrAC regulariser ``KL(pi(.|o) || pi(.|aug o)) + (V(aug o) - V(o))^2``, not reduced.

    The targets (``dist``, ``values``, on the original observations) are
    detached: the regulariser pulls the augmented outputs towards them.
    """
    target = _detached(dist)
    if isinstance(target, Normal) and isinstance(aug_dist, Normal):
        kl = _normal_kl(target, aug_dist).sum(-1)  # independent action dimensions
    else:
        kl = kl_divergence(target, aug_dist)
    v = (aug_values.float() - values.detach().float()) ** 2
    return kl + v, {"drac_policy": kl.detach(), "drac_value": v.detach()}
