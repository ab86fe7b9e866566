"""Image augmentation for the update.

Random shift (DrQ, Kostrikov et al. 2020; DrQ-v2): pad each frame by ``pad``
pixels replicating its border, then crop back at a random offset. Done here
by clamped indexing on uint8 frames, on whatever device they are on, with the
same shift for all stacked frames of one sample.

``ppo.augment_loss`` is its use, RAD's (Laskin et al. 2020): every loss reads the shifted
frames, drawn afresh per minibatch, against the ``logp_old`` of the frames the policy acted
on, so the ratio's clipping also measures how far a shift moves the policy. The denominator
must stay the acting pass's, the probability the action was drawn with (docs/learning.md).
Acting and the no-grad score passes never see an augmented frame.

Random draws come from the module's own ``torch.Generator``, seeded by
``builders.build_augmentation`` and saved in each rank's checkpoint state, so a resumed run
draws the same shifts; a minibatch's
shifts are drawn at once, before it is split into micro-batches, so
micro-batching does not change them.
"""

from __future__ import annotations

import torch
from torch import nn

AUGMENTATIONS = ("none", "shift")


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


Augmentation = RandomShift


def make_augmentation(name: str, pad: int, seed: int | None = None) -> Augmentation | None:
    """``model.augment`` -> the module, or None for ``none``; ``seed`` seeds its draws."""
    if name == "none":
        return None
    if name == "shift":
        return RandomShift(pad, seed)
    raise ValueError(f"unknown augmentation {name!r}: use one of {' | '.join(AUGMENTATIONS)}")
