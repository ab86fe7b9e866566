"""visppo against Stable-Baselines3's PPO, end to end, side by side on one device (issue 58).

    pip install stable-baselines3   # for this script only; visppo does not need it
    python tools/speed_vs_sb3.py [--device cpu|cuda|auto] [--num-envs 8] [--steps-per-env 256]
        [--minibatch 64] [--epochs 4] [--iterations 5] [--repeats 3] [--threads 0] [--seed 1]
        [--config configs/reacher_pixels.yaml] [--visppo KEY=VALUE]... [--json FILE]

Both learners train on pixel Reacher-v5 (84x84 RGB frames, 3 stacked, the same
renderer settings: the config's ``env.render_samples``) with the Nature CNN
(512 features), the same env count, steps per env, minibatch and epochs, with
their envs in worker processes on the machine's CPUs (forkserver) and the
network on ``--device``:

- visppo: ``visppo train`` on ``--config`` with those sizes as overrides
  (``env.frame_stack=3``, ``train.device``; its other settings are the config's
  and visppo's defaults, e.g. ``train.amp=auto``; ``--visppo`` adds overrides);
- SB3: ``PPO("CnnPolicy")`` over ``VecFrameStack(SubprocVecEnv(...), 3)``, fp32
  (tools/bench_sb3.py's env stack and clock).

Why one script: the ratio of two speeds measured at different times on a shared
machine measures the machine's drift as much as the libraries. Here the runs
alternate (visppo, SB3, visppo, SB3, ...), each in a fresh spawned process, so
drift hits both alike. Each run's figure is the median over ``--iterations``
timed iterations (one warm-up iteration before them is left out); the printed
figure is the median over ``--repeats`` runs, and the ratio is visppo's median
over SB3's. Per iteration it reports the time collecting (acting and env steps)
and the rest (values, update, logging); for SB3 the collect span also holds its
last-value and GAE pass, which visppo counts in its ``values`` phase.

Beside it, the placement that ``visppo bench devices`` recommends for the same
config (visppo.bench: where acting and the update should run), measured first
in the same invocation.

``--json`` gets every figure: the device (and its name on CUDA), torch and SB3
versions, the sizes, each run's figures, the medians and the ratio. It is
rewritten after every repeat (``"complete": false`` until the last), so a run
cut short by a time limit still leaves what it measured.
"""

from __future__ import annotations

import argparse
import datetime
import functools
import importlib.metadata
import importlib.util
import json
import os
import platform
import statistics
import sys
from pathlib import Path

import bench_sb3  # sets MUJOCO_GL=egl unless set: before anything imports mujoco
from bench import isolated, training_figures

from visppo.atomic import atomic_write_text
from visppo.bench import bench_devices, cpu_name, format_devices
from visppo.config import load_config
from visppo.errors import UserError
from visppo.precision import resolve_precision

DEFAULT_CONFIG = Path(__file__).resolve().parents[1] / "configs" / "reacher_pixels.yaml"
FRAME_STACK = 3
IMAGE_SIZE = 84
GOAL = 3.0  # issue 58: visppo >= 3x SB3's end-to-end steps/s on a GPU
# the keys the script sets itself, so that both learners have the same sizes
MATCHED = ("env.id", "env.pixels", "env.image_size", "env.frame_stack", "env.render_samples", "model.encoder",
           "model.feature_dim", "ppo.num_envs", "ppo.num_steps", "ppo.minibatch_size", "ppo.num_epochs",
           "train.device", "train.seed", "train.threads")
# what else --visppo may set: how visppo runs the same work (precision, memory layout, placement),
# never what the work is; train.deterministic goes to SB3's cuDNN settings as well
TUNABLE = ("train.amp", "train.channels_last", "train.deterministic", "memory.", "rollout.", "env.vector",
           "model.encoder_checkpointing")
# what SB3's side does and visppo's config must do too (a --config may set them): one frame a step,
# pixels only, the env's own camera and time limit, every epoch run, one encoder trained from scratch
SB3_SIDE = {"env.action_repeat": 1, "env.state": False, "env.camera": "", "env.max_episode_steps": 0,
            "ppo.target_kl": 0.0, "model.share_encoder": True, "model.freeze_encoder_updates": 0,
            "model.resize": 0, "model.encoder_weights": "none"}


class Parser(argparse.ArgumentParser):
    """argparse whose own errors are one ``error:`` line too, exit code 2."""

    def error(self, message: str) -> None:
        self.exit(2, f"error: {message} (see --help)\n")


class BadInput(ValueError):
    """An option the user must change: one ``error:`` line, exit 2, nothing run or written."""


def parse(argv: list[str] | None):
    """(options, visppo config, resolved device); BadInput on bad input, before anything runs."""
    import torch

    parser = Parser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", choices=("cpu", "cuda", "auto"), default="auto",
                        help="where both learners' networks run; auto: cuda when available (auto)")
    parser.add_argument("--num-envs", type=int, default=8, help="envs of each learner (8)")
    parser.add_argument("--steps-per-env", type=int, default=256, help="rollout steps per env (256)")
    parser.add_argument("--minibatch", type=int, default=64, help="samples per optimizer step (64)")
    parser.add_argument("--epochs", type=int, default=4, help="epochs per iteration (4)")
    parser.add_argument("--iterations", type=int, default=5, help="timed iterations per run, after a warm-up one (5)")
    parser.add_argument("--repeats", type=int, default=3, help="runs per learner, interleaved; medians (3)")
    parser.add_argument("--threads", type=int, default=0, help="torch intra-op threads; 0: torch's default")
    parser.add_argument("--seed", type=int, default=1, help="both learners' seed (1)")
    parser.add_argument("--config", type=Path, default=DEFAULT_CONFIG,
                        help="visppo's config; the sizes above override it (configs/reacher_pixels.yaml)")
    parser.add_argument("--visppo", action="append", default=[], metavar="KEY=VALUE",
                        help="another visppo override (e.g. train.amp=off); not one of the matched sizes")
    parser.add_argument("--json", type=Path, metavar="FILE", help="write every figure here as JSON")
    ns = parser.parse_args(argv)
    for name in ("num_envs", "steps_per_env", "minibatch", "epochs", "iterations", "repeats"):
        if getattr(ns, name) < 1:
            raise BadInput(f"--{name.replace('_', '-')} must be at least 1, got {getattr(ns, name)}")
    if ns.threads < 0 or not 0 <= ns.seed < 2**31:
        raise BadInput(f"--threads must be at least 0 and --seed in 0 .. 2**31 - 1, got {ns.threads} and {ns.seed}")
    if ns.minibatch > ns.num_envs * ns.steps_per_env:
        raise BadInput(f"--minibatch {ns.minibatch} is larger than the rollout --num-envs x --steps-per-env = "
                       f"{ns.num_envs * ns.steps_per_env}: lower it or collect more steps")
    for item in ns.visppo:
        key = item.split("=", 1)[0]
        if "=" not in item or key in MATCHED:
            raise BadInput(f"--visppo {item}: give KEY=VALUE for a key other than the matched sizes "
                           f"({', '.join(MATCHED)}); set those with this script's own options")
        if not key.startswith(TUNABLE):
            raise BadInput(f"--visppo {item}: {key} would change visppo's work and not SB3's; --visppo sets only "
                           f"how visppo runs it ({', '.join(k + ('*' if k.endswith('.') else '') for k in TUNABLE)})")
    if ns.json is not None and not ns.json.parent.is_dir():
        raise BadInput(f"--json {ns.json}: folder {ns.json.parent} does not exist")
    if ns.json is not None and ns.json.is_dir():
        raise BadInput(f"--json {ns.json} is a folder: give a file name, e.g. {ns.json / 'speed_vs_sb3.json'}")
    device = ns.device
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    elif device == "cuda" and not torch.cuda.is_available():
        raise BadInput("--device cuda, but torch sees no CUDA device here: use --device cpu (or auto), "
                       "or run on a machine with a GPU and a CUDA build of torch")
    if not ns.config.is_file():
        raise BadInput(f"--config {ns.config}: no such file")
    overrides = [f"env.image_size={IMAGE_SIZE}", f"env.frame_stack={FRAME_STACK}", "model.encoder=nature",
                 "model.feature_dim=512", f"ppo.num_envs={ns.num_envs}", f"ppo.num_steps={ns.steps_per_env}",
                 f"ppo.minibatch_size={ns.minibatch}", f"ppo.num_epochs={ns.epochs}", f"train.device={device}",
                 f"train.seed={ns.seed}", f"train.threads={ns.threads}", *ns.visppo]
    try:
        cfg = load_config(str(ns.config), overrides)
        resolve_precision(cfg.train.amp, torch.device(device))  # fp16 on a CPU, say: refused before anything runs
    except UserError as exc:
        raise BadInput(str(exc)) from None
    for key, sb3 in SB3_SIDE.items():
        section, name = key.split(".")
        if getattr(getattr(cfg, section), name) != sb3:
            raise BadInput(f"--config {ns.config} sets {key}={getattr(getattr(cfg, section), name)!r}, where SB3's "
                           f"side has {sb3!r}: the two would do different work; use a config without it")
    if cfg.env.id != "Reacher-v5" or not cfg.env.pixels:
        raise BadInput(f"--config {ns.config} trains {cfg.env.id} (pixels={cfg.env.pixels}): the comparison is "
                       "pixel Reacher-v5 (env.id=Reacher-v5, env.pixels=true), as SB3's side builds it")
    # last, so that every other mistake is reported the same with or without SB3 installed
    if importlib.util.find_spec("stable_baselines3") is None:
        raise BadInput("speed_vs_sb3.py needs Stable-Baselines3: pip install stable-baselines3")
    return ns, cfg, device


def visppo_run(cfg, iterations: int) -> dict:
    """One visppo run (its own spawned process): steps/s, collect and rest seconds per iteration."""
    figs = isolated(training_figures, cfg, iterations + 1)  # its first iteration is the warm-up
    iteration_s = cfg.rollout_size / figs["end_to_end_sps"]
    return {"steps_per_s": figs["end_to_end_sps"], "collect_s": figs["time/collect"],
            "update_s": iteration_s - figs["time/collect"],
            "phases_s": {k[5:]: v for k, v in figs.items() if k.startswith("time/")},
            "peak_rss_bytes": figs["peak_rss_bytes"],
            **({"peak_cuda_bytes": figs["peak_cuda_bytes"]} if "peak_cuda_bytes" in figs else {})}


def sb3_run(cfg, iterations: int, device: str) -> dict:
    """One SB3 run (its own spawned process) with the sizes of ``cfg``."""
    fn = functools.partial(bench_sb3.run, num_envs=cfg.ppo.num_envs, n_steps=cfg.ppo.num_steps,
                           batch_size=cfg.ppo.minibatch_size, n_epochs=cfg.ppo.num_epochs,
                           frame_stack=cfg.env.frame_stack, device=device, seed=cfg.train.seed,
                           deterministic=cfg.train.deterministic)
    rate, collect, update = isolated(fn, iterations, cfg.train.threads, cfg.env.render_samples)
    return {"steps_per_s": rate, "collect_s": collect, "update_s": update}


def placement(cfg) -> dict:
    """What ``visppo bench devices`` reports for ``cfg``: per-device timings and the placement."""
    result = isolated(bench_devices, cfg)
    return {**result, "text": format_devices(result)}


def medians(runs: list[dict]) -> dict:
    return {k: statistics.median(r[k] for r in runs) for k in ("steps_per_s", "collect_s", "update_s")}


def figures(ns, cfg, device: str, visppo_runs: list[dict], sb3_runs: list[dict], place: dict,
            complete: bool) -> dict:
    """Everything the JSON holds."""
    import torch

    out: dict = {
        "tool": "tools/speed_vs_sb3.py", "complete": complete, "device": device,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "device_name": torch.cuda.get_device_name(0) if device == "cuda" else cpu_name(),
        "cpu_count": os.cpu_count(), "torch": torch.__version__,
        "stable_baselines3": importlib.metadata.version("stable-baselines3"), "python": platform.python_version(),
        "sizes": {"env": f"{cfg.env.id} pixels", "image_size": cfg.env.image_size, "frame_stack": cfg.env.frame_stack,
                  "render_samples": cfg.env.render_samples, "encoder": cfg.model.encoder,
                  "feature_dim": cfg.model.feature_dim, "num_envs": cfg.ppo.num_envs,
                  "steps_per_env": cfg.ppo.num_steps, "rollout": cfg.rollout_size,
                  "minibatch": cfg.ppo.minibatch_size, "epochs": cfg.ppo.num_epochs,
                  "timed_iterations": ns.iterations, "repeats": ns.repeats, "threads": ns.threads, "seed": ns.seed},
        "visppo": {"config": str(ns.config), "overrides": ns.visppo, "env_vector": cfg.env.vector,
                   "rollout_device": cfg.rollout.device,
                   "amp": resolve_precision(cfg.train.amp, torch.device(device)).name.replace("off", "fp32"), "runs": visppo_runs},
        "sb3": {"policy": "CnnPolicy", "vec_env": f"VecFrameStack(SubprocVecEnv forkserver, {cfg.env.frame_stack})",
                "amp": "fp32", "runs": sb3_runs},
        "cudnn_deterministic": cfg.train.deterministic,  # both sides (SB3's seed would switch it on for SB3 alone)
        "definitions": {"steps_per_s": "env steps per second end to end, median over timed iterations, then runs",
                        "collect_s": "seconds per iteration collecting (SB3: with its last-value and GAE pass)",
                        "update_s": "the rest of the iteration: values, update, logging"},
        "goal_ratio": GOAL,
    }
    if visppo_runs:
        out["visppo"]["median"] = medians(visppo_runs)
    if sb3_runs:
        out["sb3"]["median"] = medians(sb3_runs)
    if visppo_runs and sb3_runs:
        out["ratio"] = out["visppo"]["median"]["steps_per_s"] / out["sb3"]["median"]["steps_per_s"]
        out["ratio_per_repeat"] = [a["steps_per_s"] / b["steps_per_s"] for a, b in zip(visppo_runs, sb3_runs)]
    out["placement"] = place
    return out


def summary(fig: dict) -> str:
    s = fig["sizes"]
    lines = [f"pixel {s['env'].split()[0]} {s['image_size']}x{s['image_size']}, {s['frame_stack']} frames, "
             f"{s['encoder']} CNN {s['feature_dim']}; {s['num_envs']} envs x {s['steps_per_env']} steps, minibatch "
             f"{s['minibatch']}, {s['epochs']} epochs; on {fig['device']} ({fig['device_name']}); medians of "
             f"{s['repeats']} runs x {s['timed_iterations']} timed iterations"]
    for name, key in (("visppo", "visppo"), ("SB3", "sb3")):
        learner = fig[key]
        if "median" not in learner:
            continue
        m = learner["median"]
        runs = ", ".join(f"{r['steps_per_s']:.0f}" for r in learner["runs"])
        lines.append(f"  {name:6s} {m['steps_per_s']:8.0f} steps/s (runs: {runs}); per iteration: collect "
                     f"{m['collect_s']:.2f} s, rest {m['update_s']:.2f} s ({learner['amp']})")
    if "ratio" in fig:
        lines.append(f"  visppo / SB3: {fig['ratio']:.2f}x (goal >= {GOAL:.0f}x: "
                     f"{'met' if fig['ratio'] >= GOAL else 'not met'})")
    if "placement" in fig:
        lines.append("visppo bench devices on this config:")
        lines += ["  " + line for line in fig["placement"]["text"].splitlines()]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    try:
        ns, cfg, device = parse(argv)
    except BadInput as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    def save(fig: dict) -> None:
        if ns.json is not None:
            atomic_write_text(ns.json, json.dumps(fig, indent=2) + "\n")

    place = placement(cfg)  # first, saved and printed at once, so that a run cut short still has it
    save(figures(ns, cfg, device, [], [], place, complete=False))
    print(place["text"], flush=True)
    visppo_runs: list[dict] = []
    sb3_runs: list[dict] = []
    for _ in range(ns.repeats):  # interleaved: drift on the machine hits both learners alike
        visppo_runs.append(visppo_run(cfg, ns.iterations))
        sb3_runs.append(sb3_run(cfg, ns.iterations, device))
        print(f"repeat {len(sb3_runs)}/{ns.repeats}: visppo {visppo_runs[-1]['steps_per_s']:.0f} steps/s, "
              f"SB3 {sb3_runs[-1]['steps_per_s']:.0f} steps/s", flush=True)
        save(figures(ns, cfg, device, visppo_runs, sb3_runs, place, complete=False))
    fig = figures(ns, cfg, device, visppo_runs, sb3_runs, place, complete=True)
    save(fig)
    print(summary(fig))
    return 0


if __name__ == "__main__":
    sys.exit(main())
