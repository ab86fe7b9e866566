"""The learning table: train configs over seeds, then tabulate returns at fixed step counts.

    python tools/learning_table.py run configs/balance.yaml configs/push.yaml --seeds 1 2 3 \\
        --out runs/table [--parallel 2] [key=value ...]
    python tools/learning_table.py table runs/table --at 100k 250k 500k [--markdown F] [--plot F]
        [--column eval/success]
    python tools/learning_table.py table runs/abl/base runs/abl/norm_reward --at 100k --plot F [--per-seed]

``run`` trains every config with every seed (``train.seed=S``, ``train.threads=1``, at most
``--parallel`` at once: on 2 cores, 2), each in ``OUT/<config>/seed<S>``, logs in its run
directory; a run that already finished is skipped, one that stopped is resumed.
``table`` reads every ``OUT/<config>/seed*/metrics.csv`` and prints, per config and step
count, the mean and standard deviation over seeds of the training-rollout return (and success
where the task reports it; the mean of the last 100 episodes, as logged), the evaluation
return where periodic evaluation ran, the wall-clock minutes, and, where one exists for the
same task and step budget, a published figure with its source. ``--plot`` draws the curves as
mean +- std bands over seeds. ``--per-seed`` adds each seed's return after the mean, in seed
order, so a later run of one seed can be set beside the same seed of an earlier table.

An ablation is one ``run`` folder per variant (``--out runs/abl/<variant>`` with the variant's
``key=value``): ``table`` given several folders labels each row ``config (variant)`` and draws
the variants of a config in one panel, side by side.
"""

from __future__ import annotations

import argparse
import csv
import math
import statistics
import subprocess
import sys
import time
import warnings
from pathlib import Path

PUBLISHED = {
    # env.id -> {steps: [(method, score, source)]}; agent steps (500k agent steps = 1M frames)
    "dmc:reacher-easy": {500_000: [("SB3 PPO CnnPolicy", 113, "MR.Q, Table 6"), ("DrQ-v2", 938, "MR.Q, Table 6")]},
    "dmc:cartpole-balance": {500_000: [("SB3 PPO CnnPolicy", 353, "MR.Q, Table 6"), ("DrQ-v2", 993, "MR.Q, Table 6")]},
    "dmc:cartpole-swingup": {500_000: [("SB3 PPO CnnPolicy", 596, "MR.Q, Table 6"), ("DrQ-v2", 864, "MR.Q, Table 6")]},
    "dmc:finger-spin": {500_000: [("SB3 PPO CnnPolicy", 241, "MR.Q, Table 6"), ("DrQ-v2", 860, "MR.Q, Table 6")]},
    "dmc:walker-walk": {500_000: [("SB3 PPO CnnPolicy", 47, "MR.Q, Table 6"), ("DrQ-v2", 766, "MR.Q, Table 6")]},
    "dmc:cheetah-run": {500_000: [("SB3 PPO CnnPolicy", 155, "MR.Q, Table 6"), ("DrQ-v2", 728, "MR.Q, Table 6")]},
}
"""Published figures (MR.Q paper, Fujimoto et al. 2025, Table 6; 10 seeds)."""


def parse_steps(text: str) -> int:
    """'100k' -> 100000, '2M' -> 2000000, '5e5' -> 500000."""
    scale = {"k": 1_000, "m": 1_000_000}.get(text[-1].lower(), 1)
    return int(float(text[:-1] if scale > 1 else text) * scale)


# --------------------------------------------------------------------------- run


def run_dir_of(out: Path, config: Path, seed: int) -> Path:
    return out / config.stem / f"seed{seed}"


def command(config: Path, seed: int, run_dir: Path, overrides: list[str]) -> list[str]:
    """The training command of one (config, seed): a new run, or the resumption of a stopped one."""
    visppo = [sys.executable, "-m", "visppo", "train"]
    if (run_dir / "checkpoints" / "latest.pt").is_file():
        return [*visppo, "--resume", str(run_dir)]
    return [*visppo, str(config), f"train.seed={seed}", "train.threads=1", "run.progress=false",
            f"run.dir={run_dir}", *overrides]


def finished(run_dir: Path) -> bool:
    """The run reached its ppo.total_steps (its last metrics row is at or past it)."""
    import yaml

    config, metrics = run_dir / "config.yaml", run_dir / "metrics.csv"
    if not (config.is_file() and metrics.is_file()):
        return False
    total = yaml.safe_load(config.read_text())["ppo"]["total_steps"]
    rows = list(csv.DictReader(metrics.open()))
    return bool(rows) and int(rows[-1]["global_step"]) >= total


def run_all(configs: list[Path], seeds: list[int], out: Path, parallel: int, overrides: list[str]) -> int:
    """Train every (config, seed) not finished yet, ``parallel`` at a time; returns the failures."""
    todo = [(c, s) for c in configs for s in seeds if not finished(run_dir_of(out, c, s))]
    running: list[tuple[subprocess.Popen, Path]] = []
    failures = 0
    while todo or running:
        while todo and len(running) < parallel:
            config, seed = todo.pop(0)
            run_dir = run_dir_of(out, config, seed)
            run_dir.parent.mkdir(parents=True, exist_ok=True)
            log = (run_dir.parent / f"seed{seed}.log").open("a")
            cmd = command(config, seed, run_dir, overrides)
            print("start:", " ".join(cmd), flush=True)
            running.append((subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT), run_dir))
        time.sleep(5)
        for proc, run_dir in list(running):
            if proc.poll() is not None:
                running.remove((proc, run_dir))
                failures += proc.returncode != 0
                print(f"done ({proc.returncode}): {run_dir}", flush=True)
    return failures


# --------------------------------------------------------------------------- table


def read_rows(run_dir: Path) -> list[dict[str, float]]:
    def num(v: str) -> float:
        try:
            return float(v)
        except (TypeError, ValueError):
            return math.nan
    return [{k: num(v) for k, v in r.items()} for r in csv.DictReader((run_dir / "metrics.csv").open())]


def value_at(rows: list[dict[str, float]], column: str, step: int) -> float:
    """The last finite value of ``column`` logged at or before ``step`` (NaN if the run is shorter)."""
    if not rows or rows[-1]["global_step"] < step * 0.98:  # within the last iteration's rounding
        return math.nan
    found = [r[column] for r in rows if r["global_step"] <= step * 1.02 and math.isfinite(r.get(column, math.nan))]
    return found[-1] if found else math.nan


def wall_minutes(rows: list[dict[str, float]], step: int) -> float:
    """Minutes of training up to ``step``: the sum over iterations of rollout / steps-per-second."""
    total, previous = 0.0, 0.0
    for r in rows:
        if r["global_step"] > step * 1.02:
            break
        total += (r["global_step"] - previous) / r["steps_per_second"]
        previous = r["global_step"]
    return total / 60


def groups(outs: list[Path]) -> list[tuple[str, str, list[Path]]]:
    """(config, variant, seed run dirs) per config folder of each ``run`` folder; the variant is
    the ``run`` folder's name when several are compared, else empty."""
    found = []
    for out in outs:
        for group in sorted(p for p in out.iterdir() if p.is_dir()):
            runs = sorted(d for d in group.glob("seed*") if (d / "metrics.csv").is_file())
            if runs:
                found.append((group.name, out.name if len(outs) > 1 else "", runs))
    return sorted(found, key=lambda g: g[0])  # a config's variants together, in the folders' order


def summarize(outs: list[Path], steps: list[int]) -> list[dict]:
    """One row per (config, variant, step count): mean and std over seeds of each measured figure."""
    import yaml

    table = []
    for config, variant, runs in groups(outs):
        env = yaml.safe_load((runs[0] / "config.yaml").read_text())["env"]
        env_id, look = env["id"], (env.get("kwargs") or {}).get("look")  # dmc: which look drew the frames
        rows = {d.name: read_rows(d) for d in sorted(runs, key=_seed_number)}
        for step in steps:
            row = {"config": f"{config} ({variant})" if variant else config, "env": env_id, "look": look, "steps": step, "seeds": 0}
            for column in ("episode_return", "episode_success", "eval/return", "eval/success"):
                seeds = {name: v for name, r in rows.items() if math.isfinite(v := value_at(r, column, step))}
                row[column], row[f"{column}/seeds"] = _mean_std(list(seeds.values())), seeds
                if column == "episode_return":
                    row["seeds"] = len(seeds)
            row["minutes"] = _mean_std([wall_minutes(r, step) for r in rows.values()
                                        if math.isfinite(value_at(r, "episode_return", step))])
            row["published"] = published_at(env_id, step)
            table.append(row)
    return table


def published_at(env_id: str, step: int) -> list[tuple[str, float, str]]:
    """The published figures for ``env_id`` at a budget that ``step`` reaches within one percent:
    a rollout rarely divides the budget, so a 500k run's last row is at 500,736 (8 x 128 x 489)."""
    for budget, figures in PUBLISHED.get(env_id, {}).items():
        if budget <= step <= budget * 1.01:
            return figures
    return []


def _seed_number(run_dir: Path) -> int:
    """'seed12' -> 12, so seeds sort as numbers (seed2 before seed10)."""
    digits = run_dir.name.removeprefix("seed")
    return int(digits) if digits.isdigit() else 0


def _mean_std(values: list[float]) -> tuple[float, float, int]:
    if not values:
        return (math.nan, math.nan, 0)
    return (statistics.fmean(values), statistics.stdev(values) if len(values) > 1 else 0.0, len(values))


def markdown(table: list[dict], per_seed: bool = False) -> str:
    """The table as markdown; ``per_seed`` adds each seed's return, e.g. ``4.00 ± 1.41 (3, 5)``."""
    def cell(ms: tuple[float, float, int], digits: int = 2) -> str:
        mean, std, n = ms
        return "" if n == 0 else f"{mean:.{digits}f} ± {std:.{digits}f}"

    def returns(r: dict, column: str) -> str:
        text = cell(r[column])
        if per_seed and text:
            text += " (" + ", ".join(f"{v:.3g}" for v in r[f"{column}/seeds"].values()) + ")"
        return text

    lines = ["| config | env | steps | seeds | return (train) | success (train) | return (eval) | "
             "success (eval) | minutes | published |", "|" + " --- |" * 10]
    for r in table:
        if not r["seeds"]:
            continue
        published = "; ".join(f"{m} {s} ({src})" for m, s, src in r["published"])
        env = f"`{r['env']}`" + (f" ({r['look']} look)" if r.get("look") else "")
        lines.append(f"| {r['config']} | {env} | {r['steps']:,} | {r['seeds']} | "
                     f"{returns(r, 'episode_return')} | {cell(r['episode_success'])} | {returns(r, 'eval/return')} | "
                     f"{cell(r['eval/success'])} | {cell(r['minutes'], 0)} | {published} |")
    return "\n".join(lines)


def plot(outs: list[Path], path: Path, column: str = "episode_return") -> None:
    """A panel per config, a curve per variant: mean +- std over seeds, on a common step grid."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    found = groups(outs)
    configs = list(dict.fromkeys(config for config, _, _ in found))
    fig, axes = plt.subplots(1, len(configs), figsize=(4.5 * len(configs), 3.5), squeeze=False)
    for ax, config in zip(axes[0], configs):
        for _, variant, runs in (g for g in found if g[0] == config):
            _band(ax, [read_rows(d) for d in runs], column, variant)
        ax.set_title(config)
        ax.set_xlabel("env steps")
        ax.set_ylabel(column)
        ax.grid(alpha=0.3)
        ax.legend(fontsize="small")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def _band(ax, runs: list[list[dict[str, float]]], column: str, name: str) -> None:
    """One variant's mean curve and its +- std band over seeds."""
    import numpy as np

    end = min(r[-1]["global_step"] for r in runs)
    grid = np.linspace(0, end, 100)
    curves = []
    for r in runs:
        points = [(x["global_step"], x[column]) for x in r if math.isfinite(x.get(column, math.nan))]
        xs, ys = zip(*points) if points else ((0.0,), (math.nan,))
        curves.append(np.interp(grid, xs, ys, left=math.nan))
    curves = np.array(curves)
    with warnings.catch_warnings():  # before a run's first episode ends, no seed has a value
        warnings.simplefilter("ignore", RuntimeWarning)
        mean, std = np.nanmean(curves, 0), np.nanstd(curves, 0)
    line, = ax.plot(grid, mean, label=f"{name + ', ' if name else ''}{len(runs)} seed(s)")
    ax.fill_between(grid, mean - std, mean + std, alpha=0.25, color=line.get_color())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run", help="train configs x seeds",
                       description="Train every config with every seed; key=value overrides apply to all runs.")
    r.add_argument("configs", nargs="+", type=Path, help="config files, then any key=value overrides")
    r.add_argument("--seeds", nargs="+", type=int, default=[1, 2, 3], help="train.seed values (default: 1 2 3)")
    r.add_argument("--out", type=Path, required=True, help="folder for the runs: OUT/<config>/seed<S>")
    r.add_argument("--parallel", type=int, default=2,
                   help="runs at once, each with train.threads=1 (default 2: one per core on this machine)")
    t = sub.add_parser("table", help="tabulate a run folder")
    t.add_argument("out", type=Path, nargs="+", help="run folders; several: one per variant of an ablation")
    t.add_argument("--at", nargs="+", default=["100k", "250k", "500k"],
                   help="step counts for the rows: each column's last value logged by then, within 2%% (default 100k 250k 500k)")
    t.add_argument("--markdown", type=Path, help="also write the table to this file")
    t.add_argument("--plot", type=Path, help="draw the curves (mean +- std over seeds) to this image")
    t.add_argument("--column", default="episode_return",
                   help="metrics.csv column to plot, e.g. eval/success (default: episode_return)")
    t.add_argument("--per-seed", action="store_true", help="add each seed's return after the mean, in seed order")
    ns, rest = parser.parse_known_args(argv)
    if ns.cmd == "run":
        configs = [c for c in ns.configs if c.suffix in (".yaml", ".yml")]
        overrides = [str(c) for c in ns.configs if c.suffix not in (".yaml", ".yml")] + rest
        missing = [c for c in configs if not c.is_file()]
        if missing or not configs:
            print(f"error: config file(s) not found: {', '.join(map(str, missing)) or 'none given'}", file=sys.stderr)
            return 2
        return 1 if run_all(configs, ns.seeds, ns.out, ns.parallel, overrides) else 0
    missing = [str(o) for o in ns.out if not o.is_dir()]
    if rest or missing:
        print(f"error: {'unknown arguments ' + ' '.join(rest) if rest else ', '.join(missing) + ' is not a folder'}",
              file=sys.stderr)
        return 2
    text = markdown(summarize(ns.out, [parse_steps(s) for s in ns.at]), ns.per_seed)
    print(text)
    if ns.markdown:
        ns.markdown.write_text(text + "\n")
    if ns.plot:
        plot(ns.out, ns.plot, ns.column)
    return 0


if __name__ == "__main__":
    sys.exit(main())
