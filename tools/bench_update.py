"""Speed and peak memory of one PPO update epoch, per micro-batch size and precision.

    python tools/bench_update.py                                   # default task, 84x84
    python tools/bench_update.py env.image_size=84 env.frame_stack=3
    python tools/bench_update.py configs/dot_reach.yaml --micro 32,0 --amp off --json out.json

The rollout buffer is filled with random uint8 frames and random actions /
log-probs / values / advantages / returns (no env stepping), then
``visppo.ppo.update`` runs one epoch over it (``ppo.num_epochs=1``, early
stopping off). Each row is the median of ``--repeats`` timed runs after one
warm-up, the rows' runs interleaved (row 1, row 2, ..., row 1, ...), as update
samples/s (samples = rollout size), its ratio to the first row, and the peak
memory of one update measured in a separate, untimed run (tracking slows every
op). The first row is the baseline a plain PPO would run: fp32, NCHW, the whole
minibatch in one backward, torch's default Adam (a per-parameter loop on CPU);
the second row swaps in visppo's fused Adam, and the rest also use the config's
layout (``train.channels_last``) for the model and the rollout buffer's frames.
Peak memory counts what the update allocates (gradients, gathered batches,
activations), not the parameters and optimizer state that exist before it
(shown in the header).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import time
from pathlib import Path

import gymnasium as gym
import torch

from visppo.atomic import atomic_write_text
from visppo.buffer import RolloutBuffer
from visppo.builders import build_optimizer, build_policy, resolve_device
from visppo.config import Config, load_config
from visppo.envs import make_env, preload_before_gl
from visppo.errors import UserError
from visppo.memory import format_bytes, peak_bytes
from visppo.ppo import MemorySizes, UpdateSetup, update
from visppo.precision import Precision, resolve_precision

DEFAULT_OVERRIDES = ["ppo.minibatch_size=256"]


class Parser(argparse.ArgumentParser):
    """argparse whose own errors are one ``error:`` line too, exit code 2."""

    def error(self, message: str) -> None:
        self.exit(2, f"error: {message} (see --help)\n")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = Parser(description=__doc__.split("\n")[0])
    p.add_argument("args", nargs="*", metavar="[CONFIG] [key=value]",
                   help="a YAML config and/or overrides (defaults: the default task, ppo.minibatch_size=256)")
    p.add_argument("--micro", default="16,32,64,0",
                   help="comma-separated memory.micro_batch_size values; 0 = the whole minibatch")
    p.add_argument("--amp", default="off,bf16", help="comma-separated train.amp values (off, bf16, fp16, auto)")
    p.add_argument("--repeats", type=int, default=5, help="timed runs per row (median reported)")
    p.add_argument("--json", type=Path, default=None, help="also write the rows to this JSON file")
    return p.parse_args(argv)


def load(args: list[str]) -> Config:
    path = None
    if args and "=" not in args[0]:
        path, args = args[0], args[1:]
    return load_config(path, DEFAULT_OVERRIDES + list(args))


def spaces(cfg: Config) -> tuple[gym.spaces.Dict, gym.Space]:
    env = make_env(cfg)
    try:
        return env.observation_space, env.action_space
    finally:
        env.close()


def random_buffer(cfg: Config, obs_space: gym.spaces.Dict, action_space: gym.Space,
                  generator: torch.Generator, channels_last: bool = False,
                  device: torch.device = torch.device("cpu")) -> RolloutBuffer:
    """A rollout buffer full of random frames and plausible-scale random statistics
    (the same contents for the same generator seed, whatever the frames' layout); pinned for a
    CUDA update, as training's is, so micro-batches reach the GPU by the same path."""
    buf = RolloutBuffer(cfg.ppo.num_steps, cfg.ppo.num_envs, obs_space, action_space,
                        pin_memory=device.type == "cuda", channels_last=channels_last)
    for tensor in buf.obs.values():
        if tensor.dtype == torch.uint8:
            tensor.copy_(torch.randint(0, 256, tensor.shape, dtype=torch.uint8, generator=generator))
        else:
            tensor.normal_(generator=generator)
    if isinstance(action_space, gym.spaces.Discrete):
        buf.actions.copy_(torch.randint(0, int(action_space.n), buf.actions.shape, generator=generator))
        buf.logp.uniform_(-3.0, -0.5, generator=generator)
    else:
        buf.actions.normal_(generator=generator)
        buf.logp.normal_(-1.0 * buf.actions.shape[-1], 0.5, generator=generator)
    buf.values.normal_(generator=generator)
    buf.advantages.normal_(generator=generator)
    buf.returns.copy_(buf.values + buf.advantages)
    return buf


@dataclasses.dataclass
class Row:
    name: str
    amp: str
    channels_last: bool
    fused_adam: bool
    micro_batch_size: int
    seconds: list[float]
    samples_per_second: float
    peak_bytes: int
    skipped_steps: int
    ratio: float = 1.0


class DoesNotFit(UserError):
    """A row's micro-batch ran out of memory and the update backed off to a smaller one."""


class Setup:
    """One row's policy, optimizer and update call, built before any timing."""

    def __init__(self, cfg: Config, name: str, amp: str, channels_last: bool, fused: bool, micro: int,
                 device: torch.device, obs_space, action_space, buffer: RolloutBuffer):
        self.name, self.amp, self.channels_last, self.fused, self.device = name, amp, channels_last, fused, device
        precision: Precision = resolve_precision(amp, device)  # ConfigError: not on this device
        cfg = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, channels_last=channels_last))
        torch.manual_seed(cfg.train.seed)
        policy = build_policy(cfg, obs_space, action_space, device, load_weights=False)
        policy.train()
        optimizer = (build_optimizer(cfg, policy) if fused  # visppo's: fused Adam
                     else torch.optim.Adam(policy.parameters(), lr=cfg.ppo.learning_rate, eps=cfg.ppo.adam_eps))
        ppo_cfg = dataclasses.replace(cfg.ppo, num_epochs=1, target_kl=0.0)
        generator = torch.Generator().manual_seed(cfg.train.seed)
        self.micro = micro or cfg.ppo.minibatch_size
        # one epoch never recomputes advantages, so the no-grad chunk is not used: the rollout, not "auto"
        self.sizes = MemorySizes(self.micro, buffer.size)
        setup = UpdateSetup(ppo_cfg, self.sizes, device, precision, generator)
        self.optimizer = optimizer
        self.run = lambda: update(policy, optimizer, buffer, setup)
        self.seconds: list[float] = []
        self.skipped = self.run().skipped_steps  # warm-up: also creates the Adam state, so peaks exclude it
        self.check_fits()

    def check_fits(self) -> None:
        """An out-of-memory halves the micro-batch for the rest of the run (``with_oom_backoff``):
        the row would be timed at a size its label does not give."""
        if self.sizes.micro != self.micro:
            raise DoesNotFit(f"micro-batch {self.micro} does not fit: the update backed off to {self.sizes.micro}")

    def time_once(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        start = time.perf_counter()
        self.skipped += self.run().skipped_steps
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.seconds.append(time.perf_counter() - start)

    def row(self, buffer: RolloutBuffer) -> Row:
        """The row's figures; the peak is measured from no gradients, as the update's first
        ``zero_grad`` leaves it (the last timed run's gradients would hide the new ones on CUDA)."""
        self.optimizer.zero_grad(set_to_none=True)
        peak = peak_bytes(self.run, self.device)
        self.check_fits()
        return Row(self.name, self.amp, self.channels_last, self.fused, self.micro, self.seconds,
                   buffer.size / statistics.median(self.seconds), peak, self.skipped)


def state_bytes(cfg: Config, obs_space, action_space, device: torch.device) -> tuple[int, int]:
    """Parameter bytes and Adam state bytes (two moments per trainable parameter; the step
    counters' few bytes left out)."""
    policy = build_policy(cfg, obs_space, action_space, device, load_weights=False)
    params = sum(p.numel() * p.element_size() for p in policy.parameters())
    return params, 2 * sum(p.numel() * p.element_size() for p in policy.parameters() if p.requires_grad)


def table(rows: list[Row]) -> str:
    head = ("row", "amp", "layout", "adam", "micro", "samples/s", "vs first", "update peak", "median s")
    lines = [[r.name, r.amp, "NHWC" if r.channels_last else "NCHW", "fused" if r.fused_adam else "loop",
              str(r.micro_batch_size),
              f"{r.samples_per_second:.0f}", f"{r.ratio:.2f}x", format_bytes(r.peak_bytes),
              f"{statistics.median(r.seconds):.3f}"] for r in rows]
    widths = [max(len(h), *(len(line[i]) for line in lines)) for i, h in enumerate(head)]

    def fmt(cells: list[str] | tuple[str, ...]) -> str:  # text left, numbers right
        return "  ".join(c.rjust(w) if i >= 4 else c.ljust(w)
                         for i, (c, w) in enumerate(zip(cells, widths, strict=True)))

    out = [fmt(head), fmt(["-" * w for w in widths])]
    out += [fmt(line) for line in lines]
    return "\n".join(out)


def checked(ns: argparse.Namespace) -> tuple[Config, list[int], list[str], torch.device]:
    """The config, micro-batch sizes, AMP settings and device; a UserError on bad input."""
    cfg = load(ns.args)
    try:
        micros = [int(m) for m in ns.micro.split(",") if m.strip()]
    except ValueError as exc:
        raise UserError(f"--micro {ns.micro}: {exc}: give whole numbers, e.g. 16,32,0") from None
    amps = [a.strip() for a in ns.amp.split(",") if a.strip()]
    device = resolve_device(cfg.train.device)
    if ns.repeats < 1 or any(m < 0 for m in micros):
        raise UserError("--repeats must be >= 1 and --micro sizes >= 0")
    if ns.json is not None and not ns.json.parent.is_dir():
        raise UserError(f"--json {ns.json}: folder {ns.json.parent} does not exist")
    if ns.json is not None and ns.json.is_dir():
        raise UserError(f"--json {ns.json} is a folder: give a file name")
    unknown = [a for a in amps if a not in ("off", "bf16", "fp16", "auto")]
    if unknown:
        raise UserError(f"--amp {','.join(unknown)}: give a comma list of off, bf16, fp16, auto")
    return cfg, micros, amps, device


def main(argv: list[str] | None = None) -> int:
    ns = parse_args(argv)
    try:
        cfg, micros, amps, device = checked(ns)
        preload_before_gl()  # before a gymnasium renderer's GL context, as training does
        obs_space, action_space = spaces(cfg)  # an env that cannot be made: refused before any work
    except UserError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if cfg.train.threads:
        torch.set_num_threads(cfg.train.threads)

    # the same contents in both layouts: NCHW frames for the plain rows, the config's layout for the others
    buffers = {cl: random_buffer(cfg, obs_space, action_space, torch.Generator().manual_seed(cfg.train.seed),
                                 channels_last=cl, device=device) for cl in (False, True)}
    buffer = buffers[False]
    params, adam = state_bytes(cfg, obs_space, action_space, device)
    print(f"{cfg.env.id}: pixels {tuple(obs_space['pixels'].shape)}, rollout {buffer.size} "
          f"({cfg.ppo.num_envs} envs x {cfg.ppo.num_steps} steps), minibatch {cfg.ppo.minibatch_size}, "
          f"1 epoch; device {device}, {torch.get_num_threads()} threads, torch {torch.__version__}")
    print(f"parameters {format_bytes(params)}, Adam state {format_bytes(adam)}, "
          f"buffer {format_bytes(buffer.nbytes())} (host); median of {ns.repeats} runs after 1 warm-up",
          flush=True)

    plan = [("baseline", "off", False, False, 0), ("fused Adam", "off", False, True, 0)]
    plan += [(f"micro={m or 'mb'}", amp, cfg.train.channels_last, True, m) for amp in amps for m in micros]
    setups: list[Setup] = []
    for name, amp, channels_last, fused, micro in plan:
        if micro > cfg.ppo.minibatch_size:
            print(f"  skip {name} {amp}: micro-batch {micro} > minibatch {cfg.ppo.minibatch_size}")
            continue
        try:
            setups.append(Setup(cfg, name, amp, channels_last, fused, micro, device, obs_space, action_space,
                                buffers[channels_last]))
        except UserError as exc:  # fp16 on the CPU; a micro-batch that does not fit
            print(f"  skip {name} {amp}: {exc}")
    if not setups or setups[0].name != "baseline":
        print("error: the baseline row (fp32, the whole minibatch) did not fit: lower ppo.minibatch_size",
              file=sys.stderr)
        return 2
    for _ in range(ns.repeats):  # rows interleaved, so a slow minute of the machine hits them all
        for setup in setups:
            setup.time_once()
    rows: list[Row] = []
    for setup in setups:
        try:
            row = setup.row(buffer)
        except DoesNotFit as exc:  # backed off during the timed runs
            print(f"  skip {setup.name} {setup.amp}: {exc}")
            continue
        if not rows and row.name != "baseline":
            break
        row.ratio = row.samples_per_second / rows[0].samples_per_second if rows else 1.0
        rows.append(row)
    if not rows:
        print("error: the baseline row (fp32, the whole minibatch) did not fit: lower ppo.minibatch_size",
              file=sys.stderr)
        return 2
        if row.skipped_steps:
            print(f"  {row.name} {row.amp}: {row.skipped_steps} non-finite steps skipped")
    print()
    print(table(rows))
    if ns.json:
        atomic_write_text(ns.json, json.dumps({  # whole or absent, whatever stops the tool
            "env": cfg.env.id, "pixels": list(obs_space["pixels"].shape), "rollout": buffer.size,
            "minibatch_size": cfg.ppo.minibatch_size, "device": str(device),
            "threads": torch.get_num_threads(), "torch": torch.__version__,
            "param_bytes": params, "adam_bytes": adam,
            "rows": [dataclasses.asdict(r) for r in rows],
        }, indent=2))
        print(f"wrote {ns.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
