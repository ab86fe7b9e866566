"""The learning table: train configs over seeds, evaluate each final policy, tabulate the returns.

    python tools/learning_table.py run configs/dmc_*.yaml --seeds 1 2 3 --out runs/table \\
        [--parallel 2] [--eval-episodes 10] [key=value ...]
    python tools/learning_table.py table runs/table [--at 100k 250k 500k] [--markdown F] [--plot F]
        [--column episode_return] [--per-seed] [--reps 50000]
    python tools/learning_table.py table runs/abl/base runs/abl/norm_reward --at 100k --plot F

``run`` trains every config with every seed (``train.seed=S``, ``train.threads=1``, at most
``--parallel`` at once: on 2 cores, 2), each in ``OUT/<config>/seed<S>``, logs in
``OUT/<config>/seed<S>.log``; a run that already finished is skipped, one that stopped is
resumed, and a run folder there that another config, seed or override started is refused. When a run finishes, its final policy is evaluated::

    visppo eval RUN --episodes N --deterministic --seed 0 --json RUN/final_eval.json

(``N``: ``--eval-episodes``); a finished run without ``final_eval.json`` is evaluated by the
next ``run``. ``--keep DIR`` copies each evaluated run's small files (config.yaml,
metrics.csv, final_eval.json: what ``table`` reads) into ``DIR/<config>/seed<S>``, a folder
small enough to commit, and skips every (config, seed) whose copy is there already: a table
that takes longer than the machine keeps its run folders goes on from what was kept.

``table`` reads every ``OUT/<config>/seed*`` run and prints two tables and a summary line:

- the training curve, per config and step count (``--at``, read at the first row at or after
  the step): the mean and sample standard deviation over seeds (a one-seed cell: the value
  alone) of the training-rollout return (and success where the task reports it; the mean of
  the last 100 episodes, as logged), the periodic evaluation return where it ran, the
  wall-clock minutes, and the published figures at that budget. ``--plot`` draws the curves as
  mean +- sample std bands over seeds (none for one seed; ``--column``: which metrics.csv column);
- the final policy, per config (task) and variant: the mean +- std over seeds of
  ``final_eval.json``'s ``mean_return``, the number of seeds, the look
  (``env.kwargs.look`` in the run's config.yaml; ``published``, the suite's own, for a suite task
  without one; ``default`` for other envs), the budget
  (``ppo.total_steps``) and the published figures at that budget;
- per variant, the interquartile mean (IQM) of the final returns across DeepMind Control
  tasks with its 95% stratified bootstrap interval (``rliable``: ``aggregate_iqm``,
  ``get_interval_estimates``, ``--reps`` resamples). Scores are the **raw** returns, the
  suite's 0-1000 scale (the convention for DMC): they are not normalised, so other tasks,
  whose returns share no scale, are left out of it. The IQM takes the seeds every DMC task of
  the variant has, one score per (task, seed), and names the runs it leaves out; tasks resample
  their runs separately. A task is an env.id and look: a variant with two configs of one task
  is refused (it would count that task twice). The resampling is seeded, so the interval is the same every printing.

``--per-seed`` adds each seed's return after the mean, in seed order, so a later run of one
seed can be set beside the same seed of an earlier table. ``--markdown F`` writes what is
printed to F.

An ablation is one ``run`` folder per variant (``--out runs/abl/<variant>`` with the variant's
``key=value``): ``table`` given several folders labels each row ``config (variant)``, draws
the variants of a config in one panel, side by side, and gives each variant its own IQM.

Bad input (a missing config or folder, a step count that is not one, a run folder without its
config.yaml, ``--parallel 0``, a run folder under ``--out`` that another recipe started, two configs
of one DMC task in a variant) prints one ``error:`` line and exits with 2, writing nothing.
"""

from __future__ import annotations

import argparse
import csv
import io
import json
import math
import os
import re
import shutil
import statistics
import subprocess
import sys
import time
import warnings
from pathlib import Path

SOURCE = "MR.Q, Table 6"
PUBLISHED = {
    # env.id -> {steps: [(method, score, source)]}; agent steps (500k agent steps = 1M frames)
    f"dmc:{task}": {500_000: [("SB3 PPO CnnPolicy", ppo, SOURCE), ("DrQ-v2", drq, SOURCE)]}
    for task, ppo, drq in [
        ("reacher-easy", 113, 938), ("cartpole-balance", 353, 993), ("cartpole-swingup", 596, 864),
        ("finger-spin", 241, 860), ("walker-walk", 47, 766), ("cheetah-run", 155, 728),
        ("ball_in_cup-catch", 105, 909), ("finger-turn_easy", 189, 503), ("walker-run", 39, 546),
        ("reacher-hard", 10, 705),
    ]
}
"""Published figures (MR.Q paper, Fujimoto et al. 2025, Table 6, the suite's own look; 10 seeds)."""

FINAL_EVAL = "final_eval.json"
KEPT = ("config.yaml", "metrics.csv", FINAL_EVAL)
"""What ``--keep`` copies of a run, ``final_eval.json`` last: its presence marks a whole copy."""
EVAL_SEED = 0
POLL_SECONDS = 1.0
PANELS_PER_ROW = 5  # the plot wraps its panels (one per config) into rows of this many


class UsageError(Exception):
    """Bad input: reported as one ``error:`` line, exit code 2."""


class Parser(argparse.ArgumentParser):
    """argparse whose own errors take the same one-line form."""

    def error(self, message: str) -> None:
        self.exit(2, f"error: {message} (see learning_table.py --help)\n")


def parse_steps(text: str) -> int:
    """'100k' -> 100000, '2M' -> 2000000, '5e5' -> 500000."""
    scale = {"k": 1_000, "m": 1_000_000}.get(text[-1:].lower(), 1)
    try:
        steps = int(float(text[:-1] if scale > 1 else text) * scale)
    except (ValueError, OverflowError):  # OverflowError: 1e400, inf
        raise UsageError(f"--at {text!r} is not a step count (e.g. 100k, 2M, 5e5, 102400)") from None
    if steps <= 0:
        raise UsageError(f"--at {text!r}: a step count must be positive")
    return steps


# --------------------------------------------------------------------------- run


def run_dir_of(out: Path, config: Path, seed: int) -> Path:
    return out / config.stem / f"seed{seed}"


def run_overrides(seed: int, run_dir: Path, overrides: list[str]) -> list[str]:
    """What a new run of one (config, seed) is given on top of its config file."""
    return [f"train.seed={seed}", "train.threads=1", "run.progress=false", f"run.dir={run_dir}", *overrides]


def train_command(config: Path, seed: int, run_dir: Path, overrides: list[str]) -> list[str]:
    """The training command of one (config, seed): a new run, or the resumption of a stopped one."""
    from visppo.config import RESUMABLE

    visppo = [sys.executable, "-m", "visppo", "train"]
    given = run_overrides(seed, run_dir, overrides)
    if (run_dir / "checkpoints" / "latest.pt").is_file():  # with the keys a resume takes (the devices)
        return [*visppo, "--resume", str(run_dir), *(o for o in given if o.split("=", 1)[0].strip() in RESUMABLE)]
    return [*visppo, str(config), *given]


def check_existing_runs(configs: list[Path], seeds: list[int], out: Path, overrides: list[str],
                        keep: Path | None = None) -> None:
    """A run folder already under ``out`` (or kept under ``keep``, which ``run`` then skips) must be
    the run this command would start: else ``run`` would count it finished, or resume it, with its
    old settings, and the table would mix two. The
    keys a resume may change (``train.threads``, ``run.*``, the devices) may differ, and the resume
    is given this command's; ``ppo.total_steps`` and ``train.amp`` may not (one table, one budget and
    one precision)."""
    from visppo.config import RESUMABLE, differences, load_config
    from visppo.errors import UserError

    free = {"run.dir", *RESUMABLE} - {"ppo.total_steps", "train.amp"}

    for seed in seeds:
        for config, folder in ((c, f) for c in configs for f in (out, keep) if f is not None):
            run_dir = run_dir_of(folder, config, seed)
            saved = run_dir / "config.yaml"
            if not saved.is_file():
                continue
            try:
                theirs = load_config(saved, [f"run.dir={run_dir}"])
            except (UserError, OSError) as exc:
                raise UsageError(f"{run_dir} cannot be compared with this command: its config.yaml does not load "
                                 f"here (an older visppo's, or damaged: {type(exc).__name__}): give another "
                                 "--out, or move that run away") from None
            mine = load_config(config, run_overrides(seed, run_dir, overrides))
            for name, value, old in differences(mine, theirs):
                if name not in free:
                    raise UsageError(f"{run_dir} was started with {name}={old}, this command gives {value}: "
                                     "give another --out, or move that run away")


def eval_command(run_dir: Path, episodes: int) -> list[str]:
    """The final policy's evaluation: deterministic, evaluation stream 0, into RUN/final_eval.json."""
    return [sys.executable, "-m", "visppo", "eval", str(run_dir), "--episodes", str(episodes),
            "--deterministic", "--seed", str(EVAL_SEED), "--json", str(run_dir / FINAL_EVAL)]


def finished(run_dir: Path) -> bool:
    """The run reached its ppo.total_steps: its last metrics row is at or past it, and so is its
    latest checkpoint where it has one (a run writes its last row before its last checkpoint, and
    a kill between the two must resume it, not evaluate the checkpoint before)."""
    import torch
    import yaml

    config, metrics = run_dir / "config.yaml", run_dir / "metrics.csv"
    if not (config.is_file() and metrics.is_file()):
        return False
    total = yaml.safe_load(config.read_text())["ppo"]["total_steps"]
    rows = read_rows(run_dir)
    if not rows or rows[-1]["global_step"] < total:
        return False
    latest = run_dir / "checkpoints" / "latest.pt"
    if not latest.is_file():
        return True  # a kept folder: its final_eval.json was written from the finished run
    try:
        return torch.load(latest, map_location="cpu", weights_only=True)["global_step"] >= total
    except Exception:  # noqa: BLE001 - a damaged checkpoint is not a finished run; train resumes or says why
        return False


def keep_run(run_dir: Path, dest: Path) -> None:
    """Copy the run's KEPT files into ``dest``, each through a temporary name, final_eval.json
    last, so an interrupted copy never looks whole."""
    dest.mkdir(parents=True, exist_ok=True)
    for name in KEPT:
        tmp = dest / f".{name}.tmp"
        shutil.copyfile(run_dir / name, tmp)
        os.replace(tmp, dest / name)


def kept(keep: Path | None, config: Path, seed: int) -> bool:
    """The (config, seed) has a whole copy under ``keep``."""
    return keep is not None and (run_dir_of(keep, config, seed) / FINAL_EVAL).is_file()


def jobs(configs: list[Path], seeds: list[int], out: Path, overrides: list[str],
         episodes: int, keep: Path | None = None) -> list[tuple[Path, list[list[str]]]]:
    """(run dir, commands in order) of every (config, seed) with something left to do: train and
    evaluate a run not finished yet, evaluate a finished one without final_eval.json; nothing for
    one kept under ``keep``. Seed-major: the first seed of every config comes first, so a table
    stopped part way covers every config."""
    todo = []
    for seed in seeds:
        for config in configs:
            run_dir = run_dir_of(out, config, seed)
            if kept(keep, config, seed):
                continue
            if not finished(run_dir):
                todo.append((run_dir, [train_command(config, seed, run_dir, overrides),
                                       eval_command(run_dir, episodes)]))
            elif not (run_dir / FINAL_EVAL).is_file():
                todo.append((run_dir, [eval_command(run_dir, episodes)]))
    return todo


def run_all(configs: list[Path], seeds: list[int], out: Path, parallel: int, overrides: list[str],
            episodes: int = 10, keep: Path | None = None) -> int:
    """Train and evaluate every (config, seed) with something left to do, ``parallel`` at a
    time (a run's evaluation follows its training in the same slot), copying each evaluated run
    under ``keep`` when given; returns the failures."""
    if keep is not None:  # evaluated by an earlier `run` that was not given --keep
        for seed in seeds:
            for config in configs:
                run_dir = run_dir_of(out, config, seed)
                if not kept(keep, config, seed) and finished(run_dir) and (run_dir / FINAL_EVAL).is_file():
                    keep_run(run_dir, run_dir_of(keep, config, seed))
    todo = jobs(configs, seeds, out, overrides, episodes, keep)
    running: list[tuple[subprocess.Popen, Path, list[list[str]]]] = []
    failures = 0

    def start(run_dir: Path, commands: list[list[str]]) -> None:
        run_dir.parent.mkdir(parents=True, exist_ok=True)
        cmd, rest = commands[0], commands[1:]
        print("start:", " ".join(cmd), flush=True)
        with (run_dir.parent / f"{run_dir.name}.log").open("a") as log:
            proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
        running.append((proc, run_dir, rest))

    while todo or running:
        while todo and len(running) < parallel:
            start(*todo.pop(0))
        time.sleep(POLL_SECONDS)
        for entry in list(running):
            proc, run_dir, rest = entry
            if proc.poll() is None:
                continue
            running.remove(entry)
            print(f"done ({proc.returncode}): {proc.args[3]} {run_dir}", flush=True)
            if proc.returncode != 0 or (rest and not finished(run_dir)):
                failures += 1  # a failed or stopped run is not evaluated
            elif rest:
                start(run_dir, rest)
            elif keep is not None:
                keep_run(run_dir, keep / run_dir.parent.name / run_dir.name)
                print(f"kept: {keep / run_dir.parent.name / run_dir.name}", flush=True)
    return failures


# --------------------------------------------------------------------------- table


def read_rows(run_dir: Path) -> list[dict[str, float]]:
    def num(v: str) -> float:
        try:
            return float(v)
        except (TypeError, ValueError):
            return math.nan
    from visppo.metrics import complete_text  # a last line a kill cut short is not read

    return [{k: num(v) for k, v in r.items()} for r in csv.DictReader(io.StringIO(complete_text(run_dir / "metrics.csv")))]


def value_at(rows: list[dict[str, float]], column: str, step: int) -> float:
    """``column`` at ``step``: its value at the first row at or after it (the iteration that crossed
    the step; a rollout rarely divides it), or, where the column is not logged there (a periodic
    evaluation), the last value before it; NaN if the run is shorter (by more than 2%)."""
    if not rows or rows[-1]["global_step"] < step * 0.98:  # within the last iteration's rounding
        return math.nan
    finite = [r for r in rows if math.isfinite(r.get(column, math.nan))]
    crossing = next((r for r in rows if r["global_step"] >= step), rows[-1])
    if math.isfinite(crossing.get(column, math.nan)):
        return crossing[column]
    before = [r[column] for r in finite if r["global_step"] <= crossing["global_step"]]
    return before[-1] if before else math.nan


def wall_minutes(rows: list[dict[str, float]], step: int) -> float:
    """Minutes of training up to ``step``: the sum over rows of the steps since the previous row over
    the row's steps/s, which visppo measures over every iteration since that row, whatever
    ``run.log_every`` (NaN when the run did not log its speed, as tools/sb3_dmc.py's runs do not)."""
    total, previous = 0.0, 0.0
    for r in rows:
        total += (r["global_step"] - previous) / r.get("steps_per_second", math.nan)
        previous = r["global_step"]
        if previous >= step:  # the iteration that crossed the step, as value_at reads it
            break
    return total / 60


SEED_FOLDER = re.compile(r"seed(\d+)")
"""A run folder's name: ``seed<S>``; any other folder beside them (``seed2_old``) is not a run of the table."""


def seed_number(run_dir: Path) -> int:
    """'seed12' -> 12, so seeds sort as numbers (seed2 before seed10)."""
    return int(SEED_FOLDER.fullmatch(run_dir.name).group(1))


def groups(outs: list[Path]) -> list[tuple[str, str, list[Path]]]:
    """(config, variant, seed run dirs in seed order) per config folder of each ``run`` folder;
    the variant is the ``run`` folder's name when several are compared, else empty."""
    found = []
    for out in outs:
        for group in sorted(p for p in out.iterdir() if p.is_dir()):
            runs = sorted((d for d in group.glob("seed*") if SEED_FOLDER.fullmatch(d.name)
                           and (d / "metrics.csv").is_file()), key=seed_number)
            if runs:
                found.append((group.name, out.name if len(outs) > 1 else "", runs))
    return sorted(found, key=lambda g: g[0])  # a config's variants together, in the folders' order


def check_folders(outs: list[Path]) -> None:
    """Every folder holds runs, and every run its config.yaml; else a UsageError."""
    for out in outs:
        if not out.is_dir():
            raise UsageError(f"{out} is not a folder")
    names = [out.name for out in outs]
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:  # the table names each variant by its folder: two would merge into one
        raise UsageError(f"two folders are named {twice[0]} ({', '.join(str(o) for o in outs if o.name == twice[0])}): "
                         "the table names each variant by its folder's name; rename or link one")
    found = groups(outs)
    for out in outs:
        if not any(run.parent.parent == out for _, _, runs in found for run in runs):
            raise UsageError(f"{out} holds no runs: give the --out folder of learning_table.py run "
                             "(OUT/<config>/seed<S>/metrics.csv)")
    for _, _, runs in found:
        numbers = [seed_number(run) for run in runs]
        if len(set(numbers)) < len(numbers):  # seed1 and seed01
            twice = [str(r) for r in runs if numbers.count(seed_number(r)) > 1]
            raise UsageError(f"{' and '.join(twice)} are one seed twice: move one away")
        for run in runs:
            if not (run / "config.yaml").is_file():
                raise UsageError(f"{run} has metrics.csv but no config.yaml: not a run folder that "
                                 "visppo train wrote")
            final = run / FINAL_EVAL
            if final.is_file():
                problem = final_eval_problem(run, final)
                if problem:
                    raise UsageError(f"{final} {problem}: evaluate the finished run with learning_table.py run "
                                     f"(or {' '.join(eval_command(run, 10)[1:])}), or move that run away")
        settings = {run: run_settings(run) for run in runs}
        first = runs[0]
        for run in runs[1:]:
            differ = [k for k, v in settings[run].items() if v != settings[first][k]]
            if differ:  # one row, one env, look and budget
                what = ", ".join(f"{k} ({settings[first][k]} and {settings[run][k]})" for k in differ)
                raise UsageError(f"{first} and {run} differ in {what}: one row of the table is one setting; "
                                 "move one away")


def final_eval_problem(run: Path, final: Path) -> str | None:
    """Why ``final`` is not the final policy's evaluation as ``run`` makes it (None: it is): a
    deterministic one on evaluation stream :data:`EVAL_SEED`, of the run's last checkpoint, in the
    env the run trained on. A field an older visppo (or tools/sb3_dmc.py) did not write is not held
    against it."""
    try:
        result = json.loads(final.read_text())
        float(result["mean_return"])
    except (ValueError, KeyError, TypeError) as exc:
        return f"is not a visppo eval --json file ({exc!r})"
    env_id, _, total = run_env(run)
    if result.get("deterministic", True) is not True or result.get("seed", EVAL_SEED) != EVAL_SEED:
        return (f"is not the final evaluation (deterministic={result.get('deterministic')}, "
                f"seed={result.get('seed')}; the table's are deterministic, seed {EVAL_SEED})")
    if result.get("env_overrides"):
        return f"evaluated in a changed env ({', '.join(result['env_overrides'])})"
    if result.get("env_id", env_id) != env_id:
        return f"evaluated {result['env_id']}, where the run trained on {env_id}"
    if result.get("global_step", total) < total:
        return f"evaluated step {result['global_step']:,}, before the run's ppo.total_steps {total:,}"
    return None


def run_settings(run_dir: Path) -> dict:
    """What every seed of one row must share: env, look and budget. Not train.amp: config.yaml keeps
    ``auto``, not what it resolved to on the machine (fp32 on most CPUs, as ``off``); ``run`` holds a
    table's runs to one precision as it starts them (:func:`check_existing_runs`)."""
    env_id, look, total = run_env(run_dir)
    return {"env.id": env_id, "look": look, "ppo.total_steps": total}


def look_of(env_id: str, kwargs: dict | None) -> str | None:
    """The look an env drew its frames with: env.kwargs.look; a suite task without one drew the
    suite's own look (the wrapper's default), any other env has none (None)."""
    return (kwargs or {}).get("look") or ("published" if env_id.startswith("dmc:") else None)


def run_env(run_dir: Path) -> tuple[str, str | None, int]:
    """(env.id, look, ppo.total_steps) of a run, from its config.yaml."""
    import yaml

    cfg = yaml.safe_load((run_dir / "config.yaml").read_text())
    env = cfg["env"]
    return env["id"], look_of(env["id"], env.get("kwargs")), int(cfg["ppo"]["total_steps"])


def label(config: str, variant: str) -> str:
    return f"{config} ({variant})" if variant else config


def summarize(outs: list[Path], steps: list[int]) -> list[dict]:
    """One row per (config, variant, step count): mean and std over seeds of each measured figure."""
    table = []
    for config, variant, runs in groups(outs):
        env_id, look, _ = run_env(runs[0])  # dmc: which look drew the frames
        rows = {d.name: read_rows(d) for d in runs}
        for step in steps:
            row = {"config": label(config, variant), "env": env_id, "look": look, "steps": step,
                   "seeds": 0}
            for column in ("episode_return", "episode_success", "eval/return", "eval/success"):
                seeds = {name: v for name, r in rows.items()
                         if math.isfinite(v := value_at(r, column, step))}
                row[column], row[f"{column}/seeds"] = mean_std(list(seeds.values())), seeds
                if column == "episode_return":
                    row["seeds"] = len(seeds)
            minutes = [wall_minutes(r, step) for r in rows.values()
                       if math.isfinite(value_at(r, "episode_return", step))]
            row["minutes"] = mean_std([m for m in minutes if math.isfinite(m)])
            row["published"] = published_at(env_id, step)
            table.append(row)
    return table


def final_results(outs: list[Path]) -> list[dict]:
    """One row per (config, variant) with a final evaluation: its env, look, budget, each seed's
    ``mean_return`` (in seed order), their mean +- std, and the published figures."""
    table = []
    for config, variant, runs in groups(outs):
        evaluated = [d for d in runs if (d / FINAL_EVAL).is_file()]
        if not evaluated:
            continue
        env_id, look, budget = run_env(evaluated[0])
        results = {d.name: json.loads((d / FINAL_EVAL).read_text()) for d in evaluated}
        seeds = {name: float(r["mean_return"]) for name, r in results.items()}
        rates = [r.get("success_rate") for r in results.values()]
        success = mean_std([float(v) for v in rates]) if all(v is not None for v in rates) else None
        table.append({"config": label(config, variant), "task": config, "variant": variant,
                      "env": env_id, "look": look or "default", "budget": budget,
                      "seeds": seeds, "return": mean_std(list(seeds.values())), "success": success,
                      "episodes": sorted({int(r.get("episodes", 0)) for r in results.values()}),
                      "published": published_at(env_id, budget)})
    return table


def check_one_config_per_task(final: list[dict]) -> None:
    """Refuse a variant with two configs of one DMC task (the same env.id and look): the IQM takes
    one score per task and seed, and the two would count that task twice. They are two methods (or
    one run twice), not two tasks, and no average of them is the variant's score: each belongs in
    a run folder of its own, a variant of its own."""
    seen: dict[tuple[str, str, str], str] = {}
    for r in final:
        if not r["env"].startswith("dmc:"):
            continue
        key = (r["variant"], r["env"], r["look"])
        if key in seen:
            where = f" in {r['variant']}" if r["variant"] else ""
            raise UsageError(f"{seen[key]} and {r['task']}{where} are the same DMC task ({r['env']}, "
                             f"{r['look']} look), which the IQM would count twice: move one into a run "
                             "folder of its own and give both folders (a variant each)")
        seen[key] = r["task"]


def iqm_summary(final: list[dict], reps: int = 50_000, seed: int = 0) -> list[dict]:
    """Per variant: the IQM of the raw final returns over its DMC tasks (one score per task and
    seed, the seeds every such task has) and its 95% stratified bootstrap interval (rliable; NaN
    with one seed per task). A task is an env.id and look: two configs of one task in a variant
    are refused (:func:`check_one_config_per_task`)."""
    check_one_config_per_task(final)
    import numpy as np
    from rliable import library as rly
    from rliable import metrics

    summaries = []
    for variant in dict.fromkeys(r["variant"] for r in final):
        rows = [r for r in final if r["variant"] == variant and r["env"].startswith("dmc:")]
        others = [r["task"] for r in final if r["variant"] == variant and r not in rows]
        common = set.intersection(*(set(r["seeds"]) for r in rows)) if rows else set()
        seeds = sorted(common, key=lambda name: seed_number(Path(name)))
        unused = [f"{r['task']} {s}" for r in rows for s in r["seeds"] if s not in common]
        summary = {"variant": variant, "tasks": [r["task"] for r in rows], "seeds": seeds,
                   "left_out": others, "unused_runs": unused, "iqm": math.nan, "ci": (math.nan, math.nan),
                   "reps": reps}
        scores = np.array([[r["seeds"][s] for r in rows] for s in seeds])  # runs x tasks
        if len(seeds) == 1:  # the stratified bootstrap resamples seeds within each task: one gives no spread
            summary["iqm"] = float(metrics.aggregate_iqm(scores))
            summary["scores"] = scores
        elif seeds:
            # rliable 1.2 resamples with numpy's global RNG whatever random_state says: seed that
            # too (and put it back), or the interval would change from one printing to the next
            global_state = np.random.get_state()
            np.random.seed(seed)
            try:
                with warnings.catch_warnings():  # arch: RandomState is deprecated in favour of Generator
                    warnings.simplefilter("ignore", FutureWarning)
                    point, interval = rly.get_interval_estimates(
                        {"score": scores}, lambda x: np.array([metrics.aggregate_iqm(x)]), reps=reps,
                        random_state=np.random.RandomState(seed))
            finally:
                np.random.set_state(global_state)
            summary["iqm"] = float(point["score"][0])
            summary["ci"] = (float(interval["score"][0, 0]), float(interval["score"][1, 0]))
            summary["scores"] = scores
        summaries.append(summary)
    return summaries


def published_at(env_id: str, step: int) -> list[tuple[str, float, str]]:
    """The published figures for ``env_id`` at a budget that ``step`` reaches within one percent:
    a rollout rarely divides the budget, so a 500k run's last row is at 500,736 (8 x 128 x 489)."""
    for budget, figures in PUBLISHED.get(env_id, {}).items():
        if budget <= step <= budget * 1.01:
            return figures
    return []


def mean_std(values: list[float]) -> tuple[float, float, int]:
    """Mean, sample standard deviation (n - 1; NaN for one value) and count."""
    if not values:
        return (math.nan, math.nan, 0)
    return (statistics.fmean(values), statistics.stdev(values) if len(values) > 1 else math.nan, len(values))


def cell(ms: tuple[float, float, int], digits: int = 2) -> str:
    """``mean ± std``, or the mean alone for one seed (no spread to give, not a spread of 0)."""
    mean, std, n = ms
    if n == 0:
        return ""
    return f"{mean:.{digits}f}" if n == 1 else f"{mean:.{digits}f} ± {std:.{digits}f}"


def published_text(figures: list[tuple[str, float, str]]) -> str:
    return "; ".join(f"{m} {s} ({src})" for m, s, src in figures)


def markdown(table: list[dict], per_seed: bool = False) -> str:
    """The training-curve table; ``per_seed`` adds each seed's return, e.g. ``4.00 ± 1.41 (1: 3, 2: 5)`` (seed: return)."""
    def returns(r: dict, column: str) -> str:
        text = cell(r[column])
        if per_seed and text:
            text += " (" + ", ".join(f"{s.removeprefix('seed')}: {v:.3g}" for s, v in r[f"{column}/seeds"].items()) + ")"
        return text

    lines = ["| config | env | steps | seeds | return (train) | success (train) | return (eval) | "
             "success (eval) | minutes | published |", "|" + " --- |" * 10]
    for r in table:
        if not r["seeds"]:
            continue
        env = f"`{r['env']}`" + (f" ({r['look']} look)" if r.get("look") else "")
        lines.append(f"| {r['config']} | {env} | {r['steps']:,} | {r['seeds']} | "
                     f"{returns(r, 'episode_return')} | {cell(r['episode_success'])} | "
                     f"{returns(r, 'eval/return')} | {cell(r['eval/success'])} | "
                     f"{cell(r['minutes'], 0)} | {published_text(r['published'])} |")
    return "\n".join(lines)


def final_markdown(final: list[dict], summaries: list[dict], per_seed: bool = False) -> str:
    """The final-policy table, then one IQM line per variant."""
    lines = [f"Final policy: `visppo eval RUN --deterministic --seed {EVAL_SEED}`, the mean return "
             "of each run's episodes, then mean ± std over seeds.", "",
             "| config | env | look | budget | seeds | episodes | final return | final success | published |",
             "|" + " --- |" * 9]
    for r in final:
        text = cell(r["return"])
        if per_seed:
            text += " (" + ", ".join(f"{s.removeprefix('seed')}: {v:.3g}" for s, v in r["seeds"].items()) + ")"
        episodes = "-".join(str(n) for n in dict.fromkeys((r["episodes"][0], r["episodes"][-1])))
        lines.append(f"| {r['config']} | `{r['env']}` | {r['look']} | {r['budget']:,} | "
                     f"{len(r['seeds'])} | {episodes} | {text} | {cell(r['success']) if r['success'] else ''} | "
                     f"{published_text(r['published'])} |")
    for s in summaries:
        lines += ["", iqm_line(s)]
    for line in goal_lines(final):
        lines += ["", line]
    return "\n".join(lines)


def goal_lines(final: list[dict]) -> list[str]:
    """Per variant, against the published rows at the runs' budget: on how many tasks the mean
    final return is above the first published method (the PPO row), and the mean of the task means
    beside the published methods' means over the same tasks and the half-way mark."""
    lines = []
    for variant in dict.fromkeys(r["variant"] for r in final):
        rows = [r for r in final if r["variant"] == variant and r["published"]]
        methods = {tuple(m for m, _, _ in r["published"]) for r in rows}
        if len(methods) != 1:
            continue  # none published, or rows at different budgets: no single comparison
        methods = list(methods.pop())
        published = {m: statistics.fmean(r["published"][i][1] for r in rows) for i, m in enumerate(methods)}
        below = [r["task"] for r in rows if r["return"][0] <= r["published"][0][1]]
        ours = statistics.fmean(r["return"][0] for r in rows)
        name = f" ({variant})" if variant else ""
        text = (f"Against the published rows{name}, {len(rows)} task(s): above {methods[0]} on "
                f"{len(rows) - len(below)} of {len(rows)}" + (f" (not on {', '.join(below)})" if below else "")
                + f"; mean of the task means {ours:.1f} against "
                + ", ".join(f"{m} {v:.1f}" for m, v in published.items()))
        if len(methods) > 1:
            text += f" (half way from the first to the last: {(published[methods[0]] + published[methods[-1]]) / 2:.1f})"
        lines.append(text)
    return lines


def iqm_line(s: dict) -> str:
    name = f"IQM ({s['variant']})" if s["variant"] else "IQM"
    left = f"; left out (no common scale): {', '.join(s['left_out'])}" if s["left_out"] else ""
    if s.get("unused_runs"):
        left += (f"; not in the IQM, as not every task has their seed yet: {len(s['unused_runs'])} run(s) "
                 f"({', '.join(s['unused_runs'])})")
    if not s["tasks"]:
        return f"{name}: no DeepMind Control task with a final evaluation{left}"
    if not s["seeds"]:
        return f"{name}: the DMC tasks {', '.join(s['tasks'])} share no evaluated seed{left}"
    head = (f"{name} over {len(s['tasks'])} DMC task(s) x {len(s['seeds'])} seed(s) "
            f"({', '.join(s['seeds'])}), raw returns (0-1000): **{s['iqm']:.1f}** ")
    lo, hi = s["ci"]
    if math.isnan(lo):
        return head + f"(no interval: one seed per task leaves the stratified bootstrap nothing to resample){left}"
    return head + f"[95% CI {lo:.1f}, {hi:.1f}] (stratified bootstrap, {s['reps']:,} reps, rliable){left}"


def plot(outs: list[Path], path: Path, column: str = "episode_return") -> None:
    """A panel per config, a curve per variant: mean +- std over seeds, on a common step grid."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from visppo.plot import save_figure  # the image is whole or absent, whatever stops the tool

    found = groups(outs)
    configs = list(dict.fromkeys(config for config, _, _ in found))
    cols = min(len(configs), PANELS_PER_ROW)
    rows = -(-len(configs) // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(4.5 * cols, 3.5 * rows), squeeze=False)
    for ax in axes.flat[len(configs):]:
        ax.set_visible(False)  # the last row's empty panels
    for ax, config in zip(axes.flat, configs):
        for _, variant, runs in (g for g in found if g[0] == config):
            _band(ax, [read_rows(d) for d in runs], column, variant)
        ax.set_title(config)
        ax.set_xlabel("agent steps (global_step)")
        ax.set_ylabel(column)
        ax.grid(alpha=0.3)
        ax.legend(fontsize="small")
    fig.tight_layout()
    save_figure(fig, path, dpi=110)


def _band(ax, runs: list[list[dict[str, float]]], column: str, name: str) -> None:
    """One variant's mean curve and its +- std band over seeds (sample std, as the tables), as far as
    its longest run: past a shorter run's last row, the seeds that got there (the band narrows to
    the line where one is left); a seed with no row yet is left out."""
    import numpy as np

    runs = [r for r in runs if r]
    if not runs:
        return

    end = max(r[-1]["global_step"] for r in runs)
    grid = np.linspace(0, end, 100)
    curves = []
    for r in runs:
        points = [(x["global_step"], x[column]) for x in r if math.isfinite(x.get(column, math.nan))]
        xs, ys = zip(*points) if points else ((0.0,), (math.nan,))
        curves.append(np.interp(grid, xs, ys, left=math.nan, right=math.nan))
    curves = np.array(curves)
    with warnings.catch_warnings():  # before a run's first episode ends, no seed has a value
        warnings.simplefilter("ignore", RuntimeWarning)
        mean, std = np.nanmean(curves, 0), np.nanstd(curves, 0, ddof=1)  # the tables' std; NaN (no band): one seed
    line, = ax.plot(grid, mean, label=f"{name + ', ' if name else ''}{len(runs)} seed(s)")
    ax.fill_between(grid, mean - std, mean + std, alpha=0.25, color=line.get_color())


def build_parser() -> Parser:
    parser = Parser(prog="learning_table.py", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="cmd", required=True, parser_class=Parser)
    r = sub.add_parser("run", help="train configs x seeds, then evaluate each final policy",
                       description="Train every config with every seed (the first seed of every "
                                   "config first), then evaluate each final policy; key=value "
                                   "overrides apply to all runs.")
    r.add_argument("configs", nargs="+", help="config files, then any key=value overrides")
    r.add_argument("--seeds", nargs="+", type=int, default=[1, 2, 3],
                   help="train.seed values (default: 1 2 3)")
    r.add_argument("--out", type=Path, required=True, help="folder for the runs: OUT/<config>/seed<S>")
    r.add_argument("--parallel", type=int, default=2,
                   help="runs at once, each with train.threads=1 (default 2: one per core here)")
    r.add_argument("--eval-episodes", type=int, default=10,
                   help=f"episodes of the final policy's evaluation, RUN/{FINAL_EVAL} (default 10)")
    r.add_argument("--keep", type=Path,
                   help="copy each evaluated run's config.yaml, metrics.csv and final_eval.json to "
                        "KEEP/<config>/seed<S>, and skip the (config, seed) pairs kept there already")
    t = sub.add_parser("table", help="tabulate run folders")
    t.add_argument("out", type=Path, nargs="+",
                   help="run folders; several: one per variant of an ablation")
    t.add_argument("--at", nargs="+", default=["100k", "250k", "500k"],
                   help="step counts of the training-curve rows: each column at the first row at or "
                        "after the step (a column not logged there: its last value before; default "
                        "100k 250k 500k)")
    t.add_argument("--markdown", type=Path, help="also write the tables to this file")
    t.add_argument("--plot", type=Path, help="draw the curves (mean +- sample std over seeds) to this image")
    t.add_argument("--column", default="episode_return",
                   help="metrics.csv column to plot, e.g. eval/success (default: episode_return)")
    t.add_argument("--per-seed", action="store_true",
                   help="add each seed's return after the mean, in seed order")
    t.add_argument("--reps", type=int, default=50_000,
                   help="bootstrap resamples of the IQM's interval, seeded (default 50000, rliable's)")
    return parser


def cmd_run(ns: argparse.Namespace, rest: list[str]) -> int:
    from visppo.config import load_config
    from visppo.errors import UserError

    configs = [Path(c) for c in ns.configs if "=" not in c]
    overrides = [c for c in ns.configs if "=" in c] + rest
    if ns.parallel < 1:
        raise UsageError(f"--parallel must be at least 1, got {ns.parallel}")
    if ns.eval_episodes < 1:
        raise UsageError(f"--eval-episodes must be at least 1, got {ns.eval_episodes}")
    missing = [str(c) for c in configs if not c.is_file()]
    if missing or not configs:
        raise UsageError(f"config file(s) not found: {', '.join(missing) or 'none given'}")
    stems = [c.stem for c in configs]
    if len(set(stems)) < len(stems):
        raise UsageError(f"two configs share a name ({', '.join(stems)}): each gets OUT/<name>")
    for item in overrides:
        if item.split("=", 1)[0].strip() in ("train.seed", "run.dir"):
            raise UsageError(f"'{item}': run sets train.seed and run.dir itself (--seeds, --out)")
    tasks = {}
    for config in configs:
        try:
            cfg = load_config(config, overrides)
        except UserError as exc:
            raise UsageError(str(exc)) from None
        look = look_of(cfg.env.id, cfg.env.kwargs)
        if cfg.env.id.startswith("dmc:") and tasks.setdefault((cfg.env.id, look), config) != config:
            # before hours of training, not when the table is made (check_one_config_per_task)
            raise UsageError(f"{tasks[(cfg.env.id, look)]} and {config} train the same DMC task ({cfg.env.id}, "
                             f"{look} look), which the IQM would count twice: run them into two --out folders")
    if ns.keep is not None and ns.keep.resolve() == ns.out.resolve():
        raise UsageError(f"--keep {ns.keep} is --out itself: give a folder of its own (e.g. under docs/)")
    seeds = list(dict.fromkeys(ns.seeds))
    check_existing_runs(configs, seeds, ns.out, overrides, ns.keep)
    return 1 if run_all(configs, seeds, ns.out, ns.parallel, overrides, ns.eval_episodes, ns.keep) else 0


def have_rliable() -> bool:
    try:
        import rliable.library  # noqa: F401  (it needs arch, which needs a matching pandas)
    except ImportError:
        return False
    return True


def cmd_table(ns: argparse.Namespace, rest: list[str]) -> int:
    if rest:
        raise UsageError(f"unknown arguments {' '.join(rest)}")
    steps = [parse_steps(s) for s in ns.at]
    if ns.reps < 1:
        raise UsageError(f"--reps must be at least 1, got {ns.reps}")
    check_folders(ns.out)
    for option, path in (("--markdown", ns.markdown), ("--plot", ns.plot)):
        if path is not None and not path.parent.is_dir():
            raise UsageError(f"{option} {path}: folder {path.parent} does not exist")
        if path is not None and path.is_dir():
            raise UsageError(f"{option} {path} is a folder: give a file name")
    if ns.plot is not None:
        from visppo.errors import ConfigError
        from visppo.plot import check_format

        try:
            check_format(ns.plot)
        except ConfigError as exc:
            raise UsageError(f"--plot {ns.plot}: {exc}") from None
        columns = set()
        for _, _, runs in groups(ns.out):
            for run in runs:
                with (run / "metrics.csv").open() as f:
                    columns.update(next(csv.reader(f), []))
        if ns.column not in columns:
            raise UsageError(f"--column {ns.column}: no run logged it (columns: "
                             f"{', '.join(sorted(columns))})")
    text = markdown(summarize(ns.out, steps), ns.per_seed)
    final = final_results(ns.out)
    if final:
        check_one_config_per_task(final)  # the goal lines count tasks too, with or without rliable
        iqm = have_rliable()
        text += "\n\n" + final_markdown(final, iqm_summary(final, ns.reps) if iqm else [], ns.per_seed)
        if not iqm:
            text += "\n\nIQM: not computed, it needs rliable (pip install -e \".[test]\" or pip install rliable)"
    print(text)
    if ns.markdown:
        from visppo.atomic import atomic_write_text  # whole or absent, whatever stops the tool

        atomic_write_text(ns.markdown, text + "\n")
    if ns.plot:
        plot(ns.out, ns.plot, ns.column)
    return 0


def main(argv: list[str] | None = None) -> int:
    ns, rest = build_parser().parse_known_args(argv)
    try:
        return cmd_run(ns, rest) if ns.cmd == "run" else cmd_table(ns, rest)
    except UsageError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
