"""``visppo bench devices``: where should rollout and training run?

Times, on each available device, one rollout forward (a batch of
``ppo.num_envs`` observations from host memory in one pass) and one
micro-batch forward+backward (as the update does; with ``memory.micro_batch_size=auto``,
the probe's size under ``memory.budget`` on that device), with the config's AMP and
channels_last settings. Training goes to the GPU only when its
forward+backward is clearly faster there (>= 1.5x): a GPU that is barely faster
does not pay for the copies and the second policy.
"""

from __future__ import annotations

import platform
import statistics
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import numpy as np
import torch

from visppo.builders import build_policy
from visppo.config import Config
from visppo.envs import make_env
from visppo.policy import ActorCritic
from visppo.precision import acting_precision
from visppo.probe import probe

CLEARLY_FASTER = 1.5


def _median_seconds(fn: Callable[[], None], device: torch.device, repeats: int) -> float:
    fn()  # warm-up: allocator, kernels, cuDNN autotune
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def random_obs(obs_space, n: int) -> dict[str, torch.Tensor]:
    """A batch of random observations in host memory, uint8 frames as the buffer holds them."""
    out = {}
    for key, space in obs_space.spaces.items():
        if space.dtype == np.uint8:
            out[key] = torch.randint(0, 256, (n, *space.shape), dtype=torch.uint8)
        else:
            out[key] = torch.randn(n, *space.shape)
    return out


def micro_batch_on(cfg: Config, device: torch.device) -> int:
    """The micro-batch training would use on ``device``: ``memory.micro_batch_size=auto`` asks the
    probe for the largest under ``memory.budget`` (fake mode), as ``visppo train`` does at start-up."""
    if cfg.memory.micro_batch_size != "auto":
        return cfg.micro_batch
    if cfg.train.amp == "fp16" and device.type != "cuda":  # the precision the row is timed in
        cfg = replace(cfg, train=replace(cfg.train, amp="auto"))
    return probe(cfg, cfg.memory.budget, str(device), mode="fake").micro_batch_size


def bench_devices(cfg: Config, repeats: int = 5) -> dict:
    """Median seconds of one act pass and one micro-batch update per device, and a placement."""
    env = make_env(cfg)
    obs_space, action_space = env.observation_space, env.action_space
    env.close()
    devices = [torch.device("cpu")] + ([torch.device("cuda")] if torch.cuda.is_available() else [])
    rows = []
    for device in devices:
        precision = acting_precision(cfg.train.amp, device)
        policy: ActorCritic = build_policy(cfg, obs_space, action_space, device, load_weights=False)
        act_obs = random_obs(obs_space, cfg.ppo.num_envs)
        micro = micro_batch_on(cfg, device)
        upd_obs = {k: v.to(device) for k, v in random_obs(obs_space, micro).items()}
        with torch.no_grad():
            actions, _, _ = policy.act(upd_obs)

        def act() -> None:
            with torch.inference_mode(), precision.autocast():
                policy.act({k: v.to(device, non_blocking=True) for k, v in act_obs.items()})[0].cpu()

        def update() -> None:
            policy.zero_grad(set_to_none=True)
            with precision.autocast():
                logp, entropy, value = policy.score_actions(upd_obs, actions)
            (logp.sum() + value.sum() + entropy.sum()).backward()

        rows.append({"device": str(device), "amp": precision.name,
                     "act_seconds": _median_seconds(act, device, repeats),
                     "act_batch": cfg.ppo.num_envs,
                     "update_seconds": _median_seconds(update, device, repeats),
                     "micro_batch": micro})
    train_on, act_on = placement(rows)
    return {"rows": rows, "train.device": train_on, "rollout.device": act_on}


def cpu_name() -> str:
    """The CPU's model name (Linux's /proc/cpuinfo), else what ``platform`` knows: a timing's or a
    measurement's JSON says what machine made it."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def placement(rows: list[dict]) -> tuple[str, str]:
    """(train.device, rollout.device) from the timed rows: the update goes to the GPU when it is
    clearly faster per sample (the sizes may differ by device), acting when it is faster at all
    (acting's batch is small, so the GPU's launch and copy overheads can lose to the CPU)."""
    by_device = {r["device"]: r for r in rows}
    if "cuda" not in by_device:
        return "cpu", "cpu"
    cpu, gpu = by_device["cpu"], by_device["cuda"]
    per_sample = {d: r["update_seconds"] / r["micro_batch"] for d, r in (("cpu", cpu), ("cuda", gpu))}
    train_on = "cuda" if per_sample["cpu"] >= CLEARLY_FASTER * per_sample["cuda"] else "cpu"
    act_on = "cuda" if gpu["act_seconds"] < cpu["act_seconds"] else "cpu"
    return train_on, act_on


def format_devices(result: dict) -> str:
    lines = [f"{'device':8s} {'amp':9s} {'act (batch)':>18s} {'fwd+bwd (micro-batch)':>26s}"]
    for r in result["rows"]:
        lines.append(f"{r['device']:8s} {r['amp']:9s} {r['act_seconds'] * 1e3:11.2f} ms ({r['act_batch']:3d})"
                     f" {r['update_seconds'] * 1e3:15.2f} ms ({r['micro_batch']:4d})")
    lines.append(f"recommended: train.device={result['train.device']} rollout.device={result['rollout.device']}"
                 + ("" if len(result["rows"]) > 1 else "  (no CUDA device here)"))
    return "\n".join(lines)
