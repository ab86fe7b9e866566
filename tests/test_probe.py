import json

import pytest
import torch
from conftest import infer_with, tiny_overrides, update_with

from visppo.buffer import RolloutBuffer
from visppo.cli import main
from visppo.config import PPOConfig, load_config
from visppo.errors import ConfigError
from visppo.policy import ActorCritic
from visppo.probe import Prober, probe


def test_fake_mode_estimate_matches_real_cpu_measurement():
    """The fake-tensor estimate (nothing allocated) agrees with live bytes of the real step."""
    cfg = load_config(None, tiny_overrides(**{"env.image_size": 64, "train.channels_last": "false"}))
    fake = Prober(cfg, torch.device("cpu"), "fake")
    real = Prober(cfg, torch.device("cpu"), "real")
    for kind, size in (("micro_batch", 16), ("micro_batch", 32), ("infer_chunk", 64)):
        f, r = fake.activations(kind, size), real.activations(kind, size)
        assert r > 0 and abs(f - r) <= 0.01 * r, (kind, f, r)  # the same counter on fakes and real tensors
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
                                     "activations", "conv_workspace"}
    assert set(result.breakdown) <= set(result.sources)  # every line says where its figure comes from


@pytest.mark.parametrize("amp,device,margin", [("off", "cuda", 0.25), ("bf16", "cuda", 0.10),
                                               ("off", "cpu", 0.10)])
def test_default_margin_keeps_a_quarter_free_for_fp32_on_a_gpu(amp, device, margin):
    """fp32 on an H100 used up to 24% more than estimated (allocator fragmentation), AMP within 11%."""
    cfg = load_config(None, tiny_overrides(**{"train.amp": amp}))
    result = probe(cfg, "2GiB", device, "fake")
    assert result.limit_bytes == int(2 * 2**30 * (1 - margin))
    assert probe(cfg, "2GiB", device, "fake", margin=0.5).limit_bytes == 2**30  # an explicit one wins


def test_cuda_target_in_fake_mode_adds_named_gpu_lines_and_uses_bf16():
    from visppo.probe import CUDA_CONTEXT_DEFAULT

    cfg = load_config(None, tiny_overrides(**{"train.amp": "auto"}))
    result = probe(cfg, "8GiB", "cuda", "fake", world_size=2)
    assert result.mode == "fake" and result.amp == "bf16"
    b = result.breakdown
    if not torch.cuda.is_available():
        assert b["cuda_context"] == CUDA_CONTEXT_DEFAULT
    assert b["cublas_workspace"] > 0 and b["cudnn_workspace"] > 0 and b["allocator_rounding"] > 0
    # world_size 2: the all-reduce's flat fp32 gradient copy, beyond what the pass's transients already hold
    flat = 4 * sum(p.numel() for p in Prober(cfg, torch.device("cuda"), "fake").trainable)
    assert b["allreduce_buffer"] == max(0, flat - b["activations"] - b["cudnn_workspace"])
    assert "conv_workspace" not in b  # the CPU kernel's model does not apply to a GPU
    assert set(b) <= set(result.sources)
    assert result.micro_batch_size == cfg.ppo.minibatch_size  # tiny model: everything fits


def test_buffer_on_device_reports_the_largest_rollout():
    cfg = load_config(None, tiny_overrides(**{"memory.buffer_device": "device"}))
    result = probe(cfg, "1GiB", "cpu", "fake")
    assert result.rollout_steps and result.rollout_steps > cfg.ppo.num_steps
    assert any(c.kind == "rollout" for c in result.candidates)


def test_probe_cli_writes_json_plot_and_config(tmp_path, capsys):
    """Each output whole, in folders made for it (as the other commands' outputs)."""
    out = tmp_path / "p.json"
    code = main(["probe", *tiny_overrides(), "--budget", "2GiB", "--device", "cpu", "--mode", "fake",
                 "--json", str(out), "--plot", str(tmp_path / "plots" / "p.png"),
                 "--write-config", str(tmp_path / "c.yaml")])
    assert code == 0
    assert sorted(p.name for p in tmp_path.rglob("*")) == ["c.yaml", "p.json", "p.png", "plots"]
    data = json.loads(out.read_text())
    assert {"budget_bytes", "micro_batch_size", "infer_chunk_size", "peak_bytes", "breakdown",
            "candidates"} <= data.keys()
    assert all({"kind", "size", "peak_bytes", "fits"} <= c.keys() for c in data["candidates"])
    assert (tmp_path / "plots" / "p.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
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
        assert abs(f - r) <= 0.02 * r, (encoder, amp, size, f, r)


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


# --------------------------------------------------------------------------- each byte counted once


def _adam_state_bytes(opt: torch.optim.Optimizer) -> int:
    return sum(v.numel() * v.element_size() for st in opt.state.values() for v in st.values()
               if isinstance(v, torch.Tensor))


@pytest.mark.parametrize("model", [{}, {"model.encoder": "resnet18", "model.resize": 32}], ids=["nature", "resnet18"])
def test_static_lines_equal_the_bytes_of_a_real_model_its_gradients_and_adam_state(model):
    """parameters, gradients and optimizer_state are exactly what training allocates for them; the
    parameters line holds the model's buffers too (ResNet's BatchNorm statistics)."""
    from visppo.builders import build_optimizer, build_policy

    cfg = load_config(None, tiny_overrides(**model))
    prober = Prober(cfg, torch.device("cpu"), "fake")
    policy = build_policy(cfg, prober.obs_space, prober.action_space, torch.device("cpu"), load_weights=False)
    opt = build_optimizer(cfg, policy)
    for p in policy.parameters():
        p.grad = torch.ones_like(p)
    opt.step()
    held = [*policy.parameters(), *policy.buffers()]  # non-persistent buffers too: not in the state dict
    assert prober.static["parameters"] == sum(v.numel() * v.element_size() for v in held)
    assert any(name.endswith("running_var") for name, _ in policy.named_buffers()) == bool(model)
    assert prober.static["gradients"] == sum(p.grad.numel() * p.grad.element_size() for p in policy.parameters())
    assert prober.static["optimizer_state"] == _adam_state_bytes(opt)


def test_a_trunk_frozen_for_good_is_probed_as_training_freezes_it():
    """model.encoder_lr_scale=0 freezes the trunk for the whole run (visppo.loop's FreezeSchedule): no
    gradient, no Adam state and no backward through it. The probe's static lines equal what such an
    update leaves, its fake pass matches a real one, and the pass is lighter than a trained trunk's."""
    import math

    from visppo.builders import build_optimizer, build_policy
    from visppo.encoders import FreezeSchedule

    model = {"model.encoder": "resnet18", "model.resize": 32}
    cfg = load_config(None, tiny_overrides(**model, **{"model.encoder_lr_scale": 0}))
    prober = Prober(cfg, torch.device("cpu"), "fake")
    policy = build_policy(cfg, prober.obs_space, prober.action_space, torch.device("cpu"), load_weights=False)
    opt = build_optimizer(cfg, policy)
    buf = RolloutBuffer(8, 2, prober.obs_space, prober.action_space)
    buf.advantages.normal_(generator=torch.Generator().manual_seed(0))
    ppo_cfg = PPOConfig(num_epochs=1, minibatch_size=16)
    update_with(policy, opt, buf, ppo_cfg, 8, 16, torch.Generator().manual_seed(0),
                before_step=FreezeSchedule(policy.encoders(), math.inf, opt))
    assert all(p.grad is None for p in policy.trunk_parameters())
    assert prober.static["gradients"] == sum(p.grad.numel() * p.grad.element_size()
                                             for p in policy.parameters() if p.grad is not None)
    assert prober.static["optimizer_state"] == _adam_state_bytes(opt)
    real = Prober(cfg, torch.device("cpu"), "real")
    f, r = prober.activations("micro_batch", 16), real.activations("micro_batch", 16)
    assert abs(f - r) <= 0.02 * r, (f, r)
    trained = Prober(load_config(None, tiny_overrides(**model, **{"model.encoder_lr_scale": 0.1})), torch.device("cpu"), "fake")
    assert f < trained.activations("micro_batch", 16) and prober.static["gradients"] < trained.static["gradients"]


def test_gradients_are_counted_once_in_a_single_pass_and_in_an_accumulating_one():
    """The measured part holds no gradient bytes: a pass that allocates them (the whole minibatch at
    once) has them taken out, and a later micro-batch starts with them allocated."""
    cfg = load_config(None, tiny_overrides(**{"ppo.minibatch_size": 32}))
    prober = Prober(cfg, torch.device("cpu"), "real")
    whole = prober._pass("micro_batch", 32)["activations"]  # one pass: grads born inside it

    from visppo.memory import LiveBytes
    from visppo.precision import Precision
    from visppo.probe import _backward_pass

    buf = RolloutBuffer(32, 1, prober.obs_space, prober.action_space, channels_last=cfg.train.channels_last)
    prober.policy.zero_grad(set_to_none=True)
    index, adv, precision = torch.arange(32), torch.zeros(32), Precision(torch.device("cpu"), None)
    with LiveBytes() as meter:
        _backward_pass(prober.policy, buf, index, adv, cfg, torch.device("cpu"), precision)
    grads = sum(p.grad.numel() * p.grad.element_size() for p in prober.trainable)
    assert meter.current >= grads  # what stays after the pass is the gradients (and nothing big else)
    assert whole == meter.peak - prober.static["gradients"]
    prober.policy.zero_grad(set_to_none=True)
    # accumulating at 16 of 32: the gradients exist before; the pass adds its activations and the
    # temporary gradients, and is no larger than the first pass's peak plus the gradients
    acc = Prober(load_config(None, tiny_overrides(**{"ppo.minibatch_size": 64})), torch.device("cpu"), "real")
    later = acc._pass("micro_batch", 32)["activations"]
    assert later <= whole + grads
    assert later >= whole  # the same activations, plus each temporary gradient before it is added in


def test_breakdown_sums_to_the_peak_with_every_line_once():
    cfg = load_config(None, tiny_overrides(**{"memory.buffer_device": "device"}))
    prober = Prober(cfg, torch.device("cuda"), "fake")
    cand = prober.measure("micro_batch", 16, 2**62)
    assert cand.peak_bytes == sum(cand.breakdown.values())
    assert cand.breakdown["buffer"] == prober.buffer_bytes_per_sample * cfg.rollout_size
    assert list(cand.breakdown).count("gradients") == 1


def test_cuda_context_is_measured_once_per_gpu_name_and_cached(tmp_path, monkeypatch):
    import visppo.probe as probe_mod

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda d=None: "Fake GPU 8GB")
    calls = []

    def measure(device):
        calls.append(device)
        return 123 * 2**20
    a = probe_mod.cuda_context_bytes(torch.device("cuda"), measure)
    b = probe_mod.cuda_context_bytes(torch.device("cuda"), measure)
    assert a[0] == b[0] == 123 * 2**20 and len(calls) == 1
    assert "measured now" in a[1] and "measured earlier" in b[1]
    assert json.loads((tmp_path / "visppo" / "cuda_context.json").read_text()) == {"Fake GPU 8GB": 123 * 2**20}


def test_an_implausible_cuda_context_is_not_cached(tmp_path, monkeypatch):
    """A GPU shared with another process reads its memory as context: warn and measure again next time."""
    import visppo.probe as probe_mod

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda d=None: "Fake GPU 8GB")
    busy = probe_mod.CUDA_CONTEXT_PLAUSIBLE_MAX + 1
    with pytest.warns(UserWarning, match="another process"):
        value, source = probe_mod.cuda_context_bytes(torch.device("cuda"), lambda d: busy)
    assert value == busy and "not cached" in source
    assert not (tmp_path / "visppo" / "cuda_context.json").exists()
    assert probe_mod.cuda_context_bytes(torch.device("cuda"), lambda d: 700 * 2**20)[0] == 700 * 2**20


def test_cublas_workspace_follows_the_environment(monkeypatch):
    from visppo.probe import CUBLAS_WORKSPACE, cublas_workspace_bytes

    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", ":4096:2:16:8")
    assert cublas_workspace_bytes(torch.device("cuda"))[0] == CUBLAS_WORKSPACE["older"]
    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG")
    if not torch.cuda.is_available():
        assert cublas_workspace_bytes(torch.device("cuda"))[0] == CUBLAS_WORKSPACE["sm90+"]


def test_cuda_block_size_rounds_like_the_caching_allocator():
    from visppo.memory import cuda_block_size

    assert cuda_block_size(1) == 512 and cuda_block_size(512) == 512 and cuda_block_size(513) == 1024
    assert cuda_block_size(5 * 2**20 + 1) == 5 * 2**20 + 512  # carved from a shared 20 MiB segment
    assert cuda_block_size(11 * 2**20) == 12 * 2**20  # its own segment, in 2 MiB steps


# --------------------------------------------------------------------------- what kernels hold inside an op


def _conv_args(dtype: torch.dtype) -> tuple:
    x = torch.zeros(4, 16, 32, 32, dtype=dtype)
    w = torch.zeros(32, 16, 3, 3, dtype=dtype)
    return (x, w, None, [1, 1], [1, 1], [1, 1], False, [0, 0], 1)


def test_kernel_workspace_holds_the_im2col_columns_of_the_slow_cpu_convolution():
    """bf16 on the CPU runs PyTorch's slow convolution, whose im2col columns (N x C*kh*kw x oH*oW)
    exist only inside the op: a dispatch-level meter misses them, the measurement must not."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from visppo.probe import KernelWorkspace

    args = _conv_args(torch.bfloat16)
    backend = torch._C._select_conv_backend(*args[:2], None, *args[3:], None)
    if backend != torch._C._ConvBackend.Slow2d:
        pytest.skip(f"this CPU runs bf16 convolutions with {backend}")
    conv = torch.ops.aten.convolution.default
    columns = 4 * (16 * 3 * 3) * (32 * 32) * 2
    workspace = KernelWorkspace()
    assert workspace(conv, args, {}) == columns
    with FakeTensorMode() as mode:  # fakes of the same shapes: the same figure, measured on real tensors
        fake_args = (mode.from_tensor(args[0]), mode.from_tensor(args[1]), *args[2:])
        assert KernelWorkspace()(conv, fake_args, {}) == columns
    assert workspace(torch.ops.aten.relu.default, (args[0],), {}) == 0  # only convolutions are measured


def test_kernel_workspace_is_measured_once_per_signature(monkeypatch):
    from visppo.probe import KernelWorkspace

    workspace, calls = KernelWorkspace(), []
    monkeypatch.setattr(KernelWorkspace, "_measure", staticmethod(lambda *a: calls.append(a) or 7))
    conv = torch.ops.aten.convolution.default
    assert workspace(conv, _conv_args(torch.float32), {}) == workspace(conv, _conv_args(torch.float32), {}) == 7
    assert len(calls) == 1
    workspace(conv, _conv_args(torch.bfloat16), {})  # another dtype: another kernel, measured again
    assert len(calls) == 2


def test_conv_workspace_line_adds_what_the_kernels_hold_at_the_peak(monkeypatch):
    """A CPU pass's peak is the live tensors' plus what a convolution holds inside at that moment.
    Each convolution is said to hold ``HIDDEN`` bytes (far more than the pass's tensors): the line
    is then ``HIDDEN`` plus the live bytes at the busiest convolution, minus the pass's own peak,
    whatever this CPU's kernels really allocate; the activations line stays the meter's peak."""
    from visppo.probe import KernelWorkspace

    hidden = 2**40
    cfg = load_config(None, tiny_overrides(**{"env.image_size": 48, "train.amp": "bf16"}))

    def pass_with(workspace: int, kind: str) -> tuple[dict[str, int], Prober]:
        monkeypatch.setattr(KernelWorkspace, "_measure", staticmethod(lambda *a: workspace))
        prober = Prober(cfg, torch.device("cpu"), "fake")
        return prober._pass(kind, 16), prober

    for kind in ("infer_chunk", "micro_batch"):
        lines, prober = pass_with(hidden, kind)
        assert hidden - lines["activations"] - prober.static["gradients"] < lines["conv_workspace"] <= hidden, kind
        assert pass_with(0, kind)[0] == {**lines, "conv_workspace": 0}


def test_conv_workspace_line_is_what_this_cpus_kernels_really_allocate():
    """Measured for real (oneDNN's choices differ between CPUs: on one of ours a bf16 forward
    reorders its weights, on another it allocates nothing): the line is what a convolution's
    workspace adds above the pass's peak, so zero when none allocated, never more than the largest
    measured, and zero when the busiest convolution holds less than the peak's margin (an AVX-512
    CPU measured 49 kB inside convolutions that run below the peak); the same on a second pass.
    The arithmetic with a workspace that must show is tested with a stand-in figure above."""
    cfg = load_config(None, tiny_overrides(**{"env.image_size": 48, "train.amp": "bf16"}))
    prober = Prober(cfg, torch.device("cpu"), "fake")
    lines = prober._pass("infer_chunk", 16)
    measured = list(prober.kernel_workspace.cache.values())
    assert measured, "the pass's convolutions were measured"
    assert 0 <= lines["conv_workspace"] <= max(measured)  # so 0 when no convolution allocated
    assert prober._pass("infer_chunk", 16) == lines  # deterministic (cached per signature)


def test_allreduce_line_is_the_flat_buffer_torchrun_really_builds(monkeypatch):
    """The per-minibatch all-reduce (visppo.distributed.reduce_minibatch) is run with its collective
    replaced: the tensor it hands over is the flat gradient copy the probe's line counts (plus the
    few statistics), so a change of its dtype or content would fail here."""
    from visppo import distributed

    cfg = load_config(None, tiny_overrides())
    prober = Prober(cfg, torch.device("cpu"), "real", world_size=2)
    handed = []
    monkeypatch.setattr(torch.distributed, "all_reduce", lambda t, *a, **k: handed.append(t.nbytes))
    monkeypatch.setattr(torch.distributed, "get_world_size", lambda *a: 2)
    monkeypatch.setattr(torch.distributed, "get_backend", lambda *a: "gloo")
    for p in prober.trainable:
        p.grad = torch.ones_like(p)
    stats = {"policy_loss": 1.0, "value_loss": 2.0}
    distributed.reduce_minibatch(prober.trainable, stats, failed=False)
    assert handed == [prober.allreduce_bytes + 4 * (len(stats) + 1)]
    lines = prober._pass("infer_chunk", 8)
    transient = lines["activations"] + lines["conv_workspace"]
    assert lines["allreduce_buffer"] == max(0, prober.allreduce_bytes - transient)
    assert Prober(cfg, torch.device("cpu"), "real").allreduce_bytes == 0  # one process: no such buffer


def test_kernel_workspace_under_a_users_profiler_warns_and_counts_nothing():
    from torch.profiler import profile

    cfg = load_config(None, tiny_overrides(**{"env.image_size": 48, "train.amp": "bf16"}))
    prober = Prober(cfg, torch.device("cpu"), "fake")  # measured, this pass's line is > 0 (the test above)
    with profile(), pytest.warns(RuntimeWarning, match="conv_workspace not measured"):
        assert prober._pass("infer_chunk", 16)["conv_workspace"] == 0
    assert "not measured" in prober.sources["conv_workspace"]


def test_real_mode_on_a_gpu_caps_the_allocator_of_an_indexed_device(monkeypatch):
    """``set_per_process_memory_fraction`` refuses a device without an index (ValueError), and
    ``--device cuda`` gives none: the cap goes to the current GPU. The cap leaves the allocator the
    budget less the CUDA context, which a card of the budget's size holds too. (CUDA faked: the
    probe stops at the model, after the cap.)"""
    from types import SimpleNamespace

    from torch.cuda._utils import _get_device_index

    import visppo.probe as probe_mod

    caps, contexts = [], []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)
    # measuring the context builds layers: it draws from the RNG, which the probe must leave as it was
    monkeypatch.setattr(probe_mod, "cuda_context_bytes",
                        lambda device: contexts.append(device) or torch.randn(1) and (2**30, "stub"))
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda d=None: SimpleNamespace(total_memory=80 * 2**30))
    monkeypatch.setattr(torch.cuda, "set_per_process_memory_fraction",
                        lambda fraction, device=None: caps.append((fraction, _get_device_index(device))))
    kept = []  # the probe keeps the target GPU's RNG state as it found it
    monkeypatch.setattr(torch.cuda, "get_rng_state", lambda device="cuda": kept.append(device) or torch.zeros(1))
    monkeypatch.setattr(torch.cuda, "set_rng_state", lambda state, device="cuda": None)

    class ModelBuilt(Exception):
        pass

    def stop(*args, **kwargs):
        raise ModelBuilt

    monkeypatch.setattr(probe_mod, "Prober", stop)
    rng = torch.random.get_rng_state()
    with pytest.raises(ModelBuilt):
        probe(load_config(None, tiny_overrides()), "8GiB", "cuda", mode="real")
    assert caps == [(7 / 80, 3)] and kept == [3] and contexts == [torch.device("cuda", 3)]
    assert torch.equal(torch.random.get_rng_state(), rng)
    probe_mod.emulate_smaller_card(8 * 2**30, torch.device("cuda", 1))  # an index given is kept
    probe_mod.emulate_smaller_card(80 * 2**30, torch.device("cuda"))  # the whole card: no cap
    assert caps == [(7 / 80, 3), (7 / 80, 1)]
    with pytest.raises(ConfigError, match="nothing beside the CUDA context"):
        probe_mod.emulate_smaller_card(2**30, torch.device("cuda"))


def test_a_cap_leaves_the_allocator_the_budget_less_the_context():
    import visppo.probe as probe_mod

    gib = 2**30
    assert probe_mod.cap_fraction(3 * gib, gib, 80 * gib) == pytest.approx(2 / 80)
    assert probe_mod.cap_fraction(100 * gib, gib, 80 * gib) == 1.0  # more than the card: no cap
    with pytest.raises(ValueError, match="nothing beside the CUDA context"):
        probe_mod.cap_fraction(gib, gib, 80 * gib)


def _out_of_memory_above(samples: int, monkeypatch) -> None:
    """Every policy's forward raises out-of-memory on more than ``samples`` samples."""
    real = ActorCritic.score_actions

    def score_actions(self, obs, actions):
        if len(actions) > samples:
            raise torch.OutOfMemoryError(f"out of memory: {len(actions)} samples (test)")
        return real(self, obs, actions)

    monkeypatch.setattr(ActorCritic, "score_actions", score_actions)


@pytest.mark.parametrize("kind, too_big, size_field", [
    ("infer_chunk", 32, "infer_chunk_size"), ("micro_batch", 16, "micro_batch_size")])
def test_real_mode_a_size_that_runs_out_of_memory_does_not_fit(monkeypatch, kind, too_big, size_field):
    """The measured pass must not back off (halve and retry, as training's does): the retry at a
    smaller size would report the size that ran out of memory as fitting. On the CPU as on a GPU,
    out-of-memory in the measured pass means "does not fit", not a crash."""
    _out_of_memory_above(8, monkeypatch)
    cfg = load_config(None, tiny_overrides())
    prober = Prober(cfg, torch.device("cpu"), "real")
    assert not prober.measure(kind, too_big, 2**62).fits
    assert prober.measure(kind, 8, 2**62).fits
    assert getattr(probe(cfg, "64GiB", "cpu", "real"), size_field) == 8


def test_allreduce_line_is_the_flat_gradient_copy_when_parameters_outweigh_the_pass():
    """A wide model on tiny frames, one sample per pass: the all-reduce's flat fp32 copy of the
    gradients (4 B per trainable parameter, counted here from a model built apart from the probe)
    is far above the pass's transients, so the line is that copy less those transients, and > 0."""
    from visppo.builders import build_policy
    from visppo.envs import make_env

    cfg = load_config(None, tiny_overrides(**{"env.image_size": 16, "model.hidden_dim": 1024, "model.shared_layers": 2,
                                              "ppo.minibatch_size": 2}))
    env = make_env(cfg)
    model = build_policy(cfg, env.observation_space, env.action_space, torch.device("cpu"), load_weights=False)
    env.close()
    flat = 4 * sum(p.numel() for p in model.parameters() if p.requires_grad)
    prober = Prober(cfg, torch.device("cpu"), "fake", world_size=2)
    for kind, size in (("infer_chunk", 1), ("micro_batch", 1), ("micro_batch", 2)):
        lines = prober._pass(kind, size)
        transient = lines["activations"] + lines["conv_workspace"]
        assert transient < flat / 2, (kind, size, lines)  # the config does what it is for
        assert lines["allreduce_buffer"] == flat - transient > 0, (kind, size, lines)


@pytest.mark.parametrize("mode", ["fake", "real"])
def test_probe_leaves_the_callers_rng_as_it_found_it(mode):
    """A run asks the probe for its `auto` sizes after seeding: the probe's own policy must not
    move the run's random stream (tests/test_train.py checks the trained parameters)."""
    cfg = load_config(None, tiny_overrides())
    torch.manual_seed(0)
    before = torch.get_rng_state()
    probe(cfg, "1GiB", "cpu", mode)
    assert torch.equal(torch.get_rng_state(), before)


def _stepped_measure(whole_peak: int):
    """A stand-in for Prober.measure: accumulating micro-batches cost 1000 + size bytes, the whole
    minibatch (32) ``whole_peak`` (no gradients held while its activations live); chunks 10 x their size."""
    from visppo.probe import Candidate

    def measure(self, kind, size, limit):
        peak = (whole_peak if size == 32 else 1000 + size) if kind == "micro_batch" else 10 * size
        return Candidate(kind, size, peak, peak <= limit, {"activations": peak})
    return measure


@pytest.mark.parametrize("whole_peak, budget, micro", [(500, 900, 32), (500, 1020, 32), (2000, 1010, 10)])
def test_the_whole_minibatch_is_tried_on_its_own_as_it_can_fit_where_smaller_sizes_do_not(
        monkeypatch, whole_peak, budget, micro):
    monkeypatch.setattr(Prober, "measure", _stepped_measure(whole_peak))
    cfg = load_config(None, tiny_overrides(**{"ppo.num_steps": 64, "ppo.minibatch_size": 32}))
    assert probe(cfg, budget, "cpu", "fake", margin=0.0).micro_batch_size == micro


@pytest.mark.parametrize("amp, hint", [("off", "AMP"), ("bf16", None)])
def test_nothing_fits_names_what_did_not_and_suggests_amp_only_when_it_is_off(monkeypatch, amp, hint):
    monkeypatch.setattr(Prober, "measure", _stepped_measure(2000))
    cfg = load_config(None, tiny_overrides(**{"ppo.num_steps": 64, "ppo.minibatch_size": 32, "train.amp": amp}))
    with pytest.raises(ConfigError, match="not even a micro-batch of 1 ") as info:
        probe(cfg, 900, "cpu", "fake", margin=0.0)
    assert "inference chunk" not in str(info.value) and ("AMP" in str(info.value)) is (hint is not None)


def _found(micro: int, chunk: int):
    from types import SimpleNamespace

    return lambda *a, **k: SimpleNamespace(micro_batch_size=micro, infer_chunk_size=chunk, peak_bytes=2**20)


def test_a_fixed_size_beside_an_auto_one_is_measured_at_its_own_size(monkeypatch):
    """Not compared with the largest that fits: the whole minibatch can fit where a smaller,
    accumulating micro-batch does not, so a fixed 16 beside a fitting 32 must be measured itself."""
    import visppo.loop as loop

    monkeypatch.setattr(Prober, "measure", _stepped_measure(500))
    cpu = torch.device("cpu")

    def sizes(micro, chunk):
        cfg = load_config(None, tiny_overrides(**{"ppo.num_steps": 64, "ppo.minibatch_size": 32, "memory.budget": "1000B",
                                                  "memory.micro_batch_size": micro, "memory.infer_chunk_size": chunk}))
        return loop.memory_sizes(cfg, cpu, None, "off", verbose=False)  # limit: 900 B after the 10% margin

    assert sizes("auto", 64) == loop.MemorySizes(32, 64)
    assert sizes(0, "auto") == loop.MemorySizes(32, 90)  # 0: the whole minibatch, which fits
    with pytest.raises(ConfigError, match=r"memory.micro_batch_size=16 does not fit memory.budget .*peaks at 1016 B"):
        sizes(16, "auto")
    with pytest.raises(ConfigError, match=r"memory.infer_chunk_size=128 does not fit"):
        sizes("auto", 128)
    # a chunk over the rollout runs at the rollout's size: the message gives both, the key as set
    with pytest.raises(ConfigError, match=r"memory.infer_chunk_size=4096 \(its pass is 128 samples here\) does not fit"):
        sizes("auto", 4096)


def test_a_resume_keeps_its_sizes_only_on_the_device_kind_and_precision_they_held_on(monkeypatch):
    import visppo.loop as loop

    monkeypatch.setattr(loop, "probe", _found(8, 16))
    cpu = torch.device("cpu")
    cfg = load_config(None, tiny_overrides(**{"memory.micro_batch_size": "auto", "memory.infer_chunk_size": "auto"}))
    saved = {"memory_sizes": {"micro": 4, "chunk": 2, "on": "cpu off"}}  # halved after an OOM
    assert loop.memory_sizes(cfg, cpu, saved, "off", verbose=False) == loop.MemorySizes(4, 2)
    assert loop.memory_sizes(cfg, cpu, saved, "bf16", verbose=False) == loop.MemorySizes(8, 16)  # probed again
    older = {"memory_sizes": {"micro": 4, "chunk": 2}}  # a checkpoint that did not say where
    assert loop.memory_sizes(cfg, cpu, older, "bf16", verbose=False) == loop.MemorySizes(4, 2)


def test_an_accumulating_micro_batch_is_measured_with_the_gradients_already_allocated(monkeypatch):
    """Kills: Prober._prepare() not allocating .grad before an accumulating micro-batch (the pass then
    allocates the gradients itself, and they are counted twice: in the gradients line and in
    activations, which is never corrected for an accumulating size). The existing test bounds the
    result loosely (later <= whole + grads) and the double count lands exactly on that bound."""
    import visppo.probe as probe_module
    seen = []
    real = probe_module._backward_pass

    def spy(policy, buf, index, *args):
        seen.append((len(index), all(p.grad is not None for p in policy.parameters() if p.requires_grad)))
        return real(policy, buf, index, *args)

    monkeypatch.setattr(probe_module, "_backward_pass", spy)
    prober = Prober(load_config(None, tiny_overrides(**{"ppo.minibatch_size": 32})), torch.device("cpu"), "fake")
    prober._pass("micro_batch", 16)  # accumulates into a minibatch of 32
    prober._pass("micro_batch", 32)  # the whole minibatch: its gradients are born in the pass
    assert seen == [(16, True), (32, False)]


def test_the_largest_rollout_on_the_device_fits_under_the_margin_and_one_more_step_does_not():
    """Kills: rollout_steps computed against the budget instead of the limit after the margin (the
    reported ppo.num_steps then peaks above budget * (1 - margin): the probe picks a rollout that does
    not fit). The existing test checks only that it is larger than the config's."""
    cfg = load_config(None, tiny_overrides(**{"memory.buffer_device": "device"}))
    result = probe(cfg, "64MiB", "cpu", "fake")
    top = {c.size: c for c in result.candidates if c.kind == "rollout"}[result.rollout_steps * cfg.ppo.num_envs]
    assert top.fits and top.peak_bytes <= result.limit_bytes
    per_step = top.breakdown["buffer"] // result.rollout_steps
    assert top.peak_bytes + per_step > result.limit_bytes  # the largest: one more step is over


@pytest.mark.parametrize("size", [8, 64])
def test_a_cuda_chunk_in_fake_mode_counts_the_copy_of_its_inputs_to_the_gpu(size):
    """Kills: dropping the input copy from a CUDA target's infer_chunk line in fake mode (the pass runs
    on the CPU there, where the gathered samples are already in place; on the GPU each chunk's frames
    and actions are copied over first): the chunk would be underestimated by its inputs' bytes."""
    cfg = load_config(None, tiny_overrides(**{"train.amp": "bf16"}))
    gpu, cpu = Prober(cfg, torch.device("cuda"), "fake"), Prober(cfg, torch.device("cpu"), "fake")
    one = RolloutBuffer(1, 1, gpu.obs_space, gpu.action_space)
    per_sample = sum(v[0, 0].numel() * v.element_size() for v in one.obs.values()) \
        + one.actions[0, 0].numel() * one.actions.element_size()
    assert per_sample >= 48 * 48  # at least one uint8 frame (guards the test itself)
    assert gpu.activations("infer_chunk", size) == cpu.activations("infer_chunk", size) + per_sample * size
