"""Issue 17's bad inputs: each one `error:` line that says what to change, exit 2, nothing lost."""

import shutil
from pathlib import Path

import pytest
import torch
from conftest import one_error_line, run_main, tiny_overrides

from visppo.cli import main
from visppo.config import load_config
from visppo.errors import ConfigError, RunError


def snapshot(folder):
    return {p: p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file() and p.name != ".lock"}


@pytest.fixture(scope="module")
def finished(tmp_path_factory):
    """A finished tiny run (2 iterations, a checkpoint after each); tests copy it."""
    root = tmp_path_factory.mktemp("finished")
    assert main(["train", *tiny_overrides(root, **{"run.checkpoint_every": 1})]) == 0
    return root / "run"


@pytest.fixture
def run_copy(finished, tmp_path):
    shutil.copytree(finished, tmp_path / "run")
    return tmp_path / "run"


# --------------------------------------------------------------------------- run directories


def test_item2_files_of_a_run_without_config_yaml_are_not_overwritten(run_copy, capsys):
    (run_copy / "config.yaml").unlink()
    before = snapshot(run_copy)
    code, err = run_main(capsys, "train", *tiny_overrides(run_copy.parent))
    assert code == 2
    one_error_line(err, "already holds a run", "checkpoints", "metrics.csv")
    assert snapshot(run_copy) == before


def test_item14_a_run_killed_before_its_first_checkpoint_says_how_to_start_again(run_copy, capsys, tmp_path):
    shutil.rmtree(run_copy / "checkpoints")
    code, err = run_main(capsys, "train", "--resume", run_copy)
    assert code == 2
    line = one_error_line(err, "before its first checkpoint", f"visppo train {run_copy / 'config.yaml'} run.dir=")
    assert line  # and the command it gives works:
    cfg = load_config(run_copy / "config.yaml", [f"run.dir={tmp_path / 'again'}"])
    assert cfg.run.dir == str(tmp_path / "again")


def test_item16_resume_from_an_earlier_checkpoint_of_the_run(run_copy, capsys):
    latest = run_copy / "checkpoints" / "latest.pt"
    latest.write_bytes(latest.read_bytes()[:5000])  # truncated
    code, err = run_main(capsys, "train", "--resume", run_copy)
    assert code == 2
    one_error_line(err, "corrupt", f"visppo train --resume {run_copy / 'checkpoints' / 'iter_000002.pt'}")
    latest.write_bytes(b"\x00" * 100)  # garbage
    code, err = run_main(capsys, "train", "--resume", run_copy)
    one_error_line(err, "corrupt", "iter_000002.pt")
    code, err = run_main(capsys, "train", "--resume", run_copy / "checkpoints" / "iter_000001.pt")
    assert code == 0, err
    ckpt = torch.load(run_copy / "checkpoints" / "latest.pt", weights_only=True)
    assert ckpt["iteration"] == 2 and ckpt["global_step"] == 128


def test_item6_non_finite_weights_are_refused_by_resume_and_eval(run_copy, capsys):
    latest = run_copy / "checkpoints" / "latest.pt"
    ckpt = torch.load(latest, weights_only=True)
    name = next(k for k, v in ckpt["model"].items() if v.is_floating_point())
    ckpt["model"][name].fill_(float("nan"))
    torch.save(ckpt, latest)
    before = snapshot(run_copy)
    code, err = run_main(capsys, "train", "--resume", run_copy, "ppo.total_steps=256")
    assert code == 2
    one_error_line(err, "non-finite weights", name, "iter_000002.pt")
    code, err = run_main(capsys, "eval", run_copy, "--episodes", 1, "--deterministic")
    assert code == 2
    one_error_line(err, "non-finite weights")
    assert snapshot(run_copy) == before


@pytest.mark.parametrize("drop", ["config", "minibatch_generator", "run"])
def test_a_checkpoint_without_what_resume_needs_is_one_error_line(run_copy, capsys, drop):
    """Not a KeyError traceback from deep inside the resume; nothing in the run changes."""
    latest = run_copy / "checkpoints" / "latest.pt"
    ckpt = torch.load(latest, weights_only=True)
    del (ckpt["config"] if drop == "run" else ckpt)[drop]
    torch.save(ckpt, latest)
    before = snapshot(run_copy)
    code, err = run_main(capsys, "train", "--resume", run_copy, "ppo.total_steps=256")
    assert code == 2
    one_error_line(err, "cannot be resumed", "run section" if drop == "run" else drop)
    assert snapshot(run_copy) == before


def test_an_edited_config_yaml_is_refused_also_in_a_run_dir_yaml_would_misread(tmp_path, capsys):
    """A run.dir with ': ' in it: loading config.yaml with it as an override failed, and the check
    that refuses an edited config.yaml was skipped."""
    run_dir = tmp_path / "lr: 3e-4"
    assert main(["train", *tiny_overrides(None), f"run.dir='{run_dir}'"]) == 0  # quoted, as YAML needs
    config = run_dir / "config.yaml"
    config.write_text(config.read_text().replace("gamma: 0.99", "gamma: 0.5"))
    code, err = run_main(capsys, "train", "--resume", run_dir, "ppo.total_steps=256")
    assert code == 2
    one_error_line(err, "ppo.gamma")


def test_item15_divergence_before_any_checkpoint_names_none_and_no_amp_when_off(tmp_path, monkeypatch):
    import visppo.ppo as ppo_module
    from visppo.loop import train

    real = ppo_module.ppo_loss

    def nan_loss(*args, **kwargs):
        loss, stats = real(*args, **kwargs)
        return loss * float("nan"), stats

    monkeypatch.setattr(ppo_module, "ppo_loss", nan_loss)
    with pytest.raises(RunError) as err:
        train(load_config(None, tiny_overrides(tmp_path, **{"train.max_bad_steps": 1})))
    assert "no checkpoint yet" in str(err.value) and "amp" not in str(err.value)
    assert not (tmp_path / "run" / "checkpoints").exists()


# --------------------------------------------------------------------------- config values


@pytest.mark.parametrize("override", ["ppo.learning_rate=nan", "ppo.gamma=nan", "ppo.clip_coef=inf",
                                      "model.init_log_std=-inf", "ppo.max_grad_norm=.nan"])
def test_item8_non_finite_floats_are_refused(override):
    with pytest.raises(ConfigError, match=f"{override.split('=')[0]} must be a finite number"):
        load_config(None, [override])


def test_item13_whole_numbers_in_float_notation_are_ints(tmp_path):
    cfg = load_config(None, ["ppo.total_steps=2e6", "ppo.num_envs=4.0", "memory.micro_batch_size=1.6e1"])
    assert (cfg.ppo.total_steps, cfg.ppo.num_envs, cfg.memory.micro_batch_size) == (2_000_000, 4, 16)
    path = tmp_path / "c.yaml"
    path.write_text("ppo:\n  total_steps: 2e6\n  num_steps: 1.28e2\n")
    cfg = load_config(path)
    assert (cfg.ppo.total_steps, cfg.ppo.num_steps) == (2_000_000, 128)
    with pytest.raises(ConfigError, match="ppo.num_envs"):
        load_config(None, ["ppo.num_envs=2.5"])


def test_item18_a_key_given_twice_in_a_section_is_refused(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("ppo:\n  num_envs: 2\n  num_steps: 8\n  num_envs: 4\n")
    with pytest.raises(ConfigError, match="line 4: key 'num_envs' is given twice"):
        load_config(path)
    path.write_text("ppo:\n  num_envs: 2\nppo:\n  num_steps: 8\n")
    with pytest.raises(ConfigError, match="key 'ppo' is given twice"):
        load_config(path)


@pytest.mark.timeout(30)
def test_item11_a_yaml_alias_bomb_is_refused_quickly(tmp_path):
    lines = ['a0: &a0 ["lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol"]']
    for i in range(1, 10):
        lines.append(f"a{i}: &a{i} [{', '.join([f'*a{i - 1}'] * 9)}]")
    path = tmp_path / "bomb.yaml"
    path.write_text("\n".join(lines) + "\nppo:\n  num_envs: *a9\n")
    with pytest.raises(ConfigError, match="expands to more than"):
        load_config(path)
    path.write_text("a: &a [*a]\n")  # a list that holds itself
    with pytest.raises(ConfigError, match="expands to more than"):
        load_config(path)


def test_item12_a_bad_rollout_device_names_rollout_device(monkeypatch, capsys, tmp_path):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    code, err = run_main(capsys, "train", *tiny_overrides(tmp_path), "rollout.device=cuda:3")
    assert code == 2
    line = one_error_line(err, "rollout.device=cuda:3", "1 GPU")
    assert "train.device" not in line
    assert not (tmp_path / "run").exists()


# --------------------------------------------------------------------------- faults and other commands


def test_item4_a_dead_worker_is_reported_not_hidden_by_close(tmp_path, monkeypatch):
    import visppo.loop as train_module

    real_make = train_module.make_vector_env

    def broken_envs(cfg):
        envs = real_make(cfg)
        real_close = envs.close

        def close():
            real_close()
            raise BrokenPipeError(32, "Broken pipe")  # what closing a dead worker's pipe raises

        envs.close = close
        return envs

    def dead_worker(run):
        raise RunError("env visppo/DotReach-v0: worker 0 (exit code -9) died during step")

    monkeypatch.setattr(train_module, "make_vector_env", broken_envs)
    monkeypatch.setattr(train_module, "collect_rollout", dead_worker)
    with pytest.raises(RunError, match="worker 0"):
        train_module.train(load_config(None, tiny_overrides(tmp_path)))


@pytest.mark.parametrize("args,needle", [
    (["--device", "quantum"], "--device must be cpu, cuda or cuda:N"),
    (["--write-config", "{tmp}"], "is a directory"),
    (["--json", "{tmp}/a_file/probe.json"], "is not a directory"),
    (["--plot", "{tmp}/a_file/probe.png"], "is not a directory"),
    (["--plot", "{tmp}/probe.pnj"], "cannot write a plot as '.pnj'"),
])
def test_item9_probe_arguments(tmp_path, capsys, args, needle):
    """Refused before the probe runs, and nothing is written."""
    (tmp_path / "a_file").write_text("")
    args = [a.replace("{tmp}", str(tmp_path)) for a in args]
    code, err = run_main(capsys, "probe", *tiny_overrides(), *args)
    assert code == 2
    one_error_line(err, needle)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a_file"]


def test_item10_a_metrics_csv_that_is_not_utf8(run_copy, capsys, tmp_path):
    metrics = run_copy / "metrics.csv"
    metrics.write_bytes(metrics.read_bytes() + b"\xff\xfe\x00garbage\n")
    before = snapshot(run_copy)
    code, err = run_main(capsys, "train", "--resume", run_copy / "checkpoints" / "iter_000001.pt")
    assert code == 2
    one_error_line(err, "metrics.csv is not a CSV file visppo wrote")
    code, err = run_main(capsys, "plot", run_copy, "--out", tmp_path / "c.png")
    assert code == 2
    one_error_line(err, "metrics.csv is not a CSV file visppo wrote")
    assert snapshot(run_copy) == before


def test_item3_a_camera_that_does_not_exist_is_refused(tmp_path, capsys):
    from visppo.envs import make_env

    with pytest.raises(ConfigError, match="env.camera=topp: Reacher-v5 has no camera of that name"):
        make_env(load_config(None, ["env.id=Reacher-v5", "env.camera=topp", "env.image_size=48"]))
    code, err = run_main(capsys, "train", *tiny_overrides(tmp_path), "env.camera=side")
    assert code == 2
    one_error_line(err, "env.camera=side", "fixed camera 'policy'", "remove env.camera")
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("override,key", [
    ("ppo.num_steps=1000000000", "ppo.num_steps"),  # 10**9: the rollout buffer
    ("env.image_size=100000", "env.image_size"),  # the envs' frames and the buffer
    ("model.hidden_dim=1e8", "model.hidden_dim"),  # the policy's weights (its heads: hidden_dim x the features)
    ("model.feature_dim=1e30", "model.feature_dim"),  # more than torch's int64 sizes
])
def test_item7_absurd_sizes_name_the_key_and_the_memory_they_need(tmp_path, capsys, override, key):
    code, err = run_main(capsys, "train", *tiny_overrides(tmp_path), override)
    assert code == 2
    line = one_error_line(err, key)
    assert "would need" in line or "out of range" in line
    assert not (tmp_path / "run").exists()


def test_the_policys_size_is_its_encoders_not_the_nature_cnns(monkeypatch):
    """The policy's bytes come from the policy the config builds: DrQ-v2's encoder at 512x512 (7.6
    GiB with gradients and Adam) does not fit 4 GiB, where a torchvision backbone, whose size does
    not grow with the frames, fits at any model.resize (the old formula read the Nature CNN's)."""
    import visppo.builders as builders

    monkeypatch.setattr(builders, "total_memory", lambda device: 4 * 2**30)
    cpu = torch.device("cpu")
    drq = load_config(None, ["model.encoder=drq", "env.image_size=512", "ppo.num_envs=1", "ppo.num_steps=16",
                             "ppo.minibatch_size=16"])
    with pytest.raises(ConfigError, match=r"env.image_size=512 is too large: the policy and its optimizer would need 7\.\d+ GiB"):
        builders.check_memory(drq, cpu, cpu)
    builders.check_memory(load_config(None, ["model.encoder=resnet18", "model.resize=4096"]), cpu, cpu)


def test_item5_a_full_disk_while_logging_keeps_the_checkpoints_and_metrics(tmp_path, capsys, monkeypatch):
    import errno

    from visppo.metrics import Logger

    real_log, calls = Logger.log, []

    def full_on_the_third_row(self, step, scalars):
        calls.append(step)
        if len(calls) == 3:
            with self.csv_path.open("a") as f:
                f.write(f"{step},0.1")  # half a row, then the disk is full
            raise OSError(errno.ENOSPC, "No space left on device", str(self.csv_path))
        real_log(self, step, scalars)

    monkeypatch.setattr(Logger, "log", full_on_the_third_row)
    overrides = tiny_overrides(tmp_path, **{"run.checkpoint_every": 1, "ppo.total_steps": 256})
    code, err = run_main(capsys, "train", *overrides)
    assert code == 1
    one_error_line(err, "no space left", "metrics.csv", f"visppo train --resume {tmp_path / 'run'}")
    assert torch.load(tmp_path / "run" / "checkpoints" / "latest.pt", weights_only=True)["global_step"] == 128
    monkeypatch.setattr(Logger, "log", real_log)
    code, err = run_main(capsys, "train", "--resume", tmp_path / "run")
    assert code == 0, err
    rows = (tmp_path / "run" / "metrics.csv").read_text().splitlines()
    assert [r.split(",")[0] for r in rows[1:]] == ["64", "128", "192", "256"]  # the half row is gone


def test_item4_a_worker_killed_mid_run_is_one_error_line_and_the_checkpoint_stays(tmp_path, capsys, monkeypatch):
    import os
    import signal

    import visppo.loop as train_module

    real_collect, calls = train_module.collect_rollout, []

    def kill_a_worker_in_iteration_2(run):
        calls.append(1)
        if len(calls) == 2:
            os.kill(run.envs.processes[1].pid, signal.SIGKILL)
            run.envs.processes[1].join()
        return real_collect(run)

    monkeypatch.setattr(train_module, "collect_rollout", kill_a_worker_in_iteration_2)
    overrides = tiny_overrides(tmp_path, **{"run.checkpoint_every": 1, "env.vector": "async"})
    code, err = run_main(capsys, "train", *overrides)
    assert code == 1
    one_error_line(err, "during step, worker 1 died of signal SIGKILL",
                   f"the run's last checkpoint is kept: once the env is fixed, visppo train --resume {tmp_path / 'run'}")
    assert torch.load(tmp_path / "run" / "checkpoints" / "latest.pt", weights_only=True)["global_step"] == 64


def test_item17_a_sigterm_while_the_run_starts_stops_it_at_once(tmp_path, capsys, monkeypatch):
    import os
    import signal

    import visppo.loop as train_module

    real_make = train_module.make_vector_env

    def sigterm_while_building(cfg):
        os.kill(os.getpid(), signal.SIGTERM)  # delivered here: before the first iteration
        return real_make(cfg)

    monkeypatch.setattr(train_module, "make_vector_env", sigterm_while_building)
    before = signal.getsignal(signal.SIGTERM)
    code, err = run_main(capsys, "train", *tiny_overrides(tmp_path))
    assert code == 143
    assert err.strip() == "visppo: stopped by SIGTERM before the first iteration; no checkpoint was due"
    assert not (tmp_path / "run").exists()
    assert signal.getsignal(signal.SIGTERM) is before, "the handlers are given back"


@pytest.mark.parametrize("where", ["check", "vector"])
def test_item17_a_sigterm_inside_an_env_call_while_the_run_starts_is_a_stop_not_an_env_defect(
        where, tmp_path, capsys, monkeypatch):
    """The signal arrives while the start check's env resets, or while the run's envs first reset:
    the env did nothing wrong, so no 'error: env ...' line and no exit 1 or 2."""
    import os
    import signal

    import visppo.loop as train_module

    def sigterm(reset):
        def reset_then_signal(*args, **kwargs):
            os.kill(os.getpid(), signal.SIGTERM)
            return reset(*args, **kwargs)
        return reset_then_signal

    if where == "check":  # the env's own reset: the start check's is its first call
        from visppo_envs.dot import DotReachEnv

        real_reset = DotReachEnv.reset
        monkeypatch.setattr(DotReachEnv, "reset", lambda self, **kwargs: sigterm(real_reset)(self, **kwargs))
    else:
        real_make_vector = train_module.make_vector_env

        def make_vector(cfg):
            envs = real_make_vector(cfg)
            envs.reset = sigterm(envs.reset)
            return envs

        monkeypatch.setattr(train_module, "make_vector_env", make_vector)
    code, err = run_main(capsys, "train", *tiny_overrides(tmp_path))
    assert (code, err.strip()) == (143, "visppo: stopped by SIGTERM before the first iteration; no checkpoint was due")
    assert not (tmp_path / "run").exists()


# --------------------------------------------------------------------------- fuzz


class _Started(BaseException):
    """Raised instead of the first rollout: the run got through every check and built everything."""


FUZZ_VALUES = [0, -1, 1, 2, 3, 4, 7, 8, 16, 32, 64, 100, 4096, 2.5, 0.5, 0.9, 0.01, -0.0, 1e-300, 1e9, 1e30,
               10**12, 2**70, "1e400", "nan", "-inf", "2e6", "1e12", "1_000", "0x10", "", "x", "auto", "cpu",
               "cuda:9", "off", "on", "sync", "none", "imagenet", "shift", "device", "visppo/DotReach-v0", "%",
               "'", "[", "é", "a=b", "${x}", "\\${x}", None, True, False, [], [1, 2], {}, {"a": 1}]
FUZZ_KEYS = ["ppo.nope", "nosection.key", "ppo", "env", "env.kwargs.foo", "env.kwargs", "a.b.c", "", "ppo.", ".x"]


def _fuzz_case(rng, tmp: Path, i: int, keys: list[str]) -> list[str]:
    """A random `visppo train` command line: random keys (known and not) with values of random
    types as overrides or in a YAML file, random bytes as the YAML file, or a valid file mutated."""
    import yaml

    pairs = [(rng.choice(keys), rng.choice(FUZZ_VALUES)) for _ in range(rng.randint(1, 3))]
    base = tiny_overrides(tmp / f"run{i}")
    mode, path = rng.choice(["overrides", "yaml", "bytes", "mutated"]), tmp / f"c{i}.yaml"
    if mode == "overrides":
        return ["train", *base, *[f"{k}={v}" for k, v in pairs]]
    if mode == "yaml":
        data: dict = {}
        for key, value in pairs:
            *sections, name = key.split(".")
            node = data
            for section in sections:
                node = node.setdefault(section, {}) if isinstance(node.get(section, {}), dict) else {}
            node[name] = value
        path.write_text(yaml.safe_dump(data))
    elif mode == "bytes":
        path.write_bytes(bytes(rng.randrange(256) for _ in range(rng.randint(0, 200))))
    else:
        text = bytearray(b"ppo:\n  num_envs: 2\n  gamma: 0.99\nenv:\n  id: visppo/DotReach-v0\n  image_size: 48\n")
        for _ in range(rng.randint(1, 4)):
            text[rng.randrange(len(text))] = rng.choice(b"\x00\xff:-[]{}&*!|>'\"#\n \t0123456789abc")
        path.write_bytes(bytes(text))
    return ["train", str(path), *base]


@pytest.mark.timeout(300)
def test_fuzz_every_config_starts_a_run_or_is_one_error_line(tmp_path, capsys, monkeypatch):
    """Random configs: each either starts a run (everything built, stopped before the first rollout)
    or exits 2 with one `error:` line; never a traceback, a hang or another exit code."""
    import random

    import visppo.loop as train_module
    from visppo.config import field_docs

    def started(run):
        raise _Started

    monkeypatch.setattr(train_module, "collect_rollout", started)
    rng, outcomes, threads = random.Random(17), {"started": 0, "refused": 0}, torch.get_num_threads()
    keys = [k for k in field_docs() if k != "run.dir"] + FUZZ_KEYS  # run.dir: not outside tmp_path
    for i in range(150):
        args = _fuzz_case(rng, tmp_path, i, keys)
        try:
            code, err = run_main(capsys, *args)
        except _Started:
            outcomes["started"] += 1
            capsys.readouterr()  # the started run's progress bar: not the next case's stderr
            continue
        finally:
            torch.set_num_threads(threads)  # train.threads may have been fuzzed
        assert code == 2, (args, err)
        one_error_line(err)
        outcomes["refused"] += 1
    assert outcomes["started"] >= 5 and outcomes["refused"] >= 50, outcomes


# --------------------------------------------------------------------------- further bad input found while fixing these


def test_plot_into_a_directory_and_resume_of_a_file_are_refused(run_copy, capsys, tmp_path):
    code, err = run_main(capsys, "plot", run_copy, "--out", tmp_path)
    assert code == 2  # it used to write <dir>.png beside the directory
    one_error_line(err, "is a directory", "curves.png")
    assert not tmp_path.with_suffix(".png").exists()
    code, err = run_main(capsys, "train", "--resume", run_copy / "config.yaml")
    assert code == 2
    one_error_line(err, "is a file", f"({run_copy})")


@pytest.mark.parametrize("overrides,text,needle", [
    (["train.threads=1e9"], None, "train.threads must be at most 1024"),  # torch aborted the process
    (["train.seed=1e12"], None, "train.seed must be in 0 .. 2**31 - 1"),  # numpy's traceback
    (["train.seed=-1"], None, "train.seed must be in 0 .. 2**31 - 1"),
    (["model.feature_dim=%"], None, "cannot parse override 'model.feature_dim=%'"),  # was three lines
    ([], "ppo: 5\n", "'ppo' in"),  # OmegaConf's "int is not a subclass of PPOConfig"
    ([], "env: [1, 2]\n", "must be a section of keys"),
    (["run.dir=/data/${USER}/run"], None, "'run.dir': Interpolation key 'USER' not found"),  # a traceback
    ([r"run.wandb_name=\${x}"], None, "run.wandb_name='${x}': a '${' in a value"),  # failed at the 1st save
    ([], "env:\n  kwargs:\n    look: \\${x}\n", "env.kwargs.look='${x}'"),
])
def test_more_config_values_are_one_line(tmp_path, capsys, overrides, text, needle):
    args = list(overrides)
    if text is not None:
        (tmp_path / "c.yaml").write_text(text)
        args.insert(0, tmp_path / "c.yaml")
    code, err = run_main(capsys, "config", *args)
    assert code == 2
    one_error_line(err, needle)


def test_yaml_merge_keys_and_empty_sections_still_load(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("ppo:\n  <<: {num_envs: 2, num_steps: 32}\n  num_envs: 4\nmodel:\n")
    cfg = load_config(path)
    assert (cfg.ppo.num_envs, cfg.ppo.num_steps) == (4, 32)
