"""One place decides the precision: update, acting, loss scaling."""

import warnings

import pytest
import torch

from visppo.config import TrainConfig
from visppo.errors import ConfigError
from visppo.precision import Precision, acting_precision, autocast_dtype, for_run, resolve_precision

CPU = torch.device("cpu")


def test_resolve_precision_on_the_cpu():
    assert resolve_precision("off", CPU).dtype is None
    assert resolve_precision("bf16", CPU).dtype == torch.bfloat16
    assert resolve_precision("auto", CPU).dtype is None  # fp32 on every CPU, native bf16 or not
    assert resolve_precision("bf16", CPU).scaler is None
    with pytest.raises(ConfigError, match="fp16 needs a CUDA device"):
        resolve_precision("fp16", CPU)


@pytest.mark.parametrize("capability, dtype", [((7, 5), torch.float16), ((8, 0), torch.bfloat16),
                                               ((9, 0), torch.bfloat16)])
def test_auto_on_a_gpu_is_bf16_where_the_card_has_bf16_units_and_fp16_before_them(monkeypatch, capability, dtype):
    """A T4 or V100 runs bf16 only emulated (torch's is_bf16_supported() says yes all the same):
    auto is fp16 there, asked of the device given (a torchrun rank's), not the current one."""
    asked = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: asked.append(device) or capability)
    assert autocast_dtype("auto", torch.device("cuda", 1)) == dtype
    assert asked == [torch.device("cuda", 1)]


def test_acting_on_the_train_device_uses_the_update_precision():
    run = for_run(TrainConfig(amp="bf16"), CPU, CPU)
    assert run.acting is run.update and not run.recompute_logp_old


def test_fp16_training_with_cpu_acting_recomputes_logp_old_in_the_update_precision():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # GradScaler on a machine without CUDA
        run = for_run(TrainConfig(amp="fp16"), torch.device("cuda"), CPU)
    assert run.update.dtype == torch.float16
    assert run.acting.dtype == autocast_dtype("auto", CPU) and run.acting.scaler is None
    assert run.recompute_logp_old  # logp_old must come from the function the ratio divides by


def test_bf16_acting_on_another_device_recomputes_logp_old_and_fp32_does_not():
    """Two devices' bf16 kernels round differently; fp32 ones differ by float rounding alone."""
    from visppo.precision import Precision, RunPrecision

    gpu = torch.device("cuda")
    assert RunPrecision(Precision(gpu, torch.bfloat16), Precision(CPU, torch.bfloat16), False).recompute_logp_old
    assert not RunPrecision(Precision(gpu, None), Precision(CPU, None), False).recompute_logp_old
    assert not RunPrecision(Precision(CPU, torch.bfloat16), Precision(CPU, torch.bfloat16), False).recompute_logp_old


def test_acting_precision_never_asks_for_fp16_off_cuda():
    assert acting_precision("fp16", CPU).dtype == autocast_dtype("auto", CPU)
    assert acting_precision("off", CPU).dtype is None


def test_channels_last_is_decided_with_the_precision():
    assert for_run(TrainConfig(channels_last=False), CPU, CPU).channels_last is False
    assert for_run(TrainConfig(), CPU, CPU).channels_last is True


@pytest.mark.parametrize("device, dtype", [("cpu", torch.bfloat16), ("cuda", torch.bfloat16),
                                           ("cuda", torch.float16)])
def test_autocast_runs_in_the_dtype_the_precision_names(device, dtype):
    """Kills: Precision.autocast() omitting dtype= (CUDA's autocast default is fp16: a bf16 run on an
    Ampere+ GPU would silently train in fp16 without a GradScaler)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch.autocast("cuda") on a machine without CUDA
        ctx = Precision(torch.device(device), dtype).autocast()
    assert ctx.fast_dtype == dtype
