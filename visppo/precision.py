"""How numbers are computed, decided in one place: autocast dtype, fp16 loss scaling, memory format.

Every caller (training, acting, evaluation, the probe, the benchmarks) asks
:func:`resolve_precision` or :func:`for_run`; none decides on its own.

- ``train.amp: auto`` is bf16 on CUDA with bf16 support, fp16 on older GPUs (where it
  serves memory: big image models fit), and fp32 on a CPU: the recipes were chosen in fp32,
  and bf16's speed on a CPU does not pay for a recipe nobody tested
  (docs/recipe.md#does-bf16-autocast-learn-as-fp32-does). ``bf16`` asks for it anywhere.
- ``fp16`` needs CUDA and comes with a ``GradScaler``.
- ``train.channels_last`` runs convolutions in NHWC (much faster on CPUs); the
  rollout buffer then stores frames in that layout too.
- Acting on another device than training (``rollout.device``): the acting pass
  uses the precision its own device supports; when that differs from the
  update's, or is the same reduced precision on the other device's kernels, ``logp_old`` is
  recomputed in the update's precision
  (:attr:`RunPrecision.recompute_logp_old`), so the first ratio of every
  sample is exactly 1.
"""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass

import torch

from visppo.config import TrainConfig
from visppo.errors import ConfigError


@dataclass
class Precision:
    """Mixed-precision settings for one device: autocast dtype (None = fp32) and fp16 scaler."""

    device: torch.device
    dtype: torch.dtype | None = None
    scaler: torch.amp.GradScaler | None = None

    def autocast(self) -> AbstractContextManager:
        if self.dtype is None:
            return nullcontext()
        return torch.autocast(self.device.type, dtype=self.dtype)

    @property
    def name(self) -> str:
        return {None: "off", torch.bfloat16: "bf16", torch.float16: "fp16"}[self.dtype]


@dataclass
class RunPrecision:
    """The precisions of one run: the update's, the acting pass's, and the memory format."""

    update: Precision
    acting: Precision
    channels_last: bool

    @property
    def recompute_logp_old(self) -> bool:
        """Acting computed ``logp_old`` in another dtype than the update computes ``logp``, or in the
        same reduced precision on another device, whose kernels round a bf16 pass otherwise (fp32 on
        two devices differs by float rounding alone)."""
        if self.acting.dtype != self.update.dtype:
            return True
        return self.update.dtype is not None and self.acting.device != self.update.device


def autocast_dtype(amp: str, device: torch.device) -> torch.dtype | None:
    """``train.amp`` on ``device`` -> the autocast dtype (None: fp32); ConfigError if impossible."""
    if amp == "auto":
        if device.type == "cuda":  # the probe asks without a GPU: assume one of the last years (Ampere+)
            # the card's own bf16 units (compute capability 8, Ampere, on): is_bf16_supported()
            # also says yes where bf16 is only emulated, and asks the current device, not this one
            native = not torch.cuda.is_available() or torch.cuda.get_device_capability(device)[0] >= 8
            amp = "bf16" if native else "fp16"
        else:
            amp = "off"
    if amp == "fp16" and device.type != "cuda":
        raise ConfigError("train.amp=fp16 needs a CUDA device: use bf16 or off on the CPU")
    return {"off": None, "bf16": torch.bfloat16, "fp16": torch.float16}[amp]


def resolve_precision(amp: str, device: torch.device) -> Precision:
    """``train.amp`` -> :class:`Precision` for ``device`` (with a GradScaler for fp16)."""
    dtype = autocast_dtype(amp, device)
    scaler = torch.amp.GradScaler("cuda") if dtype == torch.float16 else None
    return Precision(device, dtype, scaler)


def acting_precision(amp: str, device: torch.device) -> Precision:
    """The precision of no-grad acting on ``device``: ``train.amp``, except fp16 off CUDA, where
    the device's ``auto`` choice is used (no scaler: nothing is backpropagated)."""
    return Precision(device, autocast_dtype("auto" if amp == "fp16" and device.type != "cuda" else amp, device))


def for_run(train: TrainConfig, device: torch.device, rollout_device: torch.device) -> RunPrecision:
    """The update's precision on ``device`` and the acting pass's on ``rollout_device``.

    fp16 on a CPU rollout device is impossible: acting there uses that device's
    ``auto`` choice, and :attr:`RunPrecision.recompute_logp_old` says so.
    """
    update = resolve_precision(train.amp, device)
    acting = update if rollout_device == device else acting_precision(train.amp, rollout_device)
    return RunPrecision(update, acting, train.channels_last)
