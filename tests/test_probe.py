import json

import pytest
import torch
from conftest import infer_with, tiny_overrides, update_with

from visppo.cli import main
from visppo.config import PPOConfig, load_config
from visppo.probe import Prober, probe


def test_fake_mode_estimate_matches_real_cpu_measurement():
    """The fake-tensor estimate (nothing allocated) agrees with live bytes of the real step."""
    cfg = load_config(None, tiny_overrides(**{"env.image_size": 64, "train.channels_last": "false"}))
    fake = Prober(cfg, torch.device("cpu"), "fake")
    real = Prober(cfg, torch.device("cpu"), "real")
    for kind, size in (("micro_batch", 32), ("infer_chunk", 64)):
        f, r = fake.activations(kind, size), real.activations(kind, size)
        assert r > 0 and abs(f - r) / r < 0.25, (kind, f, r)
    # activations grow with the size; parameters etc. do not
    assert fake.activations("micro_batch", 64) > 1.5 * fake.activations("micro_batch", 16)


def test_search_returns_the_largest_size_under_the_limit():
    cfg = load_config(None, tiny_overrides(**{"ppo.num_steps": 64, "ppo.minibatch_size": 128}))
    prober = Prober(cfg, torch.device("cpu"), "fake")
    static = sum(prober.static.values())
    limit_budget = static + prober.activations("micro_batch", 40)  # somewhere between 32 and 64
    result = probe(cfg, int(limit_budget / 0.9) + 1, "cpu", "fake", margin=0.10)
    micro = result.micro_batch_size
    assert 32 <= micro < 64
    by_size = {c.size: c for c in result.candidates if c.kind == "micro_batch"}
    assert by_size[micro].fits and by_size[micro].peak_bytes <= result.limit_bytes
    assert not by_size[micro + 1].fits  # bisection pinned the boundary exactly
    assert set(result.breakdown) == {"parameters", "gradients", "optimizer_state", "buffer",
                                     "activations", "runtime_overhead"}


def test_cuda_target_in_fake_mode_adds_runtime_overhead_and_uses_bf16():
    cfg = load_config(None, tiny_overrides(**{"train.amp": "auto"}))
    result = probe(cfg, "8GiB", "cuda", "fake")
    assert result.mode == "fake" and result.amp == "bf16"
    assert result.breakdown["runtime_overhead"] > 0
    assert result.micro_batch_size == cfg.ppo.minibatch_size  # tiny model: everything fits


def test_buffer_on_device_reports_the_largest_rollout():
    cfg = load_config(None, tiny_overrides(**{"memory.buffer_device": "device"}))
    result = probe(cfg, "1GiB", "cpu", "fake")
    assert result.rollout_steps and result.rollout_steps > cfg.ppo.num_steps
    assert any(c.kind == "rollout" for c in result.candidates)


def test_probe_cli_writes_json_plot_and_config(tmp_path, capsys):
    out = tmp_path / "p.json"
    code = main(["probe", *tiny_overrides(), "--budget", "2GiB", "--device", "cpu", "--mode", "fake",
                 "--json", str(out), "--plot", str(tmp_path / "p.png"), "--write-config", str(tmp_path / "c.yaml")])
    assert code == 0
    data = json.loads(out.read_text())
    assert {"budget_bytes", "micro_batch_size", "infer_chunk_size", "peak_bytes", "breakdown",
            "candidates"} <= data.keys()
    assert all({"kind", "size", "peak_bytes", "fits"} <= c.keys() for c in data["candidates"])
    assert (tmp_path / "p.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    cfg = load_config(tmp_path / "c.yaml")
    assert cfg.memory.micro_batch_size == data["micro_batch_size"]
    assert "memory.micro_batch_size=" in capsys.readouterr().out


def test_probe_refuses_real_mode_without_the_device(capsys):
    if torch.cuda.is_available():
        pytest.skip("CUDA present")
    assert main(["probe", "--device", "cuda", "--mode", "real"]) == 2
    assert capsys.readouterr().err.startswith("error: --mode real needs")


@pytest.mark.parametrize("encoder", ["nature", "impala"])
@pytest.mark.parametrize("amp", ["off", "bf16"])
def test_fake_estimate_within_10_percent_of_real_for_encoders_amp_and_sizes(encoder, amp):
    cfg = load_config(None, tiny_overrides(**{"model.encoder": encoder, "train.amp": amp, "env.image_size": 64}))
    fake = Prober(cfg, torch.device("cpu"), "fake")
    real = Prober(cfg, torch.device("cpu"), "real")
    for size in (8, 32):
        f, r = fake.activations("micro_batch", size), real.activations("micro_batch", size)
        assert abs(f - r) <= 0.10 * r, (encoder, amp, size, f, r)


def _update_peak(minibatch: int, micro: int, rollout: int = 256) -> int:
    from test_ppo import _setup

    from visppo.memory import peak_bytes

    policy, buf = _setup(T=rollout // 4, N=4)
    opt = torch.optim.Adam(policy.parameters(), lr=1e-4)
    cfg = PPOConfig(num_epochs=1, minibatch_size=minibatch)
    cpu = torch.device("cpu")
    update_with(policy, opt, buf, cfg, micro, 16, torch.Generator().manual_seed(0))  # Adam state
    return peak_bytes(lambda: update_with(policy, opt, buf, cfg, micro, 16,
                                     torch.Generator().manual_seed(1)), cpu)


def test_update_peak_does_not_grow_with_the_minibatch_at_a_fixed_micro_batch():
    small, large = _update_peak(16, 16), _update_peak(256, 16)
    assert large <= 1.1 * small, (small, large)
    assert _update_peak(256, 256) > 3 * small  # the meter does see activations grow


def test_chunked_no_grad_pass_peak_does_not_grow_with_the_rollout():
    from test_ppo import _setup

    from visppo.memory import peak_bytes

    cpu = torch.device("cpu")
    peaks = []
    for rollout in (64, 256):
        policy, buf = _setup(T=rollout // 4, N=4)
        flat = {k: buf.flat(v) for k, v in buf.obs.items()}
        actions = buf.flat(buf.actions)
        peaks.append(peak_bytes(lambda: infer_with(policy, flat, actions, 16), cpu))
    # the outputs (one float per sample) are the only part that grows: 2 x 4 bytes x 192 samples
    assert peaks[1] - peaks[0] <= 2 * 4 * 192 + 4096, peaks
