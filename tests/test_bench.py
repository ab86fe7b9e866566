import torch
from conftest import tiny_overrides

from visppo.bench import bench_devices, format_devices
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


def test_bench_devices_resolves_an_auto_micro_batch_as_training_does():
    """memory.micro_batch_size=auto: the probe's size for memory.budget on each device (fake mode,
    as `visppo train` asks it), not a ValueError."""
    from visppo.probe import probe

    auto = {"memory.micro_batch_size": "auto", "memory.budget": "10MiB", "ppo.minibatch_size": 64}
    cfg = load_config(None, tiny_overrides(**auto))
    [row] = [r for r in bench_devices(cfg, repeats=1)["rows"] if r["device"] == "cpu"]
    expected = probe(cfg, cfg.memory.budget, "cpu", mode="fake").micro_batch_size
    assert row["micro_batch"] == expected and 0 < expected < cfg.ppo.minibatch_size
