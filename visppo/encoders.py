"""Image encoders: uint8 camera frames in, a feature vector out.

Frames stay uint8 everywhere outside the network (4x smaller than float32 in
the buffer and on the wire to the device); the conversion to float happens in
``forward``, on the device, one micro-batch at a time. No layer mixes samples
of a batch (no BatchNorm in train mode), so splitting a minibatch into
micro-batches never changes what the network computes.
"""

from __future__ import annotations

import torch
from torch import nn


def _uint8_to_float(x: torch.Tensor) -> torch.Tensor:
    return x.float().div_(255.0) if x.dtype == torch.uint8 else x.float()


class NatureCNN(nn.Module):
    """The Nature-DQN convolutional stack (Mnih et al. 2015) with a linear projection."""

    def __init__(self, in_channels: int, image_size: int, feature_dim: int):
        super().__init__()
        self.convs = nn.Sequential(
            nn.Conv2d(in_channels, 32, 8, stride=4), nn.ReLU(),
            nn.Conv2d(32, 64, 4, stride=2), nn.ReLU(),
            nn.Conv2d(64, 64, 3, stride=1), nn.ReLU(),
            nn.Flatten(),
        )
        with torch.no_grad():
            flat = self.convs(torch.zeros(1, in_channels, image_size, image_size)).shape[1]
        self.proj = nn.Sequential(nn.Linear(flat, feature_dim), nn.ReLU())
        self.out_dim = feature_dim

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        if self.convs[0].weight.is_contiguous(memory_format=torch.channels_last):
            # follow the model's layout; reorder the uint8 frames, 4x cheaper than floats
            pixels = pixels.contiguous(memory_format=torch.channels_last)
        return self.proj(self.convs(_uint8_to_float(pixels)))


class ObsEncoder(nn.Module):
    """Pixels through a CNN, optional proprioceptive state through an MLP, concatenated."""

    def __init__(self, pixel_shape: tuple[int, int, int], state_dim: int, feature_dim: int,
                 state_hidden_dim: int, encoder: str = "nature"):
        super().__init__()
        c, h, w = pixel_shape
        if encoder != "nature":
            raise ValueError(f"unknown encoder {encoder!r}")
        self.pixels = NatureCNN(c, h, feature_dim)
        self.state = None
        self.out_dim = feature_dim
        if state_dim:
            self.state = nn.Sequential(nn.Linear(state_dim, state_hidden_dim), nn.Tanh())
            self.out_dim += state_hidden_dim

    def forward(self, obs: dict[str, torch.Tensor]) -> torch.Tensor:
        feats = self.pixels(obs["pixels"])
        if self.state is not None:
            feats = torch.cat([feats, self.state(obs["state"].float()).to(feats.dtype)], dim=-1)
        return feats
