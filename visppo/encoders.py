"""Image encoders: uint8 camera frames in, a feature vector out.

Frames stay uint8 everywhere outside the network (4x smaller than float32 in
the buffer and on the wire to the device); the conversion to float happens in
``forward``, on the device, one micro-batch at a time. No layer mixes samples
of a batch (no BatchNorm in train mode), so splitting a minibatch into
micro-batches never changes what the network computes.

Every pixel encoder is a *trunk* (the conv stack whose weights may be
pretrained; what ``model.freeze_encoder_updates`` freezes and
``model.encoder_lr_scale`` scales) followed by a *projection* to
``model.feature_dim`` (always trained at the full learning rate):

- ``nature``: the Nature-DQN CNN, all stacked frames as input channels;
- ``impala``: the IMPALA CNN (Espeholt et al. 2018), likewise;
- ``drq``: DrQ-v2's encoder (Yarats et al. 2021), four 3x3 convs that keep a
  35x35 map at 84x84 (the Nature CNN keeps 7x7), projected through LayerNorm and tanh;
- ``spatial_softmax``: a small CNN whose feature maps are turned into keypoints
  (each map's softmax-weighted mean image position; Levine et al. 2016), for
  tasks where *where* things are is what matters (reaching, pushing);
- a torchvision architecture (``resnet18``, ``mobilenet_v3_small``, ...):
  built with ``weights=None``, classification head removed, ImageNet
  normalisation, optional resize, and a stack of k RGB frames run frame by
  frame through the 3-channel trunk (k folded into the batch), the k feature
  vectors concatenated before the projection. The trunk stays in eval mode
  (BatchNorm statistics frozen, no dropout or stochastic depth), so a sample's
  features never depend on its batch.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from contextlib import nullcontext
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from visppo.checkpoint import describe_mismatch, read_weights_file, without_removed_tensors
from visppo.config import ENCODERS, TORCHVISION_ENCODERS
from visppo.errors import ConfigError

TORCHVISION_BACKBONES = {name: "resnet" if name.startswith("resnet") else "features"
                         for name in TORCHVISION_ENCODERS}
"""torchvision architectures by name -> family: how the trunk is cut into blocks and where the head is
(resnet: conv1..layer4 + fc; features: ``features`` + ``classifier``, as MobileNet/EfficientNet)."""
_HEADS = {"resnet": ("fc.",), "features": ("classifier.",)}
IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)


def _uint8_to_float(x: torch.Tensor) -> torch.Tensor:
    return x.float().div_(255.0) if x.dtype == torch.uint8 else x.float()


def _uint8_to_conv_input(x: torch.Tensor) -> torch.Tensor:
    """uint8 frames -> [0, 1] for a convolution: under autocast straight to its dtype.

    The same values autocast would pass the convolution (x / 255 in fp32, rounded
    once: uint8 is exact in bf16/fp16, and their division computes in fp32), but
    no fp32 copy of the batch. That copy is memory on a GPU and time on a CPU,
    where a fresh buffer above glibc's mmap threshold (32 MiB; a minibatch of 256
    stacked 84x84 frames is 65 MB) is page-faulted in again on every pass.
    """
    if x.dtype == torch.uint8 and torch.is_autocast_enabled(x.device.type):
        return x.to(torch.get_autocast_dtype(x.device.type)).div_(255.0)
    return _uint8_to_float(x)


def _channels_last_like(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """Follow the model's layout (reorder uint8 frames: 4x cheaper than floats)."""
    if weight.dim() == 4 and weight.is_contiguous(memory_format=torch.channels_last):
        return x.contiguous(memory_format=torch.channels_last)
    return x


def _run_stages(stages: list, x: torch.Tensor, use_checkpoint: bool) -> torch.Tensor:
    """Run ``stages`` in turn; with ``use_checkpoint`` each one's activations are recomputed in backward."""
    if use_checkpoint and torch.is_grad_enabled():
        for stage in stages:
            x = checkpoint(stage, x, use_reentrant=False)
        return x
    for stage in stages:
        x = stage(x)
    return x


class PixelEncoder(nn.Module, ABC):
    """Base: ``trunk`` (possibly pretrained) -> ``proj``; ``frozen`` runs the trunk without gradients."""

    frozen: bool = False
    """Set by :class:`FreezeSchedule`: the trunk runs under no_grad, so it gets no gradient at all."""

    @abstractmethod
    def trunk(self) -> nn.Module:
        """The (possibly pretrained) part that freezing and ``encoder_lr_scale`` apply to."""

    def _no_grad_if_frozen(self):
        return torch.no_grad() if self.frozen and torch.is_grad_enabled() else nullcontext()


class _ConvProjection(PixelEncoder):
    """A conv stack ``convs`` (the trunk, ending in Flatten) followed by a projection ``proj``."""

    convs: nn.Sequential
    proj: nn.Module

    def trunk(self) -> nn.Module:
        return self.convs

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        pixels = _channels_last_like(pixels, self.convs[0].weight)
        with self._no_grad_if_frozen():
            x = self.convs(_uint8_to_conv_input(pixels))
        return self.proj(x)


class NatureCNN(_ConvProjection):
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


class SpatialSoftmaxCNN(PixelEncoder):
    """Conv features -> ``keypoints`` (x, y) positions by spatial softmax -> linear projection.

    Levine, Finn et al. 2016 ("End-to-end training of deep visuomotor policies"),
    robomimic's default image encoder. Each keypoint map's softmax over the image
    (with a learnt temperature) weights a grid of image coordinates in [-1, 1]; the
    expected coordinate is the keypoint. A policy that must move the arm to a seen
    object then reads positions directly instead of decoding them from a flattened
    map, and the expected value places a keypoint between grid cells, finer than
    the stride-4 grid it is computed on. The trunk is the Nature-DQN first layer
    (stride 4) and a same-size 3x3 layer, which keeps a larger map than ``nature``'s and costs
    more per frame (docs/learning.md has the timing).
    """

    def __init__(self, in_channels: int, image_size: int, feature_dim: int, keypoints: int = 32,
                 stride: int = 4):
        super().__init__()
        self.convs = nn.Sequential(
            nn.Conv2d(in_channels, 32, 8, stride=stride), nn.ReLU(),
            nn.Conv2d(32, 64, 3, stride=1, padding=1), nn.ReLU(),
            # no bias: a softmax ignores a constant added to its map, so a bias's true gradient is 0
            # and Adam would turn its rounding noise into full-size random steps
            nn.Conv2d(64, keypoints, 1, bias=False),
        )
        side = (image_size - 8) // stride + 1
        if side < 2:
            raise ConfigError(f"model.encoder=spatial_softmax with model.keypoint_stride={stride} needs frames of "
                              f"at least {8 + stride} pixels, not {image_size}")
        grid = torch.linspace(-1.0, 1.0, side)
        # pos_x varies along columns (image x), pos_y along rows (image y), flattened like the maps
        self.register_buffer("pos_x", grid.repeat(side), persistent=False)
        self.register_buffer("pos_y", grid.repeat_interleave(side), persistent=False)
        self.log_temperature = nn.Parameter(torch.zeros(()))
        self.proj = nn.Sequential(nn.Linear(2 * keypoints, feature_dim), nn.ReLU())
        self.out_dim = feature_dim

    def trunk(self) -> nn.Module:
        return self.convs

    def keypoint_xy(self, maps: torch.Tensor) -> torch.Tensor:
        """``[B, K, H, W]`` maps -> ``[B, 2K]`` expected (x..., y...) image coordinates in [-1, 1]."""
        b, k = maps.shape[:2]
        attention = torch.softmax(maps.float().reshape(b, k, -1) / self.log_temperature.exp(), dim=-1)
        return torch.cat([attention @ self.pos_x, attention @ self.pos_y], dim=1)

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        pixels = _channels_last_like(pixels, self.convs[0].weight)
        with self._no_grad_if_frozen():
            maps = self.convs(_uint8_to_conv_input(pixels))
        return self.proj(self.keypoint_xy(maps).to(maps.dtype))


class DrQCNN(_ConvProjection):
    """DrQ-v2's encoder: 3x3 convs (stride 2, then 1, 1, 1; 32 channels), Linear -> LayerNorm -> tanh.

    Yarats et al. 2021, the pixel encoder of the off-policy ceiling in the DMC tables. Only the first
    conv strides, so at 84x84 it keeps a 35x35 map where the Nature CNN keeps 7x7: a few-pixel
    fingertip stays resolvable. The flattened map is large (32x35x35 = 39,200), hence DrQ-v2's
    LayerNorm and tanh after the projection, which keep the features bounded whatever its scale.
    Forward and backward cost about 4x the Nature CNN's multiply-adds at 84x84.
    """

    def __init__(self, in_channels: int, image_size: int, feature_dim: int):
        super().__init__()
        self.convs = nn.Sequential(
            nn.Conv2d(in_channels, 32, 3, stride=2), nn.ReLU(),
            nn.Conv2d(32, 32, 3, stride=1), nn.ReLU(),
            nn.Conv2d(32, 32, 3, stride=1), nn.ReLU(),
            nn.Conv2d(32, 32, 3, stride=1), nn.ReLU(),
            nn.Flatten(),
        )
        side = (image_size - 3) // 2 + 1 - 6
        if side < 1:
            raise ConfigError(f"model.encoder=drq needs frames of at least 15 pixels, not {image_size}")
        self.proj = nn.Sequential(nn.Linear(32 * side * side, feature_dim), nn.LayerNorm(feature_dim),
                                  nn.Tanh())
        self.out_dim = feature_dim


class _ResidualBlock(nn.Module):
    def __init__(self, channels: int):
        super().__init__()
        self.conv0 = nn.Conv2d(channels, channels, 3, padding=1)
        self.conv1 = nn.Conv2d(channels, channels, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.conv1(F.relu(self.conv0(F.relu(x))))


class ImpalaCNN(PixelEncoder):
    """The IMPALA CNN (Espeholt et al. 2018): 3 stages of conv, max-pool, 2 residual blocks."""

    def __init__(self, in_channels: int, image_size: int, feature_dim: int,
                 channels: tuple[int, ...] = (16, 32, 32), checkpointing: bool = False):
        super().__init__()
        stages, c = [], in_channels
        for out in channels:
            stages.append(nn.Sequential(nn.Conv2d(c, out, 3, padding=1), nn.MaxPool2d(3, 2, padding=1),
                                        _ResidualBlock(out), _ResidualBlock(out)))
            c = out
        self.stages = nn.Sequential(*stages)
        self.checkpointing = checkpointing
        with torch.no_grad():
            flat = self.stages(torch.zeros(1, in_channels, image_size, image_size)).numel()
        self.proj = nn.Sequential(nn.ReLU(), nn.Flatten(), nn.Linear(flat, feature_dim), nn.ReLU())
        self.out_dim = feature_dim

    def trunk(self) -> nn.Module:
        return self.stages

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        pixels = _channels_last_like(pixels, self.stages[0][0].weight)
        with self._no_grad_if_frozen():
            x = _run_stages(list(self.stages), _uint8_to_conv_input(pixels), self.checkpointing)
        return self.proj(x)


class TorchvisionBackbone(PixelEncoder):
    """A torchvision classification network without its head, on stacks of RGB frames.

    ``[B, 3k, H, W]`` uint8 -> k frames folded into the batch ``[B*k, 3, H, W]``
    -> float, resize (``resize`` > 0), ImageNet normalisation -> the trunk ->
    ``[B, k * trunk_dim]`` -> ``proj`` -> ``[B, feature_dim]``. ``self.net`` is
    the torchvision model with its head deleted, so its state dict has
    torchvision's keys (minus ``fc.*`` / ``classifier.*``).
    """

    def __init__(self, name: str, in_channels: int, feature_dim: int, resize: int = 0,
                 checkpointing: bool = False):
        super().__init__()
        import torchvision

        if name not in TORCHVISION_BACKBONES:
            raise ValueError(f"unknown torchvision backbone {name!r}")
        if in_channels % 3:
            raise ConfigError(f"model.encoder={name} takes RGB frames (3 channels each), but the "
                              f"observations have {in_channels} channels: use RGB frames or "
                              "model.encoder=nature / impala")
        self.name, self.family = name, TORCHVISION_BACKBONES[name]
        self.frames = in_channels // 3
        self.resize, self.checkpointing = resize, checkpointing
        net = torchvision.models.get_model(name, weights=None)
        head = net.fc if self.family == "resnet" else net.classifier
        self.trunk_dim = next(m for m in head.modules() if isinstance(m, nn.Linear)).in_features
        if self.family == "resnet":
            del net.fc
        else:
            del net.classifier
        self.net = net
        self.net.eval()
        mean, std = torch.tensor(IMAGENET_MEAN), torch.tensor(IMAGENET_STD)
        # (x - mean) / std as one multiply-add; not saved in state dicts
        self.register_buffer("scale", (1.0 / std).view(1, 3, 1, 1), persistent=False)
        self.register_buffer("shift", (mean / std).view(1, 3, 1, 1), persistent=False)
        self.proj = nn.Sequential(nn.Linear(self.frames * self.trunk_dim, feature_dim), nn.ReLU())
        self.out_dim = feature_dim

    def trunk(self) -> nn.Module:
        return self.net

    def train(self, mode: bool = True) -> TorchvisionBackbone:
        """The projection follows ``mode``; the trunk stays in eval mode (frozen BatchNorm statistics)."""
        super().train(mode)
        self.net.eval()
        return self

    def _stem(self, x: torch.Tensor) -> torch.Tensor:
        net = self.net
        return net.maxpool(net.relu(net.bn1(net.conv1(x))))

    def _stages(self) -> list:
        """The trunk cut into blocks, the unit of activation checkpointing."""
        net = self.net
        if self.family == "resnet":
            return [self._stem, *net.layer1, *net.layer2, *net.layer3, *net.layer4]
        return list(net.features)

    def _first_conv(self) -> torch.Tensor:
        return self.net.conv1.weight if self.family == "resnet" else next(self.net.features.parameters())

    def frame_features(self, frames: torch.Tensor) -> torch.Tensor:
        """``[N, 3, H, W]`` RGB frames (uint8 or float in [0, 1]) -> ``[N, trunk_dim]``."""
        x = _uint8_to_float(_channels_last_like(frames, self._first_conv()))
        if self.resize and x.shape[-2:] != (self.resize, self.resize):
            x = F.interpolate(x, size=(self.resize, self.resize), mode="bilinear", align_corners=False,
                              antialias=x.shape[-1] > self.resize)
        x = x * self.scale - self.shift
        x = _run_stages(self._stages(), x, self.checkpointing)
        return torch.flatten(self.net.avgpool(x), 1)

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        b, c, h, w = pixels.shape
        with self._no_grad_if_frozen():
            feats = self.frame_features(pixels.reshape(b * self.frames, 3, h, w))
        return self.proj(feats.reshape(b, self.frames * self.trunk_dim))


def build_pixel_encoder(name: str, pixel_shape: tuple[int, int, int], feature_dim: int,
                        resize: int = 0, checkpointing: bool = False, keypoints: tuple[int, int] = (32, 4)
                        ) -> PixelEncoder:
    """``keypoints``: spatial_softmax's (count, first layer's stride); the others ignore it."""
    c, h, w = pixel_shape
    if name == "nature":
        return NatureCNN(c, h, feature_dim)
    if name == "impala":
        return ImpalaCNN(c, h, feature_dim, checkpointing=checkpointing)
    if name == "drq":
        return DrQCNN(c, h, feature_dim)
    if name == "spatial_softmax":
        count, stride = keypoints
        return SpatialSoftmaxCNN(c, h, feature_dim, count, stride)
    if name in TORCHVISION_BACKBONES:
        return TorchvisionBackbone(name, c, feature_dim, resize, checkpointing)
    raise ValueError(f"unknown encoder {name!r}: use one of {', '.join(ENCODERS)}")


def tanh_layers(in_dim: int, width: int, count: int) -> nn.Sequential:
    """``count`` Linear -> Tanh layers of ``width``, orthogonal at gain sqrt(2), zero bias (CleanRL's MLP)."""
    layers: list[nn.Module] = []
    for _ in range(count):
        linear = nn.Linear(in_dim, width)
        nn.init.orthogonal_(linear.weight, 2 ** 0.5)
        nn.init.zeros_(linear.bias)
        layers += [linear, nn.Tanh()]
        in_dim = width
    return nn.Sequential(*layers)


class ObsEncoder(nn.Module):
    """Pixels through a CNN, optional proprioceptive state through an MLP, concatenated; then
    ``shared_layers`` tanh layers of ``shared_dim`` over the concatenation (model.shared_layers):
    a trunk that both the actor's and the critic's losses train, before their own heads."""

    def __init__(self, pixel_shape: tuple[int, int, int], state_dim: int, feature_dim: int,
                 state_hidden_dim: int, encoder: str = "nature", resize: int = 0,
                 checkpointing: bool = False, shared_layers: int = 0, shared_dim: int = 256,
                 keypoints: tuple[int, int] = (32, 4)):
        super().__init__()
        self.pixels = build_pixel_encoder(encoder, tuple(pixel_shape), feature_dim, resize, checkpointing, keypoints)
        self.out_dim = feature_dim
        self.state = None
        if state_dim:
            self.state = nn.Sequential(nn.Linear(state_dim, state_hidden_dim), nn.Tanh())
            self.out_dim += state_hidden_dim
        self.shared = None
        if shared_layers:
            self.shared = tanh_layers(self.out_dim, shared_dim, shared_layers)
            self.out_dim = shared_dim

    def trunk_parameters(self) -> list[nn.Parameter]:
        """The pixel trunk's parameters: what pretrained weights fill, freezing freezes, lr scaling scales."""
        return list(self.pixels.trunk().parameters())

    def forward(self, obs: dict[str, torch.Tensor]) -> torch.Tensor:
        feats = self.pixels(obs["pixels"])
        if self.state is not None:
            feats = torch.cat([feats, self.state(obs["state"].float()).to(feats.dtype)], dim=-1)
        return feats if self.shared is None else self.shared(feats)


# --------------------------------------------------------------------------- fine-tuning controls


def _optimizer_steps(optimizer: torch.optim.Optimizer) -> int:
    """Optimizer steps taken so far, read from the optimizer's state (so it survives a resume)."""
    steps = [s["step"] for s in optimizer.state.values() if "step" in s]
    return int(max(float(s) for s in steps)) if steps else 0


class FreezeSchedule:
    """``before_step`` hook: the encoders' trunks frozen for the first ``steps`` optimizer steps.

    While frozen the trunk runs under no_grad: it gets no gradient (none is
    computed, which also saves its backward), so it takes no part in the
    gradient-norm clipping, and Adam skips it entirely (no moment update, no
    weight decay, no step count): it does not move, and it starts with fresh
    Adam state when it thaws. Call once per optimizer step, before it.
    """

    def __init__(self, encoders: list[ObsEncoder], steps: float, optimizer: torch.optim.Optimizer | None = None):
        self.encoders, self.steps = encoders, steps
        self.taken = _optimizer_steps(optimizer) if optimizer is not None else 0
        self._set(self.taken < steps)

    @property
    def frozen(self) -> bool:
        return self.taken < self.steps

    def _set(self, frozen: bool) -> None:
        for enc in self.encoders:
            enc.pixels.frozen = frozen

    def __call__(self, optimizer: torch.optim.Optimizer | None = None) -> None:
        if self.frozen:  # this step is a frozen one: make sure no trunk gradient reaches it
            for enc in self.encoders:
                for p in enc.trunk_parameters():
                    p.grad = None
        self.taken += 1
        self._set(self.frozen)  # for the next minibatch's forward


# --------------------------------------------------------------------------- pretrained weights


def imagenet_weights_file(name: str) -> tuple[Path, str]:
    """Where torchvision keeps ``name``'s ImageNet weights (``TORCH_HOME``'s hub cache), and their URL."""
    from torchvision.models import get_model_weights

    weights = get_model_weights(name).DEFAULT
    url = weights.url
    return Path(torch.hub.get_dir()) / "checkpoints" / url.rsplit("/", 1)[-1], url


def _load_strict(module: nn.Module, state: dict[str, torch.Tensor], source: str) -> None:
    """Load ``state`` exactly, but for BatchNorm's step counters: files saved before torch had
    them (torchvision's ResNet-18/34 ImageNet weights) lack ``*.num_batches_tracked``, which
    torch's own loader fills in; so does this, from the module (they steer no computation here)."""
    own = module.state_dict()
    state = {**{k: v for k, v in own.items() if k.endswith(".num_batches_tracked") and k not in state}, **state}
    mismatch = describe_mismatch(own, state)
    if mismatch:
        raise ConfigError(f"model.encoder_weights: {source} does not fit this encoder ({mismatch}): "
                          "give weights of the same architecture (model.encoder) and input shape")
    with torch.no_grad():
        module.load_state_dict(state, strict=True)


def _policy_state(obj: dict) -> dict | None:
    """The ActorCritic state dict in ``obj`` (a visppo checkpoint, or the state dict itself), else None."""
    if isinstance(obj.get("model"), dict):
        return obj["model"]
    if any(k.startswith("encoder.pixels.") for k in obj):
        return obj
    return None


def load_encoder_weights(encoders: list[ObsEncoder], spec: str, name: str) -> None:
    """Fill the encoders' pixel networks with ``model.encoder_weights`` (``imagenet`` or a path).

    A visppo checkpoint (or an ActorCritic state dict) gives its whole pixel
    encoder (``encoder.pixels.*``: trunk and projection; a separate critic
    encoder takes ``critic_encoder.pixels.*`` when the file has them). Any
    other dict is a state dict of the trunk in torchvision's format (its
    classification head, which visppo removes, is ignored); for nature/impala
    it is the state dict of the pixel encoder. Anything that does not fit
    exactly is refused with the keys listed. Never downloads.
    """
    if spec in ("none", ""):
        return
    if spec == "imagenet":
        if name not in TORCHVISION_BACKBONES:
            raise ConfigError(f"model.encoder_weights=imagenet needs a torchvision backbone, not {name}")
        path, url = imagenet_weights_file(name)
        if not path.is_file():
            raise ConfigError(
                f"model.encoder_weights=imagenet: the {name} ImageNet weights file {path} is missing and "
                f"visppo never downloads: fetch {url} on a machine with network and put it at {path} "
                f"(the folder is $TORCH_HOME/hub/checkpoints), or set model.encoder_weights to a local file")
        states, source = [read_weights_file(path)] * len(encoders), str(path)
    else:
        path = Path(spec).expanduser()
        obj, source = read_weights_file(path), str(path)
        policy_state = _policy_state(obj)
        if policy_state is not None:
            policy_state = without_removed_tensors(policy_state)
            def part(prefix: str) -> dict:
                return {k[len(prefix):]: v for k, v in policy_state.items() if k.startswith(prefix)}
            actor = part("encoder.pixels.")
            if not actor:
                raise ConfigError(f"model.encoder_weights: {path} is a visppo checkpoint without "
                                  "encoder.pixels.* keys: give a checkpoint of a pixel policy")
            states = [actor] + [part("critic_encoder.pixels.") or actor for _ in encoders[1:]]
            for enc, state in zip(encoders, states, strict=True):
                _load_strict(enc.pixels, state, source)
            return
        states = [obj] * len(encoders)
    for enc, state in zip(encoders, states, strict=True):
        if isinstance(enc.pixels, TorchvisionBackbone):
            heads = _HEADS[enc.pixels.family]
            trunk_state = {k: v for k, v in state.items() if not k.startswith(heads)}
            _load_strict(enc.pixels.net, trunk_state, source)
        else:
            _load_strict(enc.pixels, state, source)
