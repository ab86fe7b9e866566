"""tools/gpu_session.sh, the GPU session's one prepared command: it parses; its drop list leaves a
dm_control whose suite loads and renders through visppo_envs.dmc; and, run dry with a stand-in
python, its ``dmc`` step stops the training with one SIGTERM and evaluates the checkpoint, and
every step combination leaves few enough, shallow enough files in ``$OUT`` for the device tool
to bring back."""

from __future__ import annotations

import importlib.metadata
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SESSION = ROOT / "tools" / "gpu_session.sh"


def test_the_session_script_parses():
    res = subprocess.run(["bash", "-n", str(SESSION)], capture_output=True, text=True, timeout=30)
    assert res.returncode == 0, res.stderr


def drop_list() -> list[str]:
    text = SESSION.read_text()
    drops = re.findall(r"--drop (\S+)", text)
    assert "dm_control/locomotion/" in drops and "dm_control/mujoco/testing/" in drops, drops
    return drops


def test_the_drop_list_leaves_a_dm_control_whose_suite_loads_and_renders(tmp_path):
    """dm_control as installed here, less what prepare drops (the same prefixes, read from the
    script), shadows the installed one: cartpole-swingup loads and renders through visppo's env,
    a few other domains load, and dog (its meshes dropped) is the only domain that cannot."""
    pytest.importorskip("dm_control", reason="the dmc extra")
    files = importlib.metadata.files("dm_control")
    drops = tuple(drop_list())
    names = [str(f) for f in files if str(f).startswith("dm_control/")]
    for prefix in drops:
        assert any(n.startswith(prefix) for n in names), f"{prefix} is not in dm_control {importlib.metadata.version('dm_control')}"
    site = tmp_path / "site"
    copied = 0
    for f in files:
        name = str(f)
        if not name.startswith("dm_control/") or name.startswith(drops) or "__pycache__" in name:
            continue
        (site / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(f.locate(), site / name)
        copied += 1
    assert copied > 100
    code = """
import dm_control, visppo_envs.dmc as d
from dm_control import suite
assert dm_control.__file__.startswith(SITE), dm_control.__file__
e = d.DMCEnv("cartpole", "swingup", look="published"); o, _ = e.reset(seed=0); e.close()
print("frame", o.shape, int(o.mean() > 0))
for domain, task in [("walker", "walk"), ("cheetah", "run"), ("finger", "spin"), ("ball_in_cup", "catch")]:
    suite.load(domain, task)
try:
    suite.load("dog", "stand")
except Exception:
    print("no dog")
""".replace("SITE", repr(str(site)))
    env = {**os.environ, "PYTHONPATH": str(site), "MUJOCO_GL": os.environ.get("MUJOCO_GL", "egl")}
    res = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    assert "frame (84, 84, 3) 1" in res.stdout and "no dog" in res.stdout, res.stdout


FAKE_PYTHON = r'''#!{python}
"""A stand-in for the GPU machine's python3: visppo train waits for SIGTERM and then saves, as
visppo does, beside a child in its process group (as its env workers are) that records a SIGTERM
reaching it; visppo eval writes its JSON; the probe and speed tools write their JSON (the probe
one trace per row too); pip, -c checks and pytest succeed at once; a script on stdin runs with
nothing importable (setup's "missing" list names everything it checks)."""
import importlib.util, json, os, signal, subprocess, sys, time
from pathlib import Path

args = sys.argv[1:]
log = Path(os.environ["FAKE_LOG"])
with log.open("a") as f:
    f.write(json.dumps(args) + "\n")
if args[:1] == ["tools/validate_probe.py"] and "--resume" in args \
        and Path(args[args.index("--resume") + 1]).read_text() == "another GPU's":
    print("error: --resume: was made with device_name 'Other GPU'", file=sys.stderr)
    sys.exit(2)
elif args[:1] == ["tools/validate_probe.py"] or args[:1] == ["tools/speed_vs_sb3.py"]:
    Path(args[args.index("--json") + 1]).write_text("{{}}")
    if "--traces" in args:
        traces = Path(args[args.index("--traces") + 1])
        traces.mkdir(parents=True, exist_ok=True)
        (traces / "nature_84_off_micro_batch_64.json.gz").write_bytes(b"gz")
elif args[:1] == ["--version"]:
    print("Python 3.12.0 (fake)")
elif args[:1] == ["-"]:
    importlib.util.find_spec = lambda name, *a: None
    sys.argv = args
    exec(sys.stdin.read())
elif args[:3] == ["-m", "visppo", "train"]:
    run = Path(next(a.split("=", 1)[1] for a in args if a.startswith("run.dir=")))
    terms = []
    signal.signal(signal.SIGTERM, lambda *_: terms.append(1))
    hit = os.environ["FAKE_LOG"] + ".worker"
    worker = subprocess.Popen([sys.executable, "-c", "import signal, sys, time; signal.signal(signal.SIGTERM, "
                               "lambda *_: (open(sys.argv[1], 'w').write('TERM'), sys.exit(0))); time.sleep(60)", hit])
    run.mkdir(parents=True)
    (run / "config.yaml").write_text("env: {{id: dmc:cartpole-swingup}}\n")
    deadline = time.time() + 60
    while not terms and time.time() < deadline:
        time.sleep(0.05)
    time.sleep(0.5)  # the iteration in progress; a second SIGTERM would arrive now
    (run / "checkpoints").mkdir()
    (run / "checkpoints" / "latest.pt").write_bytes(b"ckpt")
    (run / "metrics.csv").write_text("global_step,train/return\n1024,1.0\n2048,2.0\n")
    Path(os.environ["FAKE_LOG"] + ".terms").write_text(str(len(terms)))
    worker.kill()
    worker.wait()
    sys.exit(143 if terms else 0)
elif args[:3] == ["-m", "visppo", "eval"]:
    out = Path(args[args.index("--json") + 1])
    out.write_text(json.dumps({{"checkpoint": args[3], "episodes": 10, "mean_return": 123.0}}))
    print("dmc:cartpole-swingup: return 123.00")
'''


def fake_session(tmp_path: Path, steps: str, **env) -> tuple[subprocess.CompletedProcess, Path, list[list[str]]]:
    """tools/gpu_session.sh run from a copy of the script in an empty checkout (no .gl/, no .whl/:
    nothing is unpacked or installed), its python a stand-in; its stdout, $OUT and the calls."""
    repo = tmp_path / "repo"
    (repo / "tools").mkdir(parents=True)
    shutil.copy(SESSION, repo / "tools" / "gpu_session.sh")
    (repo / "tests").mkdir()
    for name in ("test_ppo.py", "test_validate_probe.py", "test_lint.py"):  # two with cuda tests, one without
        shutil.copy(ROOT / "tests" / name, repo / "tests" / name)
    fake = tmp_path / "python3"
    fake.write_text(FAKE_PYTHON.format(python=sys.executable))
    fake.chmod(0o755)
    out, scratch = tmp_path / "out", tmp_path / "scratch"
    scratch.mkdir(exist_ok=True)
    log = tmp_path / "calls.jsonl"
    full_env = {**os.environ, "PYTHON": str(fake), "OUT": str(out), "STEPS": steps, "TMPDIR": str(scratch),
                "FAKE_LOG": str(log), **env}
    res = subprocess.run(["bash", str(repo / "tools" / "gpu_session.sh")], env=full_env, capture_output=True,
                         text=True, timeout=120)
    calls = [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []
    return res, out, calls


def test_the_dmc_step_stops_training_once_evaluates_and_brings_back_two_small_files(tmp_path):
    res, out, calls = fake_session(tmp_path, "dmc", DMC_TIMEOUT="2", DMC_GRACE="20", DMC_ARGS="ppo.num_envs=4")
    assert res.returncode == 0, res.stderr
    assert "dmc: exit 0" in res.stdout, res.stdout
    left = sorted(p.relative_to(out).as_posix() for p in out.rglob("*"))
    assert left == ["dmc.log", "dmc_run.tar.gz", "machine.log", "setup.log"], left
    assert len(left) <= 8 and all(p.stat().st_size < 16 * 2**20 for p in out.iterdir())

    setup = (out / "setup.log").read_text()
    assert re.search(r"missing before setup: .*\bdm_control\b.*\bdm_env\b", setup), setup

    [train] = [c for c in calls if c[:3] == ["-m", "visppo", "train"]]
    assert train[3] == "configs/dmc_cartpole_swingup.yaml"
    assert {"env.kwargs.look=published", "train.device=cuda", "run.progress=false", "ppo.num_envs=4"} <= set(train)
    run_dir = next(a.split("=", 1)[1] for a in train if a.startswith("run.dir="))
    assert not run_dir.startswith(str(out)) and run_dir.startswith(str(tmp_path / "scratch"))
    # one SIGTERM, to visppo alone: a second one (timeout's to the process group) could abort it
    assert (tmp_path / "calls.jsonl.terms").read_text() == "1"
    assert not (tmp_path / "calls.jsonl.worker").exists()

    [evaluate] = [c for c in calls if c[:3] == ["-m", "visppo", "eval"]]
    assert evaluate[3] == run_dir
    assert evaluate[evaluate.index("--episodes") + 1] == "10"
    assert "--deterministic" in evaluate and "env.kwargs.look=published" in evaluate

    with tarfile.open(out / "dmc_run.tar.gz") as tar:
        names = sorted(Path(n).name for n in tar.getnames() if tar.getmember(n).isfile())
        assert names == ["config.yaml", "eval.json", "metrics.csv"]
        [member] = [m for m in tar.getmembers() if m.name.endswith("eval.json")]
        assert json.load(tar.extractfile(member))["mean_return"] == 123.0
    log = (out / "dmc.log").read_text()
    assert "train: exit 143" in log and "eval: exit 0" in log and '"mean_return": 123.0' in log, log


@pytest.mark.parametrize("steps, files", [
    ("probe speed", ["alloc_traces.tar", "machine.log", "probe.log", "probe_validation_cuda.json", "setup.log",
                     "speed.log", "speed_vs_sb3_cuda.json"]),
    ("cudatests expandable", ["cudatests.log", "expandable.log", "machine.log", "probe_validation_cuda_expandable.json",
                              "setup.log"]),
])
def test_each_call_brings_back_at_most_eight_shallow_files(tmp_path, steps, files):
    res, out, calls = fake_session(tmp_path, steps)
    assert res.returncode == 0, res.stderr
    left = sorted(p.relative_to(out).as_posix() for p in out.rglob("*"))
    assert left == files and len(left) <= 8, left
    if "probe" in steps:
        [probe] = [c for c in calls if c[:1] == ["tools/validate_probe.py"]]
        assert "--cap" in probe and "--traces" in probe
        with tarfile.open(out / "alloc_traces.tar") as tar:
            assert [Path(n).name for n in tar.getnames() if n.endswith(".json.gz")] == \
                ["nature_84_off_micro_batch_64.json.gz"]
    else:
        [tests] = [c for c in calls if c[:2] == ["-m", "pytest"]]
        assert tests[tests.index("-m", 2) + 1] == "cuda and not cuda_children and not slow"
        assert [a for a in tests if a.startswith("tests/")] == ["tests/test_ppo.py", "tests/test_validate_probe.py"]


def test_a_probe_call_packs_its_own_traces_only(tmp_path):
    stale = tmp_path / "scratch" / "alloc_traces"
    stale.mkdir(parents=True)
    (stale / "an_earlier_call.json.gz").write_bytes(b"gz")  # a warm machine's earlier call
    res, out, _ = fake_session(tmp_path, "probe")
    assert res.returncode == 0, res.stderr
    with tarfile.open(out / "alloc_traces.tar") as tar:
        assert sorted(Path(n).name for n in tar.getnames() if n.endswith(".gz")) == \
            ["nature_84_off_micro_batch_64.json.gz"]
    assert not list(out.glob("*.part"))


def test_without_dmc_in_steps_neither_dm_control_is_required_nor_the_step_run(tmp_path):
    res, out, calls = fake_session(tmp_path, "cudatests")
    assert res.returncode == 0, res.stderr
    missing = next(line for line in (out / "setup.log").read_text().splitlines() if line.startswith("missing"))
    assert "gymnasium" in missing and "dm_control" not in missing, missing
    assert not any(c[:2] == ["-m", "visppo"] for c in calls) and not (out / "dmc.log").exists()


def test_by_default_the_dmc_training_gets_what_the_call_has_left(tmp_path):
    """DMC_TIMEOUT=auto: DMC_CALL_LIMIT less the time spent, DMC_GRACE, DMC_EVAL_TIMEOUT and 90 s."""
    res, out, calls = fake_session(tmp_path, "dmc", DMC_CALL_LIMIT="115", DMC_GRACE="2", DMC_EVAL_TIMEOUT="5")
    assert res.returncode == 0 and "dmc: exit 0" in res.stdout, (res.stdout, res.stderr)
    log = (out / "dmc.log").read_text()
    limit = int(re.search(r"for (\d+) s, then SIGTERM", log).group(1))
    assert 115 - 2 - 5 - 90 - 6 <= limit <= 115 - 2 - 5 - 90, log  # the setup here takes a second or two
    assert (tmp_path / "calls.jsonl.terms").read_text() == "1"


@pytest.mark.parametrize("earlier, runs", [("{}", 1), ("another GPU's", 2)])
def test_a_probe_call_carries_on_the_json_it_is_given_or_runs_afresh_if_refused(tmp_path, earlier, runs):
    part = tmp_path / "part.json"
    part.write_text(earlier)
    res, out, calls = fake_session(tmp_path, "probe", PROBE_RESUME=str(part))
    assert res.returncode == 0, res.stderr
    probes = [c for c in calls if c[:1] == ["tools/validate_probe.py"]]
    assert len(probes) == runs and probes[0][probes[0].index("--resume") + 1] == str(part)
    if runs == 2:
        assert "--resume" not in probes[1] and "running the grid afresh" in res.stdout
    assert (out / "probe_validation_cuda.json").exists()
    res, out, calls = fake_session(tmp_path / "plain", "probe")
    assert [c for c in calls if c[:1] == ["tools/validate_probe.py"]][0].count("--resume") == 0
