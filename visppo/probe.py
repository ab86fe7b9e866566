"""Will it fit? The largest micro-batch and inference chunk under a memory budget.

``probe(cfg, budget)`` runs the config's real update step (encoder + actor +
critic forward, PPO loss, backward: :func:`visppo.ppo.minibatch_gradient`) at a
micro-batch size, and its real no-grad pass (:func:`visppo.ppo.infer`) at a
chunk size, measures the peak, and searches upward (doubling) then by
bisection for the largest sizes whose peak stays under ``budget * (1 - margin)``.

Two modes:

- ``fake`` (default where the target device is absent): the step runs under
  ``FakeTensorMode`` on the CPU, so nothing is allocated, and a
  :class:`~visppo.memory.LiveBytes` dispatch mode counts the live bytes of the
  tensors it creates. Activations take the dtype the target would use
  (bf16/fp16 under AMP).
- ``real``: the step runs for real on the device; CUDA's own peak statistics
  (``max_memory_allocated``) or, on the CPU, the same live-bytes counter.

The peak of one size is the sum of the breakdown's lines, each counted once
(:data:`SOURCES` says where each figure comes from):

- ``parameters``, ``gradients``, ``optimizer_state`` (Adam's two moments and its
  step counters), counted from the model. Gradients live through the whole
  update and, as ``update`` leaves them, through the next collection and its
  no-grad passes too.
- ``buffer``: the rollout, when ``memory.buffer_device=device``.
- ``activations``: measured. For a micro-batch that accumulates into a
  minibatch (``micro_batch_size < minibatch_size``) the step runs with the
  gradients already allocated, as from the second micro-batch on, so the
  measurement holds what that backward adds: activations, and the temporary
  gradient of each parameter before it is added into ``.grad``. For a
  micro-batch that is the whole minibatch, the step runs from ``grad=None`` and
  the gradients it allocates are taken out of the measured peak (they are
  their own line). With ``model.encoder_checkpointing`` the recomputation in
  backward is part of what is measured.
- For a CPU target: ``conv_workspace``, what convolution kernels allocate and
  free inside the op (:class:`KernelWorkspace`), at the moment of the pass's peak.
- For a CUDA target: ``cuda_context``, ``cublas_workspace``, ``cudnn_workspace``,
  ``allocator_rounding``.
- With ``world_size > 1`` (torchrun): ``allreduce_buffer``, the flat fp32 copy of
  the gradients that :func:`visppo.distributed.reduce_minibatch` all-reduces once
  per minibatch.
"""

from __future__ import annotations

import json
import math
import os
import warnings
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from torch.utils._pytree import tree_leaves, tree_map

from visppo.atomic import atomic_write_text
from visppo.buffer import RolloutBuffer
from visppo.builders import build_policy, frozen_steps, initialised_gpus
from visppo.config import Config, parse_bytes
from visppo.envs import make_env
from visppo.errors import ConfigError
from visppo.memory import (
    LiveBytes,
    cpu_allocator_peak,
    cuda_block_size,
    format_bytes,
    is_oom,
    largest_fitting,
    peak_bytes,
)
from visppo.policy import ActorCritic
from visppo.ppo import (
    MemorySizes,
    UpdateSetup,
    infer,
    minibatch_gradient,
)
from visppo.precision import Precision, autocast_dtype

# --------------------------------------------------------------------------- the training code the probe runs


def _backward_pass(policy: ActorCritic, buf: RolloutBuffer, index: torch.Tensor, adv: torch.Tensor,
                   cfg: Config, device: torch.device, precision: Precision) -> None:
    """One micro-batch of the real update: forward, PPO loss, backward into ``.grad``."""
    setup = UpdateSetup(cfg.ppo, FixedSizes(len(index), len(index)), device, precision)
    minibatch_gradient(policy, buf, index, adv, setup)


class PassOutOfMemory(MemoryError):
    """The measured pass ran out of memory at its size: that size does not fit."""


class FixedSizes(MemorySizes):
    """Sizes that never back off. Training halves a size that runs out of memory and retries
    (:func:`visppo.ppo.with_oom_backoff`); in the probe that retry would measure the smaller size
    and report the one that ran out of memory as fitting, so the first out-of-memory ends the pass."""

    def halve(self, which: str) -> None:
        raise PassOutOfMemory(f"out of memory at {which}={getattr(self, which)} (the probe does not back off)")


def _no_grad_pass(policy: ActorCritic, buf: RolloutBuffer, size: int, device: torch.device,
                  precision: Precision) -> None:
    """One chunk of the real no-grad pass (values and log-probs of ``size`` samples), at that size."""
    infer(policy, buf.flat_obs(), buf.flat(buf.actions), FixedSizes(0, size), device, precision)


# --------------------------------------------------------------------------- what a GPU adds

CUDA_CONTEXT_DEFAULT = 512 * 2**20
"""Bytes of device memory a CUDA process holds outside PyTorch's allocator: the context and
the kernels loaded lazily (PyTorch's, cuBLAS's, cuDNN's). Used when the target GPU is not
here; on a GPU, :func:`cuda_context_bytes` measures it once and caches it per device name.
An assumption until a GPU run replaces it: PyTorch's CUDA notes and ``nvidia-smi`` after a
first ``torch.zeros(1, device="cuda")`` show 300-500 MiB on recent drivers with lazy loading."""

CUDA_CONTEXT_PLAUSIBLE_MAX = 2 * 2**30
"""A measured context above this is not cached: the measurement reads the device-wide use, so
another process on the GPU inflates it, and the estimates would charge that process's memory
to every row (docs/memory.md has the run that did)."""

CUBLAS_WORKSPACE = {"sm90+": 4096 * 1024 * 8, "older": 4096 * 1024 * 2 + 16 * 1024 * 8}
"""PyTorch's default cuBLAS workspace per (handle, stream) when ``CUBLAS_WORKSPACE_CONFIG`` is
unset: ``:4096:8`` (32 MiB) on Hopper and later, ``:4096:2:16:8`` (8.1 MiB) before. It is
allocated through the caching allocator at the first matmul and kept."""

GPU_LINES = ("cuda_context", "cublas_workspace", "cudnn_workspace", "allocator_rounding")

SOURCES = {
    "parameters": "counted: bytes of every parameter and buffer (BatchNorm statistics) of the model",
    "gradients": "counted: bytes of every trainable parameter (one .grad each)",
    "optimizer_state": "counted: Adam's exp_avg + exp_avg_sq (parameter dtype) + one fp32 step per tensor",
    "buffer": "counted: rollout buffer bytes per sample x rollout size (memory.buffer_device=device)",
    "activations": "measured: live bytes of the tensors one pass creates (fake or real tensors), beyond the "
                   "gradients; later micro-batches include the temporary gradient before accumulation, and "
                   "checkpointed blocks their recomputation",
    "conv_workspace": "measured (CPU target): what each convolution or max-pool allocates and frees inside the "
                      "op beyond its outputs (oneDNN reorders and reduction buffers, im2col columns, max_pool2d's "
                      "dropped indices), run once for real at the pass's shapes and thread count, cached "
                      "(KernelWorkspace)",
    "cuda_context": "context + lazily loaded kernels: measured once per GPU name (cached), else a default",
    "cublas_workspace": "PyTorch's default per-stream cuBLAS workspace (CUBLAS_WORKSPACE_CONFIG if set)",
    "cudnn_workspace": "assumed: at most the largest convolution output of the pass (cuDNN's heuristic "
                       "algorithms, torch.backends.cudnn.benchmark off); measured inside activations in real mode",
    "allocator_rounding": "modelled: every block rounded to 512 B, blocks above 10 MiB to 2 MiB segments "
                          "(fragmentation of shared segments is left to the margin); measured in real mode",
    "allreduce_buffer": "counted: the flat fp32 copy of every trainable gradient that torchrun's per-minibatch "
                        "all-reduce builds (visppo.distributed.reduce_minibatch), 4 B per parameter; it lives "
                        "after the backward, when activations are freed, so the line is what it needs beyond "
                        "the pass's transient lines",
}


def _context_cache() -> Path:
    root = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(root) / "visppo" / "cuda_context.json"


def measure_cuda_context(device: torch.device) -> int:
    """Device memory this process holds outside the caching allocator, after loading what a
    training step loads (a convolution and a matmul, forward and backward). Reads the
    device-wide use, so it is right on a GPU no other process is using."""
    x = torch.randn(4, 3, 16, 16, device=device, requires_grad=True)
    conv, lin = torch.nn.Conv2d(3, 8, 3).to(device), torch.nn.Linear(8, 4).to(device)
    lin(conv(x).mean((2, 3))).sum().backward()
    torch.cuda.synchronize(device)
    free, total = torch.cuda.mem_get_info(device)
    return max(0, total - free - torch.cuda.memory_reserved(device))


def cuda_context_bytes(device: torch.device, measure=measure_cuda_context) -> tuple[int, str]:
    """``(bytes, where from)``: the cached figure for this GPU's name, a fresh measurement
    (then cached), or :data:`CUDA_CONTEXT_DEFAULT` when the GPU is not here."""
    if device.type != "cuda" or not torch.cuda.is_available():
        return CUDA_CONTEXT_DEFAULT, "default (no GPU here): visppo.probe.CUDA_CONTEXT_DEFAULT"
    name = torch.cuda.get_device_name(device)
    path = _context_cache()
    try:
        cache = json.loads(path.read_text())
    except (OSError, ValueError):
        cache = {}
    if name in cache:
        return int(cache[name]), f"measured earlier on {name} ({path})"
    value = int(measure(device))
    if value > CUDA_CONTEXT_PLAUSIBLE_MAX:
        warnings.warn(f"the CUDA context measured {value / 2**30:.1f} GiB, more than a context takes: "
                      "another process is likely using this GPU; the figure is used for this probe only, "
                      "not cached (rerun on an idle GPU)", stacklevel=2)
        return value, f"measured now on {name}, not cached: another process likely holds GPU memory"
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps({**cache, name: value}, indent=1))
    except OSError:
        pass
    return value, f"measured now on {name}"


def cublas_workspace_bytes(device: torch.device) -> tuple[int, str]:
    """One cuBLAS workspace (training uses one stream): ``CUBLAS_WORKSPACE_CONFIG``'s
    ``:KiB:count`` pairs when set, else PyTorch's default for the GPU (Hopper's when absent)."""
    spec = os.environ.get("CUBLAS_WORKSPACE_CONFIG")
    if spec:
        parts = [int(x) for x in spec.strip(":").split(":") if x]
        return sum(k * 1024 * n for k, n in zip(parts[::2], parts[1::2])), f"CUBLAS_WORKSPACE_CONFIG={spec}"
    if torch.cuda.is_available() and device.type == "cuda":
        major = torch.cuda.get_device_properties(device).major
        key = "sm90+" if major >= 9 else "older"
        return CUBLAS_WORKSPACE[key], f"PyTorch's default for sm{major}x"
    return CUBLAS_WORKSPACE["sm90+"], "PyTorch's default for Hopper and later (the larger one; no GPU here)"


CONV_OPS = frozenset({"aten.convolution", "aten._convolution", "aten.conv2d", "aten.convolution_backward"})
"""Convolutions as a dispatch mode sees them (the cuDNN workspace model's ops)."""


class KernelWorkspace:
    """Bytes a CPU kernel allocates and frees inside the op, beyond its outputs. Convolutions:
    oneDNN's reordered weights and per-thread weight-gradient reduction buffers (a multiple of a
    layer's weights in backward that depends on its spatial size and the thread count:
    docs/memory.md), the slow path's im2col columns (bf16).
    ``max_pool2d`` (ResNet's stem): it runs ``max_pool2d_with_indices`` and drops the int64
    indices, 4x the bytes of a bf16 output. A dispatch-level meter sees neither, and the kernels'
    choices are not worth re-deriving, so each such op is run once for real, alone, at the pass's
    shapes, strides, dtypes and thread count, and the allocator's peak inside it is measured
    (:func:`visppo.memory.cpu_allocator_peak`); cached per such signature."""

    OPS = CONV_OPS | {"aten.max_pool2d"}

    def __init__(self) -> None:
        self.cache: dict[tuple, int] = {}
        self.unmeasured = False
        """Set when a convolution could not be measured (another profiler was running): it counted 0."""

    def __call__(self, func, args: tuple, kwargs: dict) -> int:
        if str(func.overloadpacket) not in self.OPS:
            return 0
        if torch._C._autograd._profiler_enabled():  # profilers do not nest: the user's is running
            self.unmeasured = True
            return 0
        key = (str(func), torch.get_num_threads(), *(_signature(a) for a in tree_leaves((args, kwargs))))
        if key not in self.cache:
            self.cache[key] = self._measure(func, args, kwargs)
        return self.cache[key]

    @staticmethod
    def _measure(func, args: tuple, kwargs: dict) -> int:
        from torch.utils._python_dispatch import _disable_current_modes

        with _disable_current_modes():  # real tensors, outside the fake mode and the meter
            real_args, real_kwargs = tree_map(_real_like, (args, kwargs))
            peak, out = cpu_allocator_peak(lambda: func(*real_args, **real_kwargs))
        outputs = sum(t.untyped_storage().nbytes() for t in tree_leaves(out) if isinstance(t, torch.Tensor))
        return max(0, peak - outputs)


def _signature(value) -> tuple:
    if isinstance(value, torch.Tensor):
        return ("T", tuple(value.shape), tuple(value.stride()), value.dtype)
    return ("V", repr(value))


def _real_like(value):
    """A zero-filled CPU tensor of ``value``'s shape, strides and dtype (fake or real); others as they are."""
    if not isinstance(value, torch.Tensor):
        return value
    return torch.empty_strided(value.shape, value.stride(), dtype=value.dtype).zero_()


class _StepMeter(LiveBytes):
    """Live bytes, plus what convolution and max-pool kernels take inside the op, where a dispatch mode cannot
    see it: the largest convolution output (the cuDNN workspace model, for a CUDA target), and for
    a CPU target the measured :class:`KernelWorkspace`: ``workspace_peak`` is the peak with it."""

    def __init__(self, block_size=None, kernel_workspace: KernelWorkspace | None = None):
        super().__init__(block_size)
        self.largest_conv = 0
        self.kernel_workspace = kernel_workspace
        self.workspace_peak = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = super().__torch_dispatch__(func, types, args, kwargs)
        op = str(func.overloadpacket)
        if op in CONV_OPS:
            sizes = [t.numel() * t.element_size() for t in tree_leaves(out) if isinstance(t, torch.Tensor)]
            self.largest_conv = max([self.largest_conv, *sizes])
        if op in KernelWorkspace.OPS and self.kernel_workspace is not None:
            hidden = self.kernel_workspace(func, args, kwargs or {})  # the outputs are counted: what the op held beyond them
            self.workspace_peak = max(self.workspace_peak, self.current + hidden)
        self.workspace_peak = max(self.workspace_peak, self.peak)
        return out


# --------------------------------------------------------------------------- the probe


@dataclass
class Candidate:
    kind: str  # "micro_batch" | "infer_chunk" | "rollout"
    size: int
    peak_bytes: int
    fits: bool
    breakdown: dict[str, int] = field(default_factory=dict)


@dataclass
class ProbeResult:
    budget_bytes: int
    limit_bytes: int
    device: str
    mode: str
    amp: str
    micro_batch_size: int
    infer_chunk_size: int
    peak_bytes: int
    breakdown: dict[str, int]
    candidates: list[Candidate]
    rollout_steps: int | None = None  # largest num_steps with the buffer on the device
    sources: dict[str, str] = field(default_factory=dict)  # where each breakdown line comes from

    def to_json(self) -> dict:
        return asdict(self)


def _fake_mode():
    from torch._subclasses.fake_tensor import FakeTensorMode

    return FakeTensorMode(allow_non_fake_inputs=True)


def _to_fake(module: torch.nn.Module, mode) -> None:
    """Replace every parameter and buffer of ``module`` by a fake of ``mode`` (frees the real ones)."""
    with warnings.catch_warnings(), mode:
        warnings.simplefilter("ignore")
        for sub in module.modules():
            for name, p in sub._parameters.items():
                if p is not None:
                    sub._parameters[name] = torch.nn.Parameter(mode.from_tensor(p.detach()), p.requires_grad)
            for name, b in sub._buffers.items():
                if b is not None:
                    sub._buffers[name] = mode.from_tensor(b)


class Prober:
    """Holds the model once and measures one size at a time."""

    def __init__(self, cfg: Config, device: torch.device, mode: str, world_size: int = 1):
        env = make_env(cfg)
        self.obs_space, self.action_space = env.observation_space, env.action_space
        env.close()
        self.cfg, self.device, self.mode = cfg, device, mode
        self.run_device = device if mode == "real" else torch.device("cpu")
        self.dtype = autocast_dtype(cfg.train.amp, device)
        # fake mode: one FakeTensorMode holds the model too, so that every tensor of a pass is its fake
        # (nothing allocated, whatever the model's size) and views share their base's fake storage
        self._fake = _fake_mode() if mode == "fake" else None
        self.policy: ActorCritic = build_policy(cfg, self.obs_space, self.action_space, self.run_device,
                                                load_weights=False)  # values do not matter
        if self._fake is not None:
            _to_fake(self.policy, self._fake)
        frozen: set[int] = set()
        if frozen_steps(cfg) == math.inf:  # frozen for good, as the loop freezes it: no backward through
            for enc in self.policy.encoders():  # the trunk, no gradient, no Adam state
                enc.pixels.frozen = True
                frozen |= {id(p) for p in enc.trunk_parameters()}
        self.trainable = [p for p in self.policy.parameters() if p.requires_grad and id(p) not in frozen]
        self.cuda = device.type == "cuda"
        self.kernel_workspace = KernelWorkspace()
        self.static, self.sources = self._static_lines(world_size)
        one = RolloutBuffer(1, 1, self.obs_space, self.action_space)
        self.buffer_bytes_per_sample = one.nbytes()
        self.input_bytes_per_sample = sum(v.element_size() * v[0, 0].numel() for v in one.obs.values()) + \
            one.actions.element_size() * one.actions[0, 0].numel()
        if cfg.memory.buffer_device == "device":
            self.static["buffer"] = self.buffer_bytes_per_sample * cfg.rollout_size

    def _static_lines(self, world_size: int) -> tuple[dict[str, int], dict[str, str]]:
        """The lines that do not depend on the size, and where every line of a pass comes from."""
        nbytes = [t.numel() * t.element_size() for t in (*self.policy.parameters(), *self.policy.buffers())]
        grads = [p.numel() * p.element_size() for p in self.trainable]
        static = {"parameters": sum(nbytes), "gradients": sum(grads),
                  "optimizer_state": 2 * sum(grads) + 4 * len(grads),  # exp_avg, exp_avg_sq, fp32 step
                  "buffer": 0}
        names = ["parameters", "gradients", "optimizer_state", "buffer", "activations"]
        names += ["cudnn_workspace", "allocator_rounding"] if self.cuda else ["conv_workspace"]
        sources = {k: SOURCES[k] for k in names}
        # torchrun: one flat fp32 copy of every trainable parameter's gradient per minibatch
        self.allreduce_bytes = 4 * sum(p.numel() for p in self.trainable) if world_size > 1 else 0
        if world_size > 1:
            sources["allreduce_buffer"] = SOURCES["allreduce_buffer"] + f" (world_size {world_size})"
        if self.cuda:
            static["cuda_context"], src = cuda_context_bytes(self.device)
            sources["cuda_context"] = f"{SOURCES['cuda_context']}: {src}"
            static["cublas_workspace"], src = cublas_workspace_bytes(self.device)
            sources["cublas_workspace"] = f"{SOURCES['cublas_workspace']}: {src}"

            def rounding(sizes):
                return sum(cuda_block_size(n) - n for n in sizes)
            # parameters, gradients, Adam's two moments (same sizes) and its 4-byte steps in 512-byte blocks
            self._static_rounding = {"params": rounding(nbytes), "grads": rounding(grads),
                                     "optimizer": 2 * rounding(grads) + len(grads) * (cuda_block_size(4) - 4)}
        return static, sources

    def activations(self, kind: str, size: int) -> int:
        """Bytes one micro-batch step (``micro_batch``) or one no-grad chunk (``infer_chunk``) adds
        at its peak, beyond parameters, gradients and optimizer state."""
        return self._pass(kind, size)["activations"]

    def _pass(self, kind: str, size: int) -> dict[str, int]:
        """The size-dependent lines of one pass: measured, then split into what each line holds."""
        accumulating = kind == "micro_batch" and size < self.cfg.ppo.minibatch_size
        meter = _StepMeter(cuda_block_size if self.cuda else None,
                           None if self.cuda else self.kernel_workspace)
        with warnings.catch_warnings(), (self._fake or nullcontext()):
            warnings.simplefilter("ignore")
            run = self._prepare(kind, size, accumulating)
            try:
                peak, blocks, workspace = self._run_measured(run, meter)
            finally:
                self.policy.zero_grad(set_to_none=True)
        if peak is None:  # out of memory on the device: does not fit
            return {"activations": 2**62}
        if self.kernel_workspace.unmeasured and "not measured" not in self.sources["conv_workspace"]:
            note = "not measured: a torch.profiler was running (profilers do not nest); counted 0"
            warnings.warn(f"visppo probe: conv_workspace {note}", RuntimeWarning, stacklevel=2)
            self.sources["conv_workspace"] = note
        out = {"activations": peak}
        if kind == "micro_batch" and not accumulating:  # the fresh gradients have their own line
            out["activations"] = max(0, peak - self.static["gradients"])
        if kind == "infer_chunk" and self.cuda and self._fake is not None:  # the chunk's copy to the GPU
            out["activations"] += self.input_bytes_per_sample * size
        if self.cuda:
            static = self._static_rounding
            out["cudnn_workspace"] = meter.largest_conv
            out["allocator_rounding"] = (static["params"] + static["optimizer"] + (blocks - peak)
                                         + (static["grads"] if accumulating or kind == "infer_chunk" else 0))
        else:
            out["conv_workspace"] = workspace
        if self.allreduce_bytes:  # after the backward, when the activations are gone: what it adds beyond them
            transient = out["activations"] + out.get("conv_workspace", 0) + out.get("cudnn_workspace", 0)
            out["allreduce_buffer"] = max(0, self.allreduce_bytes - transient)
        return out

    def _prepare(self, kind: str, size: int, accumulating: bool) -> Callable[[], None]:
        """What exists before the pass: the host buffer (its gathered samples are the pass's), and,
        from the second micro-batch of a minibatch on, the gradients. Returns the pass."""
        precision = Precision(self.run_device, self.dtype)
        buf = RolloutBuffer(size, 1, self.obs_space, self.action_space, channels_last=self.cfg.train.channels_last)
        self.policy.zero_grad(set_to_none=True)
        if accumulating:
            for p in self.trainable:
                p.grad = torch.zeros_like(p)
        if kind == "infer_chunk":
            return lambda: _no_grad_pass(self.policy, buf, size, self.run_device, precision)
        index, adv = torch.arange(size), torch.zeros(size)
        return lambda: _backward_pass(self.policy, buf, index, adv, self.cfg, self.run_device, precision)

    def _run_measured(self, run: Callable[[], None], meter: _StepMeter) -> tuple[int | None, int, int]:
        """``(peak, peak in allocator blocks, hidden kernel workspace at the peak)``; peak None when
        the pass ran out of memory (on a GPU or on the CPU alike): the size does not fit."""
        try:
            if self.run_device.type == "cuda":
                peak = peak_bytes(run, self.run_device)
                return peak, peak, 0  # the allocator's statistic already holds its rounding
            with meter:
                run()
        except Exception as exc:
            if is_oom(exc):
                return None, 0, 0
            raise
        return meter.peak, meter.blocks_peak, meter.workspace_peak - meter.peak

    def measure(self, kind: str, size: int, limit: int) -> Candidate:
        breakdown = {**self.static, **self._pass(kind, size)}
        peak = sum(breakdown.values())
        return Candidate(kind, size, peak, peak <= limit, breakdown)


def cap_fraction(cap_bytes: int, context_bytes: int, total_bytes: int) -> float:
    """The ``set_per_process_memory_fraction`` that lets the allocator hold ``cap_bytes`` of device
    use in all: the CUDA context lives outside the allocator, so it comes off the cap."""
    if cap_bytes <= context_bytes:
        raise ValueError(f"a cap of {cap_bytes} B leaves nothing beside the CUDA context ({context_bytes} B)")
    return min(1.0, (cap_bytes - context_bytes) / total_bytes)


def emulate_smaller_card(budget_bytes: int, device: torch.device) -> None:
    """In real mode on a bigger GPU, cap this process so that its whole use, the CUDA context
    included (a card of ``budget_bytes`` holds that too), stays within ``budget_bytes``: sizes that
    would not fit the target card then really raise out-of-memory here. ``cuda`` without an index
    is the current GPU (``set_per_process_memory_fraction`` refuses a device without one)."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    total = torch.cuda.get_device_properties(index).total_memory
    if budget_bytes < total:
        context, _ = cuda_context_bytes(torch.device("cuda", index))
        try:
            fraction = cap_fraction(budget_bytes, context, total)
        except ValueError:
            raise ConfigError(f"a budget of {format_bytes(budget_bytes)} leaves nothing beside the CUDA "
                              f"context ({format_bytes(context)}): give a larger budget") from None
        torch.cuda.set_per_process_memory_fraction(fraction, index)


MARGIN = 0.10
"""Fraction of the budget kept free by default: what the model leaves out (small tensors; the
caching allocator's fragmentation). How near the estimates came on a GPU: docs/memory.md."""
MARGIN_FP32_CUDA = 0.25
"""The default for fp32 (no AMP) on a GPU, wider than ``MARGIN``: the caching allocator reserves
more beyond what fp32 passes allocate than the model counts, and no capped fp32 run has checked
a narrower one yet (docs/memory.md)."""


def default_margin(device: torch.device, dtype: torch.dtype | None) -> float:
    return MARGIN_FP32_CUDA if device.type == "cuda" and dtype is None else MARGIN


def probe(cfg: Config, budget: str | int, device: str = "cuda", mode: str | None = None,
          margin: float | None = None, world_size: int | None = None,
          fixed: dict[str, int] | None = None) -> ProbeResult:
    """Largest ``memory.micro_batch_size`` and ``memory.infer_chunk_size`` of ``cfg`` under ``budget``.

    ``fixed``: sizes given rather than searched (``{"micro_batch": 16}``, say, beside an ``auto``
    chunk): each is measured at its own size and is a ConfigError if it does not fit.

    ``margin``: fraction of the budget kept free; ``None``: :func:`default_margin` (10%, or 25%
    for fp32 on a GPU). ``world_size``: processes training together under torchrun (default:
    ``$WORLD_SIZE``, else 1); above 1 each process also builds the all-reduce's flat gradient buffer."""
    budget_bytes = parse_bytes(budget) if isinstance(budget, str) else int(budget)
    target = torch.device(device)
    present = target.type == "cpu" or torch.cuda.is_available()
    mode = mode or ("real" if present and target.type == "cpu" else "fake" if not present else "real")
    if mode == "real" and not present:
        raise ConfigError(f"--mode real needs the device {device}, which is absent here: use --mode fake")
    if margin is not None and not 0 <= margin < 1:
        raise ConfigError(f"--margin must be in [0, 1), got {margin}")
    world_size = int(os.environ.get("WORLD_SIZE", 1)) if world_size is None else world_size
    # the probe builds a policy of its own and draws inputs (and measuring the CUDA context builds
    # layers): a run that asks it for its sizes after seeding must go on from the RNG states it
    # had, or `auto` would change what the run learns
    with torch.random.fork_rng(devices=_gpus_to_keep(target, present)):
        if mode == "real" and target.type == "cuda":
            emulate_smaller_card(budget_bytes, target)
        return _probe(cfg, budget_bytes, target, mode, margin, world_size, fixed or {})


def _gpus_to_keep(target: torch.device, present: bool) -> list[int]:
    """Every initialised GPU, and a CUDA target (the probe initialises it: its first call applies
    a seed that ``torch.manual_seed`` queued, and the probe's draws would then move it on)."""
    kept = set(initialised_gpus())
    if target.type == "cuda" and present:
        kept.add(target.index if target.index is not None else torch.cuda.current_device())
    return sorted(kept)


def _probe(cfg: Config, budget_bytes: int, target: torch.device, mode: str, margin: float | None,
           world_size: int, fixed: dict[str, int]) -> ProbeResult:
    prober = Prober(cfg, target, mode, world_size)
    margin = default_margin(target, prober.dtype) if margin is None else margin
    limit = int(budget_bytes * (1 - margin))
    candidates: list[Candidate] = []

    def fits(kind: str):
        def check(size: int) -> bool:
            cand = prober.measure(kind, size, limit)
            candidates.append(cand)
            return cand.fits
        return check

    # The whole minibatch first, on its own: it keeps no gradients while its activations live (they
    # are made after its backward), where a smaller, accumulating micro-batch holds both, so it can
    # fit where every accumulating size does not; the search then covers the accumulating sizes.
    for kind, size in fixed.items():  # not searched: measured at the size given
        cand = prober.measure(kind, size, limit)
        candidates.append(cand)
        if not cand.fits:
            key = {"micro_batch": "memory.micro_batch_size", "infer_chunk": "memory.infer_chunk_size"}[kind]
            given = getattr(cfg.memory, key.split(".")[1])  # a size over the batch it cuts runs at that batch's
            shown = f"{given} (its pass is {size} samples here)" if str(given) != str(size) else str(size)
            raise ConfigError(f"{key}={shown} does not fit memory.budget {format_bytes(budget_bytes)} on {target}: "
                              f"its pass peaks at {format_bytes(cand.peak_bytes)}, over the {format_bytes(limit)} "
                              f"left after the {margin:.0%} margin: lower it, set it to auto, or raise memory.budget")
    minibatch = cfg.ppo.minibatch_size
    if "micro_batch" in fixed:
        micro = fixed["micro_batch"]
    else:
        micro = minibatch if fits("micro_batch")(minibatch) else \
            largest_fitting(fits("micro_batch"), limit=minibatch - 1)[0] if minibatch > 1 else 0
    chunk = fixed["infer_chunk"] if "infer_chunk" in fixed else \
        largest_fitting(fits("infer_chunk"), limit=cfg.rollout_size)[0]
    if micro == 0 or chunk == 0:
        model = sum(v for k, v in prober.static.items() if k not in GPU_LINES)
        gpu = sum(v for k, v in prober.static.items() if k in GPU_LINES)
        which = " and ".join(w for w, n in (("a micro-batch", micro), ("an inference chunk", chunk)) if n == 0)
        gpu_text = f", the CUDA context and workspaces {format_bytes(gpu)}" if gpu else ""
        hints = ", ".join(h for h in ("a smaller model or image", "AMP" if prober.dtype is None else "",
                                      "a larger budget") if h)
        raise ConfigError(f"nothing fits in {format_bytes(limit)} ({format_bytes(budget_bytes)} minus "
                          f"{margin:.0%} margin): not even {which} of 1 (parameters, gradients, optimizer state "
                          f"and buffer take {format_bytes(model)}{gpu_text}); use {hints}")
    top = max((c for c in candidates if c.fits and ((c.kind == "micro_batch" and c.size == micro) or
                                                     (c.kind == "infer_chunk" and c.size == chunk))),
              key=lambda c: c.peak_bytes)
    amp_name = {None: "off", torch.bfloat16: "bf16", torch.float16: "fp16"}[prober.dtype]
    result = ProbeResult(budget_bytes, limit, str(target), mode, amp_name, micro, chunk, top.peak_bytes,
                         top.breakdown, candidates, sources=prober.sources)
    if cfg.memory.buffer_device == "device":
        fixed = top.peak_bytes - top.breakdown["buffer"]  # the larger of the two passes at the chosen sizes
        per_step = prober.buffer_bytes_per_sample * cfg.ppo.num_envs
        result.rollout_steps = max(0, (limit - fixed) // per_step)
        for steps in sorted({s for s in (result.rollout_steps, cfg.ppo.num_steps) if s > 0}):
            peak = fixed + per_step * steps
            candidates.append(Candidate("rollout", steps * cfg.ppo.num_envs, peak, peak <= limit,
                                        {**top.breakdown, "buffer": per_step * steps}))
    return result


# --------------------------------------------------------------------------- reports


def format_table(result: ProbeResult) -> str:
    cols = ["parameters", "gradients", "optimizer_state", "buffer", "activations", "other"]
    head = f"{'kind':12s} {'size':>7s} {'peak':>11s} fits  " + " ".join(f"{c[:11]:>11s}" for c in cols)
    lines = [f"budget {format_bytes(result.budget_bytes)} on {result.device} ({result.mode} mode, amp "
             f"{result.amp}); limit after margin {format_bytes(result.limit_bytes)}", head]

    def value(c: Candidate, k: str) -> int:
        if k == "other":  # workspaces, GPU lines, the all-reduce buffer: named in the breakdown below
            return c.peak_bytes - sum(c.breakdown.get(name, 0) for name in cols[:-1])
        return c.breakdown.get(k, 0)
    for c in sorted(result.candidates, key=lambda c: (c.kind, c.size)):
        lines.append(f"{c.kind:12s} {c.size:7d} {format_bytes(c.peak_bytes):>11s} {'yes' if c.fits else 'no ':4s} "
                     + " ".join(f"{format_bytes(value(c, k)):>11s}" for k in cols))
    lines.append(f"=> memory.micro_batch_size={result.micro_batch_size} "
                 f"memory.infer_chunk_size={result.infer_chunk_size} (peak {format_bytes(result.peak_bytes)})")
    lines.append("peak at those sizes, line by line:")
    for k, v in result.breakdown.items():
        lines.append(f"  {k:18s} {format_bytes(v):>10s}  {result.sources.get(k, '')}")
    if result.rollout_steps is not None:
        lines.append(f"=> with the buffer on the device: ppo.num_steps <= {result.rollout_steps}")
    return "\n".join(lines)


def write_json(result: ProbeResult, path: Path) -> None:
    atomic_write_text(Path(path), json.dumps(result.to_json(), indent=2))


def plot(result: ProbeResult, path: Path) -> None:
    """Peak memory against size for each kind, with the budget and the margin line."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from visppo.plot import save_figure

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for kind in ("micro_batch", "infer_chunk"):
        pts = sorted((c.size, c.peak_bytes / 2**30) for c in result.candidates if c.kind == kind)
        if pts:
            ax.plot(*zip(*pts), marker="o", label=kind.replace("_", " "))
    ax.axhline(result.budget_bytes / 2**30, color="red", label="budget")
    ax.axhline(result.limit_bytes / 2**30, color="red", linestyle="--", label="budget - margin")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("samples per pass")
    ax.set_ylabel("peak memory (GiB)")
    ax.set_title(f"visppo probe: {result.device}, {result.mode} mode, amp {result.amp}")
    ax.legend()
    fig.tight_layout()
    try:
        save_figure(fig, path)
    finally:
        plt.close(fig)
