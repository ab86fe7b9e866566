import pytest
import torch
from conftest import tiny_overrides

from visppo.bench import CLEARLY_FASTER, bench_devices, format_devices, placement
from visppo.config import load_config


def test_bench_devices_times_each_device_and_recommends_a_placement():
    cfg = load_config(None, tiny_overrides())
    result = bench_devices(cfg, repeats=1)
    devices = [r["device"] for r in result["rows"]]
    assert devices == ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
    assert all(r["act_seconds"] > 0 and r["update_seconds"] > 0 for r in result["rows"])
    if not torch.cuda.is_available():
        assert result["train.device"] == result["rollout.device"] == "cpu"
    text = format_devices(result)
    assert "recommended: train.device=" in text


@pytest.mark.parametrize("amp", ["auto", "fp16"])
def test_bench_devices_resolves_an_auto_micro_batch_as_training_does(amp):
    """memory.micro_batch_size=auto: the probe's size for memory.budget on each device (fake mode,
    as `visppo train` asks it), not a ValueError; in the precision each row is timed in (fp16's
    CPU row is the CPU's own choice, not a ConfigError)."""
    from visppo.probe import probe

    auto = {"memory.micro_batch_size": "auto", "memory.budget": "10MiB", "ppo.minibatch_size": 64, "train.amp": amp}
    cfg = load_config(None, tiny_overrides(**auto))
    [row] = [r for r in bench_devices(cfg, repeats=1)["rows"] if r["device"] == "cpu"]
    cpu_cfg = load_config(None, tiny_overrides(**{**auto, "train.amp": "auto"}))
    expected = probe(cpu_cfg, cfg.memory.budget, "cpu", mode="fake").micro_batch_size
    assert row["micro_batch"] == expected and 0 < expected < cfg.ppo.minibatch_size


def _row(device: str, act: float, update: float, micro: int) -> dict:
    return {"device": device, "act_seconds": act, "update_seconds": update, "micro_batch": micro}


@pytest.mark.parametrize("gpu_update,gpu_micro,gpu_act,expected", [
    (1.0, 64, 0.5, ("cpu", "cuda")),                          # the same speed per sample: not clearly faster
    (1.0 / CLEARLY_FASTER, 64, 2.0, ("cuda", "cpu")),        # clearly faster updates; slower acting
    (1.0, 64 * CLEARLY_FASTER, 1.0, ("cuda", "cpu")),        # per sample: a bigger micro-batch in the same time
    (1.0 / CLEARLY_FASTER * 1.01, 64, 0.99, ("cpu", "cuda")),  # just short of clearly faster
])
def test_placement_compares_updates_per_sample_and_acting_per_pass(gpu_update, gpu_micro, gpu_act, expected):
    rows = [_row("cpu", 1.0, 1.0, 64), _row("cuda", gpu_act, gpu_update, int(gpu_micro))]
    assert placement(rows) == expected
    assert placement(rows[:1]) == ("cpu", "cpu")
