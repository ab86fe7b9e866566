"""Will it fit? The largest micro-batch and inference chunk under a memory budget.

``probe(cfg, budget)`` runs the config's real update step (encoder + actor +
critic forward, PPO loss, backward: :func:`visppo.ppo.minibatch_gradient`) at a
micro-batch size, and its real no-grad pass (:func:`visppo.ppo.score`) at a
chunk size, measures the peak, and searches upward (doubling) then by
bisection for the largest sizes whose peak stays under ``budget * (1 - margin)``.

Two modes:

- ``fake`` (default where the target device is absent): the step runs under
  ``FakeTensorMode`` on the CPU, so nothing is allocated, and
  ``MemTracker`` records the activation peak. Activations take the dtype the
  target would use (bf16/fp16 under AMP). For a CUDA target a fixed runtime
  overhead is added (see :data:`CUDA_RUNTIME_OVERHEAD`).
- ``real``: the step runs for real on the device; CUDA's own peak statistics
  (``max_memory_allocated``) or, on the CPU, a tracker of live tensor bytes.

Peak = parameters + gradients + optimizer state + buffer (when on the device)
+ activations of one micro-batch (or chunk) + runtime overhead. Parameters,
gradients and Adam's two moments are counted from the model, not measured.
"""

from __future__ import annotations

import json
import warnings
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from visppo.buffer import RolloutBuffer
from visppo.builders import build_policy
from visppo.config import Config, ConfigError, parse_bytes
from visppo.envs import make_env
from visppo.memory import format_bytes, is_oom, largest_fitting, peak_bytes
from visppo.policy import ActorCritic
from visppo.ppo import MemorySizes, UpdateSetup, infer, minibatch_gradient
from visppo.precision import Precision, autocast_dtype

CUDA_RUNTIME_OVERHEAD = 600 * 2**20
"""Bytes a CUDA process holds beyond its tensors: the CUDA context with PyTorch's
kernels loaded lazily (about 300-500 MiB on recent drivers, as PyTorch's CUDA
notes and ``nvidia-smi`` on a fresh ``torch.zeros(1, device="cuda")`` show), plus
cuBLAS workspaces (a few MiB per stream) and cuDNN convolution workspaces; the
caching allocator's rounding and fragmentation are left to ``--margin``."""


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

    def to_json(self) -> dict:
        return asdict(self)


def _random_buffer(obs_space, action_space, n: int, device: torch.device) -> RolloutBuffer:
    buf = RolloutBuffer(n, 1, obs_space, action_space, device=device)
    for v in buf.obs.values():
        v.zero_()
    return buf


class Prober:
    """Holds the model once and measures one size at a time."""

    def __init__(self, cfg: Config, device: torch.device, mode: str):
        env = make_env(cfg)
        self.obs_space, self.action_space = env.observation_space, env.action_space
        env.close()
        self.cfg, self.device, self.mode = cfg, device, mode
        self.run_device = device if mode == "real" else torch.device("cpu")
        self.dtype = autocast_dtype(cfg.train.amp, device)
        self.policy: ActorCritic = build_policy(cfg, self.obs_space, self.action_space, self.run_device,
                                                load_weights=False)  # memory does not depend on values
        trainable = [p for p in self.policy.parameters() if p.requires_grad]
        param_bytes = sum(p.numel() * p.element_size() for p in self.policy.parameters())
        grad_bytes = sum(p.numel() * p.element_size() for p in trainable)
        self.static = {"parameters": param_bytes, "gradients": grad_bytes,
                       "optimizer_state": 2 * grad_bytes,  # Adam: exp_avg + exp_avg_sq
                       "buffer": 0, "runtime_overhead": CUDA_RUNTIME_OVERHEAD if device.type == "cuda" else 0}
        per_sample = _random_buffer(self.obs_space, self.action_space, 1, torch.device("cpu")).nbytes()
        self.buffer_bytes_per_sample = per_sample
        if cfg.memory.buffer_device == "device":
            self.static["buffer"] = per_sample * cfg.rollout_size

    def activations(self, kind: str, size: int) -> int:
        """Peak bytes of one micro-batch step (``micro_batch``) or one no-grad chunk (``infer_chunk``)."""
        precision = Precision(self.run_device, self.dtype)
        if self.mode == "fake":
            return self._fake(kind, size, precision)
        try:
            return peak_bytes(lambda: self._step(kind, size, precision), self.run_device)
        except Exception as exc:  # an OOM means: does not fit
            if is_oom(exc):
                return 2**62
            raise

    def _step(self, kind: str, size: int, precision: Precision) -> None:
        buf = _random_buffer(self.obs_space, self.action_space, size, self.run_device)
        if kind == "infer_chunk":
            flat = {k: buf.flat(v) for k, v in buf.obs.items()}
            infer(self.policy, flat, buf.flat(buf.actions), MemorySizes(0, size), self.run_device, precision)
            return
        self.policy.zero_grad(set_to_none=True)
        index = torch.arange(size)
        adv = torch.zeros(size, device=self.run_device)
        setup = UpdateSetup(self.cfg.ppo, MemorySizes(size, size), self.run_device, precision)
        minibatch_gradient(self.policy, buf, index, adv, setup)
        self.policy.zero_grad(set_to_none=True)

    def _fake(self, kind: str, size: int, precision: Precision) -> int:
        from torch._subclasses.fake_tensor import FakeTensorMode
        from torch.distributed._tools.mem_tracker import MemTracker

        with warnings.catch_warnings(), FakeTensorMode(allow_non_fake_inputs=True):
            warnings.simplefilter("ignore")
            tracker = MemTracker()
            tracker.track_external(self.policy)
            with tracker:
                self._step(kind, size, precision)
            snap = tracker.get_tracker_snapshot("peak")
        total = max(d["Total"] for d in snap.values())
        return int(total - self.static["parameters"])

    def measure(self, kind: str, size: int, limit: int) -> Candidate:
        act = self.activations(kind, size)
        breakdown = {**self.static, "activations": act}
        peak = sum(breakdown.values())
        return Candidate(kind, size, peak, peak <= limit, breakdown)


def emulate_smaller_card(budget_bytes: int, device: torch.device) -> None:
    """In real mode on a bigger GPU, cap this process at ``budget_bytes`` so that sizes that
    would not fit the target card really raise out-of-memory here."""
    total = torch.cuda.get_device_properties(device).total_memory
    if budget_bytes < total:
        torch.cuda.set_per_process_memory_fraction(budget_bytes / total, device)


def probe(cfg: Config, budget: str | int, device: str = "cuda", mode: str | None = None,
          margin: float = 0.10) -> ProbeResult:
    """Largest ``memory.micro_batch_size`` and ``memory.infer_chunk_size`` of ``cfg`` under ``budget``."""
    budget_bytes = parse_bytes(budget) if isinstance(budget, str) else int(budget)
    target = torch.device(device)
    present = target.type == "cpu" or torch.cuda.is_available()
    mode = mode or ("real" if present and target.type == "cpu" else "fake" if not present else "real")
    if mode == "real" and not present:
        raise ConfigError(f"--mode real needs the device {device}, which is absent here: use --mode fake")
    if not 0 <= margin < 1:
        raise ConfigError(f"--margin must be in [0, 1), got {margin}")
    limit = int(budget_bytes * (1 - margin))
    if mode == "real" and target.type == "cuda":
        emulate_smaller_card(budget_bytes, target)
    prober = Prober(cfg, target, mode)
    candidates: list[Candidate] = []

    def fits(kind: str):
        def check(size: int) -> bool:
            cand = prober.measure(kind, size, limit)
            candidates.append(cand)
            return cand.fits
        return check

    micro, _ = largest_fitting(fits("micro_batch"), limit=cfg.ppo.minibatch_size)
    chunk, _ = largest_fitting(fits("infer_chunk"), limit=cfg.rollout_size)
    if micro == 0 or chunk == 0:
        base = sum(prober.static.values())
        raise ConfigError(f"nothing fits in {format_bytes(limit)} ({format_bytes(budget_bytes)} minus "
                          f"{margin:.0%} margin): parameters, gradients, optimizer state and buffer alone "
                          f"take {format_bytes(base)}; use a smaller model, AMP, or a larger budget")
    top = max((c for c in candidates if c.fits and ((c.kind == "micro_batch" and c.size == micro) or
                                                     (c.kind == "infer_chunk" and c.size == chunk))),
              key=lambda c: c.peak_bytes)
    amp_name = {None: "off", torch.bfloat16: "bf16", torch.float16: "fp16"}[prober.dtype]
    result = ProbeResult(budget_bytes, limit, str(target), mode, amp_name, micro, chunk, top.peak_bytes,
                         top.breakdown, candidates)
    if cfg.memory.buffer_device == "device":
        act = max(c.breakdown["activations"] for c in candidates
                  if c.fits and c.size in (micro, chunk))
        fixed = sum(v for k, v in prober.static.items() if k != "buffer") + act
        per_step = prober.buffer_bytes_per_sample * cfg.ppo.num_envs
        result.rollout_steps = max(0, (limit - fixed) // per_step)
        for steps in sorted({s for s in (result.rollout_steps, cfg.ppo.num_steps) if s > 0}):
            peak = fixed + per_step * steps
            candidates.append(Candidate("rollout", steps * cfg.ppo.num_envs, peak, peak <= limit,
                                        {**prober.static, "buffer": per_step * steps, "activations": act}))
    return result


# --------------------------------------------------------------------------- reports


def format_table(result: ProbeResult) -> str:
    cols = ["parameters", "gradients", "optimizer_state", "buffer", "activations", "runtime_overhead"]
    head = f"{'kind':12s} {'size':>7s} {'peak':>11s} fits  " + " ".join(f"{c[:11]:>11s}" for c in cols)
    lines = [f"budget {format_bytes(result.budget_bytes)} on {result.device} ({result.mode} mode, amp "
             f"{result.amp}); limit after margin {format_bytes(result.limit_bytes)}", head]
    for c in sorted(result.candidates, key=lambda c: (c.kind, c.size)):
        lines.append(f"{c.kind:12s} {c.size:7d} {format_bytes(c.peak_bytes):>11s} {'yes' if c.fits else 'no ':4s} "
                     + " ".join(f"{format_bytes(c.breakdown.get(k, 0)):>11s}" for k in cols))
    lines.append(f"=> memory.micro_batch_size={result.micro_batch_size} "
                 f"memory.infer_chunk_size={result.infer_chunk_size} (peak {format_bytes(result.peak_bytes)})")
    if result.rollout_steps is not None:
        lines.append(f"=> with the buffer on the device: ppo.num_steps <= {result.rollout_steps}")
    return "\n".join(lines)


def write_json(result: ProbeResult, path: Path) -> None:
    from visppo.checkpoint import atomic_write_text

    atomic_write_text(Path(path), json.dumps(result.to_json(), indent=2))


def plot(result: ProbeResult, path: Path) -> None:
    """Peak memory against size for each kind, with the budget and the margin line."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

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
    tmp = Path(path).with_name(f".{Path(path).name}.tmp{Path(path).suffix}")
    fig.savefig(tmp)
    plt.close(fig)
    tmp.replace(path)
